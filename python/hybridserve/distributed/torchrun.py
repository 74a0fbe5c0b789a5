"""Tensor parallelism in a process group that a launcher started: `torchrun --nproc-per-node N -m
hybridserve serve MODEL -tp N` starts N copies of the command; rank 0 is the engine and serves
HTTP, every other rank runs `run_worker` (docs/tensor-parallelism.md, "Launch modes").

Every rank joins the default group from the launcher's environment (env://: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; LOCAL_RANK picks the CUDA device), then a second, gloo-only group for
the steps. Rank 0 sends each message, the workers' shard spec once and then every step's
`StepInputs`, as a `broadcast_object_list` over that second group: there is no pipe between
processes a launcher started, and a broadcast needs no address or port beyond the ones the
launcher already gave. The control group has a timeout of its own (`IDLE_TIMEOUT`), so a worker
may wait for the next step for as long as the server is idle, and it keeps the steps apart from
the forward's collectives (NCCL on CUDA). A rank that dies closes its sockets: the broadcast or
collective another rank is in fails at once, and the launcher ends the other ranks.

This module reads the environment without importing torch (`torchrun_env`); the rest imports it
when called."""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from hybridserve.distributed.group_failure import EXIT_SHUTDOWN_TIMEOUT_S, GroupFailure
from hybridserve.errors import ConfigError

logger = logging.getLogger("hybridserve.distributed")

ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# How long a worker waits for the next step (the server may be idle for that long).
IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int


def torchrun_env() -> TorchrunEnv | None:
    """The launcher's ranks when this process is one of several that torchrun (or a launcher that
    sets the same env:// variables) started, else None."""
    if not all(os.environ.get(k) for k in ENV_VARS):
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError as exc:
        raise ConfigError(f"torchrun's RANK / WORLD_SIZE / LOCAL_RANK are not integers: {exc}") from exc
    if world <= 1:
        return None
    return TorchrunEnv(rank, world, local)


def check_torchrun(tp: int) -> TorchrunEnv | None:
    """The launcher's ranks; ConfigError when its world size is not `--tensor-parallel-size`."""
    env = torchrun_env()
    if env is not None and env.world_size != tp:
        raise ConfigError(
            f"--tensor-parallel-size {tp}: this process is one of {env.world_size} that a launcher "
            f"(torchrun) started (WORLD_SIZE={env.world_size}); pass --tensor-parallel-size "
            f"{env.world_size}, or start one process and let it spawn its workers"
        )
    return env


def _join(rank: int, world: int, device: Any) -> Any:
    """Joins the launcher's default group (as the TP group) and creates the control group."""
    import torch.distributed as dist

    from hybridserve.distributed.parallel_state import init_tp_group

    init_tp_group(rank, world, "env://", device)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def _send(obj: Any, group: Any) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([obj], src=0, group=group)


def _recv(group: Any) -> Any:
    import torch.distributed as dist

    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class TorchrunExecutor(GroupFailure):
    """Rank 0 of a launcher's group: TPExecutor's interface, with the workers reached by
    broadcasts instead of pipes. The launcher owns the processes: it started them and ends them
    all when one fails."""

    def __init__(self, spec: Any, env: TorchrunEnv) -> None:
        import torch

        if env.rank != 0:
            raise ConfigError(
                f"rank {env.rank} of a torchrun group does not build an engine: only rank 0 does "
                "(`hybridserve serve` runs the worker loop on the others)"
            )
        super().__init__()
        self.spec = spec
        self.world_size = env.world_size
        self._group = _join(0, env.world_size, torch.device(spec.device))
        _send(spec, self._group)  # the workers load their shards while this rank loads its own
        # A script that ends without shutting its engine down lets the workers exit cleanly
        # (they take a closed connection for a failure, and the launcher fails the whole job).
        atexit.register(self._shutdown_at_exit)

    @property
    def pids(self) -> list[int]:
        return []  # not children of this process

    def wait_ready(self) -> None:
        """Waits until every worker has loaded its shard; ConfigError with a worker's error."""
        import torch.distributed as dist

        try:
            status: list[Any] = [None] * self.world_size
            dist.all_gather_object(status, None, group=self._group)
            errors = [f"rank {r}: {s}" for r, s in enumerate(status) if s is not None]
            if errors:
                raise ConfigError("--tensor-parallel-size: a worker failed to start: " + "; ".join(errors))
        except BaseException:
            self.shutdown()
            raise

    def send_step(self, step: Any) -> None:
        self.check_alive()
        try:
            _send(step, self._group)
        except Exception as exc:  # noqa: BLE001 - a worker is gone (its sockets closed)
            self.fail(f"a tensor-parallel worker is gone ({exc})")
            self.check_alive()

    def _shutdown_at_exit(self) -> None:
        # The "stop" broadcast waits for every worker; one still inside a step's collectives (the
        # process exits on an error mid-step) would never take it, and the exit must not wait for
        # it: the launcher ends what is left once this rank is gone.
        t = threading.Thread(target=self.shutdown, name="hybridserve-tp-exit", daemon=True)
        t.start()
        t.join(EXIT_SHUTDOWN_TIMEOUT_S)

    def check_alive(self, grace: float = 0.0) -> None:
        """Raises EngineDeadError once the group is dead (the launcher watches the processes) or
        `shutdown` told the workers to exit."""
        self.raise_if_dead()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Tells the workers to exit and leaves the groups."""
        from hybridserve.distributed.parallel_state import destroy_tp_group

        if self._closing:
            return
        self._closing = True
        atexit.unregister(self._shutdown_at_exit)
        if self.dead_reason is None:
            try:
                _send(None, self._group)
            except Exception:  # noqa: BLE001 - a worker already gone (the launcher ends them)
                logger.debug("telling the workers to exit failed", exc_info=True)
        try:
            destroy_tp_group()
        except Exception:  # noqa: BLE001
            logger.debug("leaving the process group failed", exc_info=True)


def run_worker(env: TorchrunEnv, device: str | None) -> int:
    """The worker loop of rank `env.rank` > 0: joins the group, receives the shard spec from rank
    0, loads its shard, then runs every step it is sent until rank 0 sends None (0) or is gone
    (1). `device`: the `--device` every rank was given ("cpu", "cuda"); a CUDA rank takes
    `cuda:LOCAL_RANK`."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s tp-rank-{env.rank}: %(message)s",
        stream=sys.stderr,
    )
    import torch

    from hybridserve.distributed.parallel_state import destroy_tp_group
    from hybridserve.distributed.worker import ShardRunner, ignore_stop_signals

    ignore_stop_signals()
    dev = torch.device(f"cuda:{env.local_rank}" if (device or "cpu").startswith("cuda") else "cpu")
    group = _join(env.rank, env.world_size, dev)
    spec = _recv(group)
    torch.set_num_threads(spec.cpu_threads)
    error: str | None = None
    runner: ShardRunner | None = None
    try:
        runner = ShardRunner(spec, env.rank, device=str(dev))
    except BaseException as exc:  # reported to rank 0, which fails its start with it
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    import torch.distributed as dist

    status: list[str | None] = [None] * env.world_size
    dist.all_gather_object(status, error, group=group)
    if runner is None:
        return 1
    logger.info("rank %d of %d ready", env.rank, env.world_size)
    try:
        while True:
            step = _recv(group)
            if step is None:  # the engine shuts down
                break
            runner.run(step)
    except Exception:
        logger.exception("the engine is gone or a step failed; exiting")
        return 1
    destroy_tp_group()
    return 0
