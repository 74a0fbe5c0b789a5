"""Helpers of the tensor-parallel tests: run a function on N gloo ranks in spawned processes (the
test process is none of them), and a model's float64 logits through the test-side driver
(tests/model_fixtures.py) on one rank of a sharded model."""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, tp: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out: str) -> None:
    from hybridserve.distributed.parallel_state import destroy_tp_group, init_tp_group

    torch.set_num_threads(1)
    init_tp_group(rank, tp, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    try:
        result: Any = fn(rank, tp, *args)
        # (every rank done with its collectives before any leaves: a rank that exits while its
        # peer's last operation still reads its socket aborts that peer under load)
        torch.distributed.barrier()
    except BaseException:
        result = RuntimeError(f"rank {rank}:\n{traceback.format_exc()}")
    Path(f"{out}.{rank}").write_bytes(pickle.dumps(result))
    destroy_tp_group()
    # (the result is written: the rank ends without the interpreter's teardown, in which the
    # group's native threads, still unwinding on a loaded machine, can abort it with "terminate
    # called without an active exception")
    os._exit(0)


def run_ranks(fn: Callable[..., Any], tp: int, args: tuple[Any, ...], tmp: Path) -> list[Any]:
    """`fn(rank, tp, *args)` on `tp` spawned gloo ranks; every rank's result, in rank order."""
    out = str(tmp / f"result-{tp}")
    mp.start_processes(_entry, args=(tp, free_port(), fn, args, out), nprocs=tp, start_method="spawn")
    results = [pickle.loads(Path(f"{out}.{r}").read_bytes()) for r in range(tp)]
    errors = [str(r) for r in results if isinstance(r, BaseException)]
    if errors:
        raise RuntimeError("\n".join(errors))
    return results


def driver_logits(
    model_dir: str, tp: int, rank: int, prompts: list[list[int]], max_new: int, chunks: list[list[int] | None]
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and float64 logits of `prompts` (batched, chunked prefills, mixed rows) on
    rank `rank` of `tp` (tp 1: the whole model in this process)."""
    from model_fixtures import Driver

    lm = sharded_model(model_dir, tp, rank)
    return Driver(lm, max_seq=96, max_reqs=len(prompts)).generate(prompts, max_new, chunks=chunks)


def sharded_model(model_dir: str, tp: int, rank: int) -> Any:
    """The float64 model of `model_dir`, sharded for rank `rank` of `tp` (a LoadedModel whose
    config is the rank's shapes); its LM head computes logits on every rank."""
    from hybridserve.distributed.sharding import local_config, shard_model
    from hybridserve.model.loader import load_model

    lm = load_model(model_dir, dtype=torch.float64)
    shard_model(lm.model, lm.config, rank, tp, drop_head=False)  # every rank picks tokens
    lm.config = local_config(lm.config, tp)
    return lm


def sharded_logits(
    rank: int, tp: int, cases: list[tuple[str, list[list[int]], int, list[list[int] | None]]]
) -> list[tuple[list[list[int]], list[torch.Tensor]]]:
    """`driver_logits` of every case on this rank (run by `run_ranks`)."""
    return [driver_logits(d, tp, rank, p, n, c) for d, p, n, c in cases]


def parity_outputs(
    rank: int, tp: int, cases: list[tuple[str, list[int], list[int], int]]
) -> list[tuple[torch.Tensor, list[int], int]]:
    """Per case (model_dir, prompt, greedy prompt, tokens): the float64 logits of every position
    of `prompt` in one prefill, the greedy tokens of one request of `greedy prompt`, and how many
    sums over the ranks the prefill ran (run by `run_ranks`; the transformers parity of
    tests/model/test_model_parity.py on a sharded model)."""
    from hybridserve.distributed.parallel_state import get_tp_group
    from model_fixtures import Driver

    group = get_tp_group()
    assert group is not None
    out = []
    for model_dir, prompt, greedy_prompt, max_new in cases:
        lm = sharded_model(model_dir, tp, rank)
        drv = Driver(lm, max_seq=64, max_reqs=1)
        req = drv._new_req(0, prompt, 0, None, 0)
        before = group.num_all_reduces
        logits = drv.step([(req, prompt, False)], all_logits=True)
        sums = group.num_all_reduces - before
        tokens, _ = Driver(lm, max_seq=64, max_reqs=1).generate([greedy_prompt], max_new)
        out.append((logits, tokens[0], sums))
    return out
