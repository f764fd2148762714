//! Precise mode's agent converters, `vllm_wire::agent_chat`, on arbitrary bytes read as the
//! prompt fields the filter forwards: an Anthropic Messages prompt (with the inline-system rule
//! unknown, merging and not merging) and an OpenAI Responses prompt. Beyond "never panics", it
//! checks that a converted prompt is a chat prompt (a `messages` array of objects with a string
//! role), that knowing the template's rule changes nothing when `None` already converted,
//! that a merging template gets its system message first only, and that `python_json` writes
//! ASCII JSON that reads back as the same value (what `json.dumps` gives the template). The
//! server's side (vllm-sim converts with `Converter::Server`) converts whatever the router's
//! converts, to the same messages, and `python_repr` never panics.

use serde_json::{Map, Value};
use vllm_wire::agent_chat::{
    Converter, anthropic_chat_messages, messages_to_chat, python_json, python_repr,
    responses_to_chat,
};

/// The target's body: what one fuzz input must satisfy.
pub fn check(input: &[u8]) {
    let Ok(value) = serde_json::from_slice::<Value>(input) else {
        return;
    };
    python_json_round_trips(&value);
    let Value::Object(prompt) = value else {
        return;
    };

    let unknown = messages_to_chat(&prompt, None);
    let merged = messages_to_chat(&prompt, Some(true));
    let inline = messages_to_chat(&prompt, Some(false));
    for chat in [&unknown, &merged, &inline].into_iter().flatten() {
        check_chat(chat);
    }
    if let Ok(chat) = &unknown {
        // `None` refuses only what the rule decides: what it converts, both rules convert alike.
        assert_eq!(
            merged.as_ref(),
            Ok(chat),
            "merging changed a prompt None took"
        );
        assert_eq!(
            inline.as_ref(),
            Ok(chat),
            "not merging changed a prompt None took"
        );
    }
    // The serving process decides what a router refuses; where the router converted, both
    // agree message for message.
    for (rule, router) in [(true, &merged), (false, &inline)] {
        let server = anthropic_chat_messages(&prompt, rule, Converter::Server { unix_now_s: 7 });
        if let Ok(chat) = router {
            let server = server.expect("the server refused what the router converted");
            assert_eq!(
                messages(chat),
                server.as_slice(),
                "router and server differ"
            );
        }
    }
    let _ = python_repr(&Value::Object(prompt.clone()));
    if let Ok(chat) = &merged {
        let later_system = messages(chat)
            .iter()
            .skip(1)
            .any(|m| m.get("role").and_then(Value::as_str) == Some("system"));
        assert!(
            !later_system,
            "a merging template got a system message after the first"
        );
    }

    if let Ok(chat) = responses_to_chat(&prompt) {
        check_chat(&chat);
    }
}

/// A converted prompt is a chat prompt, and its `json.dumps` form is sound.
fn check_chat(chat: &Map<String, Value>) {
    for m in messages(chat) {
        assert!(
            m.get("role").is_some_and(Value::is_string),
            "a chat message without a string role: {m}"
        );
    }
    python_json_round_trips(&Value::Object(chat.clone()));
}

fn messages(chat: &Map<String, Value>) -> &[Value] {
    match chat.get("messages") {
        Some(Value::Array(messages)) => messages,
        other => panic!("a converted prompt without a messages array: {other:?}"),
    }
}

/// `python_json` is `json.dumps` with `ensure_ascii`: ASCII only, and JSON that reads back as
/// the value written (floats in Python's repr still name the same double).
fn python_json_round_trips(value: &Value) {
    let text = python_json(value);
    assert!(text.is_ascii(), "json.dumps output is ASCII: {text}");
    let back: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("python_json wrote invalid JSON ({e}): {text}"));
    assert_eq!(&back, value, "python_json does not read back: {text}");
}
