"""Type stubs of the Rust extension module `hybridserve._core` (rust/py/). Keep in step with it."""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__version__: str

class HybridServeError(Exception): ...
class ConfigError(HybridServeError): ...
class InvalidRequestError(HybridServeError): ...
class InternalError(HybridServeError): ...

# --- scheduler (rust/py/scheduler.rs) -------------------------------------------------------------

class SchedulerOutput:
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
    def state_copies(self) -> npt.NDArray[np.int64]: ...  # [C, 2] (src, dst), in order, BEFORE the forward
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
    def __len__(self) -> int: ...

class RequestDelta:
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

class Scheduler:
    """Continuous batching with chunked prefill, hybrid prefix caching and speculative bookkeeping.
    Lower `priority` values are served first and preempted last; ties go by arrival (FCFS).
    Call update_from_output() with every output that has rows before the next schedule(); an output
    with no rows (nothing fits right now) needs no update and carries no state copies."""

    def __init__(
        self, config: ResolvedConfig, num_kv_blocks: int, num_mamba_slots: int, hash_seed: int = 0
    ) -> None: ...  # ConfigError on unusable sizes (both counts include the null block/slot 0)
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int,
        eos_token_id: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        min_tokens: int = 0,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None: ...  # InvalidRequestError on bad input (empty, too long, duplicate id, ...)
    def abort_request(self, request_id: str) -> bool: ...
    def schedule(self) -> SchedulerOutput: ...  # GIL released
    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: npt.NDArray[np.int32],
        num_sampled: npt.NDArray[np.int32],
        draft_token_ids: npt.NDArray[np.int32] | None = None,
        num_drafts: npt.NDArray[np.int32] | None = None,
    ) -> list[RequestDelta]: ...  # GIL released; int64 arrays and lists are accepted too
    def has_unfinished_requests(self) -> bool: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def reset_prefix_cache(self) -> bool: ...  # False while blocks are in use
    def get_token_ids(self, request_id: str) -> list[int]: ...  # prompt + output so far
    def get_num_computed_tokens(self, request_id: str) -> int | None: ...  # extension
