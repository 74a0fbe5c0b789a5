"""Batched token sampling with per-request parameters and seeds.

Every row of a batch carries its own `SamplingParams`, its own seed and its token history. The
processing order follows vLLM v1:

0. `logit_bias` (OpenAI's): each biased token's value is added to the model's logit of that row,
   before everything else (greedy rows too). Rows without one are untouched, and a batch without
   any takes no extra step. Then (after a grammar's mask, below) vLLM's `allowed_token_ids`:
   every other token gets -inf; and `bad_words`: a banned token sequence's last token gets -inf
   where the output so far ends with the rest of it (a one-token sequence always). Either is left
   out at a position where it would forbid every token the masks before it allow, as `min_tokens`
   is, so that a row always has a token to draw.
1. `min_tokens`: while fewer than `min_tokens` tokens were generated, the stop tokens
   (`stop_token_ids`, and EOS unless `ignore_eos`) get -inf.
2. Penalties on the model's logits: repetition penalty over prompt + output tokens (HF/vLLM:
   a positive logit is divided by the penalty, a negative one multiplied), then frequency and
   presence penalties over output tokens only (OpenAI: `logit -= frequency * count + presence * [count > 0]`).
3. Greedy rows (`temperature < 1e-5`) take the argmax of these logits (ties: lowest token id).
4. Random rows: divide by the temperature, then `min_p` (drop tokens whose probability is below
   `min_p * max_prob`), then `top_k`, then `top_p` (keep the smallest set of most likely tokens
   whose mass reaches `top_p`; the most likely token always stays, and so does every token tied
   with the last one kept), renormalise, and draw one token
   with the exponential race `argmax(p / E)`, `E ~ Exp(1)`, which is an exact draw from `p`.
   A row with a seed draws its noise keyed by (seed, output position): the n-th output token of a
   request always sees the same V exponentials (`keyed_noise`, one array operation over every
   row and token of a step), whatever else
   is in the batch, however the prompt was scheduled, cached or preempted, and whether the token
   came from a plain decode step or from a speculative verify step (`RejectionSampler` verifies
   point-mass drafts against exactly these draws). Rows without a seed share the batch generator
   passed to `sample` (one vectorised draw), or torch's default one.

A row with a grammar (`RowSampling.grammar`, structured outputs: sampling/grammar.py) first has
every token its grammar does not allow set to -inf, before step 1; so greedy rows take the argmax
of the allowed tokens and random rows draw among them. Where `min_tokens` would forbid the only
tokens the grammar allows (the grammar is complete and allows nothing but EOS), the grammar wins
(and so do `allowed_token_ids` and `bad_words`: min_tokens never leaves a row without a token).
Rows without a grammar are untouched by this.

`processed_probs(logits, rows)` returns the final distribution of each row (steps 1-4, one-hot at
the argmax for greedy rows): the target distribution that the rejection sampler verifies against.

Logprobs (`params.logprobs = n`): the chosen token plus the n most likely tokens, with 1-based
ranks. Default mode `"raw"` (vLLM v1's default, `raw_logprobs`): log-softmax of the model's logits
before any processing (penalties, temperature, truncation), i.e. what the model itself says.
`Sampler(logprobs_mode="processed")` gives the log of the final sampling distribution instead
(-inf for tokens that top-k/top-p/min-p removed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from hybridserve.sampling.grammar import GrammarMatcher, row_masks
from hybridserve.sampling.logprobs import Logprob, TokenLogprobs
from hybridserve.sampling.params import SamplingParams
from hybridserve.sampling.row_params import RowParams, mix64_array
from hybridserve.sampling.seeds import GOLDEN, MIX1, MIX2, NOISE_STREAM, UNIFORM_STREAM, keyed_seed

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS); dividing by them would overflow.
SAMPLING_EPS = 1e-5

LogprobsMode = Literal["raw", "processed"]


def _keyed_draws(
    key: int, count: int, kind: Literal["exponential", "uniform"], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`count` Exp(1) or U[0, 1) draws that depend only on the 63-bit `key`.

    On the CPU torch's generator (mt19937) keeps only 32 bits of its seed, which would let two
    positions of one long request share their noise (birthday odds L^2 / 2^33); numpy's Philox
    takes the whole key. CUDA's Philox generator takes a 64-bit seed as it is."""
    if device.type == "cpu":
        rng = np.random.Generator(np.random.Philox(key=key))
        np_dtype = np.float64 if dtype == torch.float64 else np.float32
        arr = (
            rng.standard_exponential(count, dtype=np_dtype)
            if kind == "exponential"
            else rng.random(count, dtype=np_dtype)
        )
        return torch.from_numpy(arr).to(dtype)
    g = torch.Generator(device=device)
    g.manual_seed(key)
    if kind == "exponential":
        return torch.empty(count, dtype=dtype, device=device).exponential_(generator=g)
    return torch.rand(count, dtype=dtype, device=device, generator=g)


# The keyed exponentials of a token draw: E(key, v) = -log(u) with u from splitmix64's output
# function over the Weyl sequence key + (v + 1) * golden (what splitmix64 started at `key` emits
# for its (v + 1)-th number). Any token's draw is computed alone, from (key, v), so all rows and
# tokens of a step are one array operation, where a generator per row cost a Python loop over the
# rows (about 15 us a row at a vocabulary of 795). The constants are splitmix64's (`seeds`).

# Elements per array pass on the CPU: a large vocabulary is drawn a few rows at a time, so that
# each pass works in cache (a [64, 131072] array pass by pass was 5x slower).
_NOISE_CHUNK = 1 << 16


@functools.lru_cache(maxsize=1)
def _weyl(vocab: int) -> np.ndarray:
    """(v + 1) * golden mod 2^64 for every token v, uint64 (kept for the last vocabulary size;
    read only)."""
    with np.errstate(over="ignore"):
        return np.arange(1, vocab + 1, dtype=np.uint64) * np.uint64(GOLDEN)


# Random bits a draw keeps: the top 23 (float32) or 52 (float64) of the hash, so that
# u = (bits + 1/2) / 2^bits is exact and strictly inside (0, 1) (with 24 bits the largest value,
# 2^24 - 1/2, rounds up to 2^24 in float32: u = 1 and E = 0, which wins its race outright).
_BITS = {True: 52, False: 23}
# Elements per pass on an accelerator (128 MB for each of its int64 temporaries).
_NOISE_CHUNK_DEVICE = 1 << 24


def _exponentials_from_bits_np(z: np.ndarray, wide: bool) -> np.ndarray:
    """E = -log(u) for the uint64 hashes `z` (consumed), float64 if `wide` else float32."""
    bits = _BITS[wide]
    u: np.ndarray = (z >> np.uint64(64 - bits)).astype(np.float64 if wide else np.float32)
    u += 0.5  # (exact in either type)
    u *= 2.0**-bits
    np.log(u, out=u)
    np.negative(u, out=u)
    return u


def _exponentials_np(keys: np.ndarray, vocab: int, dtype: torch.dtype) -> np.ndarray:
    """[len(keys), vocab] keyed Exp(1) draws (float64 for a float64 `dtype`, else float32) on the
    CPU."""
    n = len(keys)
    wide = dtype == torch.float64
    out = np.empty((n, vocab), dtype=np.float64 if wide else np.float32)
    weyl = _weyl(vocab)
    step = max(1, _NOISE_CHUNK // max(1, vocab))
    for start in range(0, n, step):
        with np.errstate(over="ignore"):
            z = keys[start : start + step, None] + weyl[None, :]
        mix64_array(z)
        out[start : start + step] = _exponentials_from_bits_np(z, wide)
    return out


def _signed(c: int) -> int:
    """A 64-bit unsigned constant as the int64 with its bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """A logical right shift of int64 `z` (torch's is arithmetic: the sign bits are masked off)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _exponentials_from_bits_torch(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`_exponentials_from_bits_np` of int64 `z` (the same bits as uint64)."""
    wide = dtype == torch.float64
    bits = _BITS[wide]
    ftype = torch.float64 if wide else torch.float32
    u = (_srl(z, 64 - bits).to(ftype) + 0.5) * 2.0**-bits
    return (-torch.log(u)).to(dtype)


def _exponentials_torch(
    keys: list[int], vocab: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`_exponentials_np` in torch's int64 arithmetic (wrapping), for an accelerator."""
    k = torch.as_tensor([_signed(key) for key in keys], dtype=torch.int64, device=device)
    v = torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _signed(GOLDEN)
    out = torch.empty((len(keys), vocab), dtype=dtype, device=device)
    step = max(1, _NOISE_CHUNK_DEVICE // max(1, vocab))
    for start in range(0, len(keys), step):
        z = k[start : start + step, None] + v[None, :]
        z = (z ^ _srl(z, 30)) * _signed(MIX1)
        z = (z ^ _srl(z, 27)) * _signed(MIX2)
        z = z ^ _srl(z, 31)
        out[start : start + step] = _exponentials_from_bits_torch(z, dtype)
    return out


def keyed_exponentials(
    keys: Sequence[int] | np.ndarray, vocab: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[len(keys), vocab] Exp(1) draws; row i depends only on the 63-bit keys[i] (`keyed_seed`),
    its column v only on (keys[i], v)."""
    if device.type == "cpu":
        arr = _exponentials_np(np.asarray(keys, dtype=np.uint64), vocab, dtype)
        return torch.from_numpy(arr).to(dtype)
    return _exponentials_torch([int(k) for k in keys], vocab, dtype, device)


def keyed_noise(
    keys: Sequence[tuple[int, int]],
    vocab: int,
    dtype: torch.dtype,
    device: torch.device,
    stream: int = NOISE_STREAM,
) -> torch.Tensor:
    """[len(keys), vocab] Exp(1) noise; row i depends only on keys[i] = (seed, output position)
    and the stream (the plain token draw by default)."""
    seeds = np.array([keyed_seed(seed, position, stream) for seed, position in keys], dtype=np.uint64)
    return _keyed_noise_rows(seeds, vocab, dtype, device)


class _PenaltyHistory:
    """A request's prompt tokens (as a mask over the vocabulary) and how often each token occurs in
    its output, kept with its row between steps and brought up to date by the tokens output since
    (`current`): a step costs the new tokens, not a count over the whole history (at a vocabulary
    of 795 the recount of a 1000-token prompt and its output cost about 130 µs a row a step).
    Counts are integers, so the kept counts equal a recount exactly, as long as the output only
    grows by appending (as the engine's does). It holds 9 bytes per vocabulary entry for the
    request's life (1.1 MiB at 131k), only for a request with a penalty."""

    __slots__ = ("vocab", "in_prompt", "counts", "_counts_np", "counted", "prompt", "source")

    def __init__(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], vocab: int) -> None:
        self.vocab = vocab
        # the sequences it counts (a row given another prompt or output object recounts)
        self.prompt, self.source = prompt_token_ids, output_token_ids
        self.in_prompt = _bincount(prompt_token_ids, vocab) > 0
        self.counts = _bincount(output_token_ids, vocab)
        self._counts_np = self.counts.numpy()  # (the same memory)
        self.counted = len(output_token_ids)  # output tokens in `counts`

    def current(self, output_token_ids: Sequence[int]) -> torch.Tensor:
        """The output counts of `output_token_ids`, whose first `counted` tokens are those counted."""
        n = len(output_token_ids)
        if n > self.counted:
            vocab = self.vocab
            new = [t for t in output_token_ids[self.counted :] if 0 <= t < vocab]  # (before any write)
            counts = self._counts_np
            for t in new:  # (a step's few tokens: scalar writes are fastest)
                counts[t] += 1
            self.counted = n
        return self.counts


def _bincount(ids: Sequence[int], vocab: int) -> torch.Tensor:
    """How often each token id below `vocab` occurs in `ids` (int64 [vocab])."""
    arr = np.asarray(ids, dtype=np.int64)
    arr = arr[(arr >= 0) & (arr < vocab)]
    return torch.from_numpy(np.bincount(arr, minlength=vocab))


def _penalty_counts(row: RowSampling, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(output counts, prompt mask) of `row` over `vocab` tokens, from its kept history when it
    is current (a history for another vocabulary, another output list, or an output that shrank,
    is rebuilt; the engine's rows only ever extend their output list)."""
    h = row.penalty_history
    out = row.output_token_ids
    if (
        h is None
        or h.vocab != vocab
        or h.prompt is not row.prompt_token_ids
        or h.source is not out
        or h.counted > len(out)
    ):
        h = row.penalty_history = _PenaltyHistory(row.prompt_token_ids, out, vocab)
    return h.current(out), h.in_prompt


@dataclass
class RowSampling:
    """What the sampler needs to know about one row (one request at one position).

    `prompt_token_ids` and `output_token_ids` are the request's history (the output so far, not
    including the token being sampled); their contents are only read when a penalty or
    `min_tokens` is active, but the length of the output is the position that keys the draw, so a
    row object reused for the next token must have its output (or `position`) updated: by
    appending to the same list (a row keeps its penalty counts and adds what was appended), or by
    giving it another list (counted anew).
    `eos_token_id` is masked together with `params.stop_token_ids` while fewer than
    `params.min_tokens` tokens were generated. `seed` None: the noise comes from the batch
    generator; otherwise it is keyed by (seed, `position`), the index of the output token being
    drawn (default: `len(output_token_ids)`, which the engine always passes). `grammar`: the
    request's structured-output state; its mask is applied first (module docstring).
    """

    params: SamplingParams
    seed: int | None = None
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    eos_token_id: int | None = None
    position: int | None = None
    grammar: GrammarMatcher | None = None
    # params.bad_words as token sequences (engine/input_processor.py `bad_word_sequences`)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    # params.allowed_token_ids as a mask over a vocabulary (`_allowed_mask`), and bad_word_ids
    # indexed (`BadWordIndex`), made at first use
    allowed_mask: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    bad_word_index: BadWordIndex | None = field(default=None, init=False, repr=False, compare=False)
    # The penalties' counts of this row's history, kept across steps when the row object is
    # (the engine keeps one per request; its output list grows in place): `_PenaltyHistory`
    penalty_history: _PenaltyHistory | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def output_position(self) -> int:
        """Index (0-based) of the output token this row draws next."""
        return len(self.output_token_ids) if self.position is None else self.position

    @property
    def noise_key(self) -> tuple[int, int] | None:
        """(seed, output position) of this row's next draw, None without a seed."""
        return None if self.seed is None else (self.seed, self.output_position)

    @property
    def greedy(self) -> bool:
        return float(self.params.temperature) < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    def stop_ids_to_mask(self, num_output_tokens: int) -> list[int]:
        """Stop tokens that `min_tokens` forbids after `num_output_tokens` generated tokens."""
        p = self.params
        if num_output_tokens >= p.min_tokens:
            return []
        ids = list(p.stop_token_ids)
        if self.eos_token_id is not None and not p.ignore_eos:
            ids.append(self.eos_token_id)
        return ids


@dataclass
class SamplerOutput:
    """`token_ids[i]` is row i's token; `logprobs[i]` is None unless row i asked for logprobs."""

    token_ids: torch.Tensor  # int64 [N]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


@dataclass
class ProcessedLogits:
    """Intermediate results of `process_logits` for M logit rows."""

    penalized: torch.Tensor  # [M, V] logits after min_tokens masks and penalties
    probs: torch.Tensor  # [M, V] final target distribution (one-hot argmax on greedy rows)
    greedy: torch.Tensor  # bool [M]


def _apply_logit_bias(x: torch.Tensor, rows: Sequence[RowSampling], row_index: list[int]) -> None:
    """Add each row's `logit_bias` to its logit rows, in place (ids outside the vocabulary are
    left out: the HTTP protocol refuses them, the offline API cannot know the vocabulary)."""
    vocab = x.shape[1]
    flat_rows: list[int] = []
    flat_ids: list[int] = []
    flat_vals: list[float] = []
    for i, r in enumerate(row_index):
        bias = rows[r].params.logit_bias
        if not bias:
            continue
        for t, b in bias.items():
            if t < vocab:
                flat_rows.append(i)
                flat_ids.append(t)
                flat_vals.append(b)
    if not flat_rows:
        return
    device = x.device
    x.index_put_(
        (
            torch.tensor(flat_rows, dtype=torch.int64, device=device),
            torch.tensor(flat_ids, dtype=torch.int64, device=device),
        ),
        torch.tensor(flat_vals, dtype=x.dtype, device=device),
        accumulate=True,
    )


def _apply_bans(
    x: torch.Tensor,
    rows: Sequence[RowSampling],
    row_index: list[int],
    extra_tokens: Sequence[Sequence[int]] | None,
) -> None:
    """allowed_token_ids, then bad words, in place on the logit rows whose request has them (the
    module docstring: each is left out where it would leave no token). Each is a few operations
    over all its rows at once: row by row, a batch of 64 spent 4 ms a step on them."""
    vocab = x.shape[1]
    device = x.device
    allowed_rows: list[int] = []
    allowed_masks: list[torch.Tensor] = []
    word_rows: list[int] = []  # (one entry per banned token)
    word_ids: list[int] = []
    for i, r in enumerate(row_index):
        row = rows[r]
        if row.params.allowed_token_ids is not None:
            allowed_rows.append(i)
            allowed_masks.append(_allowed_mask(row, vocab, device))
        if row.bad_word_ids:
            extra = extra_tokens[i] if extra_tokens is not None else ()
            if row.bad_word_index is None:
                row.bad_word_index = BadWordIndex(row.bad_word_ids)
            for t in row.bad_word_index.banned_after(row.output_token_ids, extra):
                if t < vocab:
                    word_rows.append(i)
                    word_ids.append(t)
    if allowed_rows:
        _forbid_unless_all(x, allowed_rows, ~torch.stack(allowed_masks))
    if word_rows:
        banned_rows = sorted(set(word_rows))
        local = {i: k for k, i in enumerate(banned_rows)}
        forbidden = torch.zeros((len(banned_rows), vocab), dtype=torch.bool, device=device)
        forbidden[
            torch.tensor([local[i] for i in word_rows], device=device),
            torch.tensor(word_ids, device=device),
        ] = True
        _forbid_unless_all(x, banned_rows, forbidden)


def _allowed_mask(row: RowSampling, vocab: int, device: torch.device) -> torch.Tensor:
    """The row's allowed_token_ids as a bool mask over `vocab` (kept on the row)."""
    mask = row.allowed_mask
    if mask is None or mask.shape[0] != vocab or mask.device != device:
        # (through numpy: indexing with a list of a vocabulary's worth of ids costs 3x as much,
        # on the engine thread that every request shares)
        ids = np.asarray(row.params.allowed_token_ids or (), dtype=np.int64)
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[torch.from_numpy(ids[ids < vocab])] = True
        mask = mask.to(device)
        row.allowed_mask = mask
    return mask


def _forbid_unless_all(x: torch.Tensor, rows: list[int], forbidden: torch.Tensor) -> None:
    """-inf on the `forbidden` tokens (bool [len(rows), V]) of logit rows `rows`, in place, except
    in a row that would have no finite logit left."""
    idx = torch.tensor(rows, device=x.device)
    before = x[idx]
    masked = before.masked_fill(forbidden, float("-inf"))
    kept = torch.isfinite(masked).any(dim=1, keepdim=True)
    x[idx] = torch.where(kept, masked, before)


class BadWordIndex:
    """A request's banned token sequences, indexed by the token before the last one: a step
    compares only the sequences whose next-to-last token the history ends with."""

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        self.singles = [int(s[0]) for s in sequences if len(s) == 1]
        # token before the last -> (the tokens before the last, the last)
        self.by_end: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for s in sequences:
            if len(s) > 1:
                self.by_end.setdefault(int(s[-2]), []).append((tuple(int(t) for t in s[:-1]), int(s[-1])))

    def banned_after(self, output: Sequence[int], extra: Sequence[int] = ()) -> list[int]:
        """The tokens that would complete a sequence after the history `output` + `extra` (a
        draft's tokens after the output): every one-token sequence's token, and a longer one's
        last token where the history ends with the others."""
        banned = list(self.singles)
        last = extra[-1] if extra else (output[-1] if output else None)
        for before, token in self.by_end.get(last, ()) if last is not None else ():
            n_out = len(before) - len(extra)  # how many of the tokens before come from the output
            if n_out > len(output):
                continue
            if n_out <= 0:
                tail = tuple(extra[len(extra) - len(before) :])
            else:
                tail = (*output[len(output) - n_out :], *extra)
            if tail == before:
                banned.append(token)
        return banned


def apply_allowed(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """`logits` with the tokens `allowed` (bool, same shape) forbids at -inf; `logits` itself when
    there is no mask."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed, float("-inf"))


def _work_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _apply_history(
    x: torch.Tensor,
    rows: Sequence[RowSampling],
    row_index: list[int],
    extra_tokens: Sequence[Sequence[int]] | None,
) -> None:
    """min_tokens masks and penalties, in place, on the logit rows whose request needs them."""
    vocab = x.shape[1]
    device = x.device
    need = [i for i, r in enumerate(row_index) if rows[r].has_penalties or rows[r].params.min_tokens > 0]
    if not need:
        return
    pen_rows: list[int] = []
    out_counts: list[torch.Tensor] = []
    in_prompts: list[torch.Tensor] = []
    base_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i in need:
        row = rows[row_index[i]]
        extra = list(extra_tokens[i]) if extra_tokens is not None else []
        n_out = len(row.output_token_ids) + len(extra)
        masked = [t for t in row.stop_ids_to_mask(n_out) if 0 <= t < vocab]
        if masked:
            constrained = (
                row.grammar is not None or row.params.allowed_token_ids is not None or row.bad_word_ids
            )
            kept = x[i, masked].clone() if constrained else None
            x[i, masked] = float("-inf")
            if kept is not None and not bool(torch.isfinite(x[i]).any()):
                x[i, masked] = kept  # the grammar or the bans allow nothing but stop tokens: they win
        if not row.has_penalties:
            continue
        r = row_index[i]
        if r not in base_cache:
            base_cache[r] = _penalty_counts(row, vocab)
        counts, in_prompt = base_cache[r]
        if extra:
            counts = counts + _bincount(extra, vocab)
        pen_rows.append(i)
        out_counts.append(counts)
        in_prompts.append(in_prompt)
    if not pen_rows:
        return
    idx = torch.as_tensor(pen_rows, dtype=torch.int64, device=device)
    counts_t = torch.stack(out_counts).to(device=device, dtype=x.dtype)  # (stacked: copies)
    seen_t = torch.stack(in_prompts).to(device) | (counts_t > 0)
    params = [rows[row_index[i]].params for i in pen_rows]
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype, device=device)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype, device=device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype, device=device)[:, None]
    sub = x[idx]
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen_t, penalized, sub)
    sub = sub - freq * counts_t - pres * (counts_t > 0).to(x.dtype)
    x[idx] = sub


# The sizes of the partial sorts that look for a row's top-p boundary, in turn, before the whole
# row is sorted: a model's distribution at a usual temperature puts its top-p mass in a few dozen
# tokens, and the 1024 largest of 131k cost a tenth of a full sort. A probe is used only where it
# is at most a sixteenth of the vocabulary: on a small one the whole sort costs little more.
_TOP_P_PROBES = (64, 1024)
_PROBE_SHARE = 16


def _kth_largest(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[M, 1]: the k[i]-th largest value of each row of `x` (1 <= k[i] <= vocab), by a partial
    sort, not a sort of the whole row (on the CPU numpy's selection: torch's CPU top-k of 64 of
    795 took 0.45 ms for 64 rows, numpy's 0.06)."""
    if x.device.type != "cpu":
        return x.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
    a = x.detach().numpy()
    vocab = a.shape[1]
    at = vocab - k.numpy()
    part = np.partition(a, sorted(set(at.tolist())), axis=-1)
    return torch.from_numpy(part[np.arange(len(a)), at])[:, None]


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[M, 1]: the smallest probability a row keeps under its top_p ([M, 1], in (0, 1]).

    The kept set is the smallest set of most likely tokens whose mass reaches top_p: walking the
    tokens from the most likely, a token stays while the mass before it is below top_p, so the most
    likely always stays. The threshold is the last kept token's probability, and every token
    tied with it stays too, whatever order a sort gave the ties, so a row's set depends only on
    the row. Found from the largest few tokens of each row when their mass reaches top_p
    (`_TOP_P_PROBES`), the rows that does not cover from more. On the CPU a row's answer is the
    same whichever partial sort finds it (the same values, summed in the same order by numpy's
    sequential cumsum; its sort of 64 rows of 795 took 0.08 ms, torch's 2.2 ms). An accelerator's
    parallel scan may round a row's sums differently by their length, so there a row's set may
    differ in a last-bit case from a whole sort's, but it still depends on that row alone."""
    if probs.device.type == "cpu":
        p, tp = probs.detach().numpy(), top_p.detach().numpy()
        out = np.empty((len(p), 1), dtype=p.dtype)
        _top_p_stages(p, tp, out, _descending_np)
        return torch.from_numpy(out)
    threshold = torch.empty((len(probs), 1), dtype=probs.dtype, device=probs.device)
    _top_p_stages(probs, top_p, threshold, _descending_torch)
    return threshold


def _descending_np(p: np.ndarray, k: int) -> np.ndarray:
    """The k largest values of each row, largest first."""
    neg = -p if k == p.shape[1] else np.partition(-p, k - 1, axis=-1)[:, :k]
    neg.sort(axis=-1)
    return -neg


def _descending_torch(p: torch.Tensor, k: int) -> torch.Tensor:
    return p.topk(k, dim=-1).values if k < p.shape[1] else p.sort(dim=-1, descending=True).values


def _top_p_stages(p: Any, tp: Any, out: Any, descending: Callable[[Any, int], Any]) -> None:
    """`_top_p_threshold` over numpy arrays or tensors alike (`descending` sorts)."""
    vocab = p.shape[1]
    on_np = isinstance(p, np.ndarray)
    todo: Any = None  # the rows whose boundary is still to find (None: every row)
    for k in (*(k for k in _TOP_P_PROBES if k * _PROBE_SHARE <= vocab), vocab):
        top = descending(p if todo is None else p[todo], k)
        mass = top.cumsum(-1)
        before = np.zeros_like(top) if on_np else torch.zeros_like(top)  # the mass ahead of each
        before[:, 1:] = mass[:, :-1]
        limit = tp if todo is None else tp[todo]
        # (a top_p below the dtype's smallest value is 0 here: the most likely token still stays)
        last = ((before < limit).sum(-1)[:, None] - 1).clip(min=0)
        kept = np.take_along_axis(top, last, axis=-1) if on_np else top.gather(1, last)
        if todo is None:
            out[...] = kept
        else:
            out[todo] = kept
        if k == vocab:  # (a whole sort finds every boundary)
            break
        # a partial sort finds the boundary when its tokens' mass reaches top_p
        rest = ~(mass[:, -1] >= limit[:, 0])
        if todo is None:
            todo = np.flatnonzero(rest) if on_np else rest.nonzero().squeeze(1)
        else:
            todo = todo[rest]
        if len(todo) == 0:
            break


def _truncate(x: torch.Tensor, params: RowParams) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p on the logits of random rows (`params`: theirs, one per
    logit row); returns masked logits. Neither top_k nor top_p sorts a whole row unless top_p
    needs it (`_top_p_threshold`): on a vocabulary of 131k a full sort of 64 rows took 0.6 s on one
    core."""
    dtype, device = x.dtype, x.device
    vocab = x.shape[1]
    temp = torch.from_numpy(params.temperature).to(dtype=dtype, device=device)
    # (a new tensor, written in place from here on: each fresh [rows, vocabulary] array costs
    # its page faults, about as much as the arithmetic at a large vocabulary on the CPU)
    x = x / temp[:, None]
    neg_inf = float("-inf")

    min_p = params.min_p
    if (min_p > 0.0).any():
        probs = torch.softmax(x, dim=-1)
        min_p_t = torch.from_numpy(min_p).to(dtype=dtype, device=device)
        thresh = min_p_t[:, None] * probs.amax(dim=-1, keepdim=True)
        x.masked_fill_(probs < thresh, neg_inf)

    top_k = params.top_k
    k_rows = np.flatnonzero((top_k > 0) & (top_k < vocab))
    if len(k_rows):
        k_t = torch.from_numpy(top_k[k_rows]).to(device)
        _on_rows(x, k_rows, lambda sub: sub.masked_fill_(sub < _kth_largest(sub, k_t), neg_inf))

    top_p = params.top_p
    p_rows = np.flatnonzero(top_p < 1.0)
    if len(p_rows):
        tp_t = torch.from_numpy(top_p[p_rows]).to(dtype=dtype, device=device)[:, None]

        def nucleus(sub: torch.Tensor) -> torch.Tensor:
            probs = torch.softmax(sub, dim=-1)
            return sub.masked_fill_(probs < _top_p_threshold(probs, tp_t), neg_inf)

        _on_rows(x, p_rows, nucleus)
    return x


def _on_rows(x: torch.Tensor, rows: np.ndarray, f: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Applies `f`, which writes its argument in place and returns it, to the rows `rows`
    (increasing) of `x`: to all of `x` at once when they are all its rows, else to a copy of them
    that is written back."""
    if len(rows) == x.shape[0]:
        f(x)
        return
    rows_t = torch.from_numpy(rows.astype(np.int64)).to(x.device)
    x[rows_t] = f(x[rows_t])


def process_logits(
    logits: torch.Tensor,
    rows: Sequence[RowSampling],
    *,
    row_index: Sequence[int] | None = None,
    extra_tokens: Sequence[Sequence[int]] | None = None,
    allowed: torch.Tensor | None = None,
    params: RowParams | None = None,
) -> ProcessedLogits:
    """Apply every sampling parameter to `logits` [M, V].

    Logit row i belongs to `rows[row_index[i]]` (default: row i). `extra_tokens[i]`, when given,
    are tokens appended to that row's output history for logit row i (the draft tokens before a
    verify position), so penalties and min_tokens see exactly the context of that position.
    `allowed` (bool [M, V]): the grammar masks of the logit rows (all True for rows without one).
    `params`: `RowParams.of(rows)` where the caller has it (the model runner's persistent batch).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab], got shape {tuple(logits.shape)}")
    m = logits.shape[0]
    ridx = np.arange(m) if row_index is None else np.asarray(row_index, dtype=np.int64).reshape(-1)
    if len(ridx) != m:
        raise ValueError(f"row_index has {len(ridx)} entries for {m} logit rows")
    if extra_tokens is not None and len(extra_tokens) != m:
        raise ValueError(f"extra_tokens has {len(extra_tokens)} entries for {m} logit rows")
    if params is None:
        params = RowParams.of(rows)
    elif len(params.greedy) != len(rows):
        raise ValueError(f"params has {len(params.greedy)} rows for {len(rows)}")
    device = logits.device
    x = logits.to(_work_dtype(logits))
    biased = bool(params.biased.any())
    history = bool(params.needs_history.any())
    banned = bool(params.banned.any())
    if biased or allowed is not None or history or banned:
        x = x.clone()  # (written in place below; the caller's logits stay as they are)
    if biased:
        _apply_logit_bias(x, rows, ridx.tolist())  # on the raw logits, before everything else
    if allowed is not None:
        x.masked_fill_(~allowed, float("-inf"))
    if banned:
        _apply_bans(x, rows, ridx.tolist(), extra_tokens)
    if history:
        _apply_history(x, rows, ridx.tolist(), extra_tokens)

    # the settings of each logit row (those of `rows` themselves when there is one row each)
    per_logit = params if row_index is None else params.take(ridx)
    greedy_np = per_logit.greedy
    greedy = torch.from_numpy(greedy_np.copy()).to(device)  # (not a view of the caller's array)
    if not greedy_np.any():  # (every row random: no gather and scatter of [M, V])
        probs = torch.softmax(_truncate(x, per_logit), dim=-1)
    else:
        probs = torch.empty_like(x)
        g_idx = greedy.nonzero().squeeze(1)
        top = argmax_rows(x[g_idx])
        one_hot = torch.zeros((len(g_idx), x.shape[1]), dtype=x.dtype, device=device)
        one_hot.scatter_(1, top[:, None], 1.0)
        probs[g_idx] = one_hot
        if not greedy_np.all():
            r_np = np.flatnonzero(~greedy_np)
            r_idx = torch.from_numpy(r_np).to(device)
            probs[r_idx] = torch.softmax(_truncate(x[r_idx], per_logit.take(r_np)), dim=-1)
    return ProcessedLogits(penalized=x, probs=probs, greedy=greedy)


def processed_probs(
    logits: torch.Tensor,
    rows: Sequence[RowSampling],
    *,
    row_index: Sequence[int] | None = None,
    extra_tokens: Sequence[Sequence[int]] | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The final target distribution [M, V] of each logit row (all parameters applied)."""
    return process_logits(logits, rows, row_index=row_index, extra_tokens=extra_tokens, allowed=allowed).probs


def exponential_noise(
    vocab: int,
    keys: Sequence[tuple[int, int] | None],
    batch_generator: torch.Generator | None,
    dtype: torch.dtype,
    device: torch.device,
    stream: int = NOISE_STREAM,
) -> torch.Tensor:
    """[len(keys), vocab] Exp(1) noise: row i keyed by keys[i] = (seed, position) in `stream`
    (`keyed_noise`), rows whose key is None from the batch generator (one vectorised draw)."""
    seeded = np.fromiter((k is not None for k in keys), dtype=bool, count=len(keys))
    draw_keys = np.array([keyed_seed(k[0], k[1], stream) for k in keys if k is not None], dtype=np.uint64)
    return _noise(seeded, draw_keys, vocab, batch_generator, dtype, device)


def row_noise(
    params: RowParams,
    vocab: int,
    batch_generator: torch.Generator | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """`exponential_noise` of the token draws of `params`' rows (a seeded row's keyed by its
    seed and output position), with the keys computed for every row at once."""
    seeded = params.seeded
    keys = params.noise_keys()
    return _noise(seeded, keys if seeded.all() else keys[seeded], vocab, batch_generator, dtype, device)


def _noise(
    seeded: np.ndarray,
    keys: np.ndarray,
    vocab: int,
    batch_generator: torch.Generator | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """[len(seeded), vocab] Exp(1) noise: the seeded rows' from their draw keys (`keys`, uint64,
    in order), the others' from the batch generator (one vectorised draw)."""
    if seeded.all():
        return _keyed_noise_rows(keys, vocab, dtype, device)
    noise = torch.empty((len(seeded), vocab), dtype=dtype, device=device)
    own = np.flatnonzero(seeded)
    if len(own):
        noise[torch.from_numpy(own).to(device)] = _keyed_noise_rows(keys, vocab, dtype, device)
    shared = np.flatnonzero(~seeded)
    noise[torch.from_numpy(shared).to(device)] = _shared_noise(
        len(shared), vocab, batch_generator, dtype, device
    )
    return noise


def _keyed_noise_rows(keys: np.ndarray, vocab: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`keyed_noise` of rows whose draw keys (`keyed_seed`'s) are computed: uint64 `keys`."""
    return keyed_exponentials(keys, vocab, dtype, device).clamp_min_(torch.finfo(dtype).tiny)


def _shared_noise(
    count: int, vocab: int, batch_generator: torch.Generator | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[count, vocab] Exp(1) noise from the batch generator (one vectorised draw)."""
    gen_device = batch_generator.device if batch_generator is not None else device
    e = torch.empty((count, vocab), dtype=dtype, device=gen_device)
    e.exponential_(generator=batch_generator)
    return e.clamp_min_(torch.finfo(dtype).tiny).to(device)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value (int64 [rows]; ties and NaN: the first), with
    numpy's argmax for float32 and float64 on the CPU: torch's CPU argmax took 57 us for 64 rows
    of 795 and 8.2 ms for 64 rows of 131072 on one core, numpy's 5 us and 1.7 ms (the same
    indices: both take the first of equal values and the first NaN)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() == 2:
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


def race_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One exact draw per row from (possibly unnormalised) `probs` given Exp(1) `noise`."""
    return argmax_rows(probs / noise)


def uniform_draws(
    counts: Sequence[int],
    keys: Sequence[tuple[int, int] | None],
    batch_generator: torch.Generator | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Concatenated U[0,1) draws, counts[i] of them for row i: keyed by keys[i] = (seed, position)
    (the uniform stream), or from the batch generator where keys[i] is None."""
    total = sum(counts)
    out = torch.empty(total, dtype=dtype, device=device)
    own = [i for i, k in enumerate(keys) if k is not None and counts[i] > 0]
    shared = total - sum(counts[i] for i in own)
    if own:
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        for i in own:
            key = keys[i]
            assert key is not None
            out[offsets[i] : offsets[i + 1]] = _keyed_draws(
                keyed_seed(key[0], key[1], UNIFORM_STREAM), counts[i], "uniform", dtype, device
            )
    if shared:
        gen_device = batch_generator.device if batch_generator is not None else device
        u = torch.rand(shared, dtype=dtype, device=gen_device, generator=batch_generator).to(device)
        if not own:
            out.copy_(u)
        else:
            is_shared = torch.tensor([k is None for k in keys], dtype=torch.bool, device=device)
            counts_t = torch.as_tensor(list(counts), dtype=torch.int64, device=device)
            out[torch.repeat_interleave(is_shared, counts_t)] = u
    return out


def compute_logprobs(
    source: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int | None]
) -> list[TokenLogprobs | None]:
    """Per row: {chosen token, then the num_top[i] most likely} -> Logprob (1-based ranks).

    `source` [N, V] holds log-probabilities. Rows with num_top[i] None get None.
    """
    out: list[TokenLogprobs | None] = [None] * len(num_top)
    want = [i for i, n in enumerate(num_top) if n is not None]
    if not want:
        return out
    idx = torch.as_tensor(want, dtype=torch.int64, device=source.device)
    lp = source[idx]
    if lp.dtype != torch.float64:
        lp = lp.float()  # a float64 model's logprobs keep their precision (near-tie ranks too)
    chosen = token_ids.to(source.device)[idx]
    chosen_lp = lp.gather(1, chosen[:, None]).squeeze(1)
    ranks = (lp > chosen_lp[:, None]).sum(dim=-1) + 1
    max_n = max(int(num_top[i] or 0) for i in want)
    top_vals, top_ids = lp.topk(min(max_n, lp.shape[1]), dim=-1) if max_n > 0 else (None, None)
    chosen_l, chosen_lp_l, ranks_l = chosen.tolist(), chosen_lp.tolist(), ranks.tolist()
    top_ids_l = top_ids.tolist() if top_ids is not None else None
    top_vals_l = top_vals.tolist() if top_vals is not None else None
    for j, i in enumerate(want):
        entry: TokenLogprobs = {
            int(chosen_l[j]): Logprob(logprob=float(chosen_lp_l[j]), rank=int(ranks_l[j]))
        }
        n = int(num_top[i] or 0)
        if n > 0 and top_ids_l is not None and top_vals_l is not None:
            for rank, (tid, val) in enumerate(zip(top_ids_l[j][:n], top_vals_l[j][:n]), start=1):
                entry.setdefault(int(tid), Logprob(logprob=float(val), rank=rank))
        out[i] = entry
    return out


class Sampler:
    """Samples one token per row; see the module docstring for the exact semantics."""

    def __init__(self, logprobs_mode: LogprobsMode = "raw") -> None:
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.logprobs_mode: LogprobsMode = logprobs_mode

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[RowSampling],
        generator: torch.Generator | None = None,
        params: RowParams | None = None,
    ) -> SamplerOutput:
        """`logits` [N, V] (one row per entry of `rows`) -> one token per row. `params`:
        `RowParams.of(rows)` where the caller has it (the model runner's persistent batch)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows")
        n, vocab = logits.shape
        if n == 0:
            return SamplerOutput(
                token_ids=torch.empty(0, dtype=torch.int64, device=logits.device), logprobs=[]
            )
        if params is None:
            params = RowParams.of(rows)
        elif len(params.greedy) != n:
            raise ValueError(f"params has {len(params.greedy)} rows for {n}")
        allowed = row_masks([r.grammar for r in rows], vocab, logits.device)
        if params.plain_greedy.all():
            # Nothing to apply before the argmax but the grammar masks: skip the [N, V] copies of
            # process_logits.
            return SamplerOutput(token_ids=argmax_rows(apply_allowed(logits, allowed)), logprobs=[None] * n)
        proc = process_logits(logits, rows, allowed=allowed, params=params)
        greedy = params.greedy
        if not greedy.any():  # (every row random: no gather and scatter of [N, V])
            noise = row_noise(params, vocab, generator, proc.probs.dtype, logits.device)
            tokens = argmax_rows(torch.div(proc.probs, noise, out=noise))  # (race_sample, in place)
        else:
            tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
            g_idx = proc.greedy.nonzero().squeeze(1)
            tokens[g_idx] = argmax_rows(proc.penalized[g_idx])
            if not greedy.all():
                r_np = np.flatnonzero(~greedy)
                r_idx = torch.from_numpy(r_np).to(logits.device)
                noise = row_noise(params.take(r_np), vocab, generator, proc.probs.dtype, logits.device)
                tokens[r_idx] = race_sample(proc.probs[r_idx], noise)
        return SamplerOutput(token_ids=tokens, logprobs=self.logprobs(logits, proc, tokens, rows))

    def logprobs(
        self,
        logits: torch.Tensor,
        proc: ProcessedLogits,
        tokens: torch.Tensor,
        rows: Sequence[RowSampling],
        row_index: Sequence[int] | None = None,
    ) -> list[TokenLogprobs | None]:
        """Logprobs of `tokens` (one per logit row) in this sampler's mode."""
        ridx = list(range(logits.shape[0])) if row_index is None else list(row_index)
        num_top = [rows[r].params.logprobs for r in ridx]
        if all(v is None for v in num_top):
            return [None] * len(num_top)
        if self.logprobs_mode == "raw":
            source = torch.log_softmax(logits.to(_work_dtype(logits)), dim=-1)
        else:
            source = torch.log(proc.probs)
        return compute_logprobs(source, tokens, num_top)
