"""The engine's side of tensor parallelism: rank 0 is the engine process; `TPExecutor` spawns
ranks 1 .. N-1 (as vLLM's multiprocessing executor does), joins them in one process group, sends
each step's inputs to every worker before rank 0 runs the same step, and watches them.

- A worker that dies (a crash, SIGKILL, out of memory) is seen at once by a watchdog thread on
  the processes' sentinels; the collective rank 0 may be waiting in fails as soon as the dead
  rank's sockets close. `dead_reason` then says why, and the engine fails its requests and stops.
- Workers are daemonic children: they end with the engine (an exit handler shuts them down when
  the process exits without `LLMEngine.shutdown`; a worker also ends when its pipe from the engine
  closes, so an engine killed outright leaves no worker behind either).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import pickle
import socket
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from hybridserve.distributed.group_failure import EXIT_SHUTDOWN_TIMEOUT_S, GroupFailure
from hybridserve.distributed.parallel_state import collective_timeout_s, destroy_tp_group, init_tp_group
from hybridserve.distributed.worker import StepInputs, WorkerSpec, worker_main
from hybridserve.errors import ConfigError

logger = logging.getLogger("hybridserve.distributed")

# Seconds a worker may take to load its shard and allocate its caches.
START_TIMEOUT_S = 600.0


def _exit_status(proc: BaseProcess) -> int | None:
    """The exit status of a worker whose sentinel is ready: reaped first (it may not be yet)."""
    proc.join(1.0)
    return proc.exitcode


def _exited(rank: int, proc: BaseProcess) -> str:
    """Why the group is dead: a worker exited (with its status, when it could be reaped)."""
    code = _exit_status(proc)
    return f"tensor-parallel worker rank {rank} exited" + ("" if code is None else f" with status {code}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TPExecutor(GroupFailure):
    """Spawns and owns the workers of ranks 1 .. N-1; this process is rank 0."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.world_size = spec.world_size
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._stop_r, self._stop_w = mp.Pipe(duplex=False)
        ctx = mp.get_context("spawn")
        for rank in range(1, self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=worker_main, args=(spec, rank, child), name=f"hybridserve-tp-rank-{rank}", daemon=True
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        try:
            self._expect("joining", time.monotonic() + START_TIMEOUT_S)
            try:
                init_tp_group(0, self.world_size, spec.init_method, torch.device(spec.device))
            except Exception as exc:
                # (the join waits for every rank: one that failed in it leaves this rank a timeout
                # that names no cause, and its own error in its pipe)
                why = self._failed_worker()
                if why is None:
                    raise
                raise ConfigError(f"--tensor-parallel-size: {why}") from exc
        except BaseException:
            self._kill_all()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="hybridserve-tp-watchdog", daemon=True)
        self._watchdog.start()
        # A process that exits without shutting the engine down (a script done with its `LLM`)
        # ends the workers here, first: multiprocessing's own exit handler, which runs after this
        # one, terminates them, and the watchdog would take that for a dead worker.
        atexit.register(self._shutdown_at_exit)

    @classmethod
    def spec_for(
        cls,
        model_dir: str,
        dtype: torch.dtype,
        device: torch.device,
        world_size: int,
        num_kv_blocks: int,
        block_size: int,
        num_mamba_slots: int,
        mamba_ssm_cache_dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        load_format: str = "auto",
        tokenizer_dir: str | None = None,
    ) -> WorkerSpec:
        return WorkerSpec(
            model_dir=model_dir,
            dtype=str(dtype).removeprefix("torch."),
            device=str(device),
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            num_mamba_slots=num_mamba_slots,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{_free_port()}",
            cpu_threads=torch.get_num_threads(),
            mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
            kv_cache_dtype=kv_cache_dtype,
            load_format=load_format,
            tokenizer_dir=tokenizer_dir,
        )

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._procs]

    def wait_ready(self) -> None:
        """Waits until every worker has loaded its shard; ConfigError with a worker's error."""
        try:
            self._expect("ready", time.monotonic() + START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def _expect(self, what: str, deadline: float) -> None:
        """Waits for message `what` from every worker; ConfigError when one fails or exits."""
        pending = dict(zip(self._conns, range(1, self.world_size)))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConfigError(
                    f"--tensor-parallel-size: worker rank(s) {sorted(pending.values())} did not start"
                )
            sentinels = {self._procs[r - 1].sentinel: r for r in pending.values()}
            for ready in wait([*pending, *sentinels], timeout=left):
                if ready in sentinels:
                    rank = sentinels[ready]
                    code = _exit_status(self._procs[rank - 1])
                    raise ConfigError(
                        f"--tensor-parallel-size: worker rank {rank} exited with status {code} while starting "
                        "(its error is above; a script that starts an engine with tensor parallelism needs its "
                        'code under `if __name__ == "__main__":`, as the spawned workers import it)'
                    )
                conn: Connection = ready  # type: ignore[assignment]
                if conn not in pending:
                    continue
                try:
                    kind, detail = conn.recv()
                except (EOFError, OSError):
                    continue  # its sentinel says more
                rank = pending.pop(conn)
                if kind == "error":
                    raise ConfigError(f"--tensor-parallel-size: worker rank {rank} failed to start: {detail}")
                if kind != what:
                    raise ConfigError(
                        f"--tensor-parallel-size: worker rank {rank} sent {kind!r}, not {what!r}"
                    )

    def _failed_worker(self) -> str | None:
        """Why a worker failed, where one said so or exited, or None. The peers of a worker that
        failed inside the group's join time out waiting for it, with torch.distributed's errors
        (DistStoreError, ...): an error of another kind, then a worker that exited without a
        word, is the cause, and is named first."""
        own: list[str] = []
        exited: list[str] = []
        waited: list[str] = []
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns), start=1):
            try:
                if conn.poll(0.5):
                    kind, detail = conn.recv()
                    if kind == "error":
                        why = f"worker rank {rank} failed to start: {detail}"
                        (waited if str(detail).startswith("Dist") else own).append(why)
                        continue
            except (EOFError, OSError):
                pass  # (gone: its exit status says more)
            if proc.sentinel in wait([proc.sentinel], timeout=0):
                exited.append(_exited(rank, proc))
        return next(iter([*own, *exited, *waited]), None)

    def send_step(self, step: StepInputs) -> None:
        """Hands the step's inputs to every worker (before rank 0 runs it)."""
        self.check_alive()
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError as exc:
                self.fail(f"tensor-parallel worker rank {rank} is gone ({exc})")
                self.check_alive()

    def check_alive(self, grace: float = 0.0) -> None:
        """Raises EngineDeadError once the group is dead; a worker process that has exited makes
        it so, and so does `shutdown`. `grace`: seconds to wait for one to exit first (after a
        failed step, a worker killed a moment ago is still being torn down when its peers'
        collectives break)."""
        if self.dead_reason is None and not self._closing:
            # a worker's sentinel closes as it exits, a moment before it can be reaped (until then
            # `is_alive()` still says True): the sentinel is what tells
            ready = wait([p.sentinel for p in self._procs], timeout=grace)
            for rank, p in enumerate(self._procs, start=1):
                if p.sentinel in ready:
                    self.fail(_exited(rank, p))
        self.raise_if_dead()

    def _watch(self) -> None:
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs, start=1)}
        live = dict(sentinels)
        while live:
            ready = wait([*live, self._stop_r])
            if self._stop_r in ready:
                return
            for s in ready:
                rank = live.pop(s)
                if not self._closing:
                    self.fail(_exited(rank, self._procs[rank - 1]))

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops the workers (asks, then kills one that did not end) and leaves the process group."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self._shutdown_at_exit)
        try:
            self._stop_w.send_bytes(b"")
        except OSError:
            pass
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        for conn in self._conns:
            conn.close()
        try:
            destroy_tp_group()
        except Exception:  # noqa: BLE001 - a broken group (a rank died) is left as it is
            logger.debug("leaving the process group failed", exc_info=True)

    def _shutdown_at_exit(self) -> None:
        # Idle workers read the stop message at once; one blocked in a collective (the process is
        # exiting on an error mid-step) would not, and the exit should not wait long for it.
        self.shutdown(timeout=0.0 if self.dead_reason is not None else EXIT_SHUTDOWN_TIMEOUT_S)

    def _kill_all(self) -> None:
        # (a worker ignores SIGTERM, which a terminal or a service manager sends the whole group:
        # one that did not end by itself is killed)
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(2.0)


__all__ = ["StepInputs", "TPExecutor", "WorkerSpec", "collective_timeout_s"]
