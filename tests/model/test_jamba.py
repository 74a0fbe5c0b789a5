"""Jamba (JambaForCausalLM: Mamba1 mixers, attention, MoE) beyond the shared parity matrix of
test_model_parity.py (whose full-prompt logits, greedy and batched-greedy tests run on the `jb_*`
configs of model_fixtures.JAMBA_CONFIGS): the Mamba1 selective scan (the C++ CPU kernel against
its torch twin, the twin against a plain loop of transformers' recurrence), float64 logits
against transformers, states emitted after any token, the config parser and what it refuses,
the state layout, FLOPs, tensor-parallel sizes the shapes do not allow refused at start,
`hybridserve config --explain`, and the engine (prefix hits in every cache mode, n-gram
speculation) lossless in float64, at TP 1 and (a subset) at TP 2. The sharded logits are checked
in tests/distributed/test_tp_model.py.

float64 against transformers: transformers' Jamba computes A = -exp(A_log) and the router's
softmax in float32 even in a float64 model, so the two agree to float32 rounding and are compared
at the parity tests' 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch

import family_engine
from hybridserve.config.args import EngineArgs
from hybridserve.config.explain import format_resolved
from hybridserve.config.plan import plan_engine
from hybridserve.errors import ConfigError
from hybridserve.kernels import native, selective_scan
from hybridserve.model.architectures import get_architecture
from hybridserve.model.cache_tensors import ModelCaches, mamba_bytes_per_slot
from hybridserve.model.flops import prefill_cost
from hybridserve.model.loader import load_model
from hybridserve.model.model_config import ATTENTION, MAMBA, model_capabilities
from model_fixtures import JAMBA_CONFIGS, Driver, random_prompts

torch.set_num_threads(1)

VOCAB = family_engine.VOCAB
NAMES = list(JAMBA_CONFIGS)
ARCH = "JambaForCausalLM"

checkpoints = family_engine.checkpoints_fixture("jamba", JAMBA_CONFIGS, seed=400)


# ------------------------------------------------------------------------------------------------
# the selective scan
# ------------------------------------------------------------------------------------------------


def _scan_inputs(
    dtype: torch.dtype, T: int, Dc: int, N: int, slots: int, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, Dc, generator=g, dtype=dtype)
    dt = torch.rand(T, Dc, generator=g, dtype=dtype) * 0.3
    A = -torch.rand(Dc, N, generator=g, dtype=dtype) * 4
    B = torch.randn(T, N, generator=g, dtype=dtype)
    C = torch.randn(T, N, generator=g, dtype=dtype)
    D = torch.randn(Dc, generator=g, dtype=dtype)
    state = torch.randn(slots, Dc, N, generator=g, dtype=dtype)
    state[0] = 0
    return x, dt, A, B, C, D, state


def _loop_scan(x, dt, A, B, C, D, h0):  # noqa: ANN001, ANN202 - transformers' recurrence, one row
    h, ys, states = h0.clone(), [], []
    for t in range(x.shape[0]):
        h = torch.exp(A * dt[t][:, None]) * h + (dt[t][:, None] * B[t][None, :]) * x[t][:, None]
        ys.append(h @ C[t] + x[t] * D)
        states.append(h.clone())
    return torch.stack(ys), states


def _twin_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "mamba1_scan", lambda *a: None)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_scan_prefill_kernel_twin_and_loop_agree(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three prefill rows (one continuing from its slot, one from zeros, one reading a slot that
    another row's emit writes): y, the final states and states emitted after arbitrary tokens
    (the first, a middle one, the last) agree between the C++ kernel, the twin, and a plain loop
    of transformers' recurrence."""
    assert native.build() is not None, "the C++ CPU kernels are part of the test set-up"
    T, Dc, N = 31, 40, 16
    x, dt, A, B, C, D, state = _scan_inputs(dtype, T, Dc, N, 10, seed=1)
    qsl = torch.tensor([0, 12, 13, 31])
    read = torch.tensor([1, 2, 3])
    has_init = torch.tensor([True, False, True])
    write = torch.tensor([4, 5, 6])
    emit_row, emit_token, emit_slot = (
        torch.tensor([0, 0, 2, 1]),
        torch.tensor([0, 5, 9, 0]),
        torch.tensor([3, 7, 8, 9]),
    )
    outs = []
    for twin in (False, True):
        if twin:
            _twin_only(monkeypatch)
        s = state.clone()
        y = selective_scan.selective_scan_prefill(
            x, dt, A, B, C, D, s, qsl, read, has_init, write, emit_row, emit_token, emit_slot
        )
        outs.append((y, s))
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[0][0], outs[1][0], **tol)
    torch.testing.assert_close(outs[0][1], outs[1][1], **tol)
    y, s = outs[0]
    for r in range(3):
        a, b = int(qsl[r]), int(qsl[r + 1])
        h0 = state[int(read[r])] if bool(has_init[r]) else torch.zeros(Dc, N, dtype=dtype)
        ref_y, ref_states = _loop_scan(x[a:b], dt[a:b], A, B[a:b], C[a:b], D, h0)
        torch.testing.assert_close(y[a:b], ref_y, **tol)
        torch.testing.assert_close(s[int(write[r])], ref_states[-1], **tol)
        for er, et, es in zip(emit_row.tolist(), emit_token.tolist(), emit_slot.tolist()):
            if er == r:
                torch.testing.assert_close(s[es], ref_states[et], **tol)
    # row 2 read slot 3 before row 0's emit wrote it; untouched slots stay as they were
    assert torch.equal(s[0], state[0]) and torch.equal(s[1], state[1]) and torch.equal(s[2], state[2])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_scan_verify_rows_write_after_every_token(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode and verify rows: the state after token t goes to write_slots[r, t] (0 skipped: slot 4
    keeps its value); a row
    reads a slot that an earlier row writes, and gets the state from before the call."""
    T, Dc, N = 6, 24, 8
    x, dt, A, B, C, D, state = _scan_inputs(dtype, T, Dc, N, 9, seed=2)
    qsl = torch.tensor([0, 1, 4, 6])
    read = torch.tensor([1, 3, 3])
    ws = torch.tensor([[2, 0, 0], [3, 0, 5], [6, 7, 0]])
    outs = []
    for twin in (False, True):
        if twin:
            _twin_only(monkeypatch)
        s = state.clone()
        outs.append((selective_scan.selective_scan_update(x, dt, A, B, C, D, s, qsl, read, ws), s))
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[0][0], outs[1][0], **tol)
    torch.testing.assert_close(outs[0][1], outs[1][1], **tol)
    y, s = outs[0]
    _, st = _loop_scan(x[4:6], dt[4:6], A, B[4:6], C[4:6], D, state[3])
    torch.testing.assert_close(s[6], st[0], **tol)
    torch.testing.assert_close(s[7], st[1], **tol)
    _, st = _loop_scan(x[1:4], dt[1:4], A, B[1:4], C[1:4], D, state[3])
    torch.testing.assert_close(s[3], st[0], **tol)
    torch.testing.assert_close(s[5], st[2], **tol)
    assert torch.equal(s[4], state[4])


def test_scan_kernel_splits_channels_over_threads_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Enough work for the kernel to split the channels over two threads: the same result as one
    thread, bit for bit (channels are independent), and as the twin."""
    x, dt, A, B, C, D, state = _scan_inputs(torch.float64, 300, 200, 16, 8, seed=4)
    args = (torch.tensor([0, 100, 101, 300]), torch.tensor([1, 2, 3]), torch.tensor([True, True, False]))
    writes = (torch.tensor([4, 5, 6]), torch.tensor([0, 2]), torch.tensor([50, 10]), torch.tensor([7, 3]))
    outs = []
    for threads in (1, 2, 0):
        if threads:
            monkeypatch.setattr(native, "threads", lambda n=threads: n)
        else:
            _twin_only(monkeypatch)
        s = state.clone()
        outs.append((selective_scan.selective_scan_prefill(x, dt, A, B, C, D, s, *args, *writes), s))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    torch.testing.assert_close(outs[0][0], outs[2][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outs[0][1], outs[2][1], rtol=1e-12, atol=1e-12)


def test_scan_kernel_refuses_out_of_range_slots_writing_nothing() -> None:
    x, dt, A, B, C, D, state = _scan_inputs(torch.float32, 4, 8, 4, 5, seed=3)
    before = state.clone()
    with pytest.raises(ValueError, match="out of bounds"):
        selective_scan.selective_scan_update(
            x,
            dt,
            A,
            B,
            C,
            D,
            state,
            torch.tensor([0, 2, 4]),
            torch.tensor([1, 2]),
            torch.tensor([[3, 4], [2, 9]]),
        )
    assert torch.equal(state, before)


# ------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_float64_batched_logits_match_transformers(checkpoints, name: str) -> None:
    """family_engine.check_float64_logits (see the module docstring for what limits the
    tolerance)."""
    family_engine.check_float64_logits(checkpoints(name), 10, padded_batch=True)


def test_states_emitted_after_any_token_equal_a_prefill_stopping_there(checkpoints) -> None:
    """A prefill emitting states after tokens that end no block or chunk (the scan has no chunks)
    gives, in every Mamba layer, the conv window and state of a prefill that stops there."""
    _, d = checkpoints("jb_odd_top1")
    lm = load_model(str(d), torch.float64)
    prompt = random_prompts(1, VOCAB, [29], seed=19)[0]
    drv = Driver(lm, max_seq=64, max_reqs=2, window=2)
    a = drv._new_req(0, prompt, 0, None, 0)
    drv.step([(a, prompt[:3], False)])
    emit_slots = [drv.caches.num_slots - 1, drv.caches.num_slots - 2]
    # after absolute tokens 7 and 22 (indices 4 and 19 of this 26-token step)
    drv.step([(a, prompt[3:], False)], emits=[(0, 4, emit_slots[0]), (0, 19, emit_slots[1])])
    for boundary, slot in zip([8, 23], emit_slots):
        ref = Driver(lm, max_seq=64, max_reqs=1, window=2)
        b = ref._new_req(0, prompt[:boundary], 0, None, 0)
        ref.step([(b, prompt[:boundary], False)])
        for i in lm.config.mamba_layer_ids:
            for ours, theirs in ((drv.caches.ssm, ref.caches.ssm), (drv.caches.conv, ref.caches.conv)):
                torch.testing.assert_close(ours[i][slot], theirs[i][b.window[0]], rtol=1e-10, atol=1e-12)


def _token_linears(lm, i: int) -> int:  # noqa: ANN001
    """Weights of the linear layers one token goes through in decoder layer `i` (an MoE layer:
    the router and top-k of its experts)."""
    layer = lm.model.model.layers[i]
    total = 0
    for n, m in layer.named_modules():
        if isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * (
                lm.config.num_experts_per_tok / lm.config.n_routed_experts if ".experts." in f".{n}" else 1
            )
    return int(total)


def test_config_state_layout_and_flops(checkpoints) -> None:
    _, d = checkpoints("jb_odd_top1")
    lm = load_model(str(d), torch.float32)
    c = lm.config
    assert c.architecture == ARCH and c.model_type == "jamba" and c.mamba_version == 1
    assert c.layer_types == [MAMBA, MAMBA, ATTENTION, MAMBA, MAMBA]
    assert c.moe_layers == [False, True, False, False, True]
    assert (c.d_inner, c.dstate, c.d_conv, c.dt_rank, c.conv_dim, c.chunk_size) == (72, 16, 3, 2, 72, 1)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim) == (2, 2, 12, 0)
    assert (c.n_routed_experts, c.num_experts_per_tok) == (3, 1)
    assert not c.mamba_conv_bias and lm.model.model.layers[0].mamba.conv1d.bias is None
    caps = c.capabilities()
    assert (caps["scan_chunk_size"], caps["num_mamba_layers"], caps["num_attention_layers"]) == (1, 4, 1)
    raw = json.loads((d / "config.json").read_text())
    assert caps == {**model_capabilities(raw, "config.json"), "torch_dtype": caps["torch_dtype"]}
    # a Mamba1 state per channel: [d_inner, 1, d_state], the conv window over d_inner channels
    caches = ModelCaches.for_model(c, torch.float32, 4, 8, 3)
    assert caches.ssm[0].shape == (3, 72, 1, 16) and caches.conv[0].shape == (3, 72, 2)
    assert sorted(caches.ssm) == [0, 1, 3, 4] and sorted(caches.kv) == [2]
    assert mamba_bytes_per_slot(c, torch.float32) == 4 * (72 * 2 + 72 * 16) * 4
    linear = sum(_token_linears(lm, i) for i in range(c.num_layers))
    cost = prefill_cost(c)
    assert cost.per_token == 2 * linear + 2 * 4 * (72 * 3 + 3 * 72 * 16)
    assert cost.attn_per_context_token == 2 * 2 * 2 * 12 * 1


def _raw(**kw: object) -> dict:
    base: dict = {
        "model_type": "jamba", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "intermediate_size": 16, "attn_layer_period": 2,
        "attn_layer_offset": 1, "num_experts": 4, "num_key_value_heads": 4,
    }  # fmt: skip
    base.update(kw)
    return base


def test_parse_defaults_and_errors() -> None:
    cls = get_architecture(ARCH)
    c = cls.parse_config(_raw(num_key_value_heads=None), "j/config.json")
    assert c.layer_types == [MAMBA, ATTENTION] * 2
    assert c.moe_layers == [False, True, False, True]  # expert_layer_period 2, offset 1
    # (num_key_value_heads null: as many as the heads; left out: transformers' default, 8)
    assert (c.dt_rank, c.dstate, c.d_inner, c.num_kv_heads, c.num_experts_per_tok) == (2, 16, 64, 4, 2)
    raw = _raw(num_attention_heads=16)
    del raw["num_key_value_heads"]
    assert cls.parse_config(raw, "j/config.json").num_kv_heads == 8
    # the defaults of Jamba-v0.1: attention every 8th layer from the 5th
    raw = _raw(num_hidden_layers=16)
    del raw["attn_layer_period"], raw["attn_layer_offset"]
    c = cls.parse_config(raw, "j/config.json")
    assert [i for i, k in enumerate(c.layer_types) if k == ATTENTION] == [4, 12]
    # one expert: every layer a gated MLP
    c = cls.parse_config(_raw(num_experts=1), "j/config.json")
    assert c.moe_layers == [False] * 4 and c.n_routed_experts == 0
    bad = [
        (_raw(attn_layer_offset=2), "attn_layer_offset"),
        (_raw(expert_layer_period=2, expert_layer_offset=5), "expert_layer_offset"),
        (_raw(num_experts_per_tok=5), "expert counts"),
        (_raw(mamba_dt_rank=0), "mamba_dt_rank"),
        (_raw(hidden_act="gelu"), "activation"),
        (_raw(num_key_value_heads=3), "num_key_value_heads"),
    ]
    for raw, match in bad:
        with pytest.raises(ConfigError, match=match):
            cls.parse_config(raw, "j/config.json")


def test_plan_explain_and_tensor_parallel_sizes(checkpoints) -> None:
    _, d = checkpoints("jb_moe_gqa")
    text = family_engine.explain(d)
    assert (
        "capabilities: type jamba, Mamba layers 2, attention layers 2, boundary states on, scan chunk size 1"
    ) in text, text
    # 64 channels, 4 / 2 attention heads, experts and MLP of 24: 3 ranks cannot split them
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3: .*the Mamba channels \(d_inner 64\)"):
        plan_engine(EngineArgs(model=str(d), tensor_parallel_size=3), str(d))
    plan = plan_engine(EngineArgs(model=str(d)), str(d))
    assert "mamba_cache_mode" in format_resolved(plan.resolved, explain=True)


# ------------------------------------------------------------------------------------------------
# the engine, float64: caching and speculation change nothing (tests/family_engine.py)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_model(checkpoints, tmp_path_factory: pytest.TempPathFactory):
    """The MoE / GQA checkpoint with the Mamba layers' out_proj scaled by 0.3 and an LM head of
    0.8 of the embeddings (the model then often repeats tokens, so n-gram drafts are partly
    accepted); its reference outputs."""
    from safetensors.torch import load_file, save_file

    _, src = checkpoints("jb_moe_gqa")
    root = tmp_path_factory.mktemp("engine")
    scaled = root / "jb_scaled"
    scaled.mkdir()
    w = load_file(str(src / "model.safetensors"))
    for k in w:
        if k.endswith("mamba.out_proj.weight"):
            w[k] = w[k] * 0.3
    save_file(w, str(scaled / "model.safetensors"))
    (scaled / "config.json").write_text((src / "config.json").read_text())
    return family_engine.echo_model(scaled, root / "jb_echo", 0.8)


@family_engine.engine_matrix
def test_engine_cache_modes_and_ngram_speculation_are_lossless(
    engine_model, mode: str, spec: int | None
) -> None:
    family_engine.check_lossless(engine_model, mode, spec)


@family_engine.tensor_parallel_subset
def test_engine_at_tensor_parallel_2_gives_the_tp1_outputs(engine_model, mode: str, spec: int | None) -> None:
    """One spawned gloo worker: the TP 1 reference outputs, prefix hits and n-gram speculation
    included (the Mamba1 mixer split by channel, the experts summed over the ranks)."""
    family_engine.check_lossless(engine_model, mode, spec, tensor_parallel_size=2)
