"""PNG charts of a `bench serve` result (matplotlib, imported here only: `--plot` needs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install matplotlib (it is in the 'test' extra)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_serve(result: dict[str, Any], out_dir: str | Path, prefix: str | None = None) -> list[Path]:
    """Writes `<prefix>_latency.png` (TTFT, ITL, E2E histograms) and `<prefix>_throughput.png`
    (output tokens/s over the run); returns their paths."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = result["config"]
    name = prefix or f"serve_{cfg['workload']['name']}"
    title = (
        f"{cfg['workload']['name']}: {cfg['workload']['num_requests']} requests, rate {cfg['request_rate']}, "
        f"concurrency {cfg['concurrency']} ({cfg['model']})"
    )
    reqs = [r for r in result["requests"] if r["error"] is None and r["ttft_ms"] is not None]
    series = [
        ("TTFT", [r["ttft_ms"] for r in reqs]),
        ("ITL", list(result.get("itl_samples_ms") or [])),
        ("E2E latency", [r["e2e_ms"] for r in reqs]),
    ]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (label, values) in zip(axes, series):
        if values:
            ax.hist(values, bins=min(40, max(5, len(values) // 4)), color="#3b75af")
            st = result["summary"][{"TTFT": "ttft", "ITL": "itl", "E2E latency": "e2e"}[label]]
            for key, style in (("median_ms", "-"), ("p90_ms", "--"), ("p99_ms", ":")):
                if st.get(key) is not None:
                    ax.axvline(st[key], color="#c23b22", linestyle=style, label=f"{key[:-3]} {st[key]:.1f}")
            ax.legend(fontsize=7)
        ax.set_title(label)
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    p = out / f"{name}_latency.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    paths.append(p)

    tot = result["throughput_over_time"]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    xs = [(i + 0.5) * tot["bin_s"] for i in range(len(tot["output_tok_per_s"]))]
    ax.plot(xs, tot["output_tok_per_s"], color="#3b75af")
    ax.axhline(result["summary"]["output_throughput"], color="#c23b22", linestyle="--", label="mean")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = out / f"{name}_throughput.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    paths.append(p)
    return paths
