"""The base classes of all architectures and the registry: `CausalLM` (what the engine runs),
`StackedCausalLM` with its `DecoderStack` (the shape every family here has)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TypeVar, cast

import torch
from torch import nn

from hybridserve.model.batch import ForwardBatch
from hybridserve.model.cache_tensors import ModelCaches
from hybridserve.model.forward_context import ForwardContext
from hybridserve.model.layers.norm import RMSNorm
from hybridserve.model.model_config import MAMBA, ModelConfig

_REGISTRY: dict[str, type[CausalLM]] = {}

T = TypeVar("T", bound="type[CausalLM]")


def register(*names: str) -> Callable[[T], T]:
    def deco(cls: T) -> T:
        for n in names:
            _REGISTRY[n] = cls
        return cls

    return deco


def registered() -> dict[str, type[CausalLM]]:
    return dict(_REGISTRY)


class CausalLM(nn.Module, metaclass=abc.ABCMeta):
    """A decoder-only LM over a ForwardBatch. Subclasses implement the abstract methods below
    (decoder layers each with ``forward(hidden, ctx, caches, layer_idx, keep=None)``); their
    attribute names are free: they only need to match the checkpoint's state-dict names."""

    # checkpoint key -> key it may be tied to when missing (e.g. lm_head -> embeddings)
    tied_weights: ClassVar[dict[str, str]] = {}
    # Whether config.json's tie_word_embeddings ties them as the family's transformers class does.
    # False: the class never ties (it saves and loads its own LM head whatever the flag says), so a
    # stored head is loaded and only a missing one falls back to its tie.
    honours_tie_word_embeddings: ClassVar[bool] = True
    # parameter name -> older checkpoint names of the same tensor (tried when the name is missing)
    key_aliases: ClassVar[dict[str, tuple[str, ...]]] = {}
    # parameter-name suffixes kept in fp32 when the model runs in bf16/fp16
    fp32_param_suffixes: ClassVar[tuple[str, ...]] = (
        "A_log",
        ".D",
        "dt_bias",
        "gate.weight",
        "e_score_correction_bias",
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def tied_weight_map(self) -> dict[str, str]:
        """`tied_weights` of this model (a family whose ties depend on its config adds its own)."""
        return dict(self.tied_weights)

    @classmethod
    @abc.abstractmethod
    def parse_config(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        raise NotImplementedError

    # --- the pieces every subclass provides ---
    @abc.abstractmethod
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @abc.abstractmethod
    def decoder_layers(self) -> list[nn.Module]:
        raise NotImplementedError

    @abc.abstractmethod
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @abc.abstractmethod
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight().dtype

    @abc.abstractmethod
    def embed_weight(self) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Runs every scheduled token; returns logits ``[len(batch.logits_indices), vocab]`` in
        fp32 (fp64 for an fp64 model). Writes KV at `slot_mapping` and the Mamba states per the
        state-window arrays of `batch`."""
        dev = self.embed_weight().device
        if batch.num_tokens == 0:
            n = int(batch.logits_indices.numel())
            out_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
            return torch.empty((n, self.config.vocab_size), dtype=out_dtype, device=dev)
        return self.forward_context(ForwardContext.build(batch, dev), batch.input_ids, caches)

    def forward_context(
        self, ctx: ForwardContext, input_ids: torch.Tensor, caches: ModelCaches
    ) -> torch.Tensor:
        """`forward` of a batch whose ForwardContext is built: host reads of `ctx`'s CPU fields
        only, so that a CUDA graph can capture it (model/cuda_graphs.py builds the context of its
        static buffers itself)."""
        out_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        hidden = self.embed(input_ids.to(ctx.device, torch.int64))
        # Only the logits rows' outputs are needed after the last layer that writes a cache: that
        # layer returns those rows alone (an attention layer computes just their queries), and
        # the cache-free layers after it run on them alone. No row's output there depends on
        # another row, so only rounding can differ (tests/model/test_model_tail_rows.py, float64).
        # (CPU indices: they index device tensors as well, and the attention layer maps them to
        # rows on the CPU without a device sync)
        keep = ctx.logits_indices if _drops_rows(ctx.logits_indices, ctx.num_tokens) else None
        cut = self.last_cache_layer()
        for i, layer in enumerate(self.decoder_layers()):
            if keep is not None and i == cut:
                hidden = layer(hidden, ctx, caches, i, keep=keep)
            else:
                hidden = layer(hidden, ctx, caches, i)
        if keep is None and not _every_token(ctx.logits_indices, ctx.num_tokens):
            hidden = hidden[ctx.logits_indices]
        return self.head(self.final_norm(hidden)).to(out_dtype)

    def last_cache_layer(self) -> int:
        """Index of the last decoder layer that writes a cache (KV or Mamba state): the layers
        after it must not read the ForwardContext (they run on the logits rows only). Every layer
        takes ``keep`` (flat token indices, increasing) and then returns those rows only."""
        return len(self.decoder_layers()) - 1


class DecoderStack(nn.Module):
    """Token embeddings, the decoder layers and the final RMSNorm, under the names the family's
    checkpoint gives them: `embedding` ("embed_tokens", NemotronH's and Mamba2's "embeddings"),
    `layers`, `norm` ("final_layernorm", Granite's "norm", "norm_f"). A family whose layers need
    the embedding module (Zamba2's) passes no layers and adds them to `layers` afterwards."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers: Iterable[nn.Module] = (),
        *,
        embedding: str = "embed_tokens",
        norm: str = "final_layernorm",
    ) -> None:
        super().__init__()
        self.embedding_name, self.norm_name = embedding, norm
        self.add_module(embedding, nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(layers)
        self.add_module(norm, RMSNorm(cfg.hidden_size, cfg.norm_eps))

    @property
    def token_embedding(self) -> nn.Embedding:
        return cast(nn.Embedding, self._modules[self.embedding_name])

    @property
    def output_norm(self) -> RMSNorm:
        return cast(RMSNorm, self._modules[self.norm_name])


class StackedCausalLM(CausalLM):
    """A CausalLM that is a DecoderStack, held as `stack_name` (the checkpoint's prefix: "model",
    or "backbone"), and a bias-free `lm_head` that a checkpoint may tie to the embeddings. A
    family builds its stack (`build_stack`) and overrides what it does its own way (multipliers
    on the embeddings or the logits, a cast before the final norm).
    `config_class`: the config its parse_config returns (a family with fields of its own has a
    ModelConfig subclass; any other config is refused at construction)."""

    stack_name: ClassVar[str] = "model"
    config_class: ClassVar[type[ModelConfig]] = ModelConfig

    def __init__(self, config: ModelConfig) -> None:
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs the config of its parse_config")
        super().__init__(config)
        self.add_module(self.stack_name, self.build_stack())
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @abc.abstractmethod
    def build_stack(self) -> DecoderStack:
        """The embeddings, decoder layers and final norm for `self.config`."""
        raise NotImplementedError

    def stack(self) -> DecoderStack:
        return cast(DecoderStack, self._modules[self.stack_name])

    def tied_weight_map(self) -> dict[str, str]:
        s = self.stack()
        return {**super().tied_weight_map(), "lm_head.weight": f"{self.stack_name}.{s.embedding_name}.weight"}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.stack().token_embedding(input_ids)

    def embed_weight(self) -> torch.Tensor:
        return self.stack().token_embedding.weight

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.stack().layers)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.stack().output_norm(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def _every_token(logits_indices: torch.Tensor, num_tokens: int) -> bool:
    """Whether the logits rows are every token in order (a decode step's): the hidden states are
    then taken as they are, with no gather (on a device, indexing with CPU indices copies them
    there first)."""
    n = int(logits_indices.numel())
    return n == num_tokens and (n == 0 or bool((logits_indices == torch.arange(n)).all()))


def _drops_rows(logits_indices: torch.Tensor, num_tokens: int) -> bool:
    """Whether some tokens need no output (prefill tokens before a row's last, or a chunk that
    does not end its prompt), with the indices (CPU) strictly increasing inside [0, num_tokens)
    as the scheduler emits them; any other list is taken as it is, by indexing."""
    n = int(logits_indices.numel())
    if n >= num_tokens:
        return False
    if n == 0:
        return True
    li = logits_indices
    return int(li[0]) >= 0 and int(li[-1]) < num_tokens and bool((li[1:] > li[:-1]).all())


def mamba_or_attention(
    layer: Any,  # an nn.Module with `kind` and a `mamba` or `self_attn` mixer
    h: torch.Tensor,
    hidden: torch.Tensor,
    ctx: ForwardContext,
    caches: ModelCaches,
    idx: int,
    keep: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixer of a decoder layer that has either a `mamba` or a `self_attn` mixer (its `kind`)
    on the normed input `h`: (the residual stream, the mixer's output), both reduced to the rows
    `keep` when given. An attention mixer then computes the queries of the kept rows only (K / V
    of every token are written); a Mamba mixer runs every token (its state needs them all)."""
    if layer.kind == MAMBA:
        h = layer.mamba(h, ctx, caches.conv[idx], caches.ssm[idx])
        return (hidden, h) if keep is None else (hidden[keep], h[keep])
    h = layer.self_attn(h, ctx, caches.kv[idx], keep=keep)
    return (hidden if keep is None else hidden[keep]), h
