"""Logprobs on a SentencePiece-style tokenizer (Metaspace: "▁" for a space, the text's first space
dropped when decoding), through the real server with the demo model's weights: each token's label
and offset say what it adds where it stands, so the labels add up to the text and each offset is
where its token's text starts (a token decoded alone lost its space, and every offset after the
first word was off)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridserve.model.demo import ensure_demo_model
from server_fixtures import ServerProcess, call, running_server


def _metaspace_model(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    demo = Path(ensure_demo_model())
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(demo / name, folder / name)
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    corpus = (demo / "../../../python/hybridserve/model/demo_corpus.txt").resolve()
    text = corpus.read_text() if corpus.is_file() else "The morning was cold and clear. " * 50
    tok.train_from_iterator(
        [text] * 4, trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"])
    )
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _metaspace_model(tmp_path_factory.mktemp("metaspace") / "m")


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[ServerProcess]:
    with running_server("--dtype", "float32", "--served-model-name", "demo", model=str(model)) as srv:
        yield srv


@pytest.mark.parametrize("as_ids", [False, True])
def test_labels_and_offsets_say_what_each_token_adds(
    server: ServerProcess, model: Path, as_ids: bool
) -> None:
    from hybridserve.engine.tokenizer import Tokenizer

    prompt = "The morning was cold and clear"
    _, tok = call(server, "/tokenize", {"model": "demo", "prompt": prompt, "add_special_tokens": False})
    body = {"model": "demo", "prompt": tok["tokens"] if as_ids else prompt, "echo": True, "logprobs": 1,
            "max_tokens": 6, "temperature": 0}  # fmt: skip
    status, r = call(server, "/v1/completions", body)
    assert status == 200, r
    c = r["choices"][0]
    lp = c["logprobs"]
    text, offsets, tokens = c["text"], lp["text_offset"], lp["tokens"]
    assert text.startswith(prompt) and offsets == sorted(offsets) and offsets[0] == 0
    n = len(tok["tokens"])
    # the generated tokens' labels add up to the generated text, their spaces included
    assert "".join(tokens[n:]) == text[len(prompt) :]
    assert offsets[n] == len(prompt)
    # every echoed token starts where the text decoded up to it ends, a word's label with its
    # space (the first token as the text begins)
    ids = tok["tokens"]
    decode = Tokenizer(model).decode
    assert offsets[:n] == [len(decode(ids[:i])) for i in range(n)]
    assert tokens[1:n] == [decode(ids[: i + 1])[len(decode(ids[:i])) :] for i in range(1, n)]
    assert any(t.startswith(" ") for t in tokens[1:n])
