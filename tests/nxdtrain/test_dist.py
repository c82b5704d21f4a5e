"""Rank arithmetic in NxD order and launcher detection (no processes needed)."""

from __future__ import annotations

import pytest

from nxdtrain.dist import Coords, coords, detect_env, first_slurm_host, group_ranks, rank_of
from nxdtrain.errors import TrainError


def test_rank_order_is_nxds():
    """rank = pp·(dp·tp) + dp·tp + tp, for every rank of a 2 x 3 x 2 world."""
    tp, dp, pp = 2, 3, 2
    seen = []
    for rank in range(tp * dp * pp):
        c = coords(rank, tp=tp, dp=dp, pp=pp)
        assert rank == c.pp * (dp * tp) + c.dp * tp + c.tp == rank_of(c, tp=tp, dp=dp)
        seen.append(c)
    assert len(set(seen)) == tp * dp * pp
    assert coords(7, tp=2, dp=3, pp=2) == Coords(tp=1, dp=0, pp=1)


def test_groups():
    sizes = dict(tp=2, dp=2, pp=2)
    assert group_ranks("tp", **sizes) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks("dp", **sizes) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks("pp", **sizes) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks("mp", **sizes) == [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize("nodelist,host", [
    ("node001", "node001"),
    ("gpu-[017-020,031],cpu7", "gpu-017"),
    ("trn1-st-[3,5-9]", "trn1-st-3"),
    ("a,b", "a"),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_detect_env():
    torchrun = detect_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "1234",
                           "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (torchrun.rank, torchrun.world_size, torchrun.local_rank, torchrun.launcher) == (5, 8, 1, "torchrun")
    assert (torchrun.master_addr, torchrun.master_port) == ("h0", 1234)
    slurm = detect_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                        "SLURM_JOB_NODELIST": "trn-[04-05]", "SLURM_JOB_ID": "123456"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank, slurm.launcher) == (9, 16, 1, "slurm")
    assert (slurm.master_addr, slurm.master_port) == ("trn-04", 10000 + 123456 % 20000)
    assert detect_env({}).launcher == "single" and detect_env({}).world_size == 1
    with pytest.raises(TrainError, match="torchrun: MASTER_ADDR is not set"):
        detect_env({"RANK": "0", "WORLD_SIZE": "2"})
