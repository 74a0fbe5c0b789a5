"""ForwardContext: per-forward metadata derived once from a ForwardBatch and shared by all layers
(decode / prefill splits of the state-window arrays, rebased emits, rotary tables)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridserve.model.batch import ForwardBatch


def _host64(t: torch.Tensor) -> torch.Tensor:
    """t as int64 on the CPU; t itself when it is (the scheduler's arrays are)."""
    if t.dtype == torch.int64 and t.is_cpu:
        return t
    return t.to(torch.device("cpu"), torch.int64)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t as int64 on `device`; t itself when it is."""
    if t.dtype == torch.int64 and t.device == device:
        return t
    return t.to(device, torch.int64)


# The prefill fields of a decode-only step (never written: layers only read them).
_ZERO_QSL = torch.zeros(1, dtype=torch.int64)
_EMPTY64 = torch.zeros(0, dtype=torch.int64)
_EMPTY_BOOL = torch.zeros(0, dtype=torch.bool)


@dataclass
class ForwardContext:
    batch: ForwardBatch
    device: torch.device
    num_tokens: int
    num_decodes: int
    num_decode_tokens: int  # decode tokens are the flat range [0, num_decode_tokens)
    positions: torch.Tensor  # int64 [T] on device
    slot_mapping: torch.Tensor  # int64 [T] on device
    block_table: torch.Tensor  # int64 [R, max_blocks] on device
    qsl: torch.Tensor  # int64 [R + 1] CPU
    seq_lens: torch.Tensor  # int64 [R] CPU
    num_computed: torch.Tensor  # int64 [R] CPU
    logits_indices: torch.Tensor  # int64 [L] CPU: the tokens whose logits the forward returns
    # decode subset (rows [0, num_decodes))
    dec_qsl: torch.Tensor  # CPU, from 0
    dec_read_slot: torch.Tensor
    dec_write_slots: torch.Tensor
    # prefill subset (rows [num_decodes, R)), token offsets rebased to 0
    pre_qsl: torch.Tensor  # CPU, from 0
    pre_num_computed: torch.Tensor  # CPU
    pre_read_slot: torch.Tensor
    pre_has_initial_state: torch.Tensor
    pre_write_slot: torch.Tensor
    emit_row: torch.Tensor  # rebased to prefill rows
    emit_token: torch.Tensor
    emit_slot: torch.Tensor
    # per-forward values that layers build once and share (keyed by the layer kind's own keys)
    scratch: dict[tuple[object, ...], object] = field(default_factory=dict)
    _rope_cache: dict[tuple[int, float, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )

    @classmethod
    def build(cls, batch: ForwardBatch, device: torch.device) -> ForwardContext:
        qsl = _host64(batch.query_start_loc)
        nd = int(batch.num_decodes)
        R = int(qsl.numel()) - 1
        T = int(batch.input_ids.numel())
        bounds = qsl[[nd, R]].tolist() if R >= 0 else [0, 0]  # one read for both ends
        if bounds[1] != T:
            raise ValueError(f"query_start_loc ends at {bounds[1]} but the batch has {T} tokens")
        ndt = bounds[0]
        wslots = _host64(batch.state_write_slots)
        if wslots.dim() == 1:
            wslots = wslots[:, None]
        read_slot = _host64(batch.state_read_slot)
        num_computed = _host64(batch.num_computed_tokens)
        er = _host64(batch.emit_row)
        if er.numel() > 0 and bool((er < nd).any()):
            raise ValueError("emits are only allowed in prefill rows")
        if R == nd:  # decode rows only (every decode step): the prefill fields are empty
            pre_qsl, pre_computed, pre_read, pre_init, pre_write = (
                _ZERO_QSL, _EMPTY64, _EMPTY64, _EMPTY_BOOL, _EMPTY64,
            )  # fmt: skip
            emit_row = er
        else:
            pre_qsl = qsl[nd:] - ndt
            pre_computed = num_computed[nd:]
            pre_read = read_slot[nd:]
            pre_init = batch.has_initial_state.to(torch.device("cpu"), torch.bool)[nd:]
            pre_write = wslots[nd:, 0]
            emit_row = er - nd
        return cls(
            batch=batch,
            device=device,
            num_tokens=T,
            num_decodes=nd,
            num_decode_tokens=ndt,
            positions=_on(batch.positions, device),
            slot_mapping=_on(batch.slot_mapping, device),
            block_table=_on(batch.block_table, device),
            qsl=qsl,
            seq_lens=_host64(batch.seq_lens),
            num_computed=num_computed,
            logits_indices=_host64(batch.logits_indices),
            dec_qsl=qsl[: nd + 1].clone(),
            dec_read_slot=read_slot[:nd],
            dec_write_slots=wslots[:nd],
            pre_qsl=pre_qsl,
            pre_num_computed=pre_computed,
            pre_read_slot=pre_read,
            pre_has_initial_state=pre_init,
            pre_write_slot=pre_write,
            emit_row=emit_row,
            emit_token=_host64(batch.emit_token),
            emit_slot=_host64(batch.emit_slot),
        )

    @property
    def num_rows(self) -> int:
        return int(self.qsl.numel()) - 1

    @property
    def num_prefills(self) -> int:
        return self.num_rows - self.num_decodes

    def rope(self, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, rotary_dim]`` for the batch positions (HF default rope: ``cat(freqs,
        freqs)``), computed in fp32 (fp64 for fp64 models) and cast to ``dtype``."""
        key = (rotary_dim, theta, dtype)
        hit = self._rope_cache.get(key)
        if hit is not None:
            return hit
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, rotary_dim, 2, dtype=cdt, device=self.device) / rotary_dim)
        )
        freqs = self.positions.to(cdt)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        out = (emb.cos().to(dtype), emb.sin().to(dtype))
        self._rope_cache[key] = out
        return out
