//! What each fuzz target checks, one module per target of `fuzz/` with a `check(&[u8])` that
//! panics when an input breaks what the code under test promises.
//!
//! The targets themselves are one line each (`fuzz_target!(|data: &[u8]| check(data))`), built
//! by cargo-fuzz with sanitizers in their own workspace; `scripts/fuzz.sh` runs them. Here the
//! same checks are plain Rust, so `cargo test` replays every committed seed corpus
//! (`fuzz/corpus/<target>/`) through them natively (`seed_corpora` below): a check that
//! drifts from the code it checks fails `make test`, not only a fuzzing session someone has to
//! remember to run. Structured targets build their input from the bytes as libFuzzer's
//! `fuzz_target!` does (`Arbitrary::arbitrary_take_rest`), so corpora carry over.

pub mod agent_chat;
pub mod canonicalize;
pub mod event_sources;
pub mod filter_config;
pub mod filter_machine;
pub mod kv_events;
pub mod models_list;
pub mod prom_parser;
pub mod response_usage;
pub mod route_api;
pub mod sync_api;

/// A target's check: returns on an input that keeps every promise, panics on one that does not.
pub type Check = fn(&[u8]);

/// A structured target's input built from the bytes as libFuzzer's `fuzz_target!` builds it
/// (`arbitrary_take_rest`), handed to `check`; bytes that build none are skipped, as there.
fn structured<T: for<'a> arbitrary::Arbitrary<'a>>(data: &[u8], check: impl FnOnce(T)) {
    if let Ok(input) = T::arbitrary_take_rest(arbitrary::Unstructured::new(data)) {
        check(input);
    }
}

/// The targets by name (as `fuzz/Cargo.toml` and `fuzz/corpus/` name them), with their checks.
pub const TARGETS: [(&str, Check); 11] = [
    ("agent_chat", agent_chat::check),
    ("canonicalize", canonicalize::check),
    ("event_sources", event_sources::check),
    ("filter_config", filter_config::check),
    ("filter_machine", filter_machine::check),
    ("kv_events", kv_events::check),
    ("models_list", models_list::check),
    ("prom_parser", prom_parser::check),
    ("response_usage", response_usage::check),
    ("route_api", route_api::check),
    ("sync_api", sync_api::check),
];

#[cfg(test)]
mod seed_corpora {
    // Every committed seed corpus through its target's check, natively: the seeds are the inputs
    // someone chose (regressions among them), and a check that no longer holds on them fails here.

    use std::path::Path;

    use super::TARGETS;

    #[test]
    fn every_seed_passes_its_targets_check() {
        let corpora = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
        for (target, check) in TARGETS {
            let dir = corpora.join(target);
            let mut seeds: Vec<_> = std::fs::read_dir(&dir)
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .map(|entry| entry.unwrap().path())
                .collect();
            seeds.sort();
            assert!(!seeds.is_empty(), "{target} has no seed corpus");
            for seed in seeds {
                let bytes = std::fs::read(&seed).unwrap();
                let outcome = std::panic::catch_unwind(|| check(&bytes));
                assert!(
                    outcome.is_ok(),
                    "{target}: {} fails its check",
                    seed.display()
                );
            }
        }
    }

    #[test]
    fn every_fuzz_target_has_a_check() {
        let targets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/fuzz_targets");
        let mut names: Vec<String> = std::fs::read_dir(&targets)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter_map(|p| Some(p.file_stem()?.to_str()?.to_owned()))
            .collect();
        names.sort();
        let checked: Vec<&str> = TARGETS.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, checked);
    }
}
