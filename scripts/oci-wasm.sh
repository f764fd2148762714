#!/usr/bin/env bash
# Package a proxy-wasm module as an OCI image layout tarball, without Docker.
#
#   scripts/oci-wasm.sh WASM OUT.tar [NAME:TAG]
#
# The image is the "oci" variant of the Wasm image spec that Istio (WasmPlugin, and ECDS
# configs fetched by istio-agent) and Envoy Gateway (EnvoyExtensionPolicy code.type Image)
# accept: a manifest with exactly two layers, the runtime config JSON
# (application/vnd.module.wasm.config.v1+json) and the raw module
# (application/vnd.module.wasm.content.layer.v1+wasm); the same config blob is the manifest's
# config. Both fetchers require two layers and pick the one with the wasm media type.
#
# Output: an OCI image layout (oci-layout, index.json, blobs/sha256/*) as a reproducible tar
# (sorted names, mtime 0, uid/gid 0). Push it with any OCI tool, e.g.
#   skopeo copy oci-archive:target/oci/kvroute-filter.oci.tar docker://REGISTRY/kvroute-filter:TAG
#   mkdir layout && tar -xf OUT.tar -C layout && oras cp --from-oci-layout layout:TAG REGISTRY/kvroute-filter:TAG
# The manifest digest it prints is what WasmPlugin.spec.sha256 / EnvoyExtensionPolicy
# code.image.sha256 must be (both compare against the image manifest digest), or pin the URL
# as REGISTRY/kvroute-filter@sha256:DIGEST.
set -euo pipefail

die() { echo "oci-wasm: $*" >&2; exit 1; }

[[ $# -ge 2 && $# -le 3 ]] || die "usage: $0 WASM OUT.tar [NAME:TAG]"
wasm=$1
out=$2
ref=${3:-kvroute-filter:latest}
tag=${ref##*:}
[[ "$ref" == *:* && -n "$tag" && "$tag" != "$ref" ]] || die "reference must be NAME:TAG, got '$ref'"
[[ "$tag" =~ ^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$ ]] || die "invalid tag '$tag'"
[[ -f "$wasm" ]] || die "no such file: $wasm (build it with 'make wasm')"
# Refuse anything that is not a wasm binary module (magic \0asm, version 1).
magic=$(head -c 8 "$wasm" | od -An -tx1 | tr -d ' \n')
[[ "$magic" == "0061736d01000000" ]] || die "$wasm is not a WebAssembly binary module"
for tool in sha256sum tar od; do command -v "$tool" >/dev/null || die "needs '$tool'"; done

layout=$(mktemp -d)
trap 'rm -rf "$layout"' EXIT
blobs="$layout/blobs/sha256"
mkdir -p "$blobs"

# Stores stdin or a file as a blob; prints "<hex> <size>".
put_blob() {
    local src=$1 tmp hex size
    tmp="$layout/blob.tmp"
    cat "$src" >"$tmp"
    hex=$(sha256sum "$tmp" | cut -d' ' -f1)
    size=$(wc -c <"$tmp" | tr -d ' ')
    mv "$tmp" "$blobs/$hex"
    echo "$hex $size"
}

read -r wasm_hex wasm_size < <(put_blob "$wasm")

# Runtime config of the Wasm image spec: proxy-wasm ABI 0.2.1 (what the Rust SDK exports) and
# the root_id the module registers (`kvroute`).
config_json='{"type":"envoy_proxy","abiVersions":["v0.2.1"],"config":{"root_ids":["kvroute"]}}'
read -r cfg_hex cfg_size < <(put_blob <(printf '%s' "$config_json"))

created="1970-01-01T00:00:00Z"
manifest_json=$(printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.module.wasm.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.module.wasm.config.v1+json","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.title":"runtime-config.json"}},{"mediaType":"application/vnd.module.wasm.content.layer.v1+wasm","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.title":"plugin.wasm"}}],"annotations":{"org.opencontainers.image.created":"%s","org.opencontainers.image.title":"kvroute proxy-wasm filter"}}' \
    "$cfg_hex" "$cfg_size" "$cfg_hex" "$cfg_size" "$wasm_hex" "$wasm_size" "$created")
read -r man_hex man_size < <(put_blob <(printf '%s' "$manifest_json"))

printf '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.ref.name":"%s","io.containerd.image.name":"%s"}}]}' \
    "$man_hex" "$man_size" "$tag" "$ref" >"$layout/index.json"

mkdir -p "$(dirname "$out")"
tar --create --file "$out.tmp" --directory "$layout" --format=ustar \
    --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --mode=u=rwX,go=rX \
    oci-layout index.json blobs
mv "$out.tmp" "$out"

echo "wrote $out ($ref)"
echo "manifest digest: sha256:$man_hex"
echo "wasm layer:      sha256:$wasm_hex ($wasm_size bytes)"
