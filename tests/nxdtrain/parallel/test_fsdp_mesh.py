"""The FSDP2 mesh is built on the run's own process groups: ``--shard-params`` adds no process group (its mesh's
shard dimension is nxdtrain's dp group; at dp 1, where nxdtrain keeps none, one group of one rank), ``--hybrid-shard
N`` adds only its replicate and shard groups, laid out as NxD's dp order says (dp ranks ``k·N .. k·N + N - 1`` share
one copy). Counted on torch's own group registry."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from nxdtrain.parallel.dist import Mesh, spawn


def _groups() -> set[object]:
    return set(dist.distributed_c10d._world.pg_map)  # every process group this rank is a member of


def _mesh_worker() -> None:
    from nxdtrain.parallel.fsdp import dp_mesh

    dist.init_process_group("gloo", init_method="env://", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    try:
        rank = dist.get_rank()
        # tp 2 x dp 2, --shard-params: the mesh is the run's dp group, nothing made
        run = Mesh(tp=2, pp=1, timeout_s=60)
        before = _groups()
        mesh = dp_mesh("cpu", run, 2)
        assert _groups() == before, f"rank {rank}: new groups {_groups() - before}"
        assert mesh.get_group("shard") is run.dp_group and mesh.get_local_rank("shard") == run.coords.dp
        assert mesh.mesh.tolist() == [rank % 2, rank % 2 + 2]  # tp fastest: the dp peers are two ranks apart
        # tp 1 x dp 4, --hybrid-shard 2: only the replicate and shard groups are made
        run = Mesh(tp=1, pp=1, timeout_s=60)
        before = _groups()
        mesh = dp_mesh("cpu", run, 2)
        replicate, shard = mesh.get_group("replicate"), mesh.get_group("shard")
        assert _groups() - before == {replicate, shard}, f"rank {rank}: new groups {_groups() - before}"
        assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
        assert dist.get_process_group_ranks(shard) == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert dist.get_process_group_ranks(replicate) == [rank % 2, rank % 2 + 2]
        assert (mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")) == (rank // 2, rank % 2)
        # the groups work: a sum over the shard group
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=shard)
        assert total.item() == (rank // 2 * 2) * 2 + 1
        # tp 4 x dp 1, --shard-params: the run keeps no dp group of one rank; one is made for the mesh, nothing else
        run = Mesh(tp=4, pp=1, timeout_s=60)
        assert run.dp_group is None
        before = _groups()
        mesh = dp_mesh("cpu", run, 1)
        assert _groups() - before == {mesh.get_group("shard")} and mesh.mesh.tolist() == [rank]
    finally:
        dist.destroy_process_group()


def test_fsdp_mesh_reuses_the_run_groups():
    assert spawn(_mesh_worker, (), 4, timeout_s=120) == 0
