"""The engine's tokenizer: `tokenizers.Tokenizer` from tokenizer.json, with the special tokens of
tokenizer_config.json."""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

from hybridserve.errors import ConfigError

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece's byte-fallback pieces

# Texts of at least this many characters (in all, for `encode_many`) are encoded through
# `encode_batch`, which lets go of Python's global lock while it works (`encode` holds it): a
# prompt of megabytes takes seconds to tokenize, and the server's event loop and engine thread must
# run meanwhile. Shorter texts keep `encode`: a thread that lets go of the lock while the engine
# thread runs may wait for it to come back, which a short text's few microseconds of work do not
# justify. Both give the same ids.
_RELEASE_GIL_CHARS = 16384


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), inverted: char -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), 256),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_LEVEL = _byte_level_alphabet()


def with_special_tokens_map(model_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    """`config` (tokenizer_config.json's fields) with the special tokens (`bos_token`,
    `eos_token`, ...) that special_tokens_map.json names put over its own, as transformers reads
    them: older checkpoints name them only there. A config in the newer form (with
    `added_tokens_decoder`) is taken alone, as transformers takes it. ConfigError for a file that
    is not a JSON object."""
    path = model_dir / "special_tokens_map.json"
    if not path.is_file() or "added_tokens_decoder" in config:
        return config
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path}: cannot read the special tokens: {e}") from None
    if not isinstance(entries, dict):
        raise ConfigError(f"{path}: the special tokens must be a JSON object")
    named = {
        k: v
        for k, v in entries.items()
        if isinstance(k, str)
        and (k.endswith("_token") or k in ("additional_special_tokens", "extra_special_tokens"))
        and v is not None
    }
    return {**config, **named}


class Encoding(dict[str, Any]):
    """What the tokenizer's call form returns: transformers' `BatchEncoding` as scripts read it,
    by key (`enc["input_ids"]`) or by attribute (`enc.input_ids`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        self.model_dir = model_dir
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{path}: missing (a model folder needs tokenizer.json)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises plain Exceptions for bad files
            raise ConfigError(f"{path}: cannot be loaded: {exc}") from exc
        # A tokenizer.json saved with truncation or padding would cut or pad every prompt silently;
        # transformers' tokenizer turns both off for a plain call, and so does the engine.
        self._tok.no_truncation()
        self._tok.no_padding()
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = {}
        if cfg_path.is_file():
            try:
                self.config = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ConfigError(f"{cfg_path}: cannot read the tokenizer config: {e}") from None
            except RecursionError:
                raise ConfigError(
                    f"{cfg_path}: cannot read the tokenizer config: nested too deeply"
                ) from None
            if not isinstance(self.config, dict):
                raise ConfigError(f"{cfg_path}: the tokenizer config must be a JSON object")
        self.config = with_special_tokens_map(model_dir, self.config)
        self.eos_token = self._special("eos_token")
        self.bos_token = self._special("bos_token")
        self.eos_token_id = self._id_of(self.eos_token)
        self.bos_token_id = self._id_of(self.bos_token)
        self.chat_template: str | None = self.config.get("chat_template")
        added = self._tok.get_added_tokens_decoder()
        self._special_ids = {i for i, t in added.items() if t.special}
        # tokens that tokenizer.json leaves plain and the config makes special (one it names as
        # eos_token and the like, or marks special in added_tokens_decoder): transformers skips
        # them too; the library's own skipping does not know them, so `decode` drops them first
        self._config_special_ids = self._named_special_ids() - self._special_ids
        self._special_ids |= self._config_special_ids
        #: added tokens by their text (a model's tags: `<tool_call>`, `</think>`)
        self.added_token_ids: dict[str, int] = {t.content: i for i, t in added.items() if t.content}
        self._labels: dict[int, str] = {}

    def _named_special_ids(self) -> set[int]:
        """Ids of the tokens the config makes special: the ones it names (`bos_token`,
        `eos_token`, ..., `additional_special_tokens`) and those `added_tokens_decoder` marks."""
        texts = [self._special(k) for k in self.config if isinstance(k, str) and k.endswith("_token")]
        for key in ("additional_special_tokens", "extra_special_tokens"):  # (transformers 5's name)
            more = self.config.get(key)
            if isinstance(more, dict):  # (extra_special_tokens may name them: {"image_token": ...})
                more = list(more.values())
            if isinstance(more, list):
                texts += [
                    t if isinstance(t, str) else t.get("content") if isinstance(t, dict) else None
                    for t in more
                ]
        ids = {i for t in texts if isinstance(t, str) and (i := self._tok.token_to_id(t)) is not None}
        declared = self.config.get("added_tokens_decoder")
        if isinstance(declared, dict):
            for key, entry in declared.items():
                if isinstance(entry, dict) and entry.get("special") is True and str(key).isdigit():
                    ids.add(int(key))
        return ids

    def _id_of(self, token: str | None) -> int | None:
        """A named token's id (None for no name, or a name the vocabulary lacks)."""
        return self._tok.token_to_id(token) if token else None

    def _special(self, key: str) -> str | None:
        v = self.config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return v if isinstance(v, str) else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of a text, with the tokenizer's special tokens (a BOS) by default, as
        transformers' `encode` and vLLM's tokenizer give them (`LLM.get_tokenizer()`)."""
        return self.encode_many([text], add_special_tokens=add_special_tokens)[0]

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> Encoding:
        """transformers' call form: `input_ids` and `attention_mask` (every token attended), lists
        of them for a list of texts."""
        if isinstance(text, list):
            ids = self.encode_many(text, add_special_tokens=add_special_tokens)
            return Encoding(input_ids=ids, attention_mask=[[1] * len(one) for one in ids])
        one = self.encode(text, add_special_tokens=add_special_tokens)
        return Encoding(input_ids=one, attention_mask=[1] * len(one))

    # transformers' tokenizer methods that scripts written for vLLM call on `LLM.get_tokenizer()`

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return dict(self._tok.get_vocab(with_added_tokens=True))

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        return self.id_to_token(ids) if isinstance(ids, int) else [self.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """Each token's id; one the vocabulary lacks is the unknown token's (None without one)."""

        def one(t: str) -> int | None:
            tid = self._tok.token_to_id(t)
            return tid if tid is not None else self.unk_token_id

        return one(tokens) if isinstance(tokens, str) else [one(t) for t in tokens]

    def batch_decode(
        self, sequences: list[list[int]], skip_special_tokens: bool = False, **kwargs: Any
    ) -> list[str]:
        """Each sequence decoded (transformers' default keeps the special tokens; its other
        options, `clean_up_tokenization_spaces` say, change nothing here)."""
        return [self.decode(list(ids), skip_special_tokens=skip_special_tokens) for ids in sequences]

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self._special_ids)

    @property
    def all_special_tokens(self) -> list[str]:
        return [t for i in self.all_special_ids if (t := self.id_to_token(i)) is not None]

    @property
    def pad_token(self) -> str | None:
        return self._special("pad_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of(self.pad_token)

    @property
    def unk_token(self) -> str | None:
        return self._special("unk_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id_of(self.unk_token)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> str | list[int] | dict[str, list[int]]:
        """The model's chat template (or `chat_template`: a template's text, or the name of one of
        the model's) rendered as transformers' `apply_chat_template` renders it (`kwargs`: more
        template variables): the text, or with `tokenize` its ids (the special tokens the
        template writes, none added), as {"input_ids": ...} with `return_dict`. Tensors
        (`return_tensors`) are not made: a TypeError, not a list where a tensor was asked for."""
        from hybridserve.engine.chat_template import ChatTemplate, encode_rendered

        if kwargs.pop("return_tensors", None) is not None:
            raise TypeError("apply_chat_template: return_tensors is not served; convert the ids")
        template = ChatTemplate.from_model_dir(self.model_dir)
        if chat_template is not None:
            template = template.with_source(chat_template)
        extra = {**kwargs, **({"tools": tools} if tools is not None else {})}
        text = template.render(
            conversation, add_generation_prompt, extra or None, continue_final_message=continue_final_message
        )
        if not tokenize:
            return text
        ids = encode_rendered(self, text, add_special_tokens=False)
        return Encoding(input_ids=ids) if return_dict else ids

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """The ids of each text. Texts that are long in all go through one `encode_batch` call,
        which holds the global lock for none of them: one `encode` per text would hold it for each
        in turn, and every time the engine thread let go of it (each torch operation does) the
        next text would take it for its whole length."""
        if sum(len(t) for t in texts) >= _RELEASE_GIL_CHARS:
            return [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]
        return [list(self._tok.encode(t, add_special_tokens=add_special_tokens).ids) for t in texts]

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))` found without encoding (0 where none is known), so
        that a prompt of megabytes is refused as longer than the context at once instead of after
        seconds of tokenizing."""
        per_token = self._max_chars_per_token
        return -(-len(text) // per_token) if per_token else 0

    @cached_property
    def _max_chars_per_token(self) -> int | None:
        """The most characters of a text one token can stand for, where that is bounded: in a
        byte-level BPE without a normalizer every byte of the text is covered by exactly one token,
        a vocabulary entry of k characters covers k bytes and an added token its text's bytes, and a
        character is at least one byte. Anything else (a normalizer that may shorten the text, an
        unknown-token that stands for any run, an added token that swallows the spaces beside it, a
        byte missing from the vocabulary) gives no bound."""
        try:
            spec = json.loads(self.to_json())
        except (ValueError, RecursionError):
            return None
        model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
        pres = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
        if spec.get("normalizer") is not None or model.get("type") != "BPE":
            return None
        if not any(isinstance(q, dict) and q.get("type") == "ByteLevel" for q in pres):
            return None
        vocab = model.get("vocab")
        if not isinstance(vocab, dict) or not all(c in vocab for c in _BYTE_LEVEL):
            return None
        longest = max(len(piece) for piece in vocab)
        for added in spec.get("added_tokens") or []:
            if added.get("lstrip") or added.get("rstrip"):
                return None
            longest = max(longest, len(str(added.get("content", "")).encode("utf-8")))
        return longest

    def decode(self, ids: int | list[int], skip_special_tokens: bool = True) -> str:
        # (one id, a numpy one too, as transformers' decode takes it)
        seq = list(ids) if isinstance(ids, Iterable) else [operator.index(ids)]
        if skip_special_tokens and self._config_special_ids:
            seq = [i for i in seq if i not in self._config_special_ids]
        return self._tok.decode(seq, skip_special_tokens=skip_special_tokens)

    @cached_property
    def _probe(self) -> tuple[int, str] | None:
        """A token that decodes to one character, alone and repeated: decoded just before another
        token, it takes what the decoder does to the start of a text (SentencePiece's decoders
        drop the text's first space), so that the other token shows the text it adds within a
        sequence. None when the vocabulary has no such token."""
        candidates = [self._tok.token_to_id(c) for c in "aeiostnrxAEIOST0123456789"]
        candidates += range(min(self._tok.get_vocab_size(), 2048))
        for tid in candidates:
            if tid is None:
                continue
            one = self._tok.decode([tid], skip_special_tokens=False)
            if len(one) == 1 and not one.isspace() and one != "\ufffd":
                if self._tok.decode([tid, tid], skip_special_tokens=False) == one * 2:
                    return tid, one
        return None

    def token_bytes(self, token_id: int, first: bool = False) -> bytes:
        """The bytes one token adds to a text it is part of (`first`: to a text it begins; they
        differ where the decoder drops a text's first space, as SentencePiece's Metaspace does). A
        piece of a multi-byte character decodes to U+FFFD on its own; its bytes come from the
        vocabulary entry (byte-level BPE or byte fallback)."""
        probe = None if first else self._probe
        if probe is None:
            text = self._tok.decode([int(token_id)], skip_special_tokens=False)
        else:
            text = self._tok.decode([probe[0], int(token_id)], skip_special_tokens=False)
            text = text[len(probe[1]) :] if text.startswith(probe[1]) else text
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self._tok.id_to_token(int(token_id)) or ""
        m = _BYTE_FALLBACK.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if piece and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return text.encode("utf-8")

    def token_to_text(self, token_id: int) -> str:
        """A token's text for logprobs; a piece of a character is `bytes:\\xNN...` (OpenAI's form),
        so distinct tokens never share a label."""
        label = self._labels.get(token_id)
        if label is None:
            raw = self.token_bytes(token_id)
            try:
                label = raw.decode("utf-8")
            except UnicodeDecodeError:
                label = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._labels[token_id] = label  # at most one entry per vocabulary token
        return label

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what the grammar library builds its own from)."""
        return str(self._tok.to_str())

    def id_to_token(self, token_id: int) -> str | None:
        """A token's vocabulary entry (e.g. "\u0120world" in byte-level BPE), as transformers'
        convert_ids_to_tokens; None outside the vocabulary."""
        piece = self._tok.id_to_token(int(token_id))
        return piece if isinstance(piece, str) else None

    def is_special(self, token_id: int) -> bool:
        """Whether decoding with skip_special_tokens drops this token."""
        return int(token_id) in self._special_ids
