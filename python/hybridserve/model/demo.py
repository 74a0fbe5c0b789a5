"""The built-in demo model: a tiny Nemotron-H checkpoint trained offline on the project's own text.

`hybridserve demo-model DIR` writes, with no network access:

- `config.json`: a Hugging Face `nemotron_h` config (`NemotronHForCausalLM`) with the hybrid layer
  pattern `M-M*-M*-` (Mamba2, MLP and attention layers), written both as `layers_block_type`
  (transformers 5.x names) and as the legacy `hybrid_override_pattern` string;
- `model.safetensors`: float32 weights (about 1M parameters) under the HF state-dict names
  (`backbone.embeddings.weight`, `backbone.layers.{i}.norm.weight`, `backbone.layers.{i}.mixer.*`,
  `backbone.norm_f.weight`, `lm_head.weight`): a seeded random init trained for TRAIN_STEPS AdamW
  steps (about half a minute on a CPU) with transformers' own NemotronH in pure torch on
  `demo_corpus.txt` (a few KB of English written for the project, shipped in the package). The
  model memorises that text: greedy decoding from the start of one of its lines recites the
  corpus (so n-gram speculation gets drafts accepted there); it does not answer questions, and on
  any other text it produces corpus-flavoured word salad;
- `tokenizer.json`: a byte-level BPE trained at build time on the same corpus, with the special
  tokens `<|endoftext|>` (bos/pad), `<|im_start|>`, `<|im_end|>` (eos);
- `tokenizer_config.json` (ChatML chat template) and `generation_config.json`.

The same seed gives the same bytes on the same machine (training runs in one thread with
deterministic algorithms; see `train_weights`). `time_step_limit`, the mixer's dt clamp, is
`[0, inf]` (written with transformers' `{"__float__": "Infinity"}` tag), as in released configs;
`time_step_min` (1e-9) only feeds transformers' initialiser.

`ensure_demo_model()` builds the default-seed checkpoint once into a cache folder and returns its
path; `resolve_model_path("demo")` is what every `model=` argument goes through.

This module is imported by the CLI to build its parser: no torch at module level.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridserve.cache_root import cache_root

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("hybridserve.demo")

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

# Initialisation of the training (`init_weights`): GPT-2 style scales, so that the first loss is about
# log(vocab_size).
INIT_STD = 0.02
LM_HEAD_STD = 0.02
DT_MIN, DT_MAX = 1e-3, 0.1  # softplus(dt_bias) is log-uniform in this range
A_MIN, A_MAX = 1.0, 16.0  # A_log = log(uniform(A_MIN, A_MAX))
# time_step_min feeds only transformers' initialiser of dt_bias (which takes its log: it must stay
# > 0); the weights here are drawn by `DT_MIN`/`DT_MAX`. (Changing it would change the checkpoint's
# config.json, and so its cache folder.)
TIME_STEP_MIN = 1e-9

# Training (see `train_weights`): AdamW from the seeded random init, on windows of the tokenized
# corpus, in one CPU thread with deterministic algorithms, so the same seed gives the same bytes on
# the same machine. A step is one batch of TRAIN_BATCH windows of TRAIN_WINDOW tokens: half of them
# tile the corpus (read as a ring) from a random offset, half begin at a random line start, so
# that a prompt that opens a line of the corpus continues it without any text before it. The
# learning rate warms up for TRAIN_WARMUP steps, then decays along a cosine to TRAIN_LR_FLOOR of its
# peak. About 30 s on two busy CPU cores: the corpus's lines come back word for word.
TRAIN_STEPS = 32
TRAIN_BATCH = 16
TRAIN_WINDOW = 128
TRAIN_LINE_START_FRACTION = 0.5
TRAIN_LR = 6e-3
TRAIN_LR_FLOOR = 0.02
TRAIN_WARMUP = 3
TRAIN_BETAS = (0.9, 0.95)

# Bump when the generator changes in a way the hash below does not see.
DEMO_REVISION = 4


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


def build_weights(
    tokenizer_json: str, seed: int = DEFAULT_SEED, steps: int = TRAIN_STEPS
) -> tuple[dict[str, torch.Tensor], float]:
    """The checkpoint's float32 weights: the seeded random init (`init_weights`) trained for `steps`
    steps on the corpus (`train_weights`), both drawing from one CPU generator seeded with `seed`.
    Returns the weights and the last training loss."""
    import torch

    vocab_size = len(json.loads(tokenizer_json)["model"]["vocab"])
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weights = init_weights(vocab_size, gen)
    token_ids, line_starts = corpus_tokens(tokenizer_json)
    return train_weights(weights, token_ids, line_starts, gen, steps)


def init_weights(vocab_size: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random float32 weights drawn from `gen` in a fixed order (the starting point of training)."""
    import math

    import torch

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
    return out


def corpus_tokens(tokenizer_json: str) -> tuple[list[int], list[int]]:
    """The training text as token ids, and the indices of the tokens that begin a line of it.

    The corpus with EOS (`<|im_end|>`) after every paragraph, before the blank line: a recited
    paragraph ends the request (finish reason "stop") the way a chat turn would."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    eos = tok.token_to_id(EOS_TOKEN)
    if eos is None:
        raise ValueError(f"the tokenizer has no {EOS_TOKEN}")
    ids: list[int] = []
    line_starts: list[int] = []
    for i, para in enumerate(_corpus_text().rstrip("\n").split("\n\n")):
        chunk = para if i == 0 else "\n\n" + para
        enc = tok.encode(chunk)
        for j, (a, _) in enumerate(enc.offsets):
            if chunk[a] != "\n" and (a == 0 or chunk[a - 1] == "\n"):
                line_starts.append(len(ids) + j)
        ids += [*enc.ids, eos]
    return ids, line_starts


def _hf_config(vocab_size: int) -> Any:
    """build_config as a transformers NemotronHConfig (the special token ids do not matter here)."""
    import math

    from transformers import NemotronHConfig

    cfg = build_config(vocab_size, 0, 0, 0)
    cfg["time_step_limit"] = [0.0, math.inf]
    for key in ("architectures", "model_type", "dtype"):
        cfg.pop(key)
    return NemotronHConfig(**cfg)


def train_weights(
    weights: dict[str, torch.Tensor],
    token_ids: list[int],
    line_starts: list[int],
    gen: torch.Generator,
    steps: int = TRAIN_STEPS,
) -> tuple[dict[str, torch.Tensor], float]:
    """Train `weights` (the checkpoint's names) on the corpus with transformers' NemotronH in pure
    torch (float32, autograd, CPU); returns the trained weights and the last step's loss.

    Runs in one thread with deterministic algorithms and the global RNG forked (the caller's
    thread count, determinism flag and RNG state are restored afterwards)."""

    import torch
    from transformers import NemotronHForCausalLM
    from transformers.utils import logging as hf_logging

    vocab_size = weights["lm_head.weight"].shape[0]
    n = len(token_ids)
    if n < TRAIN_WINDOW + 1:
        raise ValueError(f"the demo corpus has {n} tokens, fewer than a training window")
    ring = torch.tensor(token_ids + token_ids[: TRAIN_WINDOW + 1])
    n_line = int(TRAIN_BATCH * TRAIN_LINE_START_FRACTION)
    n_tile = TRAIN_BATCH - n_line
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    verbosity = hf_logging.get_verbosity()
    loss_value = float("nan")
    try:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        hf_logging.set_verbosity_error()  # the "falling back to the PyTorch implementation" notes
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
            model = NemotronHForCausalLM(_hf_config(vocab_size))
            model.load_state_dict({_to_hf_name(k): v for k, v in weights.items()}, strict=True)
            model.train()
            params = dict(model.named_parameters())
            matrices = [p for p in params.values() if p.dim() >= 2]
            vectors = [p for p in params.values() if p.dim() < 2]
            opt = torch.optim.AdamW(
                [{"params": matrices}, {"params": vectors}], lr=TRAIN_LR, betas=TRAIN_BETAS, weight_decay=0.0
            )
            for step in range(steps):
                for group in opt.param_groups:
                    group["lr"] = TRAIN_LR * _lr_scale(step, steps)
                offset = int(torch.randint(0, n, (1,), generator=gen))
                starts = [(offset + (i * n) // n_tile) % n for i in range(n_tile)]
                picks = torch.randint(0, len(line_starts), (n_line,), generator=gen).tolist()
                starts += [line_starts[j] for j in picks]
                x = torch.stack([ring[s : s + TRAIN_WINDOW] for s in starts])
                y = torch.stack([ring[s + 1 : s + TRAIN_WINDOW + 1] for s in starts])
                logits = model(input_ids=x, use_cache=False).logits
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), y.reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                loss_value = float(loss.detach())
            trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        hf_logging.set_verbosity(verbosity)
    out = {name: trained[_to_hf_name(name)].to(torch.float32).contiguous() for name in weights}
    return out, loss_value


def _lr_scale(step: int, steps: int) -> float:
    """Linear warm-up over TRAIN_WARMUP steps, then a cosine down to TRAIN_LR_FLOOR."""
    import math

    if step < TRAIN_WARMUP:
        return (step + 1) / TRAIN_WARMUP
    cosine = 0.5 * (1.0 + math.cos(math.pi * (step - TRAIN_WARMUP) / max(1, steps - TRAIN_WARMUP)))
    return max(cosine, TRAIN_LR_FLOOR)


def _to_hf_name(name: str) -> str:
    """Checkpoint name -> transformers 5 module name (`backbone.` is `model.` in the module tree)."""
    return "model." + name[len("backbone.") :] if name.startswith("backbone.") else name


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


def write_demo_model(
    out_dir: str | os.PathLike[str], seed: int = DEFAULT_SEED, steps: int = TRAIN_STEPS
) -> Path:
    """Write the demo checkpoint into `out_dir` (created if needed; files overwritten), training its
    weights for `steps` steps (about a second a step; logged with the time taken)."""
    import time

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
    started = time.monotonic()
    trained, loss = build_weights(tok_json, seed, steps)
    logger.info(
        "trained the demo model on its corpus in %.1f s (%d steps, last loss %.3f)",
        time.monotonic() - started,
        steps,
        loss,
    )
    save_file(trained, str(weights), metadata={"format": "pt"})
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
        "train": [
            TRAIN_STEPS,
            TRAIN_BATCH,
            TRAIN_WINDOW,
            TRAIN_LINE_START_FRACTION,
            TRAIN_LR,
            TRAIN_LR_FLOOR,
            TRAIN_WARMUP,
            list(TRAIN_BETAS),
        ],
        "tokenizer": [SPECIAL_TOKENS, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, TOKENIZER_VOCAB_TARGET, CHAT_TEMPLATE],
        "corpus": hashlib.sha256(_corpus_text().encode("utf-8")).hexdigest(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode("utf-8")).hexdigest()[:12]


def demo_model_dir() -> Path:
    """Where `ensure_demo_model()` keeps the default checkpoint: `<cache>/demo-<version>-<digest>`."""
    from hybridserve import __version__

    return cache_root() / f"demo-{__version__}-{_spec_digest()}"


def ensure_demo_model() -> str:
    """Create the default demo checkpoint once (atomically: temp dir, then rename); return its path."""
    final = demo_model_dir()
    if (final / "config.json").is_file():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the demo model into %s (first use: about half a minute of training)", final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write_demo_model(tmp, steps=TRAIN_STEPS)
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


def _train_steps(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= v <= 100_000:
        raise argparse.ArgumentTypeError(f"must be in [0, 100000], got {text}")
    return v


def add_demo_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dir",
        help="folder to write the checkpoint into (created if missing; refused when it already holds "
        "one of the checkpoint's files, unless --force; other files are left alone)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace the checkpoint's files (config.json, model.safetensors, the tokenizer's) in DIR",
    )
    p.add_argument(
        "--seed", type=_weight_seed, default=DEFAULT_SEED, help="weight seed (default: %(default)s)"
    )
    p.add_argument(
        "--steps",
        type=_train_steps,
        default=TRAIN_STEPS,
        help="training steps on the corpus (default: %(default)s, about half a minute; 0 writes the "
        "random init)",
    )


# What `write_demo_model` writes into its folder.
CHECKPOINT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
    "model.safetensors",
)


def demo_model_main(args: argparse.Namespace) -> int:
    from hybridserve.errors import ConfigError

    if not str(args.dir).strip():
        raise ConfigError("DIR: an empty path (it would write into the current folder)")
    folder = Path(args.dir)
    present = sorted(
        {name for name in CHECKPOINT_FILES if (folder / name).exists()}
        | {p.name for p in folder.glob("*.safetensors*")}  # another model's shards and their index
    )
    if present and not args.force:
        # a folder may hold another model: its weights are not replaced without being asked
        raise ConfigError(
            f"DIR: {args.dir} already holds {', '.join(present)}; --force writes the checkpoint's files "
            "over it (it removes nothing else: take other weights out first)"
        )
    out = write_demo_model(args.dir, seed=args.seed, steps=args.steps)
    print(f"wrote the demo model (nemotron_h, pattern {LAYER_PATTERN}, {args.steps} training steps) to {out}")
    return 0
