"""Multi-step simulation of the scheduler through the Python wrapper, playing runner and model.

The fake runner consumes a SchedulerOutput exactly as the real one must (state copies in order
before the forward; decode rows write the state after token t to state_write_slots[r, t]; prefill
rows write emits and the final state to state_write_slots[r, 0]; K/V to slot_mapping). States and
K/V are fingerprints of the token prefix, so every row checks that its initial state and the KV of
its computed prefix are exactly those of its accepted tokens. The fake model is greedy and depends
only on the prefix, so each request has one true output whatever the caching, chunking,
speculation or preemption.
"""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve import _core as core

B, M = 4, 8
VOCAB = 40
MASK = (1 << 61) - 1


def roll(h: int, t: int) -> int:
    return ((h ^ (t + 0x9E37)) * 0x100000001B3 + 7) & MASK


def next_tok(h: int) -> int:
    return (((h * 0x2545F4914F6CDD1D) & MASK) >> 17) % VOCAB + 1


def prefix_hashes(tokens: list[int]) -> list[int]:
    hs = [1]
    for t in tokens:
        hs.append(roll(hs[-1], t))
    return hs


def greedy(prompt: list[int], max_tokens: int, eos: int | None, max_len: int) -> list[int]:
    h = prefix_hashes(prompt)[-1]
    out: list[int] = []
    while len(out) < max_tokens and len(prompt) + len(out) < max_len:
        t = next_tok(h)
        out.append(t)
        h = roll(h, t)
        if t == eos:
            break
    return out


class FakeRunner:
    def __init__(self, s: core.Scheduler, k: int, seed: int) -> None:
        self.s = s
        self.k = k
        self.rng = random.Random(seed)
        self.kv: dict[int, int] = {}
        self.slots: dict[int, tuple[int, int]] = {}
        self.seq: dict[str, list[int]] = {}
        self.drafts: dict[str, list[int]] = {}
        self.out: dict[str, list[int]] = {}
        self.reason: dict[str, str] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int, eos: int | None) -> None:
        self.s.add_request(rid, prompt, max_tokens=max_tokens, eos_token_id=eos)
        self.seq[rid] = list(prompt)
        self.out[rid] = []

    def step(self) -> int:
        o = self.s.schedule()
        if o.num_rows == 0:
            self.s.update_from_output(o, np.zeros(0, np.int32), np.zeros(0, np.int32))
            return 0
        for src, dst in o.state_copies.tolist():
            self.slots[dst] = self.slots[src]
        qsl, nc_arr = o.query_start_loc.tolist(), o.num_computed_tokens.tolist()
        ids, pos, sm = o.input_ids.tolist(), o.positions.tolist(), o.slot_mapping.tolist()
        bt, ws = o.block_table, o.state_write_slots.tolist()
        read, init = o.state_read_slot.tolist(), o.has_initial_state.tolist()
        nl, nd_sched = o.num_logits.tolist(), o.num_draft_tokens.tolist()
        emits: dict[int, list[tuple[int, int]]] = {}
        for r, t, slot in zip(o.emit_row.tolist(), o.emit_token.tolist(), o.emit_slot.tolist()):
            emits.setdefault(r, []).append((t, slot))
        sampled: list[int] = []
        ns: list[int] = []
        drafts: list[int] = []
        nd: list[int] = []
        for r, rid in enumerate(o.req_ids):
            seq = self.seq[rid]
            ph = prefix_hashes(seq)
            nc = nc_arr[r]
            decode = r < o.num_decodes
            for q in range(nc):
                assert self.kv[int(bt[r, q // B]) * B + q % B] == ph[q + 1], (rid, q)
            if init[r]:
                assert self.slots[read[r]] == (ph[nc], nc), (rid, nc)
                h = ph[nc]
            else:
                assert nc == 0
                h = 1
            for t in range(qsl[r + 1] - qsl[r]):
                i = qsl[r] + t
                assert pos[i] == nc + t
                if not decode or t == 0:
                    assert ids[i] == seq[nc + t]
                else:
                    assert ids[i] == self.drafts[rid][t - 1]
                h = roll(h, ids[i])
                self.kv[sm[i]] = h
                if decode:
                    self.slots[ws[r][t]] = (h, nc + t + 1)
                for et, slot in emits.get(r, []):
                    if et == t:
                        assert (nc + t + 1) % M == 0
                        self.slots[slot] = (h, nc + t + 1)
            if not decode:
                self.slots[ws[r][0]] = (h, qsl[r + 1] - qsl[r] + nc)
            toks: list[int] = []
            if decode:
                assert nl[r] == 1 + nd_sched[r]
                hh = ph[nc + 1]
                for j in range(nd_sched[r] + 1):
                    y = next_tok(hh)
                    toks.append(y)
                    if j < nd_sched[r] and self.drafts[rid][j] == y:
                        hh = roll(hh, y)
                    else:
                        break
            elif nl[r] == 1:
                toks.append(next_tok(h))
            ns.append(len(toks))
            sampled += toks
            # drafts for the next step: right for a while, then wrong
            hh = ph[-1]
            for t in toks:
                hh = roll(hh, t)
            d = []
            good = True
            for _ in range(self.rng.randint(0, self.k)):
                y = next_tok(hh)
                good = good and self.rng.random() < 0.7
                t = y if good else y % VOCAB + 1
                d.append(t)
                hh = roll(hh, t)
            self.drafts[rid] = d
            drafts += d
            nd.append(len(d))
        deltas = self.s.update_from_output(
            o,
            np.array(sampled, np.int32),
            np.array(ns, np.int32),
            np.array(drafts, np.int32),
            np.array(nd, np.int32),
        )
        for dl in deltas:
            self.out[dl.request_id] += dl.new_token_ids
            self.seq[dl.request_id] += dl.new_token_ids
            if dl.finished:
                self.reason[dl.request_id] = dl.finish_reason
        return o.num_rows


def run_workload(mode: str, k: int, blocks: int, seed: int, n: int, abort_p: float) -> FakeRunner:
    s = core.Scheduler(core.ResolvedConfig.for_tests(mode, k), blocks, 160)
    fr = FakeRunner(s, k, seed)
    rng = random.Random(seed)
    shared = [[rng.randint(1, VOCAB) for _ in range(8 + 11 * j)] for j in range(3)]
    prompts = {}
    pending = []
    for i in range(n):
        p = rng.choice(shared) + [rng.randint(1, VOCAB) for _ in range(rng.randint(1, 30))]
        pending.append((rng.randint(0, 2 * n), f"r{i}", p, rng.randint(1, 25), rng.choice([None, 5])))
    pending.sort()
    t = 0
    aborted = set()
    while pending or s.has_unfinished_requests():
        while pending and pending[0][0] <= t:
            _, rid, p, mt, eos = pending.pop(0)
            fr.add(rid, p, mt, eos)
            prompts[rid] = (p, mt, eos)
        if abort_p and rng.random() < abort_p:
            live = sorted(r for r in prompts if r not in fr.reason and r not in aborted)
            if live:
                rid = rng.choice(live)
                assert s.abort_request(rid)
                aborted.add(rid)
        fr.step()
        t += 1
        assert t < 5000, "no termination"
    for rid, (p, mt, eos) in prompts.items():
        exp = greedy(p, mt, eos, 4096)
        if rid in aborted:
            assert exp[: len(fr.out[rid])] == fr.out[rid]
        else:
            assert fr.out[rid] == exp, rid
    stats = s.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["mamba_slots_used"] == stats["checkpoints_committed"] + stats["checkpoints_pending"]
    return fr


def test_simulation_every_mode_with_spec_and_preemption() -> None:
    for mode in ("none", "align", "all"):
        for k in (0, 2):
            fr = run_workload(mode, k, blocks=48, seed=3, n=20, abort_p=0.0)
            st_ = fr.s.stats()
            assert st_["num_preemptions_total"] > 0
            if mode != "none":
                assert st_["prefix_hit_tokens"] > 0
            if k:
                assert st_["spec_accepted_tokens"] > 0


@settings(max_examples=25, deadline=None)
@given(
    mode=st.sampled_from(["none", "align", "all"]),
    k=st.integers(0, 3),
    blocks=st.integers(40, 120),
    seed=st.integers(0, 10_000),
    n=st.integers(1, 12),
    abort_p=st.sampled_from([0.0, 0.1]),
)
def test_random_workloads(mode: str, k: int, blocks: int, seed: int, n: int, abort_p: float) -> None:
    run_workload(mode, k, blocks, seed, n, abort_p)
