"""`LLM.beam_search` (vLLM's offline API): in float64 its beams are the ones an independent beam
search over transformers' model of the same checkpoint finds, with the same summed
log-probabilities; width 1 is greedy decoding; each step after the first computes one token per
beam (the prefix cache's last-token checkpoints fork the beams' Mamba states); bad parameters are
refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridserve import LLM, BeamSearchParams, InvalidRequestError, SamplingParams
from hybridserve.engine.beam_search import beam_score
from hybridserve.model.demo import resolve_model_path

PROMPTS = ["The history of the city", "Once upon a time"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("demo", dtype="float64", cpu_threads=1)


def _oracle(model: Any, prompt: list[int], width: int, steps: int, eos: int, penalty: float) -> list[Any]:
    """Beam search written from its definition over a transformers model: (tokens, summed
    log-probability) of the best `width` beams."""

    def score(beam: tuple[list[int], float]) -> float:
        return beam_score(beam[0], beam[1], eos, penalty)

    live: list[tuple[list[int], float]] = [(prompt, 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(steps):
        candidates = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1]
            top = torch.topk(torch.log_softmax(logits.double(), -1), 2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                (done if t == eos else candidates).append(([*tokens, t], cum + lp))
        live = sorted(candidates, key=score, reverse=True)[:width]
    return sorted([*done, *live], key=score, reverse=True)[:width]


@pytest.mark.parametrize("penalty", [1.0, 0.0])
def test_the_beams_are_those_a_search_over_transformers_finds(llm: LLM, penalty: float) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("demo"), dtype=torch.float64).eval()
    eos = llm.engine.eos_token_id
    assert eos is not None
    params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=penalty)
    got = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, got):
        ids = llm.get_tokenizer().encode(prompt)
        want = _oracle(model, ids, 3, 5, eos, penalty)
        assert [b.tokens for b in out.sequences] == [w[0] for w in want]
        for beam, (_, cum) in zip(out.sequences, want):
            # (transformers' RMSNorms cast to float32 even in a float64 model: about 1e-7 apart)
            assert beam.cum_logprob == pytest.approx(cum, abs=1e-5)
            assert beam.tokens[: len(ids)] == ids and len(beam.logprobs) == len(beam.tokens) - len(ids)
            assert beam.text == llm.get_tokenizer().decode(beam.tokens)
            assert beam.finish_reason in ("stop", "length")


def test_width_one_is_greedy_and_each_later_step_computes_one_token_a_beam(llm: LLM) -> None:
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    requests: list[int] = []
    generate = llm.generate

    def counted(prompts: Any, params: Any = None, **kw: Any) -> Any:
        requests.append(len(prompts))
        return generate(prompts, params, **kw)

    llm.generate = counted  # type: ignore[method-assign]
    try:
        llm.engine.reset_prefix_cache()
        before = llm.engine.stats()["num_scheduled_tokens_total"]
        one = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
        computed = llm.engine.stats()["num_scheduled_tokens_total"] - before
        wide = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))
    finally:
        del llm.generate
    for g, o in zip(greedy, one):
        (beam,) = o.sequences
        assert beam.tokens[-6:] == list(g.outputs[0].token_ids) and beam.finish_reason == "length"
    prompt_tokens = sum(len(llm.get_tokenizer().encode(p)) for p in PROMPTS)
    # the first step computes the prompts; every later request its one new token
    assert requests[0] == len(PROMPTS) and computed == prompt_tokens + sum(requests[1:6])
    assert all(len(o.sequences) == 4 for o in wide)
    scores = [beam_score(b.tokens, b.cum_logprob, None, 1.0) for b in wide[0].sequences]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize(
    "params",
    [
        {"beam_width": 0, "max_tokens": 4},
        {"beam_width": 11, "max_tokens": 4},
        {"beam_width": 2, "max_tokens": 0},
        {"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")},
    ],
)
def test_bad_parameters_are_refused(llm: LLM, params: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError):
        llm.beam_search("Hello", BeamSearchParams(**params))
