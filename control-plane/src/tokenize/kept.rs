//! The prompts of recent precise decisions, kept so that `/debug/mismatch` can show, for a
//! request that delivered less than the index believed, the router's and the engine's token
//! ids of the block where the two views of its prompt part (issue #18 point 3).
//!
//! A precise route's prompt is tokenised by the control plane (the router's view); the engine
//! renders it with its own template and tokenizer. Where an engine delivered fewer cached
//! blocks than the index believed, either the engine lost the blocks (eviction: both views
//! agree on the block's tokens) or it never had them as the router hashed them (another
//! template, tokenizer or normalisation: the views differ from that block on). Asking the
//! serving replica's render API for the same prompt tells the two apart. Memory is bounded:
//! the newest [`MAX_KEPT`] prompts within [`MAX_KEPT_BYTES`]; an older decision's record says
//! its prompt is no longer kept.

use parking_lot::Mutex;
use scorer_core::protocol::ApiKind;
use serde::Serialize;
use serde_json::{Map, Value};
use std::collections::{HashMap, VecDeque};

/// Most prompts kept.
pub const MAX_KEPT: usize = 256;
/// Most bytes the kept prompts may take (token ids and text, estimated).
pub const MAX_KEPT_BYTES: usize = 16 << 20;

/// One precise decision's prompt: as the engine is asked to render it, and the router's ids.
#[derive(Debug, Clone)]
pub struct KeptPrompt {
    /// The API it is rendered as (the agent APIs as the chat request vLLM makes of them).
    pub api: ApiKind,
    /// The prompt fields rendered.
    pub prompt: Map<String, Value>,
    /// The router's token ids of the prompt.
    pub ids: Vec<u32>,
}

impl KeptPrompt {
    /// What keeping it costs, about: its ids, and its text at a few bytes a token.
    fn bytes(&self) -> usize {
        self.ids.len() * 8 + 256
    }
}

/// The bounded store of recent precise prompts, by decision id.
#[derive(Debug, Default)]
pub struct KeptPrompts {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    order: VecDeque<u64>,
    prompts: HashMap<u64, KeptPrompt>,
    bytes: usize,
}

impl KeptPrompts {
    /// Keeps decision `decision_id`'s prompt, forgetting the oldest beyond the bounds. A
    /// prompt larger than the whole budget is not kept.
    pub fn keep(&self, decision_id: u64, prompt: KeptPrompt) {
        let size = prompt.bytes();
        if size > MAX_KEPT_BYTES {
            return;
        }
        let mut inner = self.inner.lock();
        if let Some(old) = inner.prompts.insert(decision_id, prompt) {
            inner.bytes -= old.bytes();
        } else {
            inner.order.push_back(decision_id);
        }
        inner.bytes += size;
        while inner.order.len() > MAX_KEPT || inner.bytes > MAX_KEPT_BYTES {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some(gone) = inner.prompts.remove(&oldest) {
                inner.bytes -= gone.bytes();
            }
        }
    }

    /// Decision `decision_id`'s prompt, if still kept.
    pub fn get(&self, decision_id: u64) -> Option<KeptPrompt> {
        self.inner.lock().prompts.get(&decision_id).cloned()
    }

    /// Prompts kept now.
    pub fn len(&self) -> usize {
        self.inner.lock().prompts.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The block where a precise prompt's two views part, as `/debug/mismatch` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DivergingBlock {
    /// The engine block (counted from 0) where the delivered hit ended.
    pub block: u32,
    /// The router's token ids of that block.
    pub router_token_ids: Vec<u32>,
    /// The engine's, from the serving replica's render API (`None` when it could not be asked).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_token_ids: Option<Vec<u32>>,
    /// Whether both views hold the same tokens there: the engine lost blocks it had (eviction),
    /// rather than never holding them as the router hashed them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub same_tokens: Option<bool>,
    /// Why the engine's view is missing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl DivergingBlock {
    /// Block `block` of `block_tokens` tokens in the router's `ids` and, when rendered, the
    /// engine's.
    pub fn of(
        block: u32,
        block_tokens: u32,
        ids: &[u32],
        engine: Result<Vec<u32>, String>,
    ) -> Self {
        let slice = |ids: &[u32]| {
            let start = (block as usize).saturating_mul(block_tokens as usize);
            let end = start.saturating_add(block_tokens as usize).min(ids.len());
            ids.get(start..end).unwrap_or_default().to_vec()
        };
        let router_token_ids = slice(ids);
        match engine {
            Ok(engine) => {
                let engine = slice(&engine);
                Self {
                    block,
                    same_tokens: Some(engine == router_token_ids),
                    router_token_ids,
                    engine_token_ids: Some(engine),
                    error: None,
                }
            }
            Err(error) => Self {
                block,
                router_token_ids,
                engine_token_ids: None,
                same_tokens: None,
                error: Some(error),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(tokens: usize) -> KeptPrompt {
        KeptPrompt {
            api: ApiKind::Chat,
            prompt: Map::new(),
            ids: vec![7; tokens],
        }
    }

    #[test]
    fn the_newest_prompts_are_kept_within_the_bounds() {
        let kept = KeptPrompts::default();
        for id in 0..(MAX_KEPT as u64 + 10) {
            kept.keep(id, prompt(10));
        }
        assert_eq!(kept.len(), MAX_KEPT);
        assert!(kept.get(9).is_none() && kept.get(10).is_some());
        // A large prompt pushes older ones out by size; one over the budget is not kept.
        kept.keep(1_000, prompt(MAX_KEPT_BYTES / 8 - 64));
        assert!(kept.len() < MAX_KEPT && kept.get(1_000).is_some());
        kept.keep(1_001, prompt(MAX_KEPT_BYTES));
        assert!(kept.get(1_001).is_none());
    }

    #[test]
    fn a_diverging_block_compares_the_two_views() {
        let router = [1, 2, 3, 4, 5, 6];
        let other = DivergingBlock::of(1, 2, &router, Ok(vec![1, 2, 9, 4, 5]));
        assert_eq!(other.router_token_ids, vec![3, 4]);
        assert_eq!(other.engine_token_ids, Some(vec![9, 4]));
        assert_eq!(other.same_tokens, Some(false));
        let evicted = DivergingBlock::of(2, 2, &router, Ok(router.to_vec()));
        assert_eq!(evicted.same_tokens, Some(true));
        let unasked = DivergingBlock::of(9, 2, &router, Err("refused".into()));
        assert_eq!(unasked.router_token_ids, Vec::<u32>::new());
        assert_eq!(unasked.error.as_deref(), Some("refused"));
    }
}
