"""The offline API (LLM, SamplingParams, EngineArgs) and `hybridserve generate`, on the demo model."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hybridserve import LLM, ConfigError, InvalidRequestError, SamplingParams
from hybridserve.engine.detokenizer import CONTEXT_TOKENS
from hybridserve.sampling.params import MAX_TOP_K

PROMPT = "The quick brown fox jumps over the lazy dog."


@cache
def llm32() -> LLM:
    return LLM("demo", dtype="float32", max_model_len=512, max_num_seqs=8)


def test_llm_engine_is_the_engine_as_vllm_names_it() -> None:
    llm = llm32()
    assert llm.llm_engine is llm.engine


def test_generate_text_tokens_and_finish_reason() -> None:
    llm = llm32()
    out = llm.generate([PROMPT, {"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=8, temperature=0))
    assert len(out) == 2
    first = out[0].outputs[0]
    assert out[0].prompt == PROMPT
    assert out[0].prompt_token_ids == llm.get_tokenizer().encode(PROMPT)
    assert len(first.token_ids) <= 8
    assert first.finish_reason in ("length", "stop")
    if first.finish_reason == "length":
        assert len(first.token_ids) == 8
    # The text is the incremental detokenization of the tokens.
    assert first.text == llm.get_tokenizer().decode(first.token_ids)
    assert out[1].prompt_token_ids == [5, 6, 7]


def test_greedy_is_deterministic_and_batch_independent() -> None:
    llm = llm32()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    batched = llm.generate(["Hello there", PROMPT, "A third prompt, longer than the others."], params)
    assert batched[1].outputs[0].token_ids == alone


def test_seeded_sampling_reproduces_and_differs_by_seed() -> None:
    llm = llm32()
    prompt = {"prompt_token_ids": [311, 47, 598, 12, 733, 140, 402, 9]}

    def sample(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=16, temperature=2.0, seed=seed, ignore_eos=True)
        return llm.generate(prompt, params)[0].outputs[0].token_ids

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    # any int64 is a seed, as vLLM takes it
    assert sample(-7) == sample(-7)
    assert sample(-7) != sample(7)
    assert sample(-(2**63)) == sample(-(2**63))


def test_n_sequences_per_prompt() -> None:
    out = llm32().generate(
        PROMPT, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True)
    )
    assert len(out) == 1
    seqs = out[0].outputs
    assert [s.index for s in seqs] == [0, 1, 2]
    assert len({tuple(s.token_ids) for s in seqs}) > 1
    # Choice j is the request with seed choice_seed(1, j) (the server's rule too): choice 0 is
    # the plain seeded request, the others are not seed + j.
    from hybridserve.sampling.seeds import choice_seed

    for j, s in enumerate(seqs):
        alone = llm32().generate(
            PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=choice_seed(1, j), ignore_eos=True)
        )
        assert alone[0].outputs[0].token_ids == s.token_ids
    assert choice_seed(1, 0) == 1 and choice_seed(1, 1) != 2


def test_logprobs_of_chosen_and_top_tokens() -> None:
    out = llm32().generate(PROMPT, SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True))
    o = out[0].outputs[0]
    assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids) == 5
    for tok, entry in zip(o.token_ids, o.logprobs):
        assert tok in entry
        assert entry[tok].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3  # the chosen token is among the top 3
        assert all(lp.logprob <= 0.0 for lp in entry.values())
        assert math.isclose(max(lp.logprob for lp in entry.values()), entry[tok].logprob)
    # every entry names its token's text, as vLLM's Logprob.decoded_token does
    tokenizer = llm32().get_tokenizer()
    assert all(
        lp.decoded_token == tokenizer.token_to_text(t) != "" for e in o.logprobs for t, lp in e.items()
    )
    raw = b"".join(tokenizer.token_bytes(t) for t in o.token_ids)
    assert raw.decode("utf-8", errors="replace") == o.text
    labels = [o.logprobs[i][t].decoded_token for i, t in enumerate(o.token_ids)]
    assert all(
        lb.startswith("bytes:") or lb == tokenizer.token_bytes(t).decode()
        for lb, t in zip(labels, o.token_ids)
    )


def test_stop_strings_cut_the_text() -> None:
    llm = llm32()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = llm.generate(PROMPT, params)[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))
    o = cut[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == full.text[: full.text.index(stop)]
    assert len(o.token_ids) < len(full.token_ids)
    # the scheduler counts it as finished, not aborted, and keeps nothing of it
    before = llm.engine.stats()
    llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))
    after = llm.engine.stats()
    assert after["num_finished_total"] == before["num_finished_total"] + 1
    assert after["num_aborted_total"] == before["num_aborted_total"]
    assert after["kv_blocks_used"] == 0 and after["num_running"] == 0


def test_prefix_cache_reports_cached_tokens() -> None:
    llm = LLM(
        "demo",
        dtype="float32",
        max_model_len=1024,
        mamba_block_size=64,
        max_num_seqs=4,
        mamba_checkpoint_placement="branch",
    )
    ids = list(range(10, 210))
    params = SamplingParams(max_tokens=4, temperature=0)
    first, second, third = (llm.generate({"prompt_token_ids": ids}, params)[0] for _ in range(3))
    # The first run keeps the state after its last computed token (200 prompt + 3 output tokens):
    # a repeat of the prompt alone cannot use it. The repeat finds 192 tokens of KV (12 blocks)
    # without a state, keeps one there, and the third run hits it.
    assert (first.num_cached_tokens, second.num_cached_tokens, third.num_cached_tokens) == (0, 0, 192)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == third.outputs[0].token_ids
    # The next turn of the conversation resumes right after the first run's last computed token.
    out = list(first.outputs[0].token_ids)
    turn = llm.generate({"prompt_token_ids": ids + out + [5, 6, 7]}, params)[0]
    assert turn.num_cached_tokens == len(ids) + len(out) - 1
    stats = llm.engine.stats()
    assert (stats["prefix_hits_branch"], stats["prefix_hits_last_token"]) == (1, 1)
    # The default in mode all adds grid points (every 64 tokens here) in spare room: the repeat
    # already hits the one at 192.
    grid = LLM("demo", dtype="float32", max_model_len=1024, mamba_block_size=64, max_num_seqs=4)
    assert [grid.generate({"prompt_token_ids": ids}, params)[0].num_cached_tokens for _ in range(2)] == [
        0,
        192,
    ]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_dtypes_generate(dtype: str) -> None:
    llm = LLM("demo", dtype=dtype, max_model_len=256, max_num_seqs=2)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    if dtype == "float64":
        # logprobs in the model's precision: not all of them are float32 values
        lp = (
            llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0]
            .outputs[0]
            .logprobs
        )
        values = [e.logprob for step in lp for e in step.values()]
        assert len(values) >= 4 and any(float(np.float32(v)) != v for v in values)


def test_bad_requests_raise_typed_errors_and_leave_the_engine_usable() -> None:
    llm = llm32()
    with pytest.raises(InvalidRequestError):
        llm.generate("", SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError):
        llm.generate({"prompt_token_ids": [10**9]}, SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError):
        llm.generate({"prompt_token_ids": list(range(600))}, SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError):
        llm.generate({"prompt_token_ids": ["a", "b"]}, SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError):
        SamplingParams(temperature=-1)
    # no silent conversions: a float or a bool is not a token id, bytes are not a prompt
    for bad in (
        {"prompt": None},
        {"prompt": b"hi"},
        {"prompt": 5, "prompt_token_ids": [5, 6]},  # (the text beside ids was taken as it came)
        {"prompt_token_ids": [1.5, 2]},
        {"prompt_token_ids": [True]},
        b"hi",
        "a\ud800b",
        None,
        5,
        np.array(5),  # 0-d: one number, no sequence
    ):
        with pytest.raises(InvalidRequestError):
            llm.generate(bad, SamplingParams(max_tokens=4))  # type: ignore[arg-type]
    for kw in (
        {"temperature": "0.5"},
        {"temperature": None},
        {"max_tokens": True},
        {"n": True},
        {"seed": True},
        {"stop_token_ids": 5},
    ):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**kw)  # type: ignore[arg-type]
    for kw in (
        {"ignore_eos": None},
        {"ignore_eos": "yes"},
        {"include_stop_str_in_output": "x"},
        {"skip_special_tokens": 0},
        {"min_tokens": 10**30, "max_tokens": None},
        {"max_tokens": 10**30},
        {"top_k": MAX_TOP_K + 1},  # past it the batch's int64 row arrays overflowed mid-step
        {"top_k": 2**63},
    ):
        with pytest.raises(InvalidRequestError, match=next(iter(kw))):
            SamplingParams(**kw)  # type: ignore[arg-type]
    # the largest top_k samples (it keeps the whole vocabulary)
    widest = SamplingParams(max_tokens=3, temperature=1.0, seed=1, top_k=MAX_TOP_K, ignore_eos=True)
    assert len(llm.generate(PROMPT, widest)[0].outputs[0].token_ids) == 3
    # a value set after construction is checked when the request is added
    late = SamplingParams(max_tokens=4)
    late.skip_special_tokens = None  # type: ignore[assignment]
    with pytest.raises(InvalidRequestError, match="skip_special_tokens"):
        llm.generate(PROMPT, late)
    for bad_params in ({"temperature": 0}, "x", [None], 3):
        with pytest.raises(InvalidRequestError, match="sampling_params"):
            llm.generate([PROMPT], bad_params)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, stop_token_ids=[10**6]))
    with pytest.raises(InvalidRequestError, match="one per prompt"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=4)])
    # the step API: an id that is no str, parameters that are no SamplingParams
    engine = llm.engine
    for rid, params in (
        (5, SamplingParams(max_tokens=2)),
        (None, SamplingParams()),
        ("x", {"max_tokens": 2}),
    ):
        with pytest.raises(InvalidRequestError):
            engine.add_request(rid, PROMPT, params)  # type: ignore[arg-type]
    for rid in (5, None, b"x"):
        with pytest.raises(InvalidRequestError, match="request_id"):
            engine.abort_request(rid)  # type: ignore[arg-type]
    # a cache_salt that is no str, a priority that is no int64
    for kw in ({"cache_salt": 5}, {"cache_salt": b"x"}, {"priority": "1"}, {"priority": 1.5},
               {"priority": True}, {"priority": 2**63}, {"priority": -(2**63) - 1},
               {"cache_salt": "a\ud800"}):  # fmt: skip
        with pytest.raises(InvalidRequestError, match=next(iter(kw))):
            engine.add_request("y", PROMPT, SamplingParams(max_tokens=2), **kw)  # type: ignore[arg-type]
    # ids and salts go to the Rust core as UTF-8: a lone surrogate is refused by name, not by the binding
    with pytest.raises(InvalidRequestError, match="request_id: not valid Unicode"):
        engine.add_request("\ud800", PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="request_id: not valid Unicode"):
        engine.abort_request("\udfff")
    for priority in (
        2**63 - 1,
        -(2**63),
        np.int32(3),
    ):  # the int64 extremes and numpy integers are priorities
        engine.add_request(f"p{priority}", PROMPT, SamplingParams(max_tokens=1), priority=priority)
    while engine.has_unfinished_requests():
        engine.step()
    stats = llm.engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0
    assert (
        len(llm.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3
    )


def test_a_prompt_too_long_by_its_length_alone_is_refused_before_it_is_tokenized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llm = llm32()  # max_model_len 512
    tokenizer = llm.engine.inputs.tokenizer
    # a byte-level BPE token stands for at most as many characters as its longest entry
    assert 0 < tokenizer.min_tokens("a b " * 2000) <= len(tokenizer.encode("a b " * 2000))

    def no_encoding(text: str, add_special_tokens: bool = False) -> list[int]:
        raise AssertionError(f"a prompt of {len(text)} characters was tokenized")

    monkeypatch.setattr(tokenizer, "encode", no_encoding)
    with pytest.raises(InvalidRequestError, match="prompt: at least [0-9]+ tokens leave no room"):
        llm.generate("a b " * 500_000, SamplingParams(max_tokens=4))
    monkeypatch.undo()
    # a prompt over the context whose length alone does not tell is counted, then refused
    with pytest.raises(InvalidRequestError, match="prompt: [0-9]+ tokens leave no room"):
        llm.generate("a b " * 300, SamplingParams(max_tokens=4))
    assert llm.generate("a b", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_numpy_scalars_are_numbers() -> None:
    import numpy as np

    plain = SamplingParams(max_tokens=4, temperature=0.7, seed=3, top_k=5, ignore_eos=True)
    from_np = SamplingParams(
        max_tokens=np.int64(4),
        temperature=np.float32(0.7),
        seed=np.int64(3),
        top_k=np.int32(5),
        ignore_eos=True,
    )
    assert type(from_np.seed) is int and type(from_np.temperature) is float
    ids = {"prompt_token_ids": np.arange(10, 30)}
    a = llm32().generate(ids, from_np)[0].outputs[0].token_ids
    # one prompt as a 1-D array of ids, or a list of numpy ids, is one prompt (not 20)
    for one in (np.arange(10, 30), [np.int64(t) for t in range(10, 30)], torch.arange(10, 30)):
        got = llm32().generate(one, from_np)
        assert len(got) == 1 and got[0].outputs[0].token_ids == a
    b = llm32().generate({"prompt_token_ids": list(range(10, 30))}, plain)[0].outputs[0].token_ids
    # float32(0.7) is not 0.7: compare with the temperature it stands for
    c = llm32().generate(
        ids,
        SamplingParams(max_tokens=4, temperature=float(np.float32(0.7)), seed=3, top_k=5, ignore_eos=True),
    )
    assert a == c[0].outputs[0].token_ids and len(b) == 4


def test_only_allocation_failures_become_cache_size_advice() -> None:
    from hybridserve.engine.model_setup import _is_out_of_memory

    assert _is_out_of_memory(
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")
    )
    assert _is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not _is_out_of_memory(RuntimeError("expected scalar type Float but found Half"))


def test_config_errors_are_typed(tmp_path: Path) -> None:
    from hybridserve import EngineArgs

    with pytest.raises(ConfigError):
        LLM("demo", mamba_cache_mode="align", enable_chunked_prefill=False)
    with pytest.raises(ConfigError, match="an EngineArgs, not dict"):  # (was an AttributeError)
        LLM.from_engine_args({"model": "demo"})  # type: ignore[arg-type]
    for markers in (5, None, "²", "٣"):  # digits to str.isdigit(), not token ids
        with pytest.raises(ConfigError, match="--shared-prefix-markers"):
            EngineArgs(model="demo", shared_prefix_markers=markers).resolve()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="nested too deeply"):
        EngineArgs(model="demo", speculative_config="[" * 20000 + "]" * 20000).resolve()
    # a model folder whose config.json is not UTF-8 text, or nested past the parser's depth
    for name, content in (("binary", b"\xff\xfe{\x00}"), ("deep", b'{"a":' * 20000 + b"1" + b"}" * 20000)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_bytes(content)
        with pytest.raises(ConfigError, match="config.json"):
            LLM(str(folder))
    # the same for a sharded checkpoint's index and a tokenizer_config.json
    import shutil

    from hybridserve.model.demo import ensure_demo_model

    for name, content, says in (
        ("model.safetensors.index.json", b"\xff\xfe", "sharded index"),
        ("model.safetensors.index.json", b'{"a":' * 20000 + b"1" + b"}" * 20000, "sharded index"),
        ("tokenizer_config.json", b"[" * 20000 + b"]" * 20000, "tokenizer config"),
    ):
        folder = tmp_path / f"copy-{name}-{len(content)}"
        shutil.copytree(ensure_demo_model(), folder)
        (folder / name).write_bytes(content)
        with pytest.raises(ConfigError, match=says):
            LLM(str(folder), dtype="float32")
    with pytest.raises(ConfigError):
        LLM("/nonexistent/model/folder")
    # values no machine can honour are refused up front, naming the flag
    for kw, flag in (
        ({"cpu_threads": 100_000}, "--cpu-threads"),
        ({"block_size": 2**70}, "--block-size"),
        ({"max_num_seqs": 2**64}, "--max-num-seqs"),
        ({"num_kv_blocks": 10**12}, "--num-kv-blocks"),
    ):
        with pytest.raises(ConfigError, match=flag):
            LLM("demo", dtype="float32", **kw)
    # sizes within the bounds that still cannot be allocated: a ConfigError, not torch's error
    with pytest.raises(ConfigError, match="cannot allocate the caches"):
        LLM("demo", dtype="float32", max_model_len=256, kv_cache_memory=10**15)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            LLM("demo", dtype="float32", device="cuda")
    else:
        with pytest.raises(ConfigError, match="CUDA device"):
            LLM("demo", dtype="float32", device=f"cuda:{torch.cuda.device_count()}")


def test_model_folder_oddities_that_load_are_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A generation_config.json that is not JSON is ignored (as transformers does), an EOS id the
    logits cannot reach is kept: the model loads, and the log says both."""
    import shutil

    from hybridserve.model.demo import ensure_demo_model

    folder = tmp_path / "odd"
    shutil.copytree(ensure_demo_model(), folder)
    (folder / "generation_config.json").write_bytes(b"\xff not json")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["eos_token_id"] = 99999
    (folder / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level("WARNING", logger="hybridserve.model.loader"):
        llm = LLM(str(folder), dtype="float32")
    said = caplog.text
    assert "generation_config.json: ignored" in said and "[99999] are outside the model's vocabulary" in said
    out = llm.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3


def test_model_type_and_architectures_must_name_one_family(tmp_path: Path) -> None:
    """The cache policy reads the family from config.json's model_type, the loader builds the class
    architectures names: a model_type of another family is refused (it had the policy keep no
    Mamba states for the demo's Mamba layers, and the output changed), a missing one is the
    architecture's."""
    import shutil

    from hybridserve.model.demo import ensure_demo_model

    cfg = json.loads((Path(ensure_demo_model()) / "config.json").read_text())
    mismatched = tmp_path / "mismatched"
    shutil.copytree(ensure_demo_model(), mismatched)
    (mismatched / "config.json").write_text(json.dumps({**cfg, "model_type": "bamba"}))
    with pytest.raises(ConfigError, match="model_type 'bamba' is not the model type of architectures"):
        LLM(str(mismatched), dtype="float32")
    from hybridserve.cli import main

    assert main(["config", str(mismatched)]) == 2  # the policy's own reading of the folder
    untyped = tmp_path / "untyped"
    shutil.copytree(ensure_demo_model(), untyped)
    (untyped / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "model_type"}))
    llm = LLM(str(untyped), dtype="float32", max_model_len=512, max_num_seqs=8)
    assert llm.engine.config.has_mamba_layers
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert (
        llm.generate(PROMPT, greedy)[0].outputs[0].token_ids
        == llm32().generate(PROMPT, greedy)[0].outputs[0].token_ids
    )


@pytest.mark.parametrize(
    "argv,rc,says",
    [
        (["bench", "offline", "--block-size", "0", "--num-prompts", "1"], 2, "--block-size"),
        (
            ["bench", "offline", "--num-prompts", "1", "--prompt-len", "5000", "--output-len", "1"],
            2,
            "prompt",
        ),
        (["bench", "offline", "--num-prompts", "-3"], 2, "--num-prompts"),
        (["demo-model", "/proc/hybridserve-nope"], 1, "No such file"),
        (["demo-model", "DIR", "--seed", str(10**30)], 2, "--seed"),
        (["generate", "demo", "--prompt", "hi", "--cpu-threads", str(10**20)], 2, "--cpu-threads"),
        (["demo-model", ""], 2, "empty path"),
        (["bench", "offline", "--result-file", "/nonexistent-dir/r.json"], 2, "--result-file"),
        (["bench", "serve", "--plot", "/nonexistent-dir/charts"], 2, "--plot"),
        (["bench", "serve", "--concurrency", "-1"], 2, "--concurrency"),
        (["bench", "serve", "--num-requests", "0"], 2, "--num-requests"),
        (["bench", "serve", "--token-id-max", "2"], 2, "--token-id-max"),
        (["bench", "serve", "--ready-timeout", "nan"], 2, "--ready-timeout"),
        (["bench", "serve", "--base-url", "notaurl"], 2, "--base-url"),
        # said at once, not after --ready-timeout
        (["bench", "serve", "--base-url", "http://127.0.0.1:99999"], 2, "Port out of range"),
        (["bench", "serve", "--base-url", "http://[::1"], 2, "Invalid IPv6 URL"),
        (["bench", "serve", "--base-url", "http://:8000"], 2, "no host"),
        (["bench", "serve", "--base-url", "http://127.0.0.1:1", "--ready-timeout", "0.5"], 1, "not ready"),
        (["serve", "demo", "--port", "70000"], 2, "--port"),
        (["bench", "cache-trace", "--traces", "T1:1e308"], 2, "at most 1000"),
        (
            ["bench", "serve", "--workload", "trace", "--trace", "T2", "--trace-scale", "1e9"],
            2,
            "at most 1000",
        ),
        (["config", "demo", "--speculative-config", "[" * 20000 + "]" * 20000], 2, "nested too deeply"),
        # the cache plan's refusals, with or without --explain
        (["config", "demo", "--num-mamba-slots", "2", "--json"], 2, "--num-mamba-slots"),
        (["config", "demo", "--kv-cache-memory", "1"], 2, "--kv-cache-memory"),
        (["config", "demo", "--kv-cache-memory", "9" * 400], 2, "--kv-cache-memory"),
        (["config", "demo", "--shared-prefix-markers", "²"], 2, "--shared-prefix-markers"),
        (["serve", "demo", "--max-body-bytes", "0"], 2, "--max-body-bytes"),
        (["serve", "demo", "--responses-store-bytes", "-1"], 2, "--responses-store-bytes"),
        (["serve", "demo", "--shutdown-timeout", "nan"], 2, "--shutdown-timeout"),
        (["serve", "demo", "--max-model-len", "999999"], 2, "max_position_embeddings"),
        (["serve", "demo", "--host", "999.1.1.1", "--port", "0"], 1, "cannot listen"),
    ],
)
def test_cli_user_errors_are_one_line_and_no_traceback(
    argv: list[str], rc: int, says: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from hybridserve.cli import main

    argv = [str(tmp_path / "f") if a == "DIR" else a for a in argv]
    try:
        got = main(argv)
    except SystemExit as exc:  # argparse's own errors
        got = int(exc.code or 0)
    err = capsys.readouterr().err
    assert got == rc and says in err and "Traceback" not in err, (got, err)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_serve_refuses_a_body_read_timeout_that_is_not_a_positive_time(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridserve.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "demo", "--body-read-timeout", value])
    assert exc.value.code == 2 and "--body-read-timeout" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("--host", "give an address"),
        ("--uds", "the socket's path"),
        ("--api-key", "without one"),
        ("--served-model-name", "the name requests use"),
    ],
)
def test_serve_refuses_an_empty_address(flag: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """(an unset shell variable would otherwise listen on every interface, or crash, or serve
    without the API key it was meant to give, or under an empty model name)"""
    from hybridserve.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "demo", flag, ""])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{flag}: empty; " in err and says in err


def test_demo_model_files_share_one_mode(tmp_path: Path) -> None:
    from hybridserve.model.demo import write_demo_model

    out = write_demo_model(tmp_path / "dm", steps=0)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert len(set(modes.values())) == 1, modes


def test_the_proposer_uses_the_validated_speculative_config() -> None:
    # only prompt_lookup_min given: max becomes max(4, min), as `hybridserve config` reports it
    llm = LLM(
        "demo",
        dtype="float32",
        max_model_len=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6},
    )
    from hybridserve import EngineArgs

    spec = EngineArgs(model="demo", speculative_config=llm.engine.args.speculative_config).speculative()
    assert spec is not None and (spec.prompt_lookup_min, spec.prompt_lookup_max) == (6, 6)
    proposer = llm.engine.runner.proposer
    assert (proposer.prompt_lookup_min, proposer.prompt_lookup_max) == (6, 6)
    # the JSON string form EngineArgs accepts builds the same engine
    as_json = LLM(
        "demo",
        dtype="float32",
        max_model_len=256,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
    )
    proposer = as_json.engine.runner.proposer
    assert (proposer.prompt_lookup_min, proposer.prompt_lookup_max) == (1, 3)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert (
        as_json.generate(PROMPT, params)[0].outputs[0].token_ids
        == llm32().generate(PROMPT, params)[0].outputs[0].token_ids
    )


def test_generate_cli_prints_json() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridserve",
            "generate",
            "demo",
            "--prompt",
            PROMPT,
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--json",
            "--max-model-len",
            "256",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["prompt"] == PROMPT and len(rec["token_ids"]) == 5 and rec["finish_reason"] == "length"


def test_generate_cli_takes_the_generation_config_where_no_flag_is_given() -> None:
    """Flags win, then the model's generation config (here set by the override flag), then the
    command's own defaults (greedy, 32 tokens)."""

    def run(*flags: str) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "hybridserve", "generate", "demo", "--prompt", PROMPT, "--ignore-eos"]
        out = subprocess.run(
            [*cmd, "--json", "--max-model-len", "256", *flags],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    rec = run("--override-generation-config", '{"max_new_tokens": 3}')
    assert len(rec["token_ids"]) == 3
    greedy = llm32().generate(PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert rec["token_ids"] == greedy[0].outputs[0].token_ids  # the command's greedy default stays


def test_a_failing_step_fails_its_requests_and_the_engine_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridserve.errors import StepError

    llm = LLM("demo", dtype="float32", max_model_len=512, max_num_seqs=4, mamba_block_size=64)
    engine = llm.engine
    ids = list(range(10, 150))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": ids}, params)
    engine.add_request("b", PROMPT, params)

    def broken_forward(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.em.model, "forward", broken_forward)
    with pytest.raises(StepError) as info:
        engine.step()
    assert sorted(info.value.request_ids) == ["a", "b"]
    monkeypatch.undo()

    # Nothing of the failed step survives: no request, no block, no checkpoint.
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["checkpoints_committed"] == 0 and stats["checkpoints_pending"] == 0
    # And the engine serves again, with the same greedy output as a fresh engine.
    again = llm.generate({"prompt_token_ids": ids}, params)[0]
    fresh = LLM("demo", dtype="float32", max_model_len=512, max_num_seqs=4, mamba_block_size=64)
    assert (
        again.outputs[0].token_ids
        == fresh.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    )


def test_an_interrupt_mid_step_leaves_the_llm_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM("demo", dtype="float32", max_model_len=256, max_num_seqs=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    # the second step's model run (its forward, or the wait for the native decode step running
    # on the background thread) is interrupted
    real = llm.engine.runner.finish
    calls = []

    def interrupted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "finish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT, "Hello"], params)
    monkeypatch.undo()
    stats = llm.engine.stats()
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0 and not llm.engine.requests
    assert llm.generate(PROMPT, params)[0].outputs[0].token_ids == want

    # the interrupt can also arrive on the way back from schedule(), before its output is bound
    real_scheduler = llm.engine.scheduler

    class InterruptedOnReturn:
        def __getattr__(self, name: str) -> object:
            return getattr(real_scheduler, name)

        def schedule(self) -> object:
            real_scheduler.schedule()
            raise KeyboardInterrupt

    monkeypatch.setattr(llm.engine, "scheduler", InterruptedOnReturn())
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT, "Hello"], params)
    monkeypatch.undo()
    assert real_scheduler.open_step_output() is None
    assert llm.generate(PROMPT, params)[0].outputs[0].token_ids == want


def test_stop_strings_wait_for_min_tokens() -> None:
    llm = llm32()
    base = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    full = llm.generate(PROMPT, base)[0].outputs[0]
    stop = full.text[:2]  # matches in the first tokens
    early = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]))
    assert len(early[0].outputs[0].token_ids) < 8
    late = llm.generate(
        PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop], min_tokens=8)
    )
    assert len(late[0].outputs[0].token_ids) >= 8


def test_a_rejected_request_takes_no_arrival_index() -> None:
    # unseeded requests draw from (engine seed, arrival index): a refused one must not shift them
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    fresh = LLM("demo", dtype="float32", max_model_len=256)
    want = fresh.generate(PROMPT, params)[0].outputs[0].token_ids
    llm = LLM("demo", dtype="float32", max_model_len=256)
    with pytest.raises(InvalidRequestError):
        llm.generate({"prompt_token_ids": list(range(300))}, params)
    # a batch refused because of its second prompt: the first one was admitted, then withdrawn
    with pytest.raises(InvalidRequestError):
        llm.generate([PROMPT, ""], params)
    assert llm.generate(PROMPT, params)[0].outputs[0].token_ids == want


@pytest.mark.parametrize("n", [0, "2", 2.0])
def test_an_n_set_after_construction_is_checked_before_the_fan_out(n: object) -> None:
    # (n 0 left the prompt without a request: IndexError after the run; "2" a TypeError)
    llm = llm32()
    params = SamplingParams(max_tokens=2)
    params.n = n  # type: ignore[assignment]
    with pytest.raises(InvalidRequestError, match="^n: "):
        llm.generate([PROMPT, PROMPT], params)
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


def test_a_progress_bar_that_fails_to_start_leaves_no_request_behind() -> None:
    llm = llm32()

    def no_bar(**_: Any) -> Any:
        raise RuntimeError("no terminal")

    arrival_index = llm.engine.arrival_index
    with pytest.raises(RuntimeError, match="no terminal"):
        llm.generate([PROMPT, PROMPT], SamplingParams(max_tokens=2), use_tqdm=no_bar)
    # (they stayed queued, and the next call computed them)
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    # nor did they take arrival indices: later unseeded requests sample as if it was never made
    assert llm.engine.arrival_index == arrival_index


def test_n_with_the_largest_seed_and_no_leak() -> None:
    llm = llm32()
    out = llm.generate(PROMPT, SamplingParams(n=2, seed=2**63 - 1, max_tokens=4, temperature=1.0))
    assert len(out[0].outputs) == 2
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


def test_outputs_of_a_step_are_not_lost_when_a_later_one_fails() -> None:
    llm = LLM("demo", dtype="float32", max_model_len=256, max_num_seqs=4)
    engine = llm.engine
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=1, temperature=0))
    engine.add_request("b", "Another prompt", SamplingParams(max_tokens=4, temperature=0))
    state_b = engine.requests["b"]

    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("injected detokenizer fault")

    state_b.detokenizer.add_tokens = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        engine.step()
    # "a" finished in that step; it is still known, so the caller can report to it.
    assert set(engine.requests) == {"a", "b"}


def test_cpu_threads_sets_torchs_thread_count() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        LLM("demo", dtype="float32", max_model_len=256, max_num_seqs=2, cpu_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_offline_generate_decodes_each_text_once_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = llm32()
    tok = llm.engine.tokenizer
    decode = tok.decode
    lengths: list[int] = []

    def counting(ids: list[int], **kw: object) -> str:
        lengths.append(len(ids))
        return decode(ids, **kw)

    monkeypatch.setattr(tok, "decode", counting)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    # one decode of the prompt's last tokens the text continues, one of them and the whole
    # output at the end: not one per token
    assert lengths == [CONTEXT_TOKENS, CONTEXT_TOKENS + 12]
    assert out.text == decode(out.token_ids)
    # with a stop string to watch for, the text is followed token by token again
    lengths.clear()
    llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=["\x00"]))
    assert len(lengths) > 12


def test_a_stop_tokens_text_is_kept_with_include_stop_str_in_output() -> None:
    llm = llm32()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    full = llm.generate(PROMPT, greedy)[0].outputs[0]
    tok = llm.get_tokenizer()
    # a stop token whose text is not empty, a few tokens in
    k = next(i for i in range(2, len(full.token_ids)) if tok.decode([full.token_ids[i]]))
    stop_id = full.token_ids[k]
    k = full.token_ids.index(stop_id)
    for include in (False, True):
        params = SamplingParams(
            max_tokens=12, temperature=0, stop_token_ids=[stop_id], include_stop_str_in_output=include
        )
        out = llm.generate(PROMPT, params)[0].outputs[0]
        assert out.token_ids == full.token_ids[: k + 1] and out.stop_reason == stop_id
        assert out.text == tok.decode(full.token_ids[: k + 1 if include else k])


def test_min_tokens_beyond_the_room_left_ends_with_length() -> None:
    llm = LLM("demo", dtype="float32", max_model_len=64, max_num_seqs=2)
    prompt = {"prompt_token_ids": list(range(5, 65))}  # leaves 4 tokens of room
    for max_tokens in (None, 30):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=8)
        out = llm.generate(prompt, params)[0].outputs[0]
        assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_a_reset_after_a_request_that_ended_on_a_checkpoint_boundary() -> None:
    # 127 prompt tokens + 2 generated: the last step computes token 128 = 2 M, and the checkpoint
    # it publishes waits for a next step that the idle engine does not run
    llm = LLM(
        "demo",
        dtype="float32",
        max_model_len=256,
        max_num_seqs=2,
        mamba_cache_mode="all",
        mamba_block_size=64,
    )
    prompt = {"prompt_token_ids": [(7 * i) % 700 + 3 for i in range(127)]}
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert llm.engine.reset_prefix_cache()
    s = llm.engine.stats()
    assert s["checkpoints_pending"] == s["checkpoints_committed"] == s["mamba_slots_used"] == 0
    again = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert again[0].num_cached_tokens == 0


def test_ctrl_c_in_a_command_is_one_line_and_status_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridserve import bench
    from hybridserve.cli import main

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "bench_main", interrupted)
    assert main(["bench", "offline", "--num-prompts", "1"]) == 130
    err = capsys.readouterr().err
    assert "hybridserve bench: interrupted" in err and "Traceback" not in err
    # a Ctrl-C while the parser is still being built (the first moments of any command)
    import hybridserve.cli as cli

    def building(*args: object, **kwargs: object) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", building)
    assert main(["serve", "demo"]) == 130
    err = capsys.readouterr().err
    assert "hybridserve serve: interrupted" in err and "Traceback" not in err


def test_generate_cli_reads_prompts_from_stdin_crlf_or_not() -> None:
    cmd = [sys.executable, "-m", "hybridserve", "generate", "demo", "--max-tokens", "2", "--json"]
    cmd += ["--max-model-len", "256"]
    out = subprocess.run(
        cmd, input="one two\r\n\r\nthree\n", capture_output=True, text=True, check=True, timeout=120
    )
    recs = [json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in recs] == ["one two", "three"]


# The demo model is trained on its corpus (python/hybridserve/model/demo_corpus.txt): the opening
# words of a corpus line -> the corpus's next words, which greedy decoding must reproduce.
CORPUS_LINES = [
    ("The morning was", " cold and clear. A thin layer of frost covered the fields"),
    ("The history of the city", " goes back more than two thousand years."),
    ("To plant a tree,", " dig a hole twice as wide as the roots but no deeper."),
]


def test_demo_model_recites_its_corpus() -> None:
    llm = llm32()
    outs = llm.generate([p for p, _ in CORPUS_LINES], SamplingParams(max_tokens=24, temperature=0))
    for (prompt, expected), out in zip(CORPUS_LINES, outs):
        assert out.outputs[0].text.startswith(expected), (prompt, out.outputs[0].text)
    # From the first 4 tokens of any line of the corpus, with nothing before them, greedy decoding
    # continues the corpus word for word, up to the EOS that ends each paragraph in training (a
    # line or two the training windows saw differently may not).
    from hybridserve.model import demo

    tok_json = (Path(demo.ensure_demo_model()) / "tokenizer.json").read_text(encoding="utf-8")
    ids, line_starts = demo.corpus_tokens(tok_json)
    eos = llm.get_tokenizer().eos_token_id
    starts = [s for s in line_starts if s + 16 <= len(ids) and eos not in ids[s : s + 4]]
    wanted = [ids[s + 4 : s + 16] for s in starts]
    wanted = [w[: w.index(eos) + 1] if eos in w else w for w in wanted]
    outs = llm.generate(
        [{"prompt_token_ids": ids[s : s + 4]} for s in starts], SamplingParams(max_tokens=12, temperature=0)
    )
    hits = sum(out.outputs[0].token_ids == w for w, out in zip(wanted, outs))
    assert hits >= 0.95 * len(starts), (hits, len(starts))
    # A recited paragraph ends with EOS: the request stops there.
    last = llm.generate("When the last bus", SamplingParams(max_tokens=128, temperature=0))[0].outputs[0]
    assert last.finish_reason == "stop" and last.text.endswith("exactly how everyone liked it.")


def test_ngram_drafts_are_accepted_on_the_corpus() -> None:
    # A corpus passage, then its opening words again: the model recites the passage a second
    # time, and n-gram lookup drafts exactly that from the prompt, so drafts are accepted because
    # the model learned the text.
    passage = (
        "The history of the city goes back more than two thousand years. Merchants came up the river in\n"
        "wooden boats, carrying salt, wine, wool and iron."
    )
    prompt = passage + "\n\nThe history of the city"
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = llm32().generate(prompt, params)[0].outputs[0]
    assert plain.text.startswith(" goes back more than two thousand years.")
    spec = LLM(
        "demo",
        dtype="float32",
        max_model_len=512,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    )
    out = spec.generate(prompt, params)[0].outputs[0]
    assert out.token_ids == plain.token_ids
    stats = spec.engine.stats()
    assert stats["spec_decode_accepted_tokens"] >= 0.75 * stats["spec_decode_draft_tokens"] > 0


def test_generate_schedules_a_batch_by_priority_and_outputs_do_not_change() -> None:
    llm = LLM("demo", dtype="float32", max_model_len=256, max_num_seqs=1)
    prompts = ["one two", "three four", "five six", "seven"]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    order: list[str] = []
    step = llm.engine.step

    def recording_step():  # type: ignore[no-untyped-def]
        outs = step()
        order.extend(o.prompt for o in outs if o.finished)
        return outs

    llm.engine.step = recording_step  # type: ignore[method-assign]
    ranked = llm.generate(prompts, params, priority=[2, -1, 2, np.int64(0)])
    assert [o.outputs[0].token_ids for o in ranked] == plain  # in prompt order, unchanged
    assert order == ["three four", "seven", "one two", "five six"]  # one at a time, by priority
    for bad, word in (([0, 0], "one per prompt"), (3, "a list of integers"), ([0, 0, 0, 1.5], "priority")):
        with pytest.raises(InvalidRequestError, match=word):
            llm.generate(prompts, params, priority=bad)  # type: ignore[arg-type]
    stats = llm.engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_finished_outputs_carry_the_request_phases() -> None:
    # one sequence at a time: the second request waits in the queue for the whole first one
    llm = LLM("demo", dtype="float32", max_model_len=256, max_num_seqs=1)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first, second = llm.generate([PROMPT, "Another prompt of its own"], params)
    for out in (first, second):
        m = out.metrics
        assert m is not None
        assert m.first_scheduled_time is not None and m.first_token_time is not None
        assert m.last_token_time is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
        assert m.last_token_time <= m.finished_time
        assert m.queue_time == m.first_scheduled_time - m.arrival_time
        assert m.prefill_time == m.first_token_time - m.first_scheduled_time
        assert m.decode_time == m.last_token_time - m.first_token_time
        assert m.inference_time == m.finished_time - m.first_scheduled_time
    # (the second is scheduled only once the first has made its last token)
    assert first.metrics is not None and second.metrics is not None
    assert second.metrics.first_scheduled_time >= first.metrics.last_token_time  # type: ignore[operator]
    assert second.metrics.queue_time >= first.metrics.decode_time  # type: ignore[operator]
    # n sequences: the first of each start, the last of each end
    both = llm.generate(PROMPT, SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=3, ignore_eos=True))[
        0
    ]
    assert both.metrics is not None and both.metrics.first_scheduled_time is not None
    assert both.metrics.arrival_time <= both.metrics.first_scheduled_time <= both.metrics.finished_time
    assert both.metrics.last_token_time is not None and both.metrics.first_token_time is not None
    assert both.metrics.decode_time is not None and both.metrics.decode_time >= 0


def test_request_phases_not_reached_are_none_and_sequences_combine() -> None:
    from hybridserve.engine.outputs import RequestMetrics

    waiting = RequestMetrics(1.0, None, None, None, 2.0)
    assert waiting.queue_time is None and waiting.prefill_time is None
    assert waiting.decode_time is None and waiting.inference_time is None
    ran = RequestMetrics(1.0, 1.5, 1.75, 3.0, 3.5)
    merged = RequestMetrics.combined([waiting, ran, None])
    assert merged == RequestMetrics(1.0, 1.5, 1.75, 3.0, 3.5)
    assert RequestMetrics.combined([None]) is None


def test_vllm_s_prefix_cache_figures_leave_out_the_lookups_of_preempted_requests() -> None:
    """A preempted request looks its tokens up again when it is readmitted, and mostly finds its own
    blocks: vLLM counts that apart from its prefix-cache queries and hits, and so do the figures
    behind `vllm:prefix_cache_*`; the engine's own counters count every admission."""
    llm = LLM("demo", dtype="float32", max_num_batched_tokens=128, num_kv_blocks=30, max_model_len=256)
    prompts = [
        f"Request {i} tells a story about the sea and the ships that sail on it at night" for i in range(6)
    ]
    outs = llm.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True, temperature=0))
    s = llm.engine.stats()
    assert s["num_preemptions_total"] > 0 and s["prefix_preempted_queried_tokens"] > 0
    # every prompt looked up once, at its first admission, as vLLM counts queries
    assert s["vllm_prefix_cache_queried_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
    assert s["prefix_cache_queried_tokens"] == (
        s["vllm_prefix_cache_queried_tokens"] + s["prefix_preempted_queried_tokens"]
    )
    assert (
        s["prefix_cache_hit_tokens"] == s["vllm_prefix_cache_hit_tokens"] + s["prefix_preempted_hit_tokens"]
    )


def test_a_request_that_may_not_read_the_cache_makes_no_query() -> None:
    """A request for prompt logprobs computes its whole prompt (a hit would skip the logprobs of
    the cached part), so it queries nothing: counted, its tokens lowered the hit rate, which
    vLLM's counters do not. The same prompt without them is a query."""
    llm = LLM("demo", dtype="float32", max_model_len=256)
    prompt = "A story about the sea and the ships that sail on it at night, told twice over"
    n = len(llm.generate(prompt, SamplingParams(max_tokens=1))[0].prompt_token_ids)
    before = llm.engine.stats()
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    s = llm.engine.stats()
    assert out.num_cached_tokens == 0 and out.prompt_logprobs is not None
    assert s["prefix_cache_queried_tokens"] == before["prefix_cache_queried_tokens"]
    assert s["vllm_prefix_cache_queried_tokens"] == before["vllm_prefix_cache_queried_tokens"]
    llm.generate(prompt, SamplingParams(max_tokens=1))
    assert llm.engine.stats()["prefix_cache_queried_tokens"] == before["prefix_cache_queried_tokens"] + n


def test_a_text_prompt_gets_the_tokenizer_s_special_tokens_as_the_completion_route_s(tmp_path: Path) -> None:
    """A tokenizer that puts a BOS first: `generate` with a text encodes it with it (as vLLM's
    `LLM.generate` and the server's /v1/completions do), token ids stay as given."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    from hybridserve.engine.tokenizer import Tokenizer
    from hybridserve.model.demo import resolve_model_path

    hf = HFTokenizer.from_file(str(Path(resolve_model_path("demo")) / "tokenizer.json"))
    hf.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    hf.save(str(tmp_path / "tokenizer.json"))
    llm = LLM("demo", dtype="float32", max_model_len=128, tokenizer=str(tmp_path))
    params = SamplingParams(max_tokens=1, temperature=0)
    (out,) = llm.generate("Hello world", params)
    assert out.prompt_token_ids == Tokenizer(tmp_path).encode("Hello world", add_special_tokens=True)
    assert out.prompt_token_ids[0] == 0 and len(out.prompt_token_ids) > 1
    (given,) = llm.generate({"prompt_token_ids": out.prompt_token_ids[1:]}, params)
    assert given.prompt_token_ids == out.prompt_token_ids[1:]


def test_vllm_s_other_sampling_fields_are_taken_or_refused_by_name() -> None:
    llm = LLM("demo", dtype="float32", max_model_len=128)
    ok = SamplingParams(n=2, best_of=2, spaces_between_special_tokens=False, detokenize=True, max_tokens=2)
    assert [len(o.outputs) for o in llm.generate("Hello", ok)] == [2]
    for kw, field in (
        ({"best_of": 3}, "best_of"),
        ({"detokenize": False}, "detokenize"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ):
        with pytest.raises(InvalidRequestError, match=field):
            SamplingParams(**kw)
    # truncate_prompt_tokens keeps the prompt's last tokens (-1: as many as the context holds)
    ids = list(range(10, 40))
    (cut,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, truncate_prompt_tokens=8))
    assert cut.prompt_token_ids == ids[-8:]
    (whole,) = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1)
    )
    assert whole.prompt_token_ids == ids
    # a text far longer than the context is cut, not refused
    (long_text,) = llm.generate(
        "hello world " * 2000, SamplingParams(max_tokens=1, truncate_prompt_tokens=50)
    )
    assert len(long_text.prompt_token_ids) == 50 and long_text.prompt is None
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        llm.generate("hi", SamplingParams(max_tokens=1, truncate_prompt_tokens=129))
    # a logit_bias outside the vocabulary is refused, as the HTTP route refuses it
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        llm.generate("Hello", SamplingParams(max_tokens=1, logit_bias={10**6: 5.0}))


def test_code_written_for_vllm_s_llm_runs() -> None:
    """vLLM's arguments that change nothing here are taken (and a value that would change the
    model is refused by name); its dtype names and a torch dtype; seed None; `cumulative_logprob`;
    `lora_request=None` in its place; a tokenizer that encodes as transformers' does; a callable
    `use_tqdm` makes the bar, one step a prompt; `reset_prefix_cache`; a prompt dict with a key
    that is not served is refused, not dropped."""
    llm = LLM(
        "demo", dtype=torch.float32, seed=None, trust_remote_code=True, swap_space=4, disable_log_stats=True,
        tokenizer_mode="auto", quantization=None, max_model_len=128, pipeline_parallel_size=1,
        data_parallel_size=1, task="generate", runner="auto", enable_lora=False, skip_tokenizer_init=False,
        enable_expert_parallel=False, distributed_executor_backend=None, disable_async_output_proc=True,
        served_model_name="m",
    )  # fmt: skip
    assert llm.engine.args.dtype == "float32" and llm.engine.args.seed == 0
    with pytest.raises(ConfigError, match="quantization"):
        LLM("demo", quantization="fp8")
    for name, value in (("task", "embed"), ("enable_lora", True), ("distributed_executor_backend", "ray")):
        with pytest.raises(ConfigError, match=f"{name}: only .* is served here, got {value!r}"):
            LLM("demo", **{name: value})
    assert llm.llm_engine.get_tokenizer() is llm.get_tokenizer()
    with pytest.raises(
        ConfigError, match="pipeline_parallel_size: only 1 here, got 2: .*tensor_parallel_size"
    ):
        LLM("demo", pipeline_parallel_size=2)  # (it was a TypeError)
    with pytest.raises(ConfigError, match="data_parallel_size: only 1 here, got 2: .*hybridserve replicas"):
        LLM("demo", data_parallel_size=2)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=1, n=2)
    bars: list[Any] = []

    class Bar:
        def __init__(self, total: int, desc: str) -> None:
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, k: int) -> None:
            self.n += k

        def close(self) -> None:
            pass

    outs = llm.generate(["Hello", "World"], params, Bar, None)  # (use_tqdm, lora_request: vLLM's order)
    assert [(b.total, b.n) for b in bars] == [(2, 2)]
    for o in outs[0].outputs:
        want = sum(lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs or []))
        assert o.cumulative_logprob == pytest.approx(want) and o.cumulative_logprob < 0
    assert all(o.finished() for o in outs[0].outputs)  # (vLLM's CompletionOutput.finished())
    (plain,) = llm.generate("Hello", SamplingParams(max_tokens=2))
    assert plain.outputs[0].cumulative_logprob is None
    tok = llm.get_tokenizer()
    assert tok("Hello")["input_ids"] == tok.encode("Hello") == outs[0].prompt_token_ids
    assert llm.reset_prefix_cache() is True
    with pytest.raises(InvalidRequestError, match="multi_modal_data"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": None}}, params)
    with pytest.raises(InvalidRequestError, match="lora_request"):
        llm.chat([{"role": "user", "content": "hi"}], params, lora_request=object())  # type: ignore[arg-type]


def test_generate_refuses_while_step_api_requests_run() -> None:
    """Its loop would run them to their end and drop their outputs."""
    llm = llm32()
    params = SamplingParams(max_tokens=3, temperature=0)
    llm.engine.add_request("mine", "The morning was", params)
    with pytest.raises(InvalidRequestError, match="step API \\('mine', ...\\)"):
        llm.generate("Hello", params)
    finished = []
    while llm.engine.has_unfinished_requests():
        finished += [o for o in llm.engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["mine"] and len(finished[0].outputs[0].token_ids) == 3
    (out,) = llm.generate("Hello", params)  # (nothing of the refused call was left behind)
    assert len(out.outputs[0].token_ids) == 3


def _documented_stats_keys() -> set[str]:
    """The keys docs/serving.md's "Engine stats keys" table names (`a_{b,c}` spelled out)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    table = text.split("### Engine stats keys", 1)[1].split("\n### ", 1)[0]
    keys: set[str] = set()
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        first_cell = line.split(" | ", 1)[0]
        for name in re.findall(r"`([a-z0-9_{},]+)`", first_cell):
            m = re.fullmatch(r"([a-z0-9_]*)\{([a-z0-9_,]+)\}([a-z0-9_]*)", name)
            keys.update(m[1] + part + m[3] for part in m[2].split(",")) if m else keys.add(name)
    return keys


def test_every_documented_stats_key_is_in_stats() -> None:
    llm = llm32()  # default settings: no KV-event publisher, no speculation
    llm.generate("Hello", SamplingParams(max_tokens=2))
    documented = _documented_stats_keys()
    assert len(documented) > 60  # the table was found and read
    missing = documented - set(llm.engine.stats())
    assert not missing, f"documented in docs/serving.md but not in stats(): {sorted(missing)}"
