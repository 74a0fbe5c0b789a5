"""A config.json that leaves a field out means transformers' default for it: for each family, the
engine reads transformers' own default config the same with any one field left out, or refuses
the config (a field it needs, such as hidden_size). Token ids are the exception: the engine takes
the end of a sequence from the tokenizer and generation config, as vLLM does."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import transformers

from hybridserve.errors import ConfigError
from hybridserve.model.architectures import get_architecture

FAMILIES = [
    "BambaConfig",
    "JambaConfig",
    "FalconH1Config",
    "NemotronHConfig",
    "GraniteMoeHybridConfig",
    "Zamba2Config",
    "Mamba2Config",
]
# read elsewhere (the tokenizer, generation config), or no field of the model
SKIPPED = {
    "architectures",
    "model_type",
    "transformers_version",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
}


def _parse(architecture: str, raw: dict[str, Any]) -> str | None:
    """The parsed config's repr, None where the engine refuses it."""
    try:
        return repr(get_architecture(architecture).parse_config(json.loads(json.dumps(raw)), "config.json"))
    except (ConfigError, KeyError, TypeError, ValueError):
        return None


@pytest.mark.parametrize("config_class", FAMILIES)
def test_a_field_left_out_reads_as_transformers_default(config_class: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = getattr(transformers, config_class)().to_dict()
    architecture = config_class.replace("Config", "ForCausalLM")
    whole = _parse(architecture, full)
    assert whole is not None
    differ = []
    for field in sorted(set(full) - SKIPPED):
        parsed = _parse(architecture, {k: v for k, v in full.items() if k != field})
        if parsed is not None and parsed != whole:
            differ.append(field)
    assert differ == []
