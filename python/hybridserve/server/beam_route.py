"""vLLM's `use_beam_search` on the completion and chat routes: the search of
engine/beam_search.py, each step's queries sent to the engine at once as one-token requests; the
`n` best beams of each prompt are its choices (text and token ids of what the beam added).

A step's queries are the beams so far as prompts: with prefix caching on, the request of the
step before kept the state after its prompt (a last-token checkpoint), so each query computes one
token. The search holds `n` x prompts places of `--max-queue-len` from start to end, as a
request's sequences do; a search the server's shutdown meets ends after the step it is in, its
live beams as they are (finish_reason "abort")."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from hybridserve.engine.beam_search import BeamSearch, BeamSearchSequence, query_logprobs
from hybridserve.engine.protocol import EngineClient
from hybridserve.sampling.logprobs import TokenLogprobs
from hybridserve.sampling.params import SamplingParams
from hybridserve.server import protocol as P


async def _next_token_logprobs(
    engine: EngineClient, tokens: list[int], params: SamplingParams, engine_id: str, req: P.GenerateRequest
) -> TokenLogprobs | None:
    last = None
    async for out in engine.generate(
        {"prompt_token_ids": tokens}, params, engine_id, cache_salt=req.cache_salt, priority=req.priority
    ):
        last = out
    return query_logprobs(last)


async def run_beam_search(
    engine: EngineClient, req: P.GenerateRequest, engine_ids: str, stopping: Callable[[], bool]
) -> tuple[list[list[BeamSearchSequence]], int]:
    """Each prompt's best beams, best first, and the steps that ran (fewer than asked when the
    server's shutdown cut the search short: its live beams end "abort"). `engine_ids`: the
    prefix of its engine requests' ids."""
    assert req.beam is not None
    search = BeamSearch(
        [p.token_ids for p in req.prompts],
        req.beam,
        engine.eos_token_id,
        int(engine.max_model_len),
        engine.extra_eos_token_ids,
    )
    params = search.step_params()
    while queries := search.queries():
        if stopping():
            return search.results(live_reason="abort"), search.steps
        ids = [f"{engine_ids}-beam{search.steps}-{i}" for i in range(len(queries))]
        tasks = [
            asyncio.create_task(_next_token_logprobs(engine, q, params, rid, req))
            for q, rid in zip(queries, ids)
        ]
        try:
            seen = await asyncio.gather(*tasks)
        except BaseException:
            # one failed, or the client left: the others end too (their requests are aborted)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        search.advance(seen)
    return search.results(), search.steps
