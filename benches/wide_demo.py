"""Writes the demo model with every layer FACTOR times wider: the same layer pattern, tokenizer and
chat template, head sizes and state size, with FACTOR times the hidden size, Mamba heads,
attention heads (and KV heads) and MLP width; random weights (seeded), written by transformers.

    .venv/bin/python benches/wide_demo.py DIR [--factor 4] [--seed 0]

For benchmarks where the demo model's compute is so cheap that the fixed cost of a request (the
HTTP round trip, a step's Python and dispatch) weighs as much as the prefill work they measure:
at factor 4 a prefill of 180 tokens costs about 5x the demo's. Its outputs are those of random
weights, which suits timing and cache benchmarks, not quality ones.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from hybridserve.model.demo import ensure_demo_model  # noqa: E402

# the files of the demo checkpoint a wider one shares as they are
SHARED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def wide_config(demo: dict, factor: int) -> dict:
    """The demo's config.json with every layer `factor` times wider (transformers' keyword names)."""
    cfg = {k: v for k, v in demo.items() if k not in ("architectures", "model_type", "dtype")}
    for key in (
        "hidden_size",
        "mamba_num_heads",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
    ):
        cfg[key] = demo[key] * factor
    # the ratio of Mamba channels to the hidden size is unchanged
    cfg["expand"] = cfg["mamba_num_heads"] * cfg["mamba_head_dim"] // cfg["hidden_size"]
    cfg["time_step_limit"] = [0.0, float("inf")]
    return cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.factor < 1:
        ap.error("--factor must be at least 1")
    import torch
    import transformers

    demo = Path(ensure_demo_model())
    cfg = wide_config(json.loads((demo / "config.json").read_text()), a.factor)
    torch.manual_seed(a.seed)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**cfg))
    a.dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.dir)
    for name in SHARED_FILES:
        shutil.copy(demo / name, a.dir / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {a.dir}: hidden size {cfg['hidden_size']}, {params / 1e6:.1f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
