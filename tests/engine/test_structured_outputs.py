"""Structured outputs in the engine (offline LLM, demo model): outputs match their grammar and end,
speculation changes nothing, grammars compile off the step loop, once, within a time limit.
docs/structured-outputs.md."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time

import pytest

from hybridserve.engine.llm import LLM
from hybridserve.errors import InvalidRequestError
from hybridserve.sampling.params import SamplingParams
from hybridserve.sampling.structured_outputs import StructuredOutputsParams

# Bounded strings, numbers and arrays: the language is finite, so every output ends (the grammar
# allows only EOS at its end) well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
PROMPTS = [
    "the cat sat on the mat. the cat sat on the mat. the cat",
    "abc abc abc abc abc",
    "Hello world, hello world",
    "one two three one two three one",
]


def _check(obj: dict) -> None:
    assert set(obj) == {"name", "age", "tags", "ok"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 6 for t in obj["tags"])
    assert isinstance(obj["ok"], bool)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("demo", dtype="float32")


def test_json_schema_outputs_are_valid_and_end(llm: LLM) -> None:
    params = [
        SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured_outputs={"json": SCHEMA})
        for s in range(24)
    ]
    outs = llm.generate([PROMPTS[s % 4] for s in range(24)], params)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        _check(json.loads(c.text))


def test_regex_choice_grammar_json_object(llm: LLM) -> None:
    cases = [
        ({"regex": r"[a-c]{2,5}-[0-9]{1,3}"}, lambda t: re.fullmatch(r"[a-c]{2,5}-[0-9]{1,3}", t)),
        ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
        ({"grammar": 'start: "x" ("+" "y"){1,4}'}, lambda t: re.fullmatch(r"x(\+y){1,4}", t)),
        ({"grammar": 'root ::= "a" [0-9] "b"'}, lambda t: re.fullmatch(r"a[0-9]b", t)),  # GBNF
    ]
    for spec, ok in cases:
        for temp in (0.0, 1.0):
            out = llm.generate(
                "Hi there", SamplingParams(max_tokens=40, temperature=temp, seed=5, structured_outputs=spec)
            )
            c = out[0].outputs[0]
            assert c.finish_reason == "stop" and ok(c.text), (spec, c.text)
    # json_object: any JSON object; with a random model it need not end, but what there is parses
    # as far as it goes and the start is an object
    c = llm.generate(
        "Hi", SamplingParams(max_tokens=30, temperature=0.0, structured_outputs={"json_object": True})
    )[0]
    assert c.outputs[0].text.startswith("{")


def test_params_validation() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutputsParams(json='{"a":' * 100_000 + "1" + "}" * 100_000)  # past the parser's depth
    # a schema given as a Python object must be a JSON value (it was a raw TypeError / ValueError)
    cyclic: dict[str, object] = {"type": "object"}
    cyclic["self"] = cyclic
    for schema in ({"enum": {1, 2}}, {"type": b"object"}, cyclic):
        with pytest.raises(InvalidRequestError, match="json: the schema must be a JSON value"):
            SamplingParams(structured_outputs={"json": schema})
    with pytest.raises(InvalidRequestError, match="at most"):
        StructuredOutputsParams(regex="a" * 300_000)
    with pytest.raises(InvalidRequestError, match="unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})
    # equal sources share a cache key, whatever field carried them
    a = StructuredOutputsParams(json=SCHEMA, param="response_format")
    assert a.cache_key == StructuredOutputsParams(json=SCHEMA).cache_key


def test_invalid_grammars_are_refused_by_name(llm: LLM) -> None:
    for spec, words in (
        ({"json": {"type": "nonsense"}}, "invalid JSON schema"),
        ({"regex": "a("}, "invalid regex"),
        ({"grammar": "start: undefined_rule"}, "invalid grammar"),
        # a lone backslash at the end escapes nothing: llguidance dropped it from a regex and
        # let a schema's pattern with one constrain nothing, so these were served unrefused
        ({"regex": "[0-9]+\\"}, "invalid regex: the regex .* ends in a lone backslash"),
        ({"json": {"type": "string", "pattern": "^[0-9]{3}\\"}}, "pattern .* lone backslash"),
        ({"json": {"patternProperties": {"^a\\": {}}}}, "patternProperties .* lone backslash"),
        # an integer no double holds was written as a neighbour of it, ending "stop"
        ({"json": {"const": 2**53 + 1}}, "const: the integer 9007199254740993 has no exact double"),
        ({"json": {"enum": ["a", [1, {"n": -(2**60) - 1}]]}}, "enum: the integer -1152921504606846977"),
    ):
        for _ in range(2):  # compiled the first time, from the cache of errors the second
            with pytest.raises(InvalidRequestError, match=words):
                llm.generate("Hi", SamplingParams(max_tokens=8, structured_outputs=spec))
    # the engine goes on; an escaped backslash at the end is a backslash
    assert llm.generate("Hi", SamplingParams(max_tokens=4))[0].outputs[0].finish_reason == "length"
    out = llm.generate("Hi", SamplingParams(max_tokens=8, structured_outputs={"regex": r"a\\"}))
    assert (out[0].outputs[0].text, out[0].outputs[0].finish_reason) == ("a\\", "stop")
    # an integer a double holds exactly is written as given
    out = llm.generate("Hi", SamplingParams(max_tokens=24, structured_outputs={"json": {"const": 2**60}}))
    assert (json.loads(out[0].outputs[0].text), out[0].outputs[0].finish_reason) == (2**60, "stop")


def test_a_batch_with_a_grammar_that_does_not_compile_is_refused_whole_every_time(llm: LLM) -> None:
    """The same contract whether the bad grammar is new or already in the compiler's cache: the
    batch is refused and leaves nothing behind; the good prompt alone then runs as before."""
    good = SamplingParams(max_tokens=6, temperature=0.0)
    bad = SamplingParams(max_tokens=6, structured_outputs={"regex": "[[[a"})
    alone = llm.generate("Hi", good)[0].outputs[0].token_ids
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="invalid regex"):
            llm.generate(["Hi", "Hi"], [good, bad])
        assert not llm.engine.has_unfinished_requests()
    assert llm.generate("Hi", good)[0].outputs[0].token_ids == alone


def test_a_grammar_too_large_to_follow_fails_its_request_alone_as_invalid(llm: LLM) -> None:
    """A grammar that compiles and gives its first mask but hits a limit of the grammar library
    a few tokens in ends its own request with finish_reason "error", marked `invalid` (the
    client's input: the server answers a 400) and naming the field; the batch's other request
    is what it is alone."""
    good = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = llm.generate("Hi", good)[0].outputs[0].token_ids
    for spec, words in (
        ({"regex": "a{1000000}"}, "lexer error"),
        (
            {"json": {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}},
            "parser",
        ),
    ):
        bad = SamplingParams(max_tokens=20, structured_outputs=spec)
        ok, failed = llm.generate(["Hi", "x"], [good, bad])
        assert ok.outputs[0].token_ids == alone and ok.error is None
        assert failed.outputs[0].finish_reason == "error" and failed.invalid
        assert failed.error is not None and failed.error.startswith(
            "structured_outputs: the grammar is too large"
        )
        assert words in failed.error
        assert not llm.engine.has_unfinished_requests()


def test_a_token_the_grammar_refuses_is_no_limit_of_the_grammar(llm: LLM) -> None:
    """A refused token means the masks failed (an engine fault, a 500), not a grammar too large
    to follow (the client's, a 400): the matcher's error state alone does not tell them apart."""
    from hybridserve.sampling.grammar import GrammarError, GrammarMatcher

    ticket = llm.engine.grammars.submit(StructuredOutputsParams(regex="abc"))
    assert ticket.wait(30)
    matcher = ticket.poll()
    assert isinstance(matcher, GrammarMatcher)
    tok = llm.get_tokenizer()
    bad = next(t for t in range(3, 795) if tok.decode([t]).strip() and not tok.decode([t]).startswith("a"))
    with pytest.raises(GrammarError, match="doesn.t satisfy the grammar"):
        matcher.accept([bad])
    assert matcher.limit_hit() is None


def test_a_refused_added_token_is_the_grammar_s_only_where_its_mask_allowed_it(llm: LLM) -> None:
    """An added token that a literal of the grammar spells: the mask allows it, the grammar refuses
    it (the client's grammar, a 400 naming it). An added token the mask did not allow is the masks'
    failure (an engine fault, a 500), like any other refused token."""
    from hybridserve.sampling.grammar import GrammarError, GrammarMatcher

    start = llm.get_tokenizer().added_token_ids["<|im_start|>"]

    def matcher(**so: list[str]) -> GrammarMatcher:
        ticket = llm.engine.grammars.submit(StructuredOutputsParams(**so))
        assert ticket.wait(30)
        m = ticket.poll()
        assert isinstance(m, GrammarMatcher)
        return m

    spelled = matcher(choice=["<|im_start|>x"])
    with pytest.raises(GrammarError):
        spelled.accept([start])
    assert spelled.refused_added_token == start
    plain = matcher(choice=["yes", "no"])
    with pytest.raises(GrammarError, match="doesn.t satisfy the grammar"):
        plain.accept([start])
    assert plain.refused_added_token is None and plain.limit_hit() is None


def test_same_grammar_compiles_once(llm: LLM) -> None:
    grammars = llm.engine.grammars  # type: ignore[attr-defined]
    spec = {"regex": r"q[0-9]{3}"}
    before = grammars.stats()["grammar_compilations"]
    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=10, structured_outputs=spec))
    llm.generate("d", SamplingParams(max_tokens=10, structured_outputs=spec))
    assert grammars.stats()["grammar_compilations"] == before + 1


def test_min_tokens_yields_to_a_complete_grammar(llm: LLM) -> None:
    """A grammar that is complete ends the output even before min_tokens: at its end (choice) or,
    when it allows nothing at all, with the EOS that min_tokens would otherwise forbid."""
    out = llm.generate(
        "Hi",
        SamplingParams(max_tokens=20, min_tokens=10, temperature=0.0, structured_outputs={"choice": ["ab"]}),
    )[0].outputs[0]
    assert out.text == "ab" and out.finish_reason == "stop"
    for temperature in (0.0, 1.0):
        out = llm.generate(
            "Hi",
            SamplingParams(
                max_tokens=20, min_tokens=10, temperature=temperature, structured_outputs={"regex": "()"}
            ),
        )[0].outputs[0]
        assert out.text == "" and out.token_ids == [llm.engine.eos_token_id] and out.finish_reason == "stop"


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_a_grammar_completed_by_the_last_token_allowed_ends_with_stop(speculative: dict | None) -> None:
    """max_tokens exactly the length of the complete output: the output is complete, so it ended
    because the grammar did ("stop"), not at the length limit; one token fewer is "length"."""
    llm = LLM("demo", dtype="float32", speculative_config=speculative)
    specs: list[dict] = [
        {
            "json": {
                "type": "object",
                "properties": {"c": {"enum": ["red", "green"]}},
                "required": ["c"],
                "additionalProperties": False,
            }
        },
        {"choice": ["the cat sat", "a mat"]},
        {"regex": "(ab|cd){3}"},
    ]
    for spec in specs:
        free = llm.generate(
            "the cat", SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=spec)
        )
        full = free[0].outputs[0]
        assert full.finish_reason == "stop", spec
        assert full.token_ids[-1] != llm.engine.eos_token_id, spec  # ended by the grammar, not an EOS
        n = len(full.token_ids)
        exact = llm.generate(
            "the cat", SamplingParams(max_tokens=n, temperature=0.0, structured_outputs=spec)
        )
        assert (exact[0].outputs[0].text, exact[0].outputs[0].finish_reason) == (full.text, "stop"), spec
        if n > 1:
            short = llm.generate(
                "the cat", SamplingParams(max_tokens=n - 1, temperature=0.0, structured_outputs=spec)
            )
            assert short[0].outputs[0].finish_reason == "length", spec
            assert full.text.startswith(short[0].outputs[0].text), spec


def test_slow_grammar_times_out_while_others_run() -> None:
    """A compilation held up past the limit refuses its request (the worker is made slow by a
    hook, so the test does not depend on the machine's speed), while requests without a grammar
    and with a quick one run to the end meanwhile; the same grammar is then refused at once."""
    llm = LLM("demo", dtype="float32", grammar_compile_timeout=0.3)
    engine = llm.engine
    release = threading.Event()

    def hold(c: object) -> None:
        if getattr(c, "kind", None) == "regex" and "slow" in getattr(c, "key", ("", ""))[1]:
            release.wait(20)

    engine.grammars.before_compile = hold  # type: ignore[attr-defined]
    start = time.monotonic()
    engine.add_request("slow", "Hi", SamplingParams(max_tokens=8, structured_outputs={"regex": "slow[0-9]"}))
    engine.add_request("plain", "Hi", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.add_request("quick", "Hi", SamplingParams(max_tokens=8, structured_outputs={"choice": ["a", "b"]}))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = (out, time.monotonic() - start)
    release.set()
    slow, slow_t = done["slow"]
    assert slow.outputs[0].finish_reason == "error" and slow.invalid
    assert slow.error is not None and "took longer than 0.3 s" in slow.error
    assert slow_t < 5.0
    assert len(done["plain"][0].outputs[0].token_ids) == 30
    assert done["quick"][0].outputs[0].text in ("a", "b")
    # the same grammar again: refused at once
    engine.grammars.before_compile = None  # type: ignore[attr-defined]
    deadline = time.monotonic() + 20
    while not engine.grammars.submit(StructuredOutputsParams(regex="slow[0-9]")).compiled.done():  # type: ignore[attr-defined]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(InvalidRequestError, match="took longer"):
        engine.add_request(
            "again", "Hi", SamplingParams(max_tokens=8, structured_outputs={"regex": "slow[0-9]"})
        )


def test_a_compiler_panic_fails_its_request_and_the_workers_live_on() -> None:
    """A panic inside the Rust compiler reaches Python as pyo3's PanicException, a BaseException
    but no Exception: it fails its own request with an error, and the workers it ran on still
    compile the grammars after it (it ended the thread, and two such panics left no worker)."""

    class Panic(BaseException):  # (pyo3's PanicException derives from BaseException)
        pass

    llm = LLM("demo", dtype="float32")
    engine = llm.engine

    def panic(c: object) -> None:
        if "panic" in getattr(c, "key", ("", ""))[1]:
            raise Panic("compiler panicked")

    engine.grammars.before_compile = panic  # type: ignore[attr-defined]
    workers = len(engine.grammars._threads)  # type: ignore[attr-defined]
    for i in range(workers + 1):  # more panics than workers
        engine.add_request(
            f"p{i}", "Hi", SamplingParams(max_tokens=4, structured_outputs={"regex": f"panic{i}"})
        )
    engine.add_request("ok", "Hi", SamplingParams(max_tokens=8, structured_outputs={"choice": ["a", "b"]}))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    for i in range(workers + 1):
        assert done[f"p{i}"].outputs[0].finish_reason == "error" and "panicked" in (done[f"p{i}"].error or "")
    assert done["ok"].outputs[0].text in ("a", "b")
    assert all(t.is_alive() for t in engine.grammars._threads)  # type: ignore[attr-defined]


def test_abort_while_compiling() -> None:
    llm = LLM("demo", dtype="float32")
    engine = llm.engine
    release = threading.Event()
    engine.grammars.before_compile = lambda c: release.wait(20)  # type: ignore[attr-defined]
    engine.add_request("w", "Hi", SamplingParams(max_tokens=8, structured_outputs={"regex": "[ab]+"}))
    assert engine.has_unfinished_requests()
    # waiting for its grammar is waiting (the scheduler does not hold it yet)
    stats = engine.stats()
    assert (stats["num_requests_waiting"], stats["num_requests_awaiting_grammar"], stats["num_waiting"]) == (
        1,
        1,
        0,
    )
    assert engine.abort_request("w")
    assert not engine.has_unfinished_requests()
    assert engine.stats()["num_requests_waiting"] == 0
    release.set()
    assert engine.step() == []


def test_shutdown_waits_for_a_compilation_still_running() -> None:
    """A process that exits while a worker compiles crashes (SIGSEGV: the worker is unwound as it
    leaves llguidance after finalization began); the engine's shutdown waits for the worker to
    end, and says within its bound whether it did."""
    llm = LLM("demo", dtype="float32", grammar_compile_timeout=0.1)
    engine = llm.engine
    release = threading.Event()
    engine.grammars.before_compile = lambda c: release.wait(20)  # type: ignore[attr-defined]
    ticket = engine.grammars.submit(StructuredOutputsParams(regex="[ab]+"))  # type: ignore[attr-defined]
    workers = list(engine.grammars._threads)  # type: ignore[attr-defined]  (this engine's)
    assert workers
    deadline = time.monotonic() + 20
    while ticket.compiled.started is None:  # (a compilation still queued is dropped instead)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not engine.grammars.shutdown(timeout=0.2)  # type: ignore[attr-defined]
    assert any(t.is_alive() for t in workers)
    threading.Timer(0.3, release.set).start()
    engine.shutdown()  # waits for the held compilation, then its worker's end
    assert ticket.compiled.done()
    assert not any(t.is_alive() for t in workers)


def _busy_workers(engine: object) -> tuple[threading.Event, list[str]]:
    """Holds every grammar worker of `engine` on a grammar of its own ("busyN"), compiling until
    the event is set; the sources each worker started on, in order."""
    release = threading.Event()
    started: list[str] = []

    def hold(c: object) -> None:
        source = getattr(c, "key", ("", ""))[1]
        started.append(source)
        if "busy" in source:
            release.wait(20)

    engine.grammars.before_compile = hold  # type: ignore[attr-defined]
    workers = engine.grammars._num_threads  # type: ignore[attr-defined]
    for i in range(workers):
        engine.add_request(  # type: ignore[attr-defined]
            f"busy{i}", "Hi", SamplingParams(max_tokens=2, structured_outputs={"regex": f"busy{i}[ab]"})
        )
    deadline = time.monotonic() + 20
    while len(started) < workers:
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.01)
    return release, started


def test_a_compilation_nobody_waits_for_is_dropped() -> None:
    """Requests aborted (a client that left) before a worker took their grammar: it is not
    compiled, so a grammar asked for after them does not wait behind it; one that another
    request still waits for is compiled, and a dropped one asked for again compiles anew."""
    llm = LLM("demo", dtype="float32")
    engine = llm.engine
    release, started = _busy_workers(engine)
    for i in range(3):
        engine.add_request(
            f"gone{i}", "Hi", SamplingParams(max_tokens=4, structured_outputs={"regex": f"gone{i}[ab]"})
        )
        assert engine.abort_request(f"gone{i}")
    for rid in ("k1", "k2"):  # one grammar, two requests, one of them aborted
        engine.add_request(rid, "Hi", SamplingParams(max_tokens=4, structured_outputs={"regex": "kept[ab]"}))
    engine.abort_request("k1")
    engine.add_request("later", "Hi", SamplingParams(max_tokens=4, structured_outputs={"choice": ["a", "b"]}))
    release.set()
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert not any("gone" in source for source in started), started
    assert engine.grammars.stats()["grammar_compilations_dropped"] == 3  # type: ignore[attr-defined]
    assert done["k2"].outputs[0].text.startswith("kept") and done["later"].outputs[0].text in ("a", "b")
    (again,) = llm.generate("Hi", SamplingParams(max_tokens=6, structured_outputs={"regex": "gone0[ab]"}))
    assert again.outputs[0].text in ("gone0a", "gone0b")


def test_shutdown_drops_the_queued_compilations() -> None:
    """The queued ones end with an error at once (nothing is served after a shutdown); the running
    ones are waited for, and counted by `compilations_running` meanwhile."""
    from hybridserve.engine.grammar_compiler import compilations_running

    llm = LLM("demo", dtype="float32")
    engine = llm.engine
    release, started = _busy_workers(engine)
    queued = engine.grammars.submit(StructuredOutputsParams(regex="queued[ab]"))  # type: ignore[attr-defined]
    assert compilations_running() >= len(started)
    assert not engine.grammars.shutdown(timeout=0.1)  # type: ignore[attr-defined]  (the busy ones run on)
    refused = queued.poll()
    assert isinstance(refused, InvalidRequestError) and "shutting down" in str(refused)
    release.set()
    engine.shutdown()
    assert "queued[ab]" not in started and compilations_running() == 0


@pytest.mark.parametrize("running", [False, True])
def test_the_command_ends_at_once_while_a_compilation_runs(running: bool) -> None:
    """`hybridserve` (cli.run): where a compilation still runs at the end, the process ends at
    once (no interpreter finalization: no atexit handler runs), with the command's status and
    its output flushed; else it ends as a program does."""
    import subprocess
    import sys

    script = f"""
import atexit, sys, threading, time
atexit.register(lambda: print("finalized", flush=True))
if {running}:
    from hybridserve.engine.grammar_compiler import GrammarCompiler, compilations_running
    from hybridserve.engine.tokenizer import Tokenizer
    from hybridserve.model.demo import ensure_demo_model
    d = ensure_demo_model()
    tok = Tokenizer(d)
    g = GrammarCompiler(tok.to_json(), tok.vocab_size, tok.eos_token_id)
    g.before_compile = lambda c: threading.Event().wait(60)
    from hybridserve.sampling.structured_outputs import StructuredOutputsParams
    g.submit(StructuredOutputsParams(regex="[ab]+"))
    while not compilations_running():
        time.sleep(0.01)
print("before", end="")
sys.argv = ["hybridserve", "config", *sys.argv[1:]]
from hybridserve.cli import run
run()
"""
    for args, said in (
        ([], "MODEL is required"),
        (["--model"], "expected one argument"),
    ):  # (argparse's exit too)
        proc = subprocess.run(
            [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stdout.startswith("before") and said in proc.stderr
        assert ("finalized" in proc.stdout) is not running


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_ngram_speculation_gives_the_same_tokens(temperature: float) -> None:
    """float64, with and without n-gram drafts (K = 3): the same tokens, greedy and seeded; drafts
    the grammar forbids are rejected, accepted ones advance it."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 6},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    }

    def params() -> list[SamplingParams]:
        ps = [
            SamplingParams(
                max_tokens=80, temperature=temperature, seed=i, structured_outputs={"json": schema}
            )
            for i in range(len(PROMPTS))
        ]
        ps.append(
            SamplingParams(
                max_tokens=40,
                temperature=temperature,
                seed=9,
                structured_outputs={"regex": r"(the cat |sat )+on"},
            )
        )
        return ps

    # a grammar that the drafts complete inside a verify row (a repetitive prompt, a short regex)
    ps_extra = SamplingParams(
        max_tokens=30, temperature=temperature, seed=11, ignore_eos=True,
        structured_outputs={"regex": r" on the mat\. the cat sat on"},
    )  # fmt: skip
    base_params = params

    def params() -> list[SamplingParams]:  # noqa: F811 - the list above plus that request
        return [*base_params(), ps_extra]

    prompts = [
        *PROMPTS,
        "the cat sat the cat sat",
        "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat sat",
    ]
    results = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        llm = LLM("demo", dtype="float64", speculative_config=spec)
        outs = llm.generate(prompts, params())
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        if spec is not None:
            stats = llm.engine.stats()
            assert stats["spec_decode_accepted_tokens"] > 0
            assert stats["spec_decode_draft_tokens"] > stats["spec_decode_accepted_tokens"]
    assert results[0] == results[1]
    for _tokens, reason in results[0][: len(PROMPTS)]:
        assert reason == "stop"


def test_a_grammar_queued_behind_busy_workers_is_refused_after_a_bounded_wait() -> None:
    from hybridserve.engine.grammar_compiler import QUEUE_WAIT_FACTOR, CompiledGrammar, GrammarTicket

    ticket = GrammarTicket(CompiledGrammar(key="k", kind="json"), 1.0, 100, "response_format")
    now = time.monotonic()
    assert ticket.poll(now) is None  # queued, within its wait
    refused = ticket.poll(now + QUEUE_WAIT_FACTOR * 1.0 + 1)
    assert isinstance(refused, InvalidRequestError) and "no grammar compiler was free" in str(refused)


def test_a_batchs_grammars_compile_side_by_side() -> None:
    """LLM.generate submits every grammar of a batch before it waits for any: here each
    compilation waits (on a barrier) until the other one has started too, which one at a time
    never happens."""
    llm = LLM("demo", dtype="float32", grammar_compile_timeout=30)
    both_started = threading.Barrier(2)

    def meet(c: object) -> None:
        if getattr(c, "kind", None) == "regex":
            both_started.wait(timeout=15)

    llm.engine.grammars.before_compile = meet  # type: ignore[attr-defined]
    outs = llm.generate(
        ["Hi", "Hi"],
        [
            SamplingParams(max_tokens=8, structured_outputs={"regex": "x[0-9]"}),
            SamplingParams(max_tokens=8, structured_outputs={"regex": "y[0-9]"}),
        ],
    )
    assert [o.outputs[0].text[0] for o in outs] == ["x", "y"]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_grammar_that_starts_after_given_tokens(temperature: float) -> None:
    """`start_after` (a thinking model's end of reasoning): the output is free until it holds the
    tokens of that text, and matches the grammar after them; with n-gram drafts (which complete
    the start inside verify rows on the repetitive prompt) the tokens are the same."""
    regex = r" [0-9]{2}-[0-9]{2}"
    prompts = [
        "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat sat on",
        "Once upon a time, in",
        "She walked to",
        "The",
        "It was a",
    ]
    results = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        llm = LLM("demo", dtype="float64", speculative_config=spec)
        params = [
            SamplingParams(
                max_tokens=40,
                temperature=temperature,
                seed=i,
                ignore_eos=True,
                structured_outputs={"regex": regex, "start_after": " the"},
            )  # fmt: skip
            for i in range(len(prompts))
        ]
        outs = llm.generate(prompts, params)
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
    assert results[0] == results[1]
    tok = llm.get_tokenizer()
    start = tok.encode(" the")
    opened = 0
    for ids, reason in results[0]:
        at = next((i for i in range(len(ids)) if ids[i : i + len(start)] == start), None)
        if at is None:  # never started: free to the end
            assert reason == "length"
            continue
        opened += 1
        assert re.fullmatch(regex, tok.decode(ids[at + len(start) :])) and reason == "stop", tok.decode(ids)
        assert not re.fullmatch(regex, tok.decode(ids[:at]))  # the text before was free
    assert opened >= 2


def test_a_grammar_start_is_checked_and_needs_no_consumed_tokens() -> None:
    from hybridserve.sampling.grammar import GrammarError, GrammarMatcher

    with pytest.raises(InvalidRequestError, match="start_after"):
        StructuredOutputsParams(regex="a", start_after="")
    m = GrammarMatcher(None, vocab_size=10)  # type: ignore[arg-type]  # (closed: the matcher is not read)
    m.start_after([3, 4])
    assert not m.opened and not m.is_terminated() and not m.is_accepting()
    assert m.gate_end([1, 3]) is None
    m.accept([1, 3])
    assert m.gate_end([4, 5]) == 0 and m.gate_end([5, 3, 4]) == 2 and m.gate_end([5]) is None
    m.accept([4])
    assert m.opened and m.num_accepted == 3
    late = GrammarMatcher(None, vocab_size=10)  # type: ignore[arg-type]
    late.num_accepted = 1
    with pytest.raises(GrammarError):
        late.start_after([3])


# ------------------------------------------------------------------------- schema and grammar forms


def _matcher(so: StructuredOutputsParams, llm: LLM):  # noqa: ANN202
    import llguidance

    tok = llm.engine.grammars.tokenizer()
    return tok, llguidance.LLMatcher(tok, so.to_grammar(), log_level=0)


def _takes(so: StructuredOutputsParams, llm: LLM, text: str) -> bool:
    tok, m = _matcher(so, llm)
    assert not m.get_error(), m.get_error()
    return bool(m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting())


def test_schema_forms_vllm_and_pydantic_write_compile_as_expected(llm: LLM) -> None:
    """A string `format` the grammar library does not check (pydantic's Path, SecretStr; OpenAPI's
    uri-reference) leaves the string free instead of refusing the schema (a property named
    "format" is a property); `disable_additional_properties` (OpenAI's strict) closes objects
    that do not say otherwise; `disable_any_whitespace` writes JSON without spaces."""
    from hybridserve.sampling.structured_outputs import prepared_schema

    schema = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "format": "path"},
            "when": {"type": "string", "format": "date"},
            "format": {"type": "string", "format": "uri-reference"},
        },
        "required": ["path"],
    }
    prepared = prepared_schema(schema)
    assert prepared["properties"]["when"]["format"] == "date" and "format" in prepared["properties"]
    assert "format" not in prepared["properties"]["path"] and "format" not in prepared["properties"]["format"]
    loose = StructuredOutputsParams(json=schema)
    assert _takes(loose, llm, '{"path": "data/x", "other": 1}')
    strict = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    assert _takes(strict, llm, '{"path": "data/x"}') and not _takes(
        strict, llm, '{"path": "data/x", "other": 1}'
    )
    compact = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}},
                                      disable_any_whitespace=True)  # fmt: skip
    assert _takes(compact, llm, '{"a":1}') and not _takes(compact, llm, '{"a": 1}')
    assert loose.cache_key != strict.cache_key


def test_integer_bounds_past_two_to_the_53_keep_outputs_in_range(llm: LLM) -> None:
    """The grammar library reads bounds as doubles: 2**53 + 1 was rounded to 2**53, out of the
    range, and the output ended "stop". Bounds are rounded into their range instead, and a range
    with no double in it is refused."""
    big = 2**53
    for kind in ("integer", ["integer", "null"]):
        for lo, hi in (("minimum", "maximum"), ("exclusiveMinimum", "exclusiveMaximum")):
            shift = 0 if lo == "minimum" else 1
            so = StructuredOutputsParams(json={"type": kind, lo: big + 1 - shift, hi: big + 3 + shift})
            assert _takes(so, llm, str(big + 2)), (kind, lo)
            assert not _takes(so, llm, str(big)) and not _takes(so, llm, str(big + 4)), (kind, lo)
    with pytest.raises(InvalidRequestError, match="Unsatisfiable"):
        llm.generate(
            "Hi",
            SamplingParams(
                max_tokens=30,
                structured_outputs={"json": {"type": "integer", "minimum": big + 1, "maximum": big + 1}},
            ),
        )


def test_integer_bounds_past_64_bits_bound_nothing_or_are_refused(llm: LLM) -> None:
    """The grammar's integers are 64-bit and it saturated a bound past them: minimum 1e20 allowed
    2**63 - 1, ending "stop". A bound on the far side bounds nothing; one on the near side is
    refused, naming it."""
    so = StructuredOutputsParams(json={"type": "integer", "minimum": -1e30, "maximum": 2**70})
    assert _takes(so, llm, "-5") and _takes(so, llm, str(2**63 - 1))
    # an exclusive bound at an end of the range still excludes that end
    from hybridserve.sampling.structured_outputs import prepared_schema

    assert "exclusiveMinimum" in prepared_schema({"type": "integer", "exclusiveMinimum": float(-(2**63))})
    assert "minimum" not in prepared_schema({"type": "integer", "minimum": float(-(2**63))})
    for schema in (
        {"type": "integer", "minimum": 1e20, "maximum": 1e20},
        {"type": ["integer", "null"], "exclusiveMinimum": 2**64},
        {"type": "integer", "maximum": -1e19},
    ):
        with pytest.raises(InvalidRequestError, match="leaves no 64-bit integer"):
            StructuredOutputsParams(json=schema).to_grammar()


def test_keywords_that_constrain_nothing_are_taken(llm: LLM) -> None:
    """`uniqueItems: false` and `minContains` / `maxContains` without `contains` (schema
    generators write them) constrain nothing: taken, not refused as unimplemented."""
    so = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": False,
                                       "minContains": 2, "maxItems": 3})  # fmt: skip
    assert _takes(so, llm, "[1, 1]") and not _takes(so, llm, "[1, 2, 3, 4]")


def test_gbnf_unicode_escapes_stand_for_their_characters(llm: LLM) -> None:
    """`\\u` / `\\U` escapes with leading zeros: the converter dropped the zeros ("\\u004100",
    "A00", became one CJK character, and "\\u00e9" was refused)."""
    for grammar, text, other in (
        ('root ::= "\\u004100"', "A00", "\u4100"),
        ("root ::= [\\u0041-\\u0043]{2}", "BC", "BD"),
        ('root ::= "caf\\u00e9 \\U0001F600"', "café 😀", "cafe 😀"),
        ('root ::= "\\u0022" [\\u005d]', '"]', '"-'),
        ('root ::= "\\\\u0041"', "\\u0041", "A"),
    ):
        so = StructuredOutputsParams(grammar=grammar)
        assert _takes(so, llm, text) and not _takes(so, llm, other), grammar


def test_regex_classes_are_ascii_and_lark_grammars_may_start_with_a_question_mark(llm: LLM) -> None:
    digits = StructuredOutputsParams(regex=r"\d{3}")
    assert _takes(digits, llm, "123") and not _takes(digits, llm, "١٢٣")
    spaced = StructuredOutputsParams(regex=r"a\sb")
    assert _takes(spaced, llm, "a b") and not _takes(spaced, llm, "a\u2009b")
    # vLLM's documented SQL example: a Lark grammar whose rules inline (`?start:`)
    sql = StructuredOutputsParams(
        grammar='?start: "SELECT " column " FROM " table\n?column: "a" | "b"\n?table: "t"'
    )
    assert _takes(sql, llm, "SELECT a FROM t")
    gbnf = StructuredOutputsParams(grammar='root ::= "yes" | "no"')
    assert _takes(gbnf, llm, "yes") and not _takes(gbnf, llm, "maybe")


def test_every_eos_of_the_model_ends_a_grammar_where_its_eos_may(tmp_path) -> None:  # noqa: ANN001
    """A model whose turn ends on an EOS other than the primary one (a list in
    generation_config.json): where the grammar allows EOS, that one ends the output too."""
    from pathlib import Path

    from hybridserve.model.demo import resolve_model_path

    demo = Path(resolve_model_path("demo"))
    for f in demo.iterdir():
        if f.name not in ("config.json", "generation_config.json"):
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((demo / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128)
    params = SamplingParams(
        max_tokens=12, temperature=0, logit_bias={2: 30.0}, structured_outputs={"regex": "a+"}
    )
    (out,) = llm.generate("Say a:", params)
    assert out.outputs[0].text == "a" and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == 2
    # a request that ignores EOS: the other EOS is no EOS to its grammar, which allows it nowhere
    (past,) = llm.generate("Say a:", dataclasses.replace(params, ignore_eos=True))
    assert past.outputs[0].text == "a" * 12 and past.outputs[0].finish_reason == "length"
