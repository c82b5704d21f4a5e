"""Worker and thread counts follow the CPUs this process may use, not the machine's core count."""

from __future__ import annotations

import os

import pytest

from ckptconv.engine import options


@pytest.mark.parametrize("cpu_max,expected", [
    (None, 3),                  # no cgroup v2 file: the affinity mask
    ("max 100000\n", 3),        # no quota
    ("200000 100000\n", 2),     # 2 CPUs of quota under a 3-CPU mask
    ("50000 100000\n", 1),      # half a CPU still gets one
    ("garbage\n", 3),           # unreadable: ignored
])
def test_usable_cpus_is_the_affinity_mask_capped_by_the_cgroup_quota(tmp_path, monkeypatch, cpu_max, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    assert options.usable_cpus(str(path)) == expected


def test_default_workers_use_the_mask(monkeypatch):
    monkeypatch.setattr(options, "usable_cpus", lambda: 12)
    assert options.default_workers() == 12
    monkeypatch.setattr(options, "usable_cpus", lambda: 2)
    assert options.default_workers() == options.MIN_DEFAULT_WORKERS


def test_workers_for_a_conversion_follow_its_bytes_unless_given(monkeypatch):
    monkeypatch.setattr(options, "BYTES_PER_DEFAULT_WORKER", 32 * 2**20)  # conftest lowers it for other tests
    monkeypatch.setattr(options, "usable_cpus", lambda: 2)
    mib = 2**20
    assert options.workers_for(19 * 10**6, None) == 1      # the benchmark's tiny tag
    assert options.workers_for(0, None) == 1                # nothing left to write still gets a worker
    assert options.workers_for(32 * mib + 1, None) == 2
    assert options.workers_for(256 * mib, None) == 8        # MIN_DEFAULT_WORKERS on 2 cores
    assert options.workers_for(10**11, None) == 8
    assert options.workers_for(19 * 10**6, 5) == 5          # --workers wins, however small the conversion
    monkeypatch.setattr(options, "usable_cpus", lambda: 64)
    assert options.workers_for(10**11, None) == 64
    assert options.workers_for(100 * mib, None) == 4


@pytest.mark.parametrize("given,expected", [(None, 1), (3, 3)])
def test_a_conversion_runs_the_workers_chosen_for_it(tiny_models, tmp_path, monkeypatch, given, expected):
    """The pool the executor opens is workers_for(the bytes written, --workers), and the CLI passes None unless
    --workers is given."""
    import ckptconv
    from ckptconv.cli.main import build_parser
    from ckptconv.engine import execute

    monkeypatch.setattr(options, "BYTES_PER_DEFAULT_WORKER", 32 * 2**20)
    pools: list[int] = []
    real = execute.ThreadPoolExecutor

    def recording(max_workers: int) -> execute.ThreadPoolExecutor:
        pools.append(max_workers)
        return real(max_workers=max_workers)

    monkeypatch.setattr(execute, "ThreadPoolExecutor", recording)
    src = tiny_models("llama")
    ckptconv.to_nxd(src, tmp_path / "out", tp=2, options=ckptconv.RunOptions(workers=given, quiet=True))
    assert pools == [expected, expected]  # the bands' pool and the digests' pool
    argv = ["to-nxd", str(src), str(tmp_path / "o2"), "--tp", "2"]
    assert build_parser().parse_args(argv + ([] if given is None else ["--workers", str(given)])).workers == given
