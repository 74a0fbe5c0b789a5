"""`hybridserve generate MODEL --prompt ...`: offline generation from the command line."""

from __future__ import annotations

import argparse
import json
import sys

# The command's own sampling defaults (greedy, 32 tokens). A flag given wins; then the model's
# generation config (--generation-config), as for the server's requests; then these.
CLI_DEFAULTS = {"max_tokens": 32, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def add_generate_args(p: argparse.ArgumentParser) -> None:
    from hybridserve.config import add_engine_args

    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    # (None: the model's generation config where it recommends a value, else these defaults)
    p.add_argument("--max-tokens", type=int, default=None, help=f"default {CLI_DEFAULTS['max_tokens']}")
    p.add_argument(
        "--temperature", type=float, default=None, help=f"default {CLI_DEFAULTS['temperature']} (greedy)"
    )
    p.add_argument("--top-p", type=float, default=None, help=f"default {CLI_DEFAULTS['top_p']}")
    p.add_argument("--top-k", type=int, default=None, help=f"default {CLI_DEFAULTS['top_k']}")
    p.add_argument("--min-p", type=float, default=None, help=f"default {CLI_DEFAULTS['min_p']}")
    p.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="sampling seed of every prompt (same seed, same output)",
    )
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeat for several)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(p)


def generate_main(args: argparse.Namespace) -> int:
    from hybridserve.config import EngineArgs
    from hybridserve.engine.llm import LLM
    from hybridserve.errors import HybridServeError
    from hybridserve.sampling.params import SamplingParams

    prompts = args.prompt or [line.rstrip("\r\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("hybridserve generate: give --prompt (or prompts on stdin, one per line)", file=sys.stderr)
        return 2
    try:
        engine_args = EngineArgs.from_cli(args)
        llm = LLM.from_engine_args(engine_args)
        model = llm.engine.default_sampling
        chosen = {}
        for name, default in CLI_DEFAULTS.items():
            given = getattr(args, name)
            chosen[name] = given if given is not None else model.get(name, default)
        params = SamplingParams(
            **chosen,
            repetition_penalty=model.get("repetition_penalty", 1.0),
            seed=args.sampling_seed,
            stop=list(args.stop),
            ignore_eos=args.ignore_eos,
        )
        outputs = llm.generate(prompts, params)
    except HybridServeError as exc:
        print(f"hybridserve generate: {exc}", file=sys.stderr)
        return 2
    for out in outputs:
        o = out.outputs[0]
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": out.prompt,
                        "text": o.text,
                        "token_ids": o.token_ids,
                        "finish_reason": o.finish_reason,
                        "num_cached_tokens": out.num_cached_tokens,
                    }
                )
            )
        else:
            print(f"{out.prompt}{o.text}")
    return 0
