"""A step of a whole model in one call of the C++ CPU library (``hs_decode_step``,
kernels/csrc/cpu/cpu_decode_step.cpp), the native step: decode rows (one new token, or one
verifying its drafts, every token's logits) and prefill rows (a prompt's chunk from zeros or from
a kept state, with the checkpoints it emits; the logits of the tokens in `logits_indices`), alone
or together.

At batch 1 a small model's forward as torch ops is some 450 dispatches of a few microseconds
each, around a few microseconds of arithmetic per layer; this is one ctypes call. The mixers run
the library's own kernels (the Mamba2 recurrence, paged attention, the norms), so states, K / V
and norms are computed as on the per-op path (whose prefill rows' attention is SDPA, to
rounding); the projections are the library's matrix-vector products, which agree with torch's
GEMMs to rounding (tests/model/test_decode_step.py compares the two in float64 and float32).

`DecodeStep.for_model` builds its records once (one per residual block ``x + mixer(norm(x))``)
from a model whose every part it knows: Nemotron-H (Mamba2, attention, non-gated MLP layers;
no MoE), Mamba2, and Bamba (Mamba2 or rotary attention, then a gated MLP); float32 or float64;
one process (a tensor-parallel shard has other modules and is refused). It returns None for any
other model. `run` returns None, having written nothing, for a step it does not take: more
tokens than `max_tokens`, prefill rows of more work than `max_prefill_macs` (there the forward is
faster), rows sharing a state slot, an emit outside its row, or weights that changed since the
records were built (the caller then runs the model's forward). A token's arithmetic does not
depend on the other tokens of the step, so a verified token gets exactly the logits it gets
decoded alone, and a prompt the same bits in one step or in chunks, in float32 too.

`launch` runs the same step on the library's one background thread and returns at once; the
caller waits for it (`PendingDecode.wait`) before it reads or writes the caches again. The
engine's overlapped steps build the previous step's outputs meanwhile (engine/llm_engine.py).

A step's output arrays are lent to that step alone; a caller that has read them and keeps no
view of them gives them back (`recycle`) for a later step to write, so that steps allocate
nothing.
"""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from hybridserve.kernels import native
from hybridserve.model.cache_tensors import ModelCaches
from hybridserve.model.layers.attention import PagedAttention
from hybridserve.model.layers.mamba2 import Mamba2Mixer
from hybridserve.model.layers.mlp import MLP, GatedMLP, _ReLU2
from hybridserve.model.layers.norm import GatedRMSNorm, RMSNorm
from hybridserve.model.model_config import ATTENTION, MAMBA
from hybridserve.model.model_config import MLP as MLP_KIND

# The record layout of cpu_decode_step.cpp (kFields int64 and kDoubles doubles per layer).
_FIELDS = 24
_DOUBLES = 4
_KIND = {MAMBA: 0, ATTENTION: 1, MLP_KIND: 2}
_ACT = {_ReLU2: 0, nn.SiLU: 1, nn.ReLU: 2}

# The projections' multiply-adds of a step above which the model's forward runs it: the library's
# products reach about 70% of torch's GEMM rate on a wide layer, which at small batch the
# per-op path's fixed cost (hundreds of dispatches) more than makes up for. Measured on one thread
# (benches/README.md "Per-step overhead"): on an 89M-parameter checkpoint the native step wins at
# 8 rows and loses at 32 (crossover about 16 rows; 2^30 / 88M = 12 here); on the 1M-parameter
# demo model it wins at every batch the scheduler makes.
MAX_STEP_MACS = 1 << 30

# A step with prefill rows runs here only while its prefill rows' projection and attention
# multiply-adds stay under this. Per multiply-add the library's products and its exact-softmax
# attention are slower than torch's GEMMs and SDPA over a long prompt (both about 1.7e-8 s more
# per multiply-add on one thread), while the per-op forward's fixed cost (its dispatches) is some
# 2-2.5 ms: measured on the demo model, 16 to 192 new tokens after 0, 1500 and 2600 cached ones
# (benches/README.md "Native prefill steps"), the native step was faster up to about this much.
MAX_PREFILL_MACS = 1 << 27


# A decoder layer as the residual blocks ``x + mixer(norm(x))`` it is made of: (cache index, kind,
# norm, mixer) each, or _Refused for a layer of another shape.
_Block = tuple[int, str, nn.Module, nn.Module]


def _nemotron_h_blocks(i: int, layer: nn.Module) -> list[_Block]:
    from hybridserve.model.architectures.nemotron_h import NemotronHBlock

    if type(layer) is not NemotronHBlock or layer.kind not in _KIND:
        raise _Refused(f"layer {i} ({getattr(layer, 'kind', type(layer).__name__)})")
    return [(i, layer.kind, layer.norm, layer.mixer)]


def _mamba2_blocks(i: int, layer: nn.Module) -> list[_Block]:
    from hybridserve.model.architectures.mamba2 import Mamba2Block

    if type(layer) is not Mamba2Block:
        raise _Refused(f"layer {i} ({type(layer).__name__})")
    return [(i, MAMBA, layer.norm, layer.mixer)]


def _bamba_blocks(i: int, layer: nn.Module) -> list[_Block]:
    from hybridserve.model.architectures.bamba import BambaLayer

    if type(layer) is not BambaLayer:
        raise _Refused(f"layer {i} ({type(layer).__name__})")
    mixer = layer.mamba if layer.kind == MAMBA else layer.self_attn
    return [
        (i, layer.kind, layer.input_layernorm, mixer),
        (i, MLP_KIND, layer.pre_ff_layernorm, layer.feed_forward),
    ]


def _blocks_of() -> dict[type, Any]:
    """The families the decode step runs (their embedding, final norm and LM head are the plain
    ones of StackedCausalLM, in float32 and float64), with their layers' blocks."""
    from hybridserve.model.architectures.bamba import BambaForCausalLM
    from hybridserve.model.architectures.mamba2 import Mamba2ForCausalLM
    from hybridserve.model.architectures.nemotron_h import NemotronHForCausalLM

    return {
        NemotronHForCausalLM: _nemotron_h_blocks,
        Mamba2ForCausalLM: _mamba2_blocks,
        BambaForCausalLM: _bamba_blocks,
    }


def enabled() -> bool:
    return native.env_switch("HYBRIDSERVE_DECODE_STEP")


_VERSION = operator.attrgetter("_version")  # a tensor's in-place write counter


def _ptr(a: np.ndarray) -> int:
    """The address of an int64 array's first element (the scheduler's arrays are C-contiguous
    int64; anything else is a bug upstream, not a step to run)."""
    if a.dtype != np.int64 or not a.flags.c_contiguous:
        raise ValueError(f"decode step: an array of {a.dtype} (contiguous: {a.flags.c_contiguous})")
    return int(a.ctypes.data)


class DecodeOutput(NamedTuple):
    """A decode step's logits ``[tokens, vocab]`` (float32, float64 for a float64 model), each
    token's argmax (int64: the first of equal maxima, as torch.argmax) and whether all its logits
    are finite (bool)."""

    logits: torch.Tensor
    greedy: np.ndarray
    finite: np.ndarray


class _Buffers:
    """The output arrays of steps of up to `capacity` tokens, with their addresses: lent to one
    step at a time and taken back once its caller has read them (`DecodeStep.recycle`), so that
    a step allocates nothing (a fresh [tokens, vocab] tensor cost 10-40 µs after a forward had
    emptied the caches, on the path from one step to the next)."""

    __slots__ = ("logits", "greedy", "finite", "addresses", "capacity")

    def __init__(self, capacity: int, vocab: int, dtype: torch.dtype) -> None:
        self.capacity = capacity
        self.logits = torch.empty((capacity, vocab), dtype=dtype)
        self.greedy = np.empty(capacity, dtype=np.int64)
        self.finite = np.empty(capacity, dtype=np.bool_)
        self.addresses = (self.logits.data_ptr(), int(self.greedy.ctypes.data), int(self.finite.ctypes.data))

    def view(self, num_tokens: int) -> DecodeOutput:
        return DecodeOutput(self.logits[:num_tokens], self.greedy[:num_tokens], self.finite[:num_tokens])


# Output buffers lent out at once; past this, those never given back (a step that failed before
# its caller read it) are forgotten.
_MAX_LENT = 4


class _Refused(Exception):
    """A part of the model the fused step does not know (the model keeps its forward)."""


class DecodeStep:
    def __init__(
        self,
        model: nn.Module,
        caches: ModelCaches,
        max_tokens: int | None = None,
        max_prefill_macs: int | None = MAX_PREFILL_MACS,
    ) -> None:
        """Raises _Refused for a model it cannot run (`for_model` turns that into None)."""
        from hybridserve.model.architectures.base import StackedCausalLM

        if type(model) not in _blocks_of() or not isinstance(model, StackedCausalLM):
            raise _Refused(f"{type(model).__name__} is not a family the decode step runs")
        dtype: torch.dtype = model.dtype
        if dtype not in (torch.float32, torch.float64):
            raise _Refused(f"dtype {dtype}")
        lib = native.library()
        if lib is None:
            raise _Refused("no native CPU library")
        suffix = "f32" if dtype == torch.float32 else "f64"
        self.fn = getattr(lib, f"hs_decode_step_{suffix}")
        self.launch_fn = getattr(lib, f"hs_decode_step_launch_{suffix}")
        self.wait_fn = lib.hs_decode_step_wait
        self.dtype = dtype
        self.caches = caches  # the records point into its tensors: held while they are used
        self.vocab = int(model.config.vocab_size)
        self.hidden = int(model.config.hidden_size)
        self._watch: list[torch.Tensor] = []  # every tensor the records point to
        self._keep: list[torch.Tensor] = []  # derived tensors (A) the records point to
        stack = model.stack()
        blocks = [b for i, layer in enumerate(stack.layers) for b in _blocks_of()[type(model)](i, layer)]
        rec = np.zeros((max(1, len(blocks)), _FIELDS), dtype=np.int64)
        dbl = np.zeros((max(1, len(blocks)), _DOUBLES), dtype=np.float64)
        for j, (i, kind, norm, mixer) in enumerate(blocks):
            rec[j, 0] = _KIND[kind]
            rec[j, 1] = self._norm(norm)
            dbl[j, 0] = float(norm.eps)
            if kind == MAMBA:
                self._mamba(mixer, caches, i, rec[j], dbl[j])
            elif kind == ATTENTION:
                self._attention(mixer, caches, i, rec[j], dbl[j])
            else:
                self._mlp(mixer, rec[j])
        self.final_norm = self._norm(stack.output_norm)
        self.final_eps = float(stack.output_norm.eps)
        self.embed = self._weight(stack.token_embedding.weight, (self.vocab, self.hidden))
        self.lm_head = self._linear(model.lm_head, self.hidden, self.vocab, bias=False)[0]
        self.num_layers = len(blocks)  # records: residual blocks
        macs = sum(int(np.prod(t.shape)) for t in self._watch if t.dim() == 2) - self.vocab * self.hidden
        self.max_tokens = max_tokens if max_tokens is not None else max(1, MAX_STEP_MACS // max(1, macs))
        # a prefill row's work: its tokens' projections, and per (query token, key) pair the
        # scores and values of every attention layer's heads
        self.macs_per_token = macs
        self.macs_per_pair = sum(
            2 * int(r[12]) * int(r[14]) for r in rec[: len(blocks)] if r[0] == _KIND[ATTENTION]
        )
        self.max_prefill_macs = max_prefill_macs
        self.records = rec
        self.doubles = dbl
        self._versions = self._current_versions()
        # the arguments every step passes first: the records, the sizes, the shared weights
        self._head = (
            rec.ctypes.data, dbl.ctypes.data, self.num_layers, self.hidden, self.vocab, self.embed, self.final_norm,
            self.final_eps, self.lm_head,
        )  # fmt: skip
        self._lent: list[_Buffers] = []
        self._spare: list[_Buffers] = []

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        caches: ModelCaches,
        max_tokens: int | None = None,
        max_prefill_macs: int | None = MAX_PREFILL_MACS,
    ) -> DecodeStep | None:
        """The fused step of `model` over `caches`, or None when it does not run this model here
        (or ``HYBRIDSERVE_DECODE_STEP=0`` turns it off). `max_tokens`: the most tokens of a step it
        takes (default: as many as keep the projections' work under MAX_STEP_MACS);
        `max_prefill_macs`: the most work of a step's prefill rows (None: no limit)."""
        if (max_tokens is not None and max_tokens <= 0) or not enabled():
            return None
        try:
            return cls(model, caches, max_tokens, max_prefill_macs)
        except _Refused:
            return None

    # --- the records ---
    def _weight(self, t: torch.Tensor | None, shape: tuple[int, ...]) -> int:
        if t is None:
            raise _Refused("a missing weight")
        if not t.is_cpu or t.dtype != self.dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise _Refused(f"a weight of shape {tuple(t.shape)}, {t.dtype} (wanted {shape}, {self.dtype})")
        self._watch.append(t)
        return t.data_ptr()

    def _linear(self, lin: nn.Module, n_in: int, n_out: int, bias: bool | None = None) -> tuple[int, int]:
        """(weight, bias or 0) of an nn.Linear of these sizes; `bias` False requires none."""
        if type(lin) is not nn.Linear:
            raise _Refused(f"{type(lin).__name__} is not an nn.Linear")
        assert isinstance(lin, nn.Linear)
        w = self._weight(lin.weight, (n_out, n_in))
        if lin.bias is None:
            return w, 0
        if bias is False:
            raise _Refused("a bias where the model has none")
        return w, self._weight(lin.bias, (n_out,))

    def _norm(self, norm: nn.Module) -> int:
        if type(norm) is not RMSNorm:
            raise _Refused(f"{type(norm).__name__} is not an RMSNorm")
        assert isinstance(norm, RMSNorm)
        return self._weight(norm.weight, (self.hidden,))

    def _cache(self, t: torch.Tensor) -> int:
        if not t.is_cpu or t.dtype != self.dtype or not t.is_contiguous():
            raise _Refused(f"a cache of {t.dtype} (the model is {self.dtype})")
        return t.data_ptr()

    def _mamba(self, m: nn.Module, caches: ModelCaches, i: int, rec: np.ndarray, dbl: np.ndarray) -> None:
        if type(m) is not Mamba2Mixer or type(m.norm) is not GatedRMSNorm:
            raise _Refused(f"layer {i}: {type(m).__name__}")
        assert isinstance(m, Mamba2Mixer)
        H, P, G, N = m.nheads, m.headdim, m.ngroups, m.dstate
        d_inner, conv_dim = m.d_inner, m.conv_dim
        if d_inner != H * P or conv_dim != d_inner + 2 * G * N:
            raise _Refused(f"layer {i}: Mamba sizes")
        if not (math.isfinite(m.dt_min) and m.dt_min >= 0.0 and (m.dt_max == math.inf or 0.0 <= m.dt_max)):
            raise _Refused(f"layer {i}: dt limits")
        conv, ssm = caches.conv[i], caches.ssm[i]
        W = int(m.conv1d.weight.shape[-1])
        if tuple(conv.shape[1:]) != (conv_dim, W - 1) or tuple(ssm.shape[1:]) != (H, P, N):
            raise _Refused(f"layer {i}: state shapes")
        rec[2], rec[3] = self._linear(m.in_proj, self.hidden, d_inner + conv_dim + H)
        _, A = m._constants(ssm.dtype)
        rec[4] = self._weight(m.conv1d.weight, (conv_dim, 1, W))  # [conv_dim, W] in memory
        rec[5] = 0 if m.conv1d.bias is None else self._weight(m.conv1d.bias, (conv_dim,))
        A = A.contiguous()
        self._keep.append(A)
        rec[6] = A.data_ptr()
        rec[7] = self._weight(m.D, (H,))
        rec[8] = self._weight(m.dt_bias, (H,))
        rec[9] = self._weight(m.norm.weight, (d_inner,))
        rec[10], rec[11] = self._linear(m.out_proj, d_inner, self.hidden)
        rec[12], rec[13] = self._cache(conv), conv.shape[0]
        rec[14], rec[15] = self._cache(ssm), ssm.shape[0]
        rec[16:23] = (H, P, G, N, W, int(m.activation is not None), m.norm.group_size)
        self._watch.append(m.A_log)  # A is derived from it
        dbl[1] = float(m.norm.eps)
        dbl[2] = float(m.dt_min)
        dbl[3] = float(m.dt_max) if math.isfinite(m.dt_max) else -1.0

    def _attention(self, a: nn.Module, caches: ModelCaches, i: int, rec: np.ndarray, dbl: np.ndarray) -> None:
        if type(a) is not PagedAttention:
            raise _Refused(f"layer {i}: {type(a).__name__}")
        assert isinstance(a, PagedAttention)
        if a.rotary_dim % 2 != 0 or a.rotary_dim > a.head_dim:
            raise _Refused(f"layer {i}: rotary dimension {a.rotary_dim}")
        H, KVH, D = a.num_heads, a.num_kv_heads, a.head_dim
        kv = caches.kv[i]
        if H % KVH != 0 or tuple(kv.shape[1:]) != (2, kv.shape[2], KVH, D):
            raise _Refused(f"layer {i}: attention sizes")
        rec[2], rec[3] = self._linear(a.q_proj, self.hidden, H * D)
        rec[4], rec[5] = self._linear(a.k_proj, self.hidden, KVH * D)
        rec[6], rec[7] = self._linear(a.v_proj, self.hidden, KVH * D)
        rec[8], rec[9] = self._linear(a.o_proj, H * D, self.hidden)
        rec[10], rec[11] = self._cache(kv), kv.shape[0]
        rec[12:17] = (H, KVH, D, kv.shape[2], a.rotary_dim)
        dbl[1] = float(a.scale)
        dbl[2] = float(a.rope_theta)

    def _mlp(self, m: nn.Module, rec: np.ndarray) -> None:
        if type(m) not in (MLP, GatedMLP) or type(m.act) not in _ACT:
            raise _Refused(f"{type(m).__name__} with {type(getattr(m, 'act', None)).__name__}")
        assert isinstance(m, (MLP, GatedMLP))
        inter = int(m.up_proj.weight.shape[0])
        rec[2], rec[3] = self._linear(m.up_proj, self.hidden, inter)
        rec[4], rec[5] = self._linear(m.down_proj, inter, self.hidden)
        rec[6], rec[7] = inter, _ACT[type(m.act)]
        if isinstance(m, GatedMLP):
            rec[8], rec[9] = self._linear(m.gate_proj, self.hidden, inter)

    def _current_versions(self) -> tuple[int, ...]:
        return tuple(map(_VERSION, self._watch))

    def weights_unchanged(self) -> bool:
        """Whether no weight the records point to was written in place since they were built
        (each step checks this unless its caller did: `launch(out, weights_checked=True)`)."""
        return self._current_versions() == self._versions

    # --- output buffers ---
    def _lend(self, num_tokens: int) -> _Buffers:
        fits = [b for b in self._spare if b.capacity >= num_tokens]
        if fits:
            b = min(fits, key=operator.attrgetter("capacity"))
            self._spare.remove(b)
        else:
            if len(self._lent) >= _MAX_LENT:
                self._lent.clear()
            # rounded up to a power of two (batches shrink and grow by a few rows at a time)
            capacity = max(num_tokens, min(1 << (num_tokens - 1).bit_length(), self.max_tokens))
            b = _Buffers(capacity, self.vocab, self.dtype)
        self._lent.append(b)
        return b

    def recycle(self, output: DecodeOutput) -> None:
        """Gives back the arrays of a step's output (from `run`, or `PendingDecode.wait`) once the
        caller has read them and keeps no view of them: a later step writes them. Anything else
        is ignored."""
        base = output.greedy.base
        for i, b in enumerate(self._lent):
            if b.greedy is base:
                self._spare.append(self._lent.pop(i))
                return

    # --- a step ---
    def run(self, out: Any) -> DecodeOutput | None:
        """The logits of the tokens in `logits_indices` of a step given as the scheduler's output
        (its numpy arrays: input_ids, positions, slot_mapping, block_table, state_read_slot,
        state_write_slots, query_start_loc, logits_indices, has_initial_state, emit_row,
        emit_token, emit_slot; `num_decodes`), or None, with nothing written, when the step is
        not one this runs."""
        call = self.prepare(out)
        if call is None:
            return None
        got = call.result(self.fn(*call.args))
        if got is None:
            self.recycle(call.output)
        return got

    def _takes_prefill(self, out: Any, num_decodes: int) -> bool:
        """Whether the prefill rows of a step (rows `num_decodes` on) are little enough work that
        this runs them faster than the model's forward (`max_prefill_macs`)."""
        if self.max_prefill_macs is None:
            return True
        qsl = np.asarray(out.query_start_loc)[num_decodes:]
        n = qsl[1:] - qsl[:-1]
        if (n < 1).any():
            return False  # (not a step's layout: the forward reports it)
        first = np.asarray(out.positions)[qsl[:-1]]  # each row's first position: its cached tokens
        pairs = int((n * first).sum() + (n * (n + 1) // 2).sum())
        return int(n.sum()) * self.macs_per_token + pairs * self.macs_per_pair <= self.max_prefill_macs

    def launch(self, out: Any, weights_checked: bool = False) -> PendingDecode | None:
        """The same step run on the native library's background thread: returns at once with
        the step running, or None, with nothing written or started, when `run` would return None
        or another step is already running there (the caller then runs this one itself).
        `weights_checked`: the caller has seen `weights_unchanged()` true since the weights
        could last have been written (the check then stays off the path between two steps)."""
        call = self.prepare(out, weights_checked)
        return None if call is None else self.post(call)

    def post(self, call: NativeCall) -> PendingDecode | None:
        """Starts a prepared step (`prepare`) on the background thread: as `launch`. The arrays
        it points into may have been written since it was prepared, not reallocated."""
        rc = self.launch_fn(*call.args)
        if rc != 0:
            if rc != 6:  # (6: busy) the checks made before anything was posted: raises, or None
                call.result(rc)
            self.recycle(call.output)
            return None
        return PendingDecode(call, self.wait_fn)

    def prepare(self, out: Any, weights_checked: bool = False) -> NativeCall | None:
        """The native arguments of a step (`run` and `launch` call this), with an output buffer
        lent to it (given back by `recycle(call.output)` if it never runs), or None for a step
        this does not run. For a step planned ahead this runs while the step before computes;
        its input tokens are written into the same arrays before `post`."""
        layout = getattr(out, "step_layout", None)
        # the scheduler's output: its layout checked and its addresses in one call (it holds the
        # arrays); any other object holding the same arrays: read here, and held
        lay, held = (layout(), out) if layout is not None else _step_layout(out)
        if lay is None:
            return None  # not the layout of a step (the forward reports it)
        T, R, num_decodes, num_logits, num_emits, bt_stride, ws_stride = lay[:7]
        p_ids, p_pos, p_slots, p_bt, p_rs, p_ws, p_qsl, p_li, p_init, p_erow, p_etok, p_eslot = lay[7:]
        if T > self.max_tokens or (num_decodes < R and not self._takes_prefill(out, num_decodes)):
            return None
        if not weights_checked and not self.weights_unchanged():
            return None  # weights changed in place: the model's forward reads them as they are
        buffers = self._lend(max(1, num_logits))
        p_logits, p_greedy, p_finite = buffers.addresses
        args = (
            *self._head, p_ids, p_pos, p_slots, p_bt, bt_stride, p_rs, p_ws, ws_stride, p_qsl, p_li, R,
            num_decodes, p_init, p_erow, p_etok, p_eslot, num_emits, num_logits, p_logits, p_greedy, p_finite,
            native.threads(),
        )  # fmt: skip
        return NativeCall(args, buffers.view(num_logits), held, (R, T, self.num_layers))


def _step_layout(out: Any) -> tuple[list[int] | None, tuple[np.ndarray, ...]]:
    """`SchedulerOutput.step_layout` of any other object holding the scheduler output's arrays
    (int64, C-contiguous; `has_initial_state` and the emits may be left out: a step of decode
    rows), and the arrays it read (a getter may return a fresh one each time)."""
    ids, qsl = out.input_ids, out.query_start_loc
    T, R, num_decodes = len(ids), len(qsl) - 1, int(out.num_decodes)
    if R <= 0 or int(qsl[R]) != T or not 0 <= num_decodes <= R:
        return None, ()
    pos, slots, bt, rs, ws, li = (
        out.positions, out.slot_mapping, out.block_table, out.state_read_slot, out.state_write_slots,
        out.logits_indices,
    )  # fmt: skip
    empty = np.zeros(0, dtype=np.int64)
    init = np.ascontiguousarray(
        getattr(out, "has_initial_state", np.zeros(R, dtype=np.bool_)), dtype=np.bool_
    )
    erow, etok, eslot = (getattr(out, name, empty) for name in ("emit_row", "emit_token", "emit_slot"))
    if len(pos) != T or len(slots) != T or len(rs) != R or len(init) != R:
        return None, ()
    if bt.ndim != 2 or bt.shape[0] != R or ws.ndim != 2 or ws.shape[0] != R:
        return None, ()
    if not len(erow) == len(etok) == len(eslot):
        return None, ()
    arrays = (ids, pos, slots, bt, rs, ws, qsl, li)
    emits = (erow, etok, eslot)
    layout = [T, R, num_decodes, len(li), len(erow), bt.shape[1], ws.shape[1], *map(_ptr, arrays)]
    layout += [int(init.ctypes.data), *map(_ptr, emits)]
    return layout, (*arrays, init, *emits)


class NativeCall(NamedTuple):
    """One decode step's native arguments, the output they write, what holds the arrays they
    point into (held until the step has run), and its (rows, tokens, layers) for messages."""

    args: tuple[Any, ...]
    output: DecodeOutput
    arrays: Any
    sizes: tuple[int, int, int]

    @property
    def shapes(self) -> str:
        return "{} rows, {} tokens, {} layers".format(*self.sizes)

    def result(self, rc: int) -> DecodeOutput | None:
        if rc == 0:
            return self.output
        if rc == 3:
            return None
        if rc == 5:
            raise RuntimeError("decode step: a kernel failed after the caches were written")
        native._check_rc("decode_step", rc, self.shapes)
        return None


class PendingDecode:
    """A decode step running on the native library's background thread (`DecodeStep.launch`).
    `wait` must be called, once, before the caches it writes are read or written again."""

    def __init__(self, call: NativeCall, wait_fn: Any) -> None:
        self._call: NativeCall | None = call
        self._wait_fn = wait_fn

    def __del__(self) -> None:
        # never waited for (an error between launch and wait): the step must still end before
        # the arrays it points into go, and the background thread must be free for the next
        if getattr(self, "_call", None) is not None:
            self._wait_fn()
            self._call = None

    def wait(self) -> DecodeOutput:
        call = self._call
        if call is None:
            raise RuntimeError("decode step: waited for twice")
        rc = int(self._wait_fn())
        # cleared only once the step has ended: an interrupt before this line leaves the wait
        # to __del__, so the step never outlives the arrays it reads
        self._call = None
        got = call.result(rc)
        if got is None:  # (the checks that return 3 ran before the step was posted)
            raise RuntimeError(f"decode step: the background step returned {rc}")
        return got
