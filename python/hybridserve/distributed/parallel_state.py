"""The tensor-parallel group of this process: its rank, its size, and the one collective the
sharded layers need (a sum over the ranks). With no group (a single process) nothing here is
called: the layers are only replaced by their sharded forms when the size is above 1.

NCCL on CUDA devices, gloo on the CPU. Gloo has no bfloat16 / float16 sum on every build: those
are summed in float32 and cast back (the same on every rank, so every rank still holds the same
bits)."""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridserve.errors import ConfigError

# Seconds a collective (or the start of the group) may wait for another rank. A rank that died is
# noticed at once (its sockets close); this only bounds a rank that hangs.
DEFAULT_TIMEOUT_S = 300.0
# The longest that torch.distributed takes (about 31 years: "never" in practice); from about 1e10 s
# on, its connect timeout in milliseconds overflows, and the start fails with no word of why.
MAX_TIMEOUT_S = 1e9


@dataclass
class TPGroup:
    rank: int
    world_size: int
    backend: str
    # what this process summed over the group so far (the benchmark reads them)
    num_all_reduces: int = 0
    all_reduced_bytes: int = 0


_GROUP: TPGroup | None = None


def collective_timeout_s() -> float:
    """`HYBRIDSERVE_TP_TIMEOUT_S` (seconds, a finite number above 0), else DEFAULT_TIMEOUT_S;
    ConfigError naming the variable for any other value."""
    v = os.environ.get("HYBRIDSERVE_TP_TIMEOUT_S", "").strip()
    if not v:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(v)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds <= MAX_TIMEOUT_S):
        raise ConfigError(
            f"HYBRIDSERVE_TP_TIMEOUT_S must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:,.0f}, got {v!r}"
        )
    return seconds


def init_tp_group(rank: int, world_size: int, init_method: str, device: torch.device) -> TPGroup:
    """Joins the default process group (every rank calls it with the same `init_method`)."""
    global _GROUP
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        raise ConfigError(
            "--tensor-parallel-size: this process already belongs to a torch.distributed process group "
            "(an engine with tensor parallelism that was not shut down?)"
        )
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=collective_timeout_s()),
    )
    _GROUP = TPGroup(rank=rank, world_size=world_size, backend=backend)
    return _GROUP


def adopt_tp_group() -> TPGroup:
    """The default group that a launcher (torchrun) already set up, as the TP group."""
    global _GROUP
    _GROUP = TPGroup(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=dist.get_backend())
    return _GROUP


def get_tp_group() -> TPGroup | None:
    return _GROUP


def destroy_tp_group() -> None:
    global _GROUP
    _GROUP = None
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_(t: torch.Tensor) -> torch.Tensor:
    """Sums `t` over the TP group, in place; returns it."""
    g = _GROUP
    if g is None or g.world_size == 1:
        return t
    g.num_all_reduces += 1
    g.all_reduced_bytes += t.numel() * t.element_size()
    if g.backend == "gloo" and t.dtype in (torch.bfloat16, torch.float16):
        wide = t.float()
        dist.all_reduce(wide)
        t.copy_(wide)
        return t
    if not t.is_contiguous():
        c = t.contiguous()
        dist.all_reduce(c)
        t.copy_(c)
        return t
    dist.all_reduce(t)
    return t
