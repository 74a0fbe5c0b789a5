//! The resolved engine configuration: what the policy (`policy.rs`) hands to the cache manager and
//! the scheduler. Every value here has been validated; nothing downstream re-checks it.

use crate::error::{HsError, HsResult};

/// The largest `num_speculative_tokens` (K) the policy accepts.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;
/// The largest KV `block_size` (B) the policy accepts.
pub const MAX_BLOCK_SIZE: usize = 1024;
/// The largest model scan chunk size (Q) the policy accepts.
pub const MAX_SCAN_CHUNK_SIZE: usize = 4096;
/// Upper bound on every token count (max_model_len, max_num_batched_tokens, mamba_block_size).
pub const MAX_TOKENS: usize = 1 << 24;
/// Upper bound on `max_num_seqs`.
pub const MAX_NUM_SEQS: usize = 1 << 16;
/// Upper bounds on the pools (null block / slot included): the scheduler keeps ~50 bytes of
/// bookkeeping per block and slot, so a bigger count would cost gigabytes before any KV exists.
pub const MAX_KV_BLOCKS: usize = 1 << 25;
pub const MAX_MAMBA_SLOTS: usize = 1 << 22;

/// The range of every integer setting the core checks, by its `EngineArgs` name (the CLI flag
/// with underscores): `(name, smallest, largest)`. The policy checks its inputs against this
/// table and the Python side validates the same settings with it (`_core.FLAG_LIMITS`), so a value
/// is accepted or refused by one rule wherever it is given.
pub const FLAG_LIMITS: [(&str, usize, usize); 8] = [
    ("block_size", 1, MAX_BLOCK_SIZE),
    ("mamba_block_size", 1, MAX_TOKENS),
    ("max_num_seqs", 1, MAX_NUM_SEQS),
    ("max_num_batched_tokens", 1, MAX_TOKENS),
    // a prompt token and one to generate
    ("max_model_len", 2, MAX_TOKENS),
    // the null block and one usable block
    ("num_kv_blocks", 2, MAX_KV_BLOCKS),
    ("num_mamba_slots", 1, MAX_MAMBA_SLOTS),
    ("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
];

/// Checks `value` against the `FLAG_LIMITS` entry of `name`; the error names the flag.
pub fn check_flag(name: &str, value: usize) -> HsResult<()> {
    let Some(&(_, lo, hi)) = FLAG_LIMITS.iter().find(|(n, _, _)| *n == name) else {
        return Err(HsError::Internal(format!(
            "no limits are defined for {name}"
        )));
    };
    if value < lo || value > hi {
        let flag = if name == "num_speculative_tokens" {
            "--speculative-config num_speculative_tokens".to_string()
        } else {
            format!("--{}", name.replace('_', "-"))
        };
        return Err(HsError::Config(format!(
            "{flag} must be in {lo}..={hi}, got {value}"
        )));
    }
    Ok(())
}

/// "a, b, c": the names of every variant, for the error that lists what is accepted.
pub fn one_of<T: Copy>(all: &[T], name: impl Fn(T) -> &'static str) -> String {
    all.iter().map(|v| name(*v)).collect::<Vec<_>>().join(", ")
}

/// The Mamba state caching mode after resolution (docs/cache-modes.md, "Modes").
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
    pub const ALL: [Self; 3] = [
        MambaCacheMode::None,
        MambaCacheMode::Align,
        MambaCacheMode::All,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            MambaCacheMode::None => "none",
            MambaCacheMode::Align => "align",
            MambaCacheMode::All => "all",
        }
    }
}

/// Where Mamba checkpoints are placed (docs/prefix-caching.md, "Checkpoint placement"): the
/// prefix cache can only resume a hybrid model where a copy of the state was kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CheckpointPlacement {
    /// Where prompts really share: at the deepest cached KV block of a prompt whose KV prefix hit
    /// reaches past its state hit (a prefix an earlier request shared, block granularity), and
    /// after the last computed token of every finished or preempted sequence.
    Branch,
    /// Every multiple of `mamba_block_size` (mode `all`) or the chunk ends on it (mode `align`),
    /// and decode steps that cross one.
    Grid,
    /// Both.
    BranchAndGrid,
}

impl CheckpointPlacement {
    pub const ALL: [Self; 3] = [
        CheckpointPlacement::Branch,
        CheckpointPlacement::Grid,
        CheckpointPlacement::BranchAndGrid,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CheckpointPlacement::Branch => "branch",
            CheckpointPlacement::Grid => "grid",
            CheckpointPlacement::BranchAndGrid => "branch+grid",
        }
    }

    /// Branch points and last tokens.
    pub fn branch(self) -> bool {
        match self {
            CheckpointPlacement::Branch | CheckpointPlacement::BranchAndGrid => true,
            CheckpointPlacement::Grid => false,
        }
    }

    /// Multiples of `mamba_block_size`.
    pub fn grid(self) -> bool {
        match self {
            CheckpointPlacement::Grid | CheckpointPlacement::BranchAndGrid => true,
            CheckpointPlacement::Branch => false,
        }
    }
}

/// Which committed checkpoint goes when the Mamba pool is full (stale ones always go first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EvictionPolicy {
    /// Recency combined with the prefill FLOPs a checkpoint saves per byte it holds (its state
    /// and the KV blocks only it keeps useful); a hit refreshes only the checkpoint it consumed;
    /// KV blocks that no hit can use any more are evicted before those that can.
    Flops,
    /// Least recently used; a hit refreshes only the checkpoint it consumed.
    Lru,
    /// Least recently used; a hit refreshes every checkpoint on its path (the baseline of
    /// engines that refresh a whole radix-tree path).
    LruPath,
}

impl EvictionPolicy {
    pub const ALL: [Self; 3] = [
        EvictionPolicy::Flops,
        EvictionPolicy::Lru,
        EvictionPolicy::LruPath,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EvictionPolicy::Flops => "flops",
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::LruPath => "lru-path",
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
    pub const ALL: [Self; 2] = [SpecMethod::Ngram, SpecMethod::DraftModel];

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
    /// M: tokens between grid Mamba checkpoints (a multiple of B).
    pub mamba_block_size: usize,
    /// Q: the scan chunk size of the model.
    pub scan_chunk_size: usize,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub speculative: Option<SpecConfig>,
    pub checkpoint_placement: CheckpointPlacement,
    pub eviction: EvictionPolicy,
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

    /// Checks every invariant the cache manager and the scheduler rely on (docs/cache-modes.md,
    /// "Validation"; rule 7 of "Rules").
    /// `policy::resolve` only returns configurations that pass; the error names the flag to change.
    pub fn validate(&self) -> HsResult<()> {
        let err = |m: String| Err(HsError::Config(m));
        let b = self.block_size;
        let m = self.mamba_block_size;
        let q = self.scan_chunk_size;
        let k = self.num_speculative_tokens();
        check_flag("block_size", b)?;
        if q == 0 || q > MAX_SCAN_CHUNK_SIZE {
            return err(format!(
                "the scan chunk size must be in 1..={MAX_SCAN_CHUNK_SIZE}, got {q}"
            ));
        }
        check_flag("mamba_block_size", m)?;
        if m % b != 0 {
            return err(format!(
                "--mamba-block-size ({m}) must be a positive multiple of --block-size ({b})"
            ));
        }
        check_flag("max_num_seqs", self.max_num_seqs)?;
        check_flag("max_model_len", self.max_model_len)?;
        let t = self.max_num_batched_tokens;
        check_flag("max_num_batched_tokens", t)?;
        if let Some(spec) = self.speculative {
            check_flag("num_speculative_tokens", spec.num_speculative_tokens)?;
            if k >= self.max_model_len {
                return err(format!(
                    "--speculative-config num_speculative_tokens ({k}) must be less than --max-model-len ({})",
                    self.max_model_len
                ));
            }
        }
        if t < 1 + k {
            return err(format!(
                "--max-num-batched-tokens ({t}) must be at least 1 + num_speculative_tokens ({k}): {}",
                1 + k
            ));
        }
        if !self.enable_chunked_prefill && t < self.max_model_len {
            return err(format!(
                "with chunked prefill off a whole prompt must fit in one step: raise \
                 --max-num-batched-tokens ({t}) to at least --max-model-len ({}), lower \
                 --max-model-len, or pass --enable-chunked-prefill",
                self.max_model_len
            ));
        }
        match self.mamba_cache_mode {
            MambaCacheMode::None => {}
            MambaCacheMode::Align | MambaCacheMode::All if !self.has_mamba_layers => {
                return err(format!(
                    "--mamba-cache-mode {} needs a model with Mamba layers",
                    self.mamba_cache_mode.as_str()
                ));
            }
            MambaCacheMode::Align | MambaCacheMode::All if !self.enable_prefix_caching => {
                return err(format!(
                    "--mamba-cache-mode {} needs --enable-prefix-caching",
                    self.mamba_cache_mode.as_str()
                ));
            }
            MambaCacheMode::Align => {
                if !self.enable_chunked_prefill {
                    return err(
                        "--mamba-cache-mode align needs chunked prefill: pass --enable-chunked-prefill \
                         or choose --mamba-cache-mode all"
                            .to_string(),
                    );
                }
                if m > t {
                    return err(format!(
                        "--mamba-cache-mode align needs --mamba-block-size ({m}) <= \
                         --max-num-batched-tokens ({t}); raise --max-num-batched-tokens or lower \
                         --mamba-block-size"
                    ));
                }
            }
            // The scan emits a state at any token, so `all` puts no condition on M.
            MambaCacheMode::All => {}
        }
        Ok(())
    }

    /// Checks that pools of `num_kv_blocks` KV blocks and `num_mamba_slots` state slots (both
    /// counts include the null block / null slot 0) can run at least one request of
    /// `max_model_len` tokens, so that the scheduler can always make progress.
    pub fn validate_pool_sizes(
        &self,
        num_kv_blocks: usize,
        num_mamba_slots: usize,
    ) -> HsResult<()> {
        let tokens = self
            .max_model_len
            .saturating_add(self.num_speculative_tokens());
        let need_blocks = 1 + tokens.div_ceil(self.block_size.max(1));
        if num_kv_blocks < need_blocks {
            return Err(HsError::Config(format!(
                "{num_kv_blocks} KV blocks cannot hold one sequence of --max-model-len {} tokens \
                 (needs at least {need_blocks} blocks of {} tokens, counting the null block); raise \
                 --num-kv-blocks or --kv-cache-memory, or lower --max-model-len",
                self.max_model_len, self.block_size
            )));
        }
        let need_slots = 1 + self.state_window_len();
        if self.has_mamba_layers && num_mamba_slots < need_slots {
            return Err(HsError::Config(format!(
                "{num_mamba_slots} Mamba state slots cannot hold one running window of {} slots \
                 (needs at least {need_slots}, counting the null slot); raise --num-mamba-slots or \
                 --mamba-cache-memory",
                self.state_window_len()
            )));
        }
        Ok(())
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
            checkpoint_placement: CheckpointPlacement::Grid,
            eviction: EvictionPolicy::Lru,
        }
    }
}
