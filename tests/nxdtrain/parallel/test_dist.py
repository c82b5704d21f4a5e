"""Rank arithmetic in NxD order and launcher detection (no processes needed)."""

from __future__ import annotations

import pytest

from nxdtrain.errors import TrainError
from nxdtrain.parallel.dist import Coords, coords, detect_env, first_slurm_host, group_ranks, rank_of


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


@pytest.mark.parametrize("tp,dp,pp,cp", [(8, 2, 1, 2), (2, 3, 2, 2), (1, 2, 2, 4), (4, 1, 1, 1)])
def test_context_parallel_rank_order_is_nxds(tp, dp, pp, cp):
    """NxD's parallel_state lays ranks out as arange(world).reshape(pp, dp, cp, tp) and takes each group as one
    axis of it (its zero1 sharding groups: the dp x cp plane, dp-major); the groups here are the same lists."""
    import torch

    grid = torch.arange(tp * dp * pp * cp).reshape(pp, dp, cp, tp)
    sizes = dict(tp=tp, dp=dp, pp=pp, cp=cp)

    def axis(*keep: int) -> list[list[int]]:  # groups varying along the kept axes, in rank order of their first member
        dims = list(keep) + [d for d in range(4) if d not in keep]
        moved = grid.permute(*dims[len(keep):], *keep).reshape(-1, int(torch.tensor(grid.shape)[list(keep)].prod()))
        return sorted(moved.tolist())

    assert group_ranks("tp", **sizes) == axis(3)
    assert group_ranks("cp", **sizes) == axis(2)
    assert group_ranks("dp", **sizes) == axis(1)
    assert group_ranks("pp", **sizes) == axis(0)
    assert group_ranks("dpcp", **sizes) == axis(1, 2)
    for rank in range(tp * dp * pp * cp):
        c = coords(rank, **sizes)
        assert int(grid[c.pp, c.dp, c.cp, c.tp]) == rank == rank_of(c, tp=tp, dp=dp, cp=cp)
    # cp 1 is the order without context parallelism
    if cp == 1:
        assert [coords(r, **sizes) for r in range(tp * dp * pp)] == [coords(r, tp=tp, dp=dp, pp=pp) for r in range(tp * dp * pp)]


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
