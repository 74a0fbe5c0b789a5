"""Speculative verification: rejection sampling of draft tokens against the target model.

Layout (as the scheduler produces it): row r verifies `k_r = num_draft_tokens[r]` drafts, and its
`1 + k_r` target logit rows are consecutive in `target_logits` (position j = the distribution of
the token after the first j drafts; position k_r = the bonus distribution). `draft_token_ids` is
the flat concatenation of all rows' drafts; `draft_probs`, when the proposer has them, is
`[sum k_r, V]` aligned with it (None for n-gram drafts).

Every sampling parameter is applied to the target first (`process_logits`, with the drafts before
each position counted as output for penalties and min_tokens; `logit_bias` on every position, as
the plain sampler adds it), giving p. Row r's position j is its
output token `n_r + j` (`n_r = RowSampling.output_position`), and its draws are keyed by that index.

Drafts without probabilities (point masses: the n-gram and draft-model proposers draft greedily):
the target draws its own token `y_j` at every position, exactly as the plain `Sampler` would
(greedy rows: `argmax p_j`; random rows: the race `argmax p_j / E` with the noise keyed by
(seed, n_r + j)); the row accepts drafts while `d_j == y_j` and emits `y` at the first mismatch,
or the bonus `y_k`. For a point-mass draft this *is* rejection sampling (Leviathan et al.):
`d_j` is accepted with probability `p_j(d_j)`, and the emitted `y_j != d_j` follows p_j with d_j
removed, the recovery distribution. Because the draws are the plain sampler's, a seeded request
emits the same tokens with and without speculation, token for token.

Drafts with probabilities q (`draft_probs`): random rows accept `d_j` when `u_j * q_j(d_j) <
p_j(d_j)`, `u_j ~ U[0,1)` (probability `min(1, p/q)`); at the first rejection they emit a token
from `max(p_j - q_j, 0)` normalised (a row whose residual mass is zero, possible only by rounding,
falls back to p_j); when all drafts are accepted, a bonus token from p_k. The k_r uniforms are
keyed by (seed, n_r) in the uniform stream, the final draw's exponentials by (seed, n_r) in the
recovery stream: every later step starts at a later position, so no draw is ever reused. Greedy rows
accept while `d_j == argmax p_j` either way. Rows without a seed share the batch generator.

Rows with a grammar (structured outputs): position j of row r is masked with the grammar's state
after the drafts before it (sampling/grammar.py `grammar_bitmask`, which walks the request's
matcher over the drafts and rolls it back). The target draws at each position are then exactly the
plain sampler's draws over the same history, so a draft the grammar forbids has target probability
0 and is rejected, and the token emitted at the first rejection (or the bonus token) is one the
grammar allows. The engine advances the matcher over the emitted tokens afterwards.

Each row emits its accepted drafts plus exactly one token. On CUDA (float32 logits) the
acceptance with draft probabilities runs in the fused op `hybridserve.kernels.dispatch.rejection_sample`,
fed with the same uniforms and noise, so both paths give the same tokens;
`RejectionSampler(use_kernel=...)` forces either path. Point-mass verification is a comparison of
the target's own draws with the drafts and needs no kernel of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridserve.sampling.grammar import row_masks
from hybridserve.sampling.logprobs import TokenLogprobs
from hybridserve.sampling.row_params import RowParams
from hybridserve.sampling.sampler import (
    LogprobsMode,
    ProcessedLogits,
    RowSampling,
    Sampler,
    apply_allowed,
    argmax_rows,
    exponential_noise,
    process_logits,
    race_sample,
    row_noise,
    uniform_draws,
)
from hybridserve.sampling.seeds import RECOVERY_STREAM


@dataclass
class RejectionOutput:
    """Per row: emitted tokens (accepted drafts + one), accepted-draft count, optional logprobs."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, i: int) -> list[int]:
        """The tokens emitted by row i."""
        return self.token_ids[i]

    @property
    def num_sampled(self) -> list[int]:
        """Tokens emitted per row (= num_accepted + 1), what `Scheduler.update_from_output` takes."""
        return [len(t) for t in self.token_ids]


class RejectionSampler:
    """Greedy and random rows in one batch; see the module docstring."""

    def __init__(
        self,
        logprobs_mode: LogprobsMode = "raw",
        use_kernel: bool | None = None,
        draw_all_positions: bool | None = None,
    ) -> None:
        """`use_kernel` (drafts with probabilities only; point-mass drafts never need the op):
        None (default) runs the fused `hybridserve.kernels.dispatch.rejection_sample` op when the
        logits are float32 on a CUDA device and the kernel backend is CUDA (kernels/backend.py), the
        vectorised torch code otherwise; True always goes through dispatch (its torch twin on the
        CPU); False never. Both paths draw the same randomness and give the same tokens."""
        self._sampler = Sampler(logprobs_mode)
        self.use_kernel = use_kernel
        # point-mass verification: draw every position of a random row at once (True), only up to
        # its first mismatch (False), or by device (None: all at once off the CPU)
        self.draw_all_positions = draw_all_positions

    def _kernel_path(self, probs: torch.Tensor) -> bool:
        if type(self).recovery_distribution is not RejectionSampler.recovery_distribution:
            return False  # a subclass changed the algorithm; only the torch path honours it
        if self.use_kernel is not None:
            return self.use_kernel
        if not probs.is_cuda or probs.dtype != torch.float32:
            return False
        from hybridserve.kernels import backend

        return backend.active(probs.device.type) is backend.Backend.CUDA

    def recovery_distribution(self, p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
        """Unnormalised distribution of the token emitted after rejecting `draft` drawn from q
        ([R, V] rows). Point-mass drafts need none: the target's own draw is the recovered token."""
        return (p - q).clamp_min(0.0)

    def _sample_point_mass(
        self,
        proc: ProcessedLogits,
        drafts: torch.Tensor,
        ks_t: torch.Tensor,
        start: torch.Tensor,
        dstart: torch.Tensor,
        row_index: torch.Tensor,
        draft_pos: torch.Tensor,
        params: RowParams,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Accepted counts and final tokens for drafts without probabilities: each position's
        own target draw, compared with the draft."""
        probs = proc.probs
        device = probs.device
        vocab = probs.shape[1]
        m = probs.shape[0]
        own = torch.full((m,), -1, dtype=torch.int64, device=device)  # -1: never drawn
        greedy_list = proc.greedy.tolist()
        if any(greedy_list):
            g_idx = proc.greedy.nonzero().squeeze(1)
            own[g_idx] = argmax_rows(proc.penalized[g_idx])
        if not all(greedy_list):
            # Random rows draw position by position and stop at their first mismatch: on the CPU a
            # draw costs V exponentials, and the positions after a rejection are never looked at.
            # On a GPU draws are cheap and each round trip syncs: every position in one round.
            ks = ks_t.tolist()
            start_l, dstart_l = start.tolist(), dstart.tolist()
            drafts_l = drafts.tolist()
            alive = np.flatnonzero(~params.greedy).tolist()

            def draw(pairs: list[tuple[int, int]]) -> torch.Tensor:
                """The target's own draw at position j of row r, for each (r, j): the draw of
                output position (the row's + j)."""
                r_of = np.fromiter((r for r, _ in pairs), dtype=np.intp, count=len(pairs))
                j_of = np.fromiter((j for _, j in pairs), dtype=np.int64, count=len(pairs))
                at = params.take(r_of)
                at = dataclasses.replace(at, positions=at.positions + j_of)
                pos_t = torch.as_tensor([start_l[r] + j for r, j in pairs], dtype=torch.int64, device=device)
                drawn = race_sample(probs[pos_t], row_noise(at, vocab, generator, probs.dtype, device))
                own[pos_t] = drawn
                return drawn

            all_at_once = self.draw_all_positions
            if all_at_once is None:
                all_at_once = device.type != "cpu"
            if all_at_once:
                draw([(r, j) for r in alive for j in range(ks[r] + 1)])
            else:
                j = 0
                while alive:
                    drawn_l = draw([(r, j) for r in alive]).tolist()
                    alive = [
                        r for r, t in zip(alive, drawn_l) if j < ks[r] and t == drafts_l[dstart_l[r] + j]
                    ]
                    j += 1

        accept = drafts == own[draft_pos]
        num_acc = _accepted_prefix(accept, ks_t, dstart, row_index, draft_pos)
        return num_acc, own[start + num_acc]

    def _sample_torch(
        self,
        proc: ProcessedLogits,
        drafts: torch.Tensor,
        ks: list[int],
        ks_t: torch.Tensor,
        start: torch.Tensor,
        dstart: torch.Tensor,
        row_index: torch.Tensor,
        draft_pos: torch.Tensor,
        greedy_rows: torch.Tensor,
        rand_rows: list[int],
        rows: Sequence[RowSampling],
        draft_probs: torch.Tensor,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Accepted counts and final tokens for drafts with probabilities, vectorised torch."""
        probs = proc.probs
        device = probs.device
        num_rows, vocab = len(rows), probs.shape[1]
        total_k = int(drafts.numel())
        # Acceptance of every draft (greedy: equality with argmax; random: u * q < p).
        accept = torch.zeros(total_k, dtype=torch.bool, device=device)
        if total_k:
            draft_row = row_index[draft_pos]
            g_mask = greedy_rows[draft_row]
            target_argmax = argmax_rows(proc.penalized[draft_pos])
            accept = torch.where(g_mask, drafts == target_argmax, accept)
            if rand_rows:
                u = uniform_draws(
                    [ks[i] for i in rand_rows],
                    [rows[i].noise_key for i in rand_rows],
                    generator,
                    probs.dtype,
                    device,
                )
                r_draft = (~g_mask).nonzero().squeeze(1)  # flat draft indices of random rows, in order
                p_d = probs[draft_pos[r_draft]].gather(1, drafts[r_draft][:, None]).squeeze(1)
                q_d = draft_probs[r_draft].to(probs.dtype).gather(1, drafts[r_draft][:, None]).squeeze(1)
                accept[r_draft] = u * q_d < p_d

        num_acc = _accepted_prefix(accept, ks_t, dstart, row_index, draft_pos)
        stop_pos = start + num_acc  # logit row of the emitted (recovered or bonus) token
        rejected = num_acc < ks_t

        final = torch.empty(num_rows, dtype=torch.int64, device=device)
        g_idx = greedy_rows.nonzero().squeeze(1)
        if g_idx.numel():
            final[g_idx] = argmax_rows(proc.penalized[stop_pos[g_idx]])
        r_list = rand_rows
        if r_list:
            r_idx = torch.as_tensor(r_list, dtype=torch.int64, device=device)
            p_stop = probs[stop_pos[r_idx]]
            dist = p_stop.clone()
            rej = rejected[r_idx]
            if bool(rej.any()):
                rr = rej.nonzero().squeeze(1)
                flat_d = dstart[r_idx[rr]] + num_acc[r_idx[rr]]  # the rejected draft, flat index
                q = draft_probs[flat_d].to(probs.dtype)
                rec = self.recovery_distribution(p_stop[rr], q, drafts[flat_d])
                ok = rec.sum(dim=-1) > 0
                dist[rr] = torch.where(ok[:, None], rec, p_stop[rr])
            noise = exponential_noise(
                vocab, [rows[i].noise_key for i in r_list], generator, probs.dtype, device, RECOVERY_STREAM
            )
            final[r_idx] = race_sample(dist, noise)
        return num_acc, final

    def _sample_with_kernel(
        self,
        penalized: torch.Tensor,
        probs: torch.Tensor,
        drafts: torch.Tensor,
        ks: list[int],
        ks_t: torch.Tensor,
        start: torch.Tensor,
        greedy_rows: torch.Tensor,
        rand_rows: list[int],
        rows: Sequence[RowSampling],
        draft_probs: torch.Tensor,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Accepted counts and final tokens from the fused op, fed with this sampler's randomness."""
        from hybridserve.kernels import dispatch

        device = probs.device
        num_rows, vocab = len(rows), probs.shape[1]
        total_k = int(drafts.numel())
        uniforms = torch.zeros(total_k, dtype=torch.float32, device=device)
        noise = torch.ones((num_rows, vocab), dtype=torch.float32, device=device)
        if rand_rows:
            r_idx = torch.as_tensor(rand_rows, dtype=torch.int64, device=device)
            if total_k:
                u = uniform_draws(
                    [ks[i] for i in rand_rows],
                    [rows[i].noise_key for i in rand_rows],
                    generator,
                    torch.float32,
                    device,
                )
                owner_greedy = torch.repeat_interleave(greedy_rows, ks_t)
                uniforms[~owner_greedy] = u
            noise[r_idx] = exponential_noise(
                vocab,
                [rows[i].noise_key for i in rand_rows],
                generator,
                torch.float32,
                device,
                RECOVERY_STREAM,
            )
        tokens, num_acc = dispatch.rejection_sample(
            probs.to(torch.float32),
            penalized,
            drafts,
            ks_t,
            greedy_rows,
            draft_probs.to(device=device, dtype=torch.float32),
            uniforms,
            noise,
        )
        num_acc = num_acc.to(device=device, dtype=torch.int64)
        return num_acc, tokens.to(device)[start + num_acc]

    def sample(
        self,
        target_logits: torch.Tensor | Sequence[torch.Tensor],
        draft_token_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
        rows: Sequence[RowSampling],
        num_draft_tokens: Sequence[int] | None = None,
        *,
        draft_probs: torch.Tensor | Sequence[torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
        params: RowParams | None = None,
    ) -> RejectionOutput:
        """Verify the drafts of every row.

        Flat form (the scheduler's layout): `target_logits` [sum(1 + k_r), V], `draft_token_ids`
        flat [sum k_r], `num_draft_tokens` = [k_r], `draft_probs` [sum k_r, V] or None.
        Per-row form (`num_draft_tokens` None): `target_logits` a sequence of [1 + k_r, V] tensors,
        `draft_token_ids` a sequence of per-row draft lists, `draft_probs` a sequence of [k_r, V]
        tensors or None. `generator` is used by rows without a seed. `params`:
        `RowParams.of(rows)` where the caller has it (the model runner's persistent batch).
        """
        num_rows = len(rows)
        if num_draft_tokens is None:
            per_row = [list(map(int, torch.as_tensor(d).flatten().tolist())) for d in draft_token_ids]
            if len(per_row) != num_rows:
                raise ValueError(f"{len(per_row)} draft lists for {num_rows} rows")
            ks = [len(d) for d in per_row]
            flat_drafts: torch.Tensor | Sequence[int] = [t for d in per_row for t in d]
            if not isinstance(target_logits, torch.Tensor):
                if len(target_logits) != num_rows:
                    raise ValueError(f"{len(target_logits)} target logit blocks for {num_rows} rows")
                for r, (t, k) in enumerate(zip(target_logits, ks)):
                    if t.dim() != 2 or t.shape[0] != k + 1:
                        raise ValueError(
                            f"row {r}: target logits {tuple(t.shape)} for {k} drafts (need {k + 1} rows)"
                        )
                target_logits = torch.cat(list(target_logits)) if num_rows else torch.zeros(0, 1)
            if draft_probs is not None and not isinstance(draft_probs, torch.Tensor):
                draft_probs = _concat_draft_probs(list(draft_probs))
        else:
            ks = [int(k) for k in num_draft_tokens]
            flat_drafts = draft_token_ids  # type: ignore[assignment]
            if not isinstance(target_logits, torch.Tensor):
                target_logits = torch.cat(list(target_logits))
            if draft_probs is not None and not isinstance(draft_probs, torch.Tensor):
                draft_probs = _concat_draft_probs(list(draft_probs))
        if len(ks) != num_rows:
            raise ValueError(f"num_draft_tokens has {len(ks)} entries for {num_rows} rows")
        if any(k < 0 for k in ks):
            raise ValueError("num_draft_tokens must be non-negative")
        total_k = sum(ks)
        m = total_k + num_rows
        if target_logits.dim() != 2 or target_logits.shape[0] != m:
            raise ValueError(
                f"target_logits shape {tuple(target_logits.shape)} does not match {m} positions "
                f"({num_rows} rows, {total_k} drafts)"
            )
        device = target_logits.device
        vocab = target_logits.shape[1]
        drafts = torch.as_tensor(flat_drafts, dtype=torch.int64).to(device).flatten()
        if drafts.numel() != total_k:
            raise ValueError(f"{drafts.numel()} draft tokens for num_draft_tokens summing to {total_k}")
        if total_k and (int(drafts.min()) < 0 or int(drafts.max()) >= vocab):
            raise ValueError("draft token id out of the vocabulary")
        if draft_probs is not None and tuple(draft_probs.shape) != (total_k, vocab):
            raise ValueError(f"draft_probs must be [{total_k}, {vocab}], got {tuple(draft_probs.shape)}")
        if num_rows == 0:
            return RejectionOutput(token_ids=[], num_accepted=[], logprobs=[])
        allowed: torch.Tensor | None = None
        if any(r.grammar is not None for r in rows):
            flat_l = drafts.tolist()
            row_drafts: list[list[int]] = []
            off = 0
            for k in ks:
                row_drafts.append(flat_l[off : off + k])
                off += k
            allowed = row_masks([r.grammar for r in rows], vocab, device, row_drafts)
        if params is None:
            params = RowParams.of(rows)
        elif len(params.greedy) != num_rows:
            raise ValueError(f"params has {len(params.greedy)} rows for {num_rows}")
        if draft_probs is None and params.plain_greedy.all():
            return _greedy_point_mass(apply_allowed(target_logits, allowed), drafts, ks)

        # Positions: row r owns logit rows start[r] .. start[r] + k_r; its drafts are
        # drafts[dstart[r] : dstart[r] + k_r].
        ks_t = torch.tensor(ks, dtype=torch.int64, device=device)
        start = torch.cumsum(ks_t + 1, 0) - (ks_t + 1)
        dstart = torch.cumsum(ks_t, 0) - ks_t
        row_index = torch.repeat_interleave(torch.arange(num_rows, device=device), ks_t + 1)
        pos_in_row = torch.arange(m, device=device) - start[row_index]
        # Logit rows that verify a draft, and the flat index of that draft.
        is_draft_pos = pos_in_row < ks_t[row_index]
        draft_pos = is_draft_pos.nonzero().squeeze(1)  # [total_k], in flat draft order

        extra: list[list[int]] | None = None
        if params.needs_history.any():
            dl = drafts.tolist()
            extra = []
            off = 0
            for k in ks:
                extra.extend(dl[off : off + j] for j in range(k + 1))
                off += k
        proc = process_logits(
            target_logits,
            rows,
            row_index=row_index.tolist(),
            extra_tokens=extra,
            allowed=allowed,
            params=params,
        )
        probs = proc.probs
        greedy_of_row = params.greedy.tolist()
        greedy_rows = torch.tensor(greedy_of_row, dtype=torch.bool, device=device)

        rand_rows = [i for i in range(num_rows) if not greedy_of_row[i]]
        if draft_probs is None:
            num_acc, final = self._sample_point_mass(
                proc, drafts, ks_t, start, dstart, row_index, draft_pos, params, generator
            )
        elif self._kernel_path(probs):
            num_acc, final = self._sample_with_kernel(
                proc.penalized,
                probs,
                drafts,
                ks,
                ks_t,
                start,
                greedy_rows,
                rand_rows,
                rows,
                draft_probs,
                generator,
            )
        else:
            num_acc, final = self._sample_torch(
                proc,
                drafts,
                ks,
                ks_t,
                start,
                dstart,
                row_index,
                draft_pos,
                greedy_rows,
                rand_rows,
                rows,
                draft_probs,
                generator,
            )

        num_acc_l = num_acc.tolist()
        final_l = final.tolist()
        dl_all = drafts.tolist()
        dstart_l = dstart.tolist()
        token_ids = [dl_all[dstart_l[i] : dstart_l[i] + num_acc_l[i]] + [final_l[i]] for i in range(num_rows)]

        logprobs: list[list[TokenLogprobs] | None] = [None] * num_rows
        want = [i for i in range(num_rows) if rows[i].params.logprobs is not None]
        if want:
            # Emitted token j of row i sits at logit row start[i] + j.
            start_l = start.tolist()
            lp_rows = [start_l[i] + j for i in want for j in range(num_acc_l[i] + 1)]
            lp_tokens = torch.tensor(
                [t for i in want for t in token_ids[i]], dtype=torch.int64, device=device
            )
            sel = torch.as_tensor(lp_rows, dtype=torch.int64, device=device)
            sub = _take(proc, sel)
            entries = self._sampler.logprobs(
                target_logits[sel], sub, lp_tokens, rows, row_index=row_index[sel].tolist()
            )
            off = 0
            for i in want:
                n = num_acc_l[i] + 1
                logprobs[i] = [e for e in entries[off : off + n] if e is not None]
                off += n
        return RejectionOutput(token_ids=token_ids, num_accepted=num_acc_l, logprobs=logprobs)


def _greedy_point_mass(target_logits: torch.Tensor, drafts: torch.Tensor, ks: list[int]) -> RejectionOutput:
    """Greedy rows with nothing to apply before the argmax (the sampler's fast path): a draft is
    accepted while it is the argmax of its position, and the argmax where it stops is emitted,
    exactly what the general path computes, without its [positions, V] copies."""
    own = argmax_rows(target_logits).tolist()
    flat = drafts.tolist()
    token_ids: list[list[int]] = []
    num_accepted: list[int] = []
    pos = d = 0
    for k in ks:
        a = 0
        while a < k and flat[d + a] == own[pos + a]:
            a += 1
        token_ids.append(flat[d : d + a] + [own[pos + a]])
        num_accepted.append(a)
        pos += k + 1
        d += k
    return RejectionOutput(token_ids=token_ids, num_accepted=num_accepted, logprobs=[None] * len(ks))


def _concat_draft_probs(blocks: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Per-row draft probabilities as one tensor; None when no row has them (point masses)."""
    if all(b is None for b in blocks):
        return None
    if any(b is None for b in blocks):
        raise ValueError("draft_probs: give probabilities for every row or for none")
    return torch.cat([b for b in blocks if b is not None])


def _accepted_prefix(
    accept: torch.Tensor,
    ks_t: torch.Tensor,
    dstart: torch.Tensor,
    row_index: torch.Tensor,
    draft_pos: torch.Tensor,
) -> torch.Tensor:
    """Per row, how many drafts are accepted before the first rejection (`accept` is flat, in
    draft order), via a padded [R, Kmax] cumprod."""
    num_rows = int(ks_t.numel())
    kmax = int(ks_t.max()) if num_rows else 0
    if not kmax:
        return torch.zeros(num_rows, dtype=torch.int64, device=ks_t.device)
    padded = torch.ones((num_rows, kmax), dtype=torch.int64, device=ks_t.device)
    col = torch.arange(int(accept.numel()), device=ks_t.device) - dstart[row_index[draft_pos]]
    padded[row_index[draft_pos], col] = accept.to(torch.int64)
    return torch.cumprod(padded, dim=1).sum(dim=1).clamp(max=ks_t)


def _take(proc: ProcessedLogits, sel: torch.Tensor) -> ProcessedLogits:
    """The logit rows `sel` of `proc`."""
    return ProcessedLogits(
        penalized=proc.penalized[sel],
        probs=proc.probs[sel],
        greedy=proc.greedy[sel],
    )
