"""How a model is split over N tensor-parallel ranks (docs/tensor-parallelism.md, "Sharding").

Every rank loads the whole checkpoint and keeps its slice of each weight (`shard_model`), then
replaces the layers that end a column-parallel / row-parallel pair by their forms that sum over
the ranks. The shapes every rank holds are those of `local_config`, by which the caches are sized;
`check_tensor_parallel` refuses, naming the flag, a model whose shapes N does not divide.

- Mamba2 mixer: heads split (H / N per rank). Groups of B and C split (G / N per rank) when N
  divides G; otherwise, when G divides N, each rank keeps the one group its heads belong to
  (replicated over the N / G ranks that share it). `in_proj` rows and `conv1d` channels are cut
  section by section (z, x, B, C, dt), `A_log`, `D`, `dt_bias` by head, the gated norm's weight
  with z. The gated RMSNorm normalises each group of I / G channels: a group that lies within a
  rank is normalised there; a group spread over N / G ranks gets its sum of squares summed over the
  ranks first. `out_proj` row-parallel: one sum per layer.
- Attention: query heads split; KV heads split when N divides them, else (N a multiple of them)
  each rank keeps the one KV head its query heads read. `o_proj` row-parallel.
- MLP (plain and gated) and MoE experts: up / gate column-parallel, down row-parallel. The routed
  experts of an MoE layer are summed over the ranks once, after the weighted sum of the experts
  (the router runs replicated, so every rank routes each token the same way); the shared expert
  is a row-parallel MLP.
- Granite-4.0-H: every expert of the stacked expert weights split like an MLP (gate and up rows,
  output columns), summed once per layer; the shared MLP column- / row-parallel.
- Falcon-H1: the mixer as above (its out_proj bias added after the sum), the muP vector of
  `ssm_multipliers` cut with the in_proj sections it scales, its norm before or after the gate;
  the MLP column- / row-parallel. The scalar multipliers need nothing: they scale whole tensors.
- Jamba: the Mamba1 mixer split by channel (in_proj's x and z rows, the conv, dt_proj's rows,
  A_log, D); x_proj reads every channel, so it is row-parallel: dt, B and C are summed over the
  ranks (one more sum per layer), then every rank norms them and runs dt_proj on the whole dt.
  out_proj row-parallel. Its MoE experts split like an MLP and summed once per layer (the router
  runs replicated), its dense MLPs column- / row-parallel.
- Zamba2: its Mamba2 layers as above; a shared block's attention (over 2 * hidden_size channels)
  and gated MLP as attention and MLP, each use's adapters cut with the projection they add to
  (the up half of an adapter column-parallel like its q, k, v or gate | up rows; the down half,
  rank-sized, replicated); a block is sharded once, whichever uses share it. The per-layer
  `linear` into the Mamba layer replicated.
- Embedding and LM head replicated (sampling runs on rank 0, which needs every logit); the other
  ranks skip the LM head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.distributed.parallel_state import all_reduce_
from hybridserve.errors import ConfigError
from hybridserve.model.architectures.falcon_h1 import FalconH1Mixer, FalconH1MLP
from hybridserve.model.architectures.granitemoehybrid import GraniteMoE, GraniteSharedMLP
from hybridserve.model.architectures.jamba import JambaMoE
from hybridserve.model.architectures.zamba2 import Zamba2Attention, Zamba2MLP
from hybridserve.model.layers.attention import PagedAttention
from hybridserve.model.layers.mamba1 import Mamba1Mixer
from hybridserve.model.layers.mamba2 import Mamba2Mixer
from hybridserve.model.layers.mlp import MLP, GatedMLP, MoE
from hybridserve.model.layers.norm import GatedRMSNorm, _compute_dtype
from hybridserve.model.model_config import MLP as MLP_KIND
from hybridserve.model.model_config import MOE, ModelConfig

FLAG = "--tensor-parallel-size"

# The architectures whose every layer has a sharded form here.
SUPPORTED_ARCHITECTURES = (
    "NemotronHForCausalLM",
    "BambaForCausalLM",
    "Mamba2ForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "FalconH1ForCausalLM",
    "JambaForCausalLM",
    "Zamba2ForCausalLM",
)
GRANITE = "GraniteMoeHybridForCausalLM"
JAMBA = "JambaForCausalLM"


def _divides(n: int, tp: int) -> bool:
    return n % tp == 0


def check_tensor_parallel(cfg: ModelConfig, tp: int, source: str = "config.json") -> None:
    """ConfigError naming the flag when the model cannot be split over `tp` ranks."""
    if tp == 1:
        return
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{FLAG} {tp}: {cfg.architecture} has no tensor-parallel form (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}); use {FLAG} 1"
        )
    kinds = set(cfg.layer_types)
    bad: list[str] = []
    if cfg.has_mamba_layers:
        if not _divides(cfg.nheads, tp):
            # a Mamba1 mixer (Jamba) splits its channels, held as heads of one channel
            what = f"channels (d_inner {cfg.nheads})" if cfg.mamba_version == 1 else f"heads ({cfg.nheads})"
            bad.append(f"the Mamba {what}")
        G = cfg.ngroups
        if not (_divides(G, tp) or _divides(tp, G)):
            bad.append(f"the Mamba groups n_groups ({G}: {tp} must divide it or be a multiple of it)")
    if cfg.num_attention_layers:
        if not _divides(cfg.num_heads, tp):
            bad.append(f"the attention heads ({cfg.num_heads})")
        kv = cfg.num_kv_heads
        if not (_divides(kv, tp) or _divides(tp, kv)):
            bad.append(f"the KV heads ({kv}: {tp} must divide them or be a multiple of them)")
    has_mlp = MLP_KIND in kinds or cfg.architecture in (
        "BambaForCausalLM",
        "FalconH1ForCausalLM",
        "Zamba2ForCausalLM",
        JAMBA,
    )
    if has_mlp and not _divides(cfg.intermediate_size, tp):
        bad.append(f"the MLP's intermediate_size ({cfg.intermediate_size})")
    if cfg.architecture == GRANITE:
        if not _divides(cfg.intermediate_size, tp):
            bad.append(f"the shared MLP's shared_intermediate_size ({cfg.intermediate_size})")
        if cfg.n_routed_experts and not _divides(cfg.moe_intermediate_size, tp):
            bad.append(f"the experts' intermediate_size ({cfg.moe_intermediate_size})")
    if cfg.architecture == JAMBA and cfg.n_routed_experts and not _divides(cfg.moe_intermediate_size, tp):
        bad.append(f"the experts' intermediate_size ({cfg.moe_intermediate_size})")
    if MOE in kinds:
        if not _divides(cfg.moe_intermediate_size, tp):
            bad.append(f"the experts' moe_intermediate_size ({cfg.moe_intermediate_size})")
        if not _divides(cfg.moe_shared_expert_intermediate_size, tp):
            bad.append(f"moe_shared_expert_intermediate_size ({cfg.moe_shared_expert_intermediate_size})")
    if bad:
        raise ConfigError(
            f"{FLAG} {tp}: {source}: {tp} ranks cannot split " + "; ".join(bad) + " evenly; choose a "
            "size that divides them"
        )


def local_groups(cfg: ModelConfig, rank: int, tp: int) -> tuple[int, int]:
    """(first group, groups) of B / C that rank `rank` keeps."""
    G = cfg.ngroups
    if G % tp == 0:
        return rank * (G // tp), G // tp
    return rank // (tp // G), 1


def local_kv_heads(cfg: ModelConfig, rank: int, tp: int) -> tuple[int, int]:
    """(first KV head, KV heads) that rank `rank` keeps."""
    kv = cfg.num_kv_heads
    if kv % tp == 0:
        return rank * (kv // tp), kv // tp
    return rank // (tp // kv), 1


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one rank holds (the same on every rank): what its caches are sized by."""
    if tp == 1:
        return cfg
    check_tensor_parallel(cfg, tp)
    out = dataclasses.replace(cfg)
    if cfg.has_mamba_layers:
        out.nheads = cfg.nheads // tp
        out.d_inner = cfg.d_inner // tp
        out.ngroups = local_groups(cfg, 0, tp)[1]
    if cfg.num_attention_layers:
        out.num_heads = cfg.num_heads // tp
        out.num_kv_heads = local_kv_heads(cfg, 0, tp)[1]
    out.intermediate_size = cfg.intermediate_size // tp
    out.moe_intermediate_size = cfg.moe_intermediate_size // tp
    out.moe_shared_expert_intermediate_size = cfg.moe_shared_expert_intermediate_size // tp
    return out


# ------------------------------------------------------------------ the sharded modules


class RowParallelLinear(nn.Module):
    """``sum over ranks(x_r @ W_r^T) + b``: the input's features split over the ranks, the output
    whole on every rank (one sum), the bias added once after it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce_(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class SplitGroupGatedRMSNorm(nn.Module):
    """The Mamba2 gated RMSNorm of a rank that holds part of one norm group (G < N): the group's
    sum of squares is summed over the ranks that share it, then each rank normalises its channels.
    Every rank adds its partial sum into the column of its group (the others are zero), so one
    sum over the whole group serves every group at once. `norm_before_gate` (Falcon-H1's
    default): ``w * norm(y) * silu(z)`` instead of ``w * norm(y * silu(z))``."""

    def __init__(
        self,
        weight: torch.Tensor,
        group: int,
        num_groups: int,
        group_size: int,
        eps: float,
        norm_before_gate: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group
        self.num_groups = num_groups
        self.group_size = group_size  # channels of the whole group, over all its ranks
        self.eps = eps
        self.norm_before_gate = norm_before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        cdt = _compute_dtype(out_dtype)
        gate = F.silu(z.to(cdt))
        h = y.to(cdt) if self.norm_before_gate else y.to(cdt) * gate
        sums = torch.zeros((*h.shape[:-1], self.num_groups), dtype=cdt, device=h.device)
        sums[..., self.group] = h.pow(2).sum(-1)
        all_reduce_(sums)
        ms = sums[..., self.group : self.group + 1] / self.group_size
        h = self.weight.to(cdt) * (h * torch.rsqrt(ms + self.eps))
        return (h * gate if self.norm_before_gate else h).to(out_dtype)


class _NoLogits(nn.Module):
    """The LM head of a rank other than 0: nothing reads its logits, so none are computed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :0]


# ------------------------------------------------------------------ slicing


def _rows(w: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The rows (dim 0) of `w` in the (start, length) spans, in order, as a new tensor."""
    return torch.cat([w[s : s + n] for s, n in spans]).clone()


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)


def _column_parallel(lin: nn.Linear, spans: list[tuple[int, int]]) -> None:
    lin.weight = _param(_rows(lin.weight.data, spans))
    if lin.bias is not None:
        lin.bias = _param(_rows(lin.bias.data, spans))
    lin.out_features = int(lin.weight.shape[0])


def _row_parallel(lin: nn.Linear, start: int, n: int) -> RowParallelLinear:
    w = lin.weight.data[:, start : start + n].contiguous().clone()
    b = None if lin.bias is None else lin.bias.data.clone()
    return RowParallelLinear(w, b)


def _shard_mamba(m: Mamba2Mixer, cfg: ModelConfig, rank: int, tp: int) -> None:
    H, P, N, G, inner = cfg.nheads, cfg.headdim, cfg.dstate, cfg.ngroups, cfg.d_inner
    hl = H // tp
    h0 = rank * hl
    g0, gl = local_groups(cfg, rank, tp)
    ch = (h0 * P, hl * P)  # this rank's channels of z and of x
    gn = G * N
    # in_proj rows: z | x | B | C | dt
    spans = [ch, (inner + ch[0], ch[1]), (2 * inner + g0 * N, gl * N), (2 * inner + gn + g0 * N, gl * N)]
    spans.append((2 * inner + 2 * gn + h0, hl))
    _column_parallel(m.in_proj, spans)
    # conv1d channels: x | B | C
    conv = [ch, (inner + g0 * N, gl * N), (inner + gn + g0 * N, gl * N)]
    m.conv1d.weight = _param(_rows(m.conv1d.weight.data, conv))
    if m.conv1d.bias is not None:
        m.conv1d.bias = _param(_rows(m.conv1d.bias.data, conv))
    for name in ("A_log", "D", "dt_bias"):
        setattr(m, name, _param(getattr(m, name).data[h0 : h0 + hl]))
    norm = getattr(m, "norm", None)  # Falcon-H1 without mamba_rms_norm has none
    if isinstance(norm, GatedRMSNorm):
        w = norm.weight.data[ch[0] : ch[0] + ch[1]]
        if G % tp == 0:
            norm.weight = _param(w)  # whole groups on this rank: group_size unchanged
        else:
            before_gate = isinstance(m, FalconH1Mixer) and m.norm_before_gate
            m.norm = SplitGroupGatedRMSNorm(w.clone(), g0, G, norm.group_size, norm.eps, before_gate)  # type: ignore[assignment]
    m.out_proj = _row_parallel(m.out_proj, ch[0], ch[1])  # type: ignore[assignment]
    m.nheads, m.d_inner, m.ngroups = hl, hl * P, gl
    m.conv_dim = hl * P + 2 * gl * N
    if isinstance(m, FalconH1Mixer):  # the muP vector's z, x, B, C, dt sections, as in_proj's
        m.mup_sizes = [hl * P, hl * P, gl * N, gl * N, hl]
        m._mup_cache.clear()


def _shard_mamba1(m: Mamba1Mixer, rank: int, tp: int) -> None:
    """Jamba's mixer: this rank's channels of x and z (in_proj rows), of the conv, dt_proj, A_log
    and D; x_proj and out_proj row-parallel (the first sums dt, B and C over the ranks)."""
    d = m.d_inner
    dl = d // tp
    c0 = rank * dl
    _column_parallel(m.in_proj, [(c0, dl), (d + c0, dl)])  # x | z
    m.conv1d.weight = _param(m.conv1d.weight.data[c0 : c0 + dl])
    if m.conv1d.bias is not None:
        m.conv1d.bias = _param(m.conv1d.bias.data[c0 : c0 + dl])
    m.x_proj = _row_parallel(m.x_proj, c0, dl)  # type: ignore[assignment]
    _column_parallel(m.dt_proj, [(c0, dl)])
    m.A_log = _param(m.A_log.data[c0 : c0 + dl])
    m.D = _param(m.D.data[c0 : c0 + dl])
    m.out_proj = _row_parallel(m.out_proj, c0, dl)  # type: ignore[assignment]
    m.d_inner = dl


def _shard_adapters(adapters: nn.ModuleList, spans: list[tuple[int, int]]) -> None:
    """Zamba2's per-use adapters (`up(down(x))`) of a projection cut to `spans`: each up half
    keeps those rows; placeholders (uses of another block) have no weights."""
    for a in adapters:
        if isinstance(a, nn.Sequential) and isinstance(up := a[1], nn.Linear):
            _column_parallel(up, spans)


def _shard_zamba2_attention(a: Zamba2Attention, cfg: ModelConfig, rank: int, tp: int) -> None:
    _shard_attention(a, cfg, rank, tp)
    if a.adapters:  # no GQA with adapters (refused at load): k and v split like q
        D, hl = cfg.head_dim, cfg.num_heads // tp
        for lst in (a.linear_q_adapter_list, a.linear_k_adapter_list, a.linear_v_adapter_list):
            _shard_adapters(lst, [(rank * hl * D, hl * D)])


def _shard_zamba2_mlp(m: Zamba2MLP, rank: int, tp: int) -> None:
    inter = m.down_proj.in_features
    il = inter // tp
    spans = [(rank * il, il), (inter + rank * il, il)]  # gate | up
    _column_parallel(m.gate_up_proj, spans)
    _shard_adapters(m.gate_up_proj_adapter_list, spans)
    m.down_proj = _row_parallel(m.down_proj, rank * il, il)  # type: ignore[assignment]


def _shard_attention(a: PagedAttention, cfg: ModelConfig, rank: int, tp: int) -> None:
    D = cfg.head_dim
    hl = cfg.num_heads // tp
    k0, kl = local_kv_heads(cfg, rank, tp)
    _column_parallel(a.q_proj, [(rank * hl * D, hl * D)])
    _column_parallel(a.k_proj, [(k0 * D, kl * D)])
    _column_parallel(a.v_proj, [(k0 * D, kl * D)])
    a.o_proj = _row_parallel(a.o_proj, rank * hl * D, hl * D)  # type: ignore[assignment]
    a.num_heads, a.num_kv_heads = hl, kl


def _shard_mlp(m: MLP | GatedMLP | FalconH1MLP, rank: int, tp: int, reduce: bool = True) -> None:
    inter = m.up_proj.out_features
    il = inter // tp
    span = [(rank * il, il)]
    _column_parallel(m.up_proj, span)
    if isinstance(m, (GatedMLP, FalconH1MLP)):
        _column_parallel(m.gate_proj, span)
    if reduce:
        m.down_proj = _row_parallel(m.down_proj, rank * il, il)  # type: ignore[assignment]
    else:  # partial sums, summed by the caller (experts of an MoE layer have no bias)
        w = m.down_proj.weight.data[:, rank * il : (rank + 1) * il]
        m.down_proj.weight = _param(w)
        m.down_proj.in_features = il


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    return all_reduce_(t)


def _shard_routed_experts(m: MoE | JambaMoE, rank: int, tp: int) -> None:
    """Every routed expert split like an MLP, their weighted sum summed over the ranks once."""
    for e in m.experts:
        _shard_mlp(e, rank, tp, reduce=False)  # type: ignore[arg-type]
    m.routed_reduce = _sum_over_ranks


def _shard_moe(m: MoE, rank: int, tp: int) -> None:
    _shard_routed_experts(m, rank, tp)
    _shard_mlp(m.shared_experts, rank, tp)


def _shard_granite_moe(m: GraniteMoE, rank: int, tp: int) -> None:
    """Each expert's gate and up rows and output columns of this rank (the stacked ``[E, 2 * I,
    hidden]`` and ``[E, hidden, I]`` weights); the weighted sum of the experts summed over the
    ranks once."""
    inter = m.inter
    il = inter // tp
    w_in = m.input_linear.weight.data
    gate = w_in[:, rank * il : (rank + 1) * il]
    up = w_in[:, inter + rank * il : inter + (rank + 1) * il]
    m.input_linear.weight = _param(torch.cat([gate, up], dim=1))
    m.output_linear.weight = _param(m.output_linear.weight.data[:, :, rank * il : (rank + 1) * il])
    m.inter = il
    m.routed_reduce = _sum_over_ranks


def _shard_granite_shared_mlp(m: GraniteSharedMLP, rank: int, tp: int) -> None:
    inter = m.inter
    il = inter // tp
    _column_parallel(m.input_linear, [(rank * il, il), (inter + rank * il, il)])  # gate | up
    m.output_linear = _row_parallel(m.output_linear, rank * il, il)  # type: ignore[assignment]
    m.inter = il


def shard_model(model: nn.Module, cfg: ModelConfig, rank: int, tp: int, drop_head: bool = True) -> None:
    """Keeps rank `rank`'s slice of every weight of `model` (loaded whole) and puts in the
    sharded layers; `model` then computes with the other ranks' models what the whole model
    computes, the logits on rank 0 only (on every rank without `drop_head`)."""
    if tp == 1:
        return
    check_tensor_parallel(cfg, tp)
    todo: list[Callable[[], None]] = []
    in_moe = {id(e) for m in model.modules() if isinstance(m, MoE) for e in (*m.experts, m.shared_experts)}
    in_moe |= {id(e) for m in model.modules() if isinstance(m, JambaMoE) for e in m.experts}
    for mod in model.modules():
        if type(mod) in (Mamba2Mixer, FalconH1Mixer):
            todo.append(lambda mod=mod: _shard_mamba(mod, cfg, rank, tp))  # type: ignore[misc]
        elif type(mod) is PagedAttention:
            todo.append(lambda mod=mod: _shard_attention(mod, cfg, rank, tp))  # type: ignore[misc]
        elif type(mod) is MoE:
            todo.append(lambda mod=mod: _shard_moe(mod, rank, tp))  # type: ignore[misc]
        elif type(mod) in (MLP, GatedMLP, FalconH1MLP) and id(mod) not in in_moe:
            todo.append(lambda mod=mod: _shard_mlp(mod, rank, tp))  # type: ignore[misc]
        elif type(mod) is GraniteMoE:
            todo.append(lambda mod=mod: _shard_granite_moe(mod, rank, tp))  # type: ignore[misc]
        elif type(mod) is GraniteSharedMLP:
            todo.append(lambda mod=mod: _shard_granite_shared_mlp(mod, rank, tp))  # type: ignore[misc]
        elif type(mod) is Mamba1Mixer:
            todo.append(lambda mod=mod: _shard_mamba1(mod, rank, tp))  # type: ignore[misc]
        elif type(mod) is JambaMoE:
            todo.append(lambda mod=mod: _shard_routed_experts(mod, rank, tp))  # type: ignore[misc]
        elif type(mod) is Zamba2Attention:
            todo.append(lambda mod=mod: _shard_zamba2_attention(mod, cfg, rank, tp))  # type: ignore[misc]
        elif type(mod) is Zamba2MLP:
            todo.append(lambda mod=mod: _shard_zamba2_mlp(mod, rank, tp))  # type: ignore[misc]
    for f in todo:
        f()
    if drop_head and rank != 0 and isinstance(getattr(model, "lm_head", None), nn.Module):
        model.lm_head = _NoLogits()


__all__ = [
    "FLAG",
    "RowParallelLinear",
    "SplitGroupGatedRMSNorm",
    "check_tensor_parallel",
    "local_config",
    "shard_model",
]
