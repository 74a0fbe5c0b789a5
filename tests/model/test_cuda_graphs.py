"""The CUDA-graph path of decode and verify steps (model/cuda_graphs.py), everything but the
capture itself, on the CPU: which steps a graph takes and at what padded shape, and that a step
run on a shape's static buffers (padding rows included) gives the eager forward's tokens and
leaves the caches as the eager forward does. tests/gpu/test_gpu_graphs.py runs the captured
graphs on a device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridserve.engine.llm import LLM
from hybridserve.kernels import backend
from hybridserve.model.cuda_graphs import MIN_BLOCKS, DecodeGraphs, capture_rows, graph_shape
from hybridserve.sampling.params import SamplingParams

ROWS = capture_rows(64)


def _decode_arrays(rows: int, tokens: int, seq_len: int, block_size: int = 16) -> dict[str, np.ndarray]:
    T = rows * tokens
    nb = -(-seq_len // block_size)
    return {
        "query_start_loc": np.arange(rows + 1) * tokens,
        "emit_row": np.zeros(0, dtype=np.int64),
        "logits_indices": np.arange(T),
        "seq_lens": np.full(rows, seq_len),
        "input_ids": np.arange(T) + 3,
        "positions": np.tile(np.arange(seq_len - tokens, seq_len), rows),
        "slot_mapping": np.arange(T) + 100,
        "block_table": np.arange(rows * nb).reshape(rows, nb) + 1,
        "state_read_slot": np.arange(rows) + 1,
        "state_write_slots": np.arange(rows * tokens).reshape(rows, tokens) + 50,
    }


def test_capture_rows_end_at_the_engines_batch():
    assert capture_rows(64)[-1] == 64
    assert capture_rows(20) == (1, 2, 4, 8, 16, 20)
    assert capture_rows(1000)[-1] == 256


def test_graph_shape_pads_rows_and_blocks():
    s = graph_shape(_decode_arrays(5, 1, 70), 5, 16, ROWS, 4, 64)
    assert s is not None and (s.rows, s.tokens_per_row, s.blocks_per_row) == (8, 1, 8)  # 5 blocks -> 8
    s = graph_shape(_decode_arrays(3, 4, 20), 3, 16, ROWS, 4, 64)
    assert s is not None and (s.rows, s.tokens_per_row, s.blocks_per_row) == (4, 4, MIN_BLOCKS)
    s = graph_shape(_decode_arrays(64, 1, 60 * 16 + 1), 64, 16, ROWS, 4, 64)
    assert s is not None and (s.rows, s.blocks_per_row) == (64, 64)  # 61 blocks: capped at the longest row
    a = _decode_arrays(3, 1, 40)
    a["query_start_loc"] = np.array([0, 1, 4, 6])  # verify rows of 0, 2 and 1 drafts: padded to 3
    a["logits_indices"] = np.arange(6)
    s = graph_shape(a, 3, 16, ROWS, 4, 64)
    assert s is not None and (s.rows, s.tokens_per_row) == (4, 3)


@pytest.mark.parametrize(
    "change",
    ["prefill_row", "empty_row", "some_logits", "emits", "too_many_rows", "too_many_tokens", "too_long"],
)
def test_graph_shape_refuses_steps_a_graph_cannot_run(change):
    a = _decode_arrays(4, 2, 40)
    nd, max_blocks = 4, 64
    if change == "prefill_row":
        nd = 3
    elif change == "empty_row":
        a["query_start_loc"] = np.array([0, 2, 2, 4, 8])
    elif change == "some_logits":
        a["logits_indices"] = np.array([1, 3, 5, 7])
    elif change == "emits":
        a["emit_row"] = np.array([3])
    elif change == "too_many_rows":
        a = _decode_arrays(65, 1, 40)
        nd = 65
    elif change == "too_many_tokens":
        a = _decode_arrays(4, 5, 40)
    elif change == "too_long":
        max_blocks = 2
    assert graph_shape(_decode_arrays(4, 2, 40), 4, 16, ROWS, 4, 64) is not None
    assert graph_shape(a, nd, 16, ROWS, 4, max_blocks) is None


PROMPTS = [
    "The harbour was quiet when the first boats came in with the morning tide.",
    "Seven bridges cross the river; the oldest of them",
    "A list of colours: red, green, blue, red, green, blue, red, green,",
    "Numbers: 1 2 3 1 2 3 1 2 3 1 2 3",
    "Why",
]


def _generate(graphs: bool, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM("demo", dtype="float64", max_model_len=256, max_num_seqs=8, **kw)
    runner = llm.engine.runner
    if graphs:
        # the CPU's own decode step would take these steps: the graphs take them instead
        runner.decode_step = None
        em = runner.em
        runner.graphs = DecodeGraphs(
            em.model, em.caches, max_rows=8, max_tokens_per_row=1 + runner.num_speculative_tokens,
            max_blocks_per_row=256 // em.caches.block_size,
        )  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.mark.parametrize("kernels", ["native", "reference"])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"enable_prefix_caching": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ],
    ids=["plain", "prefix_caching", "ngram"],
)
def test_graph_steps_give_the_eager_tokens(monkeypatch, kernels, kw):
    """Greedy tokens with every decode / verify step that a graph can take run on its shape's
    static buffers (padded rows and blocks) equal the eager run's; the null slot stays zero."""
    monkeypatch.setenv("HYBRIDSERVE_NATIVE_CPU", "1" if kernels == "native" else "0")
    with backend.use(None):
        eager, _ = _generate(False, **kw)
        graphed, llm = _generate(True, **kw)
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.num_replays > 0
        shapes = set(graphs.graphs)
        assert any(s.rows > 1 for s in shapes)
        if "speculative_config" in kw:
            assert any(s.tokens_per_row > 1 for s in shapes), shapes  # verify rows took graphs too
        caches = llm.engine.runner.em.caches
        for layer in caches.ssm:
            assert torch.count_nonzero(caches.ssm[layer][0]) == 0
            assert torch.count_nonzero(caches.conv[layer][0]) == 0
    assert graphed == eager


def test_a_weight_written_in_place_recaptures(monkeypatch):
    """Graphs derived from weights that were then written in place are dropped and made again."""
    monkeypatch.setenv("HYBRIDSERVE_NATIVE_CPU", "0")
    with backend.use(None):
        _, llm = _generate(True)
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.graphs
        before = dict(graphs.graphs)
        with torch.no_grad():
            next(iter(llm.engine.runner.em.model.parameters())).mul_(1.0)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate(PROMPTS[:2], params)
        assert graphs.graphs and all(before.get(s) is not c for s, c in graphs.graphs.items())
