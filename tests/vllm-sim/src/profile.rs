//! Hardware/model profiles: the numbers that make a simulated engine behave like one GPU.
//!
//! A profile is plain YAML data (see `tests/vllm-sim/profiles/*.yaml`) so experiments can add hardware
//! without code. The two shipped profiles are compiled in as well, so the simulator works from
//! any directory.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::SimError;

/// Built-in Llama-3.1-8B on one H100 profile (`tests/vllm-sim/profiles/llama8b-h100.yaml`).
pub const LLAMA8B_H100_YAML: &str = include_str!("../profiles/llama8b-h100.yaml");
/// Built-in near-zero-compute profile for overhead benchmarks (`tests/vllm-sim/profiles/fast.yaml`).
pub const FAST_YAML: &str = include_str!("../profiles/fast.yaml");

/// Every shipped profile by name (its file's stem), compiled in: the two above plus other GPUs
/// and models, each file's comments giving its sources and derivation.
pub const BUILTIN_PROFILES: &[(&str, &str)] = &[
    ("llama8b-h100", LLAMA8B_H100_YAML),
    ("fast", FAST_YAML),
    (
        "llama70b-h100-tp4",
        include_str!("../profiles/llama70b-h100-tp4.yaml"),
    ),
    (
        "qwen32b-h200",
        include_str!("../profiles/qwen32b-h200.yaml"),
    ),
    ("llama8b-l4", include_str!("../profiles/llama8b-l4.yaml")),
    (
        "llama8b-a100-40g",
        include_str!("../profiles/llama8b-a100-40g.yaml"),
    ),
    (
        "llama8b-h100-sliding-window",
        include_str!("../profiles/llama8b-h100-sliding-window.yaml"),
    ),
];

/// Cost model and limits of one simulated engine (one GPU running one model).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Profile name, for logs and `/v1/models`.
    pub name: String,
    /// Model name the profile describes (the server's default `--model`).
    #[serde(default = "default_model")]
    pub model: String,
    /// KV cache bytes per token (reported only; capacity is `kv_capacity_tokens`).
    #[serde(default = "default_kv_bytes_per_token")]
    pub kv_bytes_per_token: u64,
    /// KV cache capacity in tokens; divided by `block_size` gives the GPU block count.
    pub kv_capacity_tokens: u64,
    /// Tokens per KV block (vLLM default 16).
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// Longest prompt plus output accepted.
    #[serde(default = "default_max_model_len")]
    pub max_model_len: u32,
    /// Most sequences in one batch (vLLM `--max-num-seqs`).
    #[serde(default = "default_max_num_seqs")]
    pub max_num_seqs: u32,
    /// Token budget of one step (vLLM `--max-num-batched-tokens`), shared by prefill and decode.
    #[serde(default = "default_max_num_batched_tokens")]
    pub max_num_batched_tokens: u32,
    /// Uncached prompt tokens computed per second.
    pub prefill_tokens_per_s: f64,
    /// Duration of a step whose batch holds a single short sequence.
    pub decode_step_s_min: f64,
    /// Duration of a step whose batch's KV fills the whole cache pool.
    pub decode_step_s_full: f64,
    /// Relative step-time noise, uniform in `[-jitter, +jitter]`.
    #[serde(default)]
    pub jitter: f64,
    /// Time to load one LoRA adapter into a GPU slot, added to the step that first runs it.
    #[serde(default)]
    pub lora_load_s: f64,
    /// Prompt tokens per second loaded from the CPU offload tier into GPU blocks (PCIe
    /// bandwidth over KV bytes per token); far faster than prefill, slower than a GPU hit.
    #[serde(default = "default_cpu_load_tokens_per_s")]
    pub cpu_load_tokens_per_s: f64,
    /// A hybrid model's sliding window, in tokens: some of its layers (Gemma 3's local layers,
    /// gpt-oss's banded ones) attend only to that many recent tokens and form a KV-cache group
    /// of their own (group 1), which publishes its own events and drops a block once it falls
    /// out of the window. `None`: every layer is full attention (one group).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window_tokens: Option<u32>,
}

fn default_cpu_load_tokens_per_s() -> f64 {
    // ~25 GB/s of PCIe at 128 KiB of KV per token (Llama-3.1-8B, bf16).
    200_000.0
}
fn default_model() -> String {
    "sim-model".to_owned()
}
fn default_kv_bytes_per_token() -> u64 {
    131_072
}
fn default_block_size() -> u32 {
    16
}
fn default_max_model_len() -> u32 {
    131_072
}
fn default_max_num_seqs() -> u32 {
    256
}
fn default_max_num_batched_tokens() -> u32 {
    8192
}

impl Profile {
    /// Parses and validates a profile from YAML text.
    pub fn from_yaml(text: &str) -> Result<Self, SimError> {
        let profile: Profile = serde_yaml_ng::from_str(text)
            .map_err(|e| SimError::Config(format!("bad profile yaml: {e}")))?;
        profile.validate()?;
        Ok(profile)
    }

    /// Reads a profile file.
    pub fn load(path: &Path) -> Result<Self, SimError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            SimError::Config(format!("cannot read profile {}: {e}", path.display()))
        })?;
        Self::from_yaml(&text)
    }

    /// The default profile: Llama-3.1-8B on one H100.
    pub fn llama8b_h100() -> Self {
        Self::builtin(LLAMA8B_H100_YAML)
    }

    /// The near-zero-compute profile.
    pub fn fast() -> Self {
        Self::builtin(FAST_YAML)
    }

    /// The shipped profile called `name` ([`BUILTIN_PROFILES`]).
    pub fn named(name: &str) -> Option<Self> {
        BUILTIN_PROFILES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, text)| Self::builtin(text))
    }

    fn builtin(text: &str) -> Self {
        match Self::from_yaml(text) {
            Ok(p) => p,
            // The shipped YAML is checked by a unit test; reaching this is a build defect.
            Err(e) => panic!("built-in profile is invalid: {e}"),
        }
    }

    /// Number of KV blocks on the GPU.
    pub fn num_gpu_blocks(&self) -> u64 {
        self.kv_capacity_tokens / u64::from(self.block_size.max(1))
    }

    /// The same GPU with `tokens` of KV cache instead (a lower `gpu_memory_utilization`, a
    /// larger weight share): the pool shrinks or grows but reading one token's KV costs what
    /// it did, so `decode_step_s_full` (a step whose batch fills the pool) scales with the pool.
    /// Setting `kv_capacity_tokens` alone would make every token of a small pool as slow to
    /// decode as a full H100's worth, and a fleet-sim run with small caches would charge
    /// decode-heavy batches several times what the hardware does.
    pub fn with_kv_capacity_tokens(mut self, tokens: u64) -> Self {
        if self.kv_capacity_tokens > 0 {
            let per_token =
                (self.decode_step_s_full - self.decode_step_s_min) / self.kv_capacity_tokens as f64;
            self.decode_step_s_full = self.decode_step_s_min + per_token * tokens as f64;
        }
        self.kv_capacity_tokens = tokens;
        self
    }

    /// Checks every number is usable, so the engine never divides by zero or loops forever.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |what: &str| Err(SimError::Config(format!("profile {}: {what}", self.name)));
        if self.block_size == 0 {
            return bad("block_size must be > 0");
        }
        if !(self.lora_load_s.is_finite() && self.lora_load_s >= 0.0) {
            return bad("lora_load_s must be a non-negative number");
        }
        if !(self.cpu_load_tokens_per_s.is_finite() && self.cpu_load_tokens_per_s > 0.0) {
            return bad("cpu_load_tokens_per_s must be a positive number");
        }
        if self
            .sliding_window_tokens
            .is_some_and(|w| w < self.block_size)
        {
            return bad("sliding_window_tokens must hold at least one block");
        }
        if self.num_gpu_blocks() == 0 {
            return bad("kv_capacity_tokens must hold at least one block");
        }
        if self.num_gpu_blocks() > u64::from(u32::MAX / 2) {
            return bad("kv_capacity_tokens is too large");
        }
        if self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 || self.max_model_len == 0 {
            return bad("max_num_seqs, max_num_batched_tokens and max_model_len must be > 0");
        }
        if !(self.prefill_tokens_per_s.is_finite() && self.prefill_tokens_per_s > 0.0) {
            return bad("prefill_tokens_per_s must be a positive number");
        }
        let finite_nonneg = |x: f64| x.is_finite() && x >= 0.0;
        if !finite_nonneg(self.decode_step_s_min) || !finite_nonneg(self.decode_step_s_full) {
            return bad("decode_step_s_min and decode_step_s_full must be >= 0");
        }
        if self.decode_step_s_full < self.decode_step_s_min {
            return bad("decode_step_s_full must be >= decode_step_s_min");
        }
        if !(self.jitter.is_finite() && (0.0..1.0).contains(&self.jitter)) {
            return bad("jitter must be in [0, 1)");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_profiles_parse() {
        let p = Profile::llama8b_h100();
        assert_eq!(p.block_size, 16);
        assert_eq!(p.kv_bytes_per_token, 128 * 1024);
        assert_eq!(p.num_gpu_blocks(), 490_000 / 16);
        assert!(Profile::fast().prefill_tokens_per_s > 1e8);
    }

    #[test]
    fn every_shipped_profile_parses_under_its_name() {
        for (name, text) in BUILTIN_PROFILES {
            let p = Profile::from_yaml(text).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(p.name, *name);
            assert_eq!(Profile::named(name).as_ref(), Some(&p));
            // vLLM refuses to start when the cache cannot hold one longest request.
            if *name != "fast" {
                assert!(p.kv_capacity_tokens >= u64::from(p.max_model_len), "{name}");
            }
        }
        // The files on disk are the ones compiled in.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("profiles");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| {
                let path = e.ok()?.path();
                (path.extension()? == "yaml")
                    .then(|| path.file_stem()?.to_str().map(String::from))?
            })
            .collect();
        on_disk.sort();
        let mut builtin: Vec<String> = BUILTIN_PROFILES
            .iter()
            .map(|(n, _)| n.to_string())
            .collect();
        builtin.sort();
        assert_eq!(on_disk, builtin);
    }

    #[test]
    fn a_smaller_pool_keeps_the_decode_cost_of_a_token() {
        let full = Profile::llama8b_h100();
        let small = full.clone().with_kv_capacity_tokens(49_000);
        assert_eq!(small.kv_capacity_tokens, 49_000);
        let slope = |p: &Profile| {
            (p.decode_step_s_full - p.decode_step_s_min) / p.kv_capacity_tokens as f64
        };
        assert!((slope(&small) - slope(&full)).abs() < 1e-15);
        assert_eq!(small.decode_step_s_min, full.decode_step_s_min);
        small.validate().unwrap();
    }

    #[test]
    fn rejects_bad_numbers() {
        let bad = LLAMA8B_H100_YAML.replace("block_size: 16", "block_size: 0");
        assert!(Profile::from_yaml(&bad).is_err());
        let bad =
            LLAMA8B_H100_YAML.replace("prefill_tokens_per_s: 10000", "prefill_tokens_per_s: -1");
        assert!(Profile::from_yaml(&bad).is_err());
        assert!(Profile::from_yaml("name: x\nbogus: 1").is_err());
    }
}
