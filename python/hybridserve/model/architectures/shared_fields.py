"""Readers of the config.json fields that several families spell alike, so that each family's
`parse_config` reads them one way: the special token ids (every family), the Mamba2 mixer of the
families that name its fields `mamba_*` (Bamba, Granite-4.0-H, Falcon-H1 and, in part, Zamba2),
the attention heads, and the rotary embedding's parameters.

Each returns ModelConfig keyword arguments (a TypedDict, so the type checker checks them against
ModelConfig) or plain values; errors are the ones `model_config`'s readers raise (TypeError /
KeyError naming the field, which the loader reports with the file's name, or ConfigError naming
`source`)."""

from __future__ import annotations

from typing import Any, TypedDict

from hybridserve.errors import ConfigError
from hybridserve.model.model_config import (
    SCAN_CHUNK_DEFAULTS,
    get_field,
    get_flag,
    get_float,
    get_int,
    integral,
    scan_chunk_size,
    time_step_limit,
    token_ids,
)

# transformers 5 names the rotary embedding's parameters `rope_parameters`, 4.x `rope_scaling`.
# transformers' order: a config.json's (legacy) `rope_scaling`, where not empty, replaces
# `rope_parameters` (`convert_rope_params_to_dict`), for every family
ROPE_FIELDS = ("rope_scaling", "rope_parameters")


class SpecialTokens(TypedDict):
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None


def special_tokens(raw: dict[str, Any]) -> SpecialTokens:
    """bos / eos / pad; `eos_token_id` may list several ids (the first is `eos_token_id`)."""
    bos, _ = token_ids(raw, "bos_token_id")
    eos, eos_all = token_ids(raw, "eos_token_id")
    pad, _ = token_ids(raw, "pad_token_id")
    return SpecialTokens(bos_token_id=bos, eos_token_id=eos, eos_token_ids=eos_all, pad_token_id=pad)


def chunk_size(raw: dict[str, Any], source: str, model_type: str) -> int:
    """The Mamba scan's chunk size of a family with Mamba layers (its default when config.json
    declares none)."""
    return scan_chunk_size(raw, source, model_type) or SCAN_CHUNK_DEFAULTS[model_type]


def mamba_expand_channels(raw: dict[str, Any], hidden: int) -> int:
    """The mixer's channels: `mamba_expand` (default 2) times hidden_size."""
    return integral(get_float(raw, "mamba_expand", default=2) * hidden, "mamba_expand * hidden_size")


class MambaStateFields(TypedDict):
    dstate: int
    ngroups: int
    d_conv: int
    chunk_size: int


def mamba_state_fields(
    raw: dict[str, Any], source: str, model_type: str, *, d_state: int, n_groups: str = "mamba_n_groups"
) -> MambaStateFields:
    """The state and conv sizes: `mamba_d_state` (default `d_state`), the groups (`n_groups`:
    Zamba2 spells it `mamba_ngroups`), `mamba_d_conv` and the scan's chunk size."""
    return MambaStateFields(
        dstate=get_int(raw, "mamba_d_state", default=d_state),
        ngroups=get_int(raw, n_groups, default=1),
        d_conv=get_int(raw, "mamba_d_conv", default=4),
        chunk_size=chunk_size(raw, source, model_type),
    )


class MambaFields(MambaStateFields):
    nheads: int
    headdim: int
    d_inner: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    dt_min: float
    dt_max: float


def mamba_fields(
    raw: dict[str, Any], source: str, model_type: str, hidden: int, d_inner: int | None = None
) -> MambaFields:
    """The mixer of Bamba, Granite-4.0-H and Falcon-H1 (their transformers configs share these
    names and defaults): `d_inner` channels (a family's own field for them, Falcon-H1's
    `mamba_d_ssm`; else `mamba_expand_channels`) in `mamba_n_heads` heads (default 128) of
    `mamba_d_head` channels ("auto" or absent: split evenly), the state and conv sizes, the
    biases, and `time_step_limit` (dt's clamp)."""
    if d_inner is None:
        d_inner = mamba_expand_channels(raw, hidden)
    nheads = get_int(raw, "mamba_n_heads", default=128)
    d_head = raw.get("mamba_d_head", "auto")
    headdim = d_inner // nheads if d_head in (None, "auto") else integral(d_head, "mamba_d_head")
    dt_min, dt_max = time_step_limit(raw, "time_step_limit")
    state = mamba_state_fields(raw, source, model_type, d_state=256)
    return MambaFields(
        nheads=nheads,
        headdim=headdim,
        d_inner=d_inner,
        mamba_conv_bias=get_flag(raw, "mamba_conv_bias", default=True),
        mamba_proj_bias=get_flag(raw, "mamba_proj_bias", default=False),
        dt_min=dt_min,
        dt_max=dt_max,
        **state,
    )


class AttentionFields(TypedDict):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool


def attention_fields(raw: dict[str, Any], hidden: int, kv_heads: int | None = None) -> AttentionFields:
    """`num_attention_heads`, `num_key_value_heads`, `head_dim` (default hidden_size / heads) and
    `attention_bias`. `kv_heads`: the family's default number of KV heads where the field is left
    out (transformers' config class default); null, or left out with no such default: as many as
    the heads (no GQA)."""
    num_heads = get_int(raw, "num_attention_heads")
    return AttentionFields(
        num_heads=num_heads,
        num_kv_heads=kv_heads_field(raw, num_heads, kv_heads),
        head_dim=get_int(raw, "head_dim", default=hidden // num_heads),
        attention_bias=get_flag(raw, "attention_bias", default=False),
    )


#: `num_key_value_heads` where a config.json leaves it out, in the families whose transformers
#: config class defaults it to 8 (Bamba, Jamba, Falcon-H1, NemotronH), not to the heads
TRANSFORMERS_KV_HEADS = 8


def kv_heads_field(raw: dict[str, Any], num_heads: int, left_out: int | None) -> int:
    """`num_key_value_heads`: `left_out` where the field is absent (transformers' default for the
    family, when it has one), the number of heads where it is null."""
    if "num_key_value_heads" not in raw and left_out is not None:
        return left_out
    return get_int(raw, "num_key_value_heads", default=num_heads)


def rope_parameters(
    raw: dict[str, Any], source: str, names: tuple[str, ...] = ROPE_FIELDS, *, check_type: bool = True
) -> dict[str, Any]:
    """The rotary embedding's parameters: the first non-empty of `names`, an object ({} when
    none is). Its type must be "default", the only one the engine has, unless `check_type` is
    false (a model that runs without a rotary embedding)."""
    rp: Any = next((raw[n] for n in names if raw.get(n)), {})
    if not isinstance(rp, dict):
        raise ConfigError(f"{source}: rope_parameters must be an object")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if check_type and rope_type != "default":
        raise ConfigError(f"{source}: unsupported rope_type {rope_type!r} (only 'default')")
    return rp


def rope_theta(raw: dict[str, Any], rp: dict[str, Any]) -> float:
    """`rope_theta` of the rotary parameters `rp`, else config.json's top-level one (transformers
    4.x), else 10000."""
    return get_float(rp, "rope_theta", default=get_field(raw, "rope_theta", default=10000.0))
