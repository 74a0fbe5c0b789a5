"""ModelCaches: the KV cache and the Mamba state tensors of one model (docs/memory.md).

- KV, per attention layer: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` in the KV dtype
  (the model dtype by default, `kv_cache_dtype`). Block ids index dim 0; block 0 is the null block (allocated, never
  handed out by the pool), so ``num_blocks`` counts it.
- Mamba state, per Mamba layer: conv ``[num_slots, conv_dim, d_conv - 1]`` and ssm
  ``[num_slots, nheads, headdim, dstate]``; fp32 by default (the checkpoint's
  `mamba_ssm_cache_dtype`), float64 when the model is float64. Slot ids index dim 0; slot 0 is the
  null slot (kept at zero), so ``num_slots`` counts it. One slot id addresses the whole state of a
  sequence position across all Mamba layers.

Sizing: `kv_bytes_per_block` / `mamba_bytes_per_slot` give the bytes of one entry; the engine turns
its budgets into counts in config/sizing.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridserve.errors import ConfigError
from hybridserve.kernels import dispatch
from hybridserve.model import host_memory
from hybridserve.model.model_config import ModelConfig

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def default_state_dtype(
    config: ModelConfig, model_dtype: torch.dtype, requested: str = "auto"
) -> torch.dtype:
    """fp64 for fp64 models, else `requested` (--mamba-ssm-cache-dtype), or for "auto" the
    checkpoint's `mamba_ssm_cache_dtype` (default fp32)."""
    if model_dtype == torch.float64:
        return torch.float64
    if requested != "auto":
        return _DTYPES[requested]
    return _DTYPES.get(config.mamba_ssm_cache_dtype, torch.float32)


_KV_DTYPES = {
    **_DTYPES,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_dtype(model_dtype: torch.dtype, requested: str = "auto") -> torch.dtype:
    """The KV cache's dtype: `requested` (--kv-cache-dtype, vLLM's names), or for "auto" the
    model dtype."""
    return model_dtype if requested == "auto" else _KV_DTYPES[requested]


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class ModelCaches:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        kv_dtype: torch.dtype = torch.float32,
        state_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        conv_dtype: torch.dtype | None = None,
    ) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        if config.num_attention_layers > 0 and num_blocks < 2:
            raise ConfigError(f"need at least 2 KV blocks (block 0 is the null block), got {num_blocks}")
        if config.has_mamba_layers and num_slots < 2:
            raise ConfigError(f"need at least 2 Mamba slots (slot 0 is the null slot), got {num_slots}")
        self.config = config
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.num_slots = int(num_slots)
        self.kv_dtype = kv_dtype
        self.state_dtype = state_dtype
        self.conv_dtype = conv_dtype or state_dtype
        self.device = torch.device(device)
        self.kv: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        for i in config.attention_layer_ids:
            self.kv[i] = host_memory.zeros(
                (self.num_blocks, 2, self.block_size, config.num_kv_heads, config.head_dim),
                kv_dtype,
                self.device,
            )
        for i in config.mamba_layer_ids:
            self.conv[i] = host_memory.zeros(
                (self.num_slots, config.conv_dim, config.d_conv - 1), self.conv_dtype, self.device
            )
            self.ssm[i] = host_memory.zeros(
                (self.num_slots, config.nheads, config.headdim, config.dstate), state_dtype, self.device
            )

    # ---- construction helpers ----
    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        model_dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        device: str | torch.device = "cpu",
    ) -> ModelCaches:
        """KV in the model dtype, state in `default_state_dtype`."""
        return cls(
            config,
            num_blocks,
            block_size,
            num_slots,
            kv_dtype=model_dtype,
            state_dtype=default_state_dtype(config, model_dtype),
            device=device,
        )

    # ---- state operations ----
    def apply_state_copies(self, copies: Any) -> None:
        """Executes ``copies`` (int [C, 2] of (src, dst) slot pairs, tensor / ndarray / list), in
        order, on every Mamba layer's conv and ssm tensors (before the forward)."""
        pairs = _copy_pairs(copies, 0, self.num_slots, "state copy slot")
        if pairs is None:
            return
        src, dst = pairs
        with torch.inference_mode():  # works on normal and inference tensors alike
            for i in self.conv:
                dispatch.copy_slots(self.conv[i], src, dst)
                dispatch.copy_slots(self.ssm[i], src, dst)

    def apply_kv_copies(self, copies: Any) -> None:
        """Executes ``copies`` (int [C, 2] of (src, dst) KV block pairs), in order, on every
        attention layer's KV (before the forward): a prefix hit on the partly filled last block of
        an earlier sequence gets its own copy of that block."""
        pairs = _copy_pairs(copies, 1, self.num_blocks, "KV block copy")
        if pairs is None:
            return
        src, dst = pairs
        with torch.inference_mode():
            for kv in self.kv.values():
                for s, d in zip(src.tolist(), dst.tolist()):
                    kv[d].copy_(kv[s])

    def reset(self) -> None:
        with torch.inference_mode():
            for d in (self.kv, self.conv, self.ssm):
                for t in d.values():
                    t.zero_()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.kv, self.conv, self.ssm) for t in d.values())


def _copy_pairs(copies: Any, lo: int, hi: int, what: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(src, dst) int64 tensors of a [C, 2] copy list whose ids lie in [lo, hi); None when empty.
    ValueError naming `what` for an id out of range (nothing is copied then)."""
    t = torch.as_tensor(copies, dtype=torch.int64)
    if t.numel() == 0:
        return None
    t = t.reshape(-1, 2)
    if bool((t < lo).any() or (t >= hi).any()):
        raise ValueError(f"{what} out of range [{lo}, {hi})")
    return t[:, 0], t[:, 1]


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over all attention layers."""
    return config.num_attention_layers * 2 * block_size * config.num_kv_heads * config.head_dim * _elem(dtype)


def mamba_bytes_per_slot(
    config: ModelConfig, state_dtype: torch.dtype, conv_dtype: torch.dtype | None = None
) -> int:
    """Bytes of one state slot (conv + ssm) over all Mamba layers."""
    cdt = conv_dtype or state_dtype
    per_layer = config.conv_dim * (config.d_conv - 1) * _elem(cdt) + (
        config.nheads * config.headdim * config.dstate * _elem(state_dtype)
    )
    return config.num_mamba_layers * per_layer


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """ "float32" | "bfloat16" | "float16" | "float64" (also "fp32", "bf16", "half", "double" ...)
    or a torch dtype -> torch dtype; ConfigError otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
        raise ConfigError(f"unsupported dtype {dtype} (float32, bfloat16, float16 or float64)")
    aliases = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
        "float64": torch.float64,
        "fp64": torch.float64,
        "double": torch.float64,
    }
    d = aliases.get(str(dtype).lower().removeprefix("torch."))
    if d is None:
        raise ConfigError(f"unsupported dtype {dtype!r} (float32, bfloat16, float16 or float64)")
    return d


__all__: Sequence[str] = [
    "ModelCaches",
    "default_state_dtype",
    "kv_bytes_per_block",
    "mamba_bytes_per_slot",
    "parse_dtype",
]
