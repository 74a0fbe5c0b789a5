"""The engine's tokenizer: `tokenizers.Tokenizer` from tokenizer.json, with the special tokens of
tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridserve.errors import ConfigError


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{path}: missing (a model folder needs tokenizer.json)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises plain Exceptions for bad files
            raise ConfigError(f"{path}: cannot be loaded: {exc}") from exc
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.eos_token = self._special("eos_token")
        self.bos_token = self._special("bos_token")
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.chat_template: str | None = self.config.get("chat_template")

    def _special(self, key: str) -> str | None:
        v = self.config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return v if isinstance(v, str) else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_text(self, token_id: int) -> str:
        return self._tok.decode([int(token_id)], skip_special_tokens=False)
