//! A request's state machine: waiting -> running <-> preempted -> finished, its tokens (prompt and
//! accepted output), the stop conditions the scheduler enforces, and its chained block hashes.

use std::sync::Arc;

use crate::block_hash::{BlockHash, BlockHasher};
use crate::cache::{CheckpointKind, Prefix, ReqKey};
use crate::error::{HsError, HsResult};

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// An EOS or stop token id ended it (the token is part of the output).
    Stop,
    /// `max_tokens` or `max_model_len` was reached (or it cannot fit in the cache at all).
    Length,
    /// Aborted by the caller.
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestStatus {
    /// Never scheduled yet.
    Waiting,
    Running,
    /// Preempted by recompute: back in the waiting queue, holds nothing.
    Preempted,
    Finished(FinishReason),
}

/// The limits the scheduler enforces token by token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopParams {
    pub max_tokens: usize,
    pub eos_token_id: Option<u32>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub min_tokens: usize,
}

impl StopParams {
    pub fn max_tokens(max_tokens: usize) -> Self {
        StopParams {
            max_tokens,
            eos_token_id: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
        }
    }
}

/// Everything the caller gives for a new request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRequest {
    pub request_id: String,
    pub prompt_token_ids: Vec<u32>,
    pub stop: StopParams,
    /// Lower values are served first (and preempted last).
    pub priority: i64,
    pub cache_salt: Option<String>,
    /// Compute the whole prompt even where the prefix cache holds it: the caller needs the
    /// logits of every prompt position (prompt logprobs). The blocks and states it computes are
    /// still cached for others; once its prompt is done (a resume after preemption) it hits.
    pub skip_prefix_hit: bool,
    /// How many leading prompt tokens other prompts are expected to share (e.g. where a chat's
    /// system message ends), if the caller knows. The first request to compute that prefix keeps
    /// the state at its last full KV block, so that the second sharer already hits it (branch
    /// placement; without it the second sharer is the one that finds the branch point).
    pub shared_prefix_len: Option<usize>,
}

impl NewRequest {
    pub fn new(
        request_id: impl Into<String>,
        prompt_token_ids: Vec<u32>,
        max_tokens: usize,
    ) -> Self {
        NewRequest {
            request_id: request_id.into(),
            prompt_token_ids,
            stop: StopParams::max_tokens(max_tokens),
            priority: 0,
            cache_salt: None,
            skip_prefix_hit: false,
            shared_prefix_len: None,
        }
    }
}

/// A request inside the scheduler.
#[derive(Debug, Clone)]
pub struct Request {
    pub key: ReqKey,
    pub id: Arc<str>,
    pub num_prompt_tokens: usize,
    /// Prompt followed by the accepted output tokens. Drafts are never in here.
    pub all_token_ids: Vec<u32>,
    pub stop: StopParams,
    pub priority: i64,
    /// Arrival order (monotonic per scheduler).
    pub arrival: u64,
    pub cache_salt: Option<String>,
    /// See `NewRequest::skip_prefix_hit`.
    pub skip_prefix_hit: bool,
    /// See `NewRequest::shared_prefix_len`.
    pub shared_prefix_len: Option<usize>,
    pub status: RequestStatus,
    /// Tokens whose KV and state are computed (and valid) in the current residency.
    pub num_computed_tokens: usize,
    /// Chained hashes of the full blocks of `all_token_ids` (only with prefix caching on).
    pub block_hashes: Vec<BlockHash>,
    /// The parent hash of block 0 (the chain root of the request's cache salt).
    pub root_hash: BlockHash,
    /// Where this residency keeps a checkpoint for later sharers (a branch point found at
    /// admission, or the deepest grid point of the cached KV prefix in align mode), and why;
    /// cleared once a chunk has passed it.
    pub branch_at: Option<(usize, CheckpointKind)>,
    /// Drafts proposed for the next step.
    pub drafts: Vec<u32>,
    /// Index in the state window of the slot holding the live state (a_prev - 1, or 0).
    pub live_window_index: usize,
    /// Prefix-cache hit length at the first admission.
    pub num_cached_tokens: usize,
    /// Set once the request has been admitted once (num_cached_tokens is final then).
    pub was_admitted: bool,
    pub num_preemptions: u32,
    /// A running prefill held back in the last step it could run: it gave way to short waiting
    /// prompts, or the rows planned before it left it too few tokens to advance (its align chunk
    /// rounded down to none, or its whole prompt did not fit without chunked prefill). In the
    /// next step it goes first among the prefills, with the tokens that advance it kept from the
    /// decode rows, so that a stream of short requests (they become decode rows) slows a long
    /// prefill to at most every other step and never starves it.
    pub held_back: bool,
    /// The token that stopped the request, when FinishReason::Stop.
    pub stop_token_id: Option<u32>,
}

impl Request {
    pub fn new(key: ReqKey, arrival: u64, req: NewRequest) -> Self {
        Request {
            key,
            id: req.request_id.into(),
            num_prompt_tokens: req.prompt_token_ids.len(),
            all_token_ids: req.prompt_token_ids,
            stop: req.stop,
            priority: req.priority,
            arrival,
            cache_salt: req.cache_salt,
            skip_prefix_hit: req.skip_prefix_hit,
            shared_prefix_len: req.shared_prefix_len,
            status: RequestStatus::Waiting,
            num_computed_tokens: 0,
            block_hashes: Vec::new(),
            root_hash: BlockHash(0),
            branch_at: None,
            drafts: Vec::new(),
            live_window_index: 0,
            num_cached_tokens: 0,
            was_admitted: false,
            num_preemptions: 0,
            held_back: false,
            stop_token_id: None,
        }
    }

    /// Checks a new request against the engine limits. `max_model_len` bounds prompt + output.
    pub fn validate(req: &NewRequest, max_model_len: usize) -> HsResult<()> {
        let bad = |m: String| {
            Err(HsError::InvalidRequest(format!(
                "request {:?}: {m}",
                req.request_id
            )))
        };
        if req.prompt_token_ids.is_empty() {
            return bad("the prompt is empty".into());
        }
        if req.prompt_token_ids.len() >= max_model_len {
            return bad(format!(
                "the prompt has {} tokens; max_model_len is {max_model_len}, which leaves no room for output",
                req.prompt_token_ids.len()
            ));
        }
        if let Some(n) = req.shared_prefix_len {
            if n > req.prompt_token_ids.len() {
                return bad(format!(
                    "shared_prefix_len ({n}) is longer than the prompt ({} tokens)",
                    req.prompt_token_ids.len()
                ));
            }
        }
        if req.stop.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        if req.stop.min_tokens > req.stop.max_tokens {
            return bad(format!(
                "min_tokens ({}) is larger than max_tokens ({})",
                req.stop.min_tokens, req.stop.max_tokens
            ));
        }
        Ok(())
    }

    /// Prompt plus accepted output tokens.
    pub fn num_tokens(&self) -> usize {
        self.all_token_ids.len()
    }

    pub fn num_output_tokens(&self) -> usize {
        self.all_token_ids.len() - self.num_prompt_tokens
    }

    pub fn output_token_ids(&self) -> &[u32] {
        &self.all_token_ids[self.num_prompt_tokens..]
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.status, RequestStatus::Finished(_))
    }

    /// Output tokens it may still produce (>= 1 while unfinished).
    pub fn remaining_output(&self, max_model_len: usize) -> usize {
        let by_tokens = self
            .stop
            .max_tokens
            .saturating_sub(self.num_output_tokens());
        let by_len = max_model_len.saturating_sub(self.num_tokens());
        by_tokens.min(by_len)
    }

    /// Appends one sampled token and applies the stop conditions. Returns the finish reason if this
    /// token ended the request (the token is kept).
    pub fn append_token(&mut self, token: u32, max_model_len: usize) -> Option<FinishReason> {
        self.all_token_ids.push(token);
        let n_out = self.num_output_tokens();
        if n_out >= self.stop.min_tokens {
            let is_eos = !self.stop.ignore_eos && self.stop.eos_token_id == Some(token);
            if is_eos || self.stop.stop_token_ids.contains(&token) {
                self.stop_token_id = Some(token);
                self.status = RequestStatus::Finished(FinishReason::Stop);
                return Some(FinishReason::Stop);
            }
        }
        if n_out >= self.stop.max_tokens || self.num_tokens() >= max_model_len {
            self.status = RequestStatus::Finished(FinishReason::Length);
            return Some(FinishReason::Length);
        }
        None
    }

    /// The request's tokens and hash chain, for cache lookups.
    pub fn prefix(&self) -> Prefix<'_> {
        Prefix {
            hashes: &self.block_hashes,
            tokens: &self.all_token_ids,
            root: self.root_hash,
        }
    }

    /// Brings `block_hashes` up to date with `all_token_ids`.
    pub fn update_hashes(&mut self, hasher: &BlockHasher, block_size: usize) {
        hasher.extend(
            &mut self.block_hashes,
            &self.all_token_ids,
            block_size,
            self.cache_salt.as_deref(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(max_tokens: usize) -> Request {
        Request::new(1, 0, NewRequest::new("a", vec![1, 2, 3], max_tokens))
    }

    #[test]
    fn validation_rejects_bad_requests() {
        let ok = NewRequest::new("a", vec![1, 2], 4);
        assert!(Request::validate(&ok, 16).is_ok());
        assert!(Request::validate(&NewRequest::new("a", vec![], 4), 16).is_err());
        assert!(Request::validate(&NewRequest::new("a", vec![1, 2], 0), 16).is_err());
        assert!(Request::validate(&NewRequest::new("a", vec![1; 16], 4), 16).is_err());
        let mut m = ok.clone();
        m.stop.min_tokens = 5;
        assert!(matches!(
            Request::validate(&m, 16),
            Err(HsError::InvalidRequest(_))
        ));
    }

    #[test]
    fn max_tokens_stops_with_length() {
        let mut r = req(2);
        assert_eq!(r.append_token(7, 100), None);
        assert_eq!(r.append_token(8, 100), Some(FinishReason::Length));
        assert_eq!(r.output_token_ids(), &[7, 8]);
        assert_eq!(r.status, RequestStatus::Finished(FinishReason::Length));
    }

    #[test]
    fn max_model_len_stops_with_length() {
        let mut r = req(100);
        assert_eq!(r.append_token(7, 5), None);
        assert_eq!(r.append_token(8, 5), Some(FinishReason::Length));
    }

    #[test]
    fn eos_and_stop_ids_respect_ignore_eos_and_min_tokens() {
        let mut r = req(10);
        r.stop.eos_token_id = Some(0);
        r.stop.stop_token_ids = vec![9];
        r.stop.min_tokens = 2;
        assert_eq!(
            r.append_token(0, 100),
            None,
            "EOS before min_tokens is ignored"
        );
        assert_eq!(r.append_token(0, 100), Some(FinishReason::Stop));
        assert_eq!(r.stop_token_id, Some(0));

        let mut r = req(10);
        r.stop.eos_token_id = Some(0);
        r.stop.ignore_eos = true;
        r.stop.stop_token_ids = vec![9];
        assert_eq!(r.append_token(0, 100), None);
        assert_eq!(r.append_token(9, 100), Some(FinishReason::Stop));
        assert_eq!(r.stop_token_id, Some(9));
    }

    #[test]
    fn stop_token_wins_over_length_on_the_last_token() {
        let mut r = req(1);
        r.stop.eos_token_id = Some(5);
        assert_eq!(r.append_token(5, 100), Some(FinishReason::Stop));
    }

    #[test]
    fn hashes_follow_tokens() {
        let h = BlockHasher::new(0);
        let mut r = req(10);
        r.update_hashes(&h, 2);
        assert_eq!(r.block_hashes.len(), 1);
        r.append_token(4, 100);
        r.update_hashes(&h, 2);
        assert_eq!(r.block_hashes.len(), 2);
        let mut direct = Vec::new();
        h.extend(&mut direct, &[1, 2, 3, 4], 2, None);
        assert_eq!(direct, r.block_hashes);
    }
}
