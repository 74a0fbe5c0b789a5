"""The engine's plan before anything is allocated: the resolved configuration and the cache sizes,
with `max_num_seqs` lowered to what the Mamba state pool can run when it was not given.

State slots, not KV blocks, are what a hybrid model runs out of: one slot holds a sequence's whole
state over every Mamba layer, as large as thousands of tokens of KV. An engine that admits more
sequences than its state pool holds windows for either fails after loading the model or caps
concurrency without saying so; this plan settles it before the weights are read, says why in a
decision, and `hybridserve config --explain` prints the same plan.

The model's config parser imports torch, so it is imported when a plan is made, not with the
package.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridserve import _core
from hybridserve.config.args import EngineArgs
from hybridserve.config.capabilities import read_model_capabilities
from hybridserve.config.explain import Decision, ResolvedEngineConfig
from hybridserve.config.sizing import CacheSizes, compute_cache_sizes

if TYPE_CHECKING:
    from hybridserve.model.model_config import ModelConfig


@dataclass(frozen=True)
class EnginePlan:
    """What the engine will allocate and run with."""

    resolved: ResolvedEngineConfig
    sizes: CacheSizes
    model_config: ModelConfig


def _sequences(n: int) -> str:
    return f"{n} sequence{'' if n == 1 else 's'}"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def plan_engine(args: EngineArgs, model_dir: str) -> EnginePlan:
    """Resolves `args` for the model in `model_dir` and sizes its caches; ConfigError when the
    pools cannot run the configuration (the message names the flags to change)."""
    from hybridserve.model.cache_tensors import (
        default_state_dtype,
        kv_bytes_per_block,
        kv_cache_dtype,
        mamba_bytes_per_slot,
        parse_dtype,
    )
    from hybridserve.model.loader import load_config

    caps = read_model_capabilities(model_dir)
    resolved = args.resolve(caps, model_dir=model_dir)
    _, mcfg = load_config(model_dir)
    tp = int(args.tensor_parallel_size)
    # with tensor parallelism the pools are counted per rank: every rank holds the same blocks and
    # slots, each of its shard's size (docs/tensor-parallelism.md, "Caches")
    shard_cfg = _shard_config(mcfg, tp, model_dir)
    core = resolved.core
    dtype = parse_dtype(resolved.dtype)
    k = int(core.num_speculative_tokens)
    caching = bool(core.enable_prefix_caching)
    state_dtype = default_state_dtype(mcfg, dtype, args.mamba_ssm_cache_dtype)
    kv_dtype = kv_cache_dtype(dtype, args.kv_cache_dtype)
    sizes = compute_cache_sizes(
        block_size=int(core.block_size),
        max_model_len=int(core.max_model_len),
        max_num_seqs=int(core.max_num_seqs),
        num_speculative_tokens=k,
        prefix_caching_can_hit=caching,
        kv_bytes_per_token=kv_bytes_per_block(shard_cfg, 1, kv_dtype),
        mamba_bytes_per_slot=mamba_bytes_per_slot(shard_cfg, state_dtype),
        has_mamba_layers=bool(mcfg.has_mamba_layers),
        kv_cache_memory=args.kv_cache_memory,
        mamba_cache_memory=args.mamba_cache_memory,
        cache_memory=args.cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        num_mamba_slots=args.num_mamba_slots,
        max_num_seqs_auto=args.max_num_seqs is None,
    )
    decisions = list(resolved.decisions)
    per_seq = f"a window of {1 + k} slot{'s' if k else ''}" + (" and a checkpoint slot" if caching else "")
    if sizes.max_num_seqs != int(core.max_num_seqs):
        # resolve again with the lowered count, so every rule that depends on it sees it (with the
        # model folder, as the first time: without it the generation config's decision was lost)
        lowered = dataclasses.replace(args, max_num_seqs=sizes.max_num_seqs).resolve(
            caps, model_dir=model_dir
        )
        decisions = list(lowered.decisions)
        decisions.append(
            Decision(
                "max_num_seqs_lowered",
                "warning",
                f"max_num_seqs = {sizes.max_num_seqs}, not the default {_core.DEFAULT_MAX_NUM_SEQS}: the "
                f"Mamba state pool of {sizes.num_mamba_slots} slots runs {_sequences(sizes.state_pool_capacity)} "
                f"with {per_seq} each; raise --mamba-cache-memory (or --cache-memory, "
                "--num-mamba-slots) to run more",
            )
        )
        resolved = dataclasses.replace(lowered, args=args)
    if mcfg.has_mamba_layers:
        decisions.append(_state_dtype_decision(args.mamba_ssm_cache_dtype, mcfg, dtype, state_dtype))
        decisions.append(
            Decision(
                "state_pool_capacity",
                "info",
                f"Mamba state pool: {sizes.num_mamba_slots} slots of {_mib(sizes.mamba_bytes_per_slot)} "
                f"(the null slot counted) run {_sequences(sizes.state_pool_capacity)} with {per_seq} each; "
                f"max_num_seqs {sizes.max_num_seqs}",
            )
        )
        if sizes.state_pool_capacity < sizes.max_num_seqs:
            spare = sizes.num_mamba_slots - 1 - sizes.max_num_seqs * (1 + k)
            decisions.append(
                Decision(
                    "state_pool_below_checkpoint_reserve",
                    "warning",
                    f"--max-num-seqs {sizes.max_num_seqs} leaves {spare} slots for prefix-cache "
                    f"checkpoints, fewer than one per running sequence: checkpoints are evicted before "
                    "they are reused; "
                    + (
                        f"lower --max-num-seqs to {sizes.state_pool_capacity} or give the state pool more memory"
                        if sizes.state_pool_capacity > 0
                        else "give the state pool more memory"
                    ),
                )
            )
    if mcfg.num_attention_layers > 0:
        from hybridserve.kernels.native import reads_kv_cache

        on_cpu = not str(args.device or "cpu").startswith("cuda")
        kernel = reads_kv_cache(dtype, kv_dtype) if on_cpu else None
        decisions.append(_kv_dtype_decision(args.kv_cache_dtype, dtype, kv_dtype, kernel))
    if args.gpu_memory_utilization is not None:
        decisions.append(
            Decision(
                "gpu_memory_utilization",
                "info",
                f"--gpu-memory-utilization {args.gpu_memory_utilization:g} changes nothing on the CPU (as on "
                "vLLM's CPU build): the caches are sized by the defaults, --cache-memory, --kv-cache-memory "
                "and --mamba-cache-memory",
            )
        )
    if tp > 1:
        decisions.append(_tensor_parallel_decision(mcfg, tp))
    resolved = dataclasses.replace(resolved, decisions=decisions, model_dir=model_dir)
    return EnginePlan(resolved=resolved, sizes=sizes, model_config=mcfg)


def _kv_dtype_decision(requested: str, dtype: object, chosen: object, kernel: bool | None) -> Decision:
    """Which dtype the KV cache takes (torch dtypes: this module does not import torch), and on the
    CPU (`kernel`: whether the C++ attention kernel reads that cache; None off the CPU) what a
    dtype other than the model's costs."""
    name, model = str(chosen).removeprefix("torch."), str(dtype).removeprefix("torch.")
    if requested == "auto":
        return Decision("kv_cache_dtype", "info", f"KV cache in {name} (default: the model dtype)")
    why = "--kv-cache-dtype"
    if chosen != dtype:
        why += (
            f"; K and V are rounded to {name} when written and read back in {model} by every attention path"
        )
        if kernel:
            why += (
                "; on the CPU the attention kernel reads it as it is, and the whole-model decode step "
                "(small batches) steps aside for the layer-by-layer forward"
            )
        elif kernel is not None:
            why += (
                f"; on the CPU attention runs on the torch ops (the C++ kernels read no {name} cache under "
                f"a {model} model)"
            )
    return Decision("kv_cache_dtype", "info", f"KV cache in {name} ({why})")


def _state_dtype_decision(requested: str, mcfg: ModelConfig, dtype: object, chosen: object) -> Decision:
    """Which dtype the Mamba states take (torch dtypes: this module does not import torch)."""
    name = str(chosen).removeprefix("torch.")
    if str(dtype) == "torch.float64":
        why = "a float64 model keeps float64 states"
    elif requested != "auto":
        why = "--mamba-ssm-cache-dtype"
    else:
        why = (
            f"default: the checkpoint's mamba_ssm_cache_dtype ({mcfg.mamba_ssm_cache_dtype}), float32 when it "
            "names none; --mamba-ssm-cache-dtype sets another"
        )
    return Decision("mamba_ssm_cache_dtype", "info", f"Mamba states in {name} ({why})")


def _shard_config(mcfg: ModelConfig, tp: int, model_dir: str) -> ModelConfig:
    """The shapes one rank holds; ConfigError naming --tensor-parallel-size when `tp` does not
    divide the model."""
    if tp == 1:
        return mcfg
    from hybridserve.distributed.sharding import check_tensor_parallel, local_config

    check_tensor_parallel(mcfg, tp, f"{model_dir}/config.json")
    return local_config(mcfg, tp)


def _tensor_parallel_decision(mcfg: ModelConfig, tp: int) -> Decision:
    parts = []
    if mcfg.has_mamba_layers:
        G = mcfg.ngroups
        groups = (
            f"{G // tp} of {G} B/C groups each"
            if G % tp == 0
            else f"the one B/C group of its heads ({G} in all)"
        )
        parts.append(f"{mcfg.nheads // tp} of {mcfg.nheads} Mamba heads and {groups}")
    if mcfg.num_attention_layers:
        kv = mcfg.num_kv_heads
        kvs = f"{kv // tp} of {kv} KV heads" if kv % tp == 0 else f"1 of {kv} KV heads (replicated)"
        parts.append(f"{mcfg.num_heads // tp} of {mcfg.num_heads} query heads and {kvs}")
    return Decision(
        "tensor_parallel",
        "info",
        f"tensor parallel over {tp} ranks: each holds " + "; ".join(parts) + "; the embedding and LM "
        "head are replicated and rank 0 samples; cache budgets and pool sizes are per rank",
    )
