//! Every Envoy configuration we ship must be accepted by the Envoy we run (`envoy --mode
//! validate`), after rendering its placeholders with test values. A missing Envoy fails the test.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use kvroute_harness::{
    self as harness, ENVOY_KVROUTE_TEMPLATE, ENVOY_MODULE_FILTER, eds_file_json, envoy_base_id,
    locate_envoy, locate_envoy_module, locate_wasm, plugin_config_json, render_envoy_config,
    swap_in_envoy_module, write_atomically,
};

/// The Envoy bootstrap files in `envoy-config/` (templates included).
fn shipped_configs() -> Vec<PathBuf> {
    let dir = harness::workspace_root().join("envoy-config");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_shipped_envoy_config_validates() {
    let envoy = locate_envoy().unwrap_or_else(|e| panic!("{e}"));
    let wasm = locate_wasm().unwrap_or_else(|e| panic!("{e}"));
    let configs = shipped_configs();
    assert!(
        configs.len() >= 2,
        "expected envoy-demo.yaml and envoy-roundrobin.yaml, found {configs:?}"
    );
    let out_dir = harness::target_dir()
        .join("e2e-logs")
        .join("envoy-validate");
    std::fs::create_dir_all(&out_dir).expect("creating the output directory");
    let replicas = vec!["127.0.0.1:18001".to_string(), "127.0.0.1:18002".to_string()];
    let plugin = plugin_config_json(&serde_json::json!({"auth_token": "s3cr\"et"}));
    // envoy-file-discovery.yaml reads its hosts from an EDS file.
    let eds_path = out_dir.join("vllm-eds.json");
    write_atomically(&eds_path, &eds_file_json("vllm", &replicas, 1).unwrap()).unwrap();
    let eds_vars = [
        ("EDS_PATH", eds_path.display().to_string()),
        ("EDS_DIR", out_dir.display().to_string()),
    ];
    let mut failures = Vec::new();
    // Every bootstrap, then envoy-demo.yaml with the dynamic module's HTTP filter entry in
    // place of the wasm one, loading the module this build made.
    let module_entry = harness::workspace_root().join(ENVOY_MODULE_FILTER);
    let demo = harness::workspace_root().join(ENVOY_KVROUTE_TEMPLATE);
    let checks = configs
        .iter()
        .map(|c| (c, c))
        .chain(std::iter::once((&module_entry, &demo)));
    for (config, template) in checks {
        let module = *config == module_entry;
        let mut rendered = render_envoy_config(
            template, 19_000, 19_001, 19_002, &wasm, &plugin, &replicas, &eds_vars,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let mut cmd = Command::new(&envoy);
        if module {
            rendered = swap_in_envoy_module(&rendered, &plugin).unwrap_or_else(|e| panic!("{e}"));
            let so = locate_envoy_module().unwrap_or_else(|e| panic!("{e}"));
            cmd.env(
                "ENVOY_DYNAMIC_MODULES_SEARCH_PATH",
                so.parent().expect("the module's directory"),
            );
        }
        let name = config.file_name().map(|n| n.to_string_lossy().into_owned());
        let path = out_dir.join(name.unwrap_or_else(|| "config.yaml".into()));
        std::fs::write(&path, rendered).expect("writing the rendered config");
        let (ok, text) = validate(cmd, &path);
        if !ok {
            failures.push(format!(
                "{} (rendered at {}):\n{text}",
                config.display(),
                path.display(),
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "envoy rejected:\n{}",
        failures.join("\n")
    );
}

/// Runs `envoy --mode validate` (`cmd` is Envoy with its environment) on the configuration at
/// `path`: whether Envoy accepted it, and what it printed.
fn validate(mut cmd: Command, path: &std::path::Path) -> (bool, String) {
    let mut child = cmd
        .args(["--mode", "validate", "-l", "warning"])
        .args([
            "--base-id",
            &envoy_base_id().to_string(),
            "--use-dynamic-base-id",
        ])
        .arg("-c")
        .arg(path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawning envoy");
    let started = Instant::now();
    while child.try_wait().expect("waiting for envoy").is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("collecting envoy output");
    let text = crate::common::output_text(&out);
    (out.status.success() && text.contains(" OK"), text)
}

// A plugin configuration the dynamic module cannot read makes Envoy reject the filter, and
// Envoy's log says why in the module's words (the wasm filter fails open instead, with
// `FAIL_OPEN`; a dynamic module has no such policy).
#[test]
fn the_dynamic_module_rejects_a_bad_configuration_with_its_reason() {
    let envoy = locate_envoy().unwrap_or_else(|e| panic!("{e}"));
    let wasm = locate_wasm().unwrap_or_else(|e| panic!("{e}"));
    let so = locate_envoy_module().unwrap_or_else(|e| panic!("{e}"));
    let out_dir = harness::target_dir()
        .join("e2e-logs")
        .join("envoy-validate");
    std::fs::create_dir_all(&out_dir).expect("creating the output directory");
    let replicas = vec!["127.0.0.1:18001".to_string()];
    let plugin = r#"{"decision": "sometimes"}"#;
    let demo = harness::workspace_root().join(ENVOY_KVROUTE_TEMPLATE);
    let rendered =
        render_envoy_config(&demo, 19_000, 19_001, 19_002, &wasm, plugin, &replicas, &[])
            .unwrap_or_else(|e| panic!("{e}"));
    let rendered = swap_in_envoy_module(&rendered, plugin).unwrap_or_else(|e| panic!("{e}"));
    let path = out_dir.join("bad-module-config.yaml");
    std::fs::write(&path, rendered).expect("writing the rendered config");
    let mut cmd = Command::new(&envoy);
    cmd.env(
        "ENVOY_DYNAMIC_MODULES_SEARCH_PATH",
        so.parent().expect("the module's directory"),
    );
    let (ok, text) = validate(cmd, &path);
    assert!(!ok, "Envoy accepted a bad module configuration:\n{text}");
    assert!(
        text.contains("kvroute:") && text.contains("`sometimes`"),
        "Envoy's log does not say what is wrong:\n{text}"
    );
}
