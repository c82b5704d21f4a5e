"""One launcher detection for ckptconv's --part and nxdtrain's world (ckptconv.engine.launcher): torchrun over Slurm."""

from __future__ import annotations

import pytest

from ckptconv.engine.finalize import detect_part
from ckptconv.engine.launcher import Launch, detect_launch, local_world_size
from nxdtrain.parallel.dist import detect_env

# What each worker of `srun --nodes 2 --ntasks-per-node 1 torchrun --nproc-per-node 4 ...` sees on the
# second node: Slurm's variables describe the torchrun agent (task 1 of 2), torchrun's the worker.
SRUN_TORCHRUN = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1",
                 "SLURM_JOB_NODELIST": "trn-[04-05]", "SLURM_JOB_ID": "77",
                 "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                 "MASTER_ADDR": "trn-04", "MASTER_PORT": "29500"}
SRUN = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "node[1-2]"}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h0"}


@pytest.mark.parametrize(("env", "expected", "per_node"), [
    (SRUN_TORCHRUN, Launch(6, 8, 2, "torchrun"), 4),
    (SRUN, Launch(3, 4, 1, "slurm"), 2),
    (TORCHRUN, Launch(1, 2, 1, "torchrun"), 2),
    ({}, Launch(0, 1, 0, "single"), 1),
    ({"RANK": "3"}, Launch(0, 1, 0, "single"), 1),  # half a launcher's variables is none
    ({"RANK": "3", **SRUN}, Launch(3, 4, 1, "slurm"), 2),
])
def test_detect_launch(env, expected, per_node):
    assert detect_launch(env) == expected
    assert local_world_size(env) == per_node


@pytest.mark.parametrize("env", [SRUN_TORCHRUN, SRUN, TORCHRUN, {}])
def test_ckptconv_part_and_nxdtrain_world_agree(env, monkeypatch: pytest.MonkeyPatch):
    for var in {*SRUN_TORCHRUN, *SRUN, *TORCHRUN}:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    world = detect_env(env)
    assert detect_part() == (world.rank, world.world_size)
    assert world.launcher == detect_launch(env).launcher


def test_torchrun_under_srun_reaches_torchruns_rank_zero():
    world = detect_env(SRUN_TORCHRUN)
    assert (world.rank, world.world_size, world.local_rank, world.launcher) == (6, 8, 2, "torchrun")
    assert (world.master_addr, world.master_port) == ("trn-04", 29500)
