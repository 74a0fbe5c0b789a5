"""Grammar masks: which tokens a request's grammar allows next, for plain and verify steps.

A `GrammarMatcher` is one request's position in its compiled grammar (an llguidance `LLMatcher`
advanced over the request's output). The engine advances it over the tokens the scheduler accepted
(`accept`); the samplers only read it:

- a plain row needs the mask of the matcher's current state;
- a verify row with drafts d_0..d_{k-1} needs the mask after each prefix d_0..d_{j-1}, j = 0..k:
  `masks` walks the matcher over the drafts and rolls it back before returning. A draft the grammar
  does not allow ends the walk: the positions after it keep the all-allowed mask, which nothing
  reads, because the target's own draw at that draft's position comes from the masked distribution,
  differs from the draft, and so rejects it there (sampling/rejection.py). A draft that leaves the
  grammar is thus rejected exactly where the plain sampler would have drawn something else.

A grammar may start later (`start_after`, a thinking model's `</think>`): until the output holds
those tokens every token is allowed and none is consumed; the tokens after them are the grammar's
from its first state, in `accept` as in the masks of a verify row whose drafts complete them.

`grammar_bitmask` fills the masks of a whole batch at once in llguidance's executor (Rust threads,
the GIL released). A mask is a bitmask of int32 words, bit t of word t // 32 for token t;
`allowed_tokens` unpacks it into a bool tensor that `process_logits` applies as -inf.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import llguidance

_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _shared_executor() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor(num_threads=max(1, min(8, os.cpu_count() or 1)))
        return _executor


class GrammarError(RuntimeError):
    """The grammar cannot go on (a limit of the grammar library was hit, or a token it does not
    allow was accepted): the request fails alone."""


def _first_line(text: str, limit: int = 500) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "unknown error"
    return line[:limit]


# (the grammar's EOS id, the model's other EOS ids)
EosAliases = tuple[int, tuple[int, ...]]


class GrammarMatcher:
    """One request's state in its grammar (see the module docstring)."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        eos_aliases: EosAliases | None = None,
        added_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        # (the EOS the grammar knows, the model's other EOS ids): wherever the grammar allows its
        # EOS, the others are allowed too (`grammar_bitmask`), as each of them ends the request
        self.eos_aliases = eos_aliases
        self.num_accepted = 0  # tokens consumed so far (the request's output length)
        # `start_after`: the tokens the output holds before the grammar applies (none: it applies
        # from the first token), the last of them seen so far, and whether they were all seen
        self._gate: tuple[int, ...] = ()
        self._seen: list[int] = []
        self.opened = True
        # a token the grammar does not allow was consumed: the masks failed (an engine fault),
        # which also leaves the matcher in its error state
        self._refused_token = False
        # The tokenizer's added tokens, and the one the grammar refused after its own mask allowed
        # it: llguidance's mask allows an added token whose text a literal of the grammar spells,
        # then refuses the token, as it matches no added token inside a literal. The grammar, not
        # the engine, is then at fault: the request's error is a 400 (RequestState.grammar_refusal).
        # A token the mask did not allow is the masks' failure (an engine fault) whatever it is.
        self._added_token_ids = added_token_ids
        self.refused_added_token: int | None = None

    def start_after(self, tokens: Sequence[int]) -> None:
        """The grammar applies only to the output after its first run of `tokens` (before any
        token is accepted); until then every token is allowed and none is consumed."""
        if self.num_accepted:
            raise GrammarError("the grammar's start was set after it consumed tokens")
        self._gate = tuple(int(t) for t in tokens)
        self.opened = not self._gate

    def gate_end(self, tokens: Sequence[int]) -> int | None:
        """While the grammar waits for its start: the index in `tokens` (what follows the output
        accepted so far) of the token that completes the start tokens, or None."""
        gate = self._gate
        history = [*self._seen, *tokens]
        offset = len(self._seen)
        for end in range(max(len(gate), offset + 1), len(history) + 1):
            if tuple(history[end - len(gate) : end]) == gate:
                return end - 1 - offset
        return None

    @property
    def words(self) -> int:
        """int32 words of one mask."""
        return (self.vocab_size + 31) // 32

    def is_terminated(self) -> bool:
        """The grammar cannot be extended: only EOS may follow (the output is complete)."""
        return self.opened and bool(self._m.is_stopped())

    def is_accepting(self) -> bool:
        return self.opened and bool(self._m.is_accepting())

    def limit_hit(self) -> str | None:
        """Why the matcher is in its error state when the grammar hit a limit of the grammar
        library (too many lexer expressions or parser items, which its first masks may not
        reach), else None: also None when the error is a token the grammar refused."""
        if self._refused_token or not self._m.is_error():
            return None
        return _first_line(self._m.get_error())

    def check(self) -> None:
        """Raise GrammarError if the matcher is in its error state."""
        if self._m.is_error():
            raise GrammarError(f"the grammar failed: {_first_line(self._m.get_error())}")

    def accept(self, tokens: Sequence[int]) -> None:
        """Advance over tokens the engine accepted. GrammarError if the grammar refuses one."""
        if not tokens:
            return
        if not self.opened:
            end = self.gate_end(tokens)
            if end is None:
                self.num_accepted += len(tokens)
                keep = len(self._gate) - 1  # (the start's tokens a later call may complete)
                self._seen = [*self._seen, *map(int, tokens)][-keep:] if keep else []
                return
            self.num_accepted += end + 1
            self.opened, self._seen = True, []
            tokens = tokens[end + 1 :]
            if not tokens:
                return
        # (an added token's mask bit is read only if the token is refused: a copy of the state
        # before it, kept for the rare added token)
        added = int(tokens[0]) if len(tokens) == 1 and int(tokens[0]) in self._added_token_ids else None
        before = self._m.deep_copy() if added is not None else None
        if not self._m.consume_tokens([int(t) for t in tokens]):
            # (llguidance says so in its error's text; a limit hit while consuming does not)
            self._refused_token = "doesn't satisfy the grammar" in _first_line(self._m.get_error())
            if self._refused_token and added is not None and before is not None:
                mask = before.compute_bitmask()  # (little-endian 32-bit words: bit t of the bytes)
                if mask[added >> 3] >> (added & 7) & 1:
                    self.refused_added_token = added
            self.check()
            raise GrammarError("the grammar refused an accepted token")
        self.num_accepted += len(tokens)

    def rollback(self, num_tokens: int) -> None:
        if self._gate and num_tokens:
            raise GrammarError("a grammar with a start cannot roll back")
        if num_tokens and not self._m.rollback(num_tokens):
            raise GrammarError(f"the grammar could not roll back {num_tokens} tokens")
        self.num_accepted -= num_tokens


def grammar_bitmask(
    matchers: Sequence[GrammarMatcher | None],
    drafts: Sequence[Sequence[int]] | None = None,
    words: int | None = None,
) -> np.ndarray:
    """The bitmasks of a batch: int32 [sum(1 + len(drafts[i])), words], row i's masks back to back
    (one without drafts), all-allowed (-1) for rows without a matcher and for positions after a
    draft the grammar refuses. GrammarError names the first matcher in its error state."""
    ks = [0] * len(matchers) if drafts is None else [len(d) for d in drafts]
    if words is None:
        words = next(m.words for m in matchers if m is not None)
    out = np.full((sum(ks) + len(matchers), words), -1, dtype=np.int32)
    plain: list[tuple[llguidance.LLMatcher, int]] = []
    spec: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
    aliased: list[tuple[int, int, EosAliases]] = []  # (first row, rows, aliases)
    row = 0
    for i, m in enumerate(matchers):
        if m is not None and m.eos_aliases is not None:
            aliased.append((row, 1 + ks[i], m.eos_aliases))
        if m is not None and not m.opened:
            # before its start every token is allowed; a draft that completes the start opens the
            # grammar for the positions after it, from its first state
            d = [int(t) for t in drafts[i]] if drafts is not None and ks[i] else []
            end = m.gate_end(d)
            if end is not None:
                m.check()
                rest = d[end + 1 :]
                if rest:
                    spec.append((m._m, row + end + 1, rest))
                else:
                    plain.append((m._m, row + end + 1))
        elif m is not None:
            m.check()
            if ks[i]:
                assert drafts is not None
                spec.append((m._m, row, [int(t) for t in drafts[i]]))
            else:
                plain.append((m._m, row))
        row += 1 + ks[i]
    if not plain and not spec:
        return out
    executor = _shared_executor()
    one = words * 4
    if plain:
        executor.unsafe_compute_mask_ptr(plain, out.ctypes.data, one, out.shape[0])
    if spec:
        executor.unsafe_compute_mask_ptr_with_draft_token(spec, out.ctypes.data, one, out.shape[0])
    for m in matchers:
        if m is not None:
            m.check()  # a limit hit while computing the mask
    for first, n, (eos, others) in aliased:
        _allow_with(out[first : first + n], eos, others)
    return out


def _allow_with(masks: np.ndarray, token: int, others: Sequence[int]) -> None:
    """In int32 bitmasks [rows, words]: each of `others` is allowed in the rows that allow
    `token` (in place)."""
    bits = masks.view(np.uint32)
    word, bit = divmod(token, 32)
    on = (bits[:, word] >> np.uint32(bit)) & np.uint32(1)
    for t in others:
        w, b = divmod(t, 32)
        if w < bits.shape[1]:
            bits[:, w] |= on << np.uint32(b)


_BITS = np.arange(32, dtype=np.uint32)


def allowed_tokens(bitmask: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """bool [rows, vocab] from int32 bitmasks [rows, words]."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")
    width = bits.shape[1]
    if width < vocab:  # logits wider than the grammar's vocabulary: the extra ids are never allowed
        bits = np.pad(bits, ((0, 0), (0, vocab - width)))
    return torch.from_numpy(bits[:, :vocab].astype(np.bool_)).to(device)


def row_masks(
    grammars: Sequence[GrammarMatcher | None],
    vocab: int,
    device: torch.device,
    drafts: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor | None:
    """bool [positions, vocab] of the allowed tokens of every logit row (one per row, or 1 + k per
    verify row), None when no row has a grammar that applies (none, or none started yet: a
    thinking model's grammar waits through its whole reasoning, which then costs no mask)."""
    if all(
        g is None or (not g.opened and g.gate_end(drafts[i] if drafts is not None else ()) is None)
        for i, g in enumerate(grammars)
    ):
        return None
    return allowed_tokens(grammar_bitmask(grammars, drafts), vocab, device)
