"""Scheduler overhead: vLLM's v1 Scheduler vs hybridserve's `_core.Scheduler`, in one run.

    .venv/bin/python benches/vllm_scheduler_compare.py [--steps 300] [--result-file F]

Installs vLLM (0.33.0, the wheel with --no-deps, plus the light dependencies its scheduler imports)
into its own throw-away virtual environment `.venv-vllm-peer/` (gitignored; `--venv` moves it) the
first time. vLLM is never a dependency of the project: the peer venv borrows torch from the
project's .venv through a `.pth` line appended after its own site-packages (so vLLM's pinned
packages, e.g. transformers 5.20.2, win), and runs the vLLM half of the benchmark as a subprocess
(`--worker`), while hybridserve's half runs in this process.

Both schedulers get the same hybrid cache layout (the demo model's: attention KV group + Mamba
group, B = 16, prefix caching on, mamba cache mode `align`, max_num_batched_tokens 8192,
max_num_seqs 256) and the same workloads:

- decode: 256 running requests (1024-token unique prompts), one step = schedule() +
  update_from_output() with one sampled token per request; median over --steps steps;
- burst-unique: 64 new 2048-token prompts at once, until every prompt is prefilled;
- burst-shared: 64 new 2048-token prompts sharing a 1536-token prefix.

The fake "model" outputs (token 7 for every row that produced logits) are built outside the timed
region for both. Reports per-step times and the ratio vLLM / hybridserve for each workload
(target: >= 50x at 256 running decode requests), by wall time (perf_counter) and by the thread's
CPU time (thread_time: less sensitive to other processes on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV = ROOT / ".venv-vllm-peer"
VLLM_VERSION = "0.33.0"
# vLLM's scheduler imports these (pip freeze of a working peer venv).
PEER_REQUIREMENTS = """
aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0
apache-tvm-ffi==0.1.11 attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0 certifi==2026.10.19.post1 click==8.5.1
cloudpickle==3.1.3 einops==0.8.2 fastapi==0.136.3 frozenlist==1.8.0 h11==0.16.0 hf-xet==1.8.0 httpcore2==2.16.2
httpx2==2.16.2 huggingface_hub==2.4.0 idna==3.20 llguidance==1.7.6 markdown-it-py==4.3.0 mdurl==0.1.2 msgspec==0.23.0
multidict==7.2.1 openai==3.57.0 oss-harmony==0.0.11 packaging==26.4 partial-json-parser==0.2.1.1.post7 pillow==13.0.0
prometheus_client==0.26.0 propcache==0.5.4 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 pydantic==2.14.4
pydantic_core==2.50.5 Pygments==2.21.0 PyYAML==6.0.4 pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 rich==15.0.0
safetensors==0.8.0 shellingham==1.5.4 sniffio==1.3.1 starlette==1.10.0 tokenizers==0.23.3 tqdm==4.70.1
transformers==5.20.2 truststore==0.10.5 typer==0.29.2 typing-inspection==0.4.5 urllib3==2.8.0 uvloop==0.23.0
xgrammar==0.2.8 yarl==1.25.1
""".split()

# Workload and cache layout shared by both halves.
BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 256
MAX_MODEL_LEN = 4096
NUM_KV_BLOCKS = 40000
DECODE_REQUESTS = 256
DECODE_PROMPT_LEN = 1024
BURST_REQUESTS = 64
BURST_PROMPT_LEN = 2048
BURST_SHARED_PREFIX = 1536
VOCAB = 1000


def decode_prompts() -> list[list[int]]:
    return [
        [(i * 131 + j * 7) % (VOCAB - 3) + 3 for j in range(DECODE_PROMPT_LEN)]
        for i in range(DECODE_REQUESTS)
    ]


def burst_prompts(shared: bool) -> list[list[int]]:
    out = []
    for i in range(BURST_REQUESTS):
        if shared:
            p = [(j * 13 + 5) % (VOCAB - 3) + 3 for j in range(BURST_SHARED_PREFIX)]
            p += [
                (i * 104729 + j * 31) % (VOCAB - 3) + 3 for j in range(BURST_PROMPT_LEN - BURST_SHARED_PREFIX)
            ]
        else:
            p = [(i * 7919 + j * 31 + (j * j) % 17) % (VOCAB - 3) + 3 for j in range(BURST_PROMPT_LEN)]
        out.append(p)
    return out


def summarize(times: list[float]) -> dict[str, float]:
    s = sorted(times)
    n = len(s)
    return {
        "n": n,
        "median_ms": statistics.median(s) * 1e3,
        "mean_ms": statistics.fmean(s) * 1e3,
        "p10_ms": s[n // 10] * 1e3,
        "p90_ms": s[min(n - 1, n * 9 // 10)] * 1e3,
    }


# ----------------------------------------------------------------------------- peer venv


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_peer_venv(venv: Path) -> Path:
    """Creates the throw-away vLLM venv if it is not complete yet; returns its python."""
    py = _venv_python(venv)
    marker = venv / ".hybridserve-peer-ready"
    if marker.exists():
        return py
    t0 = time.time()
    print(
        f"[peer] building {venv} (vLLM {VLLM_VERSION}, no deps; torch borrowed from {sys.prefix})", flush=True
    )
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    peer_site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # torch (and numpy) come from the project's venv, after the peer's own packages.
    (peer_site / "zz_borrow_project_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    dl = venv / "dl"
    wheels = sorted(dl.glob(f"vllm-{VLLM_VERSION}-*.whl")) if dl.exists() else []
    if not wheels:
        subprocess.run([*pip, "download", f"vllm=={VLLM_VERSION}", "--no-deps", "-d", str(dl)], check=True)
        wheels = sorted(dl.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    subprocess.run([*pip, "install", "--quiet", "--no-deps", str(wheels[0])], check=True)
    subprocess.run([*pip, "install", "--quiet", "--no-deps", *PEER_REQUIREMENTS], check=True)
    subprocess.run(
        [
            str(py),
            "-c",
            "import vllm.v1.core.sched.scheduler, torch; print('vllm ok, torch', torch.__version__)",
        ],
        check=True,
    )
    shutil.rmtree(dl, ignore_errors=True)  # the 336 MB wheel is installed now
    marker.write_text(f"vllm {VLLM_VERSION}\n")
    print(f"[peer] ready in {time.time() - t0:.0f} s", flush=True)
    return py


# ----------------------------------------------------------------------------- vLLM half (peer venv)


def _fake_vllm_output(s: Any, out: Any, model_runner_output_cls: Any) -> Any:
    """One token (7) for every scheduled request whose prompt is fully computed."""
    req_ids = list(out.num_scheduled_tokens.keys())
    sampled = []
    for rid in req_ids:
        r = s.requests[rid]
        sampled.append([7] if r.num_computed_tokens >= r.num_tokens else [])
    return model_runner_output_cls(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def vllm_worker(model_dir: str, steps: int) -> dict[str, Any]:
    import logging

    logging.disable(logging.WARNING)
    t_import = time.perf_counter()
    import torch
    import vllm
    from vllm import SamplingParams
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    import_s = time.perf_counter() - t_import
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)

    def make(max_num_seqs: int) -> Any:
        mc = ModelConfig(
            model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN
        )
        sc = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        )
        cc = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True, mamba_cache_mode="align")
        vc = VllmConfig(
            model_config=mc, scheduler_config=sc, cache_config=cc, device_config=DeviceConfig(device="cpu")
        )
        f32 = torch.float32
        kv = KVCacheConfig(
            num_blocks=NUM_KV_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["model.layers.3.mixer", "model.layers.6.mixer"],
                    FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=f32),
                ),
                KVCacheGroupSpec(
                    ["model.layers.0.mixer", "model.layers.2.mixer", "model.layers.5.mixer"],
                    MambaSpec(
                        block_size=BLOCK_SIZE,
                        shapes=((384, 3), (8, 32, 32)),
                        dtypes=(f32, f32),
                        mamba_cache_mode="align",
                    ),
                ),
            ],
        )
        vc.cache_config.num_gpu_blocks = NUM_KV_BLOCKS
        return Scheduler(
            vllm_config=vc,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            log_stats=False,
        )

    def request(rid: str, prompt: list[int], max_tokens: int) -> Any:
        return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), pooling_params=None,
                       block_hasher=hasher)  # fmt: skip

    # decode: 256 running requests
    s = make(MAX_NUM_SEQS)
    for i, p in enumerate(decode_prompts()):
        s.add_request(request(f"d{i}", p, 1 << 14))
    warm = 0
    while True:
        out = s.schedule()
        mro = _fake_vllm_output(s, out, ModelRunnerOutput)
        s.update_from_output(out, mro)
        warm += 1
        if (
            all(s.requests[f"d{i}"].num_output_tokens >= 2 for i in range(DECODE_REQUESTS))
            and len(out.num_scheduled_tokens) == DECODE_REQUESTS
        ):
            break
    for _ in range(20):
        out = s.schedule()
        s.update_from_output(out, _fake_vllm_output(s, out, ModelRunnerOutput))
    sched_t, upd_t, step_t, cpu_t = [], [], [], []
    for _ in range(steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        out = s.schedule()
        t1, c1 = time.perf_counter(), time.thread_time()
        mro = _fake_vllm_output(s, out, ModelRunnerOutput)
        c2, t2 = time.thread_time(), time.perf_counter()
        s.update_from_output(out, mro)
        t3, c3 = time.perf_counter(), time.thread_time()
        assert len(out.num_scheduled_tokens) == DECODE_REQUESTS
        sched_t.append(t1 - t0)
        upd_t.append(t3 - t2)
        step_t.append((t1 - t0) + (t3 - t2))
        cpu_t.append((c1 - c0) + (c3 - c2))
    res: dict[str, Any] = {
        "version": vllm.__version__,
        "torch": torch.__version__,
        "import_s": import_s,
        "decode": {
            "step": summarize(step_t),
            "step_cpu": summarize(cpu_t),
            "schedule": summarize(sched_t),
            "update": summarize(upd_t),
        },
    }

    # prefill bursts
    for shared in (False, True):
        s = make(BURST_REQUESTS)
        prompts = burst_prompts(shared)
        step_times: list[float] = []
        cpu_times: list[float] = []
        hit_tokens = 0
        tokens = 0
        t_total = time.perf_counter()
        for i, p in enumerate(prompts):
            s.add_request(request(f"b{i}", p, 1))
        while s.has_unfinished_requests():
            c0, t0 = time.thread_time(), time.perf_counter()
            out = s.schedule()
            t1, c1 = time.perf_counter(), time.thread_time()
            mro = _fake_vllm_output(s, out, ModelRunnerOutput)
            c2, t2 = time.thread_time(), time.perf_counter()
            s.update_from_output(out, mro)
            t3, c3 = time.perf_counter(), time.thread_time()
            cpu_times.append((c1 - c0) + (c3 - c2))
            step_times.append((t1 - t0) + (t3 - t2))
            tokens += out.total_num_scheduled_tokens
            for nr in out.scheduled_new_reqs:
                hit_tokens += nr.num_computed_tokens
        total = time.perf_counter() - t_total
        res["burst_shared" if shared else "burst_unique"] = {
            "steps": len(step_times),
            "total_ms": sum(step_times) * 1e3,
            "wall_incl_add_ms": total * 1e3,
            "per_step_ms": sum(step_times) * 1e3 / max(1, len(step_times)),
            "cpu_per_step_ms": sum(cpu_times) * 1e3 / max(1, len(cpu_times)),
            "scheduled_tokens": tokens,
            "hit_tokens": hit_tokens,
        }
    return res


# ----------------------------------------------------------------------------- hybridserve half


def hybridserve_run(steps: int, mode: str) -> dict[str, Any]:
    import numpy as np

    from hybridserve import _core

    def make(max_num_seqs: int) -> Any:
        cfg = _core.resolve_policy(
            has_mamba_layers=True,
            supports_boundary_states=True,
            scan_chunk_size=64,  # the demo model's
            max_position_embeddings=MAX_MODEL_LEN,
            enable_prefix_caching=True,
            mamba_cache_mode=mode,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            max_num_seqs=max_num_seqs,
            max_model_len=MAX_MODEL_LEN,
        )
        return _core.Scheduler(cfg, NUM_KV_BLOCKS, max_num_seqs + 2048 + 1), cfg

    def fake(out: Any) -> tuple[Any, Any]:
        num = (np.asarray(out.num_logits) > 0).astype(np.int32)
        return np.full(int(num.sum()), 7, dtype=np.int32), num

    s, cfg = make(MAX_NUM_SEQS)
    for i, p in enumerate(decode_prompts()):
        s.add_request(f"d{i}", p, max_tokens=1 << 14, ignore_eos=True)
    while True:
        out = s.schedule()
        sampled, num = fake(out)
        s.update_from_output(out, sampled, num)
        if out.num_decodes == DECODE_REQUESTS:
            break
    for _ in range(20):
        out = s.schedule()
        s.update_from_output(out, *fake(out))
    sched_t, upd_t, step_t, cpu_t = [], [], [], []
    for _ in range(steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        out = s.schedule()
        t1, c1 = time.perf_counter(), time.thread_time()
        sampled, num = fake(out)
        c2, t2 = time.thread_time(), time.perf_counter()
        s.update_from_output(out, sampled, num)
        t3, c3 = time.perf_counter(), time.thread_time()
        assert out.num_decodes == DECODE_REQUESTS
        sched_t.append(t1 - t0)
        upd_t.append(t3 - t2)
        step_t.append((t1 - t0) + (t3 - t2))
        cpu_t.append((c1 - c0) + (c3 - c2))
    res: dict[str, Any] = {
        "mode": cfg.mamba_cache_mode,
        "mamba_block_size": cfg.mamba_block_size,
        "decode": {
            "step": summarize(step_t),
            "step_cpu": summarize(cpu_t),
            "schedule": summarize(sched_t),
            "update": summarize(upd_t),
        },
    }
    for shared in (False, True):
        s, _ = make(BURST_REQUESTS)
        prompts = burst_prompts(shared)
        step_times: list[float] = []
        cpu_times: list[float] = []
        tokens = 0
        t_total = time.perf_counter()
        for i, p in enumerate(prompts):
            s.add_request(f"b{i}", p, max_tokens=1, ignore_eos=True)
        while s.has_unfinished_requests():
            c0, t0 = time.thread_time(), time.perf_counter()
            out = s.schedule()
            t1, c1 = time.perf_counter(), time.thread_time()
            sampled, num = fake(out)
            c2, t2 = time.thread_time(), time.perf_counter()
            s.update_from_output(out, sampled, num)
            t3, c3 = time.perf_counter(), time.thread_time()
            cpu_times.append((c1 - c0) + (c3 - c2))
            step_times.append((t1 - t0) + (t3 - t2))
            tokens += out.num_scheduled_tokens
        total = time.perf_counter() - t_total
        st = s.stats()
        res["burst_shared" if shared else "burst_unique"] = {
            "steps": len(step_times),
            "total_ms": sum(step_times) * 1e3,
            "wall_incl_add_ms": total * 1e3,
            "per_step_ms": sum(step_times) * 1e3 / max(1, len(step_times)),
            "cpu_per_step_ms": sum(cpu_times) * 1e3 / max(1, len(cpu_times)),
            "scheduled_tokens": tokens,
            "hit_tokens": int(st.get("prefix_hit_tokens", 0)),
            "lost_tokens": int(st.get("prefix_lost_tokens", 0)),
        }
    return res


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the peer venv (default .venv-vllm-peer)")
    ap.add_argument("--steps", type=int, default=300, help="timed decode steps per scheduler")
    ap.add_argument("--install-only", action="store_true", help="only build the peer venv")
    ap.add_argument(
        "--result-file", type=Path, default=ROOT / "benches" / "results" / "vllm_scheduler_compare.json"
    )
    ap.add_argument(
        "--worker", action="store_true", help=argparse.SUPPRESS
    )  # the vLLM half, in the peer venv
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        Path(a.worker_out).write_text(json.dumps(vllm_worker(a.model_dir, a.steps)))
        return 0

    py = ensure_peer_venv(a.venv)
    if a.install_only:
        return 0
    from hybridserve.model.demo import ensure_demo_model

    model_dir = str(ensure_demo_model())
    load_before = os.getloadavg()
    out = a.venv / "worker-result.json"
    print("[vllm] running vLLM's v1 Scheduler in the peer venv ...", flush=True)
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", PYTHONWARNINGS="ignore")
    subprocess.run(
        [
            str(py),
            __file__,
            "--worker",
            "--model-dir",
            model_dir,
            "--worker-out",
            str(out),
            "--steps",
            str(a.steps),
        ],
        check=True,
        env=env,
    )
    v = json.loads(out.read_text())
    print("[hybridserve] running _core.Scheduler (align, then all) ...", flush=True)
    h = {mode: hybridserve_run(a.steps, mode) for mode in ("align", "all")}
    load_after = os.getloadavg()

    rows = []
    for mode, hr in h.items():
        rows.append(
            {
                "workload": f"decode, {DECODE_REQUESTS} running (median step)",
                "hybridserve_mode": mode,
                "vllm_ms": v["decode"]["step"]["median_ms"],
                "hybridserve_ms": hr["decode"]["step"]["median_ms"],
                "ratio": _ratio(v["decode"]["step"]["median_ms"], hr["decode"]["step"]["median_ms"]),
                "vllm_cpu_ms": v["decode"]["step_cpu"]["median_ms"],
                "hybridserve_cpu_ms": hr["decode"]["step_cpu"]["median_ms"],
                "cpu_ratio": _ratio(
                    v["decode"]["step_cpu"]["median_ms"], hr["decode"]["step_cpu"]["median_ms"]
                ),
            }
        )
        for key, label in (("burst_unique", "unique prompts"), ("burst_shared", "shared 1536-token prefix")):
            rows.append(
                {
                    "workload": f"burst {BURST_REQUESTS}x{BURST_PROMPT_LEN}, {label} (per step)",
                    "hybridserve_mode": mode,
                    "vllm_ms": v[key]["per_step_ms"],
                    "hybridserve_ms": hr[key]["per_step_ms"],
                    "ratio": _ratio(v[key]["per_step_ms"], hr[key]["per_step_ms"]),
                    "vllm_cpu_ms": v[key]["cpu_per_step_ms"],
                    "hybridserve_cpu_ms": hr[key]["cpu_per_step_ms"],
                    "cpu_ratio": _ratio(v[key]["cpu_per_step_ms"], hr[key]["cpu_per_step_ms"]),
                    "vllm_steps": v[key]["steps"],
                    "hybridserve_steps": hr[key]["steps"],
                    "vllm_total_ms": v[key]["total_ms"],
                    "hybridserve_total_ms": hr[key]["total_ms"],
                    "vllm_hit_tokens": v[key]["hit_tokens"],
                    "hybridserve_hit_tokens": hr[key]["hit_tokens"],
                }
            )
    result = {
        "benchmark": "vllm_scheduler_compare",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": load_after,
        },  # fmt: skip
        "setup": {
            "block_size": BLOCK_SIZE,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "max_num_seqs": MAX_NUM_SEQS,
            "num_kv_blocks": NUM_KV_BLOCKS,
            "decode_prompt_len": DECODE_PROMPT_LEN,
            "steps": a.steps,
            "vllm_cache": "attention group (layers 3, 6) + Mamba group (layers 0, 2, 5), align",
        },
        "vllm": v,
        "hybridserve": h,
        "rows": rows,
    }
    a.result_file.parent.mkdir(parents=True, exist_ok=True)
    a.result_file.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"\nvLLM {v['version']} (torch {v['torch']}) vs hybridserve, load average {load_before[0]:.1f} -> {load_after[0]:.1f}"
    )
    print(
        f"{'workload':55s} {'hs mode':7s} {'vLLM ms':>8s} {'hs ms':>8s} {'ratio':>7s} | CPU: {'vLLM':>7s} {'hs':>7s} {'ratio':>7s}"
    )
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.0f}x"
        cratio = "-" if r["cpu_ratio"] is None else f"{r['cpu_ratio']:.0f}x"
        print(
            f"{r['workload']:55s} {r['hybridserve_mode']:7s} {r['vllm_ms']:8.3f} {r['hybridserve_ms']:8.4f} {ratio:>7s} |"
            f"      {r['vllm_cpu_ms']:7.3f} {r['hybridserve_cpu_ms']:7.4f} {cratio:>7s}"
        )
        if "vllm_steps" in r:
            print(f"{'':55s} steps vLLM {r['vllm_steps']} / hs {r['hybridserve_steps']}, hit tokens vLLM "
                  f"{r['vllm_hit_tokens']} / hs {r['hybridserve_hit_tokens']}")  # fmt: skip
    print(f"result: {a.result_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
