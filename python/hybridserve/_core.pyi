"""Type stubs of the Rust extension module `hybridserve._core` (rust/py/). Keep in step with it."""

from collections.abc import Sequence
from typing import Literal, TypeAlias, final

import numpy as np
import numpy.typing as npt

# Token id arrays the scheduler takes: int32 or int64 arrays, or lists.
_IntArray = npt.NDArray[np.int32] | npt.NDArray[np.int64] | Sequence[int]

__version__: str

class HybridServeError(Exception): ...
class ConfigError(HybridServeError): ...
class InvalidRequestError(HybridServeError): ...
class InternalError(HybridServeError): ...

# --- policy (rust/py/policy.rs) -------------------------------------------------------------------

DEFAULT_BLOCK_SIZE: int  # 16
DEFAULT_MAX_NUM_SEQS: int  # 64
DEFAULT_MAX_NUM_BATCHED_TOKENS: int  # 2048
DEFAULT_MAX_MODEL_LEN: int  # 4096, when the model declares no max_position_embeddings
MIN_AUTO_MAMBA_BLOCK_SIZE: int  # 256
MAX_SPECULATIVE_TOKENS: int  # 16
MAX_BLOCK_SIZE: int  # 1024
MAX_SCAN_CHUNK_SIZE: int  # 4096
MAX_TOKENS: int  # 2**24: bound on every token count
MAX_NUM_SEQS: int  # 2**16
MAX_KV_BLOCKS: int  # 2**25, null block included
MAX_MAMBA_SLOTS: int  # 2**22, null slot included

# The names each enum setting accepts (the Rust enums' names: rust/config.rs, rust/policy.rs).
MambaCacheModeName: TypeAlias = Literal["auto", "none", "align", "all"]  # as requested
ResolvedMambaCacheMode: TypeAlias = Literal["none", "align", "all"]
CheckpointPlacementName: TypeAlias = Literal["branch", "grid", "branch+grid"]
EvictionPolicyName: TypeAlias = Literal["flops", "lru", "lru-path"]
SpeculativeMethodName: TypeAlias = Literal["ngram", "draft_model"]
MAMBA_CACHE_MODES: tuple[MambaCacheModeName, ...]
CHECKPOINT_PLACEMENTS: tuple[CheckpointPlacementName, ...]
EVICTION_POLICIES: tuple[EvictionPolicyName, ...]
# where a Mamba checkpoint was placed: "grid", "branch", "last_token", "declared" (the suffixes of
# Scheduler.stats' per-kind keys)
CHECKPOINT_KINDS: tuple[str, ...]
SPECULATIVE_METHODS: tuple[SpeculativeMethodName, ...]
# (smallest, largest) of every integer setting the core checks, by EngineArgs field name
FLAG_LIMITS: dict[str, tuple[int, int]]

@final
class Decision:  # made by the extension only: no constructor
    """One decision of the cache-mode policy."""

    @property
    def code(self) -> str: ...  # stable identifier, e.g. "mode_align_for_speculative"
    @property
    def level(self) -> str: ...  # "info" | "warning"
    @property
    def message(self) -> str: ...
    def to_dict(self) -> dict[str, str]: ...

@final
class ResolvedConfig:  # made by the extension only: no constructor
    """The validated engine configuration (Rust ResolvedConfig) and the decisions behind it."""

    @property
    def has_mamba_layers(self) -> bool: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def mamba_cache_mode(self) -> ResolvedMambaCacheMode: ...
    @property
    def enable_chunked_prefill(self) -> bool: ...
    @property
    def block_size(self) -> int: ...  # B
    @property
    def mamba_block_size(self) -> int: ...  # M (a multiple of B; unused in mode none)
    @property
    def scan_chunk_size(self) -> int: ...  # Q (= B for a model without Mamba layers)
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def num_speculative_tokens(self) -> int: ...  # K, 0 without speculative decoding
    @property
    def speculative_method(self) -> SpeculativeMethodName | None: ...
    @property
    def state_window_len(self) -> int: ...  # 1 + K
    @property
    def checkpoint_placement(self) -> CheckpointPlacementName: ...
    @property
    def eviction(self) -> EvictionPolicyName: ...
    @property
    def decisions(self) -> list[Decision]: ...
    def validate_pool_sizes(self, num_kv_blocks: int, num_mamba_slots: int) -> None: ...
    # ConfigError; OverflowError for a negative count (the counts are unsigned)
    @staticmethod
    def for_tests(
        mode: ResolvedMambaCacheMode = "align", num_speculative_tokens: int = 0
    ) -> ResolvedConfig: ...
    def to_dict(self) -> dict[str, object]: ...

def resolve_policy(
    *,
    has_mamba_layers: bool,
    supports_boundary_states: bool,
    scan_chunk_size: int | None = None,
    max_position_embeddings: int | None = None,
    enable_prefix_caching: bool | str | None = None,  # None/"auto", True/"on", False/"off"
    mamba_cache_mode: MambaCacheModeName = "auto",
    enable_chunked_prefill: bool | str | None = None,
    speculative_method: SpeculativeMethodName | None = None,
    num_speculative_tokens: int = 0,
    block_size: int = ...,  # DEFAULT_BLOCK_SIZE
    mamba_block_size: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int = ...,  # DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None,
    mamba_checkpoint_placement: CheckpointPlacementName | None = None,  # None: the policy decides
    prefix_cache_eviction: EvictionPolicyName | None = None,  # None: flops
) -> ResolvedConfig: ...  # ConfigError naming the flag(s) to change
def auto_mamba_block_size(block_size: int, scan_chunk_size: int) -> int: ...

# --- scheduler (rust/py/scheduler.rs) -------------------------------------------------------------

@final
class SchedulerOutput:  # made by the extension only: no constructor
    """One step's batch (the layout of model/batch.py's ForwardBatch). Rows [0, num_decodes) are
    decode/verify rows. Each array getter moves the Rust buffer into numpy on first access (no copy)
    and returns the same array object afterwards. R rows, T tokens, W = 1 + K window slots."""

    @property
    def req_ids(self) -> list[str]: ...  # batch order
    @property
    def num_decodes(self) -> int: ...
    @property
    def num_rows(self) -> int: ...  # R (extension; also len(output))
    @property
    def num_scheduled_tokens(self) -> int: ...  # T
    @property
    def step_id(self) -> int: ...  # extension: 0 for an output without rows
    @property
    def input_ids(self) -> npt.NDArray[np.int64]: ...  # [T]
    @property
    def positions(self) -> npt.NDArray[np.int64]: ...  # [T]
    @property
    def query_start_loc(self) -> npt.NDArray[np.int64]: ...  # [R + 1]
    @property
    def num_computed_tokens(self) -> npt.NDArray[np.int64]: ...  # [R]
    @property
    def seq_lens(self) -> npt.NDArray[np.int64]: ...  # [R]
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]: ...  # [T] block_id * block_size + offset
    @property
    def block_table(self) -> npt.NDArray[np.int64]: ...  # [R, max_blocks], 0-padded
    @property
    def state_read_slot(self) -> npt.NDArray[np.int64]: ...  # [R], 0 when has_initial_state is False
    @property
    def has_initial_state(self) -> npt.NDArray[np.bool_]: ...  # [R]
    @property
    def state_write_slots(self) -> npt.NDArray[np.int64]: ...  # [R, W], unused entries 0
    @property
    def emit_row(self) -> npt.NDArray[np.int64]: ...  # [E]
    @property
    def emit_token(self) -> npt.NDArray[np.int64]: ...  # [E] token index within the row
    @property
    def emit_slot(self) -> npt.NDArray[np.int64]: ...  # [E]
    @property
    def state_copies(
        self,
    ) -> npt.NDArray[np.int64]: ...  # [C, 2] (src, dst) slots, in order, BEFORE the forward
    @property
    def kv_copies(self) -> npt.NDArray[np.int64]: ...  # [C, 2] (src, dst) KV blocks, BEFORE the forward
    @property
    def logits_indices(self) -> npt.NDArray[np.int64]: ...  # [sum num_logits], flat token indices
    @property
    def num_logits(self) -> npt.NDArray[np.int32]: ...  # [R]: 0 partial prefill, 1, or 1 + k
    @property
    def num_draft_tokens(self) -> npt.NDArray[np.int32]: ...  # [R]
    @property
    def draft_token_ids(self) -> npt.NDArray[np.int32]: ...  # [sum k], also the last k inputs of each row
    @property
    def finished_req_ids(self) -> list[str]: ...  # finished or aborted since the previous output
    def step_layout(self) -> list[int] | None:
        """None for a step without rows; else [tokens, rows, num_decodes, len(logits_indices),
        len(emit_row), block_table's row stride, state_write_slots' row stride] and the data
        addresses of input_ids, positions, slot_mapping, block_table, state_read_slot,
        state_write_slots, query_start_loc, logits_indices, has_initial_state, emit_row,
        emit_token, emit_slot (the getters' arrays)."""
    def __len__(self) -> int: ...

@final
class RequestDelta:  # made by the extension only: no constructor
    """What one step changed for one request."""

    @property
    def request_id(self) -> str: ...
    @property
    def new_token_ids(self) -> list[int]: ...  # includes the stop token when one ended it
    @property
    def finished(self) -> bool: ...
    @property
    def finish_reason(self) -> str | None: ...  # "stop" | "length" | "abort" | None
    @property
    def stop_token_id(self) -> int | None: ...
    @property
    def num_cached_tokens(self) -> int: ...  # prefix-cache hit at the first admission

@final
class Scheduler:
    """Continuous batching with chunked prefill, hybrid prefix caching and speculative bookkeeping.
    Lower `priority` values are served first and preempted last; ties go by arrival (FCFS).
    Step loop: out = schedule(); if out.num_rows: apply out.state_copies, run the forward, sample;
    then ALWAYS deltas = update_from_output(out, ...) (with empty arrays when there are no rows: it
    then returns the deltas of requests the scheduler finished by itself, e.g. a request that
    cannot fit in the KV cache even alone -> finish_reason "length"). An output with no rows
    carries no state copies and no emits. schedule() raises InternalError if the previous output
    with rows was not updated. num_sampled[r] is 0 for partial prefill rows, 1 for the last chunk,
    1..1+k (accepted drafts + 1) for decode/verify rows, and may be 0 for a row whose request was
    aborted after schedule(). Checkpoint placement: with "branch", a prompt whose cached KV prefix
    reaches past its state hit keeps the state at the deepest cached block (mode all: an emit
    inside the row; mode align: a chunk ends there), and a finished, preempted or
    finish_request()-ed request keeps the state after its last computed token (a prompt that
    extends it hits it, the partly filled block copied by kv_copies). With "grid", in align mode the
    chunk that reaches the end of a prompt is first cut at the prompt's last multiple of
    mamba_block_size: a prompt of L tokens with M < L, L % M != 0, takes two prefill steps."""

    def __new__(
        cls, config: ResolvedConfig, num_kv_blocks: int, num_mamba_slots: int, hash_seed: int | None = None
    ) -> Scheduler: ...
    # ConfigError on unusable sizes (both counts include the null block/slot 0), OverflowError for
    # a negative count; hash_seed None = 0, a negative seed counts as its two's-complement bits
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int,
        eos_token_id: int | None = None,
        stop_token_ids: Sequence[int] = ...,  # none
        ignore_eos: bool = False,
        min_tokens: int = 0,
        priority: int = 0,
        cache_salt: str | None = None,
        skip_prefix_hit: bool = False,  # compute the whole prompt (prompt logprobs); still cached
        # leading tokens other prompts will share (a system message): its first user keeps the
        # state at the last full block of it, so the second already hits; <= len(prompt)
        shared_prefix_len: int | None = None,
    ) -> None: ...  # InvalidRequestError on bad input (empty, too long, duplicate id, ...)
    def abort_request(self, request_id: str) -> bool: ...
    def finish_request(self, request_id: str) -> bool: ...
    def schedule(self) -> SchedulerOutput: ...  # GIL released
    def schedule_ahead(self) -> SchedulerOutput | None:
        """The step after the one in flight, planned while it runs: its input tokens are
        placeholders until `confirm_ahead`. None where its plan could depend on the tokens of
        the step in flight (a prefill row, drafts, a grid boundary, a request that could be
        admitted) or no step is in flight."""
    def confirm_ahead(self, planned: SchedulerOutput) -> bool:
        """After the update of the step in flight: True when the planned step is what `schedule`
        would now make; it is then the step in flight, its `input_ids` hold the tokens just
        sampled, and rows of requests that ended since write nothing that is read. False: the
        plan is discarded (call `schedule`). InvalidRequestError for an output that is not the
        planned one."""
    def discard_ahead(self) -> None: ...  # drops the step planned ahead, if any
    def open_step_output(self) -> SchedulerOutput | None:
        """The output of the step scheduled and not yet updated (the same object `schedule`
        returned), None if no step is open: how a caller that lost it closes the step."""
    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: _IntArray,
        num_sampled: _IntArray,
        draft_token_ids: _IntArray | None = None,
        num_drafts: _IntArray | None = None,
    ) -> list[RequestDelta]: ...  # GIL released
    def cancel_step(self, output: SchedulerOutput) -> list[RequestDelta]: ...
    # closes the open step whose forward did not complete: its pending checkpoints are cancelled,
    # its still-running requests go back to waiting; InvalidRequestError if it is not the open step
    def has_unfinished_requests(self) -> bool: ...  # also True while a finish delta is pending
    def set_state_bytes_per_slot(self, num_bytes: int) -> None: ...  # extension, for stats
    def set_cost_model(
        self,
        *,
        state_bytes: int,
        kv_bytes_per_block: int,
        flops_per_token: float,
        attn_flops_per_context_token: float,
        flop_weight: float | None = None,
    ) -> None: ...  # the flops eviction score and the FLOP stats; InvalidRequestError if a FLOP
    # count or flop_weight is negative or not finite, OverflowError if a byte count is outside u64
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    # stats() keys: num_running, num_waiting, num_preempted (now), num_preemptions_total, num_steps,
    # num_scheduled_tokens (last step), num_scheduled_tokens_total, num_finished_total,
    # num_aborted_total, prefix_queried_tokens, prefix_hit_tokens, prefix_lost_tokens (once per
    # admission that may read the cache), prefix_preempted_queried_tokens, prefix_preempted_hit_tokens (the part of
    # admissions after a preemption), spec_drafted_tokens, spec_accepted_tokens, checkpoints_emitted,
    # checkpoints_published, kv_blocks_total, kv_blocks_used, kv_blocks_cached_free,
    # mamba_slots_total, mamba_slots_used, checkpoints_committed, checkpoints_pending,
    # checkpoint_bytes, cache_queried_tokens, cache_hit_tokens, cache_kv_hit_tokens,
    # cache_lost_tokens (every lookup), kv_evictions, checkpoint_evictions, max_num_batched_tokens,
    # max_num_seqs, num_speculative_tokens; by checkpoint kind (grid, branch, last_token, declared):
    # prefix_hits_{kind}, prefix_hit_tokens_{kind} (admissions), checkpoints_{kind} (committed now);
    # checkpoints_kept (last-token states kept), kv_evictions_useless (blocks no hit could use),
    # checkpoint_evictions_{stale,for_checkpoint,for_window,for_kv}, kv_blocks_cached,
    # mamba_slots_window, kv_events_emitted; floats: prefill_flops_queried, prefill_flops_saved
    # (cost model's), checkpoint_reuse_rate_{kind} (the running reuse rate the eviction reads).
    def stats(self) -> dict[str, int | float]: ...
    def reset_prefix_cache(self) -> bool: ...  # False while blocks are in use
    # KV cache events (docs/kv-events.md): recorded from the call on.
    def enable_kv_events(self) -> None: ...
    # (kind "stored" | "removed" | "cleared", group 0 attention | 1 mamba, block id, parent id,
    # token ids) since the last call, in order; empty unless enabled.
    def take_kv_events(self) -> list[tuple[str, int, int, int | None, list[int]]]: ...
    def get_token_ids(self, request_id: str) -> list[int]: ...  # prompt + output; raises once finished
    def get_num_computed_tokens(self, request_id: str) -> int | None: ...  # extension
