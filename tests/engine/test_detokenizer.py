"""Incremental detokenization (windowed) equals decoding the whole output; stop strings cut it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.engine.detokenizer import IncrementalDetokenizer
from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.model.demo import ensure_demo_model
from hybridserve.sampling.params import MAX_STOP_STR_LEN


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


class _Chars:
    """One character per token (id = code point): stop-string cases written as plain text."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def _run(text: str, **kw: object) -> tuple[str, str, str | None]:
    """(released text, final text, stop string) of streaming `text` one character at a time."""
    d = IncrementalDetokenizer(_Chars(), **kw)  # type: ignore[arg-type]
    released = ""
    for i, c in enumerate(text):
        released += d.add_tokens([ord(c)], final=i == len(text) - 1)
        if d.stopped_by is not None:
            break
    return released, d.text, d.stopped_by


@pytest.mark.parametrize(
    "stop, min_tokens, expected",
    [
        (["b"], 3, "abca"),  # the b among the first 3 tokens is not a stop
        (["b", "zzzzz"], 3, "abca"),  # a longer, unrelated stop string changes nothing
        (["bca"], 3, "a"),  # completed by token 4: the "bc" of tokens 2-3 is cut too
        (["ca"], 3, "ab"),
        (["ca"], 4, "abcab"),  # the first "ca" ends with token 4, one of the first min_tokens
        (["ca"], 0, "ab"),
        (["bc"], 4, "abca"),  # the first "bc" ends at token 3
    ],
)
def test_stop_strings_respect_min_tokens(stop: list[str], min_tokens: int, expected: str) -> None:
    released, text, stopped_by = _run("abcabcabc", stop=stop, min_tokens=min_tokens)
    assert released == text == expected
    assert stopped_by is not None


@pytest.mark.parametrize(
    "stop, include, expected, stopped_by",
    [
        (["l", " ligh"], True, "a l", "l"),  # "l" is completed first, whatever the list order
        ([" ligh", "l"], True, "a l", "l"),
        (["l", " ligh"], False, "a ", "l"),
        (["b c", "c"], False, "a ", "b c"),  # both end at the c: the earlier start cuts more
        (["c", "b c"], True, "a b c", "b c"),
    ],
)
def test_the_first_completed_stop_string_wins(
    stop: list[str], include: bool, expected: str, stopped_by: str
) -> None:
    for text in ("a light", "a b c d"):
        if not all(s in text for s in stop):
            continue
        released, final, by = _run(text, stop=stop, include_stop_str_in_output=include)
        assert released == final == expected
        assert by == stopped_by
    # the same when the whole text arrives in one step (no character-by-character streaming)
    text = "a light" if "l" in stop else "a b c d"
    d = IncrementalDetokenizer(_Chars(), stop=stop, include_stop_str_in_output=include)  # type: ignore[arg-type]
    assert d.add_tokens([ord(c) for c in text]) == expected and d.stopped_by == stopped_by


class _Pieces:
    """Token id i decodes to pieces[i] (several characters per token, no partial characters)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


def _reference(
    calls: list[list[str]], stop: list[str], include: bool, min_tokens: int, last_final: bool
) -> tuple[list[str], str | None]:
    """What the detokenizer must release per call, by brute force over the whole text each call:
    once more than min_tokens tokens have arrived, the stop occurrence ending first (starting first
    on a tie) among those ending in the call's new text ends the output (one that ended in the
    text of an earlier call never counts); otherwise the longest end of the text that is a proper
    prefix of a stop string is held back (nothing at the end)."""
    full, released, deltas, ntok = "", "", [], 0
    for k, call in enumerate(calls):
        seen = len(full)
        full += "".join(call)
        ntok += len(call)
        final = last_final and k == len(calls) - 1
        if ntok > min_tokens:
            found = [
                (i + len(s), i, s)
                for s in stop
                for i in range(len(full) - len(s) + 1)
                if full.startswith(s, i) and i + len(s) > seen
            ]
            if found:
                end, i, s = min(found)
                now = full[: max(end if include else i, len(released))]
                deltas.append(now[len(released) :])
                return deltas, s
        hold = 0
        if not final:
            hold = max((n for s in stop for n in range(1, len(s)) if full.endswith(s[:n])), default=0)
        now = full[: max(len(full) - hold, len(released))]
        deltas.append(now[len(released) :])
        released = now
    return deltas, None


_ABC = "abc"


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.text(_ABC, min_size=1, max_size=3), min_size=0, max_size=30),
    stop=st.lists(st.text(_ABC, min_size=1, max_size=6), min_size=1, max_size=4),
    split=st.lists(st.integers(1, 4), min_size=30, max_size=30),
    include=st.booleans(),
    min_tokens=st.integers(0, 6),
    last_final=st.booleans(),
)
def test_stop_strings_match_a_brute_force_reference(
    pieces: list[str],
    stop: list[str],
    split: list[int],
    include: bool,
    min_tokens: int,
    last_final: bool,
) -> None:
    # the tokens arrive in calls of 1-4 tokens (several per call: a step with drafts accepted)
    calls: list[list[int]] = []
    i = 0
    for n in split:
        if i >= len(pieces):
            break
        calls.append(list(range(i, min(i + n, len(pieces)))))
        i += n
    if not calls:
        calls = [[]]
    expected, stopped_by = _reference(
        [[pieces[t] for t in c] for c in calls], stop, include, min_tokens, last_final
    )
    d = IncrementalDetokenizer(
        _Pieces(pieces),  # type: ignore[arg-type]
        stop=stop,
        include_stop_str_in_output=include,
        min_tokens=min_tokens,
    )
    got = []
    for k, c in enumerate(calls):
        got.append(d.add_tokens(c, final=last_final and k == len(calls) - 1))
        if d.stopped_by is not None:
            break
    assert got == expected
    assert d.stopped_by == stopped_by
    assert d.text == "".join(expected)
    # the output processor's closing call: what is still held back comes out, unless it was cut
    rest = d.add_tokens([], final=True)
    if stopped_by is not None or last_final:
        assert rest == ""
    else:
        assert d.text == "".join(expected) + rest == "".join(pieces)


def test_long_partial_match_is_held_until_it_breaks() -> None:
    # The text keeps ending in a long prefix of the stop string; what is held back follows it.
    body = "abcd" * 511 + "abc"
    stop = body + "X"
    assert len(stop) == MAX_STOP_STR_LEN
    d = IncrementalDetokenizer(_Chars(), stop=[stop])  # type: ignore[arg-type]
    assert "".join(d.add_tokens([ord(c)]) for c in body) == ""
    assert d.add_tokens([ord("d")]) == "abcd"  # "abcd" x 511 may still start the stop string
    assert d.add_tokens([ord("Y")]) == "abcd" * 511 + "Y"  # nothing may: all of it comes out
    assert "".join(d.add_tokens([ord(c)]) for c in stop) == ""
    assert d.stopped_by == stop and d.text == "abcd" * 512 + "Y"


def test_empty_stop_string_is_refused() -> None:
    # (SamplingParams refuses it first; an empty string would match everywhere)
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(_Chars(), stop=["a", ""])  # type: ignore[arg-type]


def test_a_stop_string_that_ended_among_the_first_min_tokens_never_counts() -> None:
    """ "aa" ends with token 2 of min_tokens 2; its second "a" is held back (it may start another
    "aa"), and the next token must not make the old match count. A later "aa" still does."""
    released, text, stopped_by = _run("aabab", stop=["aa"], min_tokens=2)
    assert released == text == "aabab" and stopped_by is None
    released, text, stopped_by = _run("aabaab", stop=["aa"], min_tokens=2)
    assert released == text == "aab" and stopped_by == "aa"
    released, text, stopped_by = _run("aaab", stop=["aa"], min_tokens=2)  # "aa" at tokens 2-3 counts
    assert released == text == "a" and stopped_by == "aa"


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A SentencePiece-style tokenizer (Metaspace, decoded as Llama-2's: "▁" to a space, then the
    text's first space stripped): a token's leading space shows only after another token."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    pieces = ["<unk>", "▁The", "▁capital", "▁is", "▁the", "▁d", "▁m", "é", "▁caf"]
    hf = HFTokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    folder = tmp_path_factory.mktemp("metaspace")
    hf.save(str(folder / "tokenizer.json"))
    return Tokenizer(folder)


@pytest.mark.parametrize("deferred", [False, True])
def test_the_first_token_keeps_its_space_after_the_prompt(metaspace: Tokenizer, deferred: bool) -> None:
    """The window starts on the prompt's last tokens (as vLLM's): decoded alone, "▁the" would lose
    its space, and the text would not continue the prompt."""
    prompt, out = [1, 2, 3], [4, 5, 4, 6]  # "The capital is" + " the d the m"
    d = IncrementalDetokenizer(metaspace, context=prompt, deferred=deferred)
    text = "".join(d.add_tokens([t], final=i == len(out) - 1) for i, t in enumerate(out))
    assert text == d.text == " the d the m"
    assert metaspace.decode(prompt) + text == metaspace.decode(prompt + out)
    # a stop string that begins with the space matches at the token that brings it
    s = IncrementalDetokenizer(metaspace, stop=[" the"], context=prompt)
    assert s.add_tokens([4]) == "" and s.stopped_by == " the" and s.text == ""
    # without a prompt there is nothing to continue: the text starts as the decoder starts it
    assert IncrementalDetokenizer(metaspace).add_tokens([4], final=True) == "the"


def test_a_token_s_bytes_are_what_it_adds_within_a_text(metaspace: Tokenizer) -> None:
    """Logprobs name a token by the text it adds where it stands, its space included (decoded
    alone, SentencePiece's decoder drops it: " the" read "the", and its offsets missed a byte per
    word); the first token of a text adds what the text starts with."""
    prompt, out = [1, 2, 3], [4, 5, 4, 6]
    added = b"".join(metaspace.token_bytes(t) for t in out)
    assert added == metaspace.decode(prompt + out).encode()[len(metaspace.decode(prompt).encode()) :]
    assert metaspace.token_bytes(4) == b" the" and metaspace.token_to_text(4) == " the"
    starts = metaspace.token_bytes(1, first=True) + b"".join(metaspace.token_bytes(t) for t in prompt[1:])
    assert starts == metaspace.decode(prompt).encode() and starts.startswith(b"The")
    # "é" has no space: the same alone and within a text
    assert metaspace.token_bytes(7) == metaspace.token_bytes(7, first=True) == "é".encode()
