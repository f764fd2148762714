//! A fast deterministic tokenizer and the ChatML chat template.
//!
//! Real tokenizers are slow to load and need model files; the simulator only needs two
//! properties of one: the same text always gives the same ids, and a prompt that extends another
//! prompt tokenises to an extension of its ids (so prefix caching works across chat turns).
//!
//! [`WordTokenizer`] pre-tokenises like byte-level BPE does at word granularity: a special token
//! (`<|im_start|>`, ...) is one token; a word together with one leading space is one token; any
//! other whitespace character is a token of its own. The id is `xxh3(piece) % vocab + offset`.
//! Generated ids come from a fixed word list, and the detokenised text of generated ids
//! re-tokenises to the same ids, so turn N+1 of a chat reuses the KV of turn N's answer.
//!
//! The [`Tokenizer`] and [`ChatTemplate`] traits are the seam where a Hugging Face tokenizer and
//! a Jinja template can plug in later.

use hashbrown::HashMap;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

/// Turns text into token ids and generated ids back into text.
pub trait Tokenizer: Send + Sync {
    /// Token ids of `text` (no special tokens added).
    fn encode(&self, text: &str) -> Vec<u32>;
    /// Text of `ids`; for ids from [`Tokenizer::output_vocab`] re-encoding gives `ids` back.
    fn decode(&self, ids: &[u32]) -> String;
    /// Ids the engine may generate.
    fn output_vocab(&self) -> Vec<u32>;
}

/// Renders chat messages into the prompt text the model sees.
pub trait ChatTemplate: Send + Sync {
    /// The prompt text; with `add_generation_prompt` it ends with the assistant turn header.
    fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> String;
}

/// One chat message with its text content already flattened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

/// Special tokens with fixed ids below [`WordTokenizer::OFFSET`].
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Words the simulated model "generates" (lorem-ipsum English).
const WORDS: &str = "the of and to in is was that for on with as by at from it an be this are \
    which or have not has but were had their one all been can more its new other also after \
    first two time year would about there some only into most over such when between up out \
    many then these so may where any made part world state city during under while system \
    both through well each data model cache token request server route fleet block prefix \
    latency batch queue memory engine answer question light river mountain ocean forest \
    garden window paper story music market energy signal number letter simple quick bright \
    quiet gentle steady careful clever silver golden early later always never often rarely \
    today tomorrow together across around behind beyond inside outside above below near far \
    north south east west spring summer autumn winter morning evening night day week month \
    build write read learn teach think know find keep give take make move turn open close \
    start finish carry follow lead hold bring send show tell ask answer help change grow";

/// Deterministic word-level tokenizer (see the module docs).
#[derive(Debug, Clone)]
pub struct WordTokenizer {
    vocab_size: u32,
    words: Vec<(u32, String)>,
    by_id: HashMap<u32, usize>,
}

impl Default for WordTokenizer {
    fn default() -> Self {
        Self::new(128_000)
    }
}

impl WordTokenizer {
    /// First id of hashed (non-special) tokens.
    pub const OFFSET: u32 = 16;

    /// A tokenizer whose hashed ids fall in `OFFSET..OFFSET + vocab_size`.
    pub fn new(vocab_size: u32) -> Self {
        let vocab_size = vocab_size.max(1);
        let mut words = Vec::new();
        let mut by_id = HashMap::new();
        for word in WORDS.split_whitespace() {
            let piece = format!(" {word}");
            let id = Self::hashed_id(vocab_size, &piece);
            // Keep only words whose id is unique, so decoding is unambiguous.
            if let hashbrown::hash_map::Entry::Vacant(slot) = by_id.entry(id) {
                slot.insert(words.len());
                words.push((id, piece));
            }
        }
        Self {
            vocab_size,
            words,
            by_id,
        }
    }

    fn hashed_id(vocab_size: u32, piece: &str) -> u32 {
        Self::OFFSET + (xxh3_64(piece.as_bytes()) % u64::from(vocab_size)) as u32
    }

    /// Splits `text` into pieces; every piece maps to exactly one id.
    pub fn pieces(text: &str) -> Vec<&str> {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if let Some(len) = special_at(&text[i..]) {
                out.push(&text[i..i + len]);
                i += len;
                continue;
            }
            let ch = next_char(&text[i..]);
            let start = i;
            if ch.is_whitespace() {
                i += ch.len_utf8();
                // A single space glues to the word that follows it.
                if ch == ' ' && i < bytes.len() && special_at(&text[i..]).is_none() {
                    let next = next_char(&text[i..]);
                    if !next.is_whitespace() {
                        i = word_end(text, i);
                    }
                }
            } else {
                i = word_end(text, i);
            }
            out.push(&text[start..i]);
        }
        out
    }
}

fn next_char(s: &str) -> char {
    s.chars().next().unwrap_or(' ')
}

/// Length of the special token `s` starts with, if any.
fn special_at(s: &str) -> Option<usize> {
    if !s.starts_with("<|") {
        return None;
    }
    SPECIAL_TOKENS
        .iter()
        .find(|t| s.starts_with(**t))
        .map(|t| t.len())
}

/// End of the run of non-whitespace characters starting at `i` (stops before a special token).
fn word_end(text: &str, mut i: usize) -> usize {
    while i < text.len() {
        let rest = &text[i..];
        let ch = next_char(rest);
        if ch.is_whitespace() || special_at(rest).is_some() {
            break;
        }
        i += ch.len_utf8();
    }
    i
}

impl Tokenizer for WordTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        Self::pieces(text)
            .into_iter()
            .map(
                |piece| match SPECIAL_TOKENS.iter().position(|t| *t == piece) {
                    Some(i) => i as u32,
                    None => Self::hashed_id(self.vocab_size, piece),
                },
            )
            .collect()
    }

    fn decode(&self, ids: &[u32]) -> String {
        let mut out = String::new();
        for &id in ids {
            if let Some(special) = SPECIAL_TOKENS.get(id as usize) {
                out.push_str(special);
            } else if let Some(&i) = self.by_id.get(&id) {
                out.push_str(&self.words[i].1);
            } else {
                // Not invertible (a hashed prompt piece): a readable placeholder.
                out.push_str(&format!(" <{id}>"));
            }
        }
        out
    }

    fn output_vocab(&self) -> Vec<u32> {
        self.words.iter().map(|(id, _)| *id).collect()
    }
}

/// The ChatML template (Qwen, many fine-tunes):
/// `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then `<|im_start|>assistant\n`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChatMl;

impl ChatTemplate for ChatMl {
    fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> String {
        let mut out = String::new();
        for m in messages {
            out.push_str("<|im_start|>");
            out.push_str(&m.role);
            out.push('\n');
            out.push_str(&m.content);
            out.push_str("<|im_end|>\n");
        }
        if add_generation_prompt {
            out.push_str("<|im_start|>assistant\n");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    #[test]
    fn pieces_glue_one_leading_space() {
        assert_eq!(
            WordTokenizer::pieces("Hi there  you\n<|im_end|>x"),
            vec!["Hi", " there", " ", " you", "\n", "<|im_end|>", "x"]
        );
        assert_eq!(WordTokenizer::pieces(""), Vec::<&str>::new());
        assert_eq!(WordTokenizer::pieces("é ü"), vec!["é", " ü"]);
    }

    #[test]
    fn deterministic_and_special_ids() {
        let t = WordTokenizer::default();
        let a = t.encode("<|im_start|>user\nhello world");
        assert_eq!(a, t.encode("<|im_start|>user\nhello world"));
        assert_eq!(a[0], 1);
        assert!(a[1..].iter().all(|&id| id >= WordTokenizer::OFFSET));
        assert_ne!(t.encode(" hello"), t.encode("hello"));
    }

    #[test]
    fn generated_text_round_trips() {
        let t = WordTokenizer::default();
        let vocab = t.output_vocab();
        assert!(vocab.len() > 150);
        let ids: Vec<u32> = vocab.iter().copied().cycle().step_by(7).take(50).collect();
        assert_eq!(t.encode(&t.decode(&ids)), ids);
    }

    #[test]
    fn chat_turns_extend_token_prefix() {
        let t = WordTokenizer::default();
        let mut history = vec![msg("system", "Be brief."), msg("user", "What is a cache?")];
        let turn1 = t.encode(&ChatMl.render(&history, true));
        let answer: Vec<u32> = t.output_vocab().into_iter().take(9).collect();
        history.push(msg("assistant", &t.decode(&answer)));
        history.push(msg("user", "And a prefix?"));
        let turn2 = t.encode(&ChatMl.render(&history, true));
        assert_eq!(turn2[..turn1.len()], turn1[..]);
        assert_eq!(turn2[turn1.len()..turn1.len() + answer.len()], answer[..]);
    }
}
