"""The engine's tokenizer: a long text is encoded without holding Python's global lock, to the same
ids as the library's own `encode`."""

from __future__ import annotations

import threading
import time

import pytest

from hybridserve.engine import tokenizer as tokenizer_module
from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.model.demo import ensure_demo_model

THRESHOLD = tokenizer_module._RELEASE_GIL_CHARS


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(ensure_demo_model())


@pytest.mark.parametrize("add_special_tokens", [False, True])
@pytest.mark.parametrize("length", [THRESHOLD - 1, THRESHOLD, THRESHOLD + 7, 5 * THRESHOLD])
def test_long_and_short_texts_get_the_librarys_ids(
    tok: Tokenizer, length: int, add_special_tokens: bool
) -> None:
    # words, punctuation, multi-byte characters and a special token, cut at an odd place
    unit = "The morning was cold — naïve café 日本 🦊 <|im_end|>\n"
    text = (unit * (length // len(unit) + 1))[:length]
    assert len(text) == length
    want = list(tok._tok.encode(text, add_special_tokens=add_special_tokens).ids)
    assert tok.encode(text, add_special_tokens=add_special_tokens) == want


def test_a_long_text_is_encoded_while_other_threads_run(tok: Tokenizer) -> None:
    """`encode` of the library holds the global lock for the whole text (seconds for megabytes):
    a server's event loop would stall that long. The other thread here must keep running."""
    text = "a b " * 400_000
    done = threading.Event()
    took: list[float] = []

    def encode() -> None:
        t0 = time.perf_counter()
        tok.encode(text)
        took.append(time.perf_counter() - t0)
        done.set()

    worker = threading.Thread(target=encode)
    worker.start()
    turns = 0
    while not done.is_set():
        time.sleep(0.001)
        turns += 1
    worker.join()
    # held lock: the loop gets a turn or two in the whole encode (measured: 2 turns in 2.8 s)
    assert took[0] > 0.1, "the text encoded too fast to tell"
    assert turns >= 20, (turns, took[0])
