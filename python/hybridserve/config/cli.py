"""The engine flags of every subcommand (vLLM's names) and `hybridserve config`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Collection, Sequence
from pathlib import Path

from hybridserve import _core
from hybridserve.arg_types import only_one
from hybridserve.config.args import (
    CHAT_CONTENT_FORMATS,
    DEFAULT_MAX_QUEUE_LEN,
    DTYPE_ALIASES,
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    STATE_DTYPES,
    EngineArgs,
    check_marker_ids,
    parse_shared_prefix_markers,
)
from hybridserve.config.capabilities import resolve_model_dir
from hybridserve.config.explain import format_resolved
from hybridserve.config.plan import plan_engine
from hybridserve.errors import ConfigError, HybridServeError
from hybridserve.sampling.params import DEFAULT_MAX_LOGPROBS


def add_engine_args(p: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
    """Adds every engine flag (vLLM names) to `p`, and the MODEL positional unless `p` has one or
    `model_positional` is False. `--max-queue-len` is left to the server (and `config`)."""
    if model_positional and not any(a.dest == "model" for a in p._actions):
        p.add_argument(
            "model", nargs="?", default=None, help="model folder (HF config.json + safetensors), or 'demo'"
        )
        # (model cards write `vllm serve --model NAME`, an older form vLLM still takes)
        p.add_argument("--model", dest="model_option", default=None, metavar="MODEL", help="MODEL, as a flag")
    p.add_argument(
        "--config",
        dest="config_file",
        default=None,
        metavar="FILE",
        help="read flags from a YAML file of flag names and values (vLLM's; the command line's own "
        "flags win; docs/serving.md, Command line)",
    )
    g = p.add_argument_group("engine")
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM's command lines: hybridserve runs no code from a model folder",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="the folder of the tokenizer (tokenizer.json, tokenizer_config.json, its chat template) when "
        "it is not the model's (vLLM's flag)",
    )
    g.add_argument(
        "--load-format",
        choices=list(LOAD_FORMATS),
        default="auto",
        help="auto / safetensors: the checkpoint's weights; dummy: small seeded random numbers, to measure "
        "a model's speed from its config.json alone (its answers are noise)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefix caching of the KV cache and the Mamba state (default: on)",
    )
    g.add_argument(
        "--mamba-cache-mode",
        choices=list(_core.MAMBA_CACHE_MODES),
        default="auto",
        help="how Mamba states are checkpointed for prefix hits (default: auto; see `hybridserve config --explain`)",
    )
    g.add_argument(
        "--mamba-checkpoint-placement",
        choices=list(_core.CHECKPOINT_PLACEMENTS),
        default=None,
        help="where Mamba states are kept for prefix hits: branch (where prompts share a prefix, and at the "
        "last token of finished sequences), grid (every --mamba-block-size tokens), branch+grid (default: branch+grid in mode all, branch in align)",
    )
    g.add_argument(
        "--prefix-cache-eviction",
        choices=list(_core.EVICTION_POLICIES),
        default=None,
        help="which Mamba checkpoint goes when the state pool is full: flops (recency and prefill FLOPs saved "
        "per byte), lru, lru-path (LRU refreshing a hit's whole path) (default: flops)",
    )
    g.add_argument(
        "--shared-prefix-markers",
        default="auto",
        metavar="auto|none|IDS",
        help="token ids that end a chat message: a prompt up to the first of them (its system message) is "
        "taken as shared, and the first request to compute it keeps the Mamba state there, so that the second "
        "user already hits it (default: auto, the chat template's end-of-message token; ids separated by commas)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="the chat template to serve instead of the model's: a file holding a Jinja template, or the "
        "template itself (the chat routes, LLM.chat and the auto shared-prefix markers use it)",
    )
    g.add_argument(
        "--chat-template-content-format",
        choices=CHAT_CONTENT_FORMATS,
        default="auto",
        help="how the chat template is handed a message's content (vLLM's flag): string, openai (a list of "
        "text parts) or auto (default: the list for a template that loops over a message's content, such as "
        "Gemma 3's, else the string)",
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|FOLDER",
        help="default sampling parameters for requests that do not set them: auto (default) takes the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM "
        "does; vllm takes none; a folder, the generation_config.json in it",
    )
    g.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="generation-config fields set over it, e.g. '{\"temperature\": 0.5}'",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split long prompts over several steps (default: on; mamba cache mode align requires it)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' or '
        '\'{"method": "draft_model", "model": "DIR", "num_speculative_tokens": 3}\'',
    )
    g.add_argument(
        "--block-size", type=int, default=_core.DEFAULT_BLOCK_SIZE, help="tokens per KV block (default: 16)"
    )
    g.add_argument(
        "--mamba-block-size",
        type=int,
        default=None,
        help="tokens between grid Mamba checkpoints (default: the smallest multiple of lcm(block size, scan chunk) >= 256)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help=f"most running sequences (default: {_core.DEFAULT_MAX_NUM_SEQS}, lowered to what the Mamba "
        "state pool can run with its speculative windows and a checkpoint slot each)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per step (default: 2048, raised where the configuration needs more)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest sequence (default: the model's max_position_embeddings)",
    )
    g.add_argument(
        "--dtype",
        choices=[*DTYPES, *DTYPE_ALIASES],
        default="auto",
        help="model dtype (default: auto; vLLM's half, float and double name float16, float32, float64)",
    )
    g.add_argument(
        "--mamba-ssm-cache-dtype",
        choices=list(STATE_DTYPES),
        default="auto",
        help="dtype of the Mamba states (default: auto, the checkpoint's mamba_ssm_cache_dtype, else float32; "
        "unlike vLLM's auto never the model dtype; float32 also over a checkpoint that asks for less)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=list(KV_CACHE_DTYPES),
        default="auto",
        help="dtype of the KV cache (default: auto, the model dtype; fp8 is fp8_e4m3, kept without scales). "
        "K and V are rounded to it when written; prefix caching stays lossless",
    )
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: auto)")
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N processes (ranks; gloo on the CPU, NCCL on cuda:0..N-1; default: 1)",
    )
    g.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=only_one("hybridserve splits a model over devices by --tensor-parallel-size"),
        default=1,
        metavar="1",
        help="accepted for vLLM's command lines with 1 (the model is split by --tensor-parallel-size)",
    )
    g.add_argument("--seed", type=int, default=0, help="engine seed of sampling (default: 0)")
    g.add_argument(
        "--prefix-cache-hash-seed",
        type=int,
        default=None,
        metavar="SEED",
        help="secret seed of the prefix cache's block hashes, 0..2**64-1 (default: drawn from the OS at "
        "every start; give one only to make hashes repeatable, and keep it secret)",
    )
    g.add_argument("--kv-cache-memory", default=None, metavar="BYTES", help="KV cache budget, e.g. 2GiB")
    g.add_argument(
        "--mamba-cache-memory", default=None, metavar="BYTES", help="Mamba state cache budget, e.g. 1GiB"
    )
    g.add_argument(
        "--cache-memory",
        default=None,
        metavar="BYTES",
        help="both caches together, e.g. 3GiB (split: see config/sizing.py; with one of the two budgets above, the other gets the rest)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="FRACTION",
        help="vLLM's flag: accepted on the CPU, where it changes nothing (the budgets above size the "
        "caches, as on vLLM's CPU build); refused with --device cuda",
    )
    g.add_argument(
        "--num-kv-blocks", type=int, default=None, help="exact KV block count (overrides --kv-cache-memory)"
    )
    g.add_argument(
        "--num-mamba-slots",
        type=int,
        default=None,
        help="exact Mamba slot count (overrides --mamba-cache-memory)",
    )
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="CPU threads for the engine (torch's and the C++ kernels'; default: the usable cores minus one, "
        "or torch's choice when OMP_NUM_THREADS is set)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlapped steps: a step of decode rows computes on a background thread while the previous "
        "step's outputs are built (default: on when the native decode step runs the model and a core is "
        "left beside the CPU threads)",
    )
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--no-enforce-eager: on a GPU, steps of decode and verify rows replay CUDA graphs; "
        "--enforce-eager: every step runs eagerly (default: eager, as the captured graphs have not yet run on "
        "a device in the GPU tests; nothing changes on the CPU)",
    )
    g.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish KV cache events for cache-aware routers, in vLLM's format and spelling, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' '
        "(docs/kv-events.md; the events carry every request's token ids: publish on a trusted network)",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=DEFAULT_MAX_LOGPROBS,
        metavar="N",
        help=f"most log-probabilities a request may ask for per token (logprobs, top_logprobs, prompt_logprobs; "
        f"default: {DEFAULT_MAX_LOGPROBS}; -1: the vocabulary)",
    )
    g.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="structured outputs: a grammar (JSON schema, regex, ...) that takes longer to compile is "
        "refused with a 400 (default: 10)",
    )


def settle_model(ns: argparse.Namespace) -> str | None:
    """Puts MODEL or `--model` into `ns.model` (parsers `add_engine_args` gave both); an error
    message when neither is given or the two differ."""
    if not hasattr(ns, "model_option"):
        return None
    given, option = ns.model, ns.model_option
    if given is None and option is None:
        hint = ""
        if getattr(ns, "served_model_name", None):
            # (nargs="+", as vLLM's: it takes every word after it, MODEL too)
            hint = "; --served-model-name takes every name after it, so give MODEL before it"
        return f"MODEL is required: a model folder or 'demo' (or --model MODEL){hint}"
    if given is not None and option is not None and given != option:
        return f"MODEL {given!r} and --model {option!r} differ: give the model once"
    ns.model = given if given is not None else option
    return None


def normalize_flag_names(argv: Sequence[str], known: Collection[str]) -> list[str]:
    """`--flag_name[=value]` as `--flag-name[=value]` where that is one of the `known` flags:
    vLLM's parser takes either spelling, and command lines written for it use both (NVIDIA's
    `--mamba_ssm_cache_dtype float32`). Anything else (a value that starts with `--`, a flag of
    another program) is left as it is, and so is everything after a lone `--`."""
    out: list[str] = []
    for i, a in enumerate(argv):
        if a == "--":
            return out + list(argv[i:])
        name, eq, value = a.partition("=")
        dashed = name.replace("_", "-")
        if a.startswith("--") and dashed != name and dashed in known:
            a = dashed + eq + value
        out.append(a)
    return out


def add_config_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument(
        "--max-queue-len",
        type=int,
        default=DEFAULT_MAX_QUEUE_LEN,
        help="server admission limit (default: 512)",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--explain", action="store_true", help="also print every decision with its reason")
    out.add_argument("--json", action="store_true", help="print one JSON object")


def _one_paragraph(text: str) -> str:
    return " ".join(str(text).split())


def config_main(args: argparse.Namespace) -> int:
    """`hybridserve config MODEL [flags] [--explain | --json]`; exit 2 on a configuration error."""
    try:
        engine_args = EngineArgs.from_cli(args)
        resolved = engine_args.resolve()
        _check_folders(engine_args)
        no_plan = None
        if args.explain or _is_checkpoint(engine_args.model):
            # with the cache plan: pool sizes and the sequences the state pool can run; it needs a
            # config.json that describes the whole model (the policy needs only its capabilities).
            # A checkpoint the engine can load is always planned, so that `config` refuses the
            # sizes the engine would refuse (a folder of a config.json alone is the policy's)
            model_dir = resolve_model_dir(engine_args.model)
            if _is_checkpoint(engine_args.model):
                _check_marker_ids(engine_args, model_dir)
            no_plan = _why_no_plan(model_dir)
            if no_plan is None:
                resolved = plan_engine(engine_args, model_dir).resolved
    except HybridServeError as e:
        print(f"hybridserve config: {type(e).__name__}: {_one_paragraph(str(e))}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(resolved.to_dict(), indent=2))
    else:
        print(format_resolved(resolved, explain=args.explain))
        if no_plan is not None:
            print(f"cache plan: not computed: {no_plan}")
    return 0


def _check_folders(args: EngineArgs) -> None:
    """The folders the engine would read besides the model's, refused as it refuses them (without
    loading them): --tokenizer's tokenizer.json and the draft model's folder."""
    if args.tokenizer is not None:
        path = Path(args.tokenizer) / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(
                f"--tokenizer {args.tokenizer}: {path}: missing (a model folder needs tokenizer.json)"
            )
    spec = args.speculative()
    if spec is not None and spec.method == "draft_model" and spec.model != "demo":
        draft = Path(str(spec.model or ""))
        if not draft.is_dir():
            raise ConfigError(f"--speculative-config: model {draft}: model folder does not exist")
        if not (draft / "config.json").is_file():
            raise ConfigError(
                f"--speculative-config: model {draft}: {draft / 'config.json'}: no config.json in the model folder"
            )


def _check_marker_ids(args: EngineArgs, model_dir: str) -> None:
    """--shared-prefix-markers given as ids, refused as the engine refuses them (an id outside the
    tokenizer, which no prompt can hold; its size read as the engine's tokenizer reads it)."""
    markers = parse_shared_prefix_markers(args.shared_prefix_markers)
    if not isinstance(markers, tuple):
        return
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(args.tokenizer if args.tokenizer is not None else model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{path}: missing (a model folder needs tokenizer.json)")
    try:
        vocab_size = HFTokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # noqa: BLE001 - (the engine refuses it naming the file too)
        raise ConfigError(f"{path}: not a tokenizer: {e}") from None
    check_marker_ids(markers, vocab_size)


def _is_checkpoint(model: str) -> bool:
    """The demo model, or a folder with weights in it."""
    if model == "demo":  # (resolve_model_dir's name for it)
        return True
    folder = Path(model)
    return folder.is_dir() and any(folder.glob("*.safetensors"))


def _why_no_plan(model_dir: str) -> str | None:
    """None when the model's config.json parses as a whole model (so a plan can be made), else why
    not. Imports the architectures, and so torch."""
    from hybridserve.model.loader import load_config

    try:
        load_config(model_dir)
    except ConfigError as e:
        return _one_paragraph(str(e))
    return None
