"""Default sampling parameters from a model's generation config (config/generation.py), as vLLM
takes them: the fields read, transformers' own defaults left out, the override, the settings
auto / vllm / a folder, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from family_engine import explain
from hybridserve import ConfigError, EngineArgs
from hybridserve.config.generation import sampling_defaults


def _folder(tmp_path: Path, config: object, name: str = "m") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps(config), encoding="utf-8")
    return d


def test_fields_are_read_and_transformers_defaults_left_out(tmp_path: Path) -> None:
    d = _folder(
        tmp_path,
        {"temperature": 0.6, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.0, "max_new_tokens": 64,
         "do_sample": True, "eos_token_id": 2, "min_p": None},
    )  # fmt: skip
    defaults, why = sampling_defaults("auto", None, d)
    # top_k 50 and repetition_penalty 1.0 are transformers' defaults: no recommendation
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 64}
    assert "generation_config.json" in why and "temperature=0.6" in why


def test_settings_vllm_folder_and_override(tmp_path: Path) -> None:
    model = _folder(tmp_path, {"temperature": 0.6})
    other = _folder(tmp_path, {"top_k": 20}, "other")
    assert sampling_defaults("vllm", None, model)[0] == {}
    assert sampling_defaults(str(other), None, model)[0] == {"top_k": 20}
    assert sampling_defaults("auto", '{"temperature": 0.2, "min_p": 0.05}', model)[0] == {
        "temperature": 0.2,
        "min_p": 0.05,
    }
    assert sampling_defaults("vllm", {"max_new_tokens": 9}, model)[0] == {"max_tokens": 9}
    # a model without the file has no defaults, nor one whose file is no JSON object (ignored, as
    # transformers ignores it); without the file, config.json's fields count, as transformers
    # builds a generation config from it
    assert sampling_defaults("auto", None, tmp_path)[0] == {}
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text('{"model_type": "x", "top_k": 50, "top_p": 0.8}', encoding="utf-8")
    assert sampling_defaults("auto", None, bare)[0] == {"top_p": 0.8}
    (model / "generation_config.json").write_bytes(b"\xff not json")
    assert sampling_defaults("auto", None, model)[0] == {}
    (model / "generation_config.json").write_text("[1, 2]", encoding="utf-8")
    assert sampling_defaults("auto", None, model)[0] == {}


@pytest.mark.parametrize(
    ("setting", "override", "config", "match"),
    [
        ("nowhere", None, {}, "does not exist"),
        ("auto", '{"temprature": 0.5}', {}, "unknown field"),
        ("auto", '{"temperature": "hot"}', {}, "temperature must be a number"),
        ("auto", '{"top_k": 2.5}', {}, "top_k must be an integer"),
        ("auto", "[1]", {}, "must be a JSON object"),
        ("auto", None, {"temperature": -1}, "temperature"),
        ("folder", None, [1, 2], "does not hold a JSON object"),
        ("folder", None, "{not json", "not readable JSON"),
    ],
)
def test_bad_settings_are_config_errors(
    tmp_path: Path, setting: str, override: str | None, config: object, match: str
) -> None:
    d = _folder(tmp_path, config)
    if isinstance(config, str):
        (d / "generation_config.json").write_text(config, encoding="utf-8")
    if setting == "nowhere":
        setting = str(tmp_path / "nowhere")
    if setting == "folder":
        setting = str(d)
    with pytest.raises(ConfigError, match=match):
        sampling_defaults(setting, override, d)


def test_engine_args_check_the_flags() -> None:
    with pytest.raises(ConfigError, match="--override-generation-config"):
        EngineArgs(model="demo", override_generation_config='{"seed": 1}').validate()
    with pytest.raises(ConfigError, match="--generation-config must be"):
        EngineArgs(model="demo", generation_config="").validate()


def test_config_explain_shows_the_defaults(tmp_path: Path) -> None:
    from hybridserve.model.demo import ensure_demo_model

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_bytes((Path(ensure_demo_model()) / "config.json").read_bytes())
    (d / "generation_config.json").write_text('{"temperature": 0.7}', encoding="utf-8")
    shown = explain(d)
    assert "generation_config_defaults" in shown and "temperature=0.7" in shown
    assert "generation_config_defaults" not in explain(d, "--generation-config", "vllm")
