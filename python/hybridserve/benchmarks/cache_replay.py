"""Trace replay of the prefix cache: the engine's real Rust scheduler and cache, driven by a
request trace (`traces.py`), with the model's outputs faked. No model runs: a cell of trace x
policy x memory budget replays in seconds, so placement and eviction policies can be compared on
traffic shaped like real workloads.

The fake model answers each request with exactly the trace's `output` tokens (greedy
verification of speculative drafts against them, so n-gram speculation behaves as with a model
that produces those tokens). Follow-up turns arrive `think_time` after the turn they follow has
finished, with their prompt built from that turn's prompt and output. Time is simulated: a step
takes `STEP_OVERHEAD_S` plus its FLOPs (the model shape's prefill cost model, `model/flops.py`) at
`ACCELERATOR_FLOPS`; only the ratio of TTFTs between policies means anything.

Per cell it reports the token hit rate (prefix-cache hit tokens at each request's first admission
over its prompt tokens), the prefill FLOPs the hits saved, checkpoint memory (mean and peak), hits
by where their state came from, evictions by cause, and the modelled TTFT.

Policies (`POLICIES`), each the engine's own code under a configuration:
- `grid-lru`: Mamba checkpoints every 256 tokens (mode `all`; in mode `align` at chunk ends),
  LRU: the grid baseline, with no checkpoint placed where prompts share;
- `vllm-like`: mode `align` with a checkpoint grid as large as vLLM's hybrid block for the model
  (vLLM pads an attention page to one Mamba layer's state page: `16 * ceil(state bytes of a layer /
  (16 * KV bytes of a token in a layer))` tokens, 1040 for Nemotron-H-8B, and its prefix hits come
  in those blocks; here KV blocks stay 16 tokens, which changes no hit length since every hit ends
  on the grid), a prefill chunk cut at the deepest grid point of a shared prefix, LRU refreshing
  whole paths;
- `sglang-like`: branch points and last tokens, LRU refreshing whole paths (a radix cache's LRU);
- `branch-lru`: branch points, declared shared prefixes and last tokens, LRU (the eviction the
  FLOP-aware one is held against);
- `hybridserve`: the engine's defaults: branch points, declared shared prefixes (each prompt up to
  its first END_OF_TURN, the generated traces' end of a message: where a system message ends) and
  last tokens, in mode `all` also grid points in spare room, FLOP-aware eviction;
- `oracle`: infinite memory, the state kept at every block boundary (what any placement could
  hit at best, at block granularity).

Memory budgets are multiples of the running windows' state slots (`max_num_seqs * (1 + K)`): the
Mamba pool holds `factor` times that, and the KV pool `factor` times the KV of `max_num_seqs`
requests of the trace's mean length.
"""

from __future__ import annotations

import heapq
import math
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridserve import _core
from hybridserve.benchmarks.traces import Trace, chat_template_ids
from hybridserve.engine.shared_prefix import shared_prefix_len
from hybridserve.model.flops import PrefillCost, prefill_cost
from hybridserve.spec_decode.ngram import ngram_lookup

if TYPE_CHECKING:
    from hybridserve._core import CheckpointPlacementName, EvictionPolicyName, MambaCacheModeName

#: The KV block the cost model's block bytes are given for (a policy's own block scales them).
BLOCK_SIZE = 16
#: Fixed cost of one engine step in the time model (scheduling, launch, sampling).
STEP_OVERHEAD_S = 2e-3
#: Throughput of the time model's accelerator (dense FLOP/s actually reached).
ACCELERATOR_FLOPS = 2e14
#: Drafts per step with speculation on (n-gram, prompt lookup of 1..4 tokens).
SPEC_K = 3

#: The shape of NVIDIA's Nemotron-H-8B (its published config.json): 52 layers, 24 Mamba2 (128 heads
#: of 64, state 128, 8 groups), 4 attention (32 query / 8 KV heads of 128), 24 relu^2 MLPs of
#: 21504. The replay's default cost model: a real hybrid's ratio of state bytes to KV bytes.
NEMOTRON_H_8B: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": 131072,
    "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "chunk_size": 128,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 21504,
    "max_position_embeddings": 65536,
}


@dataclass(frozen=True)
class Policy:
    """One configuration of the engine's cache (`mode` None: the engine's default for the
    speculation setting, `all` without and `align` with)."""

    name: str
    #: None: the engine's default for the mode
    placement: CheckpointPlacementName | None
    eviction: EvictionPolicyName
    mamba_block_size: int | None = None
    mode: MambaCacheModeName | None = None
    oracle: bool = False
    flop_weight: float | None = None
    block_size: int = 16
    #: declares each prompt's first message shared (the engine's `--shared-prefix-markers`; the
    #: markers are the cell's)
    declares_shared_prefix: bool = False


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("grid-lru", "grid", "lru", 256),
        # grid: the cost shape's `vllm_block_size`, set at replay time
        Policy("vllm-like", "grid", "lru-path", 0, mode="align"),
        Policy("sglang-like", "branch", "lru-path"),
        Policy("hybridserve", None, "flops", declares_shared_prefix=True),
        Policy("oracle", "branch+grid", "lru", 16, mode="all", oracle=True),
    )
}


@dataclass(frozen=True)
class CostShape:
    """The model numbers the replay needs: bytes of one state slot and one KV block, prefill FLOPs."""

    name: str
    state_bytes: int
    kv_bytes_per_block: int
    prefill: PrefillCost
    #: vLLM's hybrid block for this model: an attention page as large as one Mamba layer's state
    vllm_block_size: int = 528

    @classmethod
    def from_config(cls, name: str, raw: dict[str, Any]) -> CostShape:
        import torch

        from hybridserve.model.architectures import get_architecture
        from hybridserve.model.cache_tensors import kv_bytes_per_block, mamba_bytes_per_slot

        arch = get_architecture(raw["architectures"][0], name)
        cfg = arch.parse_config(raw, name)
        state = mamba_bytes_per_slot(cfg, torch.float32, torch.bfloat16)
        kv = kv_bytes_per_block(cfg, BLOCK_SIZE, torch.bfloat16)
        state_per_layer = state // max(1, cfg.num_mamba_layers)
        kv_per_token_per_layer = max(1, kv // (BLOCK_SIZE * max(1, cfg.num_attention_layers)))
        return cls(
            name=name,
            state_bytes=mamba_bytes_per_slot(cfg, torch.float32),
            kv_bytes_per_block=kv,
            prefill=prefill_cost(cfg),
            vllm_block_size=16 * -(-state_per_layer // (16 * kv_per_token_per_layer)),
        )


def nemotron_h_8b() -> CostShape:
    return CostShape.from_config("nemotron-h-8b", NEMOTRON_H_8B)


def demo_shape() -> CostShape:
    """The demo model's numbers (what `hybridserve serve demo` weighs its checkpoints by)."""
    from hybridserve.config import resolve_model_dir
    from hybridserve.model.model_config import read_config_json

    return CostShape.from_config("demo", read_config_json(f"{resolve_model_dir('demo')}/config.json"))


@dataclass(frozen=True)
class Cell:
    """One replay: a trace under a policy, a memory budget and a speculation setting."""

    policy: Policy
    budget: float  # multiple of the running windows (and of the running KV); ignored by the oracle
    speculation: bool = False
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    #: the row of the experiment this cell belongs to ("auto": the engine's default mode); a
    #: policy with a mode of its own (vllm-like: align) still reports in its row
    row_mode: str = "auto"
    #: exact pool sizes (null block / slot included) instead of the budget's (to mirror a server)
    num_kv_blocks: int | None = None
    num_mamba_slots: int | None = None
    #: the tokens that end a message in the traces (generated ones: their END_OF_TURN)
    shared_prefix_markers: tuple[int, ...] = (chat_template_ids()[0],)


@dataclass
class CellResult:
    trace: str
    policy: str
    budget: float
    speculation: bool
    mode: str
    placement: str
    row_mode: str
    eviction: str
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    prefill_flops: float = 0.0
    flops_saved: float = 0.0
    hits_by_kind: dict[str, int] = field(default_factory=dict)
    hit_tokens_by_kind: dict[str, int] = field(default_factory=dict)
    lost_tokens: int = 0
    checkpoint_bytes_mean: float = 0.0
    checkpoint_bytes_peak: int = 0
    checkpoints_peak: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    peak_running: int = 0
    mamba_slots: int = 0
    kv_blocks: int = 0
    steps: int = 0
    ttft_p50_s: float = 0.0
    ttft_p95_s: float = 0.0
    simulated_s: float = 0.0
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def flops_saved_frac(self) -> float:
        return self.flops_saved / self.prefill_flops if self.prefill_flops else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        d["flops_saved_frac"] = self.flops_saved_frac
        return d


def _pool_sizes(trace: Trace, cell: Cell, k: int) -> tuple[int, int, int]:
    """(KV blocks, Mamba slots, max_model_len), null block and slot included."""
    b = cell.policy.block_size
    lengths = [trace.prompt_len(r.id) + len(r.output) for r in trace.requests]
    max_len = max(lengths) + 1
    window = cell.max_num_seqs * (1 + k)
    one_seq = 1 + math.ceil((max_len + k) / b)
    # Everything ever computed stays: at most every token of every request, in blocks and in
    # states at block boundaries.
    total = sum(math.ceil(n / b) + 1 for n in lengths)
    all_kv, all_slots = 1 + total + cell.max_num_seqs * one_seq, 1 + window + total
    if cell.policy.oracle:
        return all_kv, all_slots, max_len
    mean = sum(lengths) / len(lengths)
    # A budget's pools stop at the oracle's: pools that hold everything never evict, so a larger
    # budget changes nothing, but it allocated gigabytes in the scheduler (--budgets 1000) or
    # overflowed its sizes with a traceback (--budgets 1e300).
    kv = cell.num_kv_blocks or 1 + math.ceil(min(cell.budget * cell.max_num_seqs * mean / b, all_kv - 1))
    slots = cell.num_mamba_slots or 1 + round(min(cell.budget * window, all_slots - 1))
    return max(kv, one_seq), max(slots, 1 + window), max_len


def _config(trace: Trace, cell: Cell) -> tuple[Any, int, int, int]:
    k = SPEC_K if cell.speculation else 0
    kv, slots, max_len = _pool_sizes(trace, cell, k)
    p = cell.policy
    cfg = _core.resolve_policy(
        has_mamba_layers=True,
        supports_boundary_states=True,
        scan_chunk_size=16,
        enable_prefix_caching=True,
        mamba_cache_mode=p.mode or "auto",
        speculative_method="ngram" if k else None,
        num_speculative_tokens=k,
        block_size=p.block_size,
        mamba_block_size=p.mamba_block_size,
        max_num_batched_tokens=cell.max_num_batched_tokens,
        max_num_seqs=cell.max_num_seqs,
        max_model_len=max_len,
        mamba_checkpoint_placement=p.placement,
        prefix_cache_eviction=p.eviction,
    )
    return cfg, kv, slots, k


def replay(trace: Trace, cell: Cell, shape: CostShape | None = None) -> CellResult:
    """Replays `trace` through a fresh scheduler configured by `cell`."""
    shape = shape or nemotron_h_8b()
    if cell.policy.mamba_block_size == 0:  # sized by the model: vllm-like
        cell = replace(cell, policy=replace(cell.policy, mamba_block_size=shape.vllm_block_size))
    cfg, num_kv, num_slots, k = _config(trace, cell)
    sched = _core.Scheduler(cfg, num_kv, num_slots, 0)
    sched.set_cost_model(
        state_bytes=shape.state_bytes,
        kv_bytes_per_block=shape.kv_bytes_per_block * cell.policy.block_size // BLOCK_SIZE,
        flops_per_token=shape.prefill.per_token,
        attn_flops_per_context_token=shape.prefill.attn_per_context_token,
        flop_weight=cell.policy.flop_weight,
    )
    res = CellResult(
        trace=trace.name,
        policy=cell.policy.name,
        budget=cell.budget,
        speculation=cell.speculation,
        mode=str(cfg.mamba_cache_mode),
        row_mode=cell.row_mode,
        placement=str(cfg.checkpoint_placement),
        eviction=str(cfg.eviction),
        mamba_slots=num_slots,
        kv_blocks=num_kv,
    )
    wall0 = time.perf_counter()
    markers = cell.shared_prefix_markers if cell.policy.declares_shared_prefix else ()
    by_id = {r.id: r for r in trace.requests}
    followers: dict[str, list[str]] = {}
    for r in trace.requests:
        if r.after is not None:
            followers.setdefault(r.after, []).append(r.id)
    # (arrival time, order, id): first turns now, follow-ups when their predecessor finishes
    arrivals: list[tuple[float, int, str]] = []
    for i, r in enumerate(trace.requests):
        if r.after is None:
            heapq.heappush(arrivals, (float(r.arrival or 0.0), i, r.id))
    order = {r.id: i for i, r in enumerate(trace.requests)}
    prompts: dict[str, list[int]] = {}
    produced: dict[str, list[int]] = {}
    # prompt + output so far, as 8-byte ids: what the n-gram drafter looks through
    history: dict[str, array[int]] = {}
    arrived: dict[str, float] = {}
    ttfts: list[float] = []
    now = 0.0
    bytes_sum = 0.0
    pending = len(trace.requests)
    while pending > 0:
        while arrivals and arrivals[0][0] <= now:
            _, _, rid = heapq.heappop(arrivals)
            req = by_id[rid]
            prompt = (
                list(req.prompt)
                if req.prompt is not None
                else prompts[req.after] + produced[req.after] + list(req.prompt_append or ())  # type: ignore[index]
            )
            prompts[rid] = prompt
            produced[rid] = []
            if k:
                history[rid] = array("q", prompt)
            arrived[rid] = now
            sched.add_request(
                rid,
                prompt,
                max_tokens=len(req.output),
                ignore_eos=True,
                shared_prefix_len=shared_prefix_len(prompt, markers),
            )
        out = sched.schedule()
        if out.num_rows == 0:
            deltas = sched.update_from_output(out, np.zeros(0, np.int32), np.zeros(0, np.int32))
            if deltas:
                raise RuntimeError(f"replay: a request could not run ({deltas[0].request_id})")
            if not arrivals:
                raise RuntimeError("replay: nothing scheduled and nothing to arrive")
            now = max(now, arrivals[0][0])
            continue
        sampled, num_sampled, step_flops = _fake_model(out, by_id, produced, shape.prefill)
        ids = list(out.req_ids)
        if k:
            flat, nd = [], []
            for rid, ns in zip(ids, num_sampled):
                drafts: list[int] = []
                if ns and rid in produced:
                    h = history[rid]
                    mark = len(h)
                    h.extend(sampled_tokens_of(rid, ids, sampled, num_sampled))
                    drafts = ngram_lookup(np.frombuffer(h, dtype=np.int64), k, 1, 4)
                    del h[mark:]
                flat.extend(drafts)
                nd.append(len(drafts))
            deltas = sched.update_from_output(
                out,
                np.asarray(sampled, np.int32),
                np.asarray(num_sampled, np.int32),
                np.asarray(flat, np.int32),
                np.asarray(nd, np.int32),
            )
        else:
            deltas = sched.update_from_output(
                out, np.asarray(sampled, np.int32), np.asarray(num_sampled, np.int32)
            )
        now += STEP_OVERHEAD_S + step_flops / ACCELERATOR_FLOPS
        res.steps += 1
        st = sched.stats()
        res.peak_running = max(res.peak_running, int(st["num_running"]))
        n_ckpt = int(st["checkpoints_committed"]) + int(st["checkpoints_pending"])
        res.checkpoints_peak = max(res.checkpoints_peak, n_ckpt)
        bytes_sum += n_ckpt * shape.state_bytes
        for d in deltas:
            rid = d.request_id
            if not produced[rid] and d.new_token_ids:
                ttfts.append(now - arrived[rid])
            produced[rid].extend(d.new_token_ids)
            if k:
                history[rid].extend(d.new_token_ids)
            if d.finished:
                pending -= 1
                req = by_id[rid]
                if d.finish_reason != "length" or len(produced[rid]) != len(req.output):
                    raise RuntimeError(f"replay: {rid} ended early ({d.finish_reason})")
                n = len(prompts[rid])
                res.requests += 1
                res.prompt_tokens += n
                res.hit_tokens += d.num_cached_tokens
                res.prefill_flops += shape.prefill.flops(0, n)
                res.flops_saved += shape.prefill.flops(0, d.num_cached_tokens)
                for nxt in followers.get(rid, ()):
                    heapq.heappush(arrivals, (now + by_id[nxt].think_time, order[nxt], nxt))
    st = sched.stats()
    res.hits_by_kind = {kind: int(st[f"prefix_hits_{kind}"]) for kind in _core.CHECKPOINT_KINDS}
    res.hit_tokens_by_kind = {kind: int(st[f"prefix_hit_tokens_{kind}"]) for kind in _core.CHECKPOINT_KINDS}
    res.lost_tokens = int(st["prefix_lost_tokens"])
    res.evictions = {
        "checkpoint": int(st["checkpoint_evictions"]),
        "checkpoint_stale": int(st["checkpoint_evictions_stale"]),
        "checkpoint_for_checkpoint": int(st["checkpoint_evictions_for_checkpoint"]),
        "checkpoint_for_window": int(st["checkpoint_evictions_for_window"]),
        "checkpoint_for_kv": int(st["checkpoint_evictions_for_kv"]),
        "kv": int(st["kv_evictions"]),
        "kv_useless": int(st["kv_evictions_useless"]),
    }
    res.preemptions = int(st["num_preemptions_total"])
    res.checkpoint_bytes_mean = bytes_sum / max(1, res.steps)
    res.checkpoint_bytes_peak = res.checkpoints_peak * shape.state_bytes
    res.ttft_p50_s = _percentile(ttfts, 50)
    res.ttft_p95_s = _percentile(ttfts, 95)
    res.simulated_s = now
    res.wall_s = time.perf_counter() - wall0
    return res


def sampled_tokens_of(
    rid: str, ids: Sequence[str], sampled: Sequence[int], num_sampled: Sequence[int]
) -> list[int]:
    """The tokens row `rid` sampled in this step (the flat `sampled` holds every row's)."""
    off = 0
    for r, n in zip(ids, num_sampled):
        if r == rid:
            return list(sampled[off : off + n])
        off += n
    return []


def _fake_model(
    out: Any, by_id: dict[str, Any], produced: dict[str, list[int]], cost: PrefillCost
) -> tuple[list[int], list[int], float]:
    """The tokens a model that answers with the trace's outputs samples for this step, and the
    step's FLOPs."""
    ids = list(out.req_ids)
    num_logits = np.asarray(out.num_logits)
    num_drafts = np.asarray(out.num_draft_tokens)
    flat_drafts = np.asarray(out.draft_token_ids).tolist()
    qsl = np.asarray(out.query_start_loc).tolist()
    nct = np.asarray(out.num_computed_tokens).tolist()
    sampled: list[int] = []
    num_sampled: list[int] = []
    flops = 0.0
    d_off = 0
    for r, rid in enumerate(ids):
        n = qsl[r + 1] - qsl[r]
        flops += cost.flops(nct[r], nct[r] + n)
        nd = int(num_drafts[r])
        row_drafts = flat_drafts[d_off : d_off + nd]
        d_off += nd
        nl = int(num_logits[r])
        if nl == 0:
            num_sampled.append(0)
            continue
        truth = by_id[rid].output
        at = len(produced[rid])
        accepted = 0
        while accepted < nd and at + accepted < len(truth) and row_drafts[accepted] == truth[at + accepted]:
            accepted += 1
        toks = list(truth[at : at + accepted + 1])
        sampled.extend(toks)
        num_sampled.append(len(toks))
    return sampled, num_sampled, flops


def _percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


# ----------------------------------------------------------------------------- experiments


def run_cells(
    traces: Sequence[Trace],
    cells: Iterable[Cell],
    shape: CostShape | None = None,
    workers: int = 1,
) -> list[CellResult]:
    """Every cell on every trace (in `workers` processes when > 1), in that order."""
    jobs = [(t, c) for t in traces for c in cells]
    shape = shape or nemotron_h_8b()
    # (no more processes than cells: --workers 1000 forked a thousand idle processes)
    workers = min(workers, len(jobs))
    if workers <= 1:
        return [replay(t, c, shape) for t, c in jobs]
    import multiprocessing as mp

    with mp.get_context("fork").Pool(workers) as pool:
        return pool.starmap(replay, [(t, c, shape) for t, c in jobs], chunksize=1)


def with_weight(policy: Policy, w: float) -> Policy:
    return replace(policy, name=f"{policy.name}(w={w:g})", flop_weight=w)


#: The policy the FLOP-aware eviction is held against for FLOPs saved: the same placement, LRU.
POLICIES["branch-lru"] = Policy("branch-lru", "branch", "lru", declares_shared_prefix=True)
#: Marconi's "vLLM+" baseline, for context: a state every 32 tokens, LRU.
POLICIES["per-block-lru"] = Policy("per-block-lru", "grid", "lru", 32)

DEFAULT_POLICIES = ("oracle", "grid-lru", "vllm-like", "sglang-like", "branch-lru", "hybridserve")
#: T3 three times over (36 agentic sessions), so that a small state pool holds fewer sessions than
#: are active: with 12 it holds them all at every budget.
DEFAULT_TRACES = (("T1", 1.0), ("T2", 1.0), ("T3", 3.0), ("T4", 1.0))


@dataclass(frozen=True)
class Experiment:
    """A matrix of replays: every trace x budget x mode x speculation x policy (the oracle once
    per trace and speculation setting: it has no budget and always runs mode `all`)."""

    traces: tuple[Trace, ...]
    budgets: tuple[float, ...] = (10.0, 3.0, 1.5)
    policies: tuple[str, ...] = DEFAULT_POLICIES
    #: None = the engine's default (all without speculation, align with it)
    modes: tuple[MambaCacheModeName | None, ...] = (None,)
    speculation: tuple[bool, ...] = (False,)
    flop_weights: tuple[float, ...] = ()
    max_num_seqs: int = 32

    def cells(self) -> list[Cell]:
        out: list[Cell] = []
        for spec in self.speculation:
            for name in self.policies:
                base = POLICIES[name]
                if base.oracle:
                    out.append(Cell(base, 0.0, spec, self.max_num_seqs, row_mode="oracle"))
                    continue
                variants = [base]
                if name == "hybridserve":
                    variants += [with_weight(base, w) for w in self.flop_weights]
                for budget in self.budgets:
                    for mode in self.modes:
                        for v in variants:
                            # vllm-like is align by definition
                            p = v if mode is None or v.mode is not None else replace(v, mode=mode)
                            out.append(Cell(p, budget, spec, self.max_num_seqs, row_mode=mode or "auto"))
        return out


def run_experiment(exp: Experiment, shape: CostShape | None = None, workers: int = 1) -> list[CellResult]:
    return run_cells(exp.traces, exp.cells(), shape, workers)


def _key(r: CellResult) -> tuple[str, float, str, bool]:
    return (r.trace, r.budget, r.row_mode, r.speculation)


def report(results: Sequence[CellResult]) -> str:
    """The markdown tables of an experiment: hit rates against the oracle, the ratios the design
    is held to, and memory, evictions and hits by kind of the engine's default policy."""
    oracle = {(r.trace, r.speculation): r for r in results if r.policy == "oracle"}
    groups: dict[tuple[str, float, str, bool], dict[str, CellResult]] = {}
    for r in results:
        if r.policy != "oracle":
            groups.setdefault(_key(r), {})[r.policy] = r
    names = sorted({p for g in groups.values() for p in g}, key=_policy_order)
    lines = ["### Token hit rate (share of the infinite-memory oracle's)", ""]
    head = "| trace | budget | mode | spec | oracle | " + " | ".join(names) + " |"
    lines += [head, "|" + "---|" * (5 + len(names))]
    for key in sorted(groups, key=lambda k: (k[0], -k[1], k[2], k[3])):
        trace, budget, mode, spec = key
        o = oracle.get((trace, spec))
        cells = []
        for n in names:
            got = groups[key].get(n)
            if got is None:
                cells.append("")
            elif o is not None and o.hit_rate > 0:
                cells.append(f"{got.hit_rate:.3f} ({100 * got.hit_rate / o.hit_rate:.0f}%)")
            else:
                cells.append(f"{got.hit_rate:.3f}")
        lines.append(
            f"| {_short(trace)} | {budget:g}x | {mode} | {'ngram' if spec else 'off'} | "
            f"{'' if o is None else f'{o.hit_rate:.3f}'} | " + " | ".join(cells) + " |"
        )
    lines += ["", "### Ratios", ""]
    lines += [
        "| trace | budget | mode | spec | hybridserve / sglang-like | hybridserve / vllm-like | "
        "oracle / sglang-like | oracle / vllm-like | FLOPs saved vs branch-lru |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(groups, key=lambda k: (k[0], -k[1], k[2], k[3])):
        g = groups[key]
        new, sg, vl, lru = (g.get(n) for n in ("hybridserve", "sglang-like", "vllm-like", "branch-lru"))
        o = oracle.get((key[0], key[3]))
        if new is None:
            continue

        def ratio(a: CellResult | None, b: CellResult | None) -> str:
            return "" if a is None or b is None or b.hit_rate == 0 else f"{a.hit_rate / b.hit_rate:.2f}x"

        flops = (
            ""
            if lru is None or lru.flops_saved == 0
            else f"{100 * (new.flops_saved / lru.flops_saved - 1):+.1f}%"
        )
        lines.append(
            f"| {_short(key[0])} | {key[1]:g}x | {key[2]} | {'ngram' if key[3] else 'off'} | {ratio(new, sg)} | "
            f"{ratio(new, vl)} | {ratio(o, sg)} | {ratio(o, vl)} | {flops} |"
        )
    lines += ["", "### hybridserve: memory, hits by kind, evictions by cause", ""]
    lines += [
        "| trace | budget | mode | spec | state slots | peak checkpoints | mean / peak checkpoint GiB | "
        "hits grid / branch / last / declared | evictions stale / for ckpt / for window / for KV | KV evictions "
        "(useless) | modelled TTFT p50 / p95 s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    gib = float(1 << 30)
    for key in sorted(groups, key=lambda k: (k[0], -k[1], k[2], k[3])):
        default = groups[key].get("hybridserve")
        if default is None:
            continue
        r = default
        h, e = r.hits_by_kind, r.evictions
        lines.append(
            f"| {_short(key[0])} | {key[1]:g}x | {key[2]} | {'ngram' if key[3] else 'off'} | {r.mamba_slots - 1} | "
            f"{r.checkpoints_peak} | {r.checkpoint_bytes_mean / gib:.1f} / {r.checkpoint_bytes_peak / gib:.1f} | "
            f"{h['grid']} / {h['branch']} / {h['last_token']} / {h['declared']} | {e['checkpoint_stale']} / "
            f"{e['checkpoint_for_checkpoint']} / {e['checkpoint_for_window']} / {e['checkpoint_for_kv']} | "
            f"{e['kv']} ({e['kv_useless']}) | {r.ttft_p50_s:.3f} / {r.ttft_p95_s:.3f} |"
        )
    return "\n".join(lines) + "\n"


def _policy_order(name: str) -> tuple[int, str]:
    base = name.split("(")[0]
    order = list(DEFAULT_POLICIES) + ["per-block-lru"]
    return (order.index(base) if base in order else len(order), name)


def _short(trace_name: str) -> str:
    """'T1:seed=0:scale=1' -> 'T1', 'T3:seed=0:scale=3' -> 'T3 x3'."""
    parts = trace_name.split(":")
    scale = next((p.split("=")[1] for p in parts if p.startswith("scale=")), "1")
    return parts[0] if scale == "1" else f"{parts[0]} x{scale}"


def plot(results: Sequence[CellResult], out_dir: str) -> list[str]:
    """One PNG per speculation setting and mode: hit rate per policy, trace and budget."""
    from hybridserve.benchmarks.plots import _pyplot

    plt = _pyplot()
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    oracle = {(r.trace, r.speculation): r for r in results if r.policy == "oracle"}
    paths: list[str] = []
    for spec in sorted({r.speculation for r in results}):
        for mode in sorted({r.row_mode for r in results if r.policy != "oracle"}):
            rs = [r for r in results if r.speculation == spec and r.row_mode == mode and r.policy != "oracle"]
            if not rs:
                continue
            traces = sorted({r.trace for r in rs})
            budgets = sorted({r.budget for r in rs}, reverse=True)
            policies = sorted({r.policy for r in rs}, key=_policy_order)
            fig, axes = plt.subplots(1, len(traces), figsize=(4.2 * len(traces), 3.6), squeeze=False)
            width = 0.8 / max(1, len(policies))
            for ax, trace in zip(axes[0], traces):
                for j, pol in enumerate(policies):
                    ys = [
                        next(
                            (
                                r.hit_rate
                                for r in rs
                                if r.trace == trace and r.budget == b and r.policy == pol
                            ),
                            0.0,
                        )
                        for b in budgets
                    ]
                    ax.bar([i + j * width for i in range(len(budgets))], ys, width, label=pol)
                o = oracle.get((trace, spec))
                if o is not None:
                    ax.axhline(o.hit_rate, color="black", linestyle="--", linewidth=1, label="oracle")
                ax.set_xticks(
                    [i + 0.4 - width / 2 for i in range(len(budgets))], [f"{b:g}x" for b in budgets]
                )
                ax.set_title(_short(trace))
                ax.set_ylim(0, 1)
                ax.set_xlabel("state pool (x running windows)")
            axes[0][0].set_ylabel("token hit rate")
            axes[0][-1].legend(fontsize=7, loc="lower right")
            fig.suptitle(f"prefix-cache trace replay, mode {mode}, speculation {'ngram' if spec else 'off'}")
            fig.tight_layout()
            path = out / f"cache_trace_{mode}_{'ngram' if spec else 'nospec'}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(str(path))
    return paths
