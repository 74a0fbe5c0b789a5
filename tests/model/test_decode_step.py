"""The native step (model/decode_step.py): a step of decode and prefill rows in one call of the
C++ library, held to the model's own forward on the same caches.

- float64: logits, K / V and Mamba states within 1e-10 of the forward's, and the greedy tokens of
  several steps equal; float32 within 1e-4;
- verify rows (a token with its drafts): the forward's logits and caches, and in float32 each
  token's logits bit-equal to decoding the tokens one at a time; a row's bits do not depend on its
  batch;
- prefill rows (from zeros or a kept state, partial chunks, emitted checkpoints), alone and
  beside decode rows: the forward's logits and caches; in float32 a prompt's bits are the same
  in one step or in chunks;
- the steps it does not take (more tokens than its limit, rows that share a state slot, an emit
  outside its row, logits asked out of order, weights changed in place) return None with
  nothing written;
- bad token or block ids raise ValueError with nothing written;
- Nemotron-H (no MoE), Mamba2 and Bamba (rotary attention, gated MLP) are covered; models it
  does not know (MoE layers, the other families, bfloat16) get no decode step;
- through the engine: greedy outputs identical with it on and off, and a row whose logits are
  not finite fails alone.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from hybridserve.engine.llm import LLM
from hybridserve.kernels import backend, native
from hybridserve.kernels.backend import Backend
from hybridserve.model.batch import ForwardBatch
from hybridserve.model.cache_tensors import ModelCaches
from hybridserve.model.decode_step import DecodeStep
from hybridserve.model.loader import LoadedModel, load_model
from hybridserve.sampling.params import SamplingParams
from model_fixtures import ALL_CONFIGS, Driver, build_hf_model, random_prompts, save_hf_model

torch.set_num_threads(1)

VOCAB = 256
pytestmark = pytest.mark.skipif(native.build() is None, reason="no C++ compiler for the CPU kernels")


@pytest.fixture(autouse=True)
def _native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "_pinned", Backend.CPU_NATIVE)


def _model(tmp_path: Any, name: str, dtype: torch.dtype) -> LoadedModel:
    kind, ov = ALL_CONFIGS[name]
    path = save_hf_model(build_hf_model(kind, ov, vocab_size=VOCAB, seed=7), tmp_path / name)
    return load_model(str(path), dtype)


def _out(batch: ForwardBatch) -> SimpleNamespace:
    """A ForwardBatch as the scheduler's output gives it to the runner (numpy arrays)."""
    arrays = {
        name: np.ascontiguousarray(getattr(batch, name).cpu().numpy())
        for name in (
            "input_ids", "positions", "slot_mapping", "block_table", "state_read_slot",
            "state_write_slots", "query_start_loc", "logits_indices", "has_initial_state", "emit_row",
            "emit_token", "emit_slot",
        )
    }  # fmt: skip
    return SimpleNamespace(num_decodes=batch.num_decodes, **arrays)


def _snapshot(caches: ModelCaches) -> dict[str, dict[int, torch.Tensor]]:
    return {k: {i: t.clone() for i, t in getattr(caches, k).items()} for k in ("kv", "conv", "ssm")}


def _assert_caches(a: ModelCaches | dict, b: ModelCaches | dict, tol: float) -> None:
    for k in ("kv", "conv", "ssm"):
        da = a[k] if isinstance(a, dict) else getattr(a, k)
        db = b[k] if isinstance(b, dict) else getattr(b, k)
        assert da.keys() == db.keys()
        for i in da:
            torch.testing.assert_close(da[i], db[i], rtol=tol, atol=tol, msg=f"{k}[{i}]")


def _two_drivers(lm: LoadedModel, prompts: list[list[int]]) -> tuple[Driver, Driver, list, list]:
    """Two drivers whose requests have run the same prefill (the same forward: equal caches)."""
    drivers, reqs = [], []
    for _ in range(2):
        drv = Driver(lm, max_seq=64, max_reqs=len(prompts), window=4)
        rs = [drv._new_req(i, p, 0, None, 0) for i, p in enumerate(prompts)]
        logits = drv.step([(r, r.tokens, False) for r in rs])
        for r, row in zip(rs, logits):
            r.tokens.append(int(row.argmax()))
            r.prompt_len = len(r.tokens)
        drivers.append(drv)
        reqs.append(rs)
    _assert_caches(drivers[0].caches, drivers[1].caches, 0.0)
    return drivers[0], drivers[1], reqs[0], reqs[1]


def _two_steps(
    lm: LoadedModel, prompts: list[list[int]]
) -> tuple[Driver, Driver, list, list, DecodeStep, DecodeStep]:
    """`_two_drivers` and a native decode step over each driver's caches."""
    a, b, a_reqs, b_reqs = _two_drivers(lm, prompts)
    a_step, b_step = DecodeStep.for_model(lm.model, a.caches), DecodeStep.for_model(lm.model, b.caches)
    assert a_step is not None and b_step is not None
    return a, b, a_reqs, b_reqs, a_step, b_step


# the configs of the families it runs (Nemotron-H without MoE, Mamba2, Bamba with its rotary
# attention and gated MLP)
SUPPORTED = ["nh_g1", "m2_g2", "bamba_g1", "bamba_g2"]


@pytest.mark.parametrize("name", SUPPORTED)
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-4)], ids=["f64", "f32"]
)
def test_decode_steps_match_the_forward(tmp_path: Any, name: str, dtype: torch.dtype, tol: float) -> None:
    lm = _model(tmp_path, name, dtype)
    prompts = random_prompts(3, VOCAB, [9, 14, 5], seed=1)
    ref, mine, ref_reqs, my_reqs = _two_drivers(lm, prompts)
    step = DecodeStep.for_model(lm.model, mine.caches)
    assert step is not None
    for _ in range(6):
        ref_rows = [(r, [r.tokens[-1]], True) for r in ref_reqs]
        my_rows = [(r, [r.tokens[-1]], True) for r in my_reqs]
        want = ref.step(ref_rows)
        got = step.run(_out(mine.batch(my_rows)))
        assert got is not None
        mine.advance(my_rows)
        assert got.logits.dtype == dtype and got.logits.shape == want.shape
        torch.testing.assert_close(got.logits, want, rtol=tol, atol=tol)
        assert got.finite.all()
        assert got.greedy.tolist() == want.argmax(dim=-1).tolist()
        _assert_caches(mine.caches, ref.caches, tol)
        for r, m, t in zip(ref_reqs, my_reqs, got.greedy.tolist()):
            r.tokens.append(int(t))
            m.tokens.append(int(t))


def _prefill_and_mixed_steps(drv: Driver, prompts: list[list[int]]) -> list[tuple[list, list]]:
    """The rows and emits of three steps over fresh requests: (1) a whole prompt (no initial
    state) and the first chunk of a second one, which emits a checkpoint; (2) the first one's
    decode row, the second prompt's last chunk (from its state) with an emit, and a third
    prompt's first token alone; (3) three decode rows."""
    a, b, c = (drv._new_req(i, p, 0, None, 0) for i, p in enumerate(prompts))
    return [
        ([(a, a.tokens, False), (b, b.tokens[:6], False)], [(1, 2, b.window[2])]),
        ([(a, None, True), (b, b.tokens[6:], False), (c, c.tokens[:1], False)], [(1, 4, b.window[3])]),
        ([(a, None, True), (b, None, True)], []),
    ]


@pytest.mark.parametrize("name", SUPPORTED)
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-4)], ids=["f64", "f32"]
)
def test_prefill_and_mixed_steps_match_the_forward(
    tmp_path: Any, name: str, dtype: torch.dtype, tol: float
) -> None:
    """Prefill rows (from zeros and from a kept state, a whole prompt, a partial chunk with no
    logits, a one-token chunk) and emitted checkpoints, alone and beside decode rows: the logits
    asked and every cache (K / V, windows, states, the emitted slots) as the forward's."""
    lm = _model(tmp_path, name, dtype)
    prompts = random_prompts(3, VOCAB, [9, 14, 5], seed=2)
    ref = Driver(lm, max_seq=64, max_reqs=3, window=4)
    mine = Driver(lm, max_seq=64, max_reqs=3, window=4)
    step = DecodeStep.for_model(lm.model, mine.caches)
    assert step is not None
    ref_plan, my_plan = _prefill_and_mixed_steps(ref, prompts), _prefill_and_mixed_steps(mine, prompts)
    for (ref_rows, emits), (my_rows, _) in zip(ref_plan, my_plan):
        # a decode row's token is the one its request sampled last
        ref_rows = [(r, [r.tokens[-1]] if t is None else t, d) for r, t, d in ref_rows]
        my_rows = [(r, [r.tokens[-1]] if t is None else t, d) for r, t, d in my_rows]
        want = ref.step(ref_rows, emits)
        out = _out(mine.batch(my_rows, emits))
        got = step.run(out)
        assert got is not None
        mine.advance(my_rows)
        assert got.logits.shape == want.shape == (len(out.logits_indices), VOCAB)
        torch.testing.assert_close(got.logits, want, rtol=tol, atol=tol)
        assert got.greedy.tolist() == want.argmax(dim=-1).tolist()
        _assert_caches(mine.caches, ref.caches, tol)
        # each row that computed logits samples its argmax (a prompt done, or a decode row)
        k = 0
        for (r, _t, d), (m, _, _) in zip(ref_rows, my_rows):
            if d or r.num_computed == r.prompt_len:
                r.tokens.append(int(got.greedy[k]))
                m.tokens.append(int(got.greedy[k]))
                k += 1


def test_a_prompt_gets_the_same_bits_in_one_step_or_in_chunks(tmp_path: Any) -> None:
    """float32: a prompt's states, K / V and last logits are bit-equal whether its prefill runs in
    one native step or chunk by chunk beside another request's rows (each token's arithmetic is
    its own)."""
    lm = _model(tmp_path, "nh_g1", torch.float32)
    prompt, other = random_prompts(2, VOCAB, [23, 6], seed=5)
    whole = Driver(lm, max_seq=64, max_reqs=2, window=4)
    split = Driver(lm, max_seq=64, max_reqs=2, window=4)
    results = []
    for drv, chunks in ((whole, [23]), (split, [5, 1, 9, 8])):
        step = DecodeStep.for_model(lm.model, drv.caches)
        assert step is not None
        req = drv._new_req(0, prompt, 0, chunks, 0)
        side = drv._new_req(1, other, 0, None, 0)
        got = None
        for i, n in enumerate(chunks):
            at = req.num_computed
            rows = [(req, req.tokens[at : at + n], False)]
            if drv is split and i == 1:
                rows.append((side, side.tokens, False))  # another request's prompt beside it
            got = step.run(_out(drv.batch(rows)))
            assert got is not None
            drv.advance(rows)
        assert got is not None
        results.append(got.logits[0].clone())
    torch.testing.assert_close(results[0], results[1], rtol=0.0, atol=0.0)
    for k in ("kv", "conv", "ssm"):
        for i, t in getattr(whole.caches, k).items():
            mine = getattr(split.caches, k)[i]
            if k == "kv":  # the first request's blocks (the other request's are its own)
                t, mine = t[1 : 1 + whole.nb], mine[1 : 1 + split.nb]
            else:
                t, mine = t[1 : 1 + whole.W], mine[1 : 1 + split.W]
            torch.testing.assert_close(t, mine, rtol=0.0, atol=0.0, msg=f"{k}[{i}]")


def test_steps_it_does_not_take_write_nothing(tmp_path: Any) -> None:
    lm = _model(tmp_path, "nh_g1", torch.float64)
    prompts = random_prompts(3, VOCAB, [9, 14, 5], seed=2)
    _, drv, _, reqs = _two_drivers(lm, prompts)
    step = DecodeStep.for_model(lm.model, drv.caches, max_tokens=2)
    assert step is not None
    before = _snapshot(drv.caches)
    a, b, c = reqs
    fresh = drv._new_req(3, random_prompts(1, VOCAB, [6], seed=3)[0], 0, None, 0)
    cases = {
        "a prefill row over max_tokens": [(fresh, fresh.tokens, False)],
        "more tokens than max_tokens": [(r, [r.tokens[-1]], True) for r in reqs],
        "a verify row over max_tokens": [(a, [a.tokens[-1], 5, 6], True)],
    }
    for what, rows in cases.items():
        assert step.run(_out(drv.batch(rows))) is None, what
        _assert_caches(drv.caches, before, 0.0)
    # on a driver of its own (the request's blocks and slots in range): a prefill row whose emit
    # lies past its tokens, or that writes one slot after two of its tokens (the prefill kernel
    # refuses both); logits asked out of order
    own = Driver(lm, max_seq=64, max_reqs=2, window=4)
    p, q = (own._new_req(i, fresh.tokens, 0, None, 0) for i in range(2))
    wide = DecodeStep.for_model(lm.model, own.caches, max_tokens=64)
    assert wide is not None
    mine = _snapshot(own.caches)
    past = _out(own.batch([(p, p.tokens, False)], emits=[(0, 2, p.window[2])]))
    past.emit_token[0] = len(p.tokens)
    twice = _out(own.batch([(p, p.tokens, False)], emits=[(0, 2, p.window[0])]))
    unordered = _out(own.batch([(p, p.tokens, False), (q, q.tokens, False)]))
    unordered.logits_indices = np.ascontiguousarray(unordered.logits_indices[::-1])
    for what, out in {"emit past the row": past, "one slot twice": twice, "unordered": unordered}.items():
        assert wide.run(out) is None, what
        _assert_caches(own.caches, mine, 0.0)
    # prefill rows over the work limit: refused, while a step of decode rows is still taken
    work = len(p.tokens) * wide.macs_per_token + 21 * wide.macs_per_pair  # 6 tokens: 21 pairs
    assert wide.macs_per_pair > 0 and wide.macs_per_token > 0
    bounded = DecodeStep.for_model(lm.model, own.caches, max_tokens=64, max_prefill_macs=work - 1)
    assert bounded is not None and bounded.run(_out(own.batch([(p, p.tokens, False)]))) is None
    _assert_caches(own.caches, mine, 0.0)
    exact = DecodeStep.for_model(lm.model, own.caches, max_tokens=64, max_prefill_macs=work)
    assert exact is not None and exact.run(_out(own.batch([(p, p.tokens, False)]))) is not None
    own.advance([(p, p.tokens, False)])
    assert bounded.run(_out(own.batch([(p, [p.tokens[-1]], True)]))) is not None
    # a row reading the slot another row writes: the per-op path orders those
    out = _out(drv.batch([(a, [a.tokens[-1]], True), (b, [b.tokens[-1]], True)]))
    out.state_read_slot[1] = out.state_write_slots[0, 0]
    assert step.run(out) is None
    _assert_caches(drv.caches, before, 0.0)
    # arrays that are not a step's layout (a block table short of a row): the forward reports it
    out = _out(drv.batch([(a, [a.tokens[-1]], True), (b, [b.tokens[-1]], True)]))
    out.block_table = np.ascontiguousarray(out.block_table[:1])
    assert step.run(out) is None
    _assert_caches(drv.caches, before, 0.0)
    # weights changed in place since the records were built: the forward must read them
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(2.0)
    assert step.run(_out(drv.batch([(a, [a.tokens[-1]], True)]))) is None
    _assert_caches(drv.caches, before, 0.0)
    again = DecodeStep.for_model(lm.model, drv.caches)
    assert again is not None and again.run(_out(drv.batch([(a, [a.tokens[-1]], True)]))) is not None


@pytest.mark.parametrize("entry", ["run", "launch"])
@pytest.mark.parametrize("field", ["input_ids", "block_table", "slot_mapping", "state_read_slot"])
def test_out_of_range_ids_are_refused_before_any_write(tmp_path: Any, field: str, entry: str) -> None:
    lm = _model(tmp_path, "nh_g1", torch.float64)
    _, drv, _, reqs = _two_drivers(lm, random_prompts(2, VOCAB, [9, 7], seed=4))
    step = DecodeStep.for_model(lm.model, drv.caches)
    assert step is not None
    before = _snapshot(drv.caches)
    out = _out(drv.batch([(r, [r.tokens[-1]], True) for r in reqs]))
    arr = getattr(out, field)
    arr[(-1, 0) if arr.ndim == 2 else -1] = 10**9  # the last row's first block, or its id / slot
    with pytest.raises(ValueError, match="decode_step"):
        getattr(step, entry)(out)  # (launch: refused by the checks before anything is posted)
    assert step.wait_fn() == -1  # nothing is out on the background thread
    _assert_caches(drv.caches, before, 0.0)


def test_output_arrays_are_lent_to_one_step_at_a_time(tmp_path: Any) -> None:
    """A step writes its outputs into arrays its caller gives back (`recycle`) once read: the next
    step reuses them, and gets the values of a step into fresh arrays; arrays not given back, or
    given back twice, are never lent to two steps at once."""
    lm = _model(tmp_path, "nh_g1", torch.float64)
    prompts = random_prompts(2, VOCAB, [9, 7], seed=12)
    one, two, one_reqs, two_reqs, reused, fresh = _two_steps(lm, prompts)
    bases = []
    for _ in range(3):
        one_rows = [(r, [r.tokens[-1]], True) for r in one_reqs]
        two_rows = [(r, [r.tokens[-1]], True) for r in two_reqs]
        got = reused.run(_out(one.batch(one_rows)))
        want = fresh.run(_out(two.batch(two_rows)))
        assert got is not None and want is not None
        assert torch.equal(got.logits, want.logits) and got.greedy.tolist() == want.greedy.tolist()
        bases.append(got.greedy.base)
        reused.recycle(got)
        reused.recycle(got)  # a second time: still one buffer
        one.advance(one_rows)
        two.advance(two_rows)
        for a, b, t in zip(one_reqs, two_reqs, want.greedy.tolist()):
            a.tokens.append(int(t))
            b.tokens.append(int(t))
    assert bases[0] is not None and all(b is bases[0] for b in bases)
    rows = [(r, [r.tokens[-1]], True) for r in one_reqs]
    first = reused.run(_out(one.batch(rows)))  # kept, not given back
    assert first is not None
    kept = first.logits.clone()
    second = reused.run(_out(one.batch(rows)))  # (the same rows again: other logits)
    assert second is not None and not torch.equal(second.logits, kept)
    assert first.greedy.base is not second.greedy.base
    assert torch.equal(first.logits, kept)  # not written by the second step


def test_non_finite_logits_are_flagged_per_row(tmp_path: Any) -> None:
    lm = _model(tmp_path, "nh_g1", torch.float64)
    _, drv, _, reqs = _two_drivers(lm, random_prompts(2, VOCAB, [9, 7], seed=6))
    with torch.no_grad():  # a huge embedding row: that token's row overflows, the other stays finite
        lm.model.stack().token_embedding.weight[reqs[1].tokens[-1]] = float("inf")
    step = DecodeStep.for_model(lm.model, drv.caches)
    assert step is not None
    got = step.run(_out(drv.batch([(r, [r.tokens[-1]], True) for r in reqs])))
    assert got is not None
    assert got.finite.tolist() == [True, False] or reqs[0].tokens[-1] == reqs[1].tokens[-1]


UNSUPPORTED = [
    "nh_g2_moe",
    *[n for n, (k, _) in ALL_CONFIGS.items() if k not in ("nemotron_h", "bamba", "mamba2")],
]


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_models_it_does_not_know_get_none(tmp_path: Any, name: str) -> None:
    lm = _model(tmp_path, name, torch.float32)
    caches = ModelCaches.for_model(lm.config, lm.dtype, 8, 8, 4)
    assert DecodeStep.for_model(lm.model, caches) is None


def test_bfloat16_gets_none(tmp_path: Any) -> None:
    lm = _model(tmp_path, "nh_g1", torch.bfloat16)
    caches = ModelCaches.for_model(lm.config, lm.dtype, 8, 8, 4)
    assert DecodeStep.for_model(lm.model, caches) is None


def _generate(monkeypatch: pytest.MonkeyPatch, on: bool, **engine: Any) -> list[list[int]]:
    monkeypatch.setenv("HYBRIDSERVE_DECODE_STEP", "1" if on else "0")
    llm = LLM("demo", dtype="float64", cpu_threads=1, max_model_len=512, **engine)
    assert (llm.engine.runner.decode_step is not None) == on
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, 700, [40, 90, 17, 64, 33], seed=8)]
    params = [SamplingParams(max_tokens=24 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(5)]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    "engine",
    [
        {},
        {
            "enable_prefix_caching": True,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
        },
    ],
    ids=["plain", "prefix-cache+ngram"],
)
def test_engine_outputs_are_the_same_with_and_without_it(
    monkeypatch: pytest.MonkeyPatch, engine: dict
) -> None:
    assert _generate(monkeypatch, True, **engine) == _generate(monkeypatch, False, **engine)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "random"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "overlapped"])
def test_a_row_with_non_finite_logits_fails_alone(
    monkeypatch: pytest.MonkeyPatch, overlapped: bool, temperature: float
) -> None:
    # random rows go through the sampler, which takes the step's finiteness flags as they are
    llm = LLM("demo", dtype="float32", cpu_threads=1, max_model_len=512, async_scheduling=overlapped)
    step = llm.engine.runner.decode_step
    assert step is not None
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 700, [20, 30, 25], seed=9)]
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=5, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    calls = {"n": 0}

    def poison(got: Any) -> Any:
        calls["n"] += 1
        if got is not None and calls["n"] == 3 and len(got.finite) == 3:
            got.finite[1] = False  # the second row's logits "overflowed"
        return got

    # the step runs in the caller (run) or on the background thread (posted by launch, or as a
    # step planned ahead; then waited for)
    real_run, real_post = step.run, step.post
    monkeypatch.setattr(step, "run", lambda out: poison(real_run(out)))

    def post(call: Any) -> Any:
        pending = real_post(call)
        if pending is not None:
            real_wait = pending.wait
            pending.wait = lambda: poison(real_wait())  # type: ignore[method-assign]
        return pending

    monkeypatch.setattr(step, "post", post)
    outs = llm.generate(prompts, params)
    assert calls["n"] >= 3
    assert outs[1].outputs[0].finish_reason == "error" and "not finite" in (outs[1].error or "")
    assert [list(outs[i].outputs[0].token_ids) for i in (0, 2)] == [want[0], want[2]]
    assert llm.engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("name", ["nh_g1", "bamba_g2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_a_row_gets_the_same_bits_alone_or_in_a_batch(tmp_path: Any, dtype: torch.dtype, name: str) -> None:
    # 6 rows: a group of 4 (the 4-row tiles of the projections) and 2 left over (the one-row path)
    lm = _model(tmp_path, name, dtype)
    prompts = random_prompts(6, VOCAB, [9, 14, 5, 11, 8, 20], seed=10)
    together, alone, t_reqs, a_reqs, t_step, a_step = _two_steps(lm, prompts)
    for _ in range(3):
        rows = [(r, [r.tokens[-1]], True) for r in t_reqs]
        batched = t_step.run(_out(together.batch(rows)))
        assert batched is not None
        together.advance(rows)
        for i, r in enumerate(a_reqs):
            row = [(r, [r.tokens[-1]], True)]
            single = a_step.run(_out(alone.batch(row)))
            assert single is not None
            alone.advance(row)
            assert torch.equal(single.logits[0], batched.logits[i]), i
        _assert_caches(together.caches, alone.caches, 0.0)
        for r, s, t in zip(t_reqs, a_reqs, batched.greedy.tolist()):
            r.tokens.append(int(t))
            s.tokens.append(int(t))


@pytest.mark.parametrize("name", SUPPORTED)
def test_verify_rows_match_the_forward(tmp_path: Any, name: str) -> None:
    lm = _model(tmp_path, name, torch.float64)
    prompts = random_prompts(3, VOCAB, [9, 14, 5], seed=11)
    ref, mine, ref_reqs, my_reqs = _two_drivers(lm, prompts)
    step = DecodeStep.for_model(lm.model, mine.caches)
    assert step is not None
    drafts = [[7, 8], [], [9, 10, 11]]  # rows of 3, 1 and 4 tokens
    ref_rows = [(r, [r.tokens[-1], *d], True) for r, d in zip(ref_reqs, drafts)]
    my_rows = [(r, [r.tokens[-1], *d], True) for r, d in zip(my_reqs, drafts)]
    want = ref.step(ref_rows)
    got = step.run(_out(mine.batch(my_rows)))
    assert got is not None and got.logits.shape == want.shape == (8, VOCAB)
    torch.testing.assert_close(got.logits, want, rtol=1e-10, atol=1e-10)
    _assert_caches(mine.caches, ref.caches, 1e-10)


def test_a_verified_token_gets_its_decode_bits(tmp_path: Any) -> None:
    lm = _model(tmp_path, "nh_g1", torch.float32)
    prompts = random_prompts(2, VOCAB, [12, 7], seed=12)
    verify, decode, v_reqs, d_reqs, v_step, d_step = _two_steps(lm, prompts)
    tails = [[v_reqs[0].tokens[-1], 21, 22, 23], [v_reqs[1].tokens[-1], 31, 32]]
    rows = [(r, t, True) for r, t in zip(v_reqs, tails)]
    verified = v_step.run(_out(verify.batch(rows)))
    assert verified is not None
    starts = [0, len(tails[0])]
    for i in range(max(len(t) for t in tails)):
        live = [(r, t) for r, t in zip(d_reqs, tails) if i < len(t)]
        one = [(r, [t[i]], True) for r, t in live]
        decoded = d_step.run(_out(decode.batch(one)))
        assert decoded is not None
        decode.advance(one)
        for k, (r, _) in enumerate(live):
            row = d_reqs.index(r)
            assert torch.equal(decoded.logits[k], verified.logits[starts[row] + i]), (row, i)
    # K / V of every position are the same bits (the states sit in other window slots)
    for i in verify.caches.kv:
        assert torch.equal(verify.caches.kv[i], decode.caches.kv[i])


def test_threads_split_the_projections_without_changing_a_bit(tmp_path: Any) -> None:
    # wide enough that a projection of 4 rows is split over 2 threads (kMinMacsPerThread)
    kind, ov = ALL_CONFIGS["nh_g1"]
    wide = {**ov, "hidden_size": 256, "mamba_num_heads": 16, "mamba_head_dim": 32, "intermediate_size": 1024}
    path = save_hf_model(build_hf_model(kind, wide, vocab_size=VOCAB, seed=13), tmp_path / "wide")
    lm = load_model(str(path), torch.float32)
    prompts = random_prompts(4, VOCAB, [9, 14, 5, 11], seed=14)
    one, two, one_reqs, two_reqs, step_one, step_two = _two_steps(lm, prompts)
    try:
        for _ in range(3):
            rows_one = [(r, [r.tokens[-1]], True) for r in one_reqs]
            rows_two = [(r, [r.tokens[-1]], True) for r in two_reqs]
            torch.set_num_threads(1)
            a = step_one.run(_out(one.batch(rows_one)))
            torch.set_num_threads(2)
            b = step_two.run(_out(two.batch(rows_two)))
            assert a is not None and b is not None
            one.advance(rows_one)
            two.advance(rows_two)
            assert torch.equal(a.logits, b.logits)
            _assert_caches(one.caches, two.caches, 0.0)
            for r, s, t in zip(one_reqs, two_reqs, a.greedy.tolist()):
                r.tokens.append(int(t))
                s.tokens.append(int(t))
    finally:
        torch.set_num_threads(1)


def test_a_step_on_the_background_thread_gets_the_bits_of_one_run_here(tmp_path: Any) -> None:
    lm = _model(tmp_path, "bamba_g2", torch.float32)
    prompts = random_prompts(3, VOCAB, [9, 14, 5], seed=4)
    here, there, here_reqs, there_reqs, step_here, step_there = _two_steps(lm, prompts)
    assert step_there.wait_fn() == -1  # nothing is out
    for _ in range(4):
        here_rows = [(r, [r.tokens[-1]], True) for r in here_reqs]
        there_rows = [(r, [r.tokens[-1]], True) for r in there_reqs]
        out_there = _out(there.batch(there_rows))
        pending = step_there.launch(out_there)
        assert pending is not None
        # one step at a time runs there: another is not posted, and runs in the caller
        out_here = _out(here.batch(here_rows))
        assert step_here.launch(out_here) is None
        want = step_here.run(out_here)
        got = pending.wait()
        assert want is not None
        assert torch.equal(got.logits, want.logits) and got.greedy.tolist() == want.greedy.tolist()
        with pytest.raises(RuntimeError, match="twice"):
            pending.wait()
        here.advance(here_rows)
        there.advance(there_rows)
        _assert_caches(here.caches, there.caches, 0.0)
        for a, b, t in zip(here_reqs, there_reqs, want.greedy.tolist()):
            a.tokens.append(int(t))
            b.tokens.append(int(t))
