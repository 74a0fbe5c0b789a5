"""The typed faces of the engine that its callers program against.

- `EngineClient`: the asynchronous engine the HTTP server serves from (`AsyncEngine`).
- `OfflineEngine`: the synchronous step loop the offline `LLM` API and the offline benchmark
  drive (`LLMEngine`).

Both describe the model they serve the same way (`ServedModel`). Nothing here imports torch: the
server imports this module before any model is loaded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from hybridserve.engine.chat_template import ChatTemplate
from hybridserve.engine.input_processor import Prompt
from hybridserve.engine.outputs import RequestOutput
from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.sampling.params import SamplingParams


@runtime_checkable
class ServedModel(Protocol):
    """What a caller may know about the model an engine serves."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_logprobs(self) -> int:
        """Most log-probabilities per token a request may ask for (--max-logprobs; -1 resolved
        to the vocabulary)."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """The token that ends a sequence (None: the model has none)."""
        ...

    @property
    def extra_eos_token_ids(self) -> tuple[int, ...]:
        """The model's other EOS ids: each ends a sequence too (as a stop token id)."""
        ...

    @property
    def model_dir(self) -> str: ...

    @property
    def tokenizer_dir(self) -> str:
        """The folder of the tokenizer and its chat template (--tokenizer, else model_dir)."""
        ...

    @property
    def default_sampling(self) -> Mapping[str, Any]:
        """SamplingParams fields (and values) that a request which does not set them takes: the
        model's generation config (--generation-config)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters and gauges of the engine (the names /metrics exports)."""
        ...


@runtime_checkable
class EngineClient(ServedModel, Protocol):
    """An engine running in the background: requests stream their outputs as they are produced."""

    @property
    def ready(self) -> bool:
        """Loaded and running; False before loading ends and after the engine stopped."""
        ...

    @property
    def chat_template(self) -> ChatTemplate:
        """The chat template served (--chat-template, else the model's)."""
        ...

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """The outputs of one request (one sequence), each carrying what is new since the last
        (`delta_text`, `delta_token_ids`); the last one has `finished` set. `priority`: as
        `OfflineEngine.add_request` (lower values are scheduled first). Raises
        InvalidRequestError for a request the engine refuses, EngineDeadError when it is not
        running, and a HybridServeError when the engine failed while running the request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...


@runtime_checkable
class OfflineEngine(ServedModel, Protocol):
    """An engine driven step by step by its caller."""

    stream_outputs: bool
    arrival_index: int
    #: the chat template served (--chat-template, else the model's)
    chat_template: ChatTemplate

    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(its text, if it was text; its token ids)."""
        ...

    def get_tokenizer(self) -> Tokenizer:
        """vLLM's name for `tokenizer`."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None: ...

    def compile_grammars(self, params_list: Sequence[SamplingParams]) -> None: ...

    def abort_request(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    @property
    def requests(self) -> Mapping[str, Any]:
        """The requests the engine runs, by id."""
        ...

    def step(self) -> list[RequestOutput]: ...

    def reset_prefix_cache(self) -> bool: ...
