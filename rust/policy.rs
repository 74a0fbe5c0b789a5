//! The cache-mode policy (docs/cache-modes.md, "The policy"): typed requests in, one resolution,
//! a validated [`ResolvedConfig`] plus the list of [`Decision`]s that explain every choice out.
//!
//! The rules (the `ruleN` cases of tests/config/policy_cases.txt):
//! 1. prefix caching off → mode `none`; an explicit `align`/`all` is ignored with a warning; an
//!    explicit `mamba_block_size` is an error;
//! 2. a model without Mamba layers → the mode has no effect (`none`), stated once;
//! 3. prefix caching on, mode Auto: speculative decoding on + boundary states → `align` (chunked
//!    prefill switched on when it was Auto); speculative decoding off + boundary states → `all`;
//!    no boundary states → `align`; chunked prefill explicitly off where `align` would be chosen →
//!    an error naming both fixes;
//! 4. explicit `all` on a model that cannot emit boundary states → `align` with a warning;
//! 5. explicit `align` with chunked prefill explicitly off → an error;
//! 6. explicit `none` with prefix caching on, on a hybrid model → a warning (no hit is possible);
//! 7. validation of the result ([`ResolvedConfig::validate`]);
//! 8. where a Mamba checkpoint can exist (prefix caching on, a Mamba model, mode `align`/`all`):
//!    the checkpoint placement defaults to branch points and last tokens (`branch`), plus grid
//!    points in spare room in mode `all` (`branch+grid`), and eviction to `flops`, each stated as a
//!    decision; an explicit placement or eviction where no checkpoint can exist is reported as
//!    ignored (warning).
//!
//! `mamba_block_size` (M) in mode `none`: M is unused there; the resolved value is the same auto
//! value as in the other modes (the smallest multiple of lcm(B, Q) that is at least 256), so that it
//! still divides evenly by B and Q for any code that computes with it. (vLLM sets it to
//! `max_model_len`; a value that is not a multiple of B would only invite mistakes.)

use std::fmt;
use std::str::FromStr;

use crate::config::{
    check_flag, one_of, CheckpointPlacement, EvictionPolicy, MambaCacheMode, ResolvedConfig,
    SpecConfig, SpecMethod, MAX_SCAN_CHUNK_SIZE, MAX_TOKENS,
};
use crate::error::{HsError, HsResult};

/// Default KV block size B.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// The auto `mamba_block_size` is the smallest multiple of lcm(B, Q) that is at least this.
pub const MIN_AUTO_MAMBA_BLOCK_SIZE: usize = 256;
/// Default token budget per step with chunked prefill on (raised to M in `align` mode).
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 2048;
/// Default `max_num_seqs`.
pub const DEFAULT_MAX_NUM_SEQS: usize = 64;
/// `max_model_len` when neither the user nor the model gives one.
pub const DEFAULT_MAX_MODEL_LEN: usize = 4096;

/// `--mamba-cache-mode` as given. `Auto` means "not given"; an explicit `None` stays distinct.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MambaCacheModeRequest {
    #[default]
    Auto,
    None,
    Align,
    All,
}

/// `--enable-chunked-prefill` / `--no-enable-chunked-prefill` / not given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ChunkedPrefillRequest {
    #[default]
    Auto,
    On,
    Off,
}

/// `--enable-prefix-caching` / `--no-enable-prefix-caching` / not given (default on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PrefixCachingRequest {
    #[default]
    Auto,
    On,
    Off,
}

impl MambaCacheModeRequest {
    pub const ALL: [Self; 4] = [
        MambaCacheModeRequest::Auto,
        MambaCacheModeRequest::None,
        MambaCacheModeRequest::Align,
        MambaCacheModeRequest::All,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            MambaCacheModeRequest::Auto => "auto",
            MambaCacheModeRequest::None => "none",
            MambaCacheModeRequest::Align => "align",
            MambaCacheModeRequest::All => "all",
        }
    }
}

impl ChunkedPrefillRequest {
    pub fn as_str(self) -> &'static str {
        match self {
            ChunkedPrefillRequest::Auto => "auto",
            ChunkedPrefillRequest::On => "on",
            ChunkedPrefillRequest::Off => "off",
        }
    }

    /// `None` = Auto, `Some(true)` = On, `Some(false)` = Off.
    pub fn from_option(v: Option<bool>) -> Self {
        match v {
            None => ChunkedPrefillRequest::Auto,
            Some(true) => ChunkedPrefillRequest::On,
            Some(false) => ChunkedPrefillRequest::Off,
        }
    }
}

impl PrefixCachingRequest {
    pub fn as_str(self) -> &'static str {
        match self {
            PrefixCachingRequest::Auto => "auto",
            PrefixCachingRequest::On => "on",
            PrefixCachingRequest::Off => "off",
        }
    }

    /// `None` = Auto, `Some(true)` = On, `Some(false)` = Off.
    pub fn from_option(v: Option<bool>) -> Self {
        match v {
            None => PrefixCachingRequest::Auto,
            Some(true) => PrefixCachingRequest::On,
            Some(false) => PrefixCachingRequest::Off,
        }
    }
}

impl FromStr for MambaCacheModeRequest {
    type Err = HsError;
    fn from_str(s: &str) -> HsResult<Self> {
        parse_named("--mamba-cache-mode", s, &Self::ALL, Self::as_str)
    }
}

/// The variant of `all` named `s`; the error lists every name.
fn parse_named<T: Copy>(
    flag: &str,
    s: &str,
    all: &[T],
    name: fn(T) -> &'static str,
) -> HsResult<T> {
    all.iter().copied().find(|v| name(*v) == s).ok_or_else(|| {
        HsError::Config(format!(
            "{flag} must be one of {}; got {s:?}",
            one_of(all, name)
        ))
    })
}

fn parse_tristate(flag: &str, s: &str) -> HsResult<Option<bool>> {
    match s {
        "auto" => Ok(None),
        "on" | "true" => Ok(Some(true)),
        "off" | "false" => Ok(Some(false)),
        other => Err(HsError::Config(format!(
            "{flag} must be one of auto, on, off (or true, false); got {other:?}"
        ))),
    }
}

impl FromStr for ChunkedPrefillRequest {
    type Err = HsError;
    fn from_str(s: &str) -> HsResult<Self> {
        parse_tristate("--enable-chunked-prefill", s).map(Self::from_option)
    }
}

impl FromStr for PrefixCachingRequest {
    type Err = HsError;
    fn from_str(s: &str) -> HsResult<Self> {
        parse_tristate("--enable-prefix-caching", s).map(Self::from_option)
    }
}

impl FromStr for CheckpointPlacement {
    type Err = HsError;
    fn from_str(s: &str) -> HsResult<Self> {
        parse_named("--mamba-checkpoint-placement", s, &Self::ALL, Self::as_str)
    }
}

impl FromStr for EvictionPolicy {
    type Err = HsError;
    fn from_str(s: &str) -> HsResult<Self> {
        parse_named("--prefix-cache-eviction", s, &Self::ALL, Self::as_str)
    }
}

impl FromStr for SpecMethod {
    type Err = HsError;
    fn from_str(s: &str) -> HsResult<Self> {
        parse_named("--speculative-config method", s, &Self::ALL, Self::as_str)
    }
}

/// What the model can do, read from its config.json.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ModelCapabilities {
    pub has_mamba_layers: bool,
    /// The prefill scan can emit the state at every multiple of M (needed by mode `all`).
    pub supports_boundary_states: bool,
    /// Q: the model's scan chunk size. Required when `has_mamba_layers`.
    pub scan_chunk_size: Option<usize>,
    /// The model's context limit; caps (and defaults) `max_model_len`.
    pub max_position_embeddings: Option<usize>,
}

/// The speculative decoding request (`--speculative-config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecRequest {
    pub method: SpecMethod,
    pub num_speculative_tokens: usize,
}

/// Every input of the policy, typed. `None`/`Auto` means "not given".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyInputs {
    pub model: ModelCapabilities,
    pub enable_prefix_caching: PrefixCachingRequest,
    pub mamba_cache_mode: MambaCacheModeRequest,
    pub enable_chunked_prefill: ChunkedPrefillRequest,
    pub speculative: Option<SpecRequest>,
    pub block_size: usize,
    pub mamba_block_size: Option<usize>,
    pub max_num_batched_tokens: Option<usize>,
    pub max_num_seqs: usize,
    pub max_model_len: Option<usize>,
    /// `--mamba-checkpoint-placement` (None = not given).
    pub checkpoint_placement: Option<CheckpointPlacement>,
    /// `--prefix-cache-eviction` (None = not given).
    pub eviction: Option<EvictionPolicy>,
}

impl PolicyInputs {
    /// Everything at its default for a model with these capabilities.
    pub fn new(model: ModelCapabilities) -> Self {
        PolicyInputs {
            model,
            enable_prefix_caching: PrefixCachingRequest::Auto,
            mamba_cache_mode: MambaCacheModeRequest::Auto,
            enable_chunked_prefill: ChunkedPrefillRequest::Auto,
            speculative: None,
            block_size: DEFAULT_BLOCK_SIZE,
            mamba_block_size: None,
            max_num_batched_tokens: None,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            max_model_len: None,
            checkpoint_placement: None,
            eviction: None,
        }
    }
}

/// How loud a decision is when logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecisionLevel {
    Info,
    Warning,
}

impl DecisionLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionLevel::Info => "info",
            DecisionLevel::Warning => "warning",
        }
    }
}

/// The stable identifier of a decision (shown in `--json`, matched by tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecisionCode {
    /// Prefix caching was not given and is on by default.
    PrefixCachingDefaultOn,
    /// Rule 1: prefix caching off → mode `none`.
    PrefixCachingOffModeNone,
    /// Rule 1: an explicit `align`/`all` is ignored because prefix caching is off.
    ModeIgnoredPrefixCachingOff,
    /// Rule 2: the model has no Mamba layers; the mode has no effect.
    NoMambaLayers,
    /// Rule 3: Auto + speculative decoding + boundary states → `align`.
    ModeAlignForSpeculative,
    /// Rule 3: Auto + no speculative decoding + boundary states → `all`.
    ModeAllDefault,
    /// Rule 3: Auto on a model that cannot emit boundary states → `align`.
    ModeAlignNoBoundaryStates,
    /// Rule 4: explicit `all` on a model that cannot emit boundary states → `align`.
    AllFallbackAlign,
    /// Rule 3: chunked prefill was Auto and `align` needs it: switched on.
    ChunkedPrefillOnForAlign,
    /// Chunked prefill was Auto and is on by default.
    ChunkedPrefillDefaultOn,
    /// Rule 6: explicit `none` with prefix caching on, on a hybrid model: no hit can happen.
    ModeNoneNoHits,
    /// M was not given: the auto value.
    MambaBlockSizeAuto,
    /// An explicit M has no effect (mode `none`).
    MambaBlockSizeIgnored,
    /// M exceeds max_model_len: no grid checkpoint can ever be hit.
    MambaBlockSizeExceedsMaxModelLen,
    /// max_model_len was not given: taken from the model (or the default).
    MaxModelLenDefault,
    /// max_num_batched_tokens was not given: the default for this configuration.
    MaxNumBatchedTokensDefault,
    /// The checkpoint placement was not given: branch points and last tokens.
    CheckpointPlacementDefault,
    /// An explicit checkpoint placement or eviction policy has no effect (no Mamba checkpoints).
    CheckpointSettingsIgnored,
    /// The eviction policy was not given: FLOP-aware.
    EvictionDefault,
}

impl DecisionCode {
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionCode::PrefixCachingDefaultOn => "prefix_caching_default_on",
            DecisionCode::PrefixCachingOffModeNone => "prefix_caching_off_mode_none",
            DecisionCode::ModeIgnoredPrefixCachingOff => "mode_ignored_prefix_caching_off",
            DecisionCode::NoMambaLayers => "no_mamba_layers",
            DecisionCode::ModeAlignForSpeculative => "mode_align_for_speculative",
            DecisionCode::ModeAllDefault => "mode_all_default",
            DecisionCode::ModeAlignNoBoundaryStates => "mode_align_no_boundary_states",
            DecisionCode::AllFallbackAlign => "all_fallback_align",
            DecisionCode::ChunkedPrefillOnForAlign => "chunked_prefill_on_for_align",
            DecisionCode::ChunkedPrefillDefaultOn => "chunked_prefill_default_on",
            DecisionCode::ModeNoneNoHits => "mode_none_no_hits",
            DecisionCode::MambaBlockSizeAuto => "mamba_block_size_auto",
            DecisionCode::MambaBlockSizeIgnored => "mamba_block_size_ignored",
            DecisionCode::MambaBlockSizeExceedsMaxModelLen => {
                "mamba_block_size_exceeds_max_model_len"
            }
            DecisionCode::MaxModelLenDefault => "max_model_len_default",
            DecisionCode::MaxNumBatchedTokensDefault => "max_num_batched_tokens_default",
            DecisionCode::CheckpointPlacementDefault => "checkpoint_placement_default",
            DecisionCode::CheckpointSettingsIgnored => "checkpoint_settings_ignored",
            DecisionCode::EvictionDefault => "eviction_default",
        }
    }
}

/// One choice the policy made, with its reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub code: DecisionCode,
    pub level: DecisionLevel,
    pub message: String,
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{}] {}: {}",
            self.level.as_str(),
            self.code.as_str(),
            self.message
        )
    }
}

/// The result of [`resolve`]: a configuration that passed [`ResolvedConfig::validate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolution {
    pub config: ResolvedConfig,
    pub decisions: Vec<Decision>,
}

impl Resolution {
    pub fn has_decision(&self, code: DecisionCode) -> bool {
        self.decisions.iter().any(|d| d.code == code)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The auto `mamba_block_size`: the smallest multiple of lcm(B, Q) that is at least 256.
/// B and Q must be in range (B <= MAX_BLOCK_SIZE, Q <= MAX_SCAN_CHUNK_SIZE), so nothing overflows.
pub fn auto_mamba_block_size(block_size: usize, scan_chunk_size: usize) -> usize {
    let b = block_size.max(1);
    let q = scan_chunk_size.max(1);
    let lcm = b / gcd(b, q) * q;
    lcm * MIN_AUTO_MAMBA_BLOCK_SIZE.div_ceil(lcm)
}

fn config_err<T>(m: impl Into<String>) -> HsResult<T> {
    Err(HsError::Config(m.into()))
}

/// Why the mode came out as it did (the chunked-prefill errors depend on it).
#[derive(Clone, Copy, PartialEq, Eq)]
enum AlignReason {
    NotAlign,
    Explicit,
    DefaultForSpeculative,
    DefaultNoBoundaryStates,
    FallbackFromAll,
}

/// Resolves the typed requests into a validated configuration and its decisions, or a
/// configuration error whose message names the flag(s) to change. Never panics.
pub fn resolve(inputs: &PolicyInputs) -> HsResult<Resolution> {
    use MambaCacheModeRequest as Req;

    let caps = inputs.model;
    let mut decisions: Vec<Decision> = Vec::new();
    let mut decide = |code: DecisionCode, level: DecisionLevel, message: String| {
        decisions.push(Decision {
            code,
            level,
            message,
        });
    };

    // --- the inputs on their own ---
    let b = inputs.block_size;
    check_flag("block_size", b)?;
    check_flag("max_num_seqs", inputs.max_num_seqs)?;
    if let Some(m) = inputs.mamba_block_size {
        check_flag("mamba_block_size", m)?;
    }
    if let Some(t) = inputs.max_num_batched_tokens {
        check_flag("max_num_batched_tokens", t)?;
    }
    if let Some(l) = inputs.max_model_len {
        check_flag("max_model_len", l)?;
    }
    if let Some(spec) = inputs.speculative {
        check_flag("num_speculative_tokens", spec.num_speculative_tokens)?;
    }
    let q = match (caps.has_mamba_layers, caps.scan_chunk_size) {
        (true, Some(q)) if (1..=MAX_SCAN_CHUNK_SIZE).contains(&q) => q,
        (true, Some(q)) => {
            return config_err(format!(
                "the model's scan chunk size (config.json chunk_size) is {q}; hybridserve supports \
                 1..={MAX_SCAN_CHUNK_SIZE}"
            ))
        }
        (true, None) => return config_err(
            "the model has Mamba layers but declares no scan chunk size (config.json chunk_size)",
        ),
        // No scan: Q is unused; B keeps every derived size a plain multiple of B.
        (false, _) => b,
    };
    let spec = inputs.speculative.map(|s| SpecConfig {
        method: s.method,
        num_speculative_tokens: s.num_speculative_tokens,
    });
    let k = spec.map_or(0, |s| s.num_speculative_tokens);

    // --- max_model_len ---
    let max_pos = caps.max_position_embeddings.filter(|&p| p >= 1);
    let max_model_len = match (inputs.max_model_len, max_pos) {
        (Some(l), Some(p)) if l > p => {
            return config_err(format!(
                "--max-model-len {l} exceeds the model's max_position_embeddings ({p}); lower \
                 --max-model-len to at most {p}"
            ))
        }
        (Some(l), _) => l,
        (None, Some(p)) if p < 2 => {
            return config_err(format!(
                "the model's config.json declares max_position_embeddings = {p}: a sequence needs \
                 at least 2 positions (a prompt token and an output token)"
            ))
        }
        (None, Some(p)) => {
            let l = p.min(MAX_TOKENS);
            decide(
                DecisionCode::MaxModelLenDefault,
                DecisionLevel::Info,
                format!("max_model_len = {l}, from the model's max_position_embeddings"),
            );
            l
        }
        (None, None) => {
            decide(
                DecisionCode::MaxModelLenDefault,
                DecisionLevel::Info,
                format!(
                    "max_model_len = {DEFAULT_MAX_MODEL_LEN} (default; the model declares no \
                     max_position_embeddings)"
                ),
            );
            DEFAULT_MAX_MODEL_LEN
        }
    };

    // --- prefix caching ---
    let pc_on = match inputs.enable_prefix_caching {
        PrefixCachingRequest::On => true,
        PrefixCachingRequest::Off => false,
        PrefixCachingRequest::Auto => {
            decide(
                DecisionCode::PrefixCachingDefaultOn,
                DecisionLevel::Info,
                "prefix caching is on (default); --no-enable-prefix-caching turns it off".into(),
            );
            true
        }
    };

    // --- the mode: one exhaustive match over the rules above ---
    let spec_on = spec.is_some();
    let sup = caps.supports_boundary_states;
    let mamba = caps.has_mamba_layers;
    let (mode, align_reason) = match (pc_on, mamba, inputs.mamba_cache_mode) {
        // Rule 1.
        (false, _, Req::Auto | Req::None) => {
            decide(
                DecisionCode::PrefixCachingOffModeNone,
                DecisionLevel::Info,
                "mamba_cache_mode = none: prefix caching is off".into(),
            );
            (MambaCacheMode::None, AlignReason::NotAlign)
        }
        (false, _, req @ (Req::Align | Req::All)) => {
            decide(
                DecisionCode::ModeIgnoredPrefixCachingOff,
                DecisionLevel::Warning,
                format!(
                    "--mamba-cache-mode {} is ignored because prefix caching is off; \
                     mamba_cache_mode = none (pass --enable-prefix-caching to use it)",
                    req.as_str()
                ),
            );
            (MambaCacheMode::None, AlignReason::NotAlign)
        }
        // Rule 2.
        (true, false, req) => {
            let (level, what) = match req {
                Req::Align | Req::All => (
                    DecisionLevel::Warning,
                    format!("--mamba-cache-mode {} has no effect", req.as_str()),
                ),
                Req::Auto | Req::None => {
                    (DecisionLevel::Info, "mamba_cache_mode = none".to_string())
                }
            };
            decide(
                DecisionCode::NoMambaLayers,
                level,
                format!("the model has no Mamba layers: {what}; prefix caching covers the KV cache only"),
            );
            (MambaCacheMode::None, AlignReason::NotAlign)
        }
        // Rule 3.
        (true, true, Req::Auto) => match (spec_on, sup) {
            (true, true) => {
                decide(
                    DecisionCode::ModeAlignForSpeculative,
                    DecisionLevel::Info,
                    "mamba_cache_mode = align (default with prefix caching and speculative \
                     decoding; --mamba-cache-mode all overrides)"
                        .into(),
                );
                (MambaCacheMode::Align, AlignReason::DefaultForSpeculative)
            }
            (false, true) => {
                decide(
                    DecisionCode::ModeAllDefault,
                    DecisionLevel::Info,
                    "mamba_cache_mode = all (default with prefix caching and no speculative \
                     decoding: the scan emits the state at every checkpoint boundary)"
                        .into(),
                );
                (MambaCacheMode::All, AlignReason::NotAlign)
            }
            (_, false) => {
                decide(
                    DecisionCode::ModeAlignNoBoundaryStates,
                    DecisionLevel::Info,
                    "mamba_cache_mode = align (default: the model's scan cannot emit boundary \
                     states, so all is not available)"
                        .into(),
                );
                (MambaCacheMode::Align, AlignReason::DefaultNoBoundaryStates)
            }
        },
        // Rule 4.
        (true, true, Req::All) if !sup => {
            decide(
                DecisionCode::AllFallbackAlign,
                DecisionLevel::Warning,
                "--mamba-cache-mode all needs a scan that emits boundary states, which this model \
                 lacks: falling back to mamba_cache_mode = align"
                    .into(),
            );
            (MambaCacheMode::Align, AlignReason::FallbackFromAll)
        }
        (true, true, Req::All) => (MambaCacheMode::All, AlignReason::NotAlign),
        // Rule 5 is checked with chunked prefill below.
        (true, true, Req::Align) => (MambaCacheMode::Align, AlignReason::Explicit),
        // Rule 6.
        (true, true, Req::None) => {
            decide(
                DecisionCode::ModeNoneNoHits,
                DecisionLevel::Warning,
                "--mamba-cache-mode none with prefix caching on, on a hybrid model: no prefix hit \
                 is possible (a hit needs the Mamba state too); choose align or all, or pass \
                 --no-enable-prefix-caching"
                    .into(),
            );
            (MambaCacheMode::None, AlignReason::NotAlign)
        }
    };

    // --- chunked prefill (rules 3 and 5) ---
    // The way out besides chunked prefill: mode `all` only where the scan can emit boundary
    // states (elsewhere `all` falls back to align, and the same error comes back).
    let other_way = if sup {
        "choose --mamba-cache-mode all"
    } else {
        "turn Mamba prefix caching off (--mamba-cache-mode none or --no-enable-prefix-caching): \
         this model's scan cannot emit boundary states, so mode all is not available"
    };
    let chunked = match (align_reason, inputs.enable_chunked_prefill) {
        (AlignReason::Explicit, ChunkedPrefillRequest::Off) => {
            return config_err(format!(
                "--mamba-cache-mode align needs chunked prefill, which --no-enable-chunked-prefill \
                 turns off: remove --no-enable-chunked-prefill (or pass --enable-chunked-prefill), \
                 or {other_way}"
            ))
        }
        (AlignReason::DefaultForSpeculative, ChunkedPrefillRequest::Off) => {
            return config_err(format!(
                "with prefix caching and speculative decoding the default mamba cache mode is \
                 align, which needs chunked prefill, but --no-enable-chunked-prefill turns it off: \
                 either turn chunked prefill on (--enable-chunked-prefill) or {other_way}"
            ))
        }
        (
            AlignReason::DefaultNoBoundaryStates | AlignReason::FallbackFromAll,
            ChunkedPrefillRequest::Off,
        ) => {
            return config_err(
                "this model can only cache its Mamba state in align mode (its scan cannot emit \
                 boundary states), which needs chunked prefill, but --no-enable-chunked-prefill \
                 turns it off: either turn chunked prefill on (--enable-chunked-prefill) or turn \
                 Mamba prefix caching off (--mamba-cache-mode none or --no-enable-prefix-caching)",
            )
        }
        (AlignReason::NotAlign, ChunkedPrefillRequest::Off) => false,
        (_, ChunkedPrefillRequest::On) => true,
        (AlignReason::NotAlign, ChunkedPrefillRequest::Auto) => {
            decide(
                DecisionCode::ChunkedPrefillDefaultOn,
                DecisionLevel::Info,
                "chunked prefill is on (default); --no-enable-chunked-prefill turns it off".into(),
            );
            true
        }
        (_, ChunkedPrefillRequest::Auto) => {
            decide(
                DecisionCode::ChunkedPrefillOnForAlign,
                DecisionLevel::Info,
                "chunked prefill is on: mamba_cache_mode align requires it".into(),
            );
            true
        }
    };

    // --- mamba_block_size (M) ---
    let auto_m = auto_mamba_block_size(b, q);
    let m = match (mode, inputs.mamba_block_size) {
        (_, Some(_)) if !pc_on => {
            return config_err(
                "--mamba-block-size can only be set with prefix caching on: remove \
                 --mamba-block-size or pass --enable-prefix-caching",
            )
        }
        (MambaCacheMode::None, Some(given)) => {
            decide(
                DecisionCode::MambaBlockSizeIgnored,
                DecisionLevel::Warning,
                format!(
                    "--mamba-block-size {given} has no effect with mamba_cache_mode none \
                     (mamba_block_size = {auto_m}, unused)"
                ),
            );
            auto_m
        }
        (MambaCacheMode::None, None) => auto_m,
        (MambaCacheMode::Align | MambaCacheMode::All, Some(given)) => {
            if given % b != 0 {
                return config_err(format!(
                    "--mamba-block-size {given} must be a multiple of --block-size {b}"
                ));
            }
            given
        }
        (MambaCacheMode::Align | MambaCacheMode::All, None) => {
            decide(
                DecisionCode::MambaBlockSizeAuto,
                DecisionLevel::Info,
                format!(
                    "mamba_block_size = {auto_m}: the smallest multiple of lcm(block_size {b}, scan \
                     chunk size {q}) that is at least {MIN_AUTO_MAMBA_BLOCK_SIZE} (the interval of \
                     grid checkpoints)"
                ),
            );
            auto_m
        }
    };
    if mode != MambaCacheMode::None && m > max_model_len {
        decide(
            DecisionCode::MambaBlockSizeExceedsMaxModelLen,
            DecisionLevel::Warning,
            format!(
                "mamba_block_size {m} exceeds max_model_len {max_model_len}: no grid checkpoint \
                 can ever be hit (branch points, declared prefixes and last tokens still can); for \
                 grid checkpoints, lower --mamba-block-size"
            ),
        );
    }

    // --- the token budget ---
    let align = mode == MambaCacheMode::Align;
    let t = match inputs.max_num_batched_tokens {
        Some(t) => t,
        None => {
            let (t, why) = match (chunked, align) {
                (false, _) => (
                    DEFAULT_MAX_NUM_BATCHED_TOKENS.max(max_model_len),
                    "with chunked prefill off a whole prompt must fit in one step",
                ),
                (true, true) if m > DEFAULT_MAX_NUM_BATCHED_TOKENS => (
                    m,
                    "raised to mamba_block_size: align schedules whole checkpoint intervals",
                ),
                (true, _) => (DEFAULT_MAX_NUM_BATCHED_TOKENS, "default"),
            };
            let t = t.max(1 + k);
            decide(
                DecisionCode::MaxNumBatchedTokensDefault,
                DecisionLevel::Info,
                format!("max_num_batched_tokens = {t} ({why})"),
            );
            t
        }
    };
    if align && t < m {
        return config_err(format!(
            "mamba_cache_mode align needs --max-num-batched-tokens ({t}) >= mamba_block_size ({m}), \
             else a prompt could never be scheduled: raise --max-num-batched-tokens or lower \
             --mamba-block-size"
        ));
    }
    if !chunked && t < max_model_len {
        return config_err(format!(
            "with chunked prefill off a whole prompt must fit in one step: raise \
             --max-num-batched-tokens ({t}) to at least --max-model-len ({max_model_len}), lower \
             --max-model-len, or pass --enable-chunked-prefill"
        ));
    }
    if t < 1 + k {
        return config_err(format!(
            "--max-num-batched-tokens ({t}) must be at least 1 + num_speculative_tokens ({k}): {}",
            1 + k
        ));
    }
    if k >= max_model_len {
        return config_err(format!(
            "--speculative-config num_speculative_tokens ({k}) must be less than --max-model-len \
             ({max_model_len})"
        ));
    }

    // --- checkpoint placement and eviction (only where Mamba checkpoints exist) ---
    let checkpoints = mode != MambaCacheMode::None;
    if !checkpoints {
        let given: Vec<&str> = [
            inputs
                .checkpoint_placement
                .map(|_| "--mamba-checkpoint-placement"),
            inputs.eviction.map(|_| "--prefix-cache-eviction"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if !given.is_empty() {
            decide(
                DecisionCode::CheckpointSettingsIgnored,
                DecisionLevel::Warning,
                format!(
                    "{} has no effect: mamba_cache_mode is none, so no Mamba checkpoint is kept",
                    given.join(" and ")
                ),
            );
        }
    }
    let placement = match inputs.checkpoint_placement {
        Some(p) => p,
        None => {
            let (placement, how) = match mode {
                // The scan emits a grid state at no cost: grid points ride along, in spare room.
                MambaCacheMode::All => (
                    CheckpointPlacement::BranchAndGrid,
                    format!(
                        "the scan emits it there), after the last token of every finished \
                         sequence, and every {m} tokens where the state pool has spare room \
                         (grid points never push out a checkpoint placed for a reason, but for \
                         last-token states while no request resumes them); \
                         --mamba-checkpoint-placement branch drops the grid points, grid keeps \
                         only them"
                    ),
                ),
                // A grid point would cut a prefill chunk short: branch points and last tokens only.
                MambaCacheMode::Align | MambaCacheMode::None => (
                    CheckpointPlacement::Branch,
                    format!(
                        "a prefill chunk ends there) and after the last token of every finished \
                         sequence, so hits land on the real shared-prefix boundary instead of a \
                         grid of {m} tokens; --mamba-checkpoint-placement grid or branch+grid keeps \
                         the grid"
                    ),
                ),
            };
            if checkpoints {
                decide(
                    DecisionCode::CheckpointPlacementDefault,
                    DecisionLevel::Info,
                    format!(
                        "mamba checkpoint placement = {} (default): the state is kept where prompts \
                         share a prefix (when a prompt's cached KV prefix reaches past its state \
                         hit, at the deepest cached block, and by the first user of a prompt's \
                         declared shared prefix, its first chat message, see \
                         --shared-prefix-markers; {how}",
                        placement.as_str()
                    ),
                );
            }
            placement
        }
    };
    let eviction = match inputs.eviction {
        Some(e) => e,
        None => {
            if checkpoints {
                decide(
                    DecisionCode::EvictionDefault,
                    DecisionLevel::Info,
                    "prefix cache eviction = flops (default): a full Mamba pool evicts the \
                     checkpoint with the lowest mix of recency and prefill FLOPs saved per byte \
                     held; a hit refreshes only the checkpoint it used; KV blocks no hit can use \
                     go first; --prefix-cache-eviction lru for plain LRU"
                        .into(),
                );
            }
            EvictionPolicy::Flops
        }
    };

    let config = ResolvedConfig {
        has_mamba_layers: mamba,
        enable_prefix_caching: pc_on,
        mamba_cache_mode: mode,
        enable_chunked_prefill: chunked,
        block_size: b,
        mamba_block_size: m,
        scan_chunk_size: q,
        max_num_batched_tokens: t,
        max_num_seqs: inputs.max_num_seqs,
        max_model_len,
        speculative: spec,
        checkpoint_placement: placement,
        eviction,
    };
    // The rules above are meant to make this unreachable; a failure is a bug in the policy.
    if let Err(e) = config.validate() {
        return Err(HsError::Internal(format!(
            "the policy produced an invalid configuration: {e}"
        )));
    }
    Ok(Resolution { config, decisions })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{MAX_BLOCK_SIZE, MAX_SPECULATIVE_TOKENS};
    use proptest::prelude::*;

    const HYBRID: ModelCapabilities = ModelCapabilities {
        has_mamba_layers: true,
        supports_boundary_states: true,
        scan_chunk_size: Some(128),
        max_position_embeddings: Some(8192),
    };

    fn model(kind: &str) -> ModelCapabilities {
        match kind {
            "hybrid" => HYBRID,
            "hybrid-nosup" => ModelCapabilities {
                supports_boundary_states: false,
                ..HYBRID
            },
            "attn" => ModelCapabilities {
                has_mamba_layers: false,
                supports_boundary_states: false,
                scan_chunk_size: None,
                max_position_embeddings: Some(8192),
            },
            other => panic!("unknown model kind {other}"),
        }
    }

    /// `"key":value` out of the flat JSON object of `--speculative-config` (test helper only).
    fn json_field<'a>(json: &'a str, key: &str) -> Option<&'a str> {
        let pat = format!("\"{key}\":");
        let start = json.find(&pat)? + pat.len();
        let rest = &json[start..];
        let end = rest.find([',', '}']).unwrap_or(rest.len());
        Some(rest[..end].trim().trim_matches('"'))
    }

    /// The CLI flags of a table row, parsed the way `hybridserve config` parses them.
    fn parse_flags(kind: &str, flags: &str) -> PolicyInputs {
        let mut inputs = PolicyInputs::new(model(kind));
        let mut it = flags.split_whitespace();
        let num = |v: Option<&str>| -> usize { v.and_then(|s| s.parse().ok()).expect("a number") };
        while let Some(flag) = it.next() {
            match flag {
                "--enable-prefix-caching" => {
                    inputs.enable_prefix_caching = PrefixCachingRequest::On
                }
                "--no-enable-prefix-caching" => {
                    inputs.enable_prefix_caching = PrefixCachingRequest::Off
                }
                "--enable-chunked-prefill" => {
                    inputs.enable_chunked_prefill = ChunkedPrefillRequest::On
                }
                "--no-enable-chunked-prefill" => {
                    inputs.enable_chunked_prefill = ChunkedPrefillRequest::Off
                }
                "--mamba-cache-mode" => {
                    inputs.mamba_cache_mode = it.next().expect("a mode").parse().expect("a mode")
                }
                "--speculative-config" => {
                    let json = it.next().expect("json");
                    inputs.speculative = Some(SpecRequest {
                        method: json_field(json, "method")
                            .expect("method")
                            .parse()
                            .expect("method"),
                        num_speculative_tokens: num(json_field(json, "num_speculative_tokens")),
                    });
                }
                "--block-size" => inputs.block_size = num(it.next()),
                "--mamba-block-size" => inputs.mamba_block_size = Some(num(it.next())),
                "--max-num-batched-tokens" => inputs.max_num_batched_tokens = Some(num(it.next())),
                "--max-num-seqs" => inputs.max_num_seqs = num(it.next()),
                "--max-model-len" => inputs.max_model_len = Some(num(it.next())),
                "--mamba-checkpoint-placement" => {
                    inputs.checkpoint_placement = Some(
                        it.next()
                            .expect("a placement")
                            .parse()
                            .expect("a placement"),
                    )
                }
                "--prefix-cache-eviction" => {
                    inputs.eviction = Some(it.next().expect("a policy").parse().expect("a policy"))
                }
                other => panic!("flag {other} not known to the table parser"),
            }
        }
        inputs
    }

    fn on_off(b: bool) -> &'static str {
        if b {
            "on"
        } else {
            "off"
        }
    }

    /// Checks one expectation of the table against a result; returns the failures.
    fn check_case(expect: &str, result: &HsResult<Resolution>) -> Vec<String> {
        let mut tokens = expect.split_whitespace();
        let mut failures = Vec::new();
        match (tokens.next(), result) {
            (Some("ok"), Ok(res)) => {
                let c = &res.config;
                for tok in tokens {
                    if let Some(code) = tok.strip_prefix('+') {
                        let (code, level) = code.split_once(':').unwrap_or((code, ""));
                        let found = res.decisions.iter().any(|d| {
                            d.code.as_str() == code
                                && (level.is_empty() || d.level.as_str() == level)
                        });
                        if !found {
                            failures.push(format!("missing decision {tok}: {:?}", res.decisions));
                        }
                    } else if let Some(code) = tok.strip_prefix('-') {
                        if res.decisions.iter().any(|d| d.code.as_str() == code) {
                            failures.push(format!("unexpected decision {code}"));
                        }
                    } else {
                        let (key, want) = tok.split_once('=').expect("key=value");
                        let got = match key {
                            "mode" => c.mamba_cache_mode.as_str().to_string(),
                            "pc" => on_off(c.enable_prefix_caching).to_string(),
                            "chunked" => on_off(c.enable_chunked_prefill).to_string(),
                            "M" => c.mamba_block_size.to_string(),
                            "T" => c.max_num_batched_tokens.to_string(),
                            "L" => c.max_model_len.to_string(),
                            "k" => c.num_speculative_tokens().to_string(),
                            "place" => c.checkpoint_placement.as_str().to_string(),
                            "evict" => c.eviction.as_str().to_string(),
                            other => panic!("unknown key {other}"),
                        };
                        if got != want {
                            failures.push(format!("{key}: want {want}, got {got}"));
                        }
                    }
                }
            }
            (Some("err"), Err(HsError::Config(msg))) => {
                for tok in tokens {
                    let needle = tok.replace('~', " ");
                    if !msg.contains(&needle) {
                        failures.push(format!("error message lacks {needle:?}: {msg}"));
                    }
                }
            }
            (want, got) => failures.push(format!("want {want:?}, got {got:?}")),
        }
        failures
    }

    #[test]
    fn table_cases() {
        let table = include_str!("../tests/config/policy_cases.txt");
        let mut rules_seen = std::collections::BTreeSet::new();
        let mut n = 0;
        for line in table.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let cols: Vec<&str> = line.split('|').map(str::trim).collect();
            assert_eq!(cols.len(), 4, "bad table line: {line}");
            let (name, kind, flags, expect) = (cols[0], cols[1], cols[2], cols[3]);
            let result = resolve(&parse_flags(kind, flags));
            let failures = check_case(expect, &result);
            assert!(failures.is_empty(), "case {name}: {failures:#?}");
            if let Ok(res) = &result {
                assert_eq!(res.config.validate(), Ok(()), "case {name}");
            }
            rules_seen.insert(name.split('_').next().unwrap_or("").to_string());
            n += 1;
        }
        assert!(n >= 30, "only {n} cases");
        let want: std::collections::BTreeSet<String> =
            (1..=8).map(|r| format!("rule{r}")).collect();
        assert_eq!(rules_seen, want, "every policy rule has a case");
    }

    fn spec(k: usize) -> Option<SpecRequest> {
        Some(SpecRequest {
            method: SpecMethod::Ngram,
            num_speculative_tokens: k,
        })
    }

    #[test]
    fn seed_prefix_caching_with_speculation_gives_align_with_chunked_prefill() {
        let mut inputs = PolicyInputs::new(HYBRID);
        inputs.enable_prefix_caching = PrefixCachingRequest::On;
        inputs.speculative = spec(3);
        let res = resolve(&inputs).expect("resolves");
        assert_eq!(res.config.mamba_cache_mode, MambaCacheMode::Align);
        assert!(res.config.enable_chunked_prefill);
        assert!(res.has_decision(DecisionCode::ModeAlignForSpeculative));
        assert!(res.has_decision(DecisionCode::ChunkedPrefillOnForAlign));
        assert_eq!(res.config.num_speculative_tokens(), 3);
    }

    #[test]
    fn seed_prefix_caching_without_speculation_gives_all() {
        let mut inputs = PolicyInputs::new(HYBRID);
        inputs.enable_prefix_caching = PrefixCachingRequest::On;
        let res = resolve(&inputs).expect("resolves");
        assert_eq!(res.config.mamba_cache_mode, MambaCacheMode::All);
        assert!(res.has_decision(DecisionCode::ModeAllDefault));
        assert_eq!(res.config.mamba_block_size % res.config.scan_chunk_size, 0);
        assert_eq!(
            res.config.checkpoint_placement,
            CheckpointPlacement::BranchAndGrid
        );
        assert_eq!(res.config.eviction, EvictionPolicy::Flops);
    }

    #[test]
    fn placement_and_eviction_parse_and_reject_unknown_names() {
        for p in [
            CheckpointPlacement::Branch,
            CheckpointPlacement::Grid,
            CheckpointPlacement::BranchAndGrid,
        ] {
            assert_eq!(p.as_str().parse::<CheckpointPlacement>(), Ok(p));
        }
        for e in [
            EvictionPolicy::Flops,
            EvictionPolicy::Lru,
            EvictionPolicy::LruPath,
        ] {
            assert_eq!(e.as_str().parse::<EvictionPolicy>(), Ok(e));
        }
        match "everywhere".parse::<CheckpointPlacement>() {
            Err(HsError::Config(m)) => assert!(m.contains("--mamba-checkpoint-placement"), "{m}"),
            other => panic!("{other:?}"),
        }
        match "fifo".parse::<EvictionPolicy>() {
            Err(HsError::Config(m)) => assert!(m.contains("--prefix-cache-eviction"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn seed_chunked_prefill_off_with_speculation_is_an_error_naming_both_fixes() {
        let mut inputs = PolicyInputs::new(HYBRID);
        inputs.enable_prefix_caching = PrefixCachingRequest::On;
        inputs.speculative = spec(3);
        inputs.enable_chunked_prefill = ChunkedPrefillRequest::Off;
        match resolve(&inputs) {
            Err(HsError::Config(msg)) => {
                assert!(msg.contains("--enable-chunked-prefill"), "{msg}");
                assert!(msg.contains("--mamba-cache-mode all"), "{msg}");
            }
            other => panic!("want a configuration error, got {other:?}"),
        }
        // Taking the second fix resolves.
        inputs.mamba_cache_mode = MambaCacheModeRequest::All;
        let res = resolve(&inputs).expect("the named fix works");
        assert_eq!(res.config.mamba_cache_mode, MambaCacheMode::All);
        assert!(!res.config.enable_chunked_prefill);
    }

    #[test]
    fn auto_mamba_block_size_values() {
        assert_eq!(auto_mamba_block_size(16, 128), 256);
        assert_eq!(auto_mamba_block_size(16, 256), 256);
        assert_eq!(auto_mamba_block_size(16, 64), 256);
        assert_eq!(auto_mamba_block_size(48, 128), 384);
        assert_eq!(auto_mamba_block_size(16, 100), 400);
        assert_eq!(auto_mamba_block_size(16, 512), 512);
        assert_eq!(auto_mamba_block_size(1, 1), 256);
        assert_eq!(
            auto_mamba_block_size(MAX_BLOCK_SIZE, MAX_SCAN_CHUNK_SIZE),
            4096
        );
    }

    #[test]
    fn enums_parse_their_lowercase_strings() {
        assert_eq!(
            "none".parse::<MambaCacheModeRequest>(),
            Ok(MambaCacheModeRequest::None)
        );
        assert_eq!(
            "auto".parse::<MambaCacheModeRequest>(),
            Ok(MambaCacheModeRequest::Auto)
        );
        assert_eq!(
            "all".parse::<MambaCacheModeRequest>(),
            Ok(MambaCacheModeRequest::All)
        );
        assert_eq!(
            "align".parse::<MambaCacheModeRequest>(),
            Ok(MambaCacheModeRequest::Align)
        );
        assert!("ALL".parse::<MambaCacheModeRequest>().is_err());
        assert_eq!(
            "off".parse::<ChunkedPrefillRequest>(),
            Ok(ChunkedPrefillRequest::Off)
        );
        assert_eq!(
            "on".parse::<PrefixCachingRequest>(),
            Ok(PrefixCachingRequest::On)
        );
        assert_eq!(
            "draft_model".parse::<SpecMethod>(),
            Ok(SpecMethod::DraftModel)
        );
        for m in [
            MambaCacheModeRequest::Auto,
            MambaCacheModeRequest::None,
            MambaCacheModeRequest::Align,
            MambaCacheModeRequest::All,
        ] {
            assert_eq!(m.as_str().parse::<MambaCacheModeRequest>(), Ok(m));
        }
        match "fast".parse::<MambaCacheModeRequest>() {
            Err(HsError::Config(msg)) => assert!(msg.contains("--mamba-cache-mode"), "{msg}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn for_tests_configs_are_valid() {
        for mode in [
            MambaCacheMode::None,
            MambaCacheMode::Align,
            MambaCacheMode::All,
        ] {
            for k in [0, 1, 4] {
                assert_eq!(ResolvedConfig::for_tests(mode, k).validate(), Ok(()));
            }
        }
    }

    #[test]
    fn pool_sizes_must_hold_one_full_request() {
        let cfg = ResolvedConfig::for_tests(MambaCacheMode::Align, 2); // B = 4, L = 4096, K = 2
        let need = 1 + (4096 + 2usize).div_ceil(4);
        assert_eq!(cfg.validate_pool_sizes(need, 4), Ok(()));
        match cfg.validate_pool_sizes(need - 1, 4) {
            Err(HsError::Config(msg)) => assert!(msg.contains("--num-kv-blocks"), "{msg}"),
            other => panic!("{other:?}"),
        }
        match cfg.validate_pool_sizes(need, 3) {
            Err(HsError::Config(msg)) => assert!(msg.contains("--num-mamba-slots"), "{msg}"),
            other => panic!("{other:?}"),
        }
        let mut attn = cfg.clone();
        attn.has_mamba_layers = false;
        attn.mamba_cache_mode = MambaCacheMode::None;
        assert_eq!(attn.validate_pool_sizes(need, 0), Ok(()));
    }

    #[test]
    fn validate_rejects_broken_configs() {
        let good = ResolvedConfig::for_tests(MambaCacheMode::Align, 0);
        let broken = [
            ResolvedConfig {
                enable_chunked_prefill: false,
                ..good.clone()
            },
            ResolvedConfig {
                max_num_batched_tokens: 4,
                ..good.clone()
            },
            ResolvedConfig {
                mamba_block_size: 6,
                ..good.clone()
            },
            ResolvedConfig {
                has_mamba_layers: false,
                ..good.clone()
            },
            ResolvedConfig {
                enable_prefix_caching: false,
                ..good.clone()
            },
            ResolvedConfig {
                block_size: 0,
                ..good.clone()
            },
            ResolvedConfig {
                speculative: Some(SpecConfig {
                    method: SpecMethod::Ngram,
                    num_speculative_tokens: 0,
                }),
                ..good.clone()
            },
        ];
        for cfg in broken {
            assert!(matches!(cfg.validate(), Err(HsError::Config(_))), "{cfg:?}");
        }
    }

    fn mode_req() -> impl Strategy<Value = MambaCacheModeRequest> {
        prop_oneof![
            Just(MambaCacheModeRequest::Auto),
            Just(MambaCacheModeRequest::None),
            Just(MambaCacheModeRequest::Align),
            Just(MambaCacheModeRequest::All),
        ]
    }

    fn tri() -> impl Strategy<Value = Option<bool>> {
        prop_oneof![Just(None), Just(Some(true)), Just(Some(false))]
    }

    /// A size: mostly plausible, sometimes 0 or out of range.
    fn size(hi: usize) -> impl Strategy<Value = usize> {
        prop_oneof![
            30 => 1..=hi,
            1 => Just(0usize),
            1 => Just(usize::MAX),
            1 => (MAX_TOKENS - 2)..(MAX_TOKENS + 2),
        ]
    }

    /// An optional size: None (auto) often, a power of two often, anything sometimes.
    fn opt_size(hi: usize) -> impl Strategy<Value = Option<usize>> {
        prop_oneof![
            6 => Just(None),
            3 => (4u32..14).prop_map(|e| Some(1usize << e)),
            2 => size(hi).prop_map(Some),
        ]
    }

    fn inputs() -> impl Strategy<Value = PolicyInputs> {
        let q = prop_oneof![
            6 => prop_oneof![Just(64usize), Just(128), Just(256)].prop_map(Some),
            1 => Just(None),
            2 => size(600).prop_map(Some),
        ];
        let caps = (any::<bool>(), any::<bool>(), q, opt_size(20_000)).prop_map(|(m, s, q, p)| {
            ModelCapabilities {
                has_mamba_layers: m,
                supports_boundary_states: s,
                scan_chunk_size: q,
                max_position_embeddings: p,
            }
        });
        let k =
            prop_oneof![8 => 1usize..=MAX_SPECULATIVE_TOKENS, 1 => Just(0usize), 1 => 17usize..40];
        let spec = proptest::option::of((any::<bool>(), k)).prop_map(|o| {
            o.map(|(draft, k)| SpecRequest {
                method: if draft {
                    SpecMethod::DraftModel
                } else {
                    SpecMethod::Ngram
                },
                num_speculative_tokens: k,
            })
        });
        let b = prop_oneof![6 => (0u32..8).prop_map(|e| 1usize << e), 2 => size(80)];
        (
            caps,
            (tri(), mode_req(), tri()),
            spec,
            (b, opt_size(5000), opt_size(10_000)),
            (size(300), opt_size(20_000)),
        )
            .prop_map(
                |(model, (pc, mode, cp), speculative, (b, m, t), (seqs, l))| PolicyInputs {
                    model,
                    enable_prefix_caching: PrefixCachingRequest::from_option(pc),
                    mamba_cache_mode: mode,
                    enable_chunked_prefill: ChunkedPrefillRequest::from_option(cp),
                    speculative,
                    block_size: b,
                    mamba_block_size: m,
                    max_num_batched_tokens: t,
                    max_num_seqs: seqs,
                    max_model_len: l,
                    checkpoint_placement: None,
                    eviction: None,
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

        #[test]
        fn resolve_is_total_and_its_results_hold(inputs in inputs()) {
            match resolve(&inputs) {
                Err(HsError::Config(msg)) => {
                    // Every error names what to change: a flag, or the model's config.json.
                    prop_assert!(msg.contains("--") || msg.contains("config.json"), "{}", msg);
                }
                Err(other) => prop_assert!(false, "not a configuration error: {:?}", other),
                Ok(res) => {
                    let c = &res.config;
                    prop_assert_eq!(c.validate(), Ok(()));
                    // align is never resolved with chunked prefill off.
                    prop_assert!(c.mamba_cache_mode != MambaCacheMode::Align || c.enable_chunked_prefill);
                    // all only where the scan emits boundary states.
                    prop_assert!(c.mamba_cache_mode != MambaCacheMode::All
                        || inputs.model.supports_boundary_states);
                    prop_assert!(c.mamba_cache_mode == MambaCacheMode::None
                        || (c.has_mamba_layers && c.enable_prefix_caching));
                    // Explicit choices are kept, or changed only with a decision that says so.
                    let warned = |code: DecisionCode| res.decisions.iter()
                        .any(|d| d.code == code && d.level == DecisionLevel::Warning);
                    match inputs.mamba_cache_mode {
                        MambaCacheModeRequest::Auto => {}
                        MambaCacheModeRequest::None => prop_assert_eq!(c.mamba_cache_mode, MambaCacheMode::None),
                        req => if c.mamba_cache_mode.as_str() != req.as_str() {
                            prop_assert!(warned(DecisionCode::ModeIgnoredPrefixCachingOff)
                                || warned(DecisionCode::NoMambaLayers)
                                || warned(DecisionCode::AllFallbackAlign), "{:?}", res.decisions);
                        },
                    }
                    match inputs.enable_prefix_caching {
                        PrefixCachingRequest::On => prop_assert!(c.enable_prefix_caching),
                        PrefixCachingRequest::Off => prop_assert!(!c.enable_prefix_caching),
                        PrefixCachingRequest::Auto => prop_assert!(res.has_decision(DecisionCode::PrefixCachingDefaultOn)),
                    }
                    match inputs.enable_chunked_prefill {
                        ChunkedPrefillRequest::On => prop_assert!(c.enable_chunked_prefill),
                        ChunkedPrefillRequest::Off => prop_assert!(!c.enable_chunked_prefill),
                        ChunkedPrefillRequest::Auto => prop_assert!(
                            res.has_decision(DecisionCode::ChunkedPrefillDefaultOn)
                                || res.has_decision(DecisionCode::ChunkedPrefillOnForAlign)),
                    }
                    if let Some(m) = inputs.mamba_block_size {
                        prop_assert!(c.mamba_block_size == m || warned(DecisionCode::MambaBlockSizeIgnored));
                    }
                    if let Some(t) = inputs.max_num_batched_tokens {
                        prop_assert_eq!(c.max_num_batched_tokens, t);
                    }
                    if let Some(l) = inputs.max_model_len {
                        prop_assert_eq!(c.max_model_len, l);
                    }
                    prop_assert_eq!(c.block_size, inputs.block_size);
                    prop_assert_eq!(c.max_num_seqs, inputs.max_num_seqs);
                    prop_assert_eq!(c.speculative.map(|s| (s.method, s.num_speculative_tokens)),
                        inputs.speculative.map(|s| (s.method, s.num_speculative_tokens)));
                    prop_assert!(res.decisions.iter().all(|d| !d.message.is_empty()));
                }
            }
        }
    }
}
