"""LLM: the offline Python API, shaped like vLLM's.

llm = LLM(model="demo", dtype="float32")
outs = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
outs[0].outputs[0].text
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import jinja2

from hybridserve.config import EngineArgs
from hybridserve.config.args import CHAT_CONTENT_FORMATS
from hybridserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
from hybridserve.engine.chat_template import TEXT_PART_KEYS, TextParts, encode_rendered
from hybridserve.engine.input_processor import Prompt
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.engine.outputs import RequestMetrics, RequestOutput
from hybridserve.engine.protocol import OfflineEngine
from hybridserve.engine.tokenizer import Tokenizer
from hybridserve.errors import ConfigError, InvalidRequestError
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


def _conversations(messages: object) -> list[list[dict[str, Any]]]:
    """`LLM.chat`'s messages as conversations of plain messages: text parts joined into the
    content (one per line, as the server joins them); other keys (name, tool_calls, ...) passed
    to the template as given."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise InvalidRequestError("messages: a non-empty list of messages, or a list of such lists")
    if isinstance(messages[0], Mapping):  # one conversation (as vLLM tells the two apart)
        return [_conversation(messages, "messages")]
    out = []
    for i, c in enumerate(messages):
        if not isinstance(c, Sequence) or isinstance(c, str | bytes) or not c:
            raise InvalidRequestError(f"messages[{i}]: a non-empty list of messages")
        out.append(_conversation(c, f"messages[{i}]"))
    return out


def _conversation(messages: Sequence[object], where: str) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        p = f"{where}[{i}]"
        if not isinstance(m, Mapping):
            raise InvalidRequestError(f"{p}: a message is a mapping, not {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"{p}.role: a non-empty string, got {role!r}")
        content = m.get("content")
        if isinstance(content, list | tuple):
            texts = []
            for j, part in enumerate(content):
                key = TEXT_PART_KEYS.get(str(part.get("type"))) if isinstance(part, Mapping) else None
                if key is None or not isinstance(part.get(key), str):
                    raise InvalidRequestError(
                        f"{p}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}; "
                        f"also {', '.join(t for t in TEXT_PART_KEYS if t != 'text')})"
                    )
                texts.append(part[key])
            content = TextParts(texts)
        elif content is None:
            # (an assistant message with only tool calls, say): "" as a string, as templates add
            # strings; no parts for a template taking them
            content = TextParts(())
        elif not isinstance(content, str):
            raise InvalidRequestError(
                f"{p}.content: a string, None or a list of text parts, not {type(content).__name__}"
            )
        msg = {**m, "content": content}
        if isinstance(m.get("tool_calls"), list | tuple):
            msg["tool_calls"] = [_parsed_arguments(c) for c in m["tool_calls"]]
        out.append(msg)
    return out


def _parsed_arguments(call: object) -> object:
    """An earlier tool call with its `arguments` JSON text parsed, as vLLM's `LLM.chat` and the
    server hand them to templates (they write them with `tojson` or walk their `items`); text
    that is not JSON stays text. The caller's message is not changed."""
    if not isinstance(call, Mapping):
        return call
    fn = call.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("arguments"), str | None):
        return call
    try:  # (none, or empty: {}, as vLLM)
        args: object = json.loads(fn["arguments"]) if fn.get("arguments") else {}
    except (ValueError, RecursionError):
        return call
    return {**call, "function": {**fn, "arguments": args}}


def _no_lora(lora_request: object) -> None:
    if lora_request is not None:
        raise InvalidRequestError("lora_request: LoRA adapters are not supported; give None")


# vLLM's LLM(...) arguments that change nothing here: taken so that code written for vLLM runs
# (a value that would change the answer is refused by name, `_vllm_only_arguments`)
_VLLM_NO_OPS = frozenset(
    ("trust_remote_code", "disable_log_stats", "swap_space", "download_dir", "disable_custom_all_reduce",
     "compilation_config", "hf_token", "max_seq_len_to_capture", "disable_async_output_proc",
     "served_model_name")
)  # fmt: skip
# argument -> the values that leave the model as it is (or name what is run here anyway: text
# generation, worker processes of this machine)
_VLLM_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "quantization": (None,),
    "revision": (None,),
    "tokenizer_revision": (None,),
    "code_revision": (None,),
    "tokenizer_mode": ("auto", "hf"),
    "task": ("auto", "generate"),
    "runner": ("auto", "generate"),
    "enable_lora": (False,),
    "enable_expert_parallel": (False,),
    "skip_tokenizer_init": (False,),
    "distributed_executor_backend": (None, "mp", "uni"),
}


# vLLM's sizes of kinds of parallelism not run here: 1 is taken (code written for vLLM gives it)
_VLLM_ONLY_ONE = {
    "pipeline_parallel_size": "hybridserve splits a model over devices by tensor_parallel_size",
    "data_parallel_size": "data-parallel replicas are served by `hybridserve replicas --num-replicas N`",
}


def _vllm_only_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` without vLLM's arguments that change nothing here; ConfigError for one whose value
    would (a quantization, a revision: the model folder is read as it is)."""
    rest = {}
    for name, v in kwargs.items():
        if name in _VLLM_ONLY_ONE:
            if isinstance(v, bool) or v != 1:
                raise ConfigError(f"{name}: only 1 here, got {v!r}: {_VLLM_ONLY_ONE[name]}")
            continue
        if name in _VLLM_NO_OPS:
            continue
        if name in _VLLM_NEUTRAL:
            if v not in _VLLM_NEUTRAL[name]:
                allowed = " or ".join(repr(x) for x in _VLLM_NEUTRAL[name])
                raise ConfigError(f"{name}: only {allowed} is served here, got {v!r}")
            continue
        rest[name] = v
    return rest


class LLM:
    def __init__(self, model: str = "demo", **engine_kwargs: Any) -> None:
        """`engine_kwargs`: EngineArgs' fields; vLLM's arguments that change nothing here
        (`trust_remote_code`, `swap_space`, `disable_log_stats`, ...) are taken too."""
        self._attach(LLMEngine(EngineArgs(model=model, **_vllm_only_arguments(engine_kwargs))))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        if not isinstance(args, EngineArgs):  # (a dict of its fields was an AttributeError deep in loading)
            raise ConfigError(
                f"engine args: an EngineArgs, not {type(args).__name__}; LLM(**fields) takes fields"
            )
        llm = cls.__new__(cls)
        llm._attach(LLMEngine(args))
        return llm

    def _attach(self, engine: OfflineEngine) -> None:
        self.engine = engine
        self.engine.stream_outputs = False  # generate() only reads finished outputs
        self._next_id = 0

    @property
    def llm_engine(self) -> OfflineEngine:
        """The engine (vLLM's name for it; also `engine`)."""
        return self.engine

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """vLLM's: drops every cached prefix (KV blocks and Mamba checkpoints); False while a
        request is running."""
        return bool(self.engine.reset_prefix_cache())

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: each prompt's `params.beam_width` best beams, best first
        (engine/beam_search.py). Each step is a `generate` call whose prompts are the beams so
        far; the prefix cache's last-token checkpoints make each compute one token.
        `concurrency_limit`: at most that many prompts searched at once. `lora_request` is
        vLLM's; no adapter is served here, so only None is taken."""
        from hybridserve.engine.beam_search import beam_search

        _no_lora(lora_request)
        if isinstance(prompts, str | dict) or _is_token_list(prompts):
            listed = [prompts]
        else:
            listed = list(prompts)  # type: ignore[arg-type]
        return beam_search(
            self,
            listed,  # type: ignore[arg-type]
            params,
            use_tqdm=use_tqdm,
            concurrency_limit=concurrency_limit,
        )

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters `generate` and `chat` use when given none: SamplingParams' defaults with
        the model's generation config over them (--generation-config), as vLLM's."""
        return SamplingParams(**self.engine.default_sampling)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, as vLLM's `LLM.chat`: `messages` is one conversation
        (a list of `{"role", "content"}` messages; content a string, None or a list of text parts)
        or a list of them, each rendered with the chat template (`chat_template`, a template's
        text, else the engine's: --chat-template or the model's) and generated as `generate`
        does. `chat_template_kwargs` are more template variables (e.g. `enable_thinking`);
        `continue_final_message` continues the last message instead of starting a reply (with
        `add_generation_prompt` false). `tools` (OpenAI's function tools, as vLLM's `LLM.chat`
        takes them) are the template's `tools` variable: a template that mentions them renders
        them, as transformers' `apply_chat_template(tools=...)` does; nothing parses calls out of
        the replies here (the server does). A conversation the template refuses, or one malformed,
        raises InvalidRequestError and nothing runs. vLLM's `lora_request` (None only)
        is taken. `chat_template_content_format` (vLLM's): how the template is handed a
        message's content, "string" or "openai" (a list of text parts); "auto" keeps the engine's
        setting (--chat-template-content-format, whose "auto" gives the list to a template that
        loops over a message's content)."""
        _no_lora(lora_request)
        if chat_template_content_format not in CHAT_CONTENT_FORMATS:
            raise InvalidRequestError(
                f"chat_template_content_format: one of {', '.join(CHAT_CONTENT_FORMATS)}, got {chat_template_content_format!r}"
            )
        conversations = _conversations(messages)
        template = self.engine.chat_template
        if chat_template_content_format != "auto":
            template = template.with_content_format(chat_template_content_format)
        if chat_template is not None:
            if not isinstance(chat_template, str) or not chat_template:
                raise InvalidRequestError(f"chat_template: a Jinja template's text, got {chat_template!r}")
            try:  # (a name of one of the model's named templates is that template)
                template = template.with_source(chat_template)
            except jinja2.TemplateError as e:
                raise InvalidRequestError(f"chat_template: {e}") from None
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise InvalidRequestError(
                f"chat_template_kwargs: a mapping of template variables, not {type(chat_template_kwargs).__name__}"
            )
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            listed = (
                list(tools) if isinstance(tools, Sequence) and not isinstance(tools, (str, bytes)) else None
            )
            if listed is None or not all(isinstance(t, Mapping) for t in listed):
                raise InvalidRequestError("tools: a list of tools (objects), as OpenAI's `tools`")
            extra["tools"] = [dict(t) for t in listed]
        tokenizer = self.engine.tokenizer
        prompts: list[Prompt] = []
        for i, conversation in enumerate(conversations):
            try:
                text = template.render(
                    conversation,
                    add_generation_prompt=add_generation_prompt,
                    extra=extra,
                    continue_final_message=continue_final_message,
                )
            except Exception as e:  # noqa: BLE001 - raise_exception, a continuation, or the template failing on these messages
                where = f"messages[{i}]" if len(conversations) > 1 else "messages"
                raise InvalidRequestError(f"{where}: the chat template refused it: {e}") from None
            prompts.append({"prompt": text, "prompt_token_ids": encode_rendered(tokenizer, text)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        lora_request: None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order. `priority`: one per
        prompt (vLLM's); where the batch does not run at once, lower values are scheduled first,
        then the prompts' order. A sequence that failed
        on its own (non-finite logits in its row, an error while sampling it) comes back with
        finish_reason "error" and its result's `error` says why; the others are unaffected. A
        batch with an invalid request (a prompt, a parameter, a grammar that does not compile) is
        refused whole with InvalidRequestError, and changes nothing. `use_tqdm`: a bar over the
        prompts (True, or a tqdm-like factory to make it); `lora_request` (vLLM's): None only,
        no adapter is served. While requests added through the engine's step API
        (`llm.engine.add_request`) are unfinished it refuses with InvalidRequestError."""
        _no_lora(lora_request)
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
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
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
        # Requests added through the engine's step API (`llm.engine.add_request`) would be run to
        # their end by the loop below, their outputs dropped: refused until they are stepped or
        # aborted. (Any request in the engine now is another's: a call leaves none of its own.)
        if others := list(self.engine.requests):
            raise InvalidRequestError(
                f"the engine runs {len(others)} request(s) added through its step API ({others[0]!r}, ...): "
                "step them to their end (engine.step()) or abort them before generate"
            )
        # A value set after construction is checked before the fan-out reads it: an n of 0 left a
        # prompt with no request (IndexError after the run), an n that is no int a TypeError.
        for params in {id(p): p for p in params_list}.values():
            params.validate()
        # a grammar that does not compile refuses the batch, whether or not it was compiled before
        self.engine.compile_grammars(params_list)

        # The bar is made before any request is added: made after, a factory that raised (or Ctrl-C
        # while tqdm was imported) left the call's requests queued in the engine, or the arrival
        # indices they had taken
        progress = None
        if use_tqdm:
            factory: Callable[..., Any]
            if callable(use_tqdm):
                factory = use_tqdm
            else:
                from tqdm import tqdm

                factory = tqdm
            progress = factory(total=len(prompt_list), desc="Processed prompts")

        # Each of the n sequences of a prompt is one engine request; they are merged afterwards.
        groups: list[list[str]] = []
        arrival_index = self.engine.arrival_index
        try:
            for prompt, params, prio in zip(prompt_list, params_list, priorities):
                ids: list[str] = []
                groups.append(ids)
                for j in range(params.n):
                    sub = dataclasses.replace(params, n=1, best_of=None, seed=choice_seed(params.seed, j))
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
            if progress is not None:
                progress.close()
            raise

        final: dict[str, RequestOutput] = {}
        # (a prompt counts once its last sequence is done)
        left = {rid: len(ids) for ids in groups for rid in ids[:1]}
        group_of = {rid: ids[0] for ids in groups for rid in ids}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        head = group_of.get(out.request_id)
                        if progress is not None and head is not None:
                            left[head] -= 1
                            if left[head] == 0:
                                progress.update(1)
        except BaseException:
            for ids in groups:  # leave nothing of this call behind in the engine
                for rid in ids:
                    self.engine.abort_request(rid)
            raise
        finally:
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
                    invalid=next((final[rid].invalid for rid in ids if final[rid].error), False),
                    prompt_logprobs=first.prompt_logprobs,
                    metrics=RequestMetrics.combined([final[rid].metrics for rid in ids]),
                )
            )
        return results
