"""`LLM.beam_search` (vLLM's offline API): in float64 its beams are the ones an independent beam
search over transformers' model of the same checkpoint finds, with the same summed
log-probabilities; width 1 is greedy decoding; each step after the first computes one token per
beam (the prefix cache's last-token checkpoints fork the beams' Mamba states); bad parameters are
refused."""

from __future__ import annotations

import math
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
        length = len(beam[0]) - (beam[0][-1] == eos)
        return beam[1] / length**penalty

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
            assert beam.stop_reason == (beam.tokens[-1] if beam.finish_reason == "stop" else None)


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
        one = llm.beam_search(
            PROMPTS, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True, length_penalty=0.0)
        )
        computed = llm.engine.stats()["num_scheduled_tokens_total"] - before
        wide = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))
    finally:
        del llm.generate
    # (length_penalty 0: the score is the summed log-probability; with a length in it, an EOS the
    # greedy tokens run past, not counted in the length, would rank otherwise)
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
        {"beam_width": "2", "max_tokens": 4},
        {"beam_width": 2, "max_tokens": 4, "length_penalty": 10**400},  # (no float holds it)
    ],
)
def test_bad_parameters_are_refused(llm: LLM, params: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError):
        llm.beam_search("Hello", BeamSearchParams(**params))


def test_parameters_that_are_no_beam_search_params_are_refused(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="BeamSearchParams"):
        llm.beam_search("Hello", {"beam_width": 2, "max_tokens": 4})  # type: ignore[arg-type]


@pytest.mark.parametrize("penalty", [1000.0, -1000.0, 10**30])
def test_a_length_penalty_whose_power_leaves_a_float_ranks_and_does_not_raise(penalty: float) -> None:
    """length ** length_penalty past a float (or 0) raised OverflowError (ZeroDivisionError)
    mid-search, and an int penalty of 10**30 computed an int power without end."""
    from hybridserve.engine.beam_search import BeamSearch
    from hybridserve.sampling.logprobs import Logprob

    search = BeamSearch(
        [[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=penalty), 9, 100
    )
    search.advance([{4: Logprob(logprob=-1.0, rank=1), 5: Logprob(logprob=-2.0, rank=2)}])
    assert search.queries() == [[1, 2, 3, 4], [1, 2, 3, 5]]  # (-1 / x ranks above -2 / x)
    search.advance([{6: Logprob(logprob=-0.5, rank=1)}, {7: Logprob(logprob=-0.5, rank=1)}])
    assert [b.tokens for b in search.results()[0]] == [[1, 2, 3, 4, 6], [1, 2, 3, 5, 7]]


def test_scores_past_a_float_s_range_keep_their_order_by_length() -> None:
    """With a negative length_penalty a longer beam of the same log-probability scores lower; past
    a float's range every score is the same finite bound (a quotient that overflowed was -inf,
    below a longer beam's clamped score: the longer beam ranked better)."""
    for penalty in (-645.0, -2.0, 2.0):
        scores = [beam_score(list(range(n)), -10.0, None, penalty) for n in range(1, 9)]
        assert all(math.isfinite(x) for x in scores), scores
        pairs = zip(scores, scores[1:])
        assert all(a >= b for a, b in pairs) if penalty < 0 else all(a <= b for a, b in pairs), scores


def test_a_step_ranks_by_length_normalised_score_and_sets_eos_beams_aside() -> None:
    """The search's arithmetic on made-up log-probabilities: an EOS candidate completes (its EOS
    not counted in its length), the rest are ranked by cum / length ** length_penalty, and with
    ignore_eos an EOS candidate stays live but its EOS is still not counted (as vLLM's)."""
    from hybridserve.engine.beam_search import BeamSearch
    from hybridserve.sampling.logprobs import Logprob

    def lp(**by_token: float) -> dict[int, Logprob]:
        return {int(t[1:]): Logprob(logprob=v, rank=1) for t, v in by_token.items()}

    eos = 9
    search = BeamSearch(
        [[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=2.0), eos, 100
    )
    search.advance([lp(t4=-1.0, t5=-2.0, t9=-0.5)])
    # live: [1,2,3,4] (-1 / 4**2) and [1,2,3,5] (-2 / 16); [1,2,3,9] is complete (-0.5 / 3**2)
    assert search.queries() == [[1, 2, 3, 4], [1, 2, 3, 5]]
    search.advance([lp(t6=-0.1), lp(t7=-3.0)])
    assert search.queries() == []  # (max_tokens steps ran)
    (best,) = search.results()
    # [1,2,3,4,6]: -1.1 / 25; the EOS beam: -0.5 / 9; [1,2,3,5,7]: -5 / 25
    assert [b.tokens for b in best] == [[1, 2, 3, 4, 6], [1, 2, 3, 9]]
    assert [b.finish_reason for b in best] == ["length", "stop"] and best[1].stop_reason == eos
    assert best[1].cum_logprob == -0.5 and beam_score(best[1].tokens, -0.5, eos, 2.0) == pytest.approx(
        -0.5 / 9
    )
    kept = BeamSearch(
        [[1]], BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True, length_penalty=1.0), eos, 100
    )
    kept.advance([lp(t9=-0.6, t4=-1.0)])
    # [1, 4]: -1.0 / 2 beats [1, 9]: -0.6 / 1 (its EOS not counted; counted, it would win at -0.3)
    assert [b.tokens for b in kept.results()[0]] == [[1, 4]]


def test_vllm_s_keywords_batch_the_prompts_and_change_no_beam(llm: LLM) -> None:
    prompts = [*PROMPTS, "Hello world"]
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    together = llm.beam_search(prompts, params)
    by_two = llm.beam_search(prompts, params, use_tqdm=True, concurrency_limit=2)
    assert [[b.tokens for b in o.sequences] for o in by_two] == [
        [b.tokens for b in o.sequences] for o in together
    ]
    with pytest.raises(InvalidRequestError, match="concurrency_limit"):
        llm.beam_search(prompts, params, concurrency_limit=0)
    with pytest.raises(InvalidRequestError, match="lora_request"):
        llm.beam_search(prompts, params, lora_request=object())  # type: ignore[arg-type]


def test_every_eos_of_the_model_ends_a_beam() -> None:
    """A model's other EOS ids (end-of-turn tokens) end a beam as its EOS does, uncounted in its
    length; with ignore_eos none does."""
    from hybridserve.engine.beam_search import BeamSearch
    from hybridserve.sampling.logprobs import Logprob

    entry = {7: Logprob(logprob=-0.5, rank=1), 4: Logprob(logprob=-1.0, rank=2)}
    search = BeamSearch([[1, 2]], BeamSearchParams(beam_width=1, max_tokens=1), 9, 100, (7,))
    search.advance([entry])
    ((best,),) = search.results()
    assert best.tokens == [1, 2, 7] and best.finish_reason == "stop" and best.stop_reason == 7
    kept = BeamSearch([[1, 2]], BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True), 9, 100, (7,))
    kept.advance([entry])
    ((live,),) = kept.results()
    # (7 stays a candidate; uncounted in the length, -0.5 / 2 beats 4's -1.0 / 3)
    assert live.tokens == [1, 2, 7] and live.finish_reason == "length"


def test_a_failed_query_fails_the_search_and_an_aborted_one_ends_its_beam() -> None:
    """A step query's last output: log-probabilities go on; a failure raises (a beam cut short is
    no result that reached its length); an abort ends the beam as "abort"."""
    from hybridserve import HybridServeError
    from hybridserve.engine.beam_search import BeamSearch, query_logprobs
    from hybridserve.engine.outputs import CompletionOutput, RequestOutput
    from hybridserve.sampling.logprobs import Logprob

    def out(reason: str, logprobs: Any = None, error: str | None = None) -> RequestOutput:
        done = CompletionOutput(0, "", [], finish_reason=reason, logprobs=logprobs)
        return RequestOutput("q", None, [1], [done], finished=True, error=error)

    entry = {4: Logprob(logprob=-1.0, rank=1)}
    assert query_logprobs(out("length", [entry])) == entry
    with pytest.raises(HybridServeError, match="non-finite"):
        query_logprobs(out("error", error="non-finite logits"))
    assert query_logprobs(out("abort")) is None and query_logprobs(None) is None
    search = BeamSearch([[1, 2]], BeamSearchParams(beam_width=1, max_tokens=3), 9, 100)
    search.advance([None])
    assert search.queries() == [] and [b.finish_reason for b in search.results()[0]] == ["abort"]
