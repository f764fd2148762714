//! Precise mode's agent converters, `vllm_wire::agent_chat`, on arbitrary bytes read as the
//! prompt fields the filter forwards: an Anthropic Messages prompt (with the inline-system rule
//! unknown, merging and not merging) and an OpenAI Responses prompt. Beyond "never panics", it
//! checks that a converted prompt is a chat prompt (a `messages` array of objects with a string
//! role), that knowing the template's rule changes nothing when `None` already converted,
//! that a merging template gets its system message first only, and that `python_json` writes
//! ASCII JSON that reads back as the same value (what `json.dumps` gives the template). The
//! server's side (vllm-sim converts with `Converter::Server`) converts whatever the router's
//! converts, to the same messages, and `python_repr` never panics.
//!
//! The check is `kvroute_fuzz_checks::agent_chat` (tests/fuzz-checks), which `cargo test`
//! also runs on this target's seed corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_checks::agent_chat::check(data));
