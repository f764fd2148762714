//! vllm-sim's chat templates render what HF transformers' `apply_chat_template` renders, byte
//! for byte, on the golden fixtures in `control-plane/vllm-wire/fixtures/chat_templates/`
//! (made by `scripts/gen_chat_template_fixtures.py`; committed, so no Python is needed here).
//!
//! vllm-sim's [`ChatMessage`] carries a role and a text only: cases with tools, tool calls,
//! other message fields or extra template variables are not expressible through its API and
//! are listed in [`NOT_EXPRESSIBLE`], so a new case cannot be skipped silently.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::Value;
use vllm_sim::tokenizer::{CHATML_JINJA, ChatMessage, ChatMl, ChatTemplate, JinjaTemplate};

/// Cases the `ChatMessage` API cannot carry (tools, tool calls, `null` fields, kwargs).
const NOT_EXPRESSIBLE: &[&str] = &[
    "header_style/kwargs_date",
    "python_methods/tools",
    "tools/calls_and_results",
    "tools/calls_no_generation_prompt",
    "tools/definitions",
    "tools/null_tool_calls",
];

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../control-plane/vllm-wire/fixtures/chat_templates")
}

fn load() -> Value {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The messages as `ChatMessage`s, or `None` when they carry more than a role and a text.
fn chat_messages(case: &Value) -> Option<Vec<ChatMessage>> {
    if !case["tools"].is_null() || case["kwargs"].as_object().is_some_and(|k| !k.is_empty()) {
        return None;
    }
    // A content-parts case is rendered from the flattened messages vLLM's server hands on.
    let messages = case.get("rendered_from").unwrap_or(&case["messages"]);
    messages
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let m = m.as_object().unwrap();
            if m.keys().any(|k| k != "role" && k != "content") {
                return None;
            }
            Some(ChatMessage {
                role: m.get("role")?.as_str()?.to_owned(),
                content: m.get("content")?.as_str()?.to_owned(),
            })
        })
        .collect()
}

/// `rendered` as the server ends it: cut after the final message's text when the case
/// continues it (`continue_final_message`, vllm-wire's cut, as the server applies it).
fn continued(
    case: &Value,
    messages: &[ChatMessage],
    rendered: Result<String, vllm_sim::SimError>,
) -> Result<String, String> {
    let rendered = rendered.map_err(|e| e.to_string())?;
    if case["continue_final_message"] != true {
        return Ok(rendered);
    }
    let last = messages.last().map_or("", |m| m.content.as_str());
    vllm_wire::chat_template::cut_after_final_message(&rendered, last)
        .ok_or_else(|| "the final message does not appear".to_string())
}

/// Whether `rendered` is what transformers produced: the same text, or an error carrying its
/// message.
fn matches(case: &Value, rendered: &Result<String, String>) -> bool {
    match (rendered, case.get("expected"), case.get("expected_error")) {
        (Ok(text), Some(Value::String(want)), _) => text == want,
        (Err(e), None, Some(Value::String(want))) => e.contains(want.as_str()),
        _ => false,
    }
}

/// Every expressible case renders exactly like transformers through `JinjaTemplate`, except
/// the cases the fixture marks as known `vllm_sim` differences, which must still differ (so a
/// fix is noticed and the mark removed); the non-expressible cases are exactly the listed ones.
#[test]
fn jinja_template_matches_transformers() {
    let doc = load();
    let mut skipped = BTreeSet::new();
    let mut differing = BTreeSet::new();
    let mut known = BTreeSet::new();
    let mut checked = 0;
    for case in doc["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        if case["known_difference"].get("vllm_sim").is_some() {
            known.insert(name);
        }
        let Some(messages) = chat_messages(case) else {
            skipped.insert(name);
            continue;
        };
        let template = &doc["templates"][case["template"].as_str().unwrap()];
        let source =
            std::fs::read_to_string(fixtures().join(template["file"].as_str().unwrap())).unwrap();
        let t = JinjaTemplate::new(
            &source,
            case["bos_token"].as_str().unwrap(),
            case["eos_token"].as_str().unwrap(),
        )
        .unwrap();
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = continued(case, &messages, t.render(&messages, agp));
        checked += 1;
        if !matches(case, &rendered) {
            eprintln!(
                "{name}: differs from transformers\n  want {:?}\n  got  {rendered:?}",
                case.get("expected").or(case.get("expected_error"))
            );
            differing.insert(name);
        }
    }
    assert_eq!(
        differing, known,
        "cases differing from transformers vs. known differences"
    );
    assert_eq!(
        skipped,
        NOT_EXPRESSIBLE.iter().copied().collect(),
        "not expressible"
    );
    assert!(checked >= 15, "only {checked} cases checked");
}

/// The shipped `chatml.jinja` is vllm-sim's `CHATML_JINJA` byte for byte, and the built-in
/// [`ChatMl`] renders every ChatML case like transformers too (it is the default template).
#[test]
fn chatml_fixture_is_the_shipped_template() {
    let file = std::fs::read_to_string(fixtures().join("chatml.jinja")).unwrap();
    assert_eq!(file, CHATML_JINJA);
    let doc = load();
    let mut n = 0;
    for case in doc["cases"].as_array().unwrap() {
        if case["template"] != "chatml" {
            continue;
        }
        let messages = chat_messages(case).unwrap();
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = continued(case, &messages, ChatMl.render(&messages, agp));
        assert!(matches(case, &rendered), "{}: {rendered:?}", case["name"]);
        n += 1;
    }
    assert!(n >= 4, "{n} ChatML cases");
}
