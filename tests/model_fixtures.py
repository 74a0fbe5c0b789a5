"""Shared helpers of the model tests: tiny random HF checkpoints and a test-side driver that builds
ForwardBatch objects by hand (contiguous block tables, fixed state windows) — a mini scheduler with
chunked prefill, mixed prefill/decode batches and multi-token (verify-like) decode rows."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridserve.model.batch import ForwardBatch
from hybridserve.model.cache_tensors import ModelCaches
from hybridserve.model.loader import LoadedModel

# ------------------------------------------------------------------------------------------------
# tiny HF checkpoints
# ------------------------------------------------------------------------------------------------


def _scale_weights(model: torch.nn.Module, seed: int) -> None:
    """Re-draw the weights with larger scales than HF's init (0.02), so that next-token
    distributions are peaked and greedy argmax has clear margins."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 7 + 1))
            elif name.endswith("dt_bias"):
                dt = torch.exp(
                    torch.rand(p.shape, generator=gen) * (math.log(0.2) - math.log(0.01)) + math.log(0.01)
                )
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith(".D"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + 1.0)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("lm_head.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif p.dim() >= 2:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


NEMOTRON_H_CONFIGS = {
    # ngroups > 1, headdim 12 (not a power of two), chunk 8, GQA 4/2, all four layer kinds
    "nh_g2_moe": dict(
        layers_block_type=["linear_attention", "full_attention", "mlp", "moe"],
        hidden_size=32,
        mamba_num_heads=4,
        mamba_head_dim=12,
        ssm_state_size=8,
        n_groups=2,
        chunk_size=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24,
        n_group=2,
        topk_group=1,
    ),  # fmt: skip
    # ngroups 1, two Mamba layers, MHA, chunk 16; projection biases (use_bias: transformers writes
    # mamba_proj_bias false beside it and reads only use_bias), tie_word_embeddings true (which
    # transformers' NemotronH does not honour: it saves lm_head.weight and uses it)
    "nh_g1": dict(
        layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention"],
        hidden_size=48,
        mamba_num_heads=6,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=1,
        chunk_size=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=12,
        intermediate_size=64,
        conv_kernel=3,
        use_bias=True,
        tie_word_embeddings=True,
    ),  # fmt: skip
}

BAMBA_CONFIGS = {
    "bamba_g1": dict(
        hidden_size=32,
        num_hidden_layers=3,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
    ),  # fmt: skip
    "bamba_g2": dict(
        hidden_size=48,
        num_hidden_layers=3,
        attn_layer_indices=[0, 2],
        mamba_n_heads=8,
        mamba_d_head=12,
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_chunk_size=16,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=40,
        mamba_expand=2,
    ),  # fmt: skip
}

MAMBA2_CONFIGS = {
    "m2_g2": dict(
        hidden_size=36,
        num_hidden_layers=2,
        num_heads=6,
        head_dim=12,
        state_size=8,
        n_groups=2,
        chunk_size=8,
        expand=2,
    ),  # fmt: skip
}

GRANITE_CONFIGS = {
    # MoE (4 experts, top-2) + shared MLP, RoPE, ngroups 2, GQA 4/2, every multiplier away from 1
    "gr_moe_rope": dict(
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        hidden_size=32,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_chunk_size=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=16,
        shared_intermediate_size=24,
        num_local_experts=4,
        num_experts_per_tok=2,
        position_embedding_type="rope",
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        logits_scaling=3.0,
    ),  # fmt: skip
    # dense (no experts: the shared MLP alone), no rotary embedding, odd head dims (Mamba 9,
    # attention 9), ngroups 4, GQA 4/1, conv width 3, chunk 16
    "gr_dense_odd": dict(
        num_hidden_layers=4,
        layer_types=["attention", "mamba", "mamba", "attention"],
        hidden_size=36,
        mamba_n_heads=8,
        mamba_d_head=9,
        mamba_d_state=8,
        mamba_n_groups=4,
        mamba_d_conv=3,
        mamba_chunk_size=16,
        num_attention_heads=4,
        num_key_value_heads=1,
        shared_intermediate_size=40,
        num_local_experts=0,
        position_embedding_type="nope",
        embedding_multiplier=1.5,
        residual_multiplier=0.8,
        attention_multiplier=0.25,
        logits_scaling=1.5,
    ),  # fmt: skip
    # MoE top-1 of 3 without a shared MLP (shared_intermediate_size 0), MHA, RoPE theta 500,
    # ngroups 1, Mamba projection biases, tied embeddings
    "gr_top1_noshared": dict(
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        hidden_size=24,
        mamba_n_heads=3,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_chunk_size=8,
        mamba_proj_bias=True,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=20,
        shared_intermediate_size=0,
        num_local_experts=3,
        num_experts_per_tok=1,
        position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        tie_word_embeddings=True,
        logits_scaling=0.5,
    ),  # fmt: skip
}

FALCON_H1_CONFIGS = {
    # GQA 4/2, ngroups 2, the Mamba norm before the gate (the released models' setting), biases on
    # the Mamba projections, every muP multiplier away from 1
    "fh_gqa_norm": dict(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_ssm=48,
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_chunk_size=8,
        mamba_rms_norm=True,
        mamba_proj_bias=True,
        projectors_bias=True,
        intermediate_size=40,
        embedding_multiplier=1.5,
        lm_head_multiplier=0.7,
        key_multiplier=0.6,
        attention_in_multiplier=1.3,
        attention_out_multiplier=0.8,
        ssm_in_multiplier=0.9,
        ssm_out_multiplier=1.2,
        ssm_multipliers=[0.8, 1.25, 0.7, 1.4, 0.9],
        mlp_multipliers=[1.2, 0.75],
    ),  # fmt: skip
    # no Mamba norm (y * silu(z)), odd Mamba head dim 9, ngroups 4, GQA 6/1, conv width 3,
    # chunk 16, RoPE theta 500, tied embeddings
    "fh_odd_nonorm": dict(
        num_hidden_layers=3,
        hidden_size=36,
        num_attention_heads=6,
        num_key_value_heads=1,
        mamba_n_heads=8,
        mamba_d_ssm=72,
        mamba_d_head=9,
        mamba_d_state=8,
        mamba_n_groups=4,
        mamba_d_conv=3,
        mamba_chunk_size=16,
        mamba_rms_norm=False,
        intermediate_size=32,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        tie_word_embeddings=True,
        key_multiplier=1.4,
        ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3],
        mlp_multipliers=[0.9, 1.1],
    ),  # fmt: skip
    # the Mamba norm after the gate, ngroups 1, MHA, mamba_d_ssm from mamba_expand, attention and
    # MLP biases
    "fh_gate_norm_mha": dict(
        num_hidden_layers=2,
        hidden_size=24,
        num_attention_heads=2,
        num_key_value_heads=2,
        mamba_n_heads=3,
        mamba_d_ssm=None,
        mamba_expand=2,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_chunk_size=8,
        mamba_rms_norm=True,
        mamba_norm_before_gate=False,
        attention_bias=True,
        mlp_bias=True,
        intermediate_size=20,
        embedding_multiplier=2.0,
        attention_out_multiplier=0.5,
    ),  # fmt: skip
}

ZAMBA2_CONFIGS = {
    # two shared blocks alternating over three uses, attention adapters, RoPE on the shared
    # attention, ngroups 2, biases (add_bias_linear), tied embeddings (the blocks shared)
    "z2_two_blocks": dict(
        num_hidden_layers=6,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba"],
        hidden_size=32,
        n_mamba_heads=4,
        mamba_d_state=8,
        mamba_ngroups=2,
        chunk_size=8,
        num_attention_heads=4,
        num_mem_blocks=2,
        use_shared_attention_adapter=True,
        adapter_rank=4,
        use_mem_rope=True,
        intermediate_size=40,
        add_bias_linear=True,
    ),  # fmt: skip
    # one shared block used twice (the first layer a use), no attention adapters, no rotary
    # embedding, GQA 4/2 (head size 12), ngroups 1, conv width 3, chunk 16, silu, untied
    # embeddings (transformers 5 then gives every use its own block weights)
    "z2_gqa_nope": dict(
        num_hidden_layers=5,
        layers_block_type=["hybrid", "mamba", "mamba", "hybrid", "mamba"],
        hidden_size=24,
        n_mamba_heads=3,
        mamba_d_state=16,
        mamba_ngroups=1,
        mamba_d_conv=3,
        chunk_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_mem_blocks=1,
        adapter_rank=3,
        intermediate_size=20,
        hidden_act="silu",
        tie_word_embeddings=False,
    ),  # fmt: skip
}

JAMBA_CONFIGS = {
    # attention every other layer (GQA 4/2), MoE of 4 experts top-2 in the other layers, dt rank
    # 4, state 8, conv bias
    "jb_moe_gqa": dict(
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=0,
        mamba_d_state=8,
        mamba_dt_rank=4,
    ),  # fmt: skip
    # Mamba layers first and last, one attention layer (head size 12, no GQA), MoE of 3 experts
    # top-1 in every third layer, expand 3 (odd channel count 72), state 16, conv width 3, no conv
    # bias, dt rank "auto" (2)
    "jb_odd_top1": dict(
        num_hidden_layers=5,
        hidden_size=24,
        intermediate_size=20,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=3,
        num_experts_per_tok=1,
        attn_layer_period=4,
        attn_layer_offset=2,
        expert_layer_period=3,
        expert_layer_offset=1,
        mamba_d_state=16,
        mamba_d_conv=3,
        mamba_expand=3,
        mamba_conv_bias=False,
    ),  # fmt: skip
}

ALL_CONFIGS = {
    **{k: ("nemotron_h", v) for k, v in NEMOTRON_H_CONFIGS.items()},
    **{k: ("bamba", v) for k, v in BAMBA_CONFIGS.items()},
    **{k: ("mamba2", v) for k, v in MAMBA2_CONFIGS.items()},
    **{k: ("granitemoehybrid", v) for k, v in GRANITE_CONFIGS.items()},
    **{k: ("falcon_h1", v) for k, v in FALCON_H1_CONFIGS.items()},
    **{k: ("zamba2", v) for k, v in ZAMBA2_CONFIGS.items()},
    **{k: ("jamba", v) for k, v in JAMBA_CONFIGS.items()},
}


def build_hf_model(kind: str, overrides: dict, vocab_size: int = 256, seed: int = 0) -> torch.nn.Module:
    """A seeded random transformers model (eval mode, fp32)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    if kind == "nemotron_h":
        cfg = transformers.NemotronHConfig(**common, **overrides)
        model = transformers.NemotronHForCausalLM(cfg)
        # (time_step_min keeps its default, 0.001, as every released config has it: it shapes the
        # dt initialisation only, the mixer clamps by time_step_limit, (0, inf))
    elif kind == "bamba":
        cfg = transformers.BambaConfig(**common, **overrides)
        model = transformers.BambaForCausalLM(cfg)
    elif kind == "mamba2":
        cfg = transformers.Mamba2Config(**common, **overrides)
        model = transformers.Mamba2ForCausalLM(cfg)
    elif kind == "granitemoehybrid":
        cfg = transformers.GraniteMoeHybridConfig(**common, **overrides)
        with warnings.catch_warnings():  # a shared MLP of size 0 is initialized with a warning
            warnings.filterwarnings("ignore", "Initializing zero-element tensors")
            model = transformers.GraniteMoeHybridForCausalLM(cfg)
        # the reference loop over experts: the default grouped_mm has no float64
        model.set_experts_implementation("eager")
    elif kind == "falcon_h1":
        cfg = transformers.FalconH1Config(**common, **overrides)
        model = transformers.FalconH1ForCausalLM(cfg)
    elif kind == "zamba2":
        cfg = transformers.Zamba2Config(**common, **overrides)
        model = transformers.Zamba2ForCausalLM(cfg)
        # time_step_min = 0, as for NemotronH: transformers clamps dt only in prefill
        cfg.time_step_min = 0.0
        for m in model.modules():
            if hasattr(m, "time_step_limit"):
                m.time_step_limit = (0.0, float("inf"))
    elif kind == "jamba":
        cfg = transformers.JambaConfig(**common, **overrides)
        model = transformers.JambaForCausalLM(cfg)
        # the reference loop over experts: the default grouped_mm has no float64
        model.set_experts_implementation("eager")
    else:
        raise ValueError(kind)
    _scale_weights(model, seed + 1)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_hf_model(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(str(path))
    return path


# ------------------------------------------------------------------------------------------------
# the test-side driver
# ------------------------------------------------------------------------------------------------


@dataclass
class _Req:
    idx: int
    tokens: list[int]  # prompt + generated
    prompt_len: int
    max_new: int
    chunks: list[int]  # prefill chunk sizes (sum = prompt_len)
    arrival: int
    blocks: list[int]
    window: list[int]
    num_computed: int = 0
    live_slot_idx: int = 0  # index in window of the live state
    has_state: bool = False
    out_logits: list[torch.Tensor] = field(default_factory=list)
    done: bool = False

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Driver:
    """Greedy generation through `model.forward(ForwardBatch, ModelCaches)`.

    Request i owns KV blocks [1 + i*nb, 1 + (i+1)*nb) and state slots [1 + i*W, 1 + (i+1)*W).
    Decode rows read window[live] and write the state after token t to window[t] (live = n - 1
    afterwards), exactly the spec-decode window of docs/speculative-decoding.md, "The Mamba state
    window".
    """

    def __init__(
        self, lm: LoadedModel, max_seq: int = 128, max_reqs: int = 8, block_size: int = 8, window: int = 4
    ):
        self.lm = lm
        self.bs = block_size
        self.nb = (max_seq + block_size - 1) // block_size
        self.W = window
        self.caches = ModelCaches.for_model(
            lm.config, lm.dtype, 1 + max_reqs * self.nb, block_size, 1 + max_reqs * window, device=lm.device
        )

    def _new_req(
        self, i: int, prompt: list[int], max_new: int, chunks: list[int] | None, arrival: int
    ) -> _Req:
        chunks = list(chunks) if chunks else [len(prompt)]
        assert sum(chunks) == len(prompt)
        return _Req(
            idx=i,
            tokens=list(prompt),
            prompt_len=len(prompt),
            max_new=max_new,
            chunks=chunks,
            arrival=arrival,
            blocks=[1 + i * self.nb + b for b in range(self.nb)],
            window=[1 + i * self.W + w for w in range(self.W)],
        )

    def step(
        self,
        rows: list[tuple[_Req, list[int], bool]],
        emits: list[tuple[int, int, int]] | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """rows: (req, token ids to run, is_decode); decode rows must come first. emits: (row,
        token index in row, slot). Returns the logits of every token of decode rows and of the
        last token of final prefill chunks (`all_logits`: of every token)."""
        logits = self.lm.model(self.batch(rows, emits, all_logits), self.caches)
        self.advance(rows)
        return logits

    def advance(self, rows: list[tuple[_Req, list[int], bool]]) -> None:
        """The requests of `rows` after their step ran."""
        for req, toks, is_dec in rows:
            req.num_computed += len(toks)
            req.has_state = True
            req.live_slot_idx = len(toks) - 1 if is_dec else 0

    def batch(
        self,
        rows: list[tuple[_Req, list[int], bool]],
        emits: list[tuple[int, int, int]] | None = None,
        all_logits: bool = False,
    ) -> ForwardBatch:
        """The ForwardBatch of a `step` (nothing run, no request advanced)."""
        ids, pos, qsl, nct, sl, slot_map = [], [], [0], [], [], []
        read, has_init, wslots, logits_idx = [], [], [], []
        num_decodes = 0
        for req, toks, is_dec in rows:
            start = req.num_computed
            n = len(toks)
            base = qsl[-1]
            ids += toks
            pos += list(range(start, start + n))
            for p in range(start, start + n):
                slot_map.append(req.blocks[p // self.bs] * self.bs + p % self.bs)
            qsl.append(base + n)
            nct.append(start)
            sl.append(start + n)
            read.append(req.window[req.live_slot_idx] if req.has_state else 0)
            has_init.append(req.has_state)
            if is_dec:
                num_decodes += 1
                assert n <= self.W
                wslots.append(req.window[:n] + [0] * (self.W - n))
                logits_idx += list(range(base, base + n))
            else:
                wslots.append([req.window[0]] + [0] * (self.W - 1))
                if start + n == req.prompt_len:
                    logits_idx.append(base + n - 1)
        dev = self.lm.device

        def t(v: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(v, dtype=dtype)

        return ForwardBatch(
            input_ids=t(ids).to(dev),
            positions=t(pos).to(dev),
            query_start_loc=t(qsl),
            num_computed_tokens=t(nct),
            seq_lens=t(sl),
            num_decodes=num_decodes,
            slot_mapping=t(slot_map).to(dev),
            block_table=t([r.blocks for r, _, _ in rows]).to(dev),
            state_read_slot=t(read),
            has_initial_state=t(has_init, torch.bool),
            state_write_slots=t(wslots),
            emit_row=t([e[0] for e in emits or []]),
            emit_token=t([e[1] for e in emits or []]),
            emit_slot=t([e[2] for e in emits or []]),
            logits_indices=t(list(range(len(ids))) if all_logits else logits_idx).to(dev),
        )

    def generate(
        self,
        prompts: list[list[int]],
        max_new: int,
        chunks: list[list[int] | None] | None = None,
        arrivals: list[int] | None = None,
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Greedy generation of `max_new` tokens per prompt, all requests in shared batches.
        Returns the generated ids and, per request, the stacked logits that produced them."""
        R = len(prompts)
        chunks = chunks or [None] * R
        arrivals = arrivals or [0] * R
        reqs = [self._new_req(i, p, max_new, chunks[i], arrivals[i]) for i, p in enumerate(prompts)]
        step_no = 0
        while not all(r.done for r in reqs):
            dec = [r for r in reqs if not r.done and r.num_computed >= r.prompt_len and r.arrival <= step_no]
            pre = [r for r in reqs if not r.done and r.num_computed < r.prompt_len and r.arrival <= step_no]
            rows: list[tuple[_Req, list[int], bool]] = []
            for r in dec:
                rows.append((r, [r.tokens[-1]], True))
            for r in pre:
                done_chunks, acc = 0, 0
                while acc < r.num_computed:
                    acc += r.chunks[done_chunks]
                    done_chunks += 1
                n = r.chunks[done_chunks]
                rows.append((r, r.tokens[r.num_computed : r.num_computed + n], False))
            if rows:
                logits = self.step(rows)
                k = 0
                for r, _toks, is_dec in rows:
                    if is_dec or r.num_computed == r.prompt_len:
                        lg = logits[k]
                        k += 1
                        r.out_logits.append(lg)
                        r.tokens.append(int(lg.argmax()))
                        if len(r.generated) >= r.max_new:
                            r.done = True
                assert k == logits.shape[0]
            step_no += 1
        return [r.generated for r in reqs], [torch.stack(r.out_logits) for r in reqs]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def random_prompts(n: int, vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]
