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
