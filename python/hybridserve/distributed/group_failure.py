"""Why a tensor-parallel group became unusable: the state both executors (workers spawned here,
`executor.TPExecutor`, or started by a launcher, `torchrun.TorchrunExecutor`) keep, so that they
report a failure the same way. Imports no torch (torchrun.py reads its environment without it)."""

from __future__ import annotations

import logging

from hybridserve.errors import EngineDeadError

logger = logging.getLogger("hybridserve.distributed")

# Why an engine whose workers were stopped (`LLMEngine.stop_workers`, `shutdown`) runs no step
WORKERS_STOPPED = "the tensor-parallel workers were stopped (stop_workers or shutdown)"
# How long an exit that did not shut the engine down waits for the workers to stop by themselves
# (idle workers take the stop at once; on a loaded machine 2 s did not always suffice, and a
# process that exits while its shutdown thread is inside the process group's native code dies with
# "terminate called without an active exception"). Only a worker stuck inside a step's
# collectives makes the exit wait this long.
EXIT_SHUTDOWN_TIMEOUT_S = 10.0


class GroupFailure:
    """`dead_reason`: the first failure's reason (None while the group is usable). The first
    reason wins: a dead rank makes the others fail too, and the cause is the one to report.
    `_closing`: `shutdown` told the workers to exit; no step runs after it either."""

    def __init__(self) -> None:
        self.dead_reason: str | None = None
        self._closing = False

    def fail(self, reason: str) -> None:
        """Marks the group unusable (a step failed part way: the ranks may be out of step)."""
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.error("%s: the engine stops", reason)

    def raise_if_dead(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._closing:
            raise EngineDeadError(WORKERS_STOPPED)
