"""The model's generation config as the offline API's default sampling parameters (vLLM's
`LLM.get_default_sampling_params`), on a copy of the demo model that recommends greedy decoding
and a short answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.model.demo import ensure_demo_model, resolve_model_path

PROMPTS = ["The quick brown fox", "Once upon a time"]


@pytest.fixture(scope="module")
def recommending_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gen_cfg_demo")
    for f in Path(ensure_demo_model()).iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    (d / "generation_config.json").write_text(
        '{"bos_token_id": 1, "temperature": 0.0, "max_new_tokens": 5, "top_k": 50}', encoding="utf-8"
    )
    return d


def test_generation_config_is_the_default_and_vllm_turns_it_off(recommending_model: Path) -> None:
    llm = LLM(str(recommending_model), dtype="float32", max_model_len=256, max_num_seqs=4)
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.0, 5, 0)
        got = llm.generate(PROMPTS)  # no parameters: the model's
        want = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5))
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert all(1 <= len(o.outputs[0].token_ids) <= 5 for o in got)
        # parameters given are used as given
        assert (
            len(
                llm.generate(PROMPTS[0], SamplingParams(max_tokens=7, ignore_eos=True))[0]
                .outputs[0]
                .token_ids
            )
            == 7
        )
        chat = llm.chat([{"role": "user", "content": "Hello"}])
        assert len(chat[0].outputs[0].token_ids) <= 5
    finally:
        llm.engine.shutdown()
    plain = LLM(
        str(recommending_model), dtype="float32", max_model_len=256, max_num_seqs=4, generation_config="vllm"
    )
    try:
        assert plain.get_default_sampling_params() == SamplingParams()
    finally:
        plain.engine.shutdown()
    over = LLM(
        str(recommending_model),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        override_generation_config={"max_new_tokens": 3},
    )
    try:
        defaults = over.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens) == (0.0, 3)
    finally:
        over.engine.shutdown()


def test_every_eos_id_of_the_model_ends_a_request_as_a_stop_token(tmp_path: Path) -> None:
    """A generation_config.json whose eos_token_id is a list (instruct checkpoints name their
    end-of-turn token there): each id ends the output, as transformers stops and as vLLM adds them
    to the request's stop token ids; ignore_eos runs past them, min_tokens masks them."""
    demo = Path(resolve_model_path("demo"))
    ids = list(range(10, 30))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (free,) = LLM("demo", dtype="float32", max_model_len=128).generate({"prompt_token_ids": ids}, greedy)
    tokens = list(free.outputs[0].token_ids)
    other = next(t for t in tokens[2:] if t not in tokens[:2] and t != 2)  # an id first made 3rd or later
    at = tokens.index(other)
    folder = tmp_path / "two_eos"
    folder.mkdir()
    for f in demo.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, other]}))
    llm = LLM(str(folder), dtype="float32", max_model_len=128)
    (out,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=8, temperature=0))
    assert list(out.outputs[0].token_ids) == tokens[: at + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == other
    (past,) = llm.generate({"prompt_token_ids": ids}, greedy)
    assert list(past.outputs[0].token_ids) == tokens
    (held,) = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=8, temperature=0, min_tokens=8)
    )
    assert other not in held.outputs[0].token_ids[: at + 1]  # (masked while min_tokens holds)
