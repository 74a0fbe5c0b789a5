"""Request traces (benchmarks/traces.py): the JSONL format round-trips, every malformed line is a
TraceError naming its line, full prompts resolve `after` chains, and the seeded generators are
reproducible and have their documented shapes."""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from functools import cache

import pytest

from hybridserve.benchmarks.traces import (
    MAX_TOKEN_ID,
    TRACE_KINDS,
    Trace,
    TraceError,
    TraceRequest,
    chat_template_ids,
    generate,
    read_trace,
    summarize,
    write_trace,
)

EOT, USER, ASSISTANT = chat_template_ids()


@cache
def _gen(kind: str, seed: int = 0, scale: float = 1.0) -> Trace:
    return generate(kind, seed=seed, scale=scale)


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _common_prefix_len(seqs) -> int:
    seqs = list(seqs)
    return min(_lcp(seqs[0], s) for s in seqs[1:])


def _forked_trace() -> Trace:
    """a -> b -> c and a -> d (a fork), plus an unrelated first turn e."""
    return Trace(
        "forked",
        (
            TraceRequest(id="a", arrival=0.0, prompt=(10, 11), output=(20, 21)),
            TraceRequest(id="e", arrival=0.5, prompt=(12,), output=(22,)),
            TraceRequest(id="b", after="a", think_time=1.5, prompt_append=(30,), output=(40, 41, 42)),
            TraceRequest(id="c", after="b", think_time=0.0, prompt_append=(), output=(50,)),
            TraceRequest(id="d", after="a", think_time=2.0, prompt_append=(31, 32), output=(60,)),
        ),
    )


# ------------------------------------------------------------------------------------------
# data model


def test_full_prompt_resolves_after_chains_with_own_and_substituted_outputs() -> None:
    t = _forked_trace()
    assert t.full_prompt("a") == [10, 11]
    assert t.full_prompt("b") == [10, 11, 20, 21, 30]
    assert t.full_prompt("c") == [10, 11, 20, 21, 30, 40, 41, 42]
    assert t.full_prompt("d") == [10, 11, 20, 21, 31, 32]
    # the server's real answers replace the trace's outputs of earlier turns (any length)
    real = {"a": [7], "b": [8, 9], "c": [99]}  # c's own output does not matter for c's prompt
    assert t.full_prompt("c", real) == [10, 11, 7, 30, 8, 9]
    assert t.full_prompt("d", real) == [10, 11, 7, 31, 32]
    assert t.full_prompt("c", {"b": [8]}) == [10, 11, 20, 21, 30, 8]  # a mapping may name only some
    assert t.full_prompt("c", {}) == t.full_prompt("c")
    with pytest.raises(KeyError):
        t.full_prompt("zz")
    assert t.num_prompt_tokens() == 2 + 1 + 5 + 8 + 6
    assert t.num_output_tokens() == 2 + 1 + 3 + 1 + 1
    assert [t.prompt_len(r.id) for r in t.requests] == [len(t.full_prompt(r.id)) for r in t.requests]


def test_sessions_group_a_first_turn_with_everything_that_follows_it() -> None:
    t = _forked_trace()
    assert [[r.id for r in s] for s in t.sessions()] == [["a", "b", "c", "d"], ["e"]]
    assert [r.id for r in t.successors("a")] == ["b", "d"]
    assert t.successors("c") == ()
    assert summarize(t) == {
        "name": "forked",
        "requests": 5,
        "sessions": 2,
        "prompt_tokens": 22,
        "output_tokens": 8,
        "max_prompt_len": 8,
        "mean_prompt_len": 22 / 5,
    }


def test_a_long_chain_resolves_without_recursion() -> None:
    n = sys.getrecursionlimit() + 500
    reqs = [TraceRequest(id="r0", arrival=0.0, prompt=(1,), output=(2,))]
    reqs += [
        TraceRequest(id=f"r{i}", after=f"r{i - 1}", prompt_append=(3,), output=(2,)) for i in range(1, n)
    ]
    t = Trace("chain", tuple(reqs))
    p = t.full_prompt(f"r{n - 1}")
    assert p == [1] + [2, 3] * (n - 1)
    assert t.prompt_len(f"r{n - 1}") == len(p)
    assert len(t.sessions()) == 1 and len(t.sessions()[0]) == n


def test_dataclasses_reject_invalid_structure() -> None:
    with pytest.raises(TraceError, match='"arrival" and "after"'):
        TraceRequest(id="x", arrival=1.0, after="y", prompt_append=(1,), output=(1,))
    with pytest.raises(TraceError, match='"output"'):
        TraceRequest(id="x", arrival=1.0, prompt=(1,), output=())
    with pytest.raises(TraceError, match=r'"prompt"\[1\]'):
        TraceRequest(id="x", arrival=1.0, prompt=(1, True), output=(1,))
    first = TraceRequest(id="a", arrival=0.0, prompt=(1,), output=(1,))
    later = TraceRequest(id="b", after="c", prompt_append=(1,), output=(1,))
    c = TraceRequest(id="c", arrival=0.0, prompt=(1,), output=(1,))
    with pytest.raises(TraceError, match='request "b": "after" must name an earlier request'):
        Trace("t", (first, later, c))
    with pytest.raises(TraceError, match="duplicate id"):
        Trace("t", (first, first))
    with pytest.raises(TraceError, match="no requests"):
        Trace("t", ())
    with pytest.raises(TraceError, match="trace name must be a non-empty string"):
        Trace("", (first,))  # (a file could not name it: write_trace wrote what read_trace refused)
    # lists become tuples, integer times floats: equal to what a file read gives
    assert TraceRequest(id="a", arrival=0, prompt=[1], output=[1]) == first


def test_validate_names_the_request_with_an_out_of_vocabulary_token() -> None:
    t = _forked_trace()
    t.validate(61)
    with pytest.raises(
        TraceError, match=r'^request "d": "output"\[0\] is token id 60, not below the vocabulary size 60'
    ):
        t.validate(60)
    with pytest.raises(TraceError, match=r'^request "b": "output"\[2\] is token id 42'):
        t.validate(42)
    big = Trace("big", (t.requests[0], TraceRequest(id="f", after="a", prompt_append=(1, 999), output=(1,))))
    with pytest.raises(TraceError, match=r'^request "f": "prompt_append"\[1\] is token id 999'):
        big.validate(999)
    with pytest.raises(TraceError, match=r'^request "c": prompt \(8 tokens\) \+ output \(1\) = 9 tokens'):
        t.validate(100, max_model_len=8)
    t.validate(100, max_model_len=9)


# ------------------------------------------------------------------------------------------
# files


def test_write_then_read_gives_the_same_trace(tmp_path) -> None:
    for t in (_forked_trace(), _gen("T2", scale=0.1), _gen("T3", scale=0.1)):
        path = tmp_path / "t.jsonl"
        write_trace(t, path)
        back = read_trace(str(path))
        assert back == t and back.name == t.name
        assert [back.full_prompt(r.id) for r in back.requests] == [t.full_prompt(r.id) for r in t.requests]
    # without the header line the name is the file's stem; blank lines are skipped
    lines = (tmp_path / "t.jsonl").read_text().splitlines()[1:]
    (tmp_path / "other.jsonl").write_text("\n\n" + "\n \n".join(lines) + "\n\n")
    back = read_trace(tmp_path / "other.jsonl")
    assert back.name == "other" and back.requests == _gen("T3", scale=0.1).requests


FIRST = '{"id": "a", "arrival": 0.5, "prompt": [1, 2], "output": [3]}'


def _line(**kw) -> str:
    return json.dumps(kw)


MALFORMED = [
    # (lines of the file, the line named, words of the message)
    ([FIRST, '{"id": "b", "arrival": 1,'], 2, "not JSON (Expecting"),
    ([FIRST, "[" * 20000 + "]" * 20000], 2, "not JSON (nested too deeply)"),
    ([FIRST, "[1, 2]"], 2, "must be a JSON object"),
    (["", FIRST, '"abc"'], 3, "must be a JSON object"),
    ([FIRST, '{"id": "b", "id": "c", "arrival": 1, "prompt": [1], "output": [1]}'], 2, 'duplicate key "id"'),
    ([_line(arrival=1, prompt=[1], output=[1])], 1, 'missing "id"'),
    ([_line(id="", arrival=1, prompt=[1], output=[1])], 1, '"id" must be a non-empty string, got ""'),
    ([_line(id=5, arrival=1, prompt=[1], output=[1])], 1, '"id" must be a non-empty string, got 5'),
    ([_line(id="a", arrival=1, prompt=[1])], 1, 'missing "output"'),
    ([_line(id="a", arrival=1, promt=[1], output=[1])], 1, 'unknown key "promt"'),
    (
        [_line(id="a", arrival=1, prompt=[1], prompt_append=[1], output=[1])],
        1,
        'both "prompt" and "prompt_append"',
    ),
    ([_line(id="a", arrival=1, output=[1])], 1, 'missing "prompt"'),
    ([_line(id="a", arrival=1, prompt_append=[1], output=[1])], 1, '"prompt_append" without "after"'),
    ([_line(id="a", prompt=[1], output=[1])], 1, 'missing "arrival"'),
    ([_line(id="a", arrival=1, think_time=1, prompt=[1], output=[1])], 1, '"think_time" without "after"'),
    ([FIRST, _line(id="b", after="a", arrival=1, prompt_append=[1], output=[1])], 2, '"arrival" and "after"'),
    ([FIRST, _line(id="b", after="a", prompt=[1], output=[1])], 2, '"prompt" and "after" exclude each other'),
    ([FIRST, _line(id="b", after="a", output=[1])], 2, 'missing "prompt_append"'),
    ([FIRST, _line(id="b", after=3, prompt_append=[1], output=[1])], 2, '"after" must be the id'),
    (
        [FIRST, _line(id="b", after="zz", prompt_append=[1], output=[1])],
        2,
        '"after" names no request of the trace: "zz"',
    ),
    (
        [
            FIRST,
            _line(id="b", after="c", prompt_append=[1], output=[1]),
            "",
            _line(id="c", arrival=1, prompt=[1], output=[1]),
        ],
        2,
        '"after" must name an earlier request, got "c", which is on a later line (4)',
    ),
    ([FIRST, _line(id="b", after="b", prompt_append=[1], output=[1])], 2, "this request's own id"),
    (["", FIRST, "", FIRST], 4, 'duplicate "id" "a" (first on line 2)'),
    (
        [_line(id="a", arrival=-1, prompt=[1], output=[1])],
        1,
        '"arrival" must be a finite number >= 0 (seconds), got -1',
    ),
    (
        ['{"id": "a", "arrival": NaN, "prompt": [1], "output": [1]}'],
        1,
        '"arrival" must be a finite number >= 0 (seconds), got NaN',
    ),
    (
        ['{"id": "a", "arrival": 1e999, "prompt": [1], "output": [1]}'],
        1,
        '"arrival" must be a finite number >= 0 (seconds), got Infinity',
    ),
    (
        [_line(id="a", arrival=True, prompt=[1], output=[1])],
        1,
        '"arrival" must be a finite number >= 0 (seconds), got true',
    ),
    (
        [_line(id="a", arrival="1", prompt=[1], output=[1])],
        1,
        '"arrival" must be a finite number >= 0 (seconds), got "1"',
    ),
    (
        [FIRST, _line(id="b", after="a", think_time=-0.5, prompt_append=[1], output=[1])],
        2,
        '"think_time" must be a finite number >= 0',
    ),
    (
        [FIRST, '{"id": "b", "after": "a", "think_time": Infinity, "prompt_append": [], "output": [1]}'],
        2,
        '"think_time" must be a finite number',
    ),
    (
        [FIRST, _line(id="b", after="a", think_time=False, prompt_append=[1], output=[1])],
        2,
        '"think_time" must be a finite number >= 0 (seconds), got false',
    ),
    (
        [_line(id="a", arrival=1, prompt="abc", output=[1])],
        1,
        '"prompt" must be a non-empty list of token ids (integers >= 0), got "abc"',
    ),
    ([_line(id="a", arrival=1, prompt=[], output=[1])], 1, '"prompt" must be a non-empty list of token ids'),
    (
        [_line(id="a", arrival=1, prompt=[1, True], output=[1])],
        1,
        '"prompt"[1] must be a token id (an integer in [0, 2147483647]), got true',
    ),
    (
        [_line(id="a", arrival=1, prompt=[1.0], output=[1])],
        1,
        '"prompt"[0] must be a token id (an integer in [0, 2147483647]), got 1.0',
    ),
    (
        [_line(id="a", arrival=1, prompt=[5, -1], output=[1])],
        1,
        '"prompt"[1] must be a token id (an integer in [0, 2147483647]), got -1',
    ),
    (
        [_line(id="a", arrival=1, prompt=[MAX_TOKEN_ID + 1], output=[1])],
        1,
        f'"prompt"[0] must be a token id (an integer in [0, 2147483647]), got {MAX_TOKEN_ID + 1}',
    ),
    (
        [FIRST, _line(id="b", after="a", prompt_append=[1, "x"], output=[1])],
        2,
        '"prompt_append"[1] must be a token id',
    ),
    (
        [FIRST, _line(id="b", after="a", prompt_append=5, output=[1])],
        2,
        '"prompt_append" must be a list of token ids',
    ),
    ([_line(id="a", arrival=1, prompt=[1], output=[])], 1, '"output" must be a non-empty list of token ids'),
    ([_line(id="a", arrival=1, prompt=[1], output=[0, 2.5])], 1, '"output"[1] must be a token id'),
    (
        [_line(id="a", arrival=1, prompt=[1], output=None)],
        1,
        '"output" must be a non-empty list of token ids (integers >= 0), got null',
    ),
    (
        [FIRST, _line(trace="late")],
        2,
        '"trace" (the name of the trace) is allowed only alone, on the first line',
    ),
    ([_line(trace="x", id="a")], 1, '"trace" (the name of the trace) is allowed only alone'),
    ([_line(trace=7), FIRST], 1, '"trace" (the name of the trace) must be a non-empty string, got 7'),
    ([], 1, "the trace has no requests"),
    (["", "   ", ""], 3, "the trace has no requests"),  # the last line of the file
    (["", _line(trace="empty"), "", ""], 4, "the trace has no requests"),
]


@pytest.mark.parametrize(("lines", "lineno", "words"), MALFORMED)
def test_a_malformed_file_names_the_line_and_the_problem(tmp_path, lines, lineno, words) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + ("\n" if lines else ""))
    with pytest.raises(TraceError) as e:
        read_trace(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:{lineno}: "), msg
    assert words in msg, msg
    assert isinstance(e.value, ValueError)


def test_a_line_that_is_not_utf8_is_named(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(FIRST.encode() + b"\n" + b'{"id": "\xff"}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: not UTF-8"):
        read_trace(path)


def test_nulls_count_as_absent_keys(tmp_path) -> None:
    path = tmp_path / "n.jsonl"
    path.write_text(
        FIRST
        + "\n"
        + _line(id="b", after="a", arrival=None, prompt=None, prompt_append=[4], output=[5])
        + "\n"
    )
    assert read_trace(path).full_prompt("b") == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------
# generators


@pytest.mark.parametrize("kind", TRACE_KINDS)
def test_a_generator_is_reproducible_per_seed(kind) -> None:
    a = generate(kind, seed=3, scale=0.2)
    assert a == generate(kind, seed=3, scale=0.2)
    b = generate(kind, seed=4, scale=0.2)
    assert a.requests != b.requests and a.name != b.name
    assert generate(kind.lower(), seed=3, scale=0.2) == a
    for t in (a, b):
        for r in t.requests:
            for tokens in (r.prompt, r.prompt_append, r.output):
                assert all(3 <= x < 256 for x in tokens or ())
        t.validate(256)


@pytest.mark.parametrize(
    ("kind", "full", "per"),
    [("T1", 400, "requests"), ("T2", 60, "sessions"), ("T3", 12, "sessions"), ("T4", 400, "requests")],
)
def test_scale_multiplies_the_number_of_requests_or_sessions(kind, full, per) -> None:
    for scale, want in ((1.0, full), (0.25, full // 4), (0.33, round(full * 0.33)), (1e-6, 1)):
        assert summarize(_gen(kind, 0, scale))[per] == want
    if kind == "T2":  # (the cheapest kind; the rounding is shared)
        assert summarize(generate(kind, scale=2))[per] == 2 * full
    with pytest.raises(ValueError, match="scale"):
        generate(kind, scale=0)
    with pytest.raises(ValueError, match="scale"):
        generate(kind, scale=float("nan"))


def test_generator_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="trace kind"):
        generate("T5")
    with pytest.raises(ValueError, match="token ids"):
        generate("T1", token_id_min=10, token_id_max=13)
    t = generate("T2", scale=0.1, token_id_min=100, token_id_max=120)
    assert chat_template_ids(100) == (100, 101, 102)
    for r in t.requests:
        assert all(100 <= x < 120 for x in (r.prompt or ()) + (r.prompt_append or ()) + r.output)
        assert r.output[-1] == 100


def _poisson_gaps(times) -> list[float]:
    times = sorted(times)
    assert times[0] == 0.0
    return [b - a for a, b in zip(times, times[1:])]


def test_t1_shared_system_prompts() -> None:
    t = _gen("T1")
    assert len(t.requests) == 400 and all(r.after is None for r in t.requests)
    groups: dict[tuple, list[TraceRequest]] = {}
    for r in t.requests:
        groups.setdefault(r.prompt[:500], []).append(r)  # a system prompt has >= 500 tokens
    assert len(groups) <= 16
    sizes = sorted((len(g) for g in groups.values()), reverse=True)
    assert len(groups) >= 12 and sizes[-1] >= 2  # (true for this seed) so every group has an LCP
    system_lens = []
    for g in groups.values():
        n = _common_prefix_len(r.prompt for r in g) - 2  # the system prompt, then [EOT, USER]
        system_lens.append(n)
        assert 500 <= n <= 2500
        for r in g:  # the unique user message in the chat template
            assert r.prompt[n : n + 2] == (EOT, USER) and r.prompt[-2:] == (EOT, ASSISTANT)
            assert 30 <= len(r.prompt) - n - 4 <= 300
            assert EOT not in r.prompt[:n]  # so the first END_OF_TURN ends the system prompt
    assert any(n % 16 for n in system_lens)  # off the block grid
    # Zipf(1.1) over 16: the top system prompt takes about a third of the requests
    assert sizes[0] >= 0.25 * 400 and sizes[0] >= 8 * sizes[-1]
    assert all(16 <= len(r.output) <= 128 for r in t.requests)
    assert 0.2 <= statistics.mean(_poisson_gaps(r.arrival for r in t.requests)) <= 0.3  # 4 requests/s
    assert [r.arrival for r in t.requests] == sorted(r.arrival for r in t.requests)


def test_t2_multi_turn_chat() -> None:
    t = _gen("T2")
    sessions = t.sessions()
    assert len(sessions) == 60
    assert all(3 <= len(s) <= 8 for s in sessions)
    systems = set()
    for s in sessions:
        first = s[0]
        assert first.after is None and first.id.endswith("-0")
        p = first.prompt
        cut = p.index(EOT)  # content never uses a template id
        if cut:
            systems.add(p[:cut])
            assert 200 <= cut <= 800
        user = p[cut:]
        assert user[:2] == (EOT, USER) and user[-2:] == (EOT, ASSISTANT) and 20 <= len(user) - 4 <= 200
        for prev, cur in zip(s, s[1:]):
            assert cur.after == prev.id  # a chain, turn after turn
            a = cur.prompt_append
            assert a[:2] == (EOT, USER) and a[-2:] == (EOT, ASSISTANT) and 20 <= len(a) - 4 <= 200
            assert not {EOT, USER, ASSISTANT} & set(a[2:-2])
            full = t.full_prompt(cur.id)
            assert full[: len(t.full_prompt(prev.id)) + len(prev.output)] == t.full_prompt(prev.id) + list(
                prev.output
            )
            assert cur.think_time > 0
        for r in s:
            assert 30 <= len(r.output) <= 250 and r.output[-1] == EOT and EOT not in r.output[:-1]
    with_system = sum(1 for s in sessions if s[0].prompt[0] != EOT)
    assert 0.55 * 60 <= with_system <= 0.85 * 60
    assert 2 <= len(systems) <= 4
    think = [r.think_time for r in t.requests if r.after is not None]
    assert 3.0 <= statistics.mean(think) <= 5.0
    assert 0.6 <= statistics.mean(_poisson_gaps(s[0].arrival for s in sessions)) <= 1.5  # 1 session/s


def test_t3_agentic_sessions() -> None:
    t = _gen("T3")
    sessions = t.sessions()
    assert len(sessions) == 12
    firsts = [s[0].prompt for s in sessions]
    assert _common_prefix_len(firsts) == 4000  # the shared tool definitions, then each task
    assert all(8000 <= len(p) <= 14000 for p in firsts)
    for s in sessions:
        lens = [t.prompt_len(r.id) for r in s]
        assert lens == sorted(lens) and len(set(lens)) == len(lens)  # contexts grow
        assert max(lens) <= 40000 and len(s) <= 15
        last = s[-1]
        # it ended at 15 turns, or a tool result of at most 3000 tokens could have overflowed
        assert len(s) == 15 or lens[-1] + len(last.output) + 3000 > 40000
        for prev, cur in zip(s, s[1:]):
            assert cur.after == prev.id
            assert 300 <= len(cur.prompt_append) <= 3000 and 0.5 <= cur.think_time <= 3.0
        assert all(40 <= len(r.output) <= 200 for r in s)
    assert any(len(s) < 15 for s in sessions)  # the 40000-token limit binds (for this seed)
    assert summarize(t)["max_prompt_len"] > 30000


def test_t4_few_shot_trees() -> None:
    t = _gen("T4")
    prompts = [r.prompt for r in t.requests]
    assert len(prompts) == 400
    assert _common_prefix_len(prompts) == 300  # the root instruction
    families: dict[tuple, list[tuple]] = {}
    for p in prompts:
        families.setdefault(p[300:700], []).append(p)  # examples: >= 400 tokens
    assert len(families) == 6
    leaves = Counter()
    for family, members in families.items():
        # the family's examples end where its variants start to differ
        variants: dict[tuple, list[tuple]] = {}
        fam_len = _common_prefix_len(members) - 300
        assert 400 <= fam_len <= 900
        fam_end = 300 + fam_len
        for p in members:
            variants.setdefault(p[fam_end : fam_end + 150], []).append(p)  # a variant: >= 150
        assert 2 <= len(variants) <= 4
        for key, vm in variants.items():
            leaves[(family, key)] = len(vm)
            if len(vm) > 1:
                vlen = _common_prefix_len(vm) - fam_end
                assert 150 <= vlen <= 400
                assert all(20 <= len(p) - fam_end - vlen <= 80 for p in vm)  # the question
    assert len(leaves) <= 24
    top = leaves.most_common(1)[0][1]
    assert top >= 0.2 * 400  # Zipf(1.1) over 24 leaves
    # popularity ranks are a permutation of the leaves: the 4 most popular are not one family's
    assert len({family for (family, _), _ in leaves.most_common(4)}) >= 2
    assert all(8 <= len(r.output) <= 40 for r in t.requests)
    assert 0.2 <= statistics.mean(_poisson_gaps(r.arrival for r in t.requests)) <= 0.3
