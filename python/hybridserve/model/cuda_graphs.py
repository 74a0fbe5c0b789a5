"""CUDA graphs of decode and verify steps.

On a GPU a step of decode rows is a few hundred small kernel launches whose work takes less time
than launching them: the step's time is the host's. A CUDA graph records the launches of one
step shape once and replays them with one call. What a graph reads, it reads at the addresses it
was captured with, so each shape has static input buffers that every step of that shape is copied
into (one host-to-device copy), and the weights and caches it reads stay where they are for the
engine's life (the weights may be written in place: a write is seen by the next replay, and
`DecodeGraphs` captures again after one, since a layer may derive constants from a weight).

A shape is (rows, tokens per row, KV blocks per row):
- rows: the step's rows rounded up to one of `CAPTURE_ROWS` (at most the engine's max_num_seqs).
  The padding rows compute on token 0 at position 0 and write nothing real: their Mamba reads
  and writes go to the null slot 0 (a read of it is the zero state, a write to it is skipped) and
  their K/V to the null block 0, which no row reads unmasked;
- tokens per row: 1 for decode rows, up to 1 + K for verify rows: the longest row's. A shorter
  row (fewer drafts) is padded after its last token with tokens that compute as padding rows do:
  their state writes go to the null slot and their K/V to the null block, so the row's own
  tokens neither see them nor are changed by them, and their logits are dropped;
- blocks per row: the longest row's blocks rounded up to a power of two (at least
  `MIN_BLOCKS`), so that the attention of a step reads at most twice the keys it needs.

Graphs are captured when a shape is first met, not at start-up. Any step with prefill rows, with
logits other than every token's, or past the largest shape runs eagerly, as does every step
after a capture fails (the model then does something a graph cannot hold, such as a host sync;
the log says what). The graphs of all shapes share one memory pool: they never run at once, and
each step's logits are copied out of the pool before the next replay.

On the CPU (tests) the same class runs each shape's function on its static buffers instead of
replaying a graph: everything but the capture itself is the same code.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from hybridserve.model.batch import ForwardBatch, HostStaging
from hybridserve.model.cache_tensors import ModelCaches
from hybridserve.model.forward_context import ForwardContext

logger = logging.getLogger("hybridserve.engine")

# Row counts a graph is captured for (a step's rows are rounded up to the next one). Beyond the
# largest a step is long enough that launching its kernels is a small share of it.
CAPTURE_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# The fewest KV blocks per row a graph reads (short contexts share one shape).
MIN_BLOCKS = 4

_VERSION = operator.attrgetter("_version")
_EMPTY64 = torch.zeros(0, dtype=torch.int64)
_EMPTY_BOOL = torch.zeros(0, dtype=torch.bool)
_ZERO_QSL = torch.zeros(1, dtype=torch.int64)


class StepArrays(Protocol):
    """A step's arrays by ForwardBatch field name (a dict of them, or the scheduler's output
    through `SchedulerArrays`)."""

    def __getitem__(self, name: str, /) -> np.ndarray: ...


class SchedulerArrays:
    """The arrays of a scheduler output, read by name as a graph needs them (each read is a
    getter of the Rust object)."""

    def __init__(self, out: Any) -> None:
        self.out = out

    def __getitem__(self, name: str, /) -> np.ndarray:
        return np.asarray(getattr(self.out, name))


@dataclass(frozen=True)
class GraphShape:
    rows: int
    tokens_per_row: int
    blocks_per_row: int

    @property
    def num_tokens(self) -> int:
        return self.rows * self.tokens_per_row


def capture_rows(max_rows: int) -> tuple[int, ...]:
    """The row counts graphs are captured for when at most `max_rows` rows run at once."""
    sizes = [r for r in CAPTURE_ROWS if r < max_rows]
    return (*sizes, min(max_rows, CAPTURE_ROWS[-1]))


def graph_shape(
    arrays: StepArrays,
    num_decodes: int,
    block_size: int,
    rows: tuple[int, ...],
    max_tokens_per_row: int,
    max_blocks_per_row: int,
) -> GraphShape | None:
    """The shape of the graph that runs this step (the scheduler's arrays), or None when it
    runs eagerly: prefill rows, rows of different lengths, logits other than every token's in
    order, emitted checkpoints, more rows or longer rows than any graph holds. Rows shorter than
    the longest (verify rows with fewer drafts) are padded to its length."""
    qsl = np.asarray(arrays["query_start_loc"])
    R = len(qsl) - 1
    if R < 1 or num_decodes != R or R > rows[-1] or len(arrays["emit_row"]):
        return None
    T = int(qsl[-1])
    lengths = np.diff(qsl)
    n = int(lengths.max())
    if int(lengths.min()) < 1 or n > max_tokens_per_row:
        return None
    li = np.asarray(arrays["logits_indices"])
    if len(li) != T or not np.array_equal(li, np.arange(T)):
        return None
    blocks = -(-int(np.max(arrays["seq_lens"])) // block_size)
    if blocks > max_blocks_per_row:
        return None
    padded_blocks = min(max(MIN_BLOCKS, 1 << (blocks - 1).bit_length()), max_blocks_per_row)
    padded_rows = next(r for r in rows if r >= R)
    return GraphShape(padded_rows, n, padded_blocks)


class _StaticStep:
    """One shape's static inputs: views of one int64 device buffer that each step's arrays are
    copied into, in the order `fill` writes them."""

    def __init__(self, shape: GraphShape, device: torch.device) -> None:
        B, n, nb = shape.rows, shape.tokens_per_row, shape.blocks_per_row
        T = shape.num_tokens
        self.shape = shape
        self.sizes = (T, T, T, B * nb, B, B * n)  # ids, positions, slots, block table, read, write
        self.size = sum(self.sizes)
        self.buffer = torch.zeros(self.size + B + 1, dtype=torch.int64, device=device)
        ids, pos, slots, table, read, write, qsl = self.buffer.split([*self.sizes, B + 1])
        self.input_ids, self.positions, self.slot_mapping = ids, pos, slots
        self.block_table = table.view(B, nb)
        self.read_slot = read
        self.write_slots = write.view(B, n)
        self.qsl = qsl  # (the same for every step of the shape: written once)
        qsl.copy_(torch.arange(B + 1, dtype=torch.int64) * n)
        self.has_initial_state = torch.ones(B, dtype=torch.bool, device=device)  # (not read: no prefill rows)

    def fill(self, host: np.ndarray, arrays: StepArrays, place: np.ndarray | None) -> None:
        """Writes the step's arrays into `host` (at least `size` long) in the buffer's layout,
        padding as the module docstring says. `place`: where each of the step's tokens goes in
        the padded shape (None: the rows are all of the shape's length, in place)."""
        B, n, nb = self.shape.rows, self.shape.tokens_per_row, self.shape.blocks_per_row
        qsl = np.asarray(arrays["query_start_loc"])
        R, T = len(qsl) - 1, int(qsl[-1])
        host[: self.size] = 0
        at = 0
        for name in ("input_ids", "positions", "slot_mapping"):
            if place is None:
                host[at : at + T] = arrays[name]
            else:
                host[at + place] = arrays[name]
            at += self.shape.num_tokens
        table = np.asarray(arrays["block_table"])
        cols = min(nb, table.shape[1])
        host[at : at + B * nb].reshape(B, nb)[:R, :cols] = table[:, :cols]
        at += B * nb
        host[at : at + R] = arrays["state_read_slot"]
        at += B
        writes = np.asarray(arrays["state_write_slots"])[:, :n]
        # a padding token's state goes to the null slot (the scheduler leaves those entries 0)
        used = np.arange(writes.shape[1])[None, :] < np.diff(qsl)[:, None]
        host[at : at + B * n].reshape(B, n)[:R, : writes.shape[1]] = np.where(used, writes, 0)

    def context(self, block_size: int) -> tuple[ForwardContext, torch.Tensor]:
        """(the ForwardContext of the shape's static buffers, the input ids): the decode fields on
        the device, the host fields those of the padded shape, whose every row is taken to be
        `blocks_per_row` blocks long (the mask by position keeps each row to its own keys)."""
        B, n, nb = self.shape.rows, self.shape.tokens_per_row, self.shape.blocks_per_row
        T = self.shape.num_tokens
        qsl = torch.arange(B + 1, dtype=torch.int64) * n
        seq_lens = torch.full((B,), nb * block_size, dtype=torch.int64)
        computed = seq_lens - n
        every = torch.arange(T, dtype=torch.int64)
        dev = self.buffer.device
        batch = ForwardBatch(
            input_ids=self.input_ids, positions=self.positions, query_start_loc=qsl,
            num_computed_tokens=computed, seq_lens=seq_lens, num_decodes=B, slot_mapping=self.slot_mapping,
            block_table=self.block_table, state_read_slot=self.read_slot,
            has_initial_state=self.has_initial_state, state_write_slots=self.write_slots,
            emit_row=_EMPTY64, emit_token=_EMPTY64, emit_slot=_EMPTY64, logits_indices=every,
        )  # fmt: skip
        ctx = ForwardContext(
            batch=batch, device=dev, num_tokens=T, num_decodes=B, num_decode_tokens=T,
            positions=self.positions, slot_mapping=self.slot_mapping, block_table=self.block_table, qsl=qsl,
            seq_lens=seq_lens, num_computed=computed, logits_indices=every, dec_qsl=self.qsl,
            dec_read_slot=self.read_slot, dec_write_slots=self.write_slots, pre_qsl=_ZERO_QSL,
            pre_num_computed=_EMPTY64, pre_read_slot=_EMPTY64, pre_has_initial_state=_EMPTY_BOOL,
            pre_write_slot=_EMPTY64, emit_row=_EMPTY64, emit_token=_EMPTY64, emit_slot=_EMPTY64,
        )  # fmt: skip
        return ctx, self.input_ids


@dataclass
class _Captured:
    static: _StaticStep
    replay: Callable[[], torch.Tensor]  # runs the step on the static buffers; its logits [rows * n, V]


class DecodeGraphs:
    """The graphs of one model's decode and verify steps (module docstring). `run` takes a step
    that a graph can run and returns its logits; None for any other step (the caller runs the
    forward)."""

    def __init__(
        self,
        model: Any,
        caches: ModelCaches,
        max_rows: int,
        max_tokens_per_row: int,
        max_blocks_per_row: int,
    ) -> None:
        self.model = model
        self.caches = caches
        self.device = caches.device
        self.capture = self.device.type == "cuda"
        self.block_size = caches.block_size
        self.rows = capture_rows(max_rows)
        self.max_tokens_per_row = max_tokens_per_row
        self.max_blocks_per_row = max(1, max_blocks_per_row)
        self.staging = HostStaging(self.device)
        self.graphs: dict[GraphShape, _Captured] = {}
        self.pool: Any = torch.cuda.graph_pool_handle() if self.capture else None
        self.failed: str | None = None  # why graphs are off for good, after a capture failed
        self._weights = list(model.parameters()) if isinstance(model, nn.Module) else []
        self._versions = self._current_versions()
        self.num_replays = 0  # steps a graph ran

    def _current_versions(self) -> tuple[int, ...]:
        return tuple(map(_VERSION, self._weights))

    def shape_of(self, arrays: StepArrays, num_decodes: int) -> GraphShape | None:
        return graph_shape(
            arrays, num_decodes, self.block_size, self.rows, self.max_tokens_per_row, self.max_blocks_per_row
        )

    def run(self, arrays: StepArrays, num_decodes: int) -> torch.Tensor | None:
        """The logits ``[tokens, vocab]`` of a step of decode / verify rows (the scheduler's
        arrays, by ForwardBatch field name), computed by its shape's graph (captured now if this
        is the first step of that shape); None when no graph runs it."""
        if self.failed is not None:
            return None
        shape = self.shape_of(arrays, num_decodes)
        if shape is None:
            return None
        versions = self._current_versions()
        if versions != self._versions:  # a weight was written in place: capture again
            self.graphs.clear()
            self._versions = versions
        captured = self.graphs.get(shape)
        if captured is None:
            captured = self._capture(shape)
            if captured is None:
                return None
            self.graphs[shape] = captured
        static = captured.static
        qsl = np.asarray(arrays["query_start_loc"])
        n, T = shape.tokens_per_row, int(qsl[-1])
        place: np.ndarray | None = None
        if T != n * (len(qsl) - 1):  # rows shorter than n: token t of row r goes to r * n + t
            lengths = np.diff(qsl)
            starts = np.repeat(qsl[:-1], lengths)
            place = np.repeat(np.arange(len(lengths)) * n, lengths) + (np.arange(T) - starts)
        host = self.staging.buffer(static.size).numpy()
        static.fill(host, arrays, place)
        self.staging.copy_into(static.buffer, static.size)
        logits = captured.replay()
        self.num_replays += 1
        # (copied out of the shared pool before the next replay)
        return logits[:T].clone() if place is None else logits[torch.from_numpy(place)]

    def _capture(self, shape: GraphShape) -> _Captured | None:
        static = _StaticStep(shape, self.device)  # (all padding: the warm-up writes nothing real)
        ctx_of = static.context

        def step() -> torch.Tensor:
            ctx, ids = ctx_of(self.block_size)
            return self.model.forward_context(ctx, ids, self.caches)

        if not self.capture:
            return _Captured(static, torch.inference_mode()(step))
        try:
            with torch.inference_mode():
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    step()  # first calls (library handles, cached constants) outside the capture
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    output = step()
        except Exception as exc:  # noqa: BLE001 - any failure: the steps run eagerly from now on
            self.failed = f"capturing the graph of {shape} failed: {exc}"
            self.graphs.clear()
            logger.warning("CUDA graphs off: %s", self.failed)
            return None

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        logger.info("captured the CUDA graph of %s", shape)
        return _Captured(static, replay)
