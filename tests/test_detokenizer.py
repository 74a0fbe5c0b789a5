"""Incremental detokenization (windowed) equals decoding the whole output; stop strings cut it."""

from __future__ import annotations

import random

import pytest

from hybridserve.engine.detokenizer import IncrementalDetokenizer
from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.model.demo import ensure_demo_model


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(ensure_demo_model())


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "naïve café — 日本語のテキスト, emoji 🦊🐶 and ünïcödé",
    "   leading spaces, tabs\tand\nnewlines  ",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_streamed_text_equals_full_decode(tok: Tokenizer, text: str, chunk: int) -> None:
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok)
    pieces = []
    for i in range(0, len(ids), chunk):
        part = ids[i : i + chunk]
        pieces.append(d.add_tokens(part, final=i + chunk >= len(ids)))
    assert "".join(pieces) == tok.decode(ids) == d.text
    assert "\ufffd" not in d.text


def test_random_token_streams_match_full_decode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(3, tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        d = IncrementalDetokenizer(tok)
        out = "".join(d.add_tokens([t], final=i == len(ids) - 1) for i, t in enumerate(ids))
        assert out == tok.decode(ids)


def test_split_multibyte_character_is_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("🦊")
    assert len(ids) > 1  # the byte-level BPE splits the emoji
    d = IncrementalDetokenizer(tok)
    assert d.add_tokens(ids[:1]) == ""  # an unfinished character is not released
    assert d.add_tokens(ids[1:], final=True) == "🦊"


def test_stop_string_across_token_boundaries(tok: Tokenizer) -> None:
    text = "hello world, the lazy dog sleeps"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, stop=["lazy dog"])
    released = "".join(d.add_tokens([t]) for t in ids)
    assert d.stopped_by == "lazy dog"
    assert released == d.text == "hello world, the "
    d2 = IncrementalDetokenizer(tok, stop=["lazy dog"], include_stop_str_in_output=True)
    assert "".join(d2.add_tokens([t]) for t in ids) == "hello world, the lazy dog"


@pytest.mark.parametrize("text", TEXTS)
def test_deferred_text_equals_streamed_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    streamed, deferred = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok, deferred=True)
    for i, t in enumerate(ids):
        streamed.add_tokens([t], final=i == len(ids) - 1)
        released = deferred.add_tokens([t], final=i == len(ids) - 1)
        assert (released == "") == (i < len(ids) - 1)  # nothing before the end, everything at it
    assert deferred.text == streamed.text == tok.decode(ids)


def test_deferred_still_watches_stop_strings(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four five")
    d = IncrementalDetokenizer(tok, stop=["three"], deferred=True)
    for t in ids:
        d.add_tokens([t])
        if d.stopped_by is not None:
            break
    assert d.stopped_by == "three" and d.text == "one two "
