//! The router's chat-template rendering (precise mode, `HfTokenizer::render`) against golden
//! fixtures made by HF transformers' own `apply_chat_template`
//! (`scripts/gen_chat_template_fixtures.py`; committed in
//! `vllm-wire/fixtures/chat_templates/`, so no Python is needed here). Every case is rendered,
//! tools, tool calls and `chat_template_kwargs` included, from the request fields as JSON
//! text, the way the filter hands them to the control plane.

// An integration test: its helpers may unwrap (the product's ban is for product code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![cfg(feature = "hf-tokenizer")]

use std::collections::BTreeSet;
use std::path::PathBuf;

use control_plane::tokenize::hf::HfTokenizer;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// A word-level `tokenizer.json` with no added tokens: rendering does not depend on it.
const TOKENIZER_JSON: &str = r#"{"version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [], "normalizer": null, "pre_tokenizer": null, "post_processor": null,
    "decoder": null, "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}}"#;

/// One fixture case; the request fields stay raw JSON text so their key order is the client's.
#[derive(Deserialize)]
struct Case<'a> {
    name: String,
    template: String,
    bos_token: String,
    eos_token: String,
    #[serde(borrow)]
    messages: &'a RawValue,
    #[serde(borrow)]
    tools: &'a RawValue,
    #[serde(borrow)]
    kwargs: &'a RawValue,
    add_generation_prompt: bool,
    #[serde(default)]
    continue_final_message: bool,
    expected: Option<String>,
    expected_error: Option<String>,
    #[serde(default)]
    known_difference: Map<String, Value>,
}

#[derive(Deserialize)]
struct Fixture<'a> {
    templates: Map<String, Value>,
    #[serde(borrow)]
    cases: Vec<Case<'a>>,
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("vllm-wire/fixtures/chat_templates")
}

/// The prompt fields of a chat request, parsed as `tokenize::Tokenizers::tokenize` parses
/// what the filter sends.
fn prompt(case: &Case<'_>) -> Map<String, Value> {
    let mut text = format!(
        r#"{{"messages":{},"add_generation_prompt":{}"#,
        case.messages.get(),
        case.add_generation_prompt
    );
    if case.tools.get() != "null" {
        text.push_str(&format!(r#","tools":{}"#, case.tools.get()));
    }
    if case.kwargs.get() != "{}" {
        text.push_str(&format!(r#","chat_template_kwargs":{}"#, case.kwargs.get()));
    }
    if case.continue_final_message {
        text.push_str(r#","continue_final_message":true"#);
    }
    text.push('}');
    serde_json::from_str(&text).unwrap()
}

/// Every case renders exactly like transformers (for a rejected conversation: an error that
/// carries transformers' message), except the cases the fixture marks as known `router`
/// differences, which must still differ so a fix is noticed and the mark removed.
#[test]
fn router_renders_like_transformers() {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
    let doc: Fixture<'_> = serde_json::from_str(&text).unwrap();
    let mut differing = BTreeSet::new();
    let mut known = BTreeSet::new();
    for case in &doc.cases {
        if case.known_difference.contains_key("router") {
            known.insert(case.name.as_str());
        }
        let file = doc.templates[&case.template]["file"].as_str().unwrap();
        let source = std::fs::read_to_string(fixtures().join(file)).unwrap();
        let t = HfTokenizer::new(
            TOKENIZER_JSON.as_bytes(),
            Some(&source),
            &case.bos_token,
            &case.eos_token,
            16,
        )
        .unwrap();
        let rendered = t.render(&prompt(case)).map_err(|e| e.to_string());
        let ok = match (&rendered, &case.expected, &case.expected_error) {
            (Ok(got), Some(want), _) => got == want,
            (Err(e), None, Some(want)) => e.contains(want.as_str()),
            _ => false,
        };
        if !ok {
            eprintln!(
                "{}: differs from transformers\n  want {:?}\n  got  {rendered:?}",
                case.name,
                case.expected.as_ref().or(case.expected_error.as_ref())
            );
            differing.insert(case.name.as_str());
        }
    }
    assert_eq!(
        differing, known,
        "cases differing from transformers vs. known differences"
    );
    assert!(doc.cases.len() >= 20, "{} cases", doc.cases.len());
}
