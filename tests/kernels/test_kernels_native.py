"""The C++ CPU kernels (kernels/native.py) against plain float64 loops, and the engine with them
on and off."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from hybridserve.kernels import native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(
    not native.enabled(), reason="HYBRIDSERVE_NATIVE_CPU=0 turns the native kernels off"
)


def test_the_library_builds_here():
    # CI runs on a machine with g++: the kernels must not silently fall back to torch there
    assert native.library() is not None


def attention_ref(q, kv, block_table, qsl, positions, scale):
    """Token by token, key by key, in float64."""
    T, H, D = q.shape
    bs, KVH = kv.shape[2], kv.shape[3]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for r in range(len(qsl) - 1):
        for t in range(int(qsl[r]), int(qsl[r + 1])):
            n = int(positions[t]) + 1
            for h in range(H):
                g = h // (H // KVH)
                scores = []
                for j in range(n):
                    b, o = int(block_table[r, j // bs]), j % bs
                    scores.append(scale * float(q[t, h].double() @ kv[b, 0, o, g].double()))
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                z = sum(w)
                for j in range(n):
                    b, o = int(block_table[r, j // bs]), j % bs
                    out[t, h] += (w[j] / z) * kv[b, 1, o, g].double()
    return out


def make_case(row_tokens, contexts, H, KVH, D, bs, dtype, seed=0):
    """Rows with row_tokens[r] query tokens whose last one sits at position contexts[r] - 1,
    blocks scattered over a pool bigger than needed."""
    g = torch.Generator().manual_seed(seed)
    R = len(row_tokens)
    max_blocks = max((c + bs - 1) // bs for c in contexts) + 1
    num_blocks = R * max_blocks + 3
    kv = torch.randn(num_blocks, 2, bs, KVH, D, generator=g, dtype=torch.float64).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)[: R * max_blocks]
    block_table = perm.view(R, max_blocks).clone()
    qsl = torch.tensor([0, *torch.tensor(row_tokens).cumsum(0).tolist()], dtype=torch.int64)
    positions = torch.cat(
        [torch.arange(c - n, c, dtype=torch.int64) for n, c in zip(row_tokens, contexts, strict=True)]
    )
    q = torch.randn(int(qsl[-1]), H, D, generator=g, dtype=torch.float64).to(dtype)
    return q, kv, block_table, qsl, positions


@pytest.mark.parametrize(
    "H, KVH, D, bs",
    [(4, 2, 32, 16), (4, 4, 64, 8), (6, 2, 24, 5), (8, 1, 128, 16), (3, 3, 7, 4)],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_paged_attention_matches_loops(H, KVH, D, bs, dtype):
    # decode rows (1 token), verify rows (1 + k tokens), a row of one key, one crossing blocks
    row_tokens = [1, 4, 1, 3, 1]
    contexts = [1, 37, 2 * bs, 9, 3 * bs + 1]
    q, kv, bt, qsl, pos = make_case(row_tokens, contexts, H, KVH, D, bs, dtype)
    scale = D**-0.5
    out = native.paged_attention(q, kv, bt, qsl, pos, scale)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    ref = attention_ref(q, kv, bt, qsl, pos, scale)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_a_token_gets_the_same_output_alone_and_among_drafts():
    # a verify row's first token is exactly what a decode of that token alone computes
    q, kv, bt, qsl, pos = make_case([4], [50], 4, 2, 32, 16, torch.float32)
    together = native.paged_attention(q, kv, bt, qsl, pos, 0.2)
    for i in range(4):
        alone = native.paged_attention(q[i : i + 1], kv, bt, qsl.new_tensor([0, 1]), pos[i : i + 1], 0.2)
        assert torch.equal(alone[0], together[i])


# requests of 20 to 65 tokens, batched by the engine tests of the attention kernel below
ATTENTION_PROMPTS = [
    {"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(20 + 9 * i)]} for i in range(6)
]


def _count_kernel_calls(monkeypatch) -> list[bool]:
    """Wraps the attention kernel: each call appends whether the kernel ran (not declined)."""
    calls: list[bool] = []
    real = native.paged_attention

    def counting(*a, **kw):
        res = real(*a, **kw)
        calls.append(res is not None)
        return res

    monkeypatch.setattr(native, "paged_attention", counting)
    return calls


def test_the_engine_attention_layer_uses_it_and_agrees_with_sdpa(monkeypatch):
    from hybridserve.engine.llm import LLM
    from hybridserve.sampling.params import SamplingParams

    prompts = ATTENTION_PROMPTS
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM("demo", dtype="float64", max_num_seqs=8)
    calls = _count_kernel_calls(monkeypatch)
    with_native = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls and all(calls)
    monkeypatch.setattr(native, "paged_attention", lambda *a, **kw: None)  # the SDPA path
    with_sdpa = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert with_native == with_sdpa


@pytest.mark.parametrize(
    "what", ["block out of range", "negative block", "negative position", "table too short"]
)
def test_bad_tables_are_refused_before_reading(what):
    q, kv, bt, qsl, pos = make_case([1, 2], [20, 30], 4, 2, 32, 16, torch.float32)
    if what == "block out of range":
        bt[1, 1] = kv.shape[0]
    elif what == "negative block":
        bt[0, 0] = -1
    elif what == "negative position":
        pos[1] = -1
    else:
        bt = bt[:, :1].contiguous()  # row 1 needs 2 blocks
    with pytest.raises(ValueError, match="out of bounds"):
        native.paged_attention(q, kv, bt, qsl, pos, 0.1)


def test_a_table_of_no_blocks_and_no_query_heads_do_not_crash():
    """A block table with no columns is refused before anything is read (the kernel read its
    first entry through a null pointer), and q with no heads is declined (it divided by zero)."""
    q, kv, bt, qsl, pos = make_case([1], [5], 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="out of bounds"):
        native.paged_attention(q, kv, torch.zeros((1, 0), dtype=torch.int64), qsl, pos, 0.1)
    assert native.paged_attention(q[:, :0], kv, bt, qsl, pos, 0.1) is None


def test_shapes_that_do_not_fit_are_refused_or_declined():
    q, kv, bt, qsl, pos = make_case([1, 1], [5, 6], 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="qsl ends at"):
        native.paged_attention(q[:1], kv, bt, qsl, pos, 0.1)
    with pytest.raises(ValueError, match="rows but a block table"):
        native.paged_attention(q, kv, bt[:1], qsl, pos, 0.1)
    # not its dtype or layout: None, and the caller keeps its torch path
    assert native.paged_attention(q.half(), kv.half(), bt, qsl, pos, 0.1) is None
    assert native.paged_attention(q, kv.double(), bt, qsl, pos, 0.1) is None
    assert native.paged_attention(q[:, :3], kv, bt, qsl, pos, 0.1) is None  # H not a multiple of KVH


def test_no_compiler_means_the_torch_path(tmp_path):
    code = (
        "import logging; logging.basicConfig()\n"
        "from hybridserve.kernels import native\n"
        "assert native.library() is None\n"
        "print('fallback ok')\n"
    )
    env = {**os.environ, "CXX": "/bin/false", "HYBRIDSERVE_CACHE": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "fallback ok" in res.stdout and "native CPU kernels unavailable" in res.stderr
    # and a build in a fresh cache folder works and is reused
    env["CXX"] = "g++"
    code_ok = "from hybridserve.kernels import native\nassert native.library() is not None\n"
    for _ in range(2):
        res = subprocess.run(
            [sys.executable, "-c", code_ok], env=env, capture_output=True, text=True, timeout=300
        )
        assert res.returncode == 0, res.stderr
    assert len(list((tmp_path / "cpu_kernels").glob("*/libhybridserve_cpu.so"))) == 1


# ------------------------------------------------------------------------------------------------
# Mamba decode: conv update + state update
# ------------------------------------------------------------------------------------------------


def mamba_case(lengths, H, P, G, N, W, dtype, bias=True, slots=64, seed=0, write_cols=None):
    g = torch.Generator().manual_seed(seed)
    d_inner, conv_dim = H * P, H * P + 2 * G * N
    n, R = sum(lengths), len(lengths)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    # xbc and dt are column slices of one projection, as in the mixer
    proj = rnd(n, d_inner + conv_dim + H)
    case = dict(
        xbc=proj[:, d_inner : d_inner + conv_dim],
        dt=proj[:, d_inner + conv_dim :],
        conv_weight=rnd(conv_dim, W, scale=0.5),
        conv_bias=rnd(conv_dim) if bias else None,
        conv_state=rnd(slots, conv_dim, W - 1),
        A=-torch.rand(H, generator=g, dtype=torch.float64).to(dtype) * 4,
        D=rnd(H),
        dt_bias=rnd(H),
        ssm_state=rnd(slots, H, P, N),
        query_start_loc=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
    )
    perm = torch.randperm(slots - 1, generator=g) + 1
    wmax = write_cols or max(lengths)
    case["read_slot"] = perm[:R].clone()
    case["write_slots"] = perm[R : R + R * wmax].view(R, wmax).clone()
    return case


def run_reference(c, G, silu=True, dt_min=0.0, dt_max=math.inf):
    from hybridserve.kernels import reference as K

    H, P, N = c["ssm_state"].shape[1:]
    conv_out = K.causal_conv1d_update(
        c["xbc"], c["conv_weight"], c["conv_bias"], c["conv_state"], c["query_start_loc"], c["read_slot"],
        c["write_slots"], "silu" if silu else None,
    )  # fmt: skip
    x, B, C = conv_out.split([H * P, G * N, G * N], dim=-1)
    return K.selective_state_update(
        x.reshape(-1, H, P), c["dt"], c["A"], B.reshape(-1, G, N), C.reshape(-1, G, N), c["D"], c["dt_bias"],
        c["ssm_state"], c["query_start_loc"], c["read_slot"], c["write_slots"], dt_min, dt_max,
    )  # fmt: skip


def run_native(c, G, silu=True, dt_min=0.0, dt_max=math.inf):
    return native.mamba_decode(**c, ngroups=G, silu=silu, dt_min=dt_min, dt_max=dt_max)


def clone_case(c):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in c.items()}


@pytest.mark.parametrize(
    "H, P, G, N, W",
    [(8, 32, 2, 32, 4), (4, 6, 1, 12, 4), (6, 5, 3, 16, 2), (2, 8, 2, 128, 3)],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("lengths", [[1, 1, 1], [1, 4, 2, 3]])
def test_mamba_decode_matches_the_reference_twins(H, P, G, N, W, dtype, lengths):
    c = mamba_case(lengths, H, P, G, N, W, dtype, bias=H != 6)
    c["write_slots"][0, 0] = 0  # a null write: skipped
    if len(lengths) > 2:
        c["write_slots"][2, 0] = c["read_slot"][2]  # a plain decode's in-place update
    ref, nat = clone_case(c), clone_case(c)
    y_ref = run_reference(ref, G)
    y_nat = run_native(nat, G)
    tol = 1e-12 if dtype == torch.float64 else 3e-5
    torch.testing.assert_close(y_nat, y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(nat["conv_state"], ref["conv_state"], rtol=tol, atol=tol)
    torch.testing.assert_close(nat["ssm_state"], ref["ssm_state"], rtol=tol, atol=tol)
    assert torch.equal(nat["ssm_state"][0], c["ssm_state"][0])  # the null slot is never written


@pytest.mark.parametrize("silu, dt_min, dt_max", [(False, 0.0, math.inf), (True, 0.05, 0.5)])
def test_mamba_decode_options_and_extremes(silu, dt_min, dt_max):
    c = mamba_case([2, 1, 3], 4, 8, 2, 16, 4, torch.float32)
    c["dt"][0, :2] = torch.tensor([60.0, -60.0])  # softplus past its threshold, and ~0
    c["xbc"][1, :5] = -1e4  # silu of a huge negative input: 0, not NaN
    c["xbc"][2, 5:9] = 1e4
    ref, nat = clone_case(c), clone_case(c)
    y_ref = run_reference(ref, 2, silu, dt_min, dt_max)
    y_nat = run_native(nat, 2, silu, dt_min, dt_max)
    assert torch.isfinite(y_nat).all()
    torch.testing.assert_close(y_nat, y_ref, rtol=3e-5, atol=3e-4)
    torch.testing.assert_close(nat["ssm_state"], ref["ssm_state"], rtol=3e-5, atol=3e-4)


@pytest.mark.parametrize("where", ["dt", "dt_bias"])
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_a_nan_dt_stays_nan_as_in_the_twins(where, step):
    """A NaN in dt (or dt_bias) gives NaN outputs and states, as the twins give them: built with
    -ffast-math, the kernel's clamps turned it into dt ~ 20 and plausible numbers, so a corrupt
    checkpoint was not caught by the engine's non-finite-logits check."""
    if step == "decode":
        c = mamba_case([1, 1], 4, 16, 1, 16, 4, torch.float32)
    else:
        c = prefill_case([20, 3], 4, 16, 1, 16, 4, torch.float32, 8, [0, 0], [True, True])
    if where == "dt":
        c["dt"][0, 0] = math.nan
    else:
        c["dt_bias"][0] = math.nan
    ref, nat = clone_case(c), clone_case(c)
    if step == "decode":
        y_ref, y_nat = run_reference(ref, 1), run_native(nat, 1)
    else:
        y_ref, y_nat = prefill_reference(ref, 1), prefill_native(nat, 1)
    assert torch.isnan(y_ref).any()
    assert torch.equal(torch.isnan(y_nat), torch.isnan(y_ref))
    assert torch.equal(torch.isnan(nat["ssm_state"]), torch.isnan(ref["ssm_state"]))


def mamba1_case(T: int = 6, Dc: int = 4, N: int = 3) -> dict:
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    return dict(
        x=torch.randn(T, Dc, generator=g, dtype=f64),
        dt=torch.rand(T, Dc, generator=g, dtype=f64) * 0.3,
        A=-torch.rand(Dc, N, generator=g, dtype=f64),
        B=torch.randn(T, N, generator=g, dtype=f64),
        C=torch.randn(T, N, generator=g, dtype=f64),
        D=torch.randn(Dc, generator=g, dtype=f64),
        ssm_state=torch.randn(8, Dc, N, generator=g, dtype=f64),
        query_start_loc=torch.tensor([0, 5, T]),  # rows of 5 and 1 tokens
        read_slot=torch.tensor([1, 2]),
        has_initial_state=torch.tensor([True, True]),
    )


def test_mamba1_scan_refuses_writes_that_do_not_line_up():
    """The writes' rows, tokens and slots must be of one length (a shorter tensor was read past
    its end) and sorted by row (rows are found by counting)."""
    c = mamba1_case()
    row, tok, slot = torch.tensor([0, 0, 1]), torch.tensor([2, 4, 0, 9]), torch.tensor([3, 6, 7, 1])
    with pytest.raises(ValueError, match="of one length"):
        native.mamba1_scan(**c, writes=(row, tok[:1], slot[:1]))
    with pytest.raises(ValueError, match="sorted by row"):
        native.mamba1_scan(**c, writes=(torch.tensor([1, 0]), torch.tensor([0, 4]), torch.tensor([3, 4])))
    state = c["ssm_state"].clone()
    assert native.mamba1_scan(**c, writes=(row, tok[:3], slot[:3])) is not None
    assert not torch.equal(c["ssm_state"], state)  # (it ran, and wrote)


def test_mamba1_scan_declines_a_slot_written_by_two_rows():
    """Which of two rows' writes to one slot lands last differs between the kernel and its twin:
    the kernel declines, and the caller runs the twin."""
    c = mamba1_case()
    state = c["ssm_state"].clone()
    both = (torch.tensor([0, 1]), torch.tensor([4, 0]), torch.tensor([5, 5]))
    assert native.mamba1_scan(**c, writes=both) is None
    assert torch.equal(c["ssm_state"], state)  # nothing written


def test_mamba_decode_declines_a_read_after_write_between_rows():
    # row 1 reads the slot row 0 writes: the reference reads every row first, so the kernel
    # declines (None) and has written nothing
    c = mamba_case([1, 1], 4, 8, 2, 16, 4, torch.float64)
    c["read_slot"][1] = c["write_slots"][0, 0]
    before = clone_case(c)
    assert run_native(c, 2) is None
    assert torch.equal(c["ssm_state"], before["ssm_state"]) and torch.equal(
        c["conv_state"], before["conv_state"]
    )
    # the other way round (a later row writes what an earlier one read) is fine
    c = mamba_case([1, 1], 4, 8, 2, 16, 4, torch.float64)
    c["write_slots"][1, 0] = c["read_slot"][0]
    ref, nat = clone_case(c), clone_case(c)
    torch.testing.assert_close(run_native(nat, 2), run_reference(ref, 2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("what", ["write slot", "read slot", "too many tokens"])
def test_mamba_decode_refuses_bad_slots_before_writing(what):
    c = mamba_case([1, 2], 4, 8, 2, 16, 4, torch.float32)
    if what == "write slot":
        c["write_slots"][1, 1] = c["ssm_state"].shape[0]
    elif what == "read slot":
        c["read_slot"][0] = -1
    else:
        c["write_slots"] = c["write_slots"][:, :1].contiguous()
    before = clone_case(c)
    with pytest.raises(ValueError, match="out of bounds"):
        run_native(c, 2)
    assert torch.equal(c["ssm_state"], before["ssm_state"]) and torch.equal(
        c["conv_state"], before["conv_state"]
    )


def test_mamba_decode_declines_what_it_does_not_cover():
    c = mamba_case([1, 1], 4, 8, 2, 16, 4, torch.float32)
    bf = {
        k: (v.bfloat16() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in c.items()
    }
    assert run_native(bf, 2) is None
    mixed = clone_case(c)
    mixed["ssm_state"] = mixed["ssm_state"].double()
    assert run_native(mixed, 2) is None


def _record_kernel_calls(monkeypatch, names) -> dict[str, list[bool]]:
    """Wraps the named kernels of `native`: per name, whether each call ran (not None)."""
    calls: dict[str, list[bool]] = {n: [] for n in names}
    for name in names:
        real = getattr(native, name)

        def counting(*a, _real=real, _name=name, **kw):
            res = _real(*a, **kw)
            calls[_name].append(res is not None)
            return res

        monkeypatch.setattr(native, name, counting)
    return calls


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_the_engine_mamba_layers_use_them_and_agree_with_the_twins(spec, monkeypatch):
    from hybridserve.engine.llm import LLM
    from hybridserve.sampling.params import SamplingParams

    calls = _record_kernel_calls(monkeypatch, ("mamba_decode", "mamba_prefill"))
    # the per-op forward's layers (the native step, which calls the library's kernels itself,
    # would take every step of these small prompts)
    monkeypatch.setenv("HYBRIDSERVE_DECODE_STEP", "0")
    # long prompts (several chunks of a small budget: prefill rows continuing from a state, with
    # boundary states emitted in mode `all`) and repeated ones (prefix hits)
    prompts = ["hello hello hello hello", "1 2 3 4 1 2 3 4 1 2", "The quick brown fox", "abc abc abc abc"]
    prompts += [" ".join(str(i % 17) for i in range(150)), " ".join(str(i % 17) for i in range(150))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(
        "demo", dtype="float64", max_num_seqs=8, speculative_config=spec, max_num_batched_tokens=128,
        mamba_block_size=64,
    )  # fmt: skip
    with_native = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for name, seen in calls.items():
        assert seen and all(seen), name
    monkeypatch.setattr(native, "mamba_decode", lambda *a, **kw: None)  # the reference twins
    monkeypatch.setattr(native, "mamba_prefill", lambda *a, **kw: None)
    with_twins = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert with_native == with_twins


# ------------------------------------------------------------------------------------------------
# Mamba prefill: the recurrence in place of conv prefill + chunked SSD scan
# ------------------------------------------------------------------------------------------------


def prefill_case(lengths, H, P, G, N, W, dtype, chunk, num_computed, has_init, seed=0):
    c = mamba_case(lengths, H, P, G, N, W, dtype, slots=96, seed=seed, write_cols=1)
    R = len(lengths)
    c["write_slot"] = c.pop("write_slots")[:, 0].clone()
    c["num_computed_tokens"] = torch.tensor(num_computed, dtype=torch.int64)
    c["has_initial_state"] = torch.tensor(has_init, dtype=torch.bool)
    # emit at every chunk end inside each row (absolute positions), to fresh slots
    er, et = [], []
    for r in range(R):
        for t in range(lengths[r]):
            if (num_computed[r] + t + 1) % chunk == 0:
                er.append(r)
                et.append(t)
    used = set(c["read_slot"].tolist()) | set(c["write_slot"].tolist())
    free = [s for s in range(1, 96) if s not in used]
    c["emit_row"] = torch.tensor(er, dtype=torch.int64)
    c["emit_token"] = torch.tensor(et, dtype=torch.int64)
    c["emit_slot"] = torch.tensor(free[: len(er)], dtype=torch.int64)
    c["chunk_size"] = chunk
    return c


def prefill_reference(c, G, silu=True, dt_min=0.0, dt_max=math.inf):
    from hybridserve.kernels import reference as K

    H, P, N = c["ssm_state"].shape[1:]
    conv_out = K.causal_conv1d_prefill(
        c["xbc"], c["conv_weight"], c["conv_bias"], c["conv_state"], c["query_start_loc"], c["read_slot"],
        c["has_initial_state"], c["write_slot"], c["emit_row"], c["emit_token"], c["emit_slot"],
        "silu" if silu else None,
    )  # fmt: skip
    x, B, C = conv_out.split([H * P, G * N, G * N], dim=-1)
    return K.ssd_prefill(
        x.reshape(-1, H, P), c["dt"], c["A"], B.reshape(-1, G, N), C.reshape(-1, G, N), c["D"], c["dt_bias"],
        c["ssm_state"], c["query_start_loc"], c["num_computed_tokens"], c["read_slot"], c["has_initial_state"],
        c["write_slot"], c["emit_row"], c["emit_token"], c["emit_slot"], c["chunk_size"], dt_min, dt_max,
    )  # fmt: skip


def prefill_native(c, G, silu=True, dt_min=0.0, dt_max=math.inf):
    return native.mamba_prefill(**c, ngroups=G, silu=silu, dt_min=dt_min, dt_max=dt_max)


@pytest.mark.parametrize(
    "H, P, G, N, W",
    [(8, 32, 2, 32, 4), (4, 6, 1, 12, 4), (2, 16, 2, 16, 2), (2, 8, 1, 128, 3)],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mamba_prefill_matches_the_reference_twins(H, P, G, N, W, dtype):
    # a long row from position 0 (blocks of 64 tokens, several chunks), a row continuing mid-chunk
    # from a state, a row shorter than the conv window, a row of one token, an empty row
    lengths = [150, 37, 2, 1, 0]
    c = prefill_case(
        lengths, H, P, G, N, W, dtype, chunk=16, num_computed=[0, 21, 5, 9, 0],
        has_init=[False, True, True, True, False],
    )  # fmt: skip
    c["write_slot"][3] = 0  # a null final write
    assert c["emit_row"].numel() > 8
    ref, nat = clone_case(c), clone_case(c)
    y_ref = prefill_reference(ref, G)
    y_nat = prefill_native(nat, G)
    assert y_nat is not None
    # the chunked scan and the recurrence differ in rounding only
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    torch.testing.assert_close(y_nat, y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(nat["conv_state"], ref["conv_state"], rtol=tol, atol=tol)
    torch.testing.assert_close(nat["ssm_state"], ref["ssm_state"], rtol=tol, atol=tol)
    assert torch.equal(nat["ssm_state"][0], c["ssm_state"][0])


def test_mamba_prefill_of_a_split_prompt_equals_the_whole():
    # two calls (the second continuing from the first's state) give the state of one call:
    # exactly, since every part is a long row (>= 8 tokens: the transposed-state arithmetic).
    # A short row (decode, verify) sums y in another order and agrees to rounding only.
    whole = prefill_case([96], 8, 32, 2, 32, 4, torch.float64, chunk=32, num_computed=[0], has_init=[False])
    first = clone_case(whole)
    for k in ("xbc", "dt"):
        first[k] = whole[k][:40]
    first["query_start_loc"] = torch.tensor([0, 40])
    keep = whole["emit_token"] < 40
    for k in ("emit_row", "emit_token", "emit_slot"):
        first[k] = whole[k][keep]
    y1 = prefill_native(first, 2)
    second = clone_case(first)
    second["conv_state"], second["ssm_state"] = first["conv_state"], first["ssm_state"]
    for k in ("xbc", "dt"):
        second[k] = whole[k][40:]
    second["query_start_loc"] = torch.tensor([0, 56])
    second["num_computed_tokens"] = torch.tensor([40])
    second["has_initial_state"] = torch.tensor([True])
    second["read_slot"] = first["write_slot"].clone()
    for k, v in (("emit_row", 0 * whole["emit_row"][~keep]), ("emit_token", whole["emit_token"][~keep] - 40)):
        second[k] = v
    second["emit_slot"] = whole["emit_slot"][~keep]
    y2 = prefill_native(second, 2)
    y = prefill_native(whole, 2)
    assert torch.equal(torch.cat([y1, y2]), y)
    assert torch.equal(
        second["ssm_state"][int(whole["write_slot"][0])], whole["ssm_state"][int(whole["write_slot"][0])]
    )


def test_mamba_prefill_declines_what_the_reference_orders_differently():
    c = prefill_case(
        [40, 8], 4, 16, 2, 16, 4, torch.float64, chunk=16, num_computed=[0, 0], has_init=[True, True]
    )
    # row 1 reads the slot that row 0 writes: the reference reads first
    bad = clone_case(c)
    bad["read_slot"][1] = bad["write_slot"][0]
    before = clone_case(bad)
    assert prefill_native(bad, 2) is None
    assert torch.equal(bad["ssm_state"], before["ssm_state"]) and torch.equal(
        bad["conv_state"], before["conv_state"]
    )
    # an emit and the final state of one row in one slot: the reference writes the final first
    bad = clone_case(c)
    bad["emit_slot"][0] = bad["write_slot"][0]
    assert prefill_native(bad, 2) is None
    # an emit past its row's end is the reference's ValueError, raised before anything is written
    bad = clone_case(c)
    bad["emit_row"][0], bad["emit_token"][0] = 1, 8
    before = clone_case(bad)
    with pytest.raises(ValueError, match="out of range"):
        prefill_native(bad, 2)
    assert torch.equal(bad["ssm_state"], before["ssm_state"]) and torch.equal(
        bad["conv_state"], before["conv_state"]
    )


def emits_at(c, tokens):
    """c with its emits replaced by the given tokens of each row (fresh slots)."""
    c = clone_case(c)
    er = [r for r, ts in enumerate(tokens) for _ in ts]
    et = [t for ts in tokens for t in ts]
    used = set(c["read_slot"].tolist()) | set(c["write_slot"].tolist())
    free = [s for s in range(1, c["ssm_state"].shape[0]) if s not in used]
    c["emit_row"] = torch.tensor(er, dtype=torch.int64)
    c["emit_token"] = torch.tensor(et, dtype=torch.int64)
    c["emit_slot"] = torch.tensor(free[: len(er)], dtype=torch.int64)
    return c


# rows from position 0 and continuing mid-chunk, one-token rows; emits at the first token, inside
# chunks, at chunk ends (chunk 16) and at the last token, in row blocks of 64 tokens and across them
ANY_EMIT_ROWS = dict(
    lengths=[150, 37, 1, 9, 2],
    num_computed=[0, 21, 9, 1488, 5],
    has_init=[False, True, True, True, True],
    tokens=[[0, 1, 15, 40, 63, 64, 65, 100, 149], [0, 10, 11, 26, 36], [0], [0, 3, 6, 8], [0, 1]],
)


@pytest.mark.parametrize(
    "H, P, G, N, W",
    [(8, 32, 2, 32, 4), (4, 6, 1, 12, 4), (2, 16, 2, 16, 2), (2, 8, 1, 128, 3)],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mamba_prefill_emits_at_any_token_match_the_twins(H, P, G, N, W, dtype):
    rows = ANY_EMIT_ROWS
    c = prefill_case(
        rows["lengths"], H, P, G, N, W, dtype, chunk=16, num_computed=rows["num_computed"],
        has_init=rows["has_init"],
    )  # fmt: skip
    c = emits_at(c, rows["tokens"])
    ref, nat = clone_case(c), clone_case(c)
    y_ref = prefill_reference(ref, G)
    y_nat = prefill_native(nat, G)
    assert y_nat is not None
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    torch.testing.assert_close(y_nat, y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(nat["conv_state"], ref["conv_state"], rtol=tol, atol=tol)
    torch.testing.assert_close(nat["ssm_state"], ref["ssm_state"], rtol=tol, atol=tol)
    # the emitted slots hold states (not what the pool had there)
    slots = c["emit_slot"]
    assert not torch.equal(nat["ssm_state"][slots], c["ssm_state"][slots])
    assert torch.equal(nat["ssm_state"][0], c["ssm_state"][0])


# ------------------------------------------------------------------------------------------------
# RMSNorm and the gated RMSNorm
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rms_norms_match_the_torch_ops(dtype):
    from hybridserve.model.layers.norm import RMSNorm, gated_rms_norm_torch

    g = torch.Generator().manual_seed(3)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    norm = RMSNorm(48, 1e-5)
    norm.weight.data = torch.randn(48, generator=g)
    wide = torch.randn(7, 60, generator=g, dtype=torch.float64).to(dtype)
    plain = (torch.randn(5, 48, generator=g, dtype=torch.float64).to(dtype), wide[:1, :48].contiguous())
    for x in (wide[:, :48], wide[:, 12:].reshape(7, 1, 48)[:, 0], torch.randn(2, 3, 48, dtype=dtype), *plain):
        out = native.rms_norm(x, norm.weight, norm.eps)
        assert out is not None and out.shape == x.shape and out.dtype == dtype
        h = x.double()
        ref = norm.weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(norm(x), out, rtol=0, atol=0)  # the module takes the kernel
    proj = torch.randn(5, 100, generator=g, dtype=torch.float64).to(dtype)
    y, z = proj[:, :32].contiguous(), proj[:, 40:72]  # z: a column slice, as in the mixer
    w = torch.randn(32, generator=g, dtype=dtype)
    for group in (32, 8, 1):
        out = native.gated_rms_norm(y, z, w, group, 1e-6)
        ref = gated_rms_norm_torch(y.double(), z.double(), w.double(), group, 1e-6, torch.float64)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_norm_fast_paths_are_the_general_paths(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that need no conversion take a shorter wrapper around the same kernels: the same
    values, bit for bit, as the general wrapper gives."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 64, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(64, generator=g, dtype=torch.float64).to(dtype)
    z = torch.randn(6, 80, generator=g, dtype=torch.float64).to(dtype)[:, 8:72]
    fast = (native.rms_norm(x, w, 1e-5), native.gated_rms_norm(x, z, w, 16, 1e-5))
    monkeypatch.setattr(native, "_NORM_FAST", {})
    monkeypatch.setattr(native, "_GATED_NORM_FAST", {})
    general = (native.rms_norm(x, w, 1e-5), native.gated_rms_norm(x, z, w, 16, 1e-5))
    for a, b in zip(fast, general):
        assert a is not None and b is not None and torch.equal(a, b)


def test_rms_norms_decline_what_they_do_not_cover():
    w = torch.ones(16)
    assert native.rms_norm(torch.randint(0, 9, (3, 16)), w, 1e-5) is None
    assert native.rms_norm(torch.randn(3, 16)[:, ::2], torch.ones(8), 1e-5) is None  # not unit stride
    assert native.rms_norm(torch.randn(3, 16), torch.ones(15), 1e-5) is None
    y = torch.randn(3, 16)
    assert native.gated_rms_norm(y, y.double(), w, 8, 1e-5) is None
    assert native.gated_rms_norm(y, y, w, 5, 1e-5) is None  # groups must tile the row


# ------------------------------------------------------------------------------------------------
# bfloat16 activations (float32 Mamba states): computed in float32, rounded once
# ------------------------------------------------------------------------------------------------

BF16 = torch.bfloat16


@pytest.mark.parametrize("H, KVH, D, bs", [(4, 2, 32, 16), (6, 2, 24, 5), (8, 1, 128, 16)])
def test_bf16_attention_is_the_float32_kernel_on_the_widened_values(H, KVH, D, bs):
    # K / V stay bfloat16 in the cache (half the bytes to read); the arithmetic is float32's
    q, kv, bt, qsl, pos = make_case([1, 4, 1, 3, 1], [1, 37, 2 * bs, 9, 3 * bs + 1], H, KVH, D, bs, BF16)
    out = native.paged_attention(q, kv, bt, qsl, pos, D**-0.5)
    assert out is not None and out.dtype == BF16 and out.shape == q.shape
    wide = native.paged_attention(q.float(), kv.float(), bt, qsl, pos, D**-0.5)
    assert torch.equal(out, wide.to(BF16))
    ref = attention_ref(q, kv, bt, qsl, pos, D**-0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


# a KV cache narrower than the model (--kv-cache-dtype): the widened values, exactly
NARROW_KV = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn),
    (torch.float32, torch.float8_e5m2),
    (BF16, torch.float8_e4m3fn),
    (BF16, torch.float8_e5m2),
]


@pytest.mark.parametrize("q_dtype, kv_dtype", NARROW_KV)
@pytest.mark.parametrize("H, KVH, D, bs", [(4, 2, 32, 16), (6, 2, 24, 5), (8, 1, 128, 16)])
def test_a_narrow_kv_cache_is_the_kernel_on_its_widened_values(H, KVH, D, bs, q_dtype, kv_dtype):
    q, kv, bt, qsl, pos = make_case(
        [1, 4, 1, 3, 1], [1, 37, 2 * bs, 9, 3 * bs + 1], H, KVH, D, bs, torch.float32
    )
    narrow = kv.to(kv_dtype)
    q = q.to(q_dtype)
    out = native.paged_attention(q, narrow, bt, qsl, pos, D**-0.5)
    assert out is not None and out.dtype == q_dtype and out.shape == q.shape
    # the kernel of q's dtype on the cache widened by torch (every byte's widening is checked
    # exactly below; the arithmetic may contract into fused multiply-adds otherwise than the
    # other instantiation's, so its last bit may differ)
    wide = native.paged_attention(q, narrow.to(q_dtype), bt, qsl, pos, D**-0.5)
    torch.testing.assert_close(out, wide, rtol=1e-6, atol=1e-6)
    ref = attention_ref(q, narrow, bt, qsl, pos, D**-0.5)
    tol = 2e-6 if q_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_float8_byte_widens_as_torch_widens_it(kv_dtype):
    """Each of the 256 byte values (NaNs, infinities, subnormals too) as V of a one-key attention,
    whose output is that V (a zero's sign aside: the sum starts at +0)."""
    values = torch.arange(256, dtype=torch.uint8).view(kv_dtype)
    want = values.float()
    keep = ~want.isnan()
    # heads of 128 (the kernel's vector path) and of 256 (its scalar one)
    for kvh, d in ((2, 128), (1, 256)):
        kv = torch.zeros(1, 2, 16, kvh, d, dtype=kv_dtype)
        kv[0, 1, 0] = values.view(kvh, d)
        q = torch.zeros(1, kvh, d)
        bt = torch.zeros(1, 1, dtype=torch.int64)
        out = native.paged_attention(q, kv, bt, torch.tensor([0, 1]), torch.tensor([0]), 1.0)
        assert out is not None
        got = out[0].reshape(256)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[keep], want[keep])


@pytest.mark.parametrize("kv", ["bfloat16", "fp8"])
def test_the_engine_reads_a_narrow_kv_cache_with_the_kernel_as_the_torch_path_does(monkeypatch, kv):
    """A float32 model with --kv-cache-dtype: the decode rows' attention runs in the kernel, and
    its tokens and logprobs are the torch path's (same widened values, float32 arithmetic)."""
    from hybridserve.engine.llm import LLM
    from hybridserve.sampling.params import SamplingParams

    prompts = ATTENTION_PROMPTS
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = LLM("demo", dtype="float32", max_num_seqs=8, kv_cache_dtype=kv, cpu_threads=1)

    def run() -> list[tuple[list[int], list[float]]]:
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]) for c in outs]

    calls = _count_kernel_calls(monkeypatch)
    with_kernel = run()
    assert calls and all(calls)
    monkeypatch.setattr(native, "paged_attention", lambda *a, **kw: None)  # the torch path
    with_torch = run()
    for (tokens, lps), (want, want_lps) in zip(with_kernel, with_torch, strict=True):
        assert tokens == want
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-4


def test_a_kv_cache_of_another_dtype_without_a_kernel_takes_the_torch_path():
    q, kv, bt, qsl, pos = make_case([1], [9], 2, 2, 32, 16, torch.float32)
    assert native.paged_attention(q.double(), kv.to(torch.float8_e4m3fn), bt, qsl, pos, 0.1) is None
    assert native.paged_attention(q.to(BF16), kv, bt, qsl, pos, 0.1) is None  # (a wider cache)


def _narrow(c, names=("xbc", "dt", "conv_weight", "conv_bias")):
    return {k: (v.to(BF16) if k in names and v is not None else v) for k, v in clone_case(c).items()}


def _widened(c):
    return {k: (v.float() if isinstance(v, torch.Tensor) and v.dtype == BF16 else v) for k, v in c.items()}


def test_bf16_mamba_kernels_are_the_float32_kernels_on_the_widened_inputs():
    G = 2
    # decode and verify rows: y rounded once, every state written as float32 computes it
    c = _narrow(mamba_case([1, 4, 2, 3], 8, 32, G, 32, 4, torch.float32))
    mine, wide, twin = clone_case(c), _widened(clone_case(c)), clone_case(c)
    y = run_native(mine, G)
    assert y is not None and y.dtype == BF16
    assert torch.equal(y, run_native(wide, G).to(BF16))
    assert torch.equal(mine["ssm_state"], wide["ssm_state"]) and torch.equal(
        mine["conv_state"], wide["conv_state"]
    )
    # the twins round the conv output to bfloat16 before the scan: close, not equal
    torch.testing.assert_close(y.float(), run_reference(twin, G).float(), rtol=3e-2, atol=3e-2)
    # prefill rows (with boundary-state emits)
    c = prefill_case([70, 9, 1], 4, 16, G, 16, 4, torch.float32, 16, [0, 5, 3], [False, True, True])
    c = _narrow(c)
    mine, wide = clone_case(c), _widened(clone_case(c))
    y = prefill_native(mine, G)
    assert y is not None and y.dtype == BF16
    assert torch.equal(y, prefill_native(wide, G).to(BF16))
    assert torch.equal(mine["ssm_state"], wide["ssm_state"]) and torch.equal(
        mine["conv_state"], wide["conv_state"]
    )
    assert c["emit_row"].numel() > 0
    # emits at any token of a row: the float32 kernel's states, and close to the twins
    rows = ANY_EMIT_ROWS
    c = prefill_case(
        rows["lengths"], 4, 16, G, 16, 4, torch.float32, 16, rows["num_computed"], rows["has_init"]
    )
    c = _narrow(emits_at(c, rows["tokens"]))
    mine, wide, twin = clone_case(c), _widened(clone_case(c)), clone_case(c)
    y = prefill_native(mine, G)
    assert y is not None and y.dtype == BF16
    assert torch.equal(y, prefill_native(wide, G).to(BF16))
    assert torch.equal(mine["ssm_state"], wide["ssm_state"]) and torch.equal(
        mine["conv_state"], wide["conv_state"]
    )
    torch.testing.assert_close(y.float(), prefill_reference(twin, G).float(), rtol=3e-2, atol=3e-2)
    slots = c["emit_slot"]
    torch.testing.assert_close(mine["ssm_state"][slots], twin["ssm_state"][slots], rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(mine["conv_state"][slots], twin["conv_state"][slots], rtol=1e-2, atol=1e-2)


def test_bf16_rms_norms_are_the_float32_kernels_rounded_once():
    from hybridserve.model.layers.norm import RMSNorm, gated_rms_norm_torch

    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(48, 1e-5).to(BF16)
    norm.weight.data = torch.randn(48, generator=g).to(BF16)
    x = torch.randn(7, 48, generator=g).to(BF16)
    out = native.rms_norm(x, norm.weight, norm.eps)
    assert out is not None and out.dtype == BF16
    assert torch.equal(out, native.rms_norm(x.float(), norm.weight, norm.eps).to(BF16))
    assert torch.equal(norm(x), out)  # the module takes the kernel
    h = x.double()
    ref = norm.weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    proj = torch.randn(5, 100, generator=g).to(BF16)
    y, z = proj[:, :32].contiguous(), proj[:, 40:72]
    w = torch.randn(32, generator=g).to(BF16)
    out = native.gated_rms_norm(y, z, w, 8, 1e-6)
    assert out is not None and out.dtype == BF16
    assert torch.equal(out, native.gated_rms_norm(y.float(), z.float(), w, 8, 1e-6).to(BF16))
    ref = gated_rms_norm_torch(y, z, w, 8, 1e-6, BF16)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def _copied_shapes(fn):
    """The shapes of every tensor that `fn` converts or copies (aten _to_copy / copy_)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    shapes: list[tuple[int, ...]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "_to_copy" in str(func) or "copy_" in str(func):
                shapes.append(tuple(args[-1].shape if "copy_" in str(func) else args[0].shape))
            return func(*args, **(kwargs or {}))

    with Record():
        out = fn()
    return out, shapes


def test_bf16_kernels_read_and_write_bf16_without_copies_of_the_activations():
    # the kernels widen and round the activations themselves: only weight vectors are converted
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(10, 48, generator=g).to(BF16), torch.randn(48, generator=g).to(BF16)
    out, shapes = _copied_shapes(lambda: native.rms_norm(x, w, 1e-5))
    assert out is not None and out.dtype == BF16 and shapes == [(48,)]
    out, shapes = _copied_shapes(lambda: native.gated_rms_norm(x, x, w, 8, 1e-5))
    assert out is not None and out.dtype == BF16 and shapes == [(48,)]
    c = _narrow(mamba_case([1, 4, 2, 3], 4, 8, 2, 16, 4, torch.float32))  # 10 tokens, conv_dim 96
    y, shapes = _copied_shapes(lambda: run_native(c, 2))
    assert y is not None and y.dtype == BF16 and y.shape == (10, 4, 8)
    assert shapes and all(s[0] != 10 for s in shapes), shapes


def test_a_bf16_engine_runs_every_kernel_and_stays_close_to_its_twins(monkeypatch):
    from hybridserve.engine.llm import LLM
    from hybridserve.sampling.params import SamplingParams

    names = ("paged_attention", "mamba_decode", "mamba_prefill", "rms_norm", "gated_rms_norm")
    calls = _record_kernel_calls(monkeypatch, names)
    prompts = ["hello hello hello hello", "1 2 3 4 1 2 3 4 1 2", " ".join(str(i % 17) for i in range(90))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = LLM("demo", dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=64)
    mine = llm.generate(prompts, params)
    for name, seen in calls.items():
        assert seen and all(seen), name
    for name in names:
        monkeypatch.setattr(native, name, lambda *a, **kw: None)  # the torch twins
    twins = llm.generate(prompts, params)
    # bfloat16 rounding differs between the two: the first token's logprob is close, and most
    # greedy tokens agree
    agree = total = 0
    for a, b in zip(mine, twins):
        lp_a = a.outputs[0].logprobs[0][a.outputs[0].token_ids[0]].logprob
        lp_b = b.outputs[0].logprobs[0][b.outputs[0].token_ids[0]].logprob
        assert abs(lp_a - lp_b) < 0.1
        agree += sum(x == y for x, y in zip(a.outputs[0].token_ids, b.outputs[0].token_ids))
        total += len(a.outputs[0].token_ids)
    assert agree >= total // 2, (agree, total)


# ------------------------------------------------------------------------------------------------
# Several threads: the rows of a call split over the kernels' thread pool
# ------------------------------------------------------------------------------------------------


def test_threads_give_the_same_results_bit_for_bit(monkeypatch):
    # rows are independent, so any split over threads gives exactly the one-thread result
    def run_all(threads):
        monkeypatch.setattr(native, "threads", lambda: threads)
        q, kv, bt, qsl, pos = make_case(
            [1, 4, 1, 3, 1, 2] * 4, [40, 37, 2, 90, 17, 64] * 4, 4, 2, 32, 16, torch.float32
        )
        att = native.paged_attention(q, kv, bt, qsl, pos, 0.17)
        dec = mamba_case([1, 3, 1, 2, 1, 1, 4, 1] * 3, 8, 32, 2, 32, 4, torch.float32, slots=128)
        y_dec = run_native(dec, 2)
        pre = prefill_case(
            [150, 37, 2, 1, 0, 90], 8, 32, 2, 32, 4, torch.float32, chunk=16, num_computed=[0, 21, 5, 9, 0, 3],
            has_init=[False, True, True, True, False, True],
        )  # fmt: skip
        y_pre = prefill_native(pre, 2)
        return [att, y_dec, dec["ssm_state"], dec["conv_state"], y_pre, pre["ssm_state"], pre["conv_state"]]

    one = run_all(1)
    for threads in (2, 3, 8):
        for a, b in zip(one, run_all(threads), strict=True):
            assert a is not None and torch.equal(a, b), threads


def test_threads_decline_a_slot_shared_between_rows(monkeypatch):
    # one thread: a later row may write what an earlier row read; in parallel it may not
    c = mamba_case([1] * 20, 4, 8, 2, 16, 4, torch.float64)
    c["write_slots"][19, 0] = c["read_slot"][0]
    monkeypatch.setattr(native, "threads", lambda: 1)
    assert run_native(clone_case(c), 2) is not None
    monkeypatch.setattr(native, "threads", lambda: 4)
    assert run_native(clone_case(c), 2) is None


# ------------------------------------------------------------------------------------------------
# Inputs that once got past the checks (found by review): each must be an error or a fallback
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["huge position", "qsl not monotone", "one-row slice of a wider table"])
def test_attention_inputs_that_must_not_read_out_of_bounds(what):
    q, kv, bt, qsl, pos = make_case([1, 2], [20, 30], 4, 2, 32, 16, torch.float32)
    if what == "huge position":
        pos[0] = 2**63 - 2  # position + 1 and the block count would overflow
    elif what == "qsl not monotone":
        qsl = torch.tensor([0, 3, 2])  # row 1 ends before it starts; row 0 runs past the tokens
        q, pos = q[:2], pos[:2].clone()
    else:
        wide = torch.zeros(2, 8, dtype=torch.int64)
        wide[0, :] = bt[1, 0]
        bt = wide[:1, :1]  # "contiguous", shape [1, 1], row stride 8; the row needs 2 blocks
        qsl, q, pos = qsl[:2], q[:1], pos[:1].clone()
        pos[0] = 20
    with pytest.raises(ValueError):
        native.paged_attention(q, kv, bt, qsl, pos, 0.1)


def test_tensors_off_the_cpu_or_of_other_lengths_are_declined():
    q, kv, bt, qsl, pos = make_case([1, 1], [5, 6], 4, 2, 32, 16, torch.float32)
    assert native.paged_attention(q, kv.to("meta"), bt, qsl, pos, 0.1) is None
    assert native.paged_attention(q, kv, bt, qsl, pos.to("meta"), 0.1) is None
    c = mamba_case([1, 1], 4, 8, 2, 16, 4, torch.float32)
    for key, bad in (
        ("A", c["A"][:1]),
        ("dt_bias", c["dt_bias"][:1]),
        ("ssm_state", c["ssm_state"].to("meta")),
    ):
        assert native.mamba_decode(**{**c, key: bad}, ngroups=2, silu=True) is None, key
    for dt_max in (-1.0, -math.inf):  # bounds the reference clamps to as given
        assert native.mamba_decode(**c, ngroups=2, silu=True, dt_max=dt_max) is None
    assert native.rms_norm(torch.randn(3, 16), torch.ones(16, device="meta"), 1e-5) is None


def test_has_initial_state_is_read_as_truth_values():
    c = prefill_case(
        [5, 7], 4, 16, 2, 16, 4, torch.float64, chunk=8, num_computed=[3, 0], has_init=[True, False]
    )
    ints = clone_case(c)
    ints["has_initial_state"] = torch.tensor([2, 0])  # 2 is true, as for the reference
    torch.testing.assert_close(prefill_native(ints, 2), prefill_native(clone_case(c), 2), rtol=0, atol=0)


def test_loading_the_library_keeps_denormals():
    # -ffast-math at link time would switch the process to flush-to-zero (GCC links crtfastmath.o)
    assert native.library() is not None
    assert float(torch.tensor([1e-39], dtype=torch.float32) * 1.0) != 0.0
    assert float(torch.tensor([1e-310], dtype=torch.float64) * 1.0) != 0.0


def test_a_forked_child_can_run_parallel_kernels(tmp_path):
    code = (
        "import os, sys, torch\n"
        "sys.path.insert(0, 'tests/kernels')\n"
        "from test_kernels_native import mamba_case, run_native\n"
        "from hybridserve.kernels import native\n"
        "native.threads = lambda: 4\n"
        "def once():\n"
        "    assert run_native(mamba_case([1] * 32, 4, 8, 2, 16, 4, torch.float32, slots=80), 2) is not None\n"
        "once()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    once(); once()\n"
        "    os._exit(0)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "assert os.waitstatus_to_exitcode(status) == 0\n"
        "once()\n"
        "print('fork ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0 and "fork ok" in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_verify_row_is_bit_identical_to_decoding_its_tokens_one_by_one(dtype):
    c = mamba_case([3], 8, 32, 2, 32, 4, dtype)
    together = clone_case(c)
    y3 = run_native(together, 2)
    slot = int(c["read_slot"][0])
    for t in range(3):
        one = clone_case(c)
        one.update(
            xbc=c["xbc"][t : t + 1], dt=c["dt"][t : t + 1], query_start_loc=torch.tensor([0, 1]),
            read_slot=torch.tensor([slot]), write_slots=c["write_slots"][:, t : t + 1].clone(),
        )  # fmt: skip
        y1 = run_native(one, 2)
        assert torch.equal(y1[0], y3[t]), t
        slot = int(c["write_slots"][0, t])
        c["conv_state"], c["ssm_state"] = one["conv_state"], one["ssm_state"]
    assert torch.equal(c["ssm_state"], together["ssm_state"]) and torch.equal(
        c["conv_state"], together["conv_state"]
    )


def test_bf16_tensors_off_the_cpu_are_declined_without_widening_copies():
    # (meta tensors stand in for CUDA ones): the torch path gets them untouched, no float32
    # copy is made first
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    meta = {"device": "meta", "dtype": BF16}
    x, w = torch.empty(64, 48, **meta), torch.empty(48, **meta)
    c = mamba_case([1, 1], 4, 8, 2, 16, 4, torch.float32)
    c = {
        k: (v.to("meta") if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in c.items()
    }
    c["xbc"], c["dt"] = c["xbc"].to(BF16), c["dt"].to(BF16)
    with Record():
        assert native.rms_norm(x, w, 1e-5) is None
        assert native.gated_rms_norm(x, x, w, 8, 1e-5) is None
        assert run_native(c, 2) is None
    assert [op for op in ops if "_to_copy" in op or "copy_" in op] == [], ops
