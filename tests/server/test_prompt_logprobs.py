"""lm-evaluation-harness (pip `lm-eval`, run as it is) against the real server on the demo model in
float64: a multiple-choice task and a perplexity task from data this test writes. Its per-item
loglikelihoods must equal the offline `LLM` API's prompt logprobs for the same tokens (1e-9), and
agree with transformers' log-softmax on the same checkpoint as closely as transformers' float32
internals allow (its NemotronH computes the RMSNorms, the scan and the attention softmax in
float32 even for a float64 model; 1e-4 per item)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve.engine.llm import LLM
from hybridserve.model.demo import ensure_demo_model
from hybridserve.sampling.params import SamplingParams
from server_fixtures import ServerProcess, call

pytest.importorskip("lm_eval")

MC = [
    {"question": "The fox ran into the", "choices": ["forest.", "sea.", "sky."], "answer": 0},
    {"question": "Snow is usually", "choices": ["green", "white", "loud"], "answer": 1},
    {"question": "The bridge crossed the", "choices": ["river", "idea", "number"], "answer": 0},
    {"question": "She opened the", "choices": ["door", "sound", "blue"], "answer": 0},
]
PPL = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "A committee met on a grey morning to discuss the harbour and its trains."},
    {"text": "Numbers like 12 and 345 sit beside words in plain sentences."},
]


def _write_tasks(root: Path) -> None:
    for name, rows in (("mc", MC), ("ppl", PPL)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "hs_mc.yaml").write_text(
        f"""task: hs_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""
    )
    (root / "hs_ppl.yaml").write_text(
        f"""task: hs_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "ppl.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""
    )


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    ensure_demo_model()
    srv = ServerProcess("--dtype", "float64", "--max-model-len", "512")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
    srv.remove_log()


@pytest.fixture(scope="module")
def harness_run(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Runs `lm_eval` on both tasks; returns its logged samples per task."""
    root = tmp_path_factory.mktemp("lm_eval")
    _write_tasks(root)
    out = root / "out"
    model_args = ",".join(
        [
            "model=demo",
            f"base_url={server.base}/v1/completions",
            "tokenizer_backend=huggingface",
            f"tokenizer={ensure_demo_model()}",
            "num_concurrent=2",
            "max_retries=1",
        ]
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args]
    cmd += [
        "--tasks",
        "hs_mc,hs_ppl",
        "--include_path",
        str(root),
        "--log_samples",
        "--output_path",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples: dict[str, list[Any]] = {}
    for task in ("hs_mc", "hs_ppl"):
        [path] = list(out.rglob(f"samples_{task}_*.jsonl"))
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return samples


def _harness_model(base: str) -> Any:
    """lm-eval's own model object, for the exact token ids it sends."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        base_url=f"{base}/v1/completions",
        model="demo",
        tokenizer_backend="huggingface",
        tokenizer=ensure_demo_model(),
    )


def _requests(samples: dict[str, list[Any]], base: str) -> list[tuple[list[int], int, float]]:
    """(token ids, where the scored part starts, the harness's loglikelihood) of every item."""
    m = _harness_model(base)
    out = []
    for s in samples["hs_mc"]:
        # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}, values logged as strings
        args = [s["arguments"][f"gen_args_{i}"] for i in range(len(s["arguments"]))]
        for a, resp in zip(args, s["resps"]):
            ctx, cont = m._encode_pair(a["arg_0"], a["arg_1"])
            out.append((ctx + cont, len(ctx), float(resp[0][0])))
    for s in samples["hs_ppl"]:
        tokens = m.tok_encode(s["doc"]["text"])
        out.append(([m.prefix_token_id, *tokens], 1, float(s["resps"][0][0])))
    return out


def test_harness_scores_every_item(harness_run: dict[str, list[Any]]) -> None:
    assert len(harness_run["hs_mc"]) == len(MC) and len(harness_run["hs_ppl"]) == len(PPL)
    for s in harness_run["hs_mc"]:
        assert len(s["resps"]) == len(s["doc"]["choices"])
        assert all(float(r[0][0]) < 0 for r in s["resps"])


def test_harness_loglikelihoods_equal_the_offline_api_and_transformers(
    harness_run: dict[str, list[Any]], server: ServerProcess
) -> None:
    items = _requests(harness_run, server.base)
    llm = LLM("demo", dtype="float64", max_model_len=512)
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids, _, _ in items], SamplingParams(max_tokens=0, prompt_logprobs=0)
    )
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ensure_demo_model(), dtype=torch.float64)
    for (ids, start, harness), out in zip(items, outs):
        assert out.prompt_logprobs is not None and out.outputs[0].token_ids == []
        offline = sum(out.prompt_logprobs[p][ids[p]].logprob for p in range(start, len(ids)))
        assert abs(harness - offline) <= 1e-9, (harness, offline)
        with torch.no_grad():
            lsm = hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        reference = sum(float(lsm[p - 1, ids[p]]) for p in range(start, len(ids)))
        assert abs(harness - reference) <= 1e-4, (harness, reference)


def _post(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(
        f"{server.base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_echo_logprobs_shape_prompt_logprobs_and_score_only(server: ServerProcess) -> None:
    prompt = "The harbour was quiet when the trains"
    ids = LLM_TOKENS(prompt)
    body = {
        "model": "demo",
        "prompt": prompt,
        "echo": True,
        "logprobs": 2,
        "max_tokens": 0,
        "prompt_logprobs": 1,
    }
    r = _post(server, body)
    c = r["choices"][0]
    lp = c["logprobs"]
    assert c["text"] == prompt and r["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(t) >= 1 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # vLLM's prompt_logprobs: the same numbers, keyed by token id
    pl = c["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for p in range(1, len(ids)):
        assert pl[p][str(ids[p])]["logprob"] == lp["token_logprobs"][p]
    # echo + logprobs with generation: the prompt's entries, then the generated tokens'
    gen = _post(server, {**body, "max_tokens": 3, "temperature": 0})["choices"][0]
    assert gen["logprobs"]["token_logprobs"][: len(ids)] == lp["token_logprobs"]
    assert len(gen["logprobs"]["tokens"]) == len(ids) + 3
    # streamed: the first chunk carries the prompt part, and the pieces add up to the same
    chunks = _stream(server, {**body, "max_tokens": 3, "temperature": 0, "stream": True})
    streamed = [x for ch in chunks for x in ch["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == gen["logprobs"]["token_logprobs"]


@pytest.mark.parametrize(("logprobs", "prompt_logprobs"), [(1, 5), (5, 1)])
def test_echo_logprobs_and_prompt_logprobs_each_hold_their_own_top_n(
    server: ServerProcess, logprobs: int, prompt_logprobs: int
) -> None:
    """The engine computes one top-n for the prompt, the larger of the two; each field shows its
    own: the prompt token and its `logprobs` (or `prompt_logprobs`) best alternatives."""
    prompt = "The harbour was quiet when the trains"
    ids = LLM_TOKENS(prompt)
    body = {"model": "demo", "prompt": prompt, "echo": True, "max_tokens": 1, "temperature": 0}
    c = _post(server, {**body, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs})["choices"][0]
    echoed = c["logprobs"]["top_logprobs"][1 : len(ids)]
    assert all(logprobs <= len(t) <= logprobs + 1 for t in echoed), [len(t) for t in echoed]
    listed = c["prompt_logprobs"][1:]
    assert all(prompt_logprobs <= len(t) <= prompt_logprobs + 1 for t in listed), [len(t) for t in listed]
    for p, t in enumerate(listed, start=1):
        assert (
            str(ids[p]) in t
            and sorted(v["rank"] for k, v in t.items() if k != str(ids[p]))[-1] <= prompt_logprobs
        )
    # the same numbers as each field alone
    alone = _post(server, {**body, "logprobs": logprobs})["choices"][0]["logprobs"]["top_logprobs"]
    assert alone[1 : len(ids)] == echoed


@pytest.mark.parametrize("prompt", ["<|im_start|>hi there", "naïve 日本 <|im_end|>\nThe harbour"])
def test_echo_offsets_index_the_echoed_text_streamed_or_not(server: ServerProcess, prompt: str) -> None:
    """A text prompt is echoed as written, special tokens included: each echoed token's offset is
    where it starts in that text, and the generated tokens' offsets continue after it, the same
    streamed and not."""
    body = {"model": "demo", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0}
    c = _post(server, body)["choices"][0]
    lp = c["logprobs"]
    n = len(LLM_TOKENS(prompt))
    assert c["text"].startswith(prompt)
    offsets, tokens = lp["text_offset"], lp["tokens"]
    for tok, off in zip(tokens[:n], offsets[:n]):
        if not tok.startswith("bytes:"):  # a piece of a character shares the character's start
            assert prompt[off:].startswith(tok), (tok, off, offsets)
    assert offsets[n] == len(prompt)
    for tok, off in zip(tokens[n:], offsets[n:]):
        assert c["text"][off:].startswith(tok), (tok, off, offsets)
    chunks = _stream(server, {**body, "stream": True})
    assert [o for ch in chunks for o in ch["choices"][0]["logprobs"]["text_offset"]] == offsets


def test_prompt_logprobs_cover_every_token_after_a_cache_hit_and_change_no_other_output(
    server: ServerProcess,
) -> None:
    shared = "A long shared system prompt about ships, bridges and the weather at sea. " * 4
    first = _post(server, {"model": "demo", "prompt": shared + "One", "max_tokens": 4, "temperature": 0})
    # this one's prefix is cached now: its prompt logprobs must still cover every token
    scored = _post(
        server,
        {"model": "demo", "prompt": shared + "Two", "max_tokens": 4, "temperature": 0, "prompt_logprobs": 0},
    )
    ids = LLM_TOKENS(shared + "Two")
    pl = scored["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and all(pl[p] is not None and str(ids[p]) in pl[p] for p in range(1, len(ids)))
    again = _post(server, {"model": "demo", "prompt": shared + "One", "max_tokens": 4, "temperature": 0})
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    plain = _post(server, {"model": "demo", "prompt": shared + "Two", "max_tokens": 4, "temperature": 0})
    assert plain["choices"][0]["text"] == scored["choices"][0]["text"]
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the scorer left its states


def _stream(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    import urllib.request

    req = urllib.request.Request(
        f"{server.base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    out = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[len("data: ") :]))
    return [c for c in out if c["choices"] and c["choices"][0].get("logprobs")]


def LLM_TOKENS(text: str) -> list[int]:  # noqa: N802 - the demo tokenizer, as the server encodes
    from hybridserve.engine.tokenizer import Tokenizer

    return list(Tokenizer(ensure_demo_model()).encode(text))


def _assert_same_entries(got: list[Any], want: list[Any]) -> None:
    """The same tokens, ranks and texts at every position, and the same logprobs up to float64
    rounding: the two requests ran in batches of other shapes (docs/losslessness.md: logits are
    not claimed bit-identical across batch layouts)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if g is None or w is None:
            assert g is w is None
            continue
        strip = lambda e: {t: {k: v for k, v in x.items() if k != "logprob"} for t, x in e.items()}  # noqa: E731
        assert strip(g) == strip(w)
        assert all(abs(g[t]["logprob"] - w[t]["logprob"]) < 1e-9 for t in g)


def test_chat_prompt_logprobs_are_the_rendered_prompts(server: ServerProcess) -> None:
    """vLLM's prompt_logprobs on chat: on the response (its choices share one prompt), the same
    numbers as a completion of the rendered prompt's ids; not with stream: true."""

    def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return call(server, path, body)

    messages = [{"role": "user", "content": "The harbour was quiet when the trains"}]
    _, tok = post("/tokenize", {"messages": messages})
    status, chat = post(
        "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "n": 2, "prompt_logprobs": 2}
    )
    assert status == 200 and len(chat["choices"]) == 2
    _, done = post("/v1/completions", {"prompt": tok["tokens"], "max_tokens": 1, "prompt_logprobs": 2})
    _assert_same_entries(chat["prompt_logprobs"], done["choices"][0]["prompt_logprobs"])
    assert len(chat["prompt_logprobs"]) == tok["count"] and chat["prompt_logprobs"][0] is None
    _, plain = post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert "prompt_logprobs" not in plain
    status, err = post("/v1/chat/completions", {"messages": messages, "prompt_logprobs": 1, "stream": True})
    assert status == 400 and err["error"]["param"] == "prompt_logprobs"
