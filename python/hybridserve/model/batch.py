"""ForwardBatch: everything one model forward needs, as tensors. The engine builds it from the Rust
scheduler's output; the model runner only reads it. This is the contract between the two halves.

Rows are requests; rows [0, num_decodes) are decode/verify rows, the rest are prefill rows.
Token t of row r is flat index query_start_loc[r] + t.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# The ForwardBatch fields that come from the scheduler's arrays: those moved to the model's
# device, and those kept on the CPU (the model reads them there).
DEVICE_ARRAYS = (
    "input_ids", "positions", "slot_mapping", "block_table", "state_read_slot", "has_initial_state",
    "state_write_slots", "emit_row", "emit_token", "emit_slot",
)  # fmt: skip
HOST_ARRAYS = ("query_start_loc", "num_computed_tokens", "seq_lens", "logits_indices")


@dataclass
class ForwardBatch:
    # --- tokens (T = total scheduled tokens) ---
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T], absolute positions in each sequence
    query_start_loc: torch.Tensor  # int64 [R + 1], CPU
    num_computed_tokens: torch.Tensor  # int64 [R], CPU: tokens already computed before this step
    seq_lens: torch.Tensor  # int64 [R], CPU: num_computed_tokens + tokens scheduled now
    num_decodes: int  # rows [0, num_decodes) write the state after every token (decode/verify)

    # --- attention (paged KV cache) ---
    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset; where token t's K/V goes
    block_table: torch.Tensor  # int64 [R, max_blocks_per_row], padded with 0 (the null block)

    # --- Mamba state (slot 0 is the null slot, never read or written as a real state) ---
    state_read_slot: torch.Tensor  # int64 [R]: slot holding the initial state of the row
    has_initial_state: torch.Tensor  # bool [R]: False -> start from the zero state (fresh prompt)
    # int64 [R, W] with W = 1 + K. Decode rows: the state after token t goes to [r, t] for t < n_r.
    # Prefill rows: the state after the row's last token goes to [r, 0]. Unused entries are 0.
    state_write_slots: torch.Tensor
    # Boundary-state emissions inside prefill rows (`all` and `align` modes): the state after token
    # emit_token[e] (index within row emit_row[e]) is written to slot emit_slot[e]. The scan kernels
    # take any token of the row, so a checkpoint may sit on any block boundary the scheduler picks,
    # whether or not it is a multiple of the scan's chunk size.
    emit_row: torch.Tensor  # int64 [E]
    emit_token: torch.Tensor  # int64 [E]
    emit_slot: torch.Tensor  # int64 [E]

    # --- outputs ---
    logits_indices: torch.Tensor  # int64 [L]: flat token indices whose logits the model returns

    @property
    def num_rows(self) -> int:
        return int(self.query_start_loc.numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


class HostStaging:
    """One host buffer a step's device arrays are packed into, copied to the device in one
    transfer and sliced there: on an accelerator that is one copy per step instead of one per
    array (ten), from page-locked memory where the device is CUDA. Kept by the model runner for
    its life and grown as needed. The buffer is written again only once the previous step's copy
    out of it has completed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)
        self._copied: Any = None  # the CUDA event after the last copy out of the buffer

    def buffer(self, size: int) -> torch.Tensor:
        """The host buffer, at least `size` long, free to write."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if self._host.numel() < size:
            self._host = torch.empty(
                max(size, 2 * self._host.numel()), dtype=torch.int64, pin_memory=self._pinned
            )
        return self._host

    def to_device(self, size: int) -> torch.Tensor:
        """The buffer's first `size` entries, copied to the device (always a copy: the next step
        writes the buffer again)."""
        moved = self._host[:size].to(self.device, non_blocking=self._pinned, copy=True)
        self._record_copy()
        return moved

    def copy_into(self, dst: torch.Tensor, size: int) -> None:
        """The buffer's first `size` entries copied into the first `size` of `dst` (int64, on the
        staging's device), a buffer kept by the caller (a CUDA graph's static inputs)."""
        dst[:size].copy_(self._host[:size], non_blocking=self._pinned)
        self._record_copy()

    def _record_copy(self) -> None:
        if self._pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()


def _packed_to_device(arrays: Mapping[str, np.ndarray], staging: HostStaging) -> dict[str, torch.Tensor]:
    """`DEVICE_ARRAYS` of `arrays` on the staging's device, moved in one copy: each field is a
    view of the one moved buffer, in its shape (`has_initial_state` compared to 0 there)."""
    flat = [np.asarray(arrays[name]) for name in DEVICE_ARRAYS]
    for name, a in zip(DEVICE_ARRAYS, flat):
        if a.dtype not in (np.int64, np.bool_):  # (the buffer is int64: anything else would change)
            raise TypeError(f"{name}: a staged array must be int64 or bool, got {a.dtype}")
    total = sum(a.size for a in flat)
    host = staging.buffer(total).numpy()
    offsets = []
    at = 0
    for a in flat:
        host[at : at + a.size] = a.reshape(-1)
        offsets.append(at)
        at += a.size
    moved = staging.to_device(total)
    fields: dict[str, torch.Tensor] = {}
    for name, a, start in zip(DEVICE_ARRAYS, flat, offsets):
        view = moved[start : start + a.size].view(a.shape)
        fields[name] = view != 0 if a.dtype == np.bool_ else view
    return fields


def forward_batch_from_arrays(
    arrays: Mapping[str, np.ndarray],
    num_decodes: int,
    device: torch.device,
    staging: HostStaging | None = None,
) -> ForwardBatch:
    """A ForwardBatch of numpy arrays named as its fields (the scheduler's output, or what a
    tensor-parallel worker receives of it). With `staging` the device arrays move in one copy
    (`HostStaging`); without, each is moved alone (on the CPU: wrapped without a copy)."""

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    def host(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    if staging is not None:
        fields = _packed_to_device(arrays, staging)
    else:
        fields = {name: t(arrays[name]) for name in DEVICE_ARRAYS}
    fields.update({name: host(arrays[name]) for name in HOST_ARRAYS})
    return ForwardBatch(num_decodes=int(num_decodes), **fields)
