"""Load a Hugging Face model folder: config.json, *.safetensors (single file, several files, or a
sharded `model.safetensors.index.json`), tokenizer.json.

Errors are `hybridserve.ConfigError` naming the file and tensor: unknown architecture, missing
tensor, wrong shape, unsupported dtype (of the request or of a stored tensor).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridserve.errors import ConfigError
from hybridserve.model.architectures import CausalLM, get_architecture
from hybridserve.model.cache_tensors import parse_dtype
from hybridserve.model.model_config import (
    ARCHITECTURE_MODEL_TYPES,
    ModelConfig,
    first_architecture,
    model_type_of,
    read_config_json,
)

log = logging.getLogger(__name__)

_FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
# Show a progress bar only for checkpoints this large (tensors or bytes).
_PROGRESS_MIN_TENSORS = 200
_PROGRESS_MIN_BYTES = 512 * 1024 * 1024


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Any  # tokenizers.Tokenizer, or None when the folder has no tokenizer.json
    model_dir: str
    dtype: torch.dtype
    device: torch.device


def load_config(model_dir: str | Path) -> tuple[type[CausalLM], ModelConfig]:
    """Parse `<model_dir>/config.json` into (architecture class, ModelConfig)."""
    path = Path(model_dir) / "config.json"
    raw = read_config_json(path)
    model_type = model_type_of(raw, str(path))  # also: the two names agree
    name = first_architecture(raw) or {mt: a for a, mt in ARCHITECTURE_MODEL_TYPES.items()}.get(model_type)
    if name is None:
        raise ConfigError(
            f"{path}: no 'architectures' entry and unknown model_type {raw.get('model_type')!r}"
        )
    cls = get_architecture(name, str(path))
    try:
        cfg = cls.parse_config(raw, str(path))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: bad or missing field: {e}") from None
    except ZeroDivisionError as e:
        raise ConfigError(f"{path}: a size that another is derived from is 0 ({e})") from None
    except ArithmeticError as e:  # OverflowError: a number too large for what it sizes
        raise ConfigError(f"{path}: a size is out of range ({e})") from None
    return cls, cfg


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """checkpoint key -> file holding it."""
    index = model_dir / "model.safetensors.index.json"
    from safetensors import safe_open

    out: dict[str, Path] = {}
    if index.is_file():
        try:
            wm = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index}: bad sharded index: {e}") from None
        except RecursionError:
            raise ConfigError(f"{index}: bad sharded index: nested too deeply") from None
        if not isinstance(wm, dict):
            raise ConfigError(
                f"{index}: bad sharded index: weight_map must be an object, not {type(wm).__name__}"
            )
        for key, fname in wm.items():
            rel = Path(str(fname))
            if rel.is_absolute() or ".." in rel.parts:
                # shards live in the model folder (a symlinked shard, as in a hub cache, is fine)
                raise ConfigError(f"{index}: tensor {key!r} is in {fname!r}, outside the model folder")
            p = model_dir / rel
            if not p.is_file():
                raise ConfigError(f"{index}: tensor {key!r} is in {fname}, which does not exist")
            out[str(key)] = p
        return out
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir}: no *.safetensors files")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    if key in out:
                        raise ConfigError(f"{f}: tensor {key!r} also in {out[key]}")
                    out[key] = f
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a corrupt file
            raise ConfigError(f"{f}: cannot read safetensors: {e}") from None
    return out


def _param_dtype(cls: type[CausalLM], name: str, dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.bfloat16, torch.float16) and name.endswith(cls.fp32_param_suffixes):
        return torch.float32
    return dtype


def load_model(
    path: str,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
    load_format: str = "auto",
    tokenizer_dir: str | None = None,
) -> LoadedModel:
    """Build the architecture named in `<path>/config.json` and load its safetensors weights.

    dtype: float32, bfloat16, float16 or float64 (or their names). `progress`: tqdm bar; default
    on for large checkpoints only. `load_format` "dummy": no weights are read; every parameter is
    drawn uniformly from [-1e-3, 1e-3] by a seeded generator (`_dummy_weights`), the same on every
    load and every tensor-parallel rank. `tokenizer_dir`: where the tokenizer is (--tokenizer), if
    not in the model folder.
    """
    from hybridserve.model.demo import resolve_model_path

    model_dir = Path(resolve_model_path(str(path)))
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir}: model folder does not exist")
    dt = parse_dtype(dtype)
    dev = torch.device(device)
    cls, cfg = load_config(model_dir)
    files = _tensor_files(model_dir) if load_format != "dummy" else {}
    stored: dict[str, str] = {}  # parameter name -> key in the checkpoint (an alias if renamed)
    for name, olds in cls.key_aliases.items():
        if name not in files:
            for old in olds:
                if old in files:
                    files[name] = files[old]
                    stored[name] = old
                    break

    try:
        with torch.device("meta"):
            model = cls(cfg)
    except (RuntimeError, TypeError, ValueError) as e:
        # a size in config.json that no layer can be built with (-1, a string) that the family's
        # own checks let through: the file's error, not a traceback
        raise ConfigError(f"{model_dir / 'config.json'}: the model cannot be built from it: {e}") from None
    try:
        model.to_empty(device=dev)
    except RuntimeError as e:  # the allocator's "can't allocate" / out of memory
        n = sum(p.numel() for p in model.parameters())
        raise ConfigError(
            f"{model_dir}: the model's {n} parameters do not fit in {dev} memory "
            f"(check config.json's sizes): {str(e).splitlines()[0]}"
        ) from None
    for p in model.parameters():
        p.requires_grad_(False)
    if load_format == "dummy":
        _dummy_weights(model, cls, cfg, dt, dev)
    else:
        _read_weights(model, cls, cfg, model_dir, files, stored, dt, dev, progress)
    model.eval()
    return LoadedModel(
        model=model,
        config=cfg,
        tokenizer=_check_tokenizer(cfg, model_dir, Path(tokenizer_dir) if tokenizer_dir else model_dir),
        model_dir=str(model_dir),
        dtype=dt,
        device=dev,
    )


# vLLM's dummy weights: a small range, so that activations neither vanish nor overflow in any
# dtype, and a fixed seed, so that every load (and every rank's full copy before its shard is cut)
# holds the same numbers
_DUMMY_RANGE = 1e-3
_DUMMY_SEED = 1234


def _tied(model: CausalLM, cfg: ModelConfig) -> dict[str, str]:
    """The parameters that share another's tensor (name -> the other's), where config.json ties
    the embeddings and the architecture honours it."""
    tie = cfg.tie_word_embeddings and model.honours_tie_word_embeddings
    return dict(model.tied_weight_map()) if tie else {}


def _dummy_weights(
    model: CausalLM, cls: type[CausalLM], cfg: ModelConfig, dt: torch.dtype, dev: torch.device
) -> None:
    gen = torch.Generator(device="cpu").manual_seed(_DUMMY_SEED)
    params = dict(model.named_parameters())
    tied = _tied(model, cfg)
    for name, p in params.items():
        if name in tied:
            continue
        values = torch.empty(p.shape, dtype=torch.float32).uniform_(
            -_DUMMY_RANGE, _DUMMY_RANGE, generator=gen
        )
        p.data = values.to(device=dev, dtype=_param_dtype(cls, name, dt))
    for name, alias in tied.items():
        _set_param(model, name, params[alias])


def _read_weights(
    model: CausalLM,
    cls: type[CausalLM],
    cfg: ModelConfig,
    model_dir: Path,
    files: dict[str, Path],
    stored: dict[str, str],
    dt: torch.dtype,
    dev: torch.device,
    progress: bool | None,
) -> None:
    """The checkpoint's tensors into `model`'s parameters (checked: present, shape, dtype)."""
    params = dict(model.named_parameters())
    from safetensors import safe_open

    handles: dict[Path, Any] = {}
    try:
        ties = model.tied_weight_map()
        tied = _tied(model, cfg)
        # A tensor config.json ties that the checkpoint stores too is read, and tied only where it
        # holds the same numbers: a head saved untied under a config left tying (a fine-tune's)
        # would otherwise be dropped, and every logit change (transformers keeps it, and says so)
        stored_too = {n: tied.pop(n) for n in list(tied) if n in files}
        to_load = [n for n in params if n not in tied]
        for name in to_load:
            if name not in files:
                alias = ties.get(name)
                if alias is not None and alias in files:
                    if not cfg.tie_word_embeddings:
                        # untied config but the checkpoint only stores the shared matrix
                        # (transformers would start this tensor from random numbers instead):
                        # said, as it changes what the model says
                        log.warning(
                            "%s: config.json unties %r but the checkpoint has no such tensor: it is "
                            "tied to %r", model_dir, name, alias,
                        )  # fmt: skip
                    tied[name] = alias
                    continue
                where = ", ".join(sorted({f.name for f in files.values()})) or "no files"
                raise ConfigError(f"{model_dir}: tensor {name!r} is missing from the checkpoint ({where})")
        to_load = [n for n in to_load if n not in tied]
        total_bytes = 0
        for name in to_load:
            f = files[name]
            try:
                if f not in handles:
                    handles[f] = safe_open(str(f), framework="pt", device="cpu")
                sl = handles[f].get_slice(stored.get(name, name))
            except Exception as e:  # noqa: BLE001 - a corrupt shard, or one without the tensor
                raise ConfigError(f"{f}: cannot read tensor {name!r}: {e}") from None
            sdt = sl.get_dtype()
            if sdt not in _FLOAT_DTYPES:
                raise ConfigError(f"{f}: tensor {name!r} has unsupported dtype {sdt} (need F32/BF16/F16/F64)")
            shape = tuple(sl.get_shape())
            want = tuple(params[name].shape)
            if shape != want:
                raise ConfigError(f"{f}: tensor {name!r} has shape {list(shape)}, expected {list(want)}")
            total_bytes += params[name].numel() * 4
        show = (
            progress
            if progress is not None
            else (len(to_load) >= _PROGRESS_MIN_TENSORS or total_bytes >= _PROGRESS_MIN_BYTES)
        )
        it: Any = to_load
        if show and sys.stderr is not None:  # no bar where stderr is closed
            from tqdm.auto import tqdm

            it = tqdm(to_load, desc=f"Loading {model_dir.name}", unit="tensor")
        for name in it:
            try:
                t = handles[files[name]].get_tensor(stored.get(name, name))
            except Exception as e:  # noqa: BLE001 - data past the header is corrupt
                raise ConfigError(f"{files[name]}: cannot read tensor {name!r}: {e}") from None
            p = params[name]
            p.data = t.to(device=dev, dtype=_param_dtype(cls, name, dt))
        for name, alias in tied.items():
            src = params.get(alias)
            if src is None:
                raise ConfigError(f"{model_dir}: tied tensor {name!r} -> {alias!r} not in the model")
            if alias not in to_load:
                raise ConfigError(f"{model_dir}: tensor {alias!r} is missing from the checkpoint")
            _set_param(model, name, src)
        for name, alias in stored_too.items():
            if torch.equal(params[name].data, params[alias].data):
                _set_param(model, name, params[alias])
            else:
                log.warning(
                    "%s: config.json ties %r to %r, but the checkpoint stores it with other values: "
                    "the stored tensor is used, as transformers does", model_dir, name, alias,
                )  # fmt: skip
        unused = sorted(set(files) - set(params) - set(stored.values()))
        # Tensors with numbers in them that nothing reads (a layer past the stack config.json
        # declares, a bias the config says is not there) mean the model runs without them: said
        # as transformers says it. Empty ones (a shared MLP of size 0) are not worth a warning.
        held = []
        for name in unused:
            if files[name] not in handles:
                handles[files[name]] = safe_open(str(files[name]), framework="pt", device="cpu")
            if math.prod(handles[files[name]].get_slice(name).get_shape()) > 0:
                held.append(name)
    finally:
        handles.clear()
    if held:
        log.warning(
            "%s: %d checkpoint tensors are not used by the model config.json describes (e.g. %s)",
            model_dir, len(held), ", ".join(held[:3]),
        )  # fmt: skip
    elif unused:
        log.info("%s: %d empty checkpoint tensors not used (e.g. %s)", model_dir, len(unused), unused[0])


def _check_tokenizer(cfg: ModelConfig, model_dir: Path, tokenizer_dir: Path) -> Any:
    """The tokenizer.json of `tokenizer_dir` (None without one), said when it outgrows the
    vocabulary; and the EOS / BOS ids of the model's generation_config.json filled in."""
    tokenizer = None
    tok_path = tokenizer_dir / "tokenizer.json"
    if tok_path.is_file():
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(tok_path))
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"{tok_path}: cannot load tokenizer: {e}") from None
        n_tok = tokenizer.get_vocab_size(with_added_tokens=True)
        if n_tok > cfg.vocab_size:
            # a checkpoint may pad its vocabulary, never the other way round: text that encodes
            # to the missing ids is refused per request
            log.warning(
                "%s: the tokenizer has %d tokens but config.json's vocab_size is %d: prompts "
                "holding ids >= %d will be refused",
                tok_path, n_tok, cfg.vocab_size, cfg.vocab_size,
            )  # fmt: skip
    _fill_token_ids(cfg, model_dir)
    _warn_unreachable_token_ids(cfg, model_dir)
    return tokenizer


def _set_param(model: torch.nn.Module, name: str, value: torch.nn.Parameter) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    setattr(mod, leaf, value)


def _warn_unreachable_token_ids(cfg: ModelConfig, model_dir: Path) -> None:
    """An EOS id the model's logits do not cover can never be sampled: generation would not stop
    on it. Loaded all the same (max_tokens and stop strings still end a request), but said."""
    eos = [*cfg.eos_token_ids, *([cfg.eos_token_id] if cfg.eos_token_id is not None else [])]
    outside = sorted({i for i in eos if i >= cfg.vocab_size})
    if outside:
        log.warning(
            "%s: EOS token id(s) %s are outside the model's vocabulary (vocab_size %d): they can never "
            "be generated, so generation stops only at max_tokens or a stop string, and structured "
            "outputs (which end with EOS) are refused",
            model_dir, outside, cfg.vocab_size,
        )  # fmt: skip


def _fill_token_ids(cfg: ModelConfig, model_dir: Path) -> None:
    """eos/bos from generation_config.json when config.json lacks them (eos lists kept whole)."""
    gpath = model_dir / "generation_config.json"
    if not gpath.is_file():
        return
    try:
        g = json.loads(gpath.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        # as transformers, which loads the model without it: said, not silent
        log.warning("%s: ignored, it cannot be read as JSON: %s", gpath, e)
        return
    if not isinstance(g, dict):
        return
    eos = g.get("eos_token_id")
    bos = g.get("bos_token_id")
    for key, v in (("eos_token_id", eos), ("bos_token_id", bos)):
        vals = v if isinstance(v, list) else [] if v is None else [v]
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in vals):
            raise ConfigError(f"{gpath}: {key} must be a token id or a list of them, got {v!r}")
    if eos is not None:
        ids = [int(x) for x in (eos if isinstance(eos, list) else [eos])]
        for i in ids:
            if i not in cfg.eos_token_ids:
                cfg.eos_token_ids.append(i)
        if cfg.eos_token_id is None and ids:
            cfg.eos_token_id = ids[0]
    if cfg.bos_token_id is None and bos is not None and bos != []:
        cfg.bos_token_id = int(bos[0] if isinstance(bos, list) else bos)
