"""The sharded model on 2 and 4 gloo ranks (spawned processes) against the whole model in this
process, in float64: logits within 1e-12 relative and the same greedy tokens, on the demo model
and on tiny random Nemotron-H (MoE, n_groups 1 and 2, GQA), Bamba (n_groups 1 and 2) and Mamba2
(n_groups 2 and 4) checkpoints, and Granite-4.0-H (routed and shared experts; dense with GQA 4/1)
and Falcon-H1 (muP multipliers, the Mamba norm before the gate; no norm, GQA 6/1) and Jamba
(Mamba1 mixers split by channel, MoE and dense MLP layers, GQA 4/2; 72 channels) and Zamba2 (two
shared blocks over three uses, attention and MLP adapters, biases) ones, with
batched, chunked prefills and decode rows. At TP 4 the checkpoints with n_groups 1 or 2 have norm
groups spread over ranks (Falcon-H1's norm before the gate included) and KV heads replicated."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tp_harness import driver_logits, run_ranks, sharded_logits

from hybridserve.distributed.sharding import SUPPORTED_ARCHITECTURES, check_tensor_parallel
from hybridserve.errors import ConfigError
from hybridserve.model.architectures import supported_architectures
from hybridserve.model.demo import ensure_demo_model
from hybridserve.model.loader import load_config
from model_fixtures import ALL_CONFIGS, build_hf_model, random_prompts, save_hf_model

EXTRA = {"m2_g4": ("mamba2", dict(hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
                                  state_size=8, n_groups=4, chunk_size=8, expand=2))}  # fmt: skip
# checkpoint -> the TP degrees its shapes allow (of 2 and 4)
DEGREES = {
    "demo": (2, 4),
    "nh_g2_moe": (2, 4),
    "nh_g1": (2,),
    "bamba_g1": (2, 4),
    "bamba_g2": (2,),
    "m2_g2": (2,),
    "m2_g4": (2, 4),
    "gr_moe_rope": (2,),
    "gr_dense_odd": (2,),
    "fh_gqa_norm": (2, 4),
    "fh_odd_nonorm": (2,),
    "jb_moe_gqa": (2, 4),
    "jb_odd_top1": (2,),
    "z2_two_blocks": (2, 4),
}
MAX_NEW = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_ckpt")
    out = {"demo": str(ensure_demo_model())}
    for name in DEGREES:
        if name == "demo":
            continue
        kind, cfg = ALL_CONFIGS.get(name) or EXTRA[name]
        out[name] = str(save_hf_model(build_hf_model(kind, cfg, vocab_size=256), root / name))
    return out


def _case(name: str, path: str) -> tuple[str, list[list[int]], int, list[list[int] | None]]:
    prompts = random_prompts(3, 200, [21, 6, 30], seed=len(name))
    return path, prompts, MAX_NEW, [[8, 13], None, [16, 14]]


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, str]) -> dict[str, tuple[list[list[int]], list[torch.Tensor]]]:
    return {n: driver_logits(*_case(n, p)[:1], 1, 0, *_case(n, p)[1:]) for n, p in checkpoints.items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_logits_equal_the_whole_model(
    tp: int, checkpoints: dict[str, str], reference: dict, tmp_path: Path
) -> None:
    names = [n for n, degrees in DEGREES.items() if tp in degrees]
    cases = [_case(n, checkpoints[n]) for n in names]
    results = run_ranks(sharded_logits, tp, (cases,), tmp_path)
    for r, per_rank in enumerate(results):
        for name, (tokens, logits) in zip(names, per_rank):
            ref_tokens, ref_logits = reference[name]
            assert tokens == ref_tokens, (name, r)
            for a, b in zip(logits, ref_logits):
                assert a.dtype == torch.float64
                rel = float((a - b).abs().max() / b.abs().max())
                assert rel <= 1e-12, (name, r, rel)
    # every rank computed the same logits (the same all-reduced hidden states)
    for per_rank in results[1:]:
        for (_, la), (_, lb) in zip(per_rank, results[0]):
            assert all(torch.equal(x, y) for x, y in zip(la, lb))


def test_shapes_the_size_does_not_divide_are_refused(checkpoints: dict[str, str]) -> None:
    _, nh_g1 = load_config(checkpoints["nh_g1"])  # 6 Mamba heads, 4 KV heads
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 4: .*Mamba heads \(6\)"):
        check_tensor_parallel(nh_g1, 4)
    _, m2_g2 = load_config(checkpoints["m2_g2"])  # 6 heads in 2 groups
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3: .*n_groups \(2: 3 must divide"):
        check_tensor_parallel(m2_g2, 3)
    _, bamba_g2 = load_config(checkpoints["bamba_g2"])  # 6 attention heads, 2 KV heads
    with pytest.raises(ConfigError, match=r"attention heads \(6\)"):
        check_tensor_parallel(bamba_g2, 4)
    check_tensor_parallel(bamba_g2, 2)
    _, granite = load_config(checkpoints["gr_moe_rope"])  # experts of 16, a shared MLP of 24
    with pytest.raises(ConfigError, match=r"the experts' intermediate_size \(18\)"):
        check_tensor_parallel(dataclasses.replace(granite, moe_intermediate_size=18), 4)
    with pytest.raises(ConfigError, match=r"shared_intermediate_size \(6\)"):
        check_tensor_parallel(dataclasses.replace(granite, intermediate_size=6), 4)
    _, falcon = load_config(checkpoints["fh_odd_nonorm"])  # hybrid layers: 6 attention heads
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 4: .*attention heads \(6\)"):
        check_tensor_parallel(falcon, 4)
    # an architecture without a sharded form is refused by name (every family loaded has one)
    assert set(SUPPORTED_ARCHITECTURES) == set(supported_architectures())
    with pytest.raises(
        ConfigError, match=r"--tensor-parallel-size 2: NewForCausalLM has no tensor-parallel form"
    ):
        check_tensor_parallel(dataclasses.replace(falcon, architecture="NewForCausalLM"), 2)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan", "1e10"])
def test_a_bad_collective_timeout_is_a_config_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from hybridserve.distributed.parallel_state import collective_timeout_s

    monkeypatch.setenv("HYBRIDSERVE_TP_TIMEOUT_S", value)
    with pytest.raises(ConfigError, match="HYBRIDSERVE_TP_TIMEOUT_S"):
        collective_timeout_s()
    monkeypatch.setenv("HYBRIDSERVE_TP_TIMEOUT_S", "12.5")
    assert collective_timeout_s() == 12.5
    monkeypatch.setenv("HYBRIDSERVE_TP_TIMEOUT_S", "1e9")  # ("never", in practice)
    assert collective_timeout_s() == 1e9
