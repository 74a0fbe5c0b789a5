"""The engine at tensor-parallel size 2 (this process is rank 0, one spawned gloo worker), in
float64: the greedy outputs of the TP 1 engine, token for token, in cache modes none / align / all
with and without n-gram speculation (the family matrix of tests/family_engine.py on a tiny Bamba
checkpoint), and on the demo model with prefix hits, draft-model speculation and preemption;
seeded random sampling at TP 2 gives the TP 2 reference bit for bit with caching, speculation and
preemption. Flags that do not fit the model are refused naming --tensor-parallel-size."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import family_engine
from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineArgs
from hybridserve.config.plan import plan_engine
from hybridserve.errors import ConfigError
from hybridserve.model.demo import ensure_demo_model
from model_fixtures import BAMBA_CONFIGS, build_hf_model, save_hf_model

TP = 2


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny Bamba checkpoint (8 Mamba heads in 2 groups, 6 query / 2 KV heads) whose LM head
    leans to its embeddings, and its TP 1 reference outputs."""
    root = tmp_path_factory.mktemp("tp_engine")
    src = save_hf_model(build_hf_model("bamba", BAMBA_CONFIGS["bamba_g2"]), root / "src")
    return family_engine.echo_model(src, root / "echo", 1.0)


@pytest.mark.parametrize(
    ("mode", "spec"), [("none", None), ("align", None), ("all", None), ("align", 3), ("all", 3)]
)
def test_cache_modes_and_ngram_speculation_at_tp2_give_the_tp1_outputs(
    engine_model, mode: str, spec: int | None
) -> None:
    family_engine.check_lossless(engine_model, mode, spec, tensor_parallel_size=TP)


SEEDED_TOKENS = 16
# tests/engine/test_engine_seeded_lossless.py's rows (temperature, top-k / top-p / min-p,
# penalties, a greedy row), every sampled row seeded
_BASE: dict = dict(max_tokens=SEEDED_TOKENS, ignore_eos=True)
SEEDED = [
    SamplingParams(temperature=0.7, top_k=20, seed=11, **_BASE),
    SamplingParams(temperature=1.0, top_p=0.9, seed=12, repetition_penalty=1.2, **_BASE),
    SamplingParams(temperature=0.0, **_BASE),  # greedy on the repetitive prompt: drafts accepted
    SamplingParams(temperature=0.8, min_p=0.05, seed=13, **_BASE),
    SamplingParams(
        temperature=0.3, seed=16, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=3, **_BASE
    ),
]


def _seeded_run(model: Path, mode: str, **kw: object) -> tuple[list[tuple[int, ...]], dict, list[int]]:
    """The outputs, stats and cached tokens of the prompts, run twice on one engine when it caches
    (the second pass with prefix hits) and once otherwise."""
    llm = family_engine.make_llm(model, mode, tensor_parallel_size=TP, **kw)
    batch = [{"prompt_token_ids": p} for p in family_engine.prompts()]
    try:
        runs = [llm.generate(batch, SEEDED) for _ in range(1 if mode == "none" else 2)]
    finally:
        llm.engine.stop_workers()  # type: ignore[attr-defined]
    got = [tuple(o.outputs[0].token_ids) for o in runs[0]]
    assert all([tuple(o.outputs[0].token_ids) for o in r] == got for r in runs)
    return got, llm.engine.stats(), [o.num_cached_tokens for o in runs[-1]]


@pytest.fixture(scope="module")
def seeded_reference(engine_model) -> list[tuple[int, ...]]:  # type: ignore[no-untyped-def]
    """TP 2, one request at a time, whole prompts in one step, no caching, no speculation."""
    ref, _, _ = _seeded_run(engine_model[0], "none", max_num_batched_tokens=512, max_num_seqs=1)
    assert all(len(r) == SEEDED_TOKENS for r in ref)
    greedy = engine_model[1]  # TP 1, greedy, 12 tokens
    assert sum(r[: len(g)] != g for r, g in zip(ref, greedy)) >= 3  # the rows are sampled, not argmax
    return ref


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.parametrize(
    ("mode", "kw"),
    [
        # mode none, n-gram speculation, batched rows and chunked prefills
        ("none", dict(speculative_config=NGRAM, max_num_batched_tokens=24)),
        # mode align, no speculation: prefix hits on the second pass
        ("align", dict(max_num_batched_tokens=24)),
        # mode all, n-gram speculation and preemption: 16 KV blocks of 8 tokens for 4 sequences of
        # up to 73 tokens
        ("all", dict(speculative_config=NGRAM, max_num_batched_tokens=32, num_kv_blocks=16, max_model_len=96)),
    ],
)  # fmt: skip
def test_seeded_sampling_at_tp2_is_lossless_with_caching_speculation_and_preemption(
    engine_model, seeded_reference: list[tuple[int, ...]], mode: str, kw: dict
) -> None:
    """Seeded sampling at a fixed TP size (2): each axis of the losslessness matrix once (cache
    mode none / align / all, n-gram speculation on in none and all and off in align, a forced
    preemption in all) gives the TP 2 reference outputs bit for bit (twice on the same engine in
    align and all, the second time with prefix hits)."""
    got, stats, hits = _seeded_run(engine_model[0], mode, **kw)
    assert got == seeded_reference
    if mode != "none":
        assert sum(hits) > 0
    if "speculative_config" in kw:
        assert stats["spec_decode_accepted_tokens"] > 0
    if "num_kv_blocks" in kw:
        assert stats["num_preemptions_total"] > 0


def _demo_run(tp: int, **kw: object) -> tuple[list[tuple[int, ...]], dict]:
    prompts = [[(7 * i + j) % 150 + 3 for j in range(40 + 9 * i)] for i in range(4)]
    prompts.append(prompts[1][:37] + [5, 6, 7])  # a prefix hit on prompt 1
    llm = LLM(
        "demo", dtype="float64", seed=0, block_size=16, max_model_len=128, max_num_batched_tokens=64,
        tensor_parallel_size=tp, **kw,
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        runs = []
        for _ in range(2):  # the second run hits the states the first one left
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            runs.append([tuple(o.outputs[0].token_ids) for o in outs])
        assert runs[0] == runs[1]
        return runs[0], llm.engine.stats()
    finally:
        executor = llm.engine.runner.executor  # type: ignore[attr-defined]
        pids = [] if executor is None else executor.pids
        assert len(pids) == tp - 1
        llm.engine.stop_workers()  # type: ignore[attr-defined]
        # no worker is left behind (each is reaped: no zombie either)
        assert not [p for p in pids if Path(f"/proc/{p}").exists()]


def test_demo_model_with_draft_speculation_and_preemption_at_tp2() -> None:
    ref, _ = _demo_run(1, enable_prefix_caching=False, mamba_cache_mode="none")
    demo = str(ensure_demo_model())
    spec = {"method": "draft_model", "model": demo, "num_speculative_tokens": 3}
    # 16 KV blocks of 16 tokens for five sequences of up to 77 tokens: preemption
    out, stats = _demo_run(
        TP,
        mamba_cache_mode="all",
        enable_prefix_caching=True,
        mamba_block_size=64,
        speculative_config=spec,
        num_kv_blocks=16,
    )
    assert out == ref
    assert stats["num_preemptions_total"] > 0
    assert stats["spec_decode_accepted_tokens"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0


def test_a_narrow_kv_cache_at_tp2_gives_the_tp1_numbers(engine_model) -> None:  # type: ignore[no-untyped-def]
    """--kv-cache-dtype fp8 reaches the worker: TP 2 gives TP 1's tokens and logprobs (to float64
    rounding) with prefix hits, where a worker keeping its heads' keys unrounded would move the
    logprobs by the narrow cache's rounding."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    batch = [{"prompt_token_ids": p} for p in family_engine.prompts()]

    def numbers(tp: int, kv: str) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
        llm = family_engine.make_llm(engine_model[0], "all", tensor_parallel_size=tp, kv_cache_dtype=kv)
        try:
            llm.generate(batch, params)
            outs = llm.generate(batch, params)  # (the second pass hits the first one's checkpoints)
            assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0
        finally:
            if tp > 1:
                llm.engine.stop_workers()  # type: ignore[attr-defined]
        return [
            (tuple(c.token_ids), tuple(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])))
            for c in (o.outputs[0] for o in outs)
        ]

    one, two, exact = numbers(1, "fp8"), numbers(TP, "fp8"), numbers(1, "auto")
    gap = max(abs(a - b) for (_, x), (_, y) in zip(one, exact, strict=True) for a, b in zip(x, y))
    assert gap > 1e-6  # (the rounding is visible in the logprobs)
    for (tokens, lps), (ref_tokens, ref_lps) in zip(two, one, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-9


def test_sizes_the_model_does_not_allow_are_refused_naming_the_flag(tmp_path: Path) -> None:
    demo = str(ensure_demo_model())
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3: .*Mamba heads \(8\)"):
        plan_engine(EngineArgs(model=demo, tensor_parallel_size=3), demo)
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size must be an integer in \[1, 1024\]"):
        EngineArgs(model=demo, tensor_parallel_size=0).validate()
    # per-rank pools: at TP 2 a rank's KV block and state slot hold half the bytes, so the same
    # budget gives about twice the blocks and slots
    one = plan_engine(EngineArgs(model=demo, cache_memory=1 << 26, max_model_len=256), demo).sizes
    two = plan_engine(
        EngineArgs(model=demo, cache_memory=1 << 26, max_model_len=256, tensor_parallel_size=TP), demo
    ).sizes
    assert two.kv_bytes_per_block * 2 == one.kv_bytes_per_block
    assert two.mamba_bytes_per_slot * 2 == one.mamba_bytes_per_slot
    decisions = plan_engine(EngineArgs(model=demo, tensor_parallel_size=4), demo).resolved.decisions
    tp = [d.message for d in decisions if d.code == "tensor_parallel"]
    assert tp and "2 of 8 Mamba heads" in tp[0] and "1 of 2 KV heads (replicated)" in tp[0]


def test_a_process_that_exits_without_shutting_the_engine_down_ends_its_workers_quietly() -> None:
    """`hybridserve generate` (like any script done with its `LLM`) exits without calling
    `LLMEngine.shutdown`: the workers are ended at exit, and not reported as dead on the way."""
    proc = subprocess.run(
        [sys.executable, "-m", "hybridserve", "generate", "demo", "-tp", str(TP), "--cpu-threads", "1",
         "--prompt", "The morning was", "--max-tokens", "4"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The morning was") and len(proc.stdout) > len("The morning was\n")
    assert "exited with status" not in proc.stderr and "the engine stops" not in proc.stderr, proc.stderr


def test_a_start_that_fails_after_the_workers_started_ends_them() -> None:
    """The engine's set-up failing once its workers run (here its KV-events port is taken) ends
    them and leaves the process group: the next engine of the process starts (it was refused, the
    process already in a group, its worker left running)."""
    import socket

    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match="--kv-events-config: cannot open endpoint"):
            LLM(
                "demo", tensor_parallel_size=TP, cpu_threads=1, max_model_len=128,
                kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"},
            )  # fmt: skip
    finally:
        taken.close()
    llm = LLM("demo", tensor_parallel_size=TP, cpu_threads=1, max_model_len=128)
    try:
        (out,) = llm.generate("The morning was", SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out.outputs[0].token_ids) == 3
    finally:
        llm.engine.stop_workers()  # type: ignore[attr-defined]


JOIN_FAILS = """
import os
import hybridserve.distributed.parallel_state as ps

_join = ps.init_tp_group


def _failing_join(rank, *args, **kwargs):
    if rank == 3:  # (module level: the spawned workers import this script too)
        raise RuntimeError("no route to the group")
    return _join(rank, *args, **kwargs)


ps.init_tp_group = _failing_join

if __name__ == "__main__":
    from hybridserve import LLM
    from hybridserve.errors import ConfigError

    try:
        LLM("demo", tensor_parallel_size=4, cpu_threads=1, max_model_len=128)
    except ConfigError as e:
        print("refused:", e)
"""


def test_a_worker_that_fails_to_join_the_group_fails_the_start_with_its_error(tmp_path: Path) -> None:
    """Rank 0's join waits for every rank and then times out naming no cause, and so do the
    other workers (their store timeouts come first): the start's error is the failed worker's."""
    ensure_demo_model()
    script = tmp_path / "join_fails.py"
    script.write_text(JOIN_FAILS)
    env = {**os.environ, "HYBRIDSERVE_TP_TIMEOUT_S": "3"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert (
        "refused: --tensor-parallel-size: worker rank 3 failed to start: RuntimeError: no route to the group"
        in (proc.stdout)
    ), proc.stdout + proc.stderr[-3000:]


def test_an_llm_let_go_of_ends_its_workers_and_the_next_one_starts() -> None:
    """vLLM scripts drop an `LLM` (`del llm`) and make the next one: its workers end with it and
    the process leaves the group (a process still in a group refuses the next one)."""
    import gc

    params = SamplingParams(max_tokens=3, temperature=0.0)
    llm = LLM("demo", tensor_parallel_size=TP, cpu_threads=1, max_model_len=128)
    (first,) = llm.generate("The morning was", params)
    procs = list(llm.engine.runner.executor._procs)  # type: ignore[attr-defined]
    del llm
    gc.collect()
    for p in procs:
        p.join(10)
        assert not p.is_alive()
    llm = LLM("demo", tensor_parallel_size=TP, cpu_threads=1, max_model_len=128)
    try:
        (again,) = llm.generate("The morning was", params)
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        llm.engine.stop_workers()  # type: ignore[attr-defined]
