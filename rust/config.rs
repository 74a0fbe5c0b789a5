//! The resolved engine configuration: what the policy (`policy.rs`) hands to the cache manager and
//! the scheduler. Every value here has been validated; nothing downstream re-checks it.

/// The Mamba state caching mode after resolution (see DESIGN.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MambaCacheMode {
    /// No Mamba checkpoints: hybrid prefix hits are impossible.
    None,
    /// Prefill chunks end on multiples of `mamba_block_size`; boundary states are copied out.
    Align,
    /// The prefill scan emits the state at every multiple of `mamba_block_size`.
    All,
}

impl MambaCacheMode {
    pub fn as_str(self) -> &'static str {
        match self {
            MambaCacheMode::None => "none",
            MambaCacheMode::Align => "align",
            MambaCacheMode::All => "all",
        }
    }
}

/// Speculative decoding method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SpecMethod {
    Ngram,
    DraftModel,
}

impl SpecMethod {
    pub fn as_str(self) -> &'static str {
        match self {
            SpecMethod::Ngram => "ngram",
            SpecMethod::DraftModel => "draft_model",
        }
    }
}

/// Resolved speculative decoding settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    pub method: SpecMethod,
    /// K: drafts per step (>= 1).
    pub num_speculative_tokens: usize,
}

/// The configuration the engine runs with. Produced only by `policy::resolve`, or by
/// `ResolvedConfig::for_tests` in tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedConfig {
    pub has_mamba_layers: bool,
    pub enable_prefix_caching: bool,
    pub mamba_cache_mode: MambaCacheMode,
    pub enable_chunked_prefill: bool,
    /// B: tokens per KV block.
    pub block_size: usize,
    /// M: tokens between Mamba checkpoints (a multiple of B, and of Q in `all` mode).
    pub mamba_block_size: usize,
    /// Q: the scan chunk size of the model.
    pub scan_chunk_size: usize,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub speculative: Option<SpecConfig>,
}

impl ResolvedConfig {
    /// K, or 0 without speculative decoding.
    pub fn num_speculative_tokens(&self) -> usize {
        self.speculative.map_or(0, |s| s.num_speculative_tokens)
    }

    /// Slots in a running request's state window: 1 + K.
    pub fn state_window_len(&self) -> usize {
        1 + self.num_speculative_tokens()
    }

    /// A small valid configuration for unit tests of the cache manager and scheduler.
    pub fn for_tests(mode: MambaCacheMode, num_speculative_tokens: usize) -> Self {
        ResolvedConfig {
            has_mamba_layers: true,
            enable_prefix_caching: mode != MambaCacheMode::None,
            mamba_cache_mode: mode,
            enable_chunked_prefill: true,
            block_size: 4,
            mamba_block_size: 8,
            scan_chunk_size: 4,
            max_num_batched_tokens: 64,
            max_num_seqs: 16,
            max_model_len: 4096,
            speculative: (num_speculative_tokens > 0).then_some(SpecConfig {
                method: SpecMethod::Ngram,
                num_speculative_tokens,
            }),
        }
    }
}
