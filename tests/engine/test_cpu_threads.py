"""The engine's default CPU thread count (engine/cpu_threads.py): the usable cores minus one,
within the process's affinity and its cgroup's CPU quota; --cpu-threads and OMP_NUM_THREADS win."""

from __future__ import annotations

import os

from hybridserve.engine.cpu_threads import cgroup_cpu_limit, choose_cpu_threads, usable_cores


def test_the_default_leaves_one_core_and_explicit_settings_win():
    assert choose_cpu_threads(None, environ={}, cores=16).threads == 15
    assert choose_cpu_threads(None, environ={}, cores=2).threads == 1
    assert choose_cpu_threads(None, environ={}, cores=1).threads == 1
    given = choose_cpu_threads(3, environ={"OMP_NUM_THREADS": "1"}, cores=16)
    assert (given.threads, given.reason) == (3, "--cpu-threads")
    omp = choose_cpu_threads(None, environ={"OMP_NUM_THREADS": "4"}, cores=16)
    assert omp.threads is None and "OMP_NUM_THREADS=4" in omp.reason  # torch's own reading of it
    assert choose_cpu_threads(None, environ={"OMP_NUM_THREADS": " "}, cores=4).threads == 3


def test_tensor_parallel_ranks_share_the_default_cores():
    shared = choose_cpu_threads(None, environ={}, cores=16, ranks=2)
    assert shared.threads == 7 and "2 tensor-parallel ranks" in shared.reason
    assert choose_cpu_threads(None, environ={}, cores=8, ranks=4).threads == 1
    assert choose_cpu_threads(None, environ={}, cores=2, ranks=4).threads == 1  # (at least one)
    assert choose_cpu_threads(3, environ={}, cores=16, ranks=2).threads == 3  # (given: each rank's)


def test_usable_cores_are_the_affinity_within_the_cgroup_quota(tmp_path):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")  # a container with --cpus 1.5
    assert cgroup_cpu_limit(cpu_max) == 1.5
    cpu_max.write_text("max 100000\n")
    assert cgroup_cpu_limit(cpu_max) is None
    assert cgroup_cpu_limit(tmp_path / "absent") is None
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(cpu_limit=1.5) == 1
    assert usable_cores(cpu_limit=0.2) == 1
    assert usable_cores(cpu_limit=1000.0) == affinity
