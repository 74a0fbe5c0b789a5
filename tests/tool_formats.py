"""Helpers for the tool-call format tests: a parser's stream over random cuts of a text, a
streamed chat answer's content and calls as the openai client sees them, two chat tools whose
forced calls the demo model ends within a few tokens (bounded arguments), and a copy of the demo
model whose tokenizer has a format's tags as added tokens (as Qwen's and Granite's have)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import openai

from hybridserve.model.demo import ensure_demo_model
from hybridserve.server.tools import ToolCallStream, ToolParser, split_message

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def assert_stream_adds_up(parser: ToolParser, text: str) -> None:
    """Fed in random pieces (30 ways), the stream's content and calls are split_message's."""
    rng = random.Random(len(text))
    expected_content, expected_calls = split_message(parser, text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = ToolCallStream(parser)
        content, calls = "", []
        for i, piece in enumerate(pieces):
            c, new = stream.feed(piece, final=i == len(pieces) - 1)
            content += c
            calls.extend(new)
        assert (content or None) == expected_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected_calls]


def stream_chat(client: openai.OpenAI, **kw: Any) -> tuple[str | None, list[dict[str, str]], str | None]:
    """(content, calls as {"name", "arguments"}, finish reason) of a streamed chat answer."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += (tc.function and tc.function.name) or ""
                slot["arguments"] += (tc.function and tc.function.arguments) or ""
            finish = ch.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def demo_with_added_tags(folder: Path, tags: dict[str, bool]) -> Path:
    """The demo model copied into `folder`, its tokenizer given each tag as an added token (the
    value: whether it is special), each in place of one of the last merged tokens of its
    vocabulary (the model's sizes stay as they are)."""
    src = Path(ensure_demo_model())
    folder.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, folder / f.name)
    tj = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = tj["model"]["vocab"]
    by_id = sorted(vocab.items(), key=lambda kv: -kv[1])
    for (old, tid), (tag, special) in zip(by_id, tags.items()):
        del vocab[old]
        merges = tj["model"]["merges"]
        tj["model"]["merges"] = [
            m for m in merges if "".join(m if isinstance(m, list) else m.split(" ")) != old
        ]
        tj["added_tokens"].append(
            {
                "id": tid,
                "content": tag,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
        )
    (folder / "tokenizer.json").write_text(json.dumps(tj))
    return folder
