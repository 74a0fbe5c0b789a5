"""LLM: the offline Python API, shaped like vLLM's.

llm = LLM(model="demo", dtype="float32")
outs = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
outs[0].outputs[0].text
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Sequence
from typing import Any, cast

from hybridserve.config import EngineArgs
from hybridserve.engine.input_processor import Prompt
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.engine.outputs import RequestOutput
from hybridserve.engine.protocol import OfflineEngine
from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.errors import InvalidRequestError
from hybridserve.sampling.params import SamplingParams
from hybridserve.sampling.seeds import choice_seed


def _is_token_list(prompts: object) -> bool:
    """One prompt given as token ids (a list, tuple or 1-D array of integers), not a list of prompts."""
    if isinstance(prompts, str | bytes | bytearray | dict):
        return False
    ndim = getattr(prompts, "ndim", None)
    if ndim is not None:  # numpy array / torch tensor
        return bool(ndim == 1)
    if not isinstance(prompts, Sequence) or not prompts:
        return False
    first = prompts[0]
    return isinstance(first, numbers.Integral) and not isinstance(first, bool)


class LLM:
    def __init__(self, model: str = "demo", **engine_kwargs: Any) -> None:
        self._attach(LLMEngine(EngineArgs(model=model, **engine_kwargs)))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm._attach(LLMEngine(args))
        return llm

    def _attach(self, engine: OfflineEngine) -> None:
        self.engine = engine
        self.engine.stream_outputs = False  # generate() only reads finished outputs
        self._next_id = 0

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order. `priority`: one per
        prompt (vLLM's); where the batch does not run at once, lower values are scheduled first,
        then the prompts' order. A sequence that failed
        on its own (non-finite logits in its row, an error while sampling it) comes back with
        finish_reason "error" and its result's `error` says why; the others are unaffected. A
        batch with an invalid request (a prompt, a parameter, a grammar that does not compile) is
        refused whole with InvalidRequestError, and changes nothing."""
        if isinstance(prompts, str | dict) or _is_token_list(prompts):
            prompt_list: list[Prompt] = [prompts]  # type: ignore[list-item]
        elif (
            isinstance(prompts, Iterable)
            and not isinstance(prompts, bytes | bytearray)
            and getattr(prompts, "ndim", 1) != 0  # a 0-d array is Iterable to the type but not to iter()
        ):
            prompt_list = list(cast("Iterable[Prompt]", prompts))
        else:
            raise InvalidRequestError(
                f"prompts: a prompt or a list of prompts (str, token ids or dict), not {type(prompts).__name__}"
            )
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, str | bytes):
                raise InvalidRequestError(
                    "sampling_params: a SamplingParams or a list of them, "
                    f"not {type(sampling_params).__name__}"
                )
            params_list = list(sampling_params)
            wrong = [type(p).__name__ for p in params_list if not isinstance(p, SamplingParams)]
            if wrong:
                raise InvalidRequestError(
                    f"sampling_params: every item must be a SamplingParams, not {wrong[0]}"
                )
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError("sampling_params: one per prompt, or a single one for all")
        if priority is None:
            priorities: list[int] = [0] * len(prompt_list)
        elif isinstance(priority, Sequence) and not isinstance(priority, str | bytes):
            priorities = list(priority)
            if len(priorities) != len(prompt_list):
                raise InvalidRequestError("priority: one per prompt")
        else:
            raise InvalidRequestError(
                f"priority: a list of integers, one per prompt, not {type(priority).__name__}"
            )
        # a grammar that does not compile refuses the batch, whether or not it was compiled before
        self.engine.compile_grammars(params_list)

        # Each of the n sequences of a prompt is one engine request; they are merged afterwards.
        groups: list[list[str]] = []
        arrival_index = self.engine.arrival_index
        try:
            for prompt, params, prio in zip(prompt_list, params_list, priorities):
                ids: list[str] = []
                groups.append(ids)
                for j in range(params.n):
                    sub = dataclasses.replace(params, n=1, seed=choice_seed(params.seed, j))
                    rid = f"llm-{self._next_id}"
                    self._next_id += 1
                    self.engine.add_request(rid, prompt, sub, priority=prio)
                    ids.append(rid)
        except BaseException:  # a refusal, or Ctrl-C while adding
            # a refused batch changes nothing: its requests are gone and the arrival indices they
            # took are given back, so later unseeded requests sample as if it was never sent
            for ids in groups:
                for rid in ids:
                    self.engine.abort_request(rid)
            self.engine.arrival_index = arrival_index
            raise

        final: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=sum(len(g) for g in groups), desc="generate")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            for ids in groups:  # leave nothing of this call behind in the engine
                for rid in ids:
                    self.engine.abort_request(rid)
            raise
        if progress is not None:
            progress.close()

        results: list[RequestOutput] = []
        for ids in groups:
            first = final[ids[0]]
            outputs = []
            for j, rid in enumerate(ids):
                o = final[rid].outputs[0]
                o.index = j
                o.delta_text, o.delta_token_ids = "", []
                outputs.append(o)
            results.append(
                RequestOutput(
                    request_id=ids[0],
                    prompt=first.prompt,
                    prompt_token_ids=first.prompt_token_ids,
                    outputs=outputs,
                    finished=True,
                    num_cached_tokens=first.num_cached_tokens,
                    # a sequence that failed alone has finish_reason "error"; its reason is here
                    error=next((final[rid].error for rid in ids if final[rid].error), None),
                    prompt_logprobs=first.prompt_logprobs,
                )
            )
        return results
