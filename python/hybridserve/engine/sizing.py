"""How many KV blocks and Mamba state slots the engine allocates.

Defaults, when neither a memory budget nor an explicit count is given:
- KV: enough blocks for `max_num_seqs` sequences of `max_model_len` tokens (plus spec lookahead),
  capped at DEFAULT_KV_CACHE_MEMORY bytes.
- Mamba: one window of 1 + K slots per running sequence, plus a checkpoint reserve of
  max(64, 4 * max_num_seqs) slots when prefix caching can hit, capped at DEFAULT_MAMBA_CACHE_MEMORY.
Windows are never cut: a budget that cannot hold `max_num_seqs` windows is a configuration error.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.errors import ConfigError

DEFAULT_KV_CACHE_MEMORY = 1 << 30
DEFAULT_MAMBA_CACHE_MEMORY = 1 << 30


@dataclass(frozen=True)
class CacheSizes:
    num_kv_blocks: int  # including the null block 0
    num_mamba_slots: int  # including the null slot 0
    kv_bytes_per_block: int
    mamba_bytes_per_slot: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def compute_cache_sizes(
    *,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    num_speculative_tokens: int,
    prefix_caching_can_hit: bool,
    kv_bytes_per_token: int,
    mamba_bytes_per_slot: int,
    has_mamba_layers: bool,
    kv_cache_memory: int | None = None,
    mamba_cache_memory: int | None = None,
    num_kv_blocks: int | None = None,
    num_mamba_slots: int | None = None,
) -> CacheSizes:
    kv_bytes_per_block = kv_bytes_per_token * block_size
    per_seq_blocks = _cdiv(max_model_len + num_speculative_tokens, block_size)
    if num_kv_blocks is None:
        wanted = max_num_seqs * per_seq_blocks + 1
        budget = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
        if kv_bytes_per_block > 0:
            fits = budget // kv_bytes_per_block
            num_kv_blocks = int(min(wanted, fits) if kv_cache_memory is None else fits)
        else:
            num_kv_blocks = wanted
    if num_kv_blocks < per_seq_blocks + 1:
        raise ConfigError(
            f"the KV cache holds {num_kv_blocks} blocks of {block_size} tokens, fewer than one sequence of "
            f"--max-model-len {max_model_len} needs ({per_seq_blocks + 1}); raise --kv-cache-memory or "
            "--num-kv-blocks, or lower --max-model-len"
        )

    window = 1 + num_speculative_tokens
    min_slots = 1 + max_num_seqs * window if has_mamba_layers else 1
    if num_mamba_slots is None:
        if not has_mamba_layers:
            num_mamba_slots = 1
        else:
            reserve = max(64, 4 * max_num_seqs) if prefix_caching_can_hit else 0
            wanted = min_slots + reserve
            budget = DEFAULT_MAMBA_CACHE_MEMORY if mamba_cache_memory is None else mamba_cache_memory
            fits = budget // max(1, mamba_bytes_per_slot)
            num_mamba_slots = int(min(wanted, fits) if mamba_cache_memory is None else fits)
    if num_mamba_slots < min_slots:
        raise ConfigError(
            f"the Mamba state cache holds {num_mamba_slots} slots but {max_num_seqs} running sequences "
            f"with windows of {window} slots need {min_slots}; raise --mamba-cache-memory or "
            "--num-mamba-slots, or lower --max-num-seqs"
        )
    return CacheSizes(num_kv_blocks, num_mamba_slots, kv_bytes_per_block, mamba_bytes_per_slot)
