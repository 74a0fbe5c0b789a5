"""ForwardContext: per-forward metadata derived once from a ForwardBatch and shared by all layers
(decode / prefill splits of the state-window arrays, rebased emits, rotary tables)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridserve.model.batch import ForwardBatch


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
        cpu = torch.device("cpu")
        qsl = batch.query_start_loc.to(cpu, torch.int64)
        nd = int(batch.num_decodes)
        R = int(qsl.numel()) - 1
        T = int(batch.input_ids.numel())
        if int(qsl[-1]) != T:
            raise ValueError(f"query_start_loc ends at {int(qsl[-1])} but the batch has {T} tokens")
        ndt = int(qsl[nd])
        wslots = batch.state_write_slots.to(cpu, torch.int64)
        if wslots.dim() == 1:
            wslots = wslots[:, None]
        er = batch.emit_row.to(cpu, torch.int64)
        if er.numel() > 0 and bool((er < nd).any()):
            raise ValueError("emits are only allowed in prefill rows")
        return cls(
            batch=batch,
            device=device,
            num_tokens=T,
            num_decodes=nd,
            num_decode_tokens=ndt,
            positions=batch.positions.to(device, torch.int64),
            slot_mapping=batch.slot_mapping.to(device, torch.int64),
            block_table=batch.block_table.to(device, torch.int64),
            qsl=qsl,
            seq_lens=batch.seq_lens.to(cpu, torch.int64),
            num_computed=batch.num_computed_tokens.to(cpu, torch.int64),
            logits_indices=batch.logits_indices.to(cpu, torch.int64),
            dec_qsl=qsl[: nd + 1].clone(),
            dec_read_slot=batch.state_read_slot.to(cpu, torch.int64)[:nd],
            dec_write_slots=wslots[:nd],
            pre_qsl=qsl[nd:] - ndt,
            pre_num_computed=batch.num_computed_tokens.to(cpu, torch.int64)[nd:],
            pre_read_slot=batch.state_read_slot.to(cpu, torch.int64)[nd:],
            pre_has_initial_state=batch.has_initial_state.to(cpu, torch.bool)[nd:],
            pre_write_slot=wslots[nd:, 0] if R > nd else torch.zeros(0, dtype=torch.int64),
            emit_row=er - nd,
            emit_token=batch.emit_token.to(cpu, torch.int64),
            emit_slot=batch.emit_slot.to(cpu, torch.int64),
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
