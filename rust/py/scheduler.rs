//! PyO3 wrappers of the scheduler: `Scheduler`, `SchedulerOutput` (numpy arrays, moved out of the
//! Rust vectors without copying on first access) and `RequestDelta`.

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArrayDyn, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::errors::{to_pyerr, InternalError, InvalidRequestError};
use super::policy::PyResolvedConfig;
use crate::cache::{CheckpointKind, CostModel};
use crate::kv_events::{external_id, KvEvent};
use crate::output::SchedulerOutput;
use crate::request::{FinishReason, NewRequest, StopParams};
use crate::scheduler::{RequestDelta, Scheduler};

/// A KV cache event as Python sees it: (kind, group, block id, parent id, token ids).
type KvEventTuple = (&'static str, u32, u64, Option<u64>, Vec<u32>);

fn token_id(v: i64, what: &str) -> PyResult<u32> {
    u32::try_from(v)
        .map_err(|_| InvalidRequestError::new_err(format!("{what}: token id {v} is out of range")))
}

fn count(v: i64, what: &str) -> PyResult<usize> {
    usize::try_from(v)
        .map_err(|_| InvalidRequestError::new_err(format!("{what} must be >= 0, got {v}")))
}

/// A 1-D int array as an owned i32 vector. Always a copy: the update reads it with the GIL
/// released (validated first, then applied), and another Python thread could write to a
/// borrowed array in between.
fn i32_array(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i32>> {
    if let Ok(arr) = obj.extract::<PyReadonlyArray1<i32>>() {
        return Ok(arr.as_array().iter().copied().collect());
    }
    if let Ok(arr) = obj.extract::<PyReadonlyArray1<i64>>() {
        let mut v = Vec::with_capacity(arr.len());
        for &x in arr.as_array().iter() {
            v.push(i32::try_from(x).map_err(|_| {
                InvalidRequestError::new_err(format!("{what}: {x} is out of range"))
            })?);
        }
        return Ok(v);
    }
    obj.extract::<Vec<i32>>()
        .map_err(|_| PyTypeError::new_err(format!("{what} must be a 1-D int32 numpy array")))
}

/// The scheduler: continuous batching, chunked prefill, prefix caching, speculative bookkeeping.
#[pyclass(name = "Scheduler", module = "hybridserve._core")]
pub(crate) struct PyScheduler {
    inner: Scheduler,
    /// The output of the last `schedule()`, for `open_step_output`: a caller interrupted between
    /// the call's return and the assignment of its result has lost it and must still close the step.
    last_output: Option<Py<PySchedulerOutput>>,
    /// The output of the step planned ahead (`schedule_ahead`), until confirmed or discarded.
    ahead_output: Option<Py<PySchedulerOutput>>,
}

impl PyScheduler {
    /// An output of another scheduler can carry the open step's id (ids count from 0 in every
    /// scheduler): only the object this scheduler's schedule() returned may close the step.
    fn check_own_output(&self, output: &PyRef<'_, PySchedulerOutput>, what: &str) -> PyResult<()> {
        let open = self.inner.in_flight_step();
        let ours = self
            .last_output
            .as_ref()
            .is_some_and(|last| last.as_ptr() == output.as_ptr());
        if open == Some(output.out.step_id) && !ours {
            return Err(InvalidRequestError::new_err(format!(
                "{what}: this output was not returned by this scheduler's schedule()"
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (config, num_kv_blocks, num_mamba_slots, hash_seed = None))]
    fn new(
        config: PyRef<'_, PyResolvedConfig>,
        num_kv_blocks: usize,
        num_mamba_slots: usize,
        hash_seed: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        // Any int (default 0): a negative seed is taken as its two's-complement bits.
        let seed = match hash_seed {
            None => 0,
            Some(h) => match h.extract::<u64>() {
                Ok(v) => v,
                Err(_) => h.extract::<i64>()? as u64,
            },
        };
        let inner = Scheduler::new(&config.inner, num_kv_blocks, num_mamba_slots, seed)
            .map_err(to_pyerr)?;
        Ok(PyScheduler {
            inner,
            last_output: None,
            ahead_output: None,
        })
    }

    #[pyo3(signature = (request_id, prompt_token_ids, *, max_tokens, eos_token_id = None, stop_token_ids = Vec::new(), ignore_eos = false, min_tokens = 0, priority = 0, cache_salt = None, skip_prefix_hit = false, shared_prefix_len = None))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        request_id: String,
        prompt_token_ids: Vec<i64>,
        max_tokens: i64,
        eos_token_id: Option<i64>,
        stop_token_ids: Vec<i64>,
        ignore_eos: bool,
        min_tokens: i64,
        priority: i64,
        cache_salt: Option<String>,
        skip_prefix_hit: bool,
        shared_prefix_len: Option<i64>,
    ) -> PyResult<()> {
        let prompt = prompt_token_ids
            .into_iter()
            .map(|t| token_id(t, "prompt_token_ids"))
            .collect::<PyResult<Vec<u32>>>()?;
        let stop = StopParams {
            max_tokens: count(max_tokens, "max_tokens")?,
            eos_token_id: eos_token_id
                .map(|t| token_id(t, "eos_token_id"))
                .transpose()?,
            stop_token_ids: stop_token_ids
                .into_iter()
                .map(|t| token_id(t, "stop_token_ids"))
                .collect::<PyResult<Vec<u32>>>()?,
            ignore_eos,
            min_tokens: count(min_tokens, "min_tokens")?,
        };
        self.inner
            .add_request(NewRequest {
                request_id,
                prompt_token_ids: prompt,
                stop,
                priority,
                cache_salt,
                skip_prefix_hit,
                shared_prefix_len: shared_prefix_len
                    .map(|n| count(n, "shared_prefix_len"))
                    .transpose()?,
            })
            .map_err(to_pyerr)
    }

    /// Aborts a request in any state and frees everything it holds; False if unknown.
    fn abort_request(&mut self, request_id: &str) -> bool {
        self.inner.abort_request(request_id)
    }

    /// Ends a request the engine finished itself (a stop string): freed like an abort, counted
    /// in num_finished_total. False if the id is unknown.
    fn finish_request(&mut self, request_id: &str) -> bool {
        self.inner.finish_request(request_id)
    }

    /// The next batch (the GIL is released while it is computed).
    fn schedule(&mut self, py: Python<'_>) -> PyResult<Py<PySchedulerOutput>> {
        self.ahead_output = None;
        let inner = &mut self.inner;
        let out = py.detach(move || inner.schedule()).map_err(to_pyerr)?;
        let obj = Py::new(py, PySchedulerOutput::new(out))?;
        self.last_output = Some(obj.clone_ref(py));
        Ok(obj)
    }

    /// The step after the one in flight, planned while that one runs (its input tokens are
    /// placeholders until `confirm_ahead`), or None where its plan could depend on the tokens
    /// of the step in flight (docs/architecture.md, "Overlapped steps"). The GIL is released
    /// while it is computed.
    fn schedule_ahead(&mut self, py: Python<'_>) -> PyResult<Option<Py<PySchedulerOutput>>> {
        // (with no step in flight there is nothing to plan after: a plan already made stays)
        let Some(running) = self.last_output.as_ref().map(|o| o.clone_ref(py)) else {
            return Ok(None);
        };
        if self.inner.in_flight_step() != Some(running.borrow(py).out.step_id) {
            return Ok(None);
        }
        self.ahead_output = None;
        let planned = {
            let running = running.borrow(py);
            let (inner, out) = (&mut self.inner, &running.out);
            py.detach(move || inner.schedule_ahead(out))
                .map_err(to_pyerr)?
        };
        let Some(planned) = planned else {
            return Ok(None);
        };
        let obj = Py::new(py, PySchedulerOutput::new(planned))?;
        self.ahead_output = Some(obj.clone_ref(py));
        Ok(Some(obj))
    }

    /// After the update of the step in flight: True when the planned step `planned` is what
    /// `schedule()` would now make, and is now the step in flight, with the tokens just sampled
    /// written into its `input_ids` (and the rows of requests that ended since writing nothing
    /// that is read). False: the plan is discarded; call `schedule()`.
    fn confirm_ahead(
        &mut self,
        py: Python<'_>,
        mut planned: PyRefMut<'_, PySchedulerOutput>,
    ) -> PyResult<bool> {
        let ours = self
            .ahead_output
            .take()
            .is_some_and(|a| a.as_ptr() == planned.as_ptr());
        if !ours {
            self.inner.discard_ahead();
            return Err(InvalidRequestError::new_err(
                "confirm_ahead: this output is not the step this scheduler planned ahead",
            ));
        }
        let Some(patch) = self
            .inner
            .confirm_ahead(&mut planned.out)
            .map_err(to_pyerr)?
        else {
            return Ok(false);
        };
        planned.arrays[1] = None; // (finished_req_ids: set by the confirmation)
        let arrays = [
            planned.input_ids(py)?,
            planned.slot_mapping(py)?,
            planned.block_table(py)?,
            planned.state_write_slots(py)?,
        ];
        let mut views = Vec::with_capacity(arrays.len());
        for a in &arrays {
            views.push(a.bind(py).cast::<PyArrayDyn<i64>>()?.clone());
        }
        let [ids, slots, table, writes] = &views[..] else {
            return Err(InternalError::new_err("four arrays"));
        };
        // SAFETY: four distinct arrays this output created and holds, contiguous (each made from
        // a Vec); the GIL is held and no Rust borrow of them is alive (the native decode step
        // reads them only once the step is posted, after this returns). Unchecked mutable
        // slices: numpy's borrow registry costs more than the patch at batch 1.
        let applied = unsafe {
            patch.apply(
                ids.as_slice_mut()?,
                slots.as_slice_mut()?,
                table.as_slice_mut()?,
                writes.as_slice_mut()?,
            )
        };
        drop(views);
        let this: Py<PySchedulerOutput> = planned.into();
        self.last_output = Some(this);
        applied.map_err(to_pyerr)?;
        Ok(true)
    }

    /// Drops the step planned ahead, if any.
    fn discard_ahead(&mut self) {
        self.ahead_output = None;
        self.inner.discard_ahead();
    }

    /// The output of the step that is open (scheduled, not yet updated), None if no step is open.
    fn open_step_output(&self, py: Python<'_>) -> Option<Py<PySchedulerOutput>> {
        let step = self.inner.in_flight_step()?;
        let last = self.last_output.as_ref()?;
        (last.borrow(py).out.step_id == step).then(|| last.clone_ref(py))
    }

    #[pyo3(signature = (output, sampled_token_ids, num_sampled, draft_token_ids = None, num_drafts = None))]
    fn update_from_output<'py>(
        &mut self,
        py: Python<'py>,
        output: PyRef<'py, PySchedulerOutput>,
        sampled_token_ids: &Bound<'py, PyAny>,
        num_sampled: &Bound<'py, PyAny>,
        draft_token_ids: Option<&Bound<'py, PyAny>>,
        num_drafts: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        self.check_own_output(&output, "update_from_output")?;
        let sampled = i32_array(sampled_token_ids, "sampled_token_ids")?;
        let nsampled = i32_array(num_sampled, "num_sampled")?;
        let drafts = match (draft_token_ids, num_drafts) {
            (Some(d), Some(n)) => Some((
                i32_array(d, "draft_token_ids")?,
                i32_array(n, "num_drafts")?,
            )),
            (None, None) => None,
            _ => {
                return Err(InvalidRequestError::new_err(
                    "draft_token_ids and num_drafts must be given together",
                ))
            }
        };
        let out: &SchedulerOutput = &output.out;
        let inner = &mut self.inner;
        let deltas = py
            .detach(move || {
                let d = drafts.as_ref().map(|(a, b)| (&a[..], &b[..]));
                inner.update_from_output(out, &sampled, &nsampled, d)
            })
            .map_err(to_pyerr)?;
        PyList::new(py, deltas.into_iter().map(|d| PyRequestDelta { inner: d }))
    }

    /// Closes the open step whose forward did not complete: its pending checkpoints are
    /// cancelled, its still-running requests go back to waiting (recompute). Returns the pending
    /// finish deltas, like update_from_output.
    fn cancel_step<'py>(
        &mut self,
        py: Python<'py>,
        output: PyRef<'py, PySchedulerOutput>,
    ) -> PyResult<Bound<'py, PyList>> {
        self.check_own_output(&output, "cancel_step")?;
        let deltas = self.inner.cancel_step(&output.out).map_err(to_pyerr)?;
        // (a refused cancel changes nothing: the step planned ahead stays confirmable)
        self.ahead_output = None;
        PyList::new(py, deltas.into_iter().map(|d| PyRequestDelta { inner: d }))
    }

    fn has_unfinished_requests(&self) -> bool {
        self.inner.has_unfinished_requests()
    }

    /// Per-slot Mamba state size in bytes (all layers), for the `checkpoint_bytes` stat.
    fn set_state_bytes_per_slot(&mut self, num_bytes: usize) {
        self.inner.set_state_bytes_per_slot(num_bytes);
    }

    /// The sizes and prefill FLOPs of the model, for the `flops` eviction score and the FLOP
    /// counters: bytes of one state slot and of one KV block, FLOPs per prefilled token that do not
    /// depend on the context, and attention FLOPs per token per token of context.
    #[pyo3(signature = (*, state_bytes, kv_bytes_per_block, flops_per_token, attn_flops_per_context_token, flop_weight = None))]
    fn set_cost_model(
        &mut self,
        state_bytes: u64,
        kv_bytes_per_block: u64,
        flops_per_token: f64,
        attn_flops_per_context_token: f64,
        flop_weight: Option<f64>,
    ) -> PyResult<()> {
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        if !ok(flops_per_token) || !ok(attn_flops_per_context_token) {
            return Err(InvalidRequestError::new_err(
                "set_cost_model: FLOP counts must be finite and >= 0",
            ));
        }
        if let Some(w) = flop_weight {
            if !ok(w) {
                return Err(InvalidRequestError::new_err(
                    "set_cost_model: flop_weight must be finite and >= 0",
                ));
            }
        }
        self.inner.set_cost_model(
            CostModel {
                state_bytes,
                kv_bytes_per_block,
                flops_per_token,
                attn_flops_per_context_token,
            },
            flop_weight,
        );
        Ok(())
    }

    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }

    #[getter]
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }

    /// Counters and gauges for metrics (see _core.pyi for the keys).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let c = &s.cache;
        let d = PyDict::new(py);
        let items: [(&str, u64); 43] = [
            ("num_running", s.num_running as u64),
            ("num_waiting", s.num_waiting as u64),
            ("num_preempted", s.num_preempted as u64),
            ("num_preemptions_total", s.num_preemptions_total),
            ("num_steps", s.num_steps),
            ("num_scheduled_tokens", s.num_scheduled_tokens_last as u64),
            ("num_scheduled_tokens_total", s.num_scheduled_tokens_total),
            ("num_finished_total", s.num_finished_total),
            ("num_aborted_total", s.num_aborted_total),
            ("prefix_queried_tokens", s.prefix_queried_tokens),
            ("prefix_hit_tokens", s.prefix_hit_tokens),
            ("prefix_lost_tokens", s.prefix_lost_tokens),
            (
                "prefix_preempted_queried_tokens",
                s.prefix_preempted_queried_tokens,
            ),
            ("prefix_preempted_hit_tokens", s.prefix_preempted_hit_tokens),
            ("checkpoints_kept", s.checkpoints_kept),
            ("spec_drafted_tokens", s.spec_drafted_tokens),
            ("spec_accepted_tokens", s.spec_accepted_tokens),
            ("checkpoints_emitted", s.checkpoints_emitted),
            ("checkpoints_published", s.checkpoints_published),
            ("kv_blocks_total", c.kv_blocks_total as u64),
            ("kv_blocks_used", c.kv_blocks_used as u64),
            ("kv_blocks_cached_free", c.kv_blocks_cached_free as u64),
            ("mamba_slots_total", c.mamba_slots_total as u64),
            ("mamba_slots_used", c.mamba_slots_used as u64),
            ("checkpoints_committed", c.checkpoints_committed as u64),
            ("checkpoints_pending", c.checkpoints_pending as u64),
            ("checkpoint_bytes", c.checkpoint_bytes),
            ("cache_queried_tokens", c.queried_tokens),
            ("cache_hit_tokens", c.hit_tokens),
            ("cache_kv_hit_tokens", c.kv_hit_tokens),
            ("cache_lost_tokens", c.lost_tokens),
            ("kv_evictions", c.kv_evictions),
            ("kv_evictions_useless", c.kv_evictions_useless),
            ("checkpoint_evictions", c.checkpoint_evictions),
            ("checkpoint_evictions_stale", c.checkpoint_evictions_stale),
            (
                "checkpoint_evictions_for_checkpoint",
                c.checkpoint_evictions_for_checkpoint,
            ),
            (
                "checkpoint_evictions_for_window",
                c.checkpoint_evictions_for_window,
            ),
            ("checkpoint_evictions_for_kv", c.checkpoint_evictions_for_kv),
            ("kv_blocks_cached", c.kv_blocks_cached as u64),
            ("mamba_slots_window", c.mamba_slots_window as u64),
            (
                "max_num_batched_tokens",
                self.inner.config().max_num_batched_tokens as u64,
            ),
            ("max_num_seqs", self.inner.config().max_num_seqs as u64),
            (
                "num_speculative_tokens",
                self.inner.config().num_speculative_tokens() as u64,
            ),
        ];
        for (k, v) in items {
            d.set_item(k, v)?;
        }
        // Per checkpoint kind (grid, branch, last_token, declared): hits, hit tokens, committed
        // checkpoints and the running reuse rate.
        for kind in CheckpointKind::ALL {
            let (name, i) = (kind.as_str(), kind.index());
            d.set_item(format!("prefix_hits_{name}"), s.prefix_hits_by_kind[i])?;
            d.set_item(
                format!("prefix_hit_tokens_{name}"),
                s.prefix_hit_tokens_by_kind[i],
            )?;
            d.set_item(
                format!("checkpoints_{name}"),
                c.checkpoints_by_kind[i] as u64,
            )?;
            d.set_item(
                format!("checkpoint_reuse_rate_{name}"),
                c.checkpoint_reuse_rate[i],
            )?;
        }
        d.set_item("prefill_flops_queried", s.prefill_flops_queried)?;
        d.set_item("prefill_flops_saved", s.prefill_flops_saved)?;
        d.set_item("kv_events_emitted", self.inner.cache().num_events())?;
        Ok(d)
    }

    fn reset_prefix_cache(&mut self) -> bool {
        self.inner.reset_prefix_cache()
    }

    /// Starts recording KV cache events; entries cached before are not announced.
    fn enable_kv_events(&mut self) {
        self.inner.enable_kv_events();
    }

    /// The KV cache events since the last call, in order, as tuples
    /// `(kind, group, block_id, parent_id, token_ids)`: kind "stored" (parent_id None for a first
    /// block), "removed" (parent_id None, no tokens) or "cleared" (group 0, block_id 0). Ids are
    /// the opaque 64-bit ids of docs/kv-events.md.
    fn take_kv_events(&mut self) -> Vec<KvEventTuple> {
        self.inner
            .take_kv_events()
            .into_iter()
            .map(|e| match e {
                KvEvent::Stored {
                    group,
                    hash,
                    parent,
                    tokens,
                } => (
                    "stored",
                    group.index(),
                    external_id(hash),
                    parent.map(external_id),
                    tokens,
                ),
                KvEvent::Removed { group, hash } => (
                    "removed",
                    group.index(),
                    external_id(hash),
                    None,
                    Vec::new(),
                ),
                KvEvent::AllCleared => ("cleared", 0, 0, None, Vec::new()),
            })
            .collect()
    }

    /// Prompt + output so far. InvalidRequestError for an unknown (or finished) request.
    fn get_token_ids(&self, request_id: &str) -> PyResult<Vec<u32>> {
        self.inner
            .get_token_ids(request_id)
            .map(|t| t.to_vec())
            .ok_or_else(|| InvalidRequestError::new_err(format!("unknown request {request_id:?}")))
    }

    /// Tokens computed so far in the current residency (None for an unknown request).
    fn get_num_computed_tokens(&self, request_id: &str) -> Option<usize> {
        self.inner
            .get_request(request_id)
            .map(|r| r.num_computed_tokens)
    }
}

const N_ARRAYS: usize = 21;

/// One step's batch. Array getters move the Rust buffer into numpy on first access (no copy) and
/// return the same array afterwards.
#[pyclass(name = "SchedulerOutput", module = "hybridserve._core")]
pub(crate) struct PySchedulerOutput {
    out: SchedulerOutput,
    arrays: [Option<Py<PyAny>>; N_ARRAYS],
}

fn vec1<T: numpy::Element>(py: Python<'_>, v: &mut Vec<T>) -> Py<PyAny> {
    std::mem::take(v).into_pyarray(py).into_any().unbind()
}

fn vec2(py: Python<'_>, v: &mut Vec<i64>, cols: usize) -> PyResult<Py<PyAny>> {
    let v = std::mem::take(v);
    let rows = v.len().checked_div(cols).unwrap_or(0);
    let a = Array2::from_shape_vec((rows, cols), v)
        .map_err(|e| InternalError::new_err(e.to_string()))?;
    Ok(a.into_pyarray(py).into_any().unbind())
}

impl PySchedulerOutput {
    fn new(out: SchedulerOutput) -> Self {
        PySchedulerOutput {
            out,
            arrays: Default::default(),
        }
    }

    fn cached(
        &mut self,
        py: Python<'_>,
        idx: usize,
        make: impl FnOnce(Python<'_>, &mut SchedulerOutput) -> PyResult<Py<PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        if let Some(a) = &self.arrays[idx] {
            return Ok(a.clone_ref(py));
        }
        let a = make(py, &mut self.out)?;
        self.arrays[idx] = Some(a.clone_ref(py));
        Ok(a)
    }
}

#[pymethods]
impl PySchedulerOutput {
    #[getter]
    fn req_ids(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 0, |py, o| {
            Ok(PyList::new(py, o.req_ids.iter().map(|s| &**s))?
                .into_any()
                .unbind())
        })
    }
    #[getter]
    fn finished_req_ids(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 1, |py, o| {
            Ok(PyList::new(py, &o.finished_req_ids)?.into_any().unbind())
        })
    }
    #[getter]
    fn num_decodes(&self) -> usize {
        self.out.num_decodes
    }
    #[getter]
    fn num_rows(&self) -> usize {
        self.out.rows.len()
    }
    #[getter]
    fn num_scheduled_tokens(&self) -> usize {
        self.out.num_scheduled_tokens
    }
    #[getter]
    fn step_id(&self) -> u64 {
        self.out.step_id
    }
    #[getter]
    fn input_ids(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 2, |py, o| Ok(vec1(py, &mut o.input_ids)))
    }
    #[getter]
    fn positions(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 3, |py, o| Ok(vec1(py, &mut o.positions)))
    }
    #[getter]
    fn query_start_loc(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 4, |py, o| Ok(vec1(py, &mut o.query_start_loc)))
    }
    #[getter]
    fn num_computed_tokens(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 5, |py, o| Ok(vec1(py, &mut o.num_computed_tokens)))
    }
    #[getter]
    fn seq_lens(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 6, |py, o| Ok(vec1(py, &mut o.seq_lens)))
    }
    #[getter]
    fn slot_mapping(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 7, |py, o| Ok(vec1(py, &mut o.slot_mapping)))
    }
    #[getter]
    fn block_table(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 8, |py, o| {
            let cols = o.max_blocks;
            if cols == 0 {
                let rows = o.rows.len();
                return Ok(Array2::<i64>::zeros((rows, 0))
                    .into_pyarray(py)
                    .into_any()
                    .unbind());
            }
            vec2(py, &mut o.block_table, cols)
        })
    }
    #[getter]
    fn state_read_slot(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 9, |py, o| Ok(vec1(py, &mut o.state_read_slot)))
    }
    #[getter]
    fn has_initial_state(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 10, |py, o| Ok(vec1(py, &mut o.has_initial_state)))
    }
    #[getter]
    fn state_write_slots(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 11, |py, o| {
            let w = o.window_len.max(1);
            vec2(py, &mut o.state_write_slots, w)
        })
    }
    #[getter]
    fn emit_row(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 12, |py, o| Ok(vec1(py, &mut o.emit_row)))
    }
    #[getter]
    fn emit_token(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 13, |py, o| Ok(vec1(py, &mut o.emit_token)))
    }
    #[getter]
    fn emit_slot(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 14, |py, o| Ok(vec1(py, &mut o.emit_slot)))
    }
    #[getter]
    fn state_copies(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 15, |py, o| vec2(py, &mut o.state_copies, 2))
    }
    #[getter]
    fn kv_copies(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 20, |py, o| vec2(py, &mut o.kv_copies, 2))
    }
    #[getter]
    fn logits_indices(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 16, |py, o| Ok(vec1(py, &mut o.logits_indices)))
    }
    #[getter]
    fn num_logits(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 17, |py, o| Ok(vec1(py, &mut o.num_logits)))
    }
    #[getter]
    fn num_draft_tokens(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 18, |py, o| Ok(vec1(py, &mut o.num_draft_tokens)))
    }
    #[getter]
    fn draft_token_ids(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.cached(py, 19, |py, o| Ok(vec1(py, &mut o.draft_token_ids)))
    }

    /// For native code that runs a step reading the arrays in place (the native model step):
    /// None for a step without rows; else `[tokens, rows, num_decodes, len(logits_indices),
    /// len(emit_row), block_table's row stride, state_write_slots' row stride]` and the data
    /// addresses of input_ids, positions, slot_mapping, block_table, state_read_slot,
    /// state_write_slots, query_start_loc, logits_indices, has_initial_state, emit_row,
    /// emit_token and emit_slot, each the array its getter returns (they live as long as this
    /// output). One call where the getters and the checks of the layout cost a dozen.
    fn step_layout(&mut self, py: Python<'_>) -> PyResult<Option<Vec<usize>>> {
        let rows = self.out.rows.len();
        if rows == 0 {
            return Ok(None);
        }
        let arrays = [
            self.input_ids(py)?,
            self.positions(py)?,
            self.slot_mapping(py)?,
            self.block_table(py)?,
            self.state_read_slot(py)?,
            self.state_write_slots(py)?,
            self.query_start_loc(py)?,
            self.logits_indices(py)?,
            self.emit_row(py)?,
            self.emit_token(py)?,
            self.emit_slot(py)?,
        ];
        let mut addresses = Vec::with_capacity(arrays.len() + 1);
        let mut shapes: Vec<Vec<usize>> = Vec::with_capacity(arrays.len());
        for array in &arrays {
            let array = array.bind(py).cast::<PyArrayDyn<i64>>()?;
            if !array.is_c_contiguous() {
                return Err(InternalError::new_err("a step array is not contiguous"));
            }
            addresses.push(array.data() as usize);
            shapes.push(array.shape().to_vec());
        }
        let has_init = self.has_initial_state(py)?;
        let has_init = has_init.bind(py).cast::<PyArrayDyn<bool>>()?;
        if !has_init.is_c_contiguous() {
            return Err(InternalError::new_err("a step array is not contiguous"));
        }
        let init_shape = has_init.shape().to_vec();
        addresses.insert(8, has_init.data() as usize);
        let qsl = arrays[6].bind(py).cast::<PyArrayDyn<i64>>()?.readonly();
        let qsl = qsl.as_slice()?;
        let tokens = shapes[0][0];
        let (bt, ws) = (&shapes[3], &shapes[5]);
        let (logits, emits) = (shapes[7][0], shapes[8][0]);
        let laid_out = qsl.len() == rows + 1
            && usize::try_from(qsl[rows]).ok() == Some(tokens)
            && [1, 2].iter().all(|&i| shapes[i] == [tokens])
            && shapes[4] == [rows]
            && init_shape == [rows]
            && shapes[9] == [emits]
            && shapes[10] == [emits]
            && bt.len() == 2
            && bt[0] == rows
            && ws.len() == 2
            && ws[0] == rows;
        if !laid_out {
            return Ok(None);
        }
        let mut layout = vec![
            tokens,
            rows,
            self.out.num_decodes,
            logits,
            emits,
            bt[1],
            ws[1],
        ];
        layout.extend(addresses);
        Ok(Some(layout))
    }

    fn __len__(&self) -> usize {
        self.out.rows.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(step_id={}, rows={}, num_decodes={}, num_scheduled_tokens={}, copies={}, kv_copies={}, emits={})",
            self.out.step_id,
            self.out.rows.len(),
            self.out.num_decodes,
            self.out.num_scheduled_tokens,
            self.out.num_copies(),
            self.out.kv_copies.len() / 2,
            self.out.num_emits()
        )
    }
}

/// What one step changed for one request.
#[pyclass(name = "RequestDelta", module = "hybridserve._core", frozen)]
pub(crate) struct PyRequestDelta {
    inner: RequestDelta,
}

#[pymethods]
impl PyRequestDelta {
    #[getter]
    fn request_id(&self) -> &str {
        &self.inner.request_id
    }
    #[getter]
    fn new_token_ids(&self) -> Vec<u32> {
        self.inner.new_token_ids.clone()
    }
    #[getter]
    fn finished(&self) -> bool {
        self.inner.finished
    }
    #[getter]
    fn finish_reason(&self) -> Option<&'static str> {
        self.inner.finish_reason.map(FinishReason::as_str)
    }
    #[getter]
    fn stop_token_id(&self) -> Option<u32> {
        self.inner.stop_token_id
    }
    #[getter]
    fn num_cached_tokens(&self) -> usize {
        self.inner.num_cached_tokens
    }
    fn __repr__(&self) -> String {
        format!(
            "RequestDelta(request_id={:?}, new_token_ids={:?}, finished={}, finish_reason={}, stop_token_id={}, num_cached_tokens={})",
            self.inner.request_id,
            self.inner.new_token_ids,
            if self.inner.finished { "True" } else { "False" },
            self.inner.finish_reason.map_or("None".to_string(), |f| format!("'{}'", f.as_str())),
            self.inner.stop_token_id.map_or("None".to_string(), |t| t.to_string()),
            self.inner.num_cached_tokens
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PySchedulerOutput>()?;
    m.add_class::<PyRequestDelta>()?;
    Ok(())
}
