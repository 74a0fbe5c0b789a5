"""A tensor-parallel worker: one process per rank other than 0. It loads the whole checkpoint,
keeps its shard, allocates its shard of the KV and state pools under the same block and slot ids
as rank 0, and then runs every step rank 0 sends it: the same copies and the same forward (its
collectives meet rank 0's); it samples nothing.

Steps arrive over a pipe from the engine, not over a collective: an idle worker waits on the
pipe with no timeout, and the end of the pipe (the engine is gone, whichever way) ends the
worker. Any error ends the worker with a non-zero status; the engine sees it and stops."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

logger = logging.getLogger("hybridserve.distributed")


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its shard (picklable; no torch objects)."""

    model_dir: str
    dtype: str  # a torch dtype's name: "float64", "float32", ...
    device: str  # "cpu" or "cuda:N" of rank 0 (rank r takes index N + r)
    num_kv_blocks: int
    block_size: int
    num_mamba_slots: int
    world_size: int
    init_method: str
    cpu_threads: int
    mamba_ssm_cache_dtype: str = "auto"  # --mamba-ssm-cache-dtype
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype
    load_format: str = "auto"  # --load-format ("dummy": every rank draws the same full weights)
    tokenizer_dir: str | None = None  # --tokenizer (None: the model folder's)


@dataclass
class StepInputs:
    """What every rank needs of one step: the copies, and the forward's arrays (None when no token
    is scheduled). `batch` holds the ForwardBatch fields as numpy arrays (model/batch.py)."""

    kv_copies: np.ndarray
    state_copies: np.ndarray
    batch: dict[str, np.ndarray] | None
    num_decodes: int


def rank_device(device: str, rank: int) -> str:
    if device.startswith("cuda"):
        base = int(device.split(":")[1]) if ":" in device else 0
        return f"cuda:{base + rank}"
    return device


class ShardRunner:
    """The model shard and its caches on one rank (on `device`, else the rank's device after
    rank 0's); `run` executes one step's inputs."""

    def __init__(self, spec: WorkerSpec, rank: int, device: str | None = None) -> None:
        import torch

        from hybridserve.distributed.sharding import local_config, shard_model
        from hybridserve.kernels import backend
        from hybridserve.model.batch import HostStaging
        from hybridserve.model.cache_tensors import ModelCaches, default_state_dtype, kv_cache_dtype
        from hybridserve.model.loader import load_model

        dev = torch.device(device or rank_device(spec.device, rank))
        dtype = getattr(torch, spec.dtype)
        loaded = load_model(
            spec.model_dir,
            dtype=dtype,
            device=dev,
            load_format=spec.load_format,
            tokenizer_dir=spec.tokenizer_dir,
        )
        shard_model(loaded.model, loaded.config, rank, spec.world_size)
        self.device = dev
        self.model = loaded.model
        self.caches = ModelCaches(
            local_config(loaded.config, spec.world_size),
            num_blocks=spec.num_kv_blocks,
            block_size=spec.block_size,
            num_slots=spec.num_mamba_slots,
            kv_dtype=kv_cache_dtype(dtype, spec.kv_cache_dtype),
            state_dtype=default_state_dtype(loaded.config, dtype, spec.mamba_ssm_cache_dtype),
            device=dev,
        )
        backend.pin(backend.resolve(dev))
        # on an accelerator a step's input arrays move in one copy from a buffer kept here
        self.staging = HostStaging(dev) if dev.type != "cpu" else None

    def run(self, step: StepInputs) -> None:
        import torch

        from hybridserve.model.batch import forward_batch_from_arrays

        if len(step.kv_copies):
            self.caches.apply_kv_copies(torch.from_numpy(np.ascontiguousarray(step.kv_copies)))
        if len(step.state_copies):
            self.caches.apply_state_copies(torch.from_numpy(np.ascontiguousarray(step.state_copies)))
        if step.batch is not None:
            batch = forward_batch_from_arrays(step.batch, step.num_decodes, self.device, self.staging)
            with torch.inference_mode():
                self.model.forward(batch, self.caches)


def ignore_stop_signals() -> None:
    """A worker ends when rank 0 tells it to or is gone, never on SIGINT or SIGTERM: a Ctrl-C in
    a terminal, a service manager's stop and torchrun's forwarding reach every process of the
    group at once, and a worker that died then would break the step of every request that rank 0
    is draining. (Rank 0 kills a worker that does not end by itself; torchrun kills its ranks
    after its grace period.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def worker_main(spec: WorkerSpec, rank: int, conn: Connection) -> None:
    """The process entry point of rank `rank` (spawned by executor.TPExecutor)."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank-{rank}: %(message)s", stream=sys.stderr
    )
    ignore_stop_signals()
    code = 0
    try:
        import torch

        from hybridserve.distributed.parallel_state import destroy_tp_group, init_tp_group

        torch.set_num_threads(spec.cpu_threads)
        conn.send(("joining", None))
        init_tp_group(rank, spec.world_size, spec.init_method, torch.device(rank_device(spec.device, rank)))
        runner = ShardRunner(spec, rank)
        conn.send(("ready", None))
    except BaseException as exc:  # reported to the engine, which fails its start with it
        _send_quietly(conn, ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        os._exit(1)
    try:
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                logger.info("the engine is gone; exiting")
                break
            step: StepInputs | None = pickle.loads(data)
            if step is None:  # the engine shuts down
                break
            runner.run(step)
    except BaseException:
        logger.exception("step failed; exiting")
        code = 1
    if code == 0:
        try:
            destroy_tp_group()
        except Exception:  # noqa: BLE001 - the group may be broken when the engine died
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _send_quietly(conn: Connection, msg: Any) -> None:
    try:
        conn.send(msg)
    except OSError:
        pass
