"""Incremental detokenization and stop strings for one sequence.

Byte-level BPE tokens can split a UTF-8 character, so the text of a token on its own is not its
contribution to the text. Each step decodes only a short window: the tokens since the last point
where the text was complete (`_prefix_offset`), and compares it with the decode of the window
without the new tokens; the difference is the new text. A trailing replacement character means an
unfinished character, held back until more tokens (or the end) arrive. The cost per token is
constant, not proportional to the length of the output.

The window starts on the last few prompt tokens (`context`), as vLLM's does: decoders that strip
the space of a text's first token (SentencePiece's Metaspace, "▁the" -> "the") would otherwise
take the output's first word's space away, and a stop string " the" would match a token late. The
context's own text is never released.

`deferred=True` (the offline `LLM.generate` path, where nobody reads the text before the end): with
no stop strings to watch for, tokens are only collected and the text is decoded once, when the
final call comes.

Stop strings are watched for with an Aho-Corasick automaton over all of them (`_StopAutomaton`),
fed each new character once; its state, carried from token to token, says both whether a stop
string ends at a character and how long the longest end of the text is that could still grow into
one (the tail held back). So the work per token is proportional to the new text (plus, at worst,
the length of the longest stop string when a long partial match breaks, paid back by the
characters that built it), never to the length of the output, to the number of stop strings or to
the square of their length. The automaton is built lazily: a request pays for the parts of it its
text reaches, at most in proportion to the total length of its stop strings (which
`SamplingParams` bounds). `benches/bench_stop_strings.py` measures it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


_INCOMPLETE = "\ufffd"
# Prompt tokens the window starts on (vLLM's incremental detokenizer starts 5 back)
CONTEXT_TOKENS = 5


def _common_prefix_len(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search with C-speed comparisons
        mid = (lo + hi + 1) // 2
        if a.startswith(b[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


class _StopAutomaton:
    """Aho-Corasick automaton of a list of stop strings, built lazily.

    A node is a prefix of some stop string (the root the empty one); the state after some text is
    the node of the longest end of the text that is such a prefix. A node is named by the first
    string in sorted order that has it as a prefix and its length (`rank * width + depth`), so the
    trie needs no table of its own: a node's child by the same string's next character is the next
    id, and only the points where a later string leaves an earlier one's path are stored
    (`branch`, one per string). Failure links, the hold-back length and the match of a node are
    worked out when the text first reaches the node (`info`): building costs O(k log k) for k
    strings instead of time and memory in proportion to their total length, and a text that
    never comes near a stop string costs next to nothing.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        pats = sorted(set(stop))
        if not pats or not all(pats):
            raise ValueError("stop strings must be non-empty")
        self.pats = pats
        self.width = max(map(len, pats)) + 1
        # From the root, text without these characters leads nowhere (most text, most of the time).
        self.first_chars = frozenset(p[0] for p in pats)
        self.branch: dict[int, dict[str, int]] = {}
        # The string of rank r leaves the path of the previous ones after its common prefix with
        # rank r - 1 (sorted order: no earlier string shares more); that prefix's node is named by
        # the first rank of the run that shares it: the last rank before r whose common prefix with
        # its predecessor is shorter (a stack of increasing common prefix lengths finds it).
        stack: list[tuple[int, int]] = [(-1, 0)]  # (common prefix with the predecessor, rank)
        for r in range(1, len(pats)):
            h = _common_prefix_len(pats[r - 1], pats[r])
            while stack[-1][0] >= h:
                stack.pop()
            q = stack[-1][1]
            stack.append((h, r))
            self.branch.setdefault(q * self.width + h, {})[pats[r][h]] = r * self.width + h + 1
        # node -> (failure link, hold-back, match). The failure link: the node of the longest proper
        # suffix of the node's string. Hold-back: the longest suffix of the node's string that is a
        # proper prefix of a stop string (a whole one is a match, not something to wait for). Match:
        # the longest stop string that ends the node's string (of those ending here, the one that
        # starts first). Invariant: a node in `info` has its whole failure chain in `info`.
        self.info: dict[int, tuple[int, int, str | None]] = {0: (0, 0, None)}

    def _child(self, node: int, c: str) -> int | None:
        rank, depth = divmod(node, self.width)
        s = self.pats[rank]
        if depth < len(s) and s[depth] == c:
            return node + 1
        b = self.branch.get(node)
        return None if b is None else b.get(c)

    def step(self, state: int, c: str) -> int:
        """The state after one more character `c`."""
        info, child = self.info, self._child
        parent = state
        nxt = child(parent, c)
        while nxt is None:
            if parent == 0:
                return 0
            parent = info[parent][0]
            nxt = child(parent, c)
        if nxt not in info:
            self._resolve(nxt, parent, c)
        return nxt

    def _resolve(self, node: int, parent: int, c: str) -> None:
        """Fill `info` for `node` (= parent's child by c) and the nodes of its failure chain not
        there yet. The failure chain of parent's child by c is the children by c along parent's
        failure chain, which is in `info` already: one walk down it finds them all, each node's
        failure link being the next one found (what the classic breadth-first build computes)."""
        info, child = self.info, self._child
        chain = [node]
        tail = 0  # the failure link of the last node of `chain`
        x = parent
        while x:
            x = info[x][0]
            y = child(x, c)
            if y is not None:
                if y in info:
                    tail = y
                    break
                chain.append(y)
        for k in range(len(chain) - 1, -1, -1):
            v = chain[k]
            f = chain[k + 1] if k + 1 < len(chain) else tail
            _, f_hold, f_match = info[f]
            rank, depth = divmod(v, self.width)
            s = self.pats[rank]
            has_children = depth < len(s) or v in self.branch
            info[v] = (f, depth if has_children else f_hold, s if depth == len(s) else f_match)

    def hold(self, state: int) -> int:
        return self.info[state][1]


@dataclass
class IncrementalDetokenizer:
    tokenizer: Decoder
    stop: Sequence[str] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # A stop string counts only when it ends in the text of a call to `add_tokens` that brings the
    # tokens past the first min_tokens, as vLLM checks per update (the engine adds one token per
    # call, so: in the text of a token after the first min_tokens; stop tokens are masked for
    # those tokens too).
    min_tokens: int = 0
    # Decode once at the end instead of per token (only when there are no stop strings).
    deferred: bool = False
    # The prompt's ids (its last CONTEXT_TOKENS start the window; their text is not released)
    context: Sequence[int] = ()
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # text released so far
    stopped_by: str | None = None  # the stop string that matched, if any
    _prefix_offset: int = 0  # token_ids[:_prefix_offset] are fully represented in the decoded text
    _read_offset: int = 0  # token_ids[:_read_offset] have been decoded
    # Decoded text after `text`, held back because a stop string may start in it.
    _held: str = field(default="", init=False, repr=False)
    _automaton: _StopAutomaton | None = field(default=None, init=False, repr=False)
    _state: int = field(default=0, init=False, repr=False)  # the automaton's, after text + _held

    def __post_init__(self) -> None:
        if self.stop:
            self._automaton = _StopAutomaton(self.stop)
        tail = [int(t) for t in self.context[-CONTEXT_TOKENS:]]
        self._context_text = self.tokenizer.decode(tail, skip_special_tokens=self.skip_special_tokens)
        # (not a prompt that ends inside a character: the output's first token completes it, and
        # the window must not count the character as the prompt's)
        if tail and not self._context_text.endswith(_INCOMPLETE):
            self.token_ids = [*tail, *self.token_ids]
            self._read_offset = len(tail)
        self._context = self._read_offset  # token_ids[:_context] are the prompt's

    def _decode_output(self) -> str:
        """The whole output's text, decoded after the context (as the window decodes it)."""
        skip = self.skip_special_tokens
        whole = self.tokenizer.decode(self.token_ids, skip_special_tokens=skip)
        if not self._context:
            return whole
        if whole.startswith(self._context_text):
            return whole[len(self._context_text) :]
        return self.tokenizer.decode(self.token_ids[self._context :], skip_special_tokens=skip)

    def _decode_window(self, final: bool) -> str:
        """The text the new tokens add ('' while they end inside a character)."""
        ids = self.token_ids
        skip = self.skip_special_tokens
        before = self.tokenizer.decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        after = self.tokenizer.decode(ids[self._prefix_offset :], skip_special_tokens=skip)
        if not final and (len(after) <= len(before) or after.endswith(_INCOMPLETE)):
            return ""  # the new tokens end inside a character: wait for more
        # Rare: a new token changes how the window decodes (`after` does not start with `before`).
        # The text decoded before is kept all the same: released text is never taken back.
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return after[len(before) :]

    def add_tokens(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Append tokens; return the newly released text. Once a stop string matched, the text is
        cut there and `stopped_by` is set; later calls return ''."""
        if self.stopped_by is not None:
            return ""
        self.token_ids.extend(int(t) for t in new_ids)
        if self.deferred and not self.stop:
            if not final or (self._read_offset == len(self.token_ids) and self.text):
                return ""  # not the end yet, or already decoded up to the last token
            self._read_offset = len(self.token_ids)
            full = self._decode_output()
            delta = full[len(self.text) :] if full.startswith(self.text) else ""
            self.text = full if full.startswith(self.text) else self.text
            return delta
        new = self._decode_window(final)
        ac = self._automaton
        if ac is None:
            self.text += new
            return new
        # The first stop string to be completed wins: the match that ends first, as if the text
        # arrived one character at a time (the one that starts first on a tie). Only matches that
        # end in the new text count, and none while the tokens are among the first min_tokens
        # (a match that ends in their text never counts, even while its end is still held back).
        counts = len(self.token_ids) - self._context > self.min_tokens
        base = len(self.text)  # `pending` starts at this position of the whole text
        pending = self._held + new
        first: tuple[int, str] | None = None
        state = self._state
        if not (state == 0 and ac.first_chars.isdisjoint(new)):
            step, info = ac.step, ac.info
            end = base + len(self._held)
            for c in new:
                state = step(state, c)
                end += 1
                s = info[state][2]
                if s is not None and counts:
                    first = (end, s)
                    break
        self._state = state
        if first is not None:
            end, s = first
            self.stopped_by = s
            cut = end if self.include_stop_str_in_output else end - len(s)
            delta = pending[: max(cut - base, 0)]
            self.text += delta
            self._held = ""
            return delta
        # Hold back a tail that could be the start of a stop string, also before min_tokens: a
        # stop completed by a later token must still be cut from the text.
        hold = 0 if final else ac.hold(state)
        delta = pending[: max(len(pending) - hold, 0)]
        self._held = pending[len(delta) :]
        self.text += delta
        return delta
