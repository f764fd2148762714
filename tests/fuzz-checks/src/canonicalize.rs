//! The filter's body parser: `scorer_core::canon::canonicalize` on arbitrary bytes, then block
//! hashing. Beyond "never panics", it checks the properties routing relies on: the result is
//! deterministic, hashes cover exactly the full blocks, and a chat, Messages or Responses body's
//! canonical bytes with its last message (input item) dropped are a byte prefix of the full
//! body's (turn N is a prefix of N+1). And the hand reader of plain chat bodies reads every
//! body as serde does (`canonicalize_with_serde`).

use scorer_core::canon::{canonicalize, canonicalize_with_serde};
use scorer_core::hash::{DEFAULT_BLOCK_BYTES, block_hashes, request_seed};
use scorer_core::protocol::ApiKind;
use serde_json::Value;

/// The target's body: what one fuzz input must satisfy.
pub fn check(input: &[u8]) {
    let Some((&selector, body)) = input.split_first() else {
        return;
    };
    let api = match selector & 3 {
        0 => ApiKind::Chat,
        1 => ApiKind::Completion,
        2 => ApiKind::Responses,
        _ => ApiKind::Messages,
    };
    let block = match selector >> 2 {
        0 => DEFAULT_BLOCK_BYTES,
        n => usize::from(n),
    };
    let read = canonicalize(api, body);
    assert_eq!(
        read,
        canonicalize_with_serde(api, body),
        "read apart from serde"
    );
    let Ok(prompt) = read else {
        return;
    };
    assert_eq!(
        canonicalize(api, body).as_ref(),
        Ok(&prompt),
        "not deterministic"
    );
    let tokens = prompt.estimated_tokens();
    assert!(tokens as usize >= prompt.bytes.len() / 4);
    assert_ne!(
        prompt.cache_salt.as_deref(),
        Some(""),
        "vLLM refuses an empty salt"
    );
    let seed = request_seed(&prompt.model, prompt.cache_salt.as_deref());
    let hashes = block_hashes(seed, &prompt.bytes, block);
    assert_eq!(hashes.len(), prompt.bytes.len() / block);
    // Chained: the hashes of a prefix are a prefix of the hashes.
    let half = hashes.len() / 2;
    assert_eq!(
        block_hashes(seed, &prompt.bytes[..half * block], block),
        hashes[..half]
    );

    match api {
        ApiKind::Chat | ApiKind::Messages => prefix_property(api, "messages", body),
        ApiKind::Responses => prefix_property(api, "input", body),
        ApiKind::Completion => {}
    }
}

/// Dropping the last entry of a valid body's `list` (messages, input items) yields a canonical
/// prefix.
fn prefix_property(api: ApiKind, list: &str, body: &[u8]) {
    let Ok(Value::Object(mut full)) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    let Some(Value::Array(messages)) = full.get(list).cloned() else {
        return;
    };
    if messages.is_empty() {
        return;
    }
    let full_bytes = serde_json::to_vec(&full).expect("a Value serialises");
    let Ok(whole) = canonicalize(api, &full_bytes) else {
        return;
    };
    full.insert(
        list.into(),
        Value::Array(messages[..messages.len() - 1].to_vec()),
    );
    let prefix_bytes = serde_json::to_vec(&full).expect("a Value serialises");
    let prefix = canonicalize(api, &prefix_bytes)
        .expect("a valid body minus its last message is still valid");
    assert_eq!(prefix.model, whole.model);
    assert!(
        whole.bytes.starts_with(&prefix.bytes),
        "turn N is not a prefix of turn N+1:\n{:?}\n{:?}",
        String::from_utf8_lossy(&prefix.bytes),
        String::from_utf8_lossy(&whole.bytes)
    );
}
