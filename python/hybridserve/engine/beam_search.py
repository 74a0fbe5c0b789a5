"""Beam search over the engine (`LLM.beam_search`, vLLM's offline API and types).

Each step asks the engine for one token of every live beam, with the top 2 x `beam_width`
log-probabilities (the model's own, as vLLM's default logprobs mode), extends each beam by each
of them, and keeps the `beam_width` best of a prompt's candidates by their length-normalised score
`cum_logprob / len(tokens) ** length_penalty` (the prompt's tokens counted, an ending EOS not).
A candidate that ends in EOS is complete and leaves the live beams; so is one that reaches the
context length. At the end the best `beam_width` of the complete and the live ones are returned.

Every step sends each beam's whole token sequence as a new prompt. On a hybrid model that is
cheap only because of the prefix cache's last-token checkpoints: the request of the step before
kept the Mamba state after its prompt, so the next step's prompt, that prompt plus one token,
computes that one token whichever of the candidates it is (docs/prefix-caching.md, "Last
tokens"). The state of a beam is forked, not recomputed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridserve.errors import HybridServeError, InvalidRequestError
from hybridserve.sampling.logprobs import TokenLogprobs
from hybridserve.sampling.params import DEFAULT_MAX_LOGPROBS, SamplingParams, as_float

if TYPE_CHECKING:
    from collections.abc import Collection, Sequence

    from hybridserve.engine.input_processor import Prompt
    from hybridserve.engine.llm import LLM
    from hybridserve.engine.outputs import RequestOutput

MAX_BEAM_WIDTH = DEFAULT_MAX_LOGPROBS // 2  # (a step asks for 2 x beam_width log-probabilities)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's: `beam_width` beams, at most `max_tokens` new tokens each; `ignore_eos` keeps a beam
    going past EOS; `length_penalty` the exponent of the length the score divides by.
    `temperature` and `include_stop_str_in_output` are accepted for vLLM's signature and change
    nothing, as in vLLM's offline search: the scores are the model's log-probabilities whatever the
    temperature, and a beam that ends in EOS keeps it among its tokens."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # (vLLM's; a beam search has no stop strings)

    def check(self) -> None:
        for name, lo, hi in (("beam_width", 1, MAX_BEAM_WIDTH), ("max_tokens", 1, None)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise InvalidRequestError(f"{name}: an integer {bound}, got {v!r}")
        lp = self.length_penalty
        # (an int past a float's range is refused too: the score raises the length to its power)
        if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(as_float(lp)):
            raise InvalidRequestError(f"length_penalty: a finite number, got {lp!r}")


@dataclass
class BeamSearchSequence:
    """One beam: every token (the prompt's first), the log-probabilities of each step that made
    it (the alternatives the step saw), their sum, and once returned its text (of every token)
    and why it ended ("stop": EOS, "length": max_tokens or the context length; `stop_reason`: the
    EOS id that ended it, as vLLM's)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(
    tokens: Sequence[int], cum_logprob: float, eos: int | Collection[int] | None, length_penalty: float
) -> float:
    """The score beams are ranked by: the summed log-probability over the length to the power
    `length_penalty`, an ending EOS (`eos`: the id, or every EOS id of the model) not counted."""
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else eos
    ends = bool(tokens) and tokens[-1] in eos_ids
    return _normalised(cum_logprob, len(tokens) - ends, length_penalty)


def _normalised(cum_logprob: float, length: int, length_penalty: float) -> float:
    # (a float power: an int length_penalty made an int power of millions of digits)
    length, penalty = max(length, 1), float(length_penalty)
    try:
        score = float(cum_logprob / (length**penalty))
        if math.isfinite(score):
            return score
    except (OverflowError, ZeroDivisionError):
        pass
    # A large |length_penalty| takes length ** length_penalty past a float, or to 0, which raised
    # mid-search (the server's range is +-1e6), or the quotient past a float (an infinite score,
    # which ranked below a longer beam's): the same quotient in logs, clamped to what a float
    # holds, so that every score past the range is the same finite bound, in order with the rest.
    if cum_logprob == 0.0:
        return 0.0
    log_abs = math.log(abs(cum_logprob)) - penalty * math.log(length)
    return math.copysign(math.exp(min(log_abs, _LOG_FLOAT_MAX)), cum_logprob)


# (just below log(sys.float_info.max), whose exp may round past the largest float)
_LOG_FLOAT_MAX = 709.78


@dataclass
class _Search:
    live: list[BeamSearchSequence]
    done: list[BeamSearchSequence] = field(default_factory=list)


class BeamSearch:
    """The beams of some prompts, driven from outside by whoever runs the model: `queries()` are
    the token sequences whose next-token log-probabilities the next step needs (every live beam,
    prompt by prompt), `advance` takes them (one entry per query, None for a query the engine
    aborted: `query_logprobs`),
    and `results()` gives each prompt's best beams. The offline API (`beam_search`) and the
    server drive it alike."""

    def __init__(
        self,
        prompts: Sequence[list[int]],
        params: BeamSearchParams,
        eos_token_id: int | None,
        max_model_len: int,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        params.check()
        self.params = params
        # every EOS id of the model ends a beam (the others as stop token ids end a request), and
        # none that ends one is counted in its length
        self.eos_ids = frozenset(t for t in (eos_token_id, *extra_eos_token_ids) if t is not None)
        self.ends: frozenset[int] = frozenset() if params.ignore_eos else self.eos_ids
        self.limit = max_model_len
        self.steps = 0
        self._searches = []
        for i, ids in enumerate(prompts):
            if not ids:
                raise InvalidRequestError(f"prompts[{i}]: no tokens")
            if len(ids) >= max_model_len:
                raise InvalidRequestError(
                    f"prompts[{i}]: {len(ids)} tokens leave no room for one more within the context "
                    f"({max_model_len})"
                )
            self._searches.append(_Search([BeamSearchSequence(tokens=list(ids))]))

    def step_params(self) -> SamplingParams:
        """What each query asks the engine for: one token, with the top 2 x beam_width
        log-probabilities."""
        return SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=2 * self.params.beam_width, ignore_eos=True
        )

    def queries(self) -> list[list[int]]:
        """The next step's sequences; none once every beam ended or max_tokens steps ran."""
        if self.steps >= self.params.max_tokens:
            return []
        return [b.tokens for s in self._searches for b in s.live]

    def _score(self, b: BeamSearchSequence) -> float:
        return beam_score(b.tokens, b.cum_logprob, self.eos_ids, self.params.length_penalty)

    def advance(self, seen: Sequence[TokenLogprobs | None]) -> None:
        """Takes one step's answers. Candidates are ranked as (parent, token) pairs, and only the
        kept ones get token lists of their own (a long prompt is not copied 2 x beam_width times
        over for every beam)."""
        self.steps += 1
        penalty = self.params.length_penalty
        at = 0
        for s in self._searches:
            # (score, parent, token, summed log-probability, the step's log-probabilities)
            ranked: list[tuple[float, BeamSearchSequence, int, float, TokenLogprobs]] = []
            for beam in s.live:
                entry = seen[at]
                at += 1
                if not entry:  # (a query the engine aborted: its beam ends as it is)
                    s.done.append(_ended(beam, "abort"))
                    continue
                length = len(beam.tokens) + 1
                for token, lp in entry.items():
                    cum = beam.cum_logprob + lp.logprob
                    if token in self.ends:
                        ended = _extended(beam, token, entry, cum)
                        ended.stop_reason = token
                        s.done.append(_ended(ended, "stop"))
                        continue
                    # (the score of the extended beam, without building its token list)
                    score = _normalised(cum, length - (token in self.eos_ids), penalty)
                    ranked.append((score, beam, token, cum, entry))
            # (a stable sort: equal scores keep the order the beams and their entries came in)
            ranked.sort(key=lambda c: c[0], reverse=True)
            s.live = []
            for _, beam, token, cum, entry in ranked[: self.params.beam_width]:
                new = _extended(beam, token, entry, cum)
                if len(new.tokens) >= self.limit:
                    s.done.append(_ended(new, "length"))
                else:
                    s.live.append(new)

    def results(self, live_reason: str = "length") -> list[list[BeamSearchSequence]]:
        """Each prompt's best `beam_width` beams, best first; the live ones end as they are, with
        `live_reason` ("abort" for a search the server's shutdown cut short)."""
        out = []
        for s in self._searches:
            every = [*s.done, *(_ended(b, live_reason) for b in s.live)]
            out.append(sorted(every, key=self._score, reverse=True)[: self.params.beam_width])
        return out


def query_logprobs(out: RequestOutput | None) -> TokenLogprobs | None:
    """A step query's next-token log-probabilities from its last output; None where the engine
    aborted it (its beam ends "abort"). A query the engine failed raises: a beam cut short by a
    failure is no result, and must not pass for one that reached its length."""
    first = out.outputs[0] if out is not None and out.outputs else None
    if first is not None and first.logprobs:
        return first.logprobs[0]
    if out is not None and (out.error or (first is not None and first.finish_reason == "error")):
        raise HybridServeError(f"a beam search step failed: {out.error or 'the engine gave no reason'}")
    return None


def widest_beam(max_logprobs: int) -> int:
    """The widest beam an engine serves: a step asks for 2 x beam_width log-probabilities, which
    --max-logprobs bounds, and MAX_BEAM_WIDTH bounds the beams one search holds."""
    return min(MAX_BEAM_WIDTH, max_logprobs // 2)


def beam_search(
    llm: LLM,
    prompts: Sequence[Prompt],
    params: BeamSearchParams,
    *,
    use_tqdm: bool = False,
    concurrency_limit: int | None = None,
) -> list[BeamSearchOutput]:
    """`LLM.beam_search`. `concurrency_limit`: at most that many prompts searched at once (all
    of them when None), as vLLM's; `use_tqdm` shows a bar over the prompts."""
    if not isinstance(params, BeamSearchParams):  # (a dict of its fields was an AttributeError)
        raise InvalidRequestError(f"params: a BeamSearchParams, not {type(params).__name__}")
    params.check()
    if concurrency_limit is not None and (
        isinstance(concurrency_limit, bool) or not isinstance(concurrency_limit, int) or concurrency_limit < 1
    ):
        raise InvalidRequestError(f"concurrency_limit: an integer >= 1 or None, got {concurrency_limit!r}")
    engine = llm.engine
    if params.beam_width > (widest := widest_beam(engine.max_logprobs)):
        raise InvalidRequestError(
            f"beam_width: at most {widest} here (a step asks for 2 x beam_width log-probabilities, and "
            f"--max-logprobs is {engine.max_logprobs}), got {params.beam_width}"
        )
    ids = [engine.encode_prompt(p)[1] for p in prompts]
    eos, extra = engine.eos_token_id, engine.extra_eos_token_ids
    BeamSearch(ids, params, eos, int(engine.max_model_len), extra)  # (every prompt checked first)
    limit = concurrency_limit or max(1, len(ids))
    bar = None
    if use_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=len(ids), desc="Beam search", unit="prompt")
    results = []
    try:
        for start in range(0, len(ids), limit):
            chunk = ids[start : start + limit]
            search = BeamSearch(chunk, params, eos, int(engine.max_model_len), extra)
            step = search.step_params()
            while queries := search.queries():
                outs = llm.generate([{"prompt_token_ids": q} for q in queries], step)
                search.advance([query_logprobs(o) for o in outs])
            for best in search.results():
                for b in best:
                    b.text = engine.tokenizer.decode(b.tokens)
                results.append(BeamSearchOutput(best))
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return results


def _extended(beam: BeamSearchSequence, token: int, entry: TokenLogprobs, cum: float) -> BeamSearchSequence:
    return BeamSearchSequence(tokens=[*beam.tokens, token], logprobs=[*beam.logprobs, entry], cum_logprob=cum)


def _ended(beam: BeamSearchSequence, why: str) -> BeamSearchSequence:
    beam.finish_reason = why
    return beam
