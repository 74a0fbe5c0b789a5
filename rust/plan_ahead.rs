//! Steps planned ahead: the next step of decode rows is laid out while the step before it runs,
//! from what that step will have computed (one token per row), before its tokens are known.
//! docs/architecture.md ("Overlapped steps").
//!
//! `schedule_ahead` plans it only where the plan cannot depend on the running step's tokens:
//! every row of the running step is a one-token decode row (no drafts, no speculation), no
//! waiting request could be admitted, and no row's token lands on a grid boundary (whose state
//! the update would publish by a copy before the next step). A request that its length ends in
//! the running step gets no row. `confirm_ahead`, after the running step's update, checks that
//! the plan is what `schedule()` would now make, and returns what to write into it: each row's
//! input token (the token just sampled), and for each row whose request the update ended (an
//! EOS or stop token; an abort) a write to nothing: its KV slot moved to the null block and its
//! state writes to the null slot, so that the state it read, kept for the request's next turn,
//! is not overwritten. Anything else discards the plan and the caller schedules as usual.

use super::Scheduler;
use crate::cache::ReqKey;
use crate::error::{HsError, HsResult};
use crate::output::{RowInfo, SchedulerOutput};
use crate::request::RequestStatus;

/// What `confirm_ahead` asks to be written into the planned step's arrays (`apply`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AheadPatch {
    /// Each row's input token, in row order.
    pub input_ids: Vec<i64>,
    /// Rows whose request ended since the plan: computed, writing nothing that is read.
    pub dead_rows: Vec<usize>,
    /// (row, position) of each dead row, for its KV slot in the null block.
    positions: Vec<(usize, usize)>,
    /// The step's block-table and write-window row lengths, and the KV block size.
    max_blocks: usize,
    window_len: usize,
    block_size: usize,
}

impl AheadPatch {
    /// Writes the patch into a planned step's arrays (those of its `SchedulerOutput`, wherever
    /// they now live; `block_table` and `write_slots` row-major).
    pub fn apply(
        &self,
        input_ids: &mut [i64],
        slot_mapping: &mut [i64],
        block_table: &mut [i64],
        write_slots: &mut [i64],
    ) -> HsResult<()> {
        let (max_blocks, window_len, block_size) =
            (self.max_blocks, self.window_len, self.block_size);
        let short = || HsError::Internal("a planned step's arrays are short".into());
        if input_ids.len() != self.input_ids.len() || slot_mapping.len() != input_ids.len() {
            return Err(short());
        }
        input_ids.copy_from_slice(&self.input_ids);
        for &(r, pos) in &self.positions {
            let bt = block_table
                .get_mut(r * max_blocks + pos / block_size)
                .ok_or_else(short)?;
            *bt = 0;
            *slot_mapping.get_mut(r).ok_or_else(short)? = (pos % block_size) as i64;
            write_slots
                .get_mut(r * window_len..(r + 1) * window_len)
                .ok_or_else(short)?
                .fill(0);
        }
        Ok(())
    }

    /// `apply` to an output whose arrays are still its own.
    pub fn apply_to(&self, out: &mut SchedulerOutput) -> HsResult<()> {
        self.apply(
            &mut out.input_ids,
            &mut out.slot_mapping,
            &mut out.block_table,
            &mut out.state_write_slots,
        )
    }
}

impl Scheduler {
    /// Plans the step after `running` (the step in flight, scheduled and not yet updated) while
    /// it runs, or None where that step's plan could depend on its tokens (module docs). Its
    /// input tokens are placeholders until `confirm_ahead`. Blocks it needs are allocated now; a
    /// plan that is discarded leaves them with their requests, which the next step uses.
    pub fn schedule_ahead(
        &mut self,
        running: &SchedulerOutput,
    ) -> HsResult<Option<SchedulerOutput>> {
        if self.in_flight != Some(running.step_id) || running.rows.is_empty() {
            return Err(HsError::Internal(
                "schedule_ahead() needs the output of the step in flight".into(),
            ));
        }
        self.ahead = None;
        if self.cfg.num_speculative_tokens() > 0 || self.could_admit() {
            return Ok(None);
        }
        let m = self.cfg.mamba_block_size.max(1);
        let publishes = self.checkpoints && self.placement.grid();
        let max_len = self.cfg.max_model_len;
        let mut rows: Vec<(ReqKey, usize)> = Vec::with_capacity(running.rows.len());
        let mut covered = 0usize; // running requests with a row in the running step
        for row in &running.rows {
            if !row.is_decode || row.num_new_tokens != 1 || row.num_drafts != 0 {
                return Ok(None);
            }
            let Some(req) = self.requests.get(&row.key) else {
                continue; // aborted during the step
            };
            if req.status != RequestStatus::Running
                || req.num_computed_tokens != row.num_computed_before
            {
                return Ok(None);
            }
            covered += 1;
            let after = row.num_computed_before + 1;
            if publishes && after % m == 0 {
                return Ok(None);
            }
            if req.remaining_output(max_len) <= 1 {
                continue; // the step's token ends it by length
            }
            rows.push((row.key, after));
        }
        if rows.is_empty() || covered != self.running.len() {
            return Ok(None); // (a running request the step left out would be scheduled)
        }
        for &(key, after) in &rows {
            if self.cache.allocate_more(key, after, 1, 0).is_none() {
                return Ok(None); // (a synchronous step may preempt)
            }
        }
        let step_id = self.next_step;
        self.next_step += 1;
        let out = self.build_ahead(step_id, &rows)?;
        self.ahead = Some(step_id);
        Ok(Some(out))
    }

    /// Whether `schedule()` would admit a waiting request now (room for one more sequence).
    fn could_admit(&self) -> bool {
        !self.waiting.is_empty() && self.running.len() < self.cfg.max_num_seqs
    }

    /// A step of one-token decode rows at `rows`' positions (input tokens: placeholders).
    fn build_ahead(&self, step_id: u64, rows: &[(ReqKey, usize)]) -> HsResult<SchedulerOutput> {
        let n = rows.len();
        let (b, w) = (self.cfg.block_size, self.cfg.state_window_len());
        let max_blocks = rows
            .iter()
            .map(|&(k, _)| self.cache.block_table(k).len())
            .max()
            .unwrap_or(0);
        let mut out = SchedulerOutput {
            step_id,
            num_decodes: n,
            max_blocks,
            window_len: w,
            num_scheduled_tokens: n,
            query_start_loc: (0..=n as i64).collect(),
            logits_indices: (0..n as i64).collect(),
            num_logits: vec![1; n],
            num_draft_tokens: vec![0; n],
            has_initial_state: vec![true; n],
            state_write_slots: vec![0; n * w],
            block_table: Vec::with_capacity(n * max_blocks),
            ..SchedulerOutput::default()
        };
        for (r, &(key, pos)) in rows.iter().enumerate() {
            let req = self
                .requests
                .get(&key)
                .ok_or_else(|| HsError::Internal("a planned request vanished".into()))?;
            let table = self.cache.block_table(key);
            let window = self.cache.state_window(key);
            let blk = *table.get(pos / b).ok_or_else(|| {
                HsError::Internal(format!("block table of {:?} does not cover {pos}", req.id))
            })?;
            let slot = window.first().copied().unwrap_or(0) as i64;
            if slot == 0 && self.cfg.has_mamba_layers {
                return Err(HsError::Internal(format!(
                    "state window of {:?} is empty",
                    req.id
                )));
            }
            out.input_ids
                .push(i64::from(req.all_token_ids.last().copied().unwrap_or(0)));
            out.positions.push(pos as i64);
            out.slot_mapping.push((blk as usize * b + pos % b) as i64);
            out.num_computed_tokens.push(pos as i64);
            out.seq_lens.push(pos as i64 + 1);
            out.block_table.extend(table.iter().map(|&x| x as i64));
            out.block_table.resize((r + 1) * max_blocks, 0);
            out.state_read_slot.push(slot);
            out.state_write_slots[r * w] = slot;
            out.req_ids.push(req.id.clone());
            out.rows.push(RowInfo {
                key,
                num_computed_before: pos,
                num_new_tokens: 1,
                is_decode: true,
                num_drafts: 0,
                num_logits: 1,
            });
        }
        Ok(out)
    }

    /// After the update of the step it was planned beside: whether the planned step `planned`
    /// is what `schedule()` would now make, up to rows of requests that ended meanwhile. Some:
    /// it is now the step in flight (with the ids finished since the last output); write the
    /// patch into its arrays before it runs. None: the plan is discarded (call `schedule()`).
    pub fn confirm_ahead(&mut self, planned: &mut SchedulerOutput) -> HsResult<Option<AheadPatch>> {
        if self.in_flight.is_some() {
            return Err(HsError::Internal(
                "confirm_ahead() before the update of the step in flight".into(),
            ));
        }
        let Some(step_id) = self.ahead.take() else {
            return Ok(None);
        };
        if step_id != planned.step_id {
            return Err(HsError::Internal(
                "confirm_ahead() got an output that is not the planned step".into(),
            ));
        }
        if !self.pending_publishes.is_empty()
            || !self.pending_deltas.is_empty()
            || self.could_admit()
        {
            return Ok(None);
        }
        let mut patch = AheadPatch {
            input_ids: Vec::with_capacity(planned.rows.len()),
            max_blocks: planned.max_blocks,
            window_len: planned.window_len,
            block_size: self.cfg.block_size,
            ..AheadPatch::default()
        };
        let mut live = 0usize;
        for (r, row) in planned.rows.iter().enumerate() {
            // the row's request, and the tokens it must have computed when the step starts
            let (key, pos) = (row.key, row.num_computed_before);
            match self.requests.get(&key) {
                Some(req) if req.status == RequestStatus::Running => {
                    if req.num_computed_tokens != pos
                        || !req.drafts.is_empty()
                        || req.num_tokens() != pos + 1
                    {
                        return Ok(None);
                    }
                    live += 1;
                    patch.input_ids.push(i64::from(req.all_token_ids[pos]));
                }
                _ => {
                    // ended since the plan: any valid token id will do
                    patch.input_ids.push(0);
                    patch.dead_rows.push(r);
                    patch.positions.push((r, pos));
                }
            }
        }
        if live == 0 || live != self.running.len() {
            return Ok(None);
        }
        self.in_flight = Some(step_id);
        planned.finished_req_ids = std::mem::take(&mut self.finished_ids);
        self.stats.num_steps += 1;
        self.stats.num_scheduled_tokens_last = planned.num_scheduled_tokens;
        self.stats.num_scheduled_tokens_total += planned.num_scheduled_tokens as u64;
        Ok(Some(patch))
    }

    /// Drops the step planned ahead, if any (its blocks stay with their requests).
    pub fn discard_ahead(&mut self) {
        self.ahead = None;
    }

    /// The id of the step planned ahead and not yet confirmed, if any.
    pub fn planned_step(&self) -> Option<u64> {
        self.ahead
    }
}
