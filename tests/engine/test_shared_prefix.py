"""Declared shared prefixes (engine/shared_prefix.py): which token ends a prompt's first message,
taken from the chat template, and what the engine declares to the scheduler."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.config import EngineArgs
from hybridserve.engine.chat_template import ChatTemplate
from hybridserve.engine.shared_prefix import resolve_markers, shared_prefix_len
from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.errors import ConfigError
from hybridserve.model.demo import ensure_demo_model


def test_the_first_marker_of_any_kind_ends_the_declared_prefix() -> None:
    assert shared_prefix_len([9, 9, 7, 9, 5, 7], [5, 7]) == 3
    assert shared_prefix_len([9, 9, 7, 9, 5, 7], [5]) == 5
    assert shared_prefix_len([9, 9], [5, 7]) is None
    assert shared_prefix_len([9, 9], []) is None


@pytest.mark.parametrize(
    "value, expected",
    [("auto", "auto"), ("None", "none"), ("2", (2,)), (" 2, 7 ", (2, 7)), ([3, 4], (3, 4))],
)
def test_the_setting_parses(value: object, expected: object) -> None:
    from hybridserve.config.args import parse_shared_prefix_markers

    assert parse_shared_prefix_markers(value) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["two", "2,,7", "-1", [], [True], [-3], ["2"]])
def test_a_bad_setting_names_the_flag(value: object) -> None:
    with pytest.raises(ConfigError, match="--shared-prefix-markers"):
        EngineArgs("demo", shared_prefix_markers=value).validate()  # type: ignore[arg-type]


def test_auto_takes_the_chat_templates_end_of_message_token() -> None:
    model = ensure_demo_model()
    tok = Tokenizer(model)
    ids, why = resolve_markers("auto", model, tok)
    assert ids == (tok.encode("<|im_end|>")[0],) and "<|im_end|>" in why
    # in a rendered chat, the first one ends the system message
    text = ChatTemplate.from_model_dir(model).render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    prompt = tok.encode(text)
    n = shared_prefix_len(prompt, ids)
    assert n is not None and tok.decode(prompt[:n], skip_special_tokens=False).endswith("Be brief.<|im_end|>")
    assert resolve_markers("none", model, tok)[0] == ()
    assert resolve_markers("5,6", model, tok)[0] == (5, 6)
    # an id no token has would never be found: refused, naming it
    with pytest.raises(ConfigError, match=f"--shared-prefix-markers: {tok.vocab_size} outside"):
        resolve_markers(f"5,{tok.vocab_size}", model, tok)


def test_auto_declares_nothing_where_the_template_writes_no_special_token(tmp_path: Path) -> None:
    model = tmp_path / "plain"
    shutil.copytree(ensure_demo_model(), model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    cfg_path.write_text(json.dumps(cfg))
    ids, why = resolve_markers("auto", model, Tokenizer(model))
    assert ids == () and "no special token" in why


def test_the_second_user_of_a_chat_system_prompt_hits_it() -> None:
    """Through the engine with the demo's chat template: the first request declares its system
    message, so the second one, with another user message, already hits the system message's whole
    blocks; with the markers off it hits nothing (the branch point is found by the second user)."""
    model = ensure_demo_model()
    template = ChatTemplate.from_model_dir(model)
    tok = Tokenizer(model)
    system = "You answer questions about the demo corpus, briefly and exactly. " * 3

    def prompt(user: str) -> list[int]:
        return tok.encode(
            template.render([{"role": "system", "content": system}, {"role": "user", "content": user}])
        )

    first, second = prompt("What is the first word?"), prompt("Name the last one.")
    declared = shared_prefix_len(first, resolve_markers("auto", model, tok)[0])
    assert declared is not None and first[:declared] == second[:declared] and declared > 32
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def hits(markers: str) -> tuple[int, int]:
        llm = LLM("demo", block_size=16, max_model_len=512, shared_prefix_markers=markers)
        outs = [llm.generate({"prompt_token_ids": p}, params)[0] for p in (first, second)]
        return outs[1].num_cached_tokens, int(llm.engine.stats()["prefix_hits_declared"])

    assert hits("auto") == (declared // 16 * 16, 1)
    assert hits("none") == (0, 0)
