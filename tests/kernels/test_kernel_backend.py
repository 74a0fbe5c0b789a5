"""The kernel backend is chosen once, when the model runner starts, logged, and used by every
call; HYBRIDSERVE_KERNELS chooses by hand and a choice that cannot run is a configuration error.
The kernel sources ship inside the package (an installed wheel carries them)."""

from __future__ import annotations

import logging
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hybridserve.errors import ConfigError
from hybridserve.kernels import backend, cuda, native
from hybridserve.kernels.backend import Backend

ROOT = Path(__file__).resolve().parents[2]


def _llm(**kw: object):  # noqa: ANN202
    from hybridserve import LLM

    return LLM("demo", dtype="float32", max_model_len=128, max_num_seqs=2, **kw)


@pytest.mark.skipif(native.build() is None, reason="no C++ compiler: the CPU has no native kernels")
def test_the_runner_pins_the_cpu_kernels_and_logs_them(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hybridserve.engine"):
        llm = _llm()
    assert llm.engine.runner.kernels is Backend.CPU_NATIVE
    assert backend.pinned() is Backend.CPU_NATIVE
    assert native.library() is not None
    assert any(r.getMessage().startswith("kernels: cpu-native") for r in caplog.records)


def test_reference_kernels_by_hand_reach_no_cpp_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDSERVE_KERNELS", "reference")
    llm = _llm()
    assert llm.engine.runner.kernels is Backend.REFERENCE
    calls: list[str] = []
    for name in ("mamba_decode", "mamba_prefill", "paged_attention", "rms_norm", "gated_rms_norm"):
        real = getattr(native, name)

        def spy(*a: object, _real=real, _name=name, **k: object) -> object:
            out = _real(*a, **k)
            if out is not None:
                calls.append(_name)
            return out

        monkeypatch.setattr(native, name, spy)
    from hybridserve.sampling.params import SamplingParams

    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert calls == []  # every op ran its pure-torch twin


@pytest.mark.parametrize(
    ("value", "match"), [("cuda", "not on a CUDA device"), ("turbo", "HYBRIDSERVE_KERNELS must be one of")]
)
def test_a_kernel_choice_that_cannot_run_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, value: str, match: str
) -> None:
    monkeypatch.setenv("HYBRIDSERVE_KERNELS", value)
    with pytest.raises(ConfigError, match=match):
        _llm()


def test_the_wheel_carries_every_kernel_source(tmp_path: Path) -> None:
    """Build the wheel as `pip wheel .` does (maturin, the build backend), install it without its
    dependencies into a folder of its own, and find every source there, away from the checkout."""
    maturin = Path(sys.executable).with_name("maturin")
    subprocess.run(
        [str(maturin), "build", "--release", "--quiet", "--out", str(tmp_path / "dist")],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=900,
    )
    (wheel,) = (tmp_path / "dist").glob("hybridserve-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "site")
    code = (
        "import sys; from hybridserve.kernels import cuda, native;"
        "print(cuda.cuda_source_dir()); print(native.source_dir()); print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout.split()
    cuda_dir, cpu_dir = Path(out[0]), Path(out[1])
    assert tmp_path / "site" in cuda_dir.parents and tmp_path / "site" in cpu_dir.parents
    for folder, names in ((cuda_dir, cuda.SOURCE_FILES), (cpu_dir, native.SOURCE_FILES)):
        for name in names:
            assert (folder / name).is_file(), name
    assert out[2] == "False"  # finding the sources needs no torch
