"""Draft-model proposer: a (smaller) checkpoint run by the same model code, with a cache of its own.

Each request owns a window of K state slots and a list of KV blocks in the draft's cache.
window[0] always holds the draft's state after exactly the request's known tokens (prompt and
accepted output), so rejected drafts never leak into it: a proposal first runs the tokens the
draft has not seen yet as a prefill row (read window[0], write window[0]), then drafts token j by a
decode row that reads window[j - 2] and writes window[j - 1] (scratch slots). K/V written for draft
positions is overwritten when those positions are run for real.
Drafts are greedy (argmax), so the rejection sampler treats them as drafts without probabilities.
On the CPU the rows take the native step (model/decode_step.py) where it runs the draft model:
the decode rows always, the prefill rows while they are little work (the tokens accepted since
the last proposal; a whole prompt takes the model's forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from hybridserve.errors import ConfigError
from hybridserve.model.batch import ForwardBatch
from hybridserve.model.cache_tensors import ModelCaches, default_state_dtype, kv_bytes_per_block
from hybridserve.model.decode_step import DecodeStep
from hybridserve.model.loader import load_model
from hybridserve.spec_decode.base import History, Proposer

# The draft's KV cache is capped so that a draft model never takes most of the memory.
DRAFT_KV_CACHE_MEMORY = 256 << 20
DRAFT_BLOCK_SIZE = 16


@dataclass
class _DraftRequest:
    window: list[int]
    blocks: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


class DraftModelProposer(Proposer):
    def __init__(
        self,
        model_dir: str,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        max_num_seqs: int,
        num_speculative_tokens: int,
        target_vocab_size: int | None = None,
    ) -> None:
        if not model_dir:
            raise ConfigError('--speculative-config: method "draft_model" needs "model": PATH')
        loaded = load_model(model_dir, dtype=dtype, device=str(device))
        self.model = loaded.model
        self.config = loaded.config
        if target_vocab_size is not None and int(self.config.vocab_size) != int(target_vocab_size):
            raise ConfigError(
                f"--speculative-config: the draft model's vocabulary ({self.config.vocab_size}) differs from "
                f"the target's ({target_vocab_size}); a draft model must share the tokenizer"
            )
        self.device = device
        self.k = int(num_speculative_tokens)
        self.block_size = DRAFT_BLOCK_SIZE
        per_seq_blocks = -(-(max_model_len + self.k) // self.block_size)
        wanted_blocks = 1 + max_num_seqs * per_seq_blocks
        per_block = kv_bytes_per_block(self.config, self.block_size, dtype)
        num_blocks = (
            wanted_blocks
            if per_block == 0
            else max(2, min(wanted_blocks, DRAFT_KV_CACHE_MEMORY // per_block))
        )
        num_slots = 1 + max_num_seqs * max(1, self.k)
        self.caches = ModelCaches(
            self.config,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_slots=max(2, num_slots),
            kv_dtype=dtype,
            state_dtype=default_state_dtype(self.config, dtype),
            device=device,
        )
        # the draft's rows in one native call, where the model allows (decode rows, and prefill
        # rows of little work: `DecodeStep.run` refuses the others)
        self.decode_step = DecodeStep.for_model(self.model, self.caches) if device.type == "cpu" else None
        self.free_blocks = list(range(num_blocks - 1, 0, -1))
        self.free_slots = list(range(max(2, num_slots) - 1, 0, -1))
        self.requests: dict[str, _DraftRequest] = {}

    # ------------------------------------------------------------------ bookkeeping
    def free(self, request_id: str) -> None:
        st = self.requests.pop(request_id, None)
        if st is not None:
            self.free_blocks.extend(st.blocks)
            self.free_slots.extend(st.window)

    def _admit(self, request_id: str, num_tokens: int) -> _DraftRequest | None:
        st = self.requests.get(request_id)
        if st is None:
            width = max(1, self.k)
            if len(self.free_slots) < width:
                return None
            st = _DraftRequest(window=[self.free_slots.pop() for _ in range(width)])
            self.requests[request_id] = st
        need = -(-num_tokens // self.block_size) - len(st.blocks)
        if need > len(self.free_blocks):
            self.free(request_id)  # no room: this request goes without drafts
            return None
        st.blocks.extend(self.free_blocks.pop() for _ in range(max(0, need)))
        return st

    # ------------------------------------------------------------------ proposing
    def propose(self, token_ids_per_row: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        raise TypeError("DraftModelProposer needs request ids: call propose_for(request_ids, histories, k)")

    def propose_for(
        self, request_ids: Sequence[str], histories: Sequence[Sequence[int]], k: int
    ) -> list[list[int]]:
        return self.propose_histories(request_ids, [History(h, (), ()) for h in histories], k)

    @torch.inference_mode()
    def propose_histories(
        self, request_ids: Sequence[str], histories: Sequence[History], k: int
    ) -> list[list[int]]:
        """Drafts for each row; only the tokens this model has not run yet are read of each
        history (the rest is in its own caches)."""
        k = min(k, self.k)
        out: list[list[int]] = [[] for _ in request_ids]
        rows: list[tuple[int, _DraftRequest, int]] = []  # (row, its state, its history's length)
        for i, (rid, hist) in enumerate(zip(request_ids, histories)):
            length = len(hist)
            if k <= 0 or not length:
                continue
            st = self._admit(rid, length + k)
            if st is None or st.num_computed_tokens >= length:
                continue
            rows.append((i, st, length))
        if not rows:
            return out

        # Step 1: the unseen tokens of every row, as prefill rows.
        tokens: list[list[int]] = [histories[i].tokens_from(st.num_computed_tokens) for i, st, _ in rows]
        starts = [st.num_computed_tokens for _, st, _ in rows]
        logits = self._forward(rows, tokens, starts, decode=False, step=0)
        for _, st, length in rows:
            st.num_computed_tokens = length
        drafts = [[int(t)] for t in logits.argmax(dim=-1).tolist()]
        # Steps 2..k: one draft token per row, as decode rows writing scratch window slots.
        for j in range(1, k):
            tokens = [[d[-1]] for d in drafts]
            starts = [length + j - 1 for _, _, length in rows]
            logits = self._forward(rows, tokens, starts, decode=True, step=j)
            for d, t in zip(drafts, logits.argmax(dim=-1).tolist()):
                d.append(int(t))
        for (i, _, _), d in zip(rows, drafts):
            out[i] = d
        return out

    def _forward(
        self,
        rows: list[tuple[int, _DraftRequest, int]],
        tokens: list[list[int]],
        starts: list[int],
        *,
        decode: bool,
        step: int,
    ) -> torch.Tensor:
        dev = self.device
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        for (_, st, _), toks, s in zip(rows, tokens, starts):
            for t, tok in enumerate(toks):
                p = s + t
                ids.append(tok)
                pos.append(p)
                slots.append(st.blocks[p // bs] * bs + p % bs)
            qsl.append(len(ids))
        width = max(len(st.blocks) for _, st, _ in rows)
        table = torch.zeros((len(rows), width), dtype=torch.int64)
        for r, (_, st, _) in enumerate(rows):
            table[r, : len(st.blocks)] = torch.tensor(st.blocks, dtype=torch.int64)
        read = [st.window[0] if not decode else st.window[step - 1] for _, st, _ in rows]
        write = [st.window[0] if not decode else st.window[step] for _, st, _ in rows]
        has_init = [True if decode else s > 0 for s in starts]
        n = len(rows)
        if self.decode_step is not None:
            fused = self.decode_step.run(
                _step_arrays(ids, pos, slots, table, read, write, qsl, has_init, decode)
            )
            if fused is not None:
                return fused.logits
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int64),
            num_computed_tokens=torch.tensor(starts, dtype=torch.int64),
            seq_lens=torch.tensor([s + len(t) for s, t in zip(starts, tokens)], dtype=torch.int64),
            num_decodes=n if decode else 0,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_table=table.to(dev),
            state_read_slot=torch.tensor(read, dtype=torch.int64, device=dev),
            has_initial_state=torch.tensor(has_init, dtype=torch.bool, device=dev),
            state_write_slots=torch.tensor(write, dtype=torch.int64, device=dev).reshape(n, 1),
            emit_row=empty,
            emit_token=empty,
            emit_slot=empty,
            logits_indices=torch.tensor([q - 1 for q in qsl[1:]], dtype=torch.int64, device=dev),
        )
        return self.model.forward(batch, self.caches)


def _step_arrays(
    ids: list[int],
    pos: list[int],
    slots: list[int],
    table: torch.Tensor,
    read: list[int],
    write: list[int],
    qsl: list[int],
    has_init: list[bool],
    decode: bool,
) -> SimpleNamespace:
    """A step of one-token decode rows, or of prefill rows (each row's logits at its last
    token), as the arrays `DecodeStep.run` reads (the layout of the scheduler's output)."""
    n = len(read)

    def a(v: list[int]) -> np.ndarray:
        return np.asarray(v, dtype=np.int64)

    return SimpleNamespace(
        num_decodes=n if decode else 0,
        input_ids=a(ids),
        positions=a(pos),
        slot_mapping=a(slots),
        block_table=np.ascontiguousarray(table.numpy()),
        state_read_slot=a(read),
        state_write_slots=a(write).reshape(n, 1),
        query_start_loc=a(qsl),
        logits_indices=a([q - 1 for q in qsl[1:]]),
        has_initial_state=np.asarray(has_init, dtype=np.bool_),
    )
