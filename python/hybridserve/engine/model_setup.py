"""Engine start-up: load the model, resolve the policy against its capabilities, size and allocate
the caches, build the proposer. Decisions of the policy are logged here, once."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from hybridserve import _core
from hybridserve.config import (
    DEFAULT_PROMPT_LOOKUP_MAX,
    DEFAULT_PROMPT_LOOKUP_MIN,
    EngineArgs,
    SpeculativeConfig,
    log_decisions,
)
from hybridserve.config.plan import plan_engine
from hybridserve.config.sizing import CacheSizes
from hybridserve.engine.cpu_threads import choose_cpu_threads
from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.errors import ConfigError
from hybridserve.model.cache_tensors import (
    ModelCaches,
    default_state_dtype,
    kv_cache_dtype,
)
from hybridserve.model.demo import resolve_model_path
from hybridserve.model.loader import load_model

logger = logging.getLogger("hybridserve.engine")

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


@dataclass
class EngineModel:
    model: Any
    model_config: Any
    caches: ModelCaches
    tokenizer: Tokenizer
    resolved: _core.ResolvedConfig
    sizes: CacheSizes
    device: torch.device
    dtype: torch.dtype
    eos_token_id: int | None
    vocab_size: int
    proposer: Any
    model_dir: str
    # the model's other EOS ids (config.json's and generation_config.json's lists, the
    # tokenizer's): each ends a request as a stop token id does (`extra_eos_ids`)
    # where the tokenizer, its special tokens and the chat template come from (--tokenizer, else
    # the model folder)
    tokenizer_dir: str
    # the workers of ranks 1 .. N-1 with tensor parallelism (distributed/executor.py), else None
    executor: Any = None
    extra_eos_token_ids: tuple[int, ...] = ()


def _is_out_of_memory(exc: BaseException) -> bool:
    """torch's allocation failures: `torch.OutOfMemoryError` on a GPU, a RuntimeError from the
    CPU allocator ("can't allocate memory")."""
    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    text = str(exc).lower()
    return "allocate" in text or "out of memory" in text


def build_engine_model(args: EngineArgs) -> EngineModel:
    model_dir = resolve_model_path(args.model)
    plan = plan_engine(args, str(model_dir))
    resolved_engine = plan.resolved
    sizes = plan.sizes
    resolved: _core.ResolvedConfig = resolved_engine.core
    dtype = _DTYPES[resolved_engine.dtype]
    device = torch.device(args.device or "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: no CUDA device is available here (use --device cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(
            f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    tp = int(args.tensor_parallel_size)
    threads = choose_cpu_threads(args.cpu_threads, ranks=tp)
    if threads.threads is not None:
        torch.set_num_threads(threads.threads)
    # (torch's intra-op threads; the C++ kernels' pool uses as many: kernels/native.py)
    logger.info("CPU threads: %d (%s)", torch.get_num_threads(), threads.reason)
    # (before any weight is read or worker started: a wrong --tokenizer fails at once)
    tokenizer_dir, tokenizer = _load_tokenizer(args, str(model_dir))
    executor = (
        _start_workers(args, model_dir, dtype, device, sizes, int(resolved.block_size), tokenizer_dir)
        if tp > 1
        else None
    )
    try:
        loaded = load_model(
            model_dir,
            dtype=dtype,
            device=str(device),
            load_format=args.load_format,
            tokenizer_dir=tokenizer_dir,
        )
        mcfg = loaded.config
        cache_cfg = mcfg
        if executor is not None:
            from hybridserve.distributed.sharding import local_config, shard_model

            shard_model(loaded.model, mcfg, 0, tp)
            cache_cfg = local_config(mcfg, tp)
        log_decisions(resolved_engine, logger)
        caches = _allocate_caches(cache_cfg, sizes, resolved, dtype, device, args)
        if executor is not None:
            executor.wait_ready()
    except BaseException:
        if executor is not None:
            executor.shutdown()
        raise
    eos = mcfg.eos_token_id if mcfg.eos_token_id is not None else tokenizer.eos_token_id
    vocab_size = int(mcfg.vocab_size)
    extra_eos = extra_eos_ids(eos, [*mcfg.eos_token_ids, tokenizer.eos_token_id], vocab_size)
    logger.info(
        "model %s (%s, %s): %d KV blocks of %d tokens, %d Mamba slots",
        model_dir,
        mcfg.architecture,
        str(dtype).removeprefix("torch."),
        sizes.num_kv_blocks,
        int(resolved.block_size),
        sizes.num_mamba_slots,
    )
    try:
        # a draft model runs whole on rank 0 (docs/tensor-parallelism.md, "Speculative decoding,
        # prefix caching, preemption")
        proposer = build_proposer(resolved_engine.speculative, resolved, dtype, device, vocab_size)
    except BaseException:
        if executor is not None:
            executor.shutdown()
        raise
    return EngineModel(
        model=loaded.model,
        model_config=mcfg,
        caches=caches,
        tokenizer=tokenizer,
        resolved=resolved,
        sizes=sizes,
        device=device,
        dtype=dtype,
        eos_token_id=eos,
        vocab_size=vocab_size,
        proposer=proposer,
        model_dir=model_dir,
        tokenizer_dir=tokenizer_dir,
        executor=executor,
        extra_eos_token_ids=extra_eos,
    )


def extra_eos_ids(eos: int | None, every: list[int | None], vocab_size: int) -> tuple[int, ...]:
    """The EOS ids besides the primary `eos` that the model may generate: as transformers stops at
    any id of an `eos_token_id` list, and vLLM adds the generation config's and the tokenizer's
    to a request's stop token ids."""
    return tuple(sorted({t for t in every if t is not None and t != eos and 0 <= t < vocab_size}))


def _load_tokenizer(args: EngineArgs, model_dir: str) -> tuple[str, Tokenizer]:
    """(its folder, the tokenizer): --tokenizer's, else the model folder's; a ConfigError that
    names the flag to give or to fix."""
    if args.tokenizer is None:
        try:
            return model_dir, Tokenizer(model_dir)
        except ConfigError as e:
            raise ConfigError(f"{e}; a model folder without one needs --tokenizer DIR") from None
    tokenizer_dir = str(resolve_model_path(args.tokenizer))
    try:
        return tokenizer_dir, Tokenizer(tokenizer_dir)
    except ConfigError as e:
        raise ConfigError(f"--tokenizer {args.tokenizer}: {e}") from None


def _start_workers(
    args: EngineArgs,
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    sizes: CacheSizes,
    block_size: int,
    tokenizer_dir: str,
) -> Any:
    """Spawns the tensor-parallel workers, or joins those a launcher (torchrun) started (they load
    their shards while this process loads its)."""
    from hybridserve.distributed.executor import TPExecutor
    from hybridserve.distributed.parallel_state import collective_timeout_s
    from hybridserve.distributed.torchrun import TorchrunExecutor, check_torchrun

    tp = int(args.tensor_parallel_size)
    collective_timeout_s()  # (a bad HYBRIDSERVE_TP_TIMEOUT_S is refused before any rank starts)
    env = check_torchrun(tp)
    if env is not None and device.type == "cuda" and device.index not in (None, env.local_rank):
        # (every rank of a launcher's group takes cuda:LOCAL_RANK: another index for rank 0
        # would put two ranks on one device)
        raise ConfigError(
            f"--device {device}: under torchrun each rank takes cuda:LOCAL_RANK (rank 0: "
            f"cuda:{env.local_rank}); give --device cuda"
        )
    if device.type == "cuda" and env is None:
        first = device.index or 0
        if first + tp > torch.cuda.device_count():
            raise ConfigError(
                f"--tensor-parallel-size {tp} on {device}: needs cuda:{first}..cuda:{first + tp - 1}, this "
                f"machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    spec = TPExecutor.spec_for(
        model_dir,
        dtype,
        device,
        tp,
        sizes.num_kv_blocks,
        block_size,
        sizes.num_mamba_slots,
        args.mamba_ssm_cache_dtype,
        args.kv_cache_dtype,
        args.load_format,
        tokenizer_dir,
    )
    if env is not None:
        logger.info("tensor parallel: joining the %d ranks torchrun started", tp)
        return TorchrunExecutor(spec, env)
    logger.info("tensor parallel: starting %d worker processes", tp - 1)
    return TPExecutor(spec)


def _allocate_caches(
    cfg: Any,
    sizes: CacheSizes,
    resolved: _core.ResolvedConfig,
    dtype: torch.dtype,
    device: torch.device,
    args: EngineArgs,
) -> ModelCaches:
    state_dtype = default_state_dtype(cfg, dtype, args.mamba_ssm_cache_dtype)
    resolved.validate_pool_sizes(sizes.num_kv_blocks, sizes.num_mamba_slots)
    try:
        return ModelCaches(
            cfg,
            num_blocks=sizes.num_kv_blocks,
            block_size=int(resolved.block_size),
            num_slots=sizes.num_mamba_slots,
            kv_dtype=kv_cache_dtype(dtype, args.kv_cache_dtype),
            state_dtype=state_dtype,
            device=device,
        )
    except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory errors are RuntimeErrors
        if not isinstance(exc, MemoryError) and not _is_out_of_memory(exc):
            raise
        raise ConfigError(
            f"cannot allocate the caches ({sizes.num_kv_blocks} KV blocks, {sizes.num_mamba_slots} "
            f"Mamba slots) on {device}: {str(exc).splitlines()[0]}; lower --kv-cache-memory / "
            "--mamba-cache-memory / --cache-memory or --num-kv-blocks / --num-mamba-slots"
        ) from exc


def build_proposer(
    spec: SpeculativeConfig | None,
    resolved: _core.ResolvedConfig,
    dtype: torch.dtype,
    device: torch.device,
    vocab_size: int,
) -> Any:
    """The proposer of the validated speculative config (the one `hybridserve config` shows)."""
    method = resolved.speculative_method
    if method is None or spec is None:
        return None
    if method == "ngram":
        from hybridserve.spec_decode.ngram import NgramProposer

        return NgramProposer(
            prompt_lookup_min=int(spec.prompt_lookup_min or DEFAULT_PROMPT_LOOKUP_MIN),
            prompt_lookup_max=int(spec.prompt_lookup_max or DEFAULT_PROMPT_LOOKUP_MAX),
        )
    if method == "draft_model":
        from hybridserve.spec_decode.draft_model import DraftModelProposer

        draft_dir = resolve_model_path(str(spec.model or ""))
        return DraftModelProposer(
            draft_dir,
            dtype=dtype,
            device=device,
            max_model_len=int(resolved.max_model_len),
            max_num_seqs=int(resolved.max_num_seqs),
            num_speculative_tokens=int(resolved.num_speculative_tokens),
            target_vocab_size=vocab_size,
        )
    raise ConfigError(f"--speculative-config: unknown method {method!r}")
