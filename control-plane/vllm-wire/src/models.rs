//! vLLM's `GET /v1/models` answer (`ModelList` of `ModelCard`s,
//! `vllm/entrypoints/serve/engine/protocol.py`): the base models a replica serves, with their
//! context (`max_model_len`), and its LoRA adapters, with their `parent`.

use scorer_core::pools::ServedModel;
use serde::Deserialize;

/// Why a `/v1/models` answer is unusable.
#[derive(Debug, thiserror::Error)]
pub enum ModelsError {
    /// Not the OpenAI list shape (`{"object":"list","data":[{"id":..}, ..]}`).
    #[error("not an OpenAI model list: {0}")]
    Shape(#[from] serde_json::Error),
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelCard>,
}

#[derive(Deserialize)]
struct ModelCard {
    id: String,
    #[serde(default)]
    parent: Option<String>,
    #[serde(default)]
    max_model_len: Option<u32>,
}

/// Parses a `/v1/models` body into the models it lists (adapters keep their `parent`, base
/// models their `max_model_len`; an empty parent or a context of 0 counts as none).
pub fn parse_models(body: &[u8]) -> Result<Vec<ServedModel>, ModelsError> {
    let list: ModelList = serde_json::from_slice(body)?;
    Ok(list
        .data
        .into_iter()
        .map(|c| ServedModel {
            id: c.id,
            parent: c.parent.filter(|p| !p.is_empty()),
            max_model_len: c.max_model_len.filter(|&n| n > 0),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_model_list_with_adapters() {
        let body = br#"{"object":"list","data":[
            {"id":"meta-llama/Llama-3.1-8B","object":"model","root":"meta-llama/Llama-3.1-8B","parent":null,"max_model_len":16384},
            {"id":"sql-lora","object":"model","root":"/adapters/sql","parent":"meta-llama/Llama-3.1-8B"}]}"#;
        let models = parse_models(body).unwrap();
        assert_eq!(models.len(), 2);
        assert_eq!(models[0].parent, None);
        assert_eq!(models[0].max_model_len, Some(16_384));
        assert_eq!(models[1].max_model_len, None);
        assert_eq!(models[1].parent.as_deref(), Some("meta-llama/Llama-3.1-8B"));
        assert!(parse_models(b"<html>").is_err());
        assert!(parse_models(br#"{"data":[{"name":"x"}]}"#).is_err());
        let odd = br#"{"data":[{"id":"m","parent":"","max_model_len":0}]}"#;
        let models = parse_models(odd).unwrap();
        assert_eq!(
            (models[0].parent.as_deref(), models[0].max_model_len),
            (None, None)
        );
        assert!(parse_models(br#"{"data":[{"id":"m","max_model_len":-1}]}"#).is_err());
    }
}
