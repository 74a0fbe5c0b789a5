"""How many KV blocks and Mamba state slots the engine allocates.

Defaults, when neither a memory budget nor an explicit count is given:
- KV: enough blocks for `max_num_seqs` sequences of `max_model_len` tokens (plus spec lookahead),
  capped at DEFAULT_KV_CACHE_MEMORY bytes.
- Mamba: one window of 1 + K slots per running sequence, plus a checkpoint reserve of
  max(64, 4 * max_num_seqs) slots when prefix caching can hit, capped at DEFAULT_MAMBA_CACHE_MEMORY.
Windows are never cut. The state pool's capacity is the number of sequences it can run at once:
each holds its window and, when prefix caching can hit, leaves one slot for a checkpoint
(`state_pool_capacity`). When `max_num_seqs` was not given and the pool's capacity is below the
default, `max_num_seqs` is lowered to the capacity; a given `max_num_seqs` whose windows do not
fit is a configuration error that names the capacity.

One total budget (`--cache-memory`) is split before the rules above apply (`split_cache_memory`):
- with one of `--kv-cache-memory` / `--mamba-cache-memory` also given, the other pool gets the rest;
- else the Mamba pool gets the bytes of the slots it wants by default (windows + checkpoint
  reserve), but no more than half of the total unless its windows alone need more; the KV pool
  gets the rest. When `max_num_seqs` was not given, the windows never take the bytes the KV pool
  needs for one sequence of `max_model_len`: `max_num_seqs` is lowered to the slots left instead. A model without Mamba layers gives everything to KV, one without attention
  everything to the state pool.
Explicit counts (`--num-kv-blocks`, `--num-mamba-slots`) still override the bytes of their pool;
the bytes such a count leaves unused are not moved to the other pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve import _core
from hybridserve.errors import ConfigError

DEFAULT_KV_CACHE_MEMORY = 1 << 30
DEFAULT_MAMBA_CACHE_MEMORY = 1 << 30


@dataclass(frozen=True)
class CacheSizes:
    num_kv_blocks: int  # including the null block 0
    num_mamba_slots: int  # including the null slot 0
    kv_bytes_per_block: int
    mamba_bytes_per_slot: int
    #: Sequences the engine runs at once: the given max_num_seqs, or the default lowered to the
    #: state pool's capacity.
    max_num_seqs: int
    #: Sequences the state pool can run with their windows and one checkpoint slot each
    #: (`state_pool_capacity`); the largest max_num_seqs allowed for a model without Mamba layers.
    state_pool_capacity: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_cache_memory(
    cache_memory: int,
    *,
    kv_cache_memory: int | None,
    mamba_cache_memory: int | None,
    wanted_mamba_slots: int,
    min_mamba_slots: int,
    mamba_bytes_per_slot: int,
    has_attention_layers: bool,
    has_mamba_layers: bool,
    min_kv_bytes: int = 0,
) -> tuple[int, int]:
    """(kv bytes, mamba bytes) of one total budget; see the module docstring. `min_kv_bytes`: what
    the windows leave to the KV pool at least (0 when max_num_seqs is the user's)."""
    if kv_cache_memory is not None and mamba_cache_memory is not None:
        raise ConfigError(
            "--cache-memory is the total of --kv-cache-memory and --mamba-cache-memory: give at most one of them with it"
        )
    for given, flag, kv_given in (
        (kv_cache_memory, "--kv-cache-memory", True),
        (mamba_cache_memory, "--mamba-cache-memory", False),
    ):
        if given is None:
            continue
        rest = cache_memory - given
        if rest < 1:
            raise ConfigError(
                f"{flag} {given} leaves nothing of --cache-memory {cache_memory} for the other pool"
            )
        return (given, rest) if kv_given else (rest, given)
    if not has_mamba_layers:
        return cache_memory, 0
    if not has_attention_layers:
        return 0, cache_memory
    mamba = min(wanted_mamba_slots * mamba_bytes_per_slot, cache_memory // 2)
    mamba = max(mamba, min(min_mamba_slots * mamba_bytes_per_slot, cache_memory))
    if 0 < min_kv_bytes < cache_memory:
        mamba = min(mamba, cache_memory - min_kv_bytes)
    return cache_memory - mamba, mamba


def min_mamba_slots(max_num_seqs: int, num_speculative_tokens: int, has_mamba_layers: bool) -> int:
    """The slots the Mamba pool needs at least: a window of 1 + K for every running sequence, and
    the null slot."""
    return 1 + max_num_seqs * (1 + num_speculative_tokens) if has_mamba_layers else 1


def state_pool_capacity(
    num_mamba_slots: int, num_speculative_tokens: int, prefix_caching_can_hit: bool, has_mamba_layers: bool
) -> int:
    """Sequences a state pool of `num_mamba_slots` slots (the null slot counted) can run at once.
    Each holds a window of 1 + K slots; with prefix caching it also leaves one slot for a
    checkpoint, because branch placement keeps one per prompt that branches and one at the last
    token of every finished sequence: a pool with fewer checkpoint slots than running sequences
    evicts checkpoints before anyone can reuse them."""
    if not has_mamba_layers:
        return _core.FLAG_LIMITS["max_num_seqs"][1]
    per_seq = 1 + num_speculative_tokens + (1 if prefix_caching_can_hit else 0)
    return max(0, (num_mamba_slots - 1) // per_seq)


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
    cache_memory: int | None = None,
    max_num_seqs_auto: bool = False,
) -> CacheSizes:
    """Pool sizes for the budgets and counts given (see the module docstring). `max_num_seqs_auto`:
    max_num_seqs is the default rather than the user's, so it may be lowered to the capacity."""
    kv_bytes_per_block = kv_bytes_per_token * block_size
    per_seq_blocks = _cdiv(max_model_len + num_speculative_tokens, block_size)
    window = 1 + num_speculative_tokens
    min_slots = min_mamba_slots(max_num_seqs, num_speculative_tokens, has_mamba_layers)
    reserve = max(64, 4 * max_num_seqs) if prefix_caching_can_hit else 0
    if cache_memory is not None:
        kv_cache_memory, mamba_cache_memory = split_cache_memory(
            cache_memory,
            kv_cache_memory=kv_cache_memory,
            mamba_cache_memory=mamba_cache_memory,
            wanted_mamba_slots=min_slots + reserve,
            min_mamba_slots=min_slots,
            mamba_bytes_per_slot=mamba_bytes_per_slot,
            has_attention_layers=kv_bytes_per_token > 0,
            has_mamba_layers=has_mamba_layers,
            min_kv_bytes=(per_seq_blocks + 1) * kv_bytes_per_block if max_num_seqs_auto else 0,
        )
    if num_mamba_slots is None:
        if not has_mamba_layers:
            num_mamba_slots = 1
        else:
            wanted = min_slots + reserve
            budget = DEFAULT_MAMBA_CACHE_MEMORY if mamba_cache_memory is None else mamba_cache_memory
            fits = budget // max(1, mamba_bytes_per_slot)
            num_mamba_slots = min(
                int(min(wanted, fits) if mamba_cache_memory is None else fits), _core.MAX_MAMBA_SLOTS
            )
    capacity = state_pool_capacity(
        num_mamba_slots, num_speculative_tokens, prefix_caching_can_hit, has_mamba_layers
    )
    if max_num_seqs_auto and capacity < max_num_seqs:
        if capacity < 1:
            per_seq = 1 + window + (1 if prefix_caching_can_hit else 0)
            raise ConfigError(
                f"the Mamba state cache holds {num_mamba_slots} slots, fewer than one sequence needs "
                f"({per_seq}: the null slot, a window of {window}"
                + (" and a checkpoint slot" if prefix_caching_can_hit else "")
                + "); raise --mamba-cache-memory (or --cache-memory) or --num-mamba-slots"
            )
        max_num_seqs = capacity
        min_slots = min_mamba_slots(max_num_seqs, num_speculative_tokens, has_mamba_layers)
    if num_mamba_slots < min_slots:
        runs = (num_mamba_slots - 1) // window
        raise ConfigError(
            f"the Mamba state cache holds {num_mamba_slots} slots but --max-num-seqs {max_num_seqs} "
            f"running sequences with windows of {window} slot{'s' if window > 1 else ''} need {min_slots}, "
            "counting the null slot; "
            + (
                f"it can run {runs} (lower --max-num-seqs to {runs}, or leave it unset to have it lowered), "
                if runs > 0
                else "it cannot run even one, "
            )
            + "or raise --mamba-cache-memory (or --cache-memory) or --num-mamba-slots"
        )
    if num_kv_blocks is None:
        wanted = max_num_seqs * per_seq_blocks + 1
        budget = DEFAULT_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
        if kv_bytes_per_block > 0:
            fits = budget // kv_bytes_per_block
            # a budget beyond what the scheduler can track is capped (an explicit count is not)
            num_kv_blocks = min(
                int(min(wanted, fits) if kv_cache_memory is None else fits), _core.MAX_KV_BLOCKS
            )
        else:
            # no attention layers: the blocks hold no tensors, only the token bookkeeping, so no
            # budget caps them; the scheduler's limit still does (a model without attention was
            # refused with block_size 1 and many sequences, naming no flag)
            num_kv_blocks = min(wanted, _core.MAX_KV_BLOCKS)
    if num_kv_blocks < per_seq_blocks + 1:
        raise ConfigError(
            f"the KV cache holds {num_kv_blocks} blocks of {block_size} tokens, fewer than one sequence of "
            f"--max-model-len {max_model_len} needs ({per_seq_blocks + 1}); raise --kv-cache-memory "
            "(or --cache-memory) or --num-kv-blocks, or lower --max-model-len"
        )
    return CacheSizes(
        num_kv_blocks,
        num_mamba_slots,
        kv_bytes_per_block,
        mamba_bytes_per_slot,
        max_num_seqs=max_num_seqs,
        state_pool_capacity=capacity,
    )
