"""A step's device arrays moved in one copy (`HostStaging`, used on accelerators): every field of
the ForwardBatch equals the one moved array by array, a later step does not change an earlier
step's tensors, and an engine that stages its batches generates exactly what one that does not
generates. Run here with the CPU as the device, where the staging buffer is not page-locked and
the copy is synchronous; the packing, the views and the buffer's reuse are the same code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridserve.engine.llm import LLM
from hybridserve.model.batch import DEVICE_ARRAYS, HOST_ARRAYS, HostStaging, forward_batch_from_arrays
from hybridserve.sampling.params import SamplingParams


def random_arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    rows, tokens, window, blocks, emits = (
        int(rng.integers(lo, hi)) for lo, hi in ((1, 9), (1, 40), (1, 5), (0, 7), (0, 4))
    )
    arrays: dict[str, np.ndarray] = {}
    shapes = {
        "input_ids": (tokens,), "positions": (tokens,), "slot_mapping": (tokens,),
        "block_table": (rows, blocks), "state_read_slot": (rows,), "state_write_slots": (rows, window),
        "emit_row": (emits,), "emit_token": (emits,), "emit_slot": (emits,),
        "query_start_loc": (rows + 1,), "num_computed_tokens": (rows,), "seq_lens": (rows,),
        "logits_indices": (rows,),
    }  # fmt: skip
    for name, shape in shapes.items():
        arrays[name] = rng.integers(0, 1 << 40, size=shape, dtype=np.int64)
    arrays["has_initial_state"] = rng.random(rows) < 0.5
    return arrays


def test_staged_fields_equal_the_arrays_moved_one_by_one() -> None:
    rng = np.random.default_rng(0)
    staging = HostStaging(torch.device("cpu"))
    kept = []
    for _ in range(200):
        arrays = random_arrays(rng)
        staged = forward_batch_from_arrays(arrays, 1, torch.device("cpu"), staging)
        plain = forward_batch_from_arrays(arrays, 1, torch.device("cpu"))
        for name in (*DEVICE_ARRAYS, *HOST_ARRAYS):
            a, b = getattr(staged, name), getattr(plain, name)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
            assert a.is_contiguous()
        kept.append((staged, {name: arrays[name].copy() for name in DEVICE_ARRAYS}))
    for staged, arrays in kept:  # (each step's tensors are its own: the buffer was written since)
        for name, a in arrays.items():
            assert np.array_equal(getattr(staged, name).numpy(), a), name


def test_an_engine_that_stages_its_batches_generates_the_same_tokens() -> None:
    prompts = [f"Question {i}: how far is the harbour from the station?" for i in range(6)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = {"dtype": "float32", "max_model_len": 256, "enable_prefix_caching": True}
    results = []
    for staging in (None, HostStaging(torch.device("cpu"))):
        llm = LLM("demo", **kw)
        runner = llm.engine.runner
        runner.decode_step = None  # (every step takes the per-op forward and its ForwardBatch)
        runner.staging = staging
        results.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)])
    want, got = results
    assert got == want
    assert staging is not None and staging._host.numel() > 0  # (the batches were staged)


def test_an_array_of_another_type_is_refused() -> None:
    arrays = random_arrays(np.random.default_rng(1))
    arrays["input_ids"] = arrays["input_ids"].astype(np.int32)
    with pytest.raises(TypeError, match="input_ids: a staged array must be int64 or bool"):
        forward_batch_from_arrays(arrays, 1, torch.device("cpu"), HostStaging(torch.device("cpu")))
