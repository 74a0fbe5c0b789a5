"""The built-in demo model: a tiny Nemotron-H checkpoint written offline.

`hybridserve demo-model DIR` writes, with no network access:

- `config.json`: a Hugging Face `nemotron_h` config (`NemotronHForCausalLM`) with the hybrid layer
  pattern `M-M*-M*-` (Mamba2, MLP and attention layers), written both as `layers_block_type`
  (transformers 5.x names) and as the legacy `hybrid_override_pattern` string;
- `model.safetensors`: seeded random float32 weights under the HF state-dict names
  (`backbone.embeddings.weight`, `backbone.layers.{i}.norm.weight`, `backbone.layers.{i}.mixer.*`,
  `backbone.norm_f.weight`, `lm_head.weight`), with a planted induction head so that, like a real
  language model, it continues repeated patterns (n-gram speculation gets accepted drafts);
- `tokenizer.json`: a byte-level BPE trained at build time on `demo_corpus.txt` (shipped in the
  package), with the special tokens `<|endoftext|>` (bos/pad), `<|im_start|>`, `<|im_end|>` (eos);
- `tokenizer_config.json` (ChatML chat template) and `generation_config.json`.

The same seed gives the same bytes. `time_step_min` is 1e-9 so that the NemotronH mixer's dt clamp
(applied by transformers in prefill but not in single-token decode) never fires, and
`time_step_limit` is `[0, inf]` (written with transformers' `{"__float__": "Infinity"}` tag).

`ensure_demo_model()` builds the default-seed checkpoint once into a cache folder and returns its
path; `resolve_model_path("demo")` is what every `model=` argument goes through.

This module is imported by the CLI to build its parser: no torch at module level.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEMO_MODEL_NAME = "demo"
DEFAULT_SEED = 0

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
TOKENIZER_VOCAB_TARGET = 1024  # the trainer stops earlier when the corpus has no more merges

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Architecture of the demo checkpoint (besides vocab_size, which is the tokenizer's).
LAYER_PATTERN = "M-M*-M*-"
_PATTERN_TO_TYPE = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
HIDDEN_SIZE = 128
MAMBA_NUM_HEADS = 8
MAMBA_HEAD_DIM = 32
SSM_STATE_SIZE = 32
N_GROUPS = 2
CONV_KERNEL = 4
CHUNK_SIZE = 64
NUM_ATTENTION_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
INTERMEDIATE_SIZE = 384
MAX_POSITION_EMBEDDINGS = 4096
LAYER_NORM_EPS = 1e-5

# Initialisation scales (chosen so that next-token distributions are neither flat nor one-hot).
INIT_STD = 0.02
LM_HEAD_STD = 0.15
DT_MIN, DT_MAX = 1e-3, 0.1  # softplus(dt_bias) is log-uniform in this range
A_MIN, A_MAX = 1.0, 16.0  # A_log = log(uniform(A_MIN, A_MAX))
# transformers' NemotronH mixer clamps dt >= time_step_min in prefill but not in decode. With this
# value the clamp never fires for these weights (dt_bias >= softplus^-1(1e-3) ~ -6.9 and the dt
# projection is O(1)), so prefill and decode agree; it must stay > 0 because transformers' own
# initialiser takes log(time_step_min).
TIME_STEP_MIN = 1e-9

# The planted induction circuit (see `_plant_induction_circuit`). The residual stream is split into
# subspaces: [0, CODE_DIM) the current token's code, [CODE_DIM, 2 CODE_DIM) the previous token's
# code, [2 CODE_DIM, 3 CODE_DIM) the copied (predicted) token's code; the last dimension is a
# constant 1 carried by every embedding.
CODE_DIM = 32
PREV_TOKEN_GAIN = 0.2  # pre-silu scale of the copied code in the Mamba conv path (keeps silu ~linear)
GATE_Z = 5.0  # constant gate pre-activation: silu(5) ~ 5
MATCH_GAIN = 2.0  # attention query gain: sharp attention on matching previous tokens
COPY_READOUT_GAIN = 4.0  # LM-head weight on the copied code
EMB_NOISE_STD = 0.02

# Bump when the generator changes in a way the hash below does not see.
DEMO_REVISION = 2


def _corpus_text() -> str:
    return resources.files("hybridserve.model").joinpath("demo_corpus.txt").read_text(encoding="utf-8")


def build_tokenizer_json() -> str:
    """Train the byte-level BPE on the shipped corpus; returns the tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_TARGET,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_corpus_text()], trainer=trainer)
    # Canonical form: re-serialise through json with sorted keys so the bytes do not depend on
    # the order in which the library happens to emit fields.
    return json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=1, sort_keys=True) + "\n"


def _layer_types() -> list[str]:
    return [_PATTERN_TO_TYPE[c] for c in LAYER_PATTERN]


def build_config(vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int) -> dict[str, Any]:
    """The HF config.json contents of the demo model."""
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN_SIZE,
        "layers_block_type": _layer_types(),
        "hybrid_override_pattern": LAYER_PATTERN,
        "num_hidden_layers": len(LAYER_PATTERN),
        "tie_word_embeddings": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "num_attention_heads": NUM_ATTENTION_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "intermediate_size": INTERMEDIATE_SIZE,
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "ssm_state_size": SSM_STATE_SIZE,
        "mamba_num_heads": MAMBA_NUM_HEADS,
        "mamba_head_dim": MAMBA_HEAD_DIM,
        "mamba_hidden_act": "silu",
        "n_groups": N_GROUPS,
        "conv_kernel": CONV_KERNEL,
        "expand": (MAMBA_NUM_HEADS * MAMBA_HEAD_DIM) // HIDDEN_SIZE,
        "chunk_size": CHUNK_SIZE,
        "time_step_min": TIME_STEP_MIN,
        "time_step_max": DT_MAX,
        "time_step_floor": DT_MIN / 10,
        "time_step_limit": [0.0, {"__float__": "Infinity"}],
        "use_conv_bias": True,
        "mamba_proj_bias": False,
        "use_bias": False,
        "mamba_ssm_cache_dtype": "float32",
        "residual_in_fp32": False,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "initializer_range": INIT_STD,
        "rescale_prenorm_residual": True,
        "num_logits_to_keep": 1,
        "use_cache": True,
    }


def weight_shapes(vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the checkpoint, in generation order."""
    d_inner = MAMBA_NUM_HEADS * MAMBA_HEAD_DIM
    conv_dim = d_inner + 2 * N_GROUPS * SSM_STATE_SIZE
    shapes: list[tuple[str, tuple[int, ...]]] = [("backbone.embeddings.weight", (vocab_size, HIDDEN_SIZE))]
    for i, kind in enumerate(LAYER_PATTERN):
        p = f"backbone.layers.{i}"
        shapes.append((f"{p}.norm.weight", (HIDDEN_SIZE,)))
        if kind == "M":
            shapes += [
                (f"{p}.mixer.in_proj.weight", (d_inner + conv_dim + MAMBA_NUM_HEADS, HIDDEN_SIZE)),
                (f"{p}.mixer.conv1d.weight", (conv_dim, 1, CONV_KERNEL)),
                (f"{p}.mixer.conv1d.bias", (conv_dim,)),
                (f"{p}.mixer.A_log", (MAMBA_NUM_HEADS,)),
                (f"{p}.mixer.D", (MAMBA_NUM_HEADS,)),
                (f"{p}.mixer.dt_bias", (MAMBA_NUM_HEADS,)),
                (f"{p}.mixer.norm.weight", (d_inner,)),
                (f"{p}.mixer.out_proj.weight", (HIDDEN_SIZE, d_inner)),
            ]
        elif kind == "*":
            shapes += [
                (f"{p}.mixer.q_proj.weight", (NUM_ATTENTION_HEADS * HEAD_DIM, HIDDEN_SIZE)),
                (f"{p}.mixer.k_proj.weight", (NUM_KV_HEADS * HEAD_DIM, HIDDEN_SIZE)),
                (f"{p}.mixer.v_proj.weight", (NUM_KV_HEADS * HEAD_DIM, HIDDEN_SIZE)),
                (f"{p}.mixer.o_proj.weight", (HIDDEN_SIZE, NUM_ATTENTION_HEADS * HEAD_DIM)),
            ]
        elif kind == "-":
            shapes += [
                (f"{p}.mixer.up_proj.weight", (INTERMEDIATE_SIZE, HIDDEN_SIZE)),
                (f"{p}.mixer.down_proj.weight", (HIDDEN_SIZE, INTERMEDIATE_SIZE)),
            ]
        else:  # pragma: no cover - the pattern above has no MoE layers
            raise ValueError(f"unsupported layer kind {kind!r}")
    shapes += [("backbone.norm_f.weight", (HIDDEN_SIZE,)), ("lm_head.weight", (vocab_size, HIDDEN_SIZE))]
    return shapes


def build_weights(vocab_size: int, seed: int = DEFAULT_SEED) -> dict[str, torch.Tensor]:
    """Seeded random float32 weights (CPU generator, fixed draw order: same seed, same values)."""
    import math

    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    num_layers = len(LAYER_PATTERN)
    out: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(vocab_size):
        leaf = ".".join(name.split(".")[-2:])
        if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            t = torch.ones(shape)
        elif name.endswith("mixer.D"):
            t = torch.ones(shape)
        elif name.endswith("mixer.A_log"):
            t = torch.log(A_MIN + (A_MAX - A_MIN) * torch.rand(shape, generator=gen))
        elif name.endswith("mixer.dt_bias"):
            u = torch.rand(shape, generator=gen)
            dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
            t = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        elif name.endswith("conv1d.bias"):
            t = torch.zeros(shape)
        elif name.endswith("conv1d.weight"):
            # nn.Conv1d default scale for a depthwise conv: U(-1/sqrt(K), 1/sqrt(K)).
            bound = 1.0 / math.sqrt(CONV_KERNEL)
            t = (torch.rand(shape, generator=gen) * 2.0 - 1.0) * bound
        elif name == "lm_head.weight":
            t = torch.randn(shape, generator=gen) * LM_HEAD_STD
        elif leaf in ("out_proj.weight", "o_proj.weight", "down_proj.weight"):
            # Residual-branch outputs scaled by 1/sqrt(num_layers) (GPT-2 / Megatron scheme).
            t = torch.randn(shape, generator=gen) * (INIT_STD / math.sqrt(num_layers))
        else:
            t = torch.randn(shape, generator=gen) * INIT_STD
        out[name] = t.to(torch.float32).contiguous()
    _plant_induction_circuit(out, vocab_size, gen)
    return out


def _plant_induction_circuit(w: dict[str, torch.Tensor], vocab_size: int, gen: torch.Generator) -> None:
    """Overwrite parts of the random weights with an induction head ("[A][B] ... [A] -> [B]").

    Random weights alone never continue a repeated pattern, so n-gram speculation would never be
    accepted on them. Real language models copy; so does this one:

    - embeddings: a random unit code per token in the current-token subspace, plus a constant 1
      in the last dimension (all embeddings have the same norm, so RMSNorm scales are constant);
    - first Mamba layer: its causal conv shifts the current code by one position (tap K-2 = 1) and
      writes it, through the D skip (B = C = 0, so the SSM adds nothing) and a constant gate, into
      the previous-token subspace;
    - first attention layer, head 0 (KV head 0): query = current code, key = previous-token code,
      value = current code: position t attends to the positions whose previous token equals
      token t, and copies the token found there into the copy subspace;
    - LM head: reads the copy subspace (on top of its random weights).

    The other layers, heads and channels stay random. HF's NemotronH runs these weights unchanged.
    """
    import math

    import torch

    first_mamba = LAYER_PATTERN.index("M")
    first_attn = LAYER_PATTERN.index("*")
    if first_attn < first_mamba or HEAD_DIM < CODE_DIM or 3 * CODE_DIM >= HIDDEN_SIZE:
        raise ValueError("the induction circuit needs a Mamba layer before an attention layer")
    cur, prev, copy, const = 0, CODE_DIM, 2 * CODE_DIM, HIDDEN_SIZE - 1

    codes = torch.randn(vocab_size, CODE_DIM, generator=gen)
    codes = codes / codes.norm(dim=1, keepdim=True)
    emb = torch.randn(vocab_size, HIDDEN_SIZE, generator=gen) * EMB_NOISE_STD
    emb[:, cur : cur + CODE_DIM] = codes
    emb[:, const] = 1.0
    w["backbone.embeddings.weight"] = emb

    d_inner = MAMBA_NUM_HEADS * MAMBA_HEAD_DIM
    conv_dim = d_inner + 2 * N_GROUPS * SSM_STATE_SIZE
    idx = torch.arange(CODE_DIM)
    # Mamba: RMSNorm of an embedding multiplies it by sqrt(H / |e|^2) = sqrt(H / 2).
    p = f"backbone.layers.{first_mamba}.mixer."
    s0 = math.sqrt(HIDDEN_SIZE / 2.0)
    in_proj = torch.zeros_like(w[p + "in_proj.weight"])
    in_proj[d_inner + conv_dim :] = w[p + "in_proj.weight"][d_inner + conv_dim :]  # dt rows stay random
    in_proj[d_inner + idx, cur + idx] = PREV_TOKEN_GAIN * math.sqrt(CODE_DIM) / s0  # x channels
    in_proj[idx, const] = GATE_Z / s0  # z channels: constant gate
    w[p + "in_proj.weight"] = in_proj
    conv_w = torch.zeros(conv_dim, 1, CONV_KERNEL)
    conv_w[idx, 0, CONV_KERNEL - 2] = 1.0  # out(t) = in(t - 1)
    w[p + "conv1d.weight"] = conv_w
    w[p + "conv1d.bias"] = torch.zeros(conv_dim)
    group = d_inner // N_GROUPS  # the gated RMSNorm makes the code's norm sqrt(group)
    out_proj = torch.zeros_like(w[p + "out_proj.weight"])
    out_proj[prev + idx, idx] = 1.0 / math.sqrt(group)
    w[p + "out_proj.weight"] = out_proj

    # Attention: residual = cur + prev codes + const (norm sqrt(3)) -> RMSNorm scale sqrt(H / 3).
    p = f"backbone.layers.{first_attn}.mixer."
    s3 = math.sqrt(HIDDEN_SIZE / 3.0)
    q, k = w[p + "q_proj.weight"].clone(), w[p + "k_proj.weight"].clone()
    v, o = w[p + "v_proj.weight"].clone(), w[p + "o_proj.weight"].clone()
    q[:HEAD_DIM] = 0.0
    k[:HEAD_DIM] = 0.0
    v[:HEAD_DIM] = 0.0
    o[:, :HEAD_DIM] = 0.0
    q[idx, cur + idx] = MATCH_GAIN
    k[idx, prev + idx] = 1.0
    v[idx, cur + idx] = 1.0 / s3
    o[copy + idx, idx] = 1.0
    w[p + "q_proj.weight"], w[p + "k_proj.weight"] = q.contiguous(), k.contiguous()
    w[p + "v_proj.weight"], w[p + "o_proj.weight"] = v.contiguous(), o.contiguous()

    # Keep the copy subspace clean: nothing else writes into it.
    for i, kind in enumerate(LAYER_PATTERN):
        name = {"M": "out_proj", "*": "o_proj", "-": "down_proj"}[kind]
        key = f"backbone.layers.{i}.mixer.{name}.weight"
        wt = w[key].clone()
        keep = wt[copy : copy + CODE_DIM].clone() if i == first_attn else None
        wt[copy : copy + CODE_DIM] = 0.0
        if keep is not None:
            wt[copy : copy + CODE_DIM, :HEAD_DIM] = keep[:, :HEAD_DIM]
        w[key] = wt.contiguous()

    lm = w["lm_head.weight"].clone()
    lm[:, copy : copy + CODE_DIM] += COPY_READOUT_GAIN * codes
    w["lm_head.weight"] = lm.contiguous()


def build_tokenizer_config(vocab: dict[str, int]) -> dict[str, Any]:
    added = {
        str(vocab[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
    }


def _dump_json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def write_demo_model(out_dir: str | os.PathLike[str], seed: int = DEFAULT_SEED) -> Path:
    """Write the demo checkpoint into `out_dir` (created if needed; files overwritten)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok_json = build_tokenizer_json()
    vocab: dict[str, int] = json.loads(tok_json)["model"]["vocab"]
    vocab_size = len(vocab)
    bos, eos, pad = vocab[BOS_TOKEN], vocab[EOS_TOKEN], vocab[PAD_TOKEN]

    (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (out / "tokenizer_config.json").write_bytes(_dump_json(build_tokenizer_config(vocab)))
    (out / "special_tokens_map.json").write_bytes(
        _dump_json({"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN})
    )
    (out / "config.json").write_bytes(_dump_json(build_config(vocab_size, bos, eos, pad)))
    (out / "generation_config.json").write_bytes(
        _dump_json({"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad})
    )
    weights = out / "model.safetensors"
    save_file(build_weights(vocab_size, seed), str(weights), metadata={"format": "pt"})
    # safetensors writes its file private (0600); give it the mode the other files got (umask)
    os.chmod(weights, (out / "config.json").stat().st_mode & 0o777)
    return out


def _spec_digest() -> str:
    """Hash of everything that determines the default demo checkpoint (cache key)."""
    from hybridserve import __version__

    spec = {
        "version": __version__,
        "revision": DEMO_REVISION,
        "seed": DEFAULT_SEED,
        "config": build_config(0, 0, 0, 0),
        "shapes": weight_shapes(0),
        "init": [INIT_STD, LM_HEAD_STD, DT_MIN, DT_MAX, A_MIN, A_MAX],
        "circuit": [CODE_DIM, PREV_TOKEN_GAIN, GATE_Z, MATCH_GAIN, COPY_READOUT_GAIN, EMB_NOISE_STD],
        "tokenizer": [SPECIAL_TOKENS, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, TOKENIZER_VOCAB_TARGET, CHAT_TEMPLATE],
        "corpus": hashlib.sha256(_corpus_text().encode("utf-8")).hexdigest(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode("utf-8")).hexdigest()[:12]


def demo_cache_root() -> Path:
    """`$HYBRIDSERVE_CACHE`, else `~/.cache/hybridserve`."""
    env = os.environ.get("HYBRIDSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "hybridserve"


def demo_model_dir() -> Path:
    """Where `ensure_demo_model()` keeps the default checkpoint: `<cache>/demo-<version>-<digest>`."""
    from hybridserve import __version__

    return demo_cache_root() / f"demo-{__version__}-{_spec_digest()}"


def ensure_demo_model() -> str:
    """Create the default demo checkpoint once (atomically: temp dir, then rename); return its path."""
    final = demo_model_dir()
    if (final / "config.json").is_file():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write_demo_model(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process won the race (the target now exists and is complete).
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def resolve_model_path(model: str) -> str:
    """`"demo"` -> the cached demo checkpoint (created on first use); anything else unchanged."""
    return ensure_demo_model() if model == DEMO_MODEL_NAME else model


def _weight_seed(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= v < 2**63:
        raise argparse.ArgumentTypeError(f"must be in [0, 2^63), got {text}")
    return v


def add_demo_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dir",
        help="folder to write the checkpoint into (created if missing; the checkpoint's own files "
        "in it are replaced, other files are left alone)",
    )
    p.add_argument(
        "--seed", type=_weight_seed, default=DEFAULT_SEED, help="weight seed (default: %(default)s)"
    )


def demo_model_main(args: argparse.Namespace) -> int:
    if not str(args.dir).strip():
        from hybridserve.errors import ConfigError

        raise ConfigError("DIR: an empty path (it would write into the current folder)")
    out = write_demo_model(args.dir, seed=args.seed)
    print(f"wrote the demo model (nemotron_h, pattern {LAYER_PATTERN}) to {out}")
    return 0
