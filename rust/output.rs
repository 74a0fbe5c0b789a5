//! `SchedulerOutput`: one step's batch as flat arrays (the layout of `model/batch.py`'s
//! ForwardBatch), plus the bookkeeping `update_from_output` needs.

use crate::cache::{ReqKey, SlotId};

/// What the scheduler remembers about one row of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowInfo {
    pub key: ReqKey,
    /// num_computed_tokens before this step.
    pub num_computed_before: usize,
    /// Tokens scheduled for the row (1 + k for decode rows).
    pub num_new_tokens: usize,
    /// A decode/verify row (state after every token goes to the window).
    pub is_decode: bool,
    /// Drafts verified by this row.
    pub num_drafts: usize,
    /// Logits the model returns for this row (0 for a partial prefill chunk).
    pub num_logits: usize,
}

/// One step's batch. Rows `[0, num_decodes)` are decode/verify rows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    /// Identifies the step; `update_from_output` must get the last scheduled output.
    pub step_id: u64,
    pub req_ids: Vec<std::sync::Arc<str>>,
    pub num_decodes: usize,
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    pub query_start_loc: Vec<i64>,
    pub num_computed_tokens: Vec<i64>,
    pub seq_lens: Vec<i64>,
    pub slot_mapping: Vec<i64>,
    /// Row-major [R, max_blocks], 0-padded.
    pub block_table: Vec<i64>,
    pub max_blocks: usize,
    pub state_read_slot: Vec<i64>,
    pub has_initial_state: Vec<bool>,
    /// Row-major [R, window_len].
    pub state_write_slots: Vec<i64>,
    pub window_len: usize,
    pub emit_row: Vec<i64>,
    pub emit_token: Vec<i64>,
    pub emit_slot: Vec<i64>,
    /// Row-major [C, 2] (src, dst) state slot copies, executed in order before the forward.
    pub state_copies: Vec<i64>,
    /// Row-major [C, 2] (src, dst) KV block copies (every attention layer), executed before the
    /// forward: a hit on a tail entry copies it into a block of the request's own.
    pub kv_copies: Vec<i64>,
    pub logits_indices: Vec<i64>,
    pub num_logits: Vec<i32>,
    pub num_draft_tokens: Vec<i32>,
    pub draft_token_ids: Vec<i32>,
    pub num_scheduled_tokens: usize,
    pub finished_req_ids: Vec<String>,
    /// Per-row bookkeeping (batch order).
    pub rows: Vec<RowInfo>,
    /// Pending checkpoints written by this step (emits and publish copies): committed in
    /// `update_from_output`.
    pub pending_checkpoints: Vec<SlotId>,
    /// For each pending checkpoint, the request whose row emits it (None for a publish copy of
    /// an earlier step's state). Kept in Rust: the emit arrays above are handed to the model.
    pub pending_checkpoint_owners: Vec<Option<ReqKey>>,
}

impl SchedulerOutput {
    pub fn num_rows(&self) -> usize {
        self.rows.len()
    }

    pub fn num_copies(&self) -> usize {
        self.state_copies.len() / 2
    }

    pub fn num_emits(&self) -> usize {
        self.emit_row.len()
    }

    /// Flat token range of row `r`.
    pub fn row_range(&self, r: usize) -> std::ops::Range<usize> {
        self.query_start_loc[r] as usize..self.query_start_loc[r + 1] as usize
    }

    /// The block-table row `r` (max_blocks entries).
    pub fn block_table_row(&self, r: usize) -> &[i64] {
        &self.block_table[r * self.max_blocks..(r + 1) * self.max_blocks]
    }

    /// The write window of row `r` (window_len entries).
    pub fn write_slots_row(&self, r: usize) -> &[i64] {
        &self.state_write_slots[r * self.window_len..(r + 1) * self.window_len]
    }

    /// The state copies as (src, dst) pairs.
    pub fn copies(&self) -> impl Iterator<Item = (i64, i64)> + '_ {
        self.state_copies.chunks_exact(2).map(|c| (c[0], c[1]))
    }
}
