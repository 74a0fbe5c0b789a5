"""Request traces for prefix-cache benchmarks: the data model, a JSONL file format with strict
validation, and seeded generators of four traffic shapes.

A trace says which requests share prefixes and which turn of a conversation extends which, so that
the same trace can be replayed

- by a model-free replay of the scheduler and the cache, where the "model" answers each request
  with exactly its `output` tokens, and
- through the HTTP server by a client that builds each follow-up prompt from the server's real
  answers (`Trace.full_prompt(rid, outputs=...)`); there `len(output)` is the request's
  `max_tokens`.

Pure Python: imports neither torch nor numpy.

Data model
----------
A `TraceRequest` is either a *first turn* (`arrival` and the whole `prompt` are set) or a
*follow-up* (`after` names an earlier request of the trace; the follow-up is released
`think_time` seconds after that request finished, and its prompt is after's full prompt + after's
output + `prompt_append`). A request may be the `after` of several later requests (a conversation
that forks). A *session* is a first turn and everything that follows it, directly or not.

File format (JSONL)
-------------------
One request per line, file order = `Trace.requests` order, `after` always pointing backwards::

    {"trace": "T2:seed=0:scale=1"}
    {"id": "t2-s4-0", "arrival": 1.25, "prompt": [5, 17, ...], "output": [...]}
    {"id": "t2-s4-1", "after": "t2-s4-0", "think_time": 2.5, "prompt_append": [...], "output": [...]}

- The optional first (non-blank) line `{"trace": NAME}` names the trace (without it the name is
  the file's stem). Blank lines are skipped; line numbers in messages count them.
- Keys: `id` (non-empty string, unique), `output` (non-empty list of token ids), and either
  `arrival` (seconds from the start, finite, >= 0) + `prompt` (non-empty list of token ids), or
  `after` (id of an earlier request) + `prompt_append` (a list of token ids, may be empty) +
  optionally `think_time` (seconds, finite, >= 0; default 0). A key whose value is `null` counts as
  absent. Any other key is an error: a typo must not be silently ignored.
- A token id is a JSON integer in [0, 2**31 - 1] (not a bool, not a float such as `1.0`).

Every problem in a file raises `TraceError` (a `ValueError`) whose message starts with
`"{path}:{line}: "` (the 1-based physical line) and names the field and what is wrong.
`Trace.validate(vocab_size)` checks token ids against a model's vocabulary.

Generated traces (`generate(kind, seed=, scale=, token_id_min=, token_id_max=)`)
-------------------------------------------------------------------------------
All randomness comes from `random.Random(f"{kind}:{seed}")`, so a (kind, seed, scale, token range,
shape) always gives the same trace. `scale` multiplies the number of requests (T1, T4) or sessions
(T2, T3), rounded, at least 1; it never changes a length. Integer ranges below are inclusive
(uniform draws); "Poisson at r/s" means exponential gaps of mean 1/r, the first arrival at 0.
Arrival and think times are rounded to microseconds.

Token ids: the three lowest ids of [token_id_min, token_id_max) are the chat-template ids

    END_OF_TURN = token_id_min      (3 with the defaults)
    USER        = token_id_min + 1  (4)
    ASSISTANT   = token_id_min + 2  (5)

(`chat_template_ids(token_id_min)`); every other ("content") token of every kind is uniform in
[token_id_min + 3, token_id_max), so a template id in a generated trace is always the template.
The defaults [3, 256) lie inside any byte-level vocabulary and avoid the demo model's special
tokens 0-2.

- **T1 "shared system prompts"** (`T1Shape`): 16 system prompts with lengths uniform in
  [500, 2500] (so almost never a multiple of 16 or 256: prefixes that end off the block grid);
  400 requests, each picks a system prompt by Zipf popularity (exponent 1.1; system prompt `i` has
  rank `i + 1`) and adds a unique user message of [30, 300] tokens in the chat template, as T2
  writes a turn: `[END_OF_TURN, USER] + message + [END_OF_TURN, ASSISTANT]`; output [16, 128]
  tokens; Poisson arrivals at 4 requests/s. Ids `t1-{i}`.
- **T2 "multi-turn chat"** (`T2Shape`): 60 sessions starting as a Poisson process at 1 session/s,
  [3, 8] turns each. 70% of sessions (each independently with probability 0.7) start with one of 4
  shared system prompts (chosen uniformly; lengths uniform in [200, 800]). Each turn's user part is
  `[END_OF_TURN, USER] + message + [END_OF_TURN, ASSISTANT]` with a message of [20, 200] tokens:
  the first turn's prompt is (system prompt +) that, each later turn's `prompt_append` is that.
  Outputs are [30, 250] tokens whose last token is END_OF_TURN (the answer ends the turn, as a
  chat model's EOS). Think time exponential with mean 4 s. Ids `t2-s{session}-{turn}` (from 0).
- **T3 "agentic sessions"** (`T3Shape`): 12 sessions, Poisson starts at 0.2 sessions/s; the first
  prompt is a tool-definition prefix of 4000 tokens shared by all sessions + a task context of
  [4000, 10000] tokens; each turn's output is a tool call of [40, 200] tokens; the next turn's
  `prompt_append` is a tool result of [300, 3000] tokens. A session ends after 15 turns, or when
  the next turn's prompt would exceed 40000 tokens (so every prompt is <= 40000 tokens, every
  prompt + output <= 40200). Think time (tool latency) uniform in [0.5, 3] s. Ids
  `t3-s{session}-{turn}` (from 0).
- **T4 "few-shot trees"** (`T4Shape`): a root instruction of 300 tokens shared by every request;
  6 task families (depth 2: [400, 900] tokens of examples each); 4 variants per family (depth 3:
  [150, 400] tokens each). 400 requests, each picks a (family, variant) leaf by Zipf popularity
  (exponent 1.1) over the 24 leaves (the popularity ranks are a seeded permutation of the leaves,
  so popular leaves are spread over families), then adds a unique question of [20, 80] tokens;
  output [8, 40] tokens; Poisson arrivals at 4 requests/s. Ids `t4-{i}`.

`summarize(trace)` gives the numbers a report shows.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_TOKEN_ID",
    "TRACE_KINDS",
    "TRACE_DESCRIPTIONS",
    "T1Shape",
    "T2Shape",
    "T3Shape",
    "T4Shape",
    "Trace",
    "TraceError",
    "TraceRequest",
    "chat_template_ids",
    "default_shape",
    "generate",
    "read_trace",
    "summarize",
    "write_trace",
]

MAX_TOKEN_ID = 2**31 - 1

TRACE_KINDS = ("T1", "T2", "T3", "T4")
TRACE_DESCRIPTIONS = {
    "T1": "shared system prompts",
    "T2": "multi-turn chat",
    "T3": "agentic sessions",
    "T4": "few-shot trees",
}


class TraceError(ValueError):
    """A malformed trace: in a file, the message starts with "{path}:{line}: "."""


# ---------------------------------------------------------------------------------------------
# data model


@dataclass(frozen=True, kw_only=True)
class TraceRequest:
    """One request of a trace: a first turn (`arrival` + `prompt`) or a follow-up (`after` +
    `prompt_append`, released `think_time` seconds after `after` finished). Lists are stored as
    tuples; an invalid combination raises TraceError."""

    id: str
    arrival: float | None = None
    after: str | None = None
    think_time: float = 0.0
    prompt: tuple[int, ...] | None = None
    prompt_append: tuple[int, ...] | None = None
    output: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("prompt", "prompt_append", "output"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        for name in ("arrival", "think_time"):
            value = getattr(self, name)
            if type(value) is int:
                object.__setattr__(self, name, float(value))
        fields = {k: getattr(self, k) for k in _REQUEST_KEYS if getattr(self, k) is not None}
        if self.after is None and self.think_time == 0.0 and type(self.think_time) is float:
            del fields["think_time"]  # the default of a first turn
        problem = _request_problem(fields, tuple)
        if problem is not None:
            raise TraceError(f"request {_show(self.id)}: {problem}")

    @property
    def is_first_turn(self) -> bool:
        return self.after is None


@dataclass(frozen=True)
class Trace:
    """Requests in file order; `after` always points to an earlier request."""

    name: str
    requests: tuple[TraceRequest, ...]
    _index: dict[str, int] = field(init=False, repr=False, compare=False)
    _prompt_lens: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.requests, list):
            object.__setattr__(self, "requests", tuple(self.requests))
        # (non-empty, as a file's {"trace": NAME} line must be: write_trace wrote a trace named ""
        # into a file that read_trace refused)
        if not isinstance(self.name, str) or not self.name:
            raise TraceError(f"trace name must be a non-empty string, got {_show(self.name)}")
        if not self.requests:
            raise TraceError(f"trace {self.name!r} has no requests")
        index: dict[str, int] = {}
        lens: list[int] = []
        for i, r in enumerate(self.requests):
            if not isinstance(r, TraceRequest):
                raise TraceError(f"trace {self.name!r}: requests[{i}] is not a TraceRequest")
            if r.id in index:
                raise TraceError(f"request {_show(r.id)}: duplicate id (also requests[{index[r.id]}])")
            if r.after is None:
                assert r.prompt is not None
                lens.append(len(r.prompt))
            else:
                j = index.get(r.after)
                if j is None:
                    raise TraceError(
                        f'request {_show(r.id)}: "after" must name an earlier request, got {_show(r.after)}'
                    )
                assert r.prompt_append is not None
                lens.append(lens[j] + len(self.requests[j].output) + len(r.prompt_append))
            index[r.id] = i
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_prompt_lens", tuple(lens))

    # -- look-ups

    def request(self, request_id: str) -> TraceRequest:
        """The request with this id (KeyError if none)."""
        return self.requests[self._index[request_id]]

    def __len__(self) -> int:
        return len(self.requests)

    def prompt_len(self, request_id: str) -> int:
        """Length of the request's full prompt with the trace's own outputs."""
        return self._prompt_lens[self._index[request_id]]

    def full_prompt(self, request_id: str, outputs: Mapping[str, Sequence[int]] | None = None) -> list[int]:
        """The whole prompt of `request_id`: its first turn's prompt, then for every later turn of
        its chain the previous turn's output + that turn's `prompt_append`. `outputs` replaces the
        trace's output of any earlier turn it names (a server's real answers). Iterative: a chain
        may be longer than Python's recursion limit."""
        chain = [self.request(request_id)]
        while chain[-1].after is not None:
            chain.append(self.requests[self._index[chain[-1].after]])
        chain.reverse()
        assert chain[0].prompt is not None
        prompt = list(chain[0].prompt)
        for prev, cur in zip(chain, chain[1:]):
            out = outputs.get(prev.id) if outputs is not None else None
            prompt.extend(prev.output if out is None else out)
            assert cur.prompt_append is not None
            prompt.extend(cur.prompt_append)
        return prompt

    def num_prompt_tokens(self) -> int:
        """Sum of all full prompt lengths (with the trace's own outputs)."""
        return sum(self._prompt_lens)

    def num_output_tokens(self) -> int:
        return sum(len(r.output) for r in self.requests)

    def successors(self, request_id: str) -> tuple[TraceRequest, ...]:
        """The requests whose `after` is `request_id`, in file order."""
        self.request(request_id)  # KeyError for an unknown id
        return tuple(r for r in self.requests if r.after == request_id)

    def sessions(self) -> tuple[tuple[TraceRequest, ...], ...]:
        """One tuple per first turn (in file order): the first turn, then every request that
        follows it directly or not, in file order (so each request comes after its `after`). A
        client can replay a session by releasing each request when its `after` has finished."""
        root_of: dict[str, str] = {}
        groups: dict[str, list[TraceRequest]] = {}
        for r in self.requests:
            root = r.id if r.after is None else root_of[r.after]
            root_of[r.id] = root
            groups.setdefault(root, []).append(r)
        return tuple(tuple(g) for g in groups.values())

    def validate(self, vocab_size: int, max_model_len: int | None = None) -> None:
        """Raises TraceError naming the request if a token id is >= `vocab_size`, or (with
        `max_model_len`) if a full prompt + output is longer than `max_model_len`."""
        if type(vocab_size) is not int or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        for i, r in enumerate(self.requests):
            for name in ("prompt", "prompt_append", "output"):
                tokens = getattr(r, name)
                if tokens is None or not tokens or max(tokens) < vocab_size:
                    continue
                pos = next(k for k, t in enumerate(tokens) if t >= vocab_size)
                raise TraceError(
                    f"request {_show(r.id)}: {_show(name)}[{pos}] is token id {tokens[pos]}, "
                    f"not below the vocabulary size {vocab_size}"
                )
            if max_model_len is not None:
                total = self._prompt_lens[i] + len(r.output)
                if total > max_model_len:
                    raise TraceError(
                        f"request {_show(r.id)}: prompt ({self._prompt_lens[i]} tokens) + output "
                        f"({len(r.output)}) = {total} tokens, more than max_model_len {max_model_len}"
                    )


def summarize(trace: Trace) -> dict[str, Any]:
    """The numbers a report shows: counts, token totals, and prompt lengths (full prompts, with the
    trace's own outputs)."""
    lens = trace._prompt_lens
    return {
        "name": trace.name,
        "requests": len(trace.requests),
        "sessions": sum(1 for r in trace.requests if r.after is None),
        "prompt_tokens": sum(lens),
        "output_tokens": trace.num_output_tokens(),
        "max_prompt_len": max(lens),
        "mean_prompt_len": sum(lens) / len(lens),
    }


# ---------------------------------------------------------------------------------------------
# validation shared by the file reader and the dataclasses

_REQUEST_KEYS = ("id", "arrival", "after", "think_time", "prompt", "prompt_append", "output")
_TOKENS_HINT = "a non-empty list of token ids (integers >= 0)"


def _show(value: object, limit: int = 60) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number_problem(name: str, value: object) -> str | None:
    ok = False
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            ok = math.isfinite(float(value)) and float(value) >= 0
        except OverflowError:  # an int too large for a float
            ok = False
    return None if ok else f"{_show(name)} must be a finite number >= 0 (seconds), got {_show(value)}"


def _tokens_problem(name: str, value: object, seq_type: type, allow_empty: bool) -> str | None:
    hint = _TOKENS_HINT if not allow_empty else "a list of token ids (integers >= 0)"
    if not isinstance(value, seq_type) or (not value and not allow_empty):
        return f"{_show(name)} must be {hint}, got {_show(value)}"
    assert isinstance(value, list | tuple)
    for pos, t in enumerate(value):
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            return (
                f"{_show(name)}[{pos}] must be a token id (an integer in [0, {MAX_TOKEN_ID}]), got {_show(t)}"
            )
    return None


def _request_problem(obj: Mapping[str, object], seq_type: type) -> str | None:
    """What is wrong with one request (keys whose value is None are absent), or None. `seq_type`:
    list for parsed JSON, tuple for the dataclass. Does not check what `after` refers to."""
    unknown = [k for k in obj if k not in _REQUEST_KEYS]
    if unknown:
        allowed = ", ".join(_show(k) for k in _REQUEST_KEYS)
        return f"unknown key {_show(unknown[0])} (allowed: {allowed})"
    if "id" not in obj:
        return 'missing "id"'
    if not isinstance(obj["id"], str) or not obj["id"]:
        return f'"id" must be a non-empty string, got {_show(obj["id"])}'
    if "after" in obj:
        if not isinstance(obj["after"], str) or not obj["after"]:
            return f'"after" must be the id (a non-empty string) of an earlier request, got {_show(obj["after"])}'
        if "arrival" in obj:
            return '"arrival" and "after" exclude each other: a follow-up arrives "think_time" after its "after" finished'
        if "prompt" in obj:
            return (
                '"prompt" and "after" exclude each other: a follow-up has "prompt_append" (its prompt is '
                "after's prompt + after's output + prompt_append)"
            )
        if "prompt_append" not in obj:
            return 'missing "prompt_append" (a request with "after" gives the tokens it appends)'
        if "think_time" in obj and (p := _number_problem("think_time", obj["think_time"])):
            return p
        if p := _tokens_problem("prompt_append", obj["prompt_append"], seq_type, allow_empty=True):
            return p
    else:
        if "prompt_append" in obj:
            if "prompt" in obj:
                return 'both "prompt" and "prompt_append": a first turn has "prompt", a follow-up "after" + "prompt_append"'
            return '"prompt_append" without "after": a first turn has "prompt" and "arrival"'
        if "think_time" in obj:
            return '"think_time" without "after": a first turn has "arrival"'
        if "prompt" not in obj:
            return 'missing "prompt" (a first turn; a follow-up has "after" + "prompt_append")'
        if "arrival" not in obj:
            return 'missing "arrival" (a request without "after" needs its arrival time)'
        if p := _number_problem("arrival", obj["arrival"]):
            return p
        if p := _tokens_problem("prompt", obj["prompt"], seq_type, allow_empty=False):
            return p
    if "output" not in obj:
        return 'missing "output"'
    return _tokens_problem("output", obj["output"], seq_type, allow_empty=False)


# ---------------------------------------------------------------------------------------------
# JSONL files


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def write_trace(trace: Trace, path: str | Path) -> None:
    """Writes `trace` as JSONL: a `{"trace": name}` line, then one line per request."""
    lines = [json.dumps({"trace": trace.name})]
    for r in trace.requests:
        if r.after is None:
            obj: dict[str, Any] = {
                "id": r.id,
                "arrival": r.arrival,
                "prompt": list(r.prompt or ()),
                "output": list(r.output),
            }
        else:
            obj = {
                "id": r.id,
                "after": r.after,
                "think_time": r.think_time,
                "prompt_append": list(r.prompt_append or ()),
                "output": list(r.output),
            }
        lines.append(json.dumps(obj, separators=(", ", ": "), allow_nan=False))
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def read_trace(path: str | Path) -> Trace:
    """Reads and validates a JSONL trace; any problem raises TraceError("{path}:{line}: ...")."""
    where = str(path)
    raw_lines = Path(path).read_bytes().split(b"\n")
    # pass 1: parse every line (so that "after" can tell an unknown id from a later one)
    parsed: list[tuple[int, object]] = []  # (line number, parsed value or TraceError)
    for lineno, raw in enumerate(raw_lines, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            parsed.append(
                (lineno, TraceError(f"{where}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})"))
            )
            continue
        if not text.strip():
            continue
        try:
            value: object = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except _DuplicateKey as e:
            value = TraceError(f"{where}:{lineno}: duplicate key {_show(e.args[0])}")
        except json.JSONDecodeError as e:
            value = TraceError(f"{where}:{lineno}: not JSON ({e.msg} at column {e.colno})")
        except ValueError as e:  # e.g. an integer with too many digits
            value = TraceError(f"{where}:{lineno}: not JSON ({e})")
        except RecursionError:
            value = TraceError(f"{where}:{lineno}: not JSON (nested too deeply)")
        parsed.append((lineno, value))
    id_lines: dict[str, int] = {}
    for lineno, value in parsed:
        if isinstance(value, dict) and isinstance(value.get("id"), str):
            id_lines.setdefault(value["id"], lineno)

    # pass 2: validate in line order
    name = Path(path).stem
    requests: list[TraceRequest] = []
    seen: dict[str, int] = {}
    for n, (lineno, value) in enumerate(parsed):
        if isinstance(value, TraceError):
            raise value

        def fail(msg: str, lineno: int = lineno) -> TraceError:
            return TraceError(f"{where}:{lineno}: {msg}")

        if not isinstance(value, dict):
            raise fail(f"a line must be a JSON object (one request), got {_show(value)}")
        if "trace" in value:
            if n != 0 or len(value) != 1:
                raise fail(
                    '"trace" (the name of the trace) is allowed only alone, on the first line: {"trace": NAME}'
                )
            if not isinstance(value["trace"], str) or not value["trace"]:
                raise fail(
                    f'"trace" (the name of the trace) must be a non-empty string, got {_show(value["trace"])}'
                )
            name = value["trace"]
            continue
        obj = {k: v for k, v in value.items() if v is not None or k in ("id", "output")}
        if p := _request_problem(obj, list):
            raise fail(p)
        rid = obj["id"]
        if rid in seen:
            raise fail(f'duplicate "id" {_show(rid)} (first on line {seen[rid]})')
        after = obj.get("after")
        if after is not None and after not in seen:
            if after == rid:
                raise fail(f'"after" must name an earlier request, got this request\'s own id {_show(after)}')
            if after in id_lines:
                raise fail(
                    f'"after" must name an earlier request, got {_show(after)}, which is on a later line '
                    f"({id_lines[after]})"
                )
            raise fail(f'"after" names no request of the trace: {_show(after)}')
        seen[rid] = lineno
        requests.append(
            TraceRequest(
                id=rid,
                arrival=obj.get("arrival"),
                after=after,
                think_time=obj.get("think_time", 0.0),
                prompt=tuple(obj["prompt"]) if "prompt" in obj else None,
                prompt_append=tuple(obj["prompt_append"]) if "prompt_append" in obj else None,
                output=tuple(obj["output"]),
            )
        )
    if not requests:
        last = len(raw_lines) - (raw_lines[-1] == b"")  # the file's last line (1 if it is empty)
        raise TraceError(f"{where}:{max(1, last)}: the trace has no requests")
    return Trace(name, tuple(requests))


# ---------------------------------------------------------------------------------------------
# generators


def chat_template_ids(token_id_min: int = 3) -> tuple[int, int, int]:
    """(END_OF_TURN, USER, ASSISTANT) of generated traces: the three lowest ids of the range,
    (3, 4, 5) with the default `token_id_min`."""
    return token_id_min, token_id_min + 1, token_id_min + 2


@dataclass(frozen=True)
class T1Shape:
    """T1 "shared system prompts". Ranges are inclusive (lo, hi) integer draws."""

    num_system_prompts: int = 16
    system_prompt_len: tuple[int, int] = (500, 2500)
    zipf_exponent: float = 1.1  # popularity of system prompt i is proportional to 1 / (i + 1) ** s
    num_requests: int = 400  # times `scale`
    suffix_len: tuple[int, int] = (30, 300)  # unique user message, inside [EOT, USER] ... [EOT, ASSISTANT]
    output_len: tuple[int, int] = (16, 128)
    rate: float = 4.0  # Poisson arrivals, requests/s


@dataclass(frozen=True)
class T2Shape:
    """T2 "multi-turn chat"."""

    num_sessions: int = 60  # times `scale`
    session_rate: float = 1.0  # Poisson session starts, sessions/s
    turns: tuple[int, int] = (3, 8)
    system_prompt_fraction: float = 0.7  # probability that a session starts with a system prompt
    num_system_prompts: int = 4  # shared system prompts, picked uniformly
    system_prompt_len: tuple[int, int] = (200, 800)
    message_len: tuple[int, int] = (20, 200)  # user message, inside [EOT, USER] ... [EOT, ASSISTANT]
    output_len: tuple[int, int] = (30, 250)  # including the final END_OF_TURN
    mean_think_time: float = 4.0  # exponential, seconds


@dataclass(frozen=True)
class T3Shape:
    """T3 "agentic sessions"."""

    num_sessions: int = 12  # times `scale`
    session_rate: float = 0.2  # Poisson session starts, sessions/s
    tool_prefix_len: int = 4000  # tool definitions, shared by every session
    task_context_len: tuple[int, int] = (4000, 10000)
    tool_call_len: tuple[int, int] = (40, 200)  # each turn's output
    tool_result_len: tuple[int, int] = (300, 3000)  # each follow-up's prompt_append
    max_context: int = 40000  # no prompt is longer
    max_turns: int = 15
    think_time: tuple[float, float] = (0.5, 3.0)  # tool latency, uniform, seconds


@dataclass(frozen=True)
class T4Shape:
    """T4 "few-shot trees"."""

    root_len: int = 300  # instruction shared by every request (depth 1)
    num_families: int = 6
    family_len: tuple[int, int] = (400, 900)  # examples of a task family (depth 2)
    variants_per_family: int = 4
    variant_len: tuple[int, int] = (150, 400)  # depth 3
    zipf_exponent: float = 1.1  # over the families * variants leaves, ranks a seeded permutation
    num_requests: int = 400  # times `scale`
    question_len: tuple[int, int] = (20, 80)
    output_len: tuple[int, int] = (8, 40)
    rate: float = 4.0  # Poisson arrivals, requests/s


_SHAPES: dict[str, type] = {"T1": T1Shape, "T2": T2Shape, "T3": T3Shape, "T4": T4Shape}


def default_shape(kind: str) -> T1Shape | T2Shape | T3Shape | T4Shape:
    """The documented default shape of a trace kind."""
    return _SHAPES[_kind(kind)]()


def _kind(kind: str) -> str:
    k = kind.upper() if isinstance(kind, str) else kind
    if k not in TRACE_KINDS:
        raise ValueError(f"trace kind: one of {', '.join(TRACE_KINDS)}, got {kind!r}")
    return k


class _Gen:
    def __init__(self, rng: random.Random, token_id_min: int, token_id_max: int) -> None:
        self.rng = rng
        self.pool = range(token_id_min + 3, token_id_max)
        self.eot, self.user, self.assistant = chat_template_ids(token_id_min)

    def tokens(self, n: int) -> list[int]:
        return self.rng.choices(self.pool, k=n)

    def n(self, lo_hi: tuple[int, int]) -> int:
        return self.rng.randint(*lo_hi)

    def tokens_in(self, lo_hi: tuple[int, int]) -> list[int]:
        return self.tokens(self.n(lo_hi))

    def poisson(self, count: int, rate: float) -> list[float]:
        t, out = 0.0, []
        for i in range(count):
            if i:
                t += self.rng.expovariate(rate)
            out.append(round(t, 6))
        return out

    def zipf(self, k: int, s: float, count: int) -> list[int]:
        weights = [1.0 / (r**s) for r in range(1, k + 1)]
        return self.rng.choices(range(k), weights=weights, k=count)


# A trace of this many times its default size holds millions of requests: beyond it a scale is a
# mistake, not a workload.
MAX_SCALE = 1000.0


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def generate(
    kind: str,
    *,
    seed: int = 0,
    scale: float = 1.0,
    token_id_min: int = 3,
    token_id_max: int = 256,
    shape: T1Shape | T2Shape | T3Shape | T4Shape | None = None,
) -> Trace:
    """A seeded trace of `kind` (one of TRACE_KINDS; see the module docstring for the shapes).

    - `seed`: with `kind`, seeds `random.Random(f"{kind}:{seed}")`, the only source of randomness.
    - `scale`: multiplies the number of requests (T1, T4) or sessions (T2, T3), rounded, >= 1;
      lengths never change.
    - `token_id_min`, `token_id_max`: token ids lie in [token_id_min, token_id_max); the three
      lowest are the chat-template ids (`chat_template_ids`), content is uniform over the rest.
    - `shape`: overrides the kind's default numbers (`T1Shape()` ... `T4Shape()`).
    """
    kind = _kind(kind)
    if not (isinstance(scale, int | float) and math.isfinite(scale) and 0 < scale <= MAX_SCALE):
        raise ValueError(f"scale must be a number > 0 and at most {MAX_SCALE:g}, got {scale!r}")
    if not (0 <= token_id_min and token_id_min + 3 < token_id_max <= MAX_TOKEN_ID + 1):
        raise ValueError(
            "token ids: need 0 <= token_id_min and token_id_min + 3 < token_id_max <= 2**31 (three "
            f"template ids and at least one content id), got [{token_id_min}, {token_id_max})"
        )
    if shape is None:
        shape = _SHAPES[kind]()
    elif not isinstance(shape, _SHAPES[kind]):
        raise ValueError(f"shape for {kind} must be a {_SHAPES[kind].__name__}, got {type(shape).__name__}")
    g = _Gen(random.Random(f"{kind}:{seed}"), token_id_min, token_id_max)
    name = f"{kind}:seed={seed}:scale={scale:g}"
    builders: dict[str, Callable[[_Gen, Any, float], list[TraceRequest]]] = {
        "T1": _t1,
        "T2": _t2,
        "T3": _t3,
        "T4": _t4,
    }
    builder = builders[kind]
    return Trace(name, tuple(builder(g, shape, scale)))


def _t1(g: _Gen, s: T1Shape, scale: float) -> list[TraceRequest]:
    systems = [g.tokens_in(s.system_prompt_len) for _ in range(s.num_system_prompts)]
    n = _scaled(s.num_requests, scale)
    picks = g.zipf(s.num_system_prompts, s.zipf_exponent, n)
    arrivals = g.poisson(n, s.rate)
    return [
        TraceRequest(
            id=f"t1-{i}",
            arrival=arrivals[i],
            prompt=(*systems[picks[i]], g.eot, g.user, *g.tokens_in(s.suffix_len), g.eot, g.assistant),
            output=tuple(g.tokens_in(s.output_len)),
        )
        for i in range(n)
    ]


def _t2(g: _Gen, s: T2Shape, scale: float) -> list[TraceRequest]:
    systems = [g.tokens_in(s.system_prompt_len) for _ in range(s.num_system_prompts)]
    n = _scaled(s.num_sessions, scale)
    starts = g.poisson(n, s.session_rate)
    out: list[TraceRequest] = []

    def user_turn() -> tuple[int, ...]:
        return (g.eot, g.user, *g.tokens_in(s.message_len), g.eot, g.assistant)

    def answer() -> tuple[int, ...]:
        return (*g.tokens(g.n(s.output_len) - 1), g.eot)

    for si in range(n):
        system = g.rng.choice(systems) if g.rng.random() < s.system_prompt_fraction else []
        out.append(
            TraceRequest(
                id=f"t2-s{si}-0", arrival=starts[si], prompt=(*system, *user_turn()), output=answer()
            )
        )
        for turn in range(1, g.n(s.turns)):
            out.append(
                TraceRequest(
                    id=f"t2-s{si}-{turn}",
                    after=f"t2-s{si}-{turn - 1}",
                    think_time=round(g.rng.expovariate(1.0 / s.mean_think_time), 6),
                    prompt_append=user_turn(),
                    output=answer(),
                )
            )
    return out


def _t3(g: _Gen, s: T3Shape, scale: float) -> list[TraceRequest]:
    tools = g.tokens(s.tool_prefix_len)
    n = _scaled(s.num_sessions, scale)
    starts = g.poisson(n, s.session_rate)
    out: list[TraceRequest] = []
    for si in range(n):
        prompt = tuple(tools + g.tokens_in(s.task_context_len))
        if len(prompt) > s.max_context:
            raise ValueError(f"T3 shape: a first prompt of {len(prompt)} tokens exceeds max_context")
        req = TraceRequest(
            id=f"t3-s{si}-0", arrival=starts[si], prompt=prompt, output=tuple(g.tokens_in(s.tool_call_len))
        )
        out.append(req)
        context = len(prompt)
        for turn in range(1, s.max_turns):
            result = g.tokens_in(s.tool_result_len)
            if context + len(req.output) + len(result) > s.max_context:
                break
            context += len(req.output) + len(result)
            req = TraceRequest(
                id=f"t3-s{si}-{turn}",
                after=req.id,
                think_time=round(g.rng.uniform(*s.think_time), 6),
                prompt_append=tuple(result),
                output=tuple(g.tokens_in(s.tool_call_len)),
            )
            out.append(req)
    return out


def _t4(g: _Gen, s: T4Shape, scale: float) -> list[TraceRequest]:
    root = g.tokens(s.root_len)
    families = [g.tokens_in(s.family_len) for _ in range(s.num_families)]
    leaves = [
        root + fam + g.tokens_in(s.variant_len) for fam in families for _ in range(s.variants_per_family)
    ]
    g.rng.shuffle(leaves)  # popularity rank i -> a random leaf
    n = _scaled(s.num_requests, scale)
    picks = g.zipf(len(leaves), s.zipf_exponent, n)
    arrivals = g.poisson(n, s.rate)
    return [
        TraceRequest(
            id=f"t4-{i}",
            arrival=arrivals[i],
            prompt=tuple(leaves[picks[i]] + g.tokens_in(s.question_len)),
            output=tuple(g.tokens_in(s.output_len)),
        )
        for i in range(n)
    ]
