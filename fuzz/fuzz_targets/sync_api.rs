//! The sync protocol, from both ends: `POST /v1/sync` bodies a proxy sends (raw bytes, or
//! well-formed reports with arbitrary decisions and outcomes, written as the copy would: hash
//! lists in base64 once its control plane said it reads them) served by the control plane's
//! side (`serve_sync` on a `Router` and a small `SyncLog`), and the answers a proxy applies
//! (`LocalRouter::apply`, raw bytes or the control plane's own answers), and the shared
//! stream of active-active control planes (the log switched to stream numbering, raw bytes as a
//! message's entries at an arbitrary stream position). Invariants: nothing
//! panics; the log never holds more than its bound; an answer's `next` never goes backwards
//! for a replica; a local copy only ever routes to endpoints the control plane named, and a
//! copy fed only the control plane's answers (whole tables or deltas) holds exactly its
//! endpoints, and their model catalogues, after each.
//!
//! The check is `kvroute_fuzz_checks::sync_api` (tests/fuzz-checks), which `cargo test`
//! also runs on this target's seed corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_checks::sync_api::check(data));
