"""The model runner's persistent batch: a request's slot stays in place across steps, is written
when the request is new or its row object changed, and is freed when it finishes; what a step
gathers from the slots equals what its rows say (`RowParams.of`), whatever happened before."""

from __future__ import annotations

import random

import numpy as np

from hybridserve.engine.llm import LLM
from hybridserve.engine.persistent_batch import PersistentBatch
from hybridserve.sampling.params import SamplingParams
from hybridserve.sampling.row_params import RowParams
from hybridserve.sampling.sampler import RowSampling


def row(rng: random.Random) -> RowSampling:
    params = SamplingParams(
        max_tokens=50,
        temperature=rng.choice([0.0, 0.7, 1.3]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 20]),
        presence_penalty=rng.choice([0.0, 0.0, 0.4]),
    )
    seed = None if rng.random() < 0.2 else rng.randrange(2**63)
    position = rng.randint(0, 9) if rng.random() < 0.1 else None  # (a row naming its position)
    return RowSampling(params, seed=seed, output_token_ids=[1] * rng.randint(0, 4), position=position)


def assert_same(a: RowParams, b: RowParams) -> None:
    for name in a.__dataclass_fields__:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_gathered_settings_equal_the_rows_through_adds_frees_and_changes() -> None:
    rng = random.Random(0)
    batch = PersistentBatch(capacity=2)  # (grows several times)
    live: dict[str, RowSampling] = {}
    ids: list[str] = []
    last, kept = None, 0
    for step in range(600):
        op = rng.random()
        if op < 0.3 or not live:
            live[f"r{step}"] = row(rng)  # a new request
        elif op < 0.45:
            rid = rng.choice(sorted(live))
            del live[rid]
            batch.free(rid)  # finished or aborted
        elif op < 0.5:
            rid = rng.choice(sorted(live))
            live[rid] = row(rng)  # the same id with another row (aborted and added again)
        elif op < 0.6:
            moved = live[rng.choice(sorted(live))]
            moved.output_token_ids.append(7)  # (its position moves on)
            if moved.position is not None:
                moved.position += 1
        if not live:
            continue
        # a step samples some of the live requests (the others preempted or not scheduled), often
        # the same ones as the step before (what the batch keeps its gathered settings for)
        if ids and rng.random() < 0.5 and all(r in live for r in ids):
            ids = list(ids)
        else:
            ids = rng.sample(sorted(live), rng.randint(1, len(live)))
        rows = [live[r] for r in ids]
        slots = batch.slots(ids, rows)
        assert_same(batch.params(slots, rows), RowParams.of(rows))
        assert batch.all_plain_greedy(slots) == bool(RowParams.of(rows).plain_greedy.all())
        kept += slots is last
        last = slots
        assert len(batch) <= len(live) and batch.capacity >= len(batch)
    assert kept > 50  # (steps that reused the previous step's slots were among those checked)
    for rid in list(live):
        batch.free(rid)
    assert len(batch) == 0


def test_a_slot_stays_in_place_and_a_freed_slot_is_reused() -> None:
    batch = PersistentBatch(capacity=4)
    a, b = RowSampling(SamplingParams(temperature=0.5)), RowSampling(SamplingParams(temperature=0.0))
    slot_a, slot_b = batch.slots(["a", "b"], [a, b]).tolist()
    assert batch.slots(["b", "a", "gone"], [b, a, None]).tolist() == [slot_b, slot_a, -1]
    assert not batch.all_plain_greedy(batch.slots(["b", "gone"], [b, None]))
    assert batch.all_plain_greedy(batch.slots(["b"], [b])) and not batch.all_plain_greedy(
        batch.slots(["a"], [a])
    )
    batch.free("a")
    c = RowSampling(SamplingParams(temperature=1.5))
    slots = batch.slots(["c"], [c])
    assert slots.tolist() == [slot_a] and batch.params(slots, [c]).temperature.tolist() == [1.5]
    assert len(batch) == 2
    batch.free("never-seen")  # (nothing to free)
    assert len(batch) == 2


def test_an_engine_run_leaves_no_slot_behind_and_a_reused_id_gets_its_new_settings() -> None:
    llm = LLM("demo", dtype="float32", max_model_len=256)
    engine = llm.engine
    prompts = ["The harbour at dawn", "A bridge of iron and", "Trains run north"]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    want = [
        list(o.outputs[0].token_ids)
        for o in LLM("demo", dtype="float32", max_model_len=256).generate([prompts[0]], [seeded])
    ][0]
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, greedy)
    engine.step()
    engine.step()
    assert len(engine.runner.batch) == 3
    engine.abort_request("q0")  # its slot is freed; the id comes back with other settings
    engine.add_request("q0", prompts[0], seeded)
    got: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "q0" and out.finished:
                got = list(out.outputs[0].token_ids)
    assert got == want
    assert len(engine.runner.batch) == 0
