//! PyO3 wrappers of the cache-mode policy: `resolve_policy(...) -> ResolvedConfig`, `Decision`,
//! and the policy's defaults and limits as module constants.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyString, PyTuple};

use super::errors::to_pyerr;
use crate::cache::CheckpointKind;
use crate::config::{
    check_flag, one_of, CheckpointPlacement, EvictionPolicy, MambaCacheMode, ResolvedConfig,
    SpecMethod, FLAG_LIMITS, MAX_BLOCK_SIZE, MAX_KV_BLOCKS, MAX_MAMBA_SLOTS, MAX_NUM_SEQS,
    MAX_SCAN_CHUNK_SIZE, MAX_SPECULATIVE_TOKENS, MAX_TOKENS,
};
use crate::error::HsError;
use crate::policy::{
    self, ChunkedPrefillRequest, Decision, MambaCacheModeRequest, ModelCapabilities, PolicyInputs,
    PrefixCachingRequest, SpecRequest, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, MIN_AUTO_MAMBA_BLOCK_SIZE,
};

/// One decision of the policy: `code` (stable identifier), `level` ("info" | "warning"), `message`.
#[pyclass(name = "Decision", module = "hybridserve._core", frozen)]
#[derive(Clone)]
pub(crate) struct PyDecision {
    inner: Decision,
}

#[pymethods]
impl PyDecision {
    #[getter]
    fn code(&self) -> &'static str {
        self.inner.code.as_str()
    }
    #[getter]
    fn level(&self) -> &'static str {
        self.inner.level.as_str()
    }
    #[getter]
    fn message(&self) -> &str {
        &self.inner.message
    }
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        decision_dict(py, &self.inner)
    }
    fn __repr__(&self) -> String {
        format!(
            "Decision(code={:?}, level={:?}, message={:?})",
            self.inner.code.as_str(),
            self.inner.level.as_str(),
            self.inner.message
        )
    }
}

fn decision_dict<'py>(py: Python<'py>, d: &Decision) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("code", d.code.as_str())?;
    out.set_item("level", d.level.as_str())?;
    out.set_item("message", &d.message)?;
    Ok(out)
}

/// The validated engine configuration (Rust `ResolvedConfig`) and the decisions that produced it.
/// Other wrappers (the scheduler) take it and read `inner`.
#[pyclass(name = "ResolvedConfig", module = "hybridserve._core", frozen)]
pub(crate) struct PyResolvedConfig {
    pub(crate) inner: ResolvedConfig,
    pub(crate) decisions: Vec<Decision>,
}

fn parse_mode(s: &str) -> PyResult<MambaCacheMode> {
    let all = MambaCacheMode::ALL;
    all.iter()
        .copied()
        .find(|m| m.as_str() == s)
        .ok_or_else(|| {
            to_pyerr(HsError::Config(format!(
                "mamba_cache_mode must be one of {}; got {s:?}",
                one_of(&all, MambaCacheMode::as_str)
            )))
        })
}

#[pymethods]
impl PyResolvedConfig {
    #[getter]
    fn has_mamba_layers(&self) -> bool {
        self.inner.has_mamba_layers
    }
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.enable_prefix_caching
    }
    /// "none" | "align" | "all"
    #[getter]
    fn mamba_cache_mode(&self) -> &'static str {
        self.inner.mamba_cache_mode.as_str()
    }
    #[getter]
    fn enable_chunked_prefill(&self) -> bool {
        self.inner.enable_chunked_prefill
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size
    }
    #[getter]
    fn mamba_block_size(&self) -> usize {
        self.inner.mamba_block_size
    }
    #[getter]
    fn scan_chunk_size(&self) -> usize {
        self.inner.scan_chunk_size
    }
    #[getter]
    fn max_num_batched_tokens(&self) -> usize {
        self.inner.max_num_batched_tokens
    }
    #[getter]
    fn max_num_seqs(&self) -> usize {
        self.inner.max_num_seqs
    }
    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.max_model_len
    }
    /// K, 0 without speculative decoding.
    #[getter]
    fn num_speculative_tokens(&self) -> usize {
        self.inner.num_speculative_tokens()
    }
    /// "ngram" | "draft_model" | None
    #[getter]
    fn speculative_method(&self) -> Option<&'static str> {
        self.inner.speculative.map(|s| s.method.as_str())
    }
    /// "branch" | "grid" | "branch+grid"
    #[getter]
    fn checkpoint_placement(&self) -> &'static str {
        self.inner.checkpoint_placement.as_str()
    }
    /// "flops" | "lru" | "lru-path"
    #[getter]
    fn eviction(&self) -> &'static str {
        self.inner.eviction.as_str()
    }
    /// 1 + K: state slots in a running request's window.
    #[getter]
    fn state_window_len(&self) -> usize {
        self.inner.state_window_len()
    }
    #[getter]
    fn decisions(&self) -> Vec<PyDecision> {
        self.decisions
            .iter()
            .map(|d| PyDecision { inner: d.clone() })
            .collect()
    }

    /// Raises ConfigError unless pools of this many KV blocks and Mamba slots (both counting the
    /// null block/slot 0) can run one request of max_model_len tokens.
    fn validate_pool_sizes(&self, num_kv_blocks: usize, num_mamba_slots: usize) -> PyResult<()> {
        self.inner
            .validate_pool_sizes(num_kv_blocks, num_mamba_slots)
            .map_err(to_pyerr)
    }

    /// A small valid configuration for tests (B = 4, M = 8, Q = 4, 64-token budget, 16 seqs,
    /// max_model_len 4096, ngram speculation when num_speculative_tokens > 0).
    #[staticmethod]
    #[pyo3(signature = (mode = "align", num_speculative_tokens = 0))]
    fn for_tests(mode: &str, num_speculative_tokens: usize) -> PyResult<Self> {
        let inner = ResolvedConfig::for_tests(parse_mode(mode)?, num_speculative_tokens);
        inner.validate().map_err(to_pyerr)?;
        Ok(PyResolvedConfig {
            inner,
            decisions: Vec::new(),
        })
    }

    /// Every resolved value, `speculative` (None or {"method", "num_speculative_tokens"}) and
    /// `decisions` (list of {"code", "level", "message"}).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner;
        let out = PyDict::new(py);
        out.set_item("has_mamba_layers", c.has_mamba_layers)?;
        out.set_item("enable_prefix_caching", c.enable_prefix_caching)?;
        out.set_item("mamba_cache_mode", c.mamba_cache_mode.as_str())?;
        out.set_item("enable_chunked_prefill", c.enable_chunked_prefill)?;
        out.set_item("block_size", c.block_size)?;
        out.set_item("mamba_block_size", c.mamba_block_size)?;
        out.set_item("scan_chunk_size", c.scan_chunk_size)?;
        out.set_item("max_num_batched_tokens", c.max_num_batched_tokens)?;
        out.set_item("max_num_seqs", c.max_num_seqs)?;
        out.set_item("max_model_len", c.max_model_len)?;
        out.set_item("num_speculative_tokens", c.num_speculative_tokens())?;
        out.set_item("checkpoint_placement", c.checkpoint_placement.as_str())?;
        out.set_item("eviction", c.eviction.as_str())?;
        match c.speculative {
            Some(s) => {
                let spec = PyDict::new(py);
                spec.set_item("method", s.method.as_str())?;
                spec.set_item("num_speculative_tokens", s.num_speculative_tokens)?;
                out.set_item("speculative", spec)?;
            }
            None => out.set_item("speculative", py.None())?,
        }
        let decisions = PyList::empty(py);
        for d in &self.decisions {
            decisions.append(decision_dict(py, d)?)?;
        }
        out.set_item("decisions", decisions)?;
        Ok(out)
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "ResolvedConfig(enable_prefix_caching={}, mamba_cache_mode={:?}, \
             enable_chunked_prefill={}, block_size={}, mamba_block_size={}, scan_chunk_size={}, \
             max_num_batched_tokens={}, max_num_seqs={}, max_model_len={}, \
             num_speculative_tokens={}, has_mamba_layers={})",
            py_bool(c.enable_prefix_caching),
            c.mamba_cache_mode.as_str(),
            py_bool(c.enable_chunked_prefill),
            c.block_size,
            c.mamba_block_size,
            c.scan_chunk_size,
            c.max_num_batched_tokens,
            c.max_num_seqs,
            c.max_model_len,
            c.num_speculative_tokens(),
            py_bool(c.has_mamba_layers),
        )
    }
}

fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

fn config_error(m: String) -> PyErr {
    to_pyerr(HsError::Config(m))
}

/// A count from Python: negative values are a ConfigError naming the flag.
fn count(flag: &str, v: i64) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| config_error(format!("{flag} must be positive, got {v}")))
}

fn opt_count(flag: &str, v: Option<i64>) -> PyResult<Option<usize>> {
    v.map(|v| count(flag, v)).transpose()
}

/// None = auto; a bool; or one of the strings auto/on/off/true/false.
fn tristate(flag: &str, v: Option<&Bound<'_, PyAny>>) -> PyResult<Option<bool>> {
    let Some(v) = v else { return Ok(None) };
    if v.is_none() {
        return Ok(None);
    }
    if let Ok(b) = v.cast::<PyBool>() {
        return Ok(Some(b.is_true()));
    }
    if let Ok(s) = v.cast::<PyString>() {
        return match s.to_str()? {
            "auto" => Ok(None),
            "on" | "true" => Ok(Some(true)),
            "off" | "false" => Ok(Some(false)),
            other => Err(config_error(format!(
                "{flag} must be one of auto, on, off (or a bool); got {other:?}"
            ))),
        };
    }
    Err(PyTypeError::new_err(format!(
        "{flag} must be None, a bool or a string"
    )))
}

/// Resolves the cache-mode policy (docs/cache-modes.md, "The policy"). Raises ConfigError with a
/// message that names the flag(s) to change. String arguments take the lowercase names of the Rust
/// enums.
#[pyfunction]
#[pyo3(signature = (
    *,
    has_mamba_layers,
    supports_boundary_states,
    scan_chunk_size = None,
    max_position_embeddings = None,
    enable_prefix_caching = None,
    mamba_cache_mode = "auto",
    enable_chunked_prefill = None,
    speculative_method = None,
    num_speculative_tokens = 0,
    block_size = DEFAULT_BLOCK_SIZE as i64,
    mamba_block_size = None,
    max_num_batched_tokens = None,
    max_num_seqs = DEFAULT_MAX_NUM_SEQS as i64,
    max_model_len = None,
    mamba_checkpoint_placement = None,
    prefix_cache_eviction = None,
))]
#[allow(clippy::too_many_arguments)]
fn resolve_policy(
    has_mamba_layers: bool,
    supports_boundary_states: bool,
    scan_chunk_size: Option<i64>,
    max_position_embeddings: Option<i64>,
    enable_prefix_caching: Option<&Bound<'_, PyAny>>,
    mamba_cache_mode: &str,
    enable_chunked_prefill: Option<&Bound<'_, PyAny>>,
    speculative_method: Option<&str>,
    num_speculative_tokens: i64,
    block_size: i64,
    mamba_block_size: Option<i64>,
    max_num_batched_tokens: Option<i64>,
    max_num_seqs: i64,
    max_model_len: Option<i64>,
    mamba_checkpoint_placement: Option<&str>,
    prefix_cache_eviction: Option<&str>,
) -> PyResult<PyResolvedConfig> {
    let k = count(
        "--speculative-config num_speculative_tokens",
        num_speculative_tokens,
    )?;
    let speculative = match speculative_method {
        Some(m) => Some(SpecRequest {
            method: m.parse::<SpecMethod>().map_err(to_pyerr)?,
            num_speculative_tokens: k,
        }),
        None if k == 0 => None,
        None => {
            return Err(config_error(
                "--speculative-config needs a \"method\" (ngram or draft_model)".to_string(),
            ))
        }
    };
    let inputs = PolicyInputs {
        model: ModelCapabilities {
            has_mamba_layers,
            supports_boundary_states,
            scan_chunk_size: opt_count(
                "the model's scan chunk size (config.json chunk_size)",
                scan_chunk_size,
            )?,
            max_position_embeddings: opt_count(
                "the model's max_position_embeddings (config.json)",
                max_position_embeddings,
            )?,
        },
        enable_prefix_caching: PrefixCachingRequest::from_option(tristate(
            "--enable-prefix-caching",
            enable_prefix_caching,
        )?),
        mamba_cache_mode: mamba_cache_mode
            .parse::<MambaCacheModeRequest>()
            .map_err(to_pyerr)?,
        enable_chunked_prefill: ChunkedPrefillRequest::from_option(tristate(
            "--enable-chunked-prefill",
            enable_chunked_prefill,
        )?),
        speculative,
        block_size: count("--block-size", block_size)?,
        mamba_block_size: opt_count("--mamba-block-size", mamba_block_size)?,
        max_num_batched_tokens: opt_count("--max-num-batched-tokens", max_num_batched_tokens)?,
        max_num_seqs: count("--max-num-seqs", max_num_seqs)?,
        max_model_len: opt_count("--max-model-len", max_model_len)?,
        checkpoint_placement: mamba_checkpoint_placement
            .map(str::parse::<CheckpointPlacement>)
            .transpose()
            .map_err(to_pyerr)?,
        eviction: prefix_cache_eviction
            .map(str::parse::<EvictionPolicy>)
            .transpose()
            .map_err(to_pyerr)?,
    };
    let res = policy::resolve(&inputs).map_err(to_pyerr)?;
    Ok(PyResolvedConfig {
        inner: res.config,
        decisions: res.decisions,
    })
}

/// The auto mamba_block_size: the smallest multiple of lcm(block_size, scan_chunk_size) >= 256.
#[pyfunction]
fn auto_mamba_block_size(block_size: usize, scan_chunk_size: usize) -> PyResult<usize> {
    check_flag("block_size", block_size).map_err(to_pyerr)?;
    if scan_chunk_size == 0 || scan_chunk_size > MAX_SCAN_CHUNK_SIZE {
        return Err(config_error(format!(
            "the scan chunk size must be in 1..={MAX_SCAN_CHUNK_SIZE}, got {scan_chunk_size}"
        )));
    }
    Ok(policy::auto_mamba_block_size(block_size, scan_chunk_size))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDecision>()?;
    m.add_class::<PyResolvedConfig>()?;
    m.add_function(wrap_pyfunction!(resolve_policy, m)?)?;
    m.add_function(wrap_pyfunction!(auto_mamba_block_size, m)?)?;
    m.add("DEFAULT_BLOCK_SIZE", DEFAULT_BLOCK_SIZE)?;
    m.add("DEFAULT_MAX_NUM_SEQS", DEFAULT_MAX_NUM_SEQS)?;
    m.add(
        "DEFAULT_MAX_NUM_BATCHED_TOKENS",
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
    )?;
    m.add("DEFAULT_MAX_MODEL_LEN", DEFAULT_MAX_MODEL_LEN)?;
    m.add("MIN_AUTO_MAMBA_BLOCK_SIZE", MIN_AUTO_MAMBA_BLOCK_SIZE)?;
    m.add("MAX_SPECULATIVE_TOKENS", MAX_SPECULATIVE_TOKENS)?;
    m.add("MAX_BLOCK_SIZE", MAX_BLOCK_SIZE)?;
    m.add("MAX_SCAN_CHUNK_SIZE", MAX_SCAN_CHUNK_SIZE)?;
    m.add("MAX_TOKENS", MAX_TOKENS)?;
    m.add("MAX_NUM_SEQS", MAX_NUM_SEQS)?;
    m.add("MAX_KV_BLOCKS", MAX_KV_BLOCKS)?;
    m.add("MAX_MAMBA_SLOTS", MAX_MAMBA_SLOTS)?;
    // The names every enum setting accepts, and the range of every integer setting: the Python
    // side validates and lists choices with these, so that the rule is written once, here.
    let py = m.py();
    m.add(
        "MAMBA_CACHE_MODES",
        PyTuple::new(
            py,
            MambaCacheModeRequest::ALL.map(MambaCacheModeRequest::as_str),
        )?,
    )?;
    m.add(
        "CHECKPOINT_PLACEMENTS",
        PyTuple::new(
            py,
            CheckpointPlacement::ALL.map(CheckpointPlacement::as_str),
        )?,
    )?;
    // Where a Mamba checkpoint was placed: the suffixes of the per-kind keys of Scheduler.stats.
    m.add(
        "CHECKPOINT_KINDS",
        PyTuple::new(py, CheckpointKind::ALL.map(CheckpointKind::as_str))?,
    )?;
    m.add(
        "EVICTION_POLICIES",
        PyTuple::new(py, EvictionPolicy::ALL.map(EvictionPolicy::as_str))?,
    )?;
    m.add(
        "SPECULATIVE_METHODS",
        PyTuple::new(py, SpecMethod::ALL.map(SpecMethod::as_str))?,
    )?;
    let limits = PyDict::new(py);
    for (name, lo, hi) in FLAG_LIMITS {
        limits.set_item(name, (lo, hi))?;
    }
    m.add("FLAG_LIMITS", limits)?;
    Ok(())
}
