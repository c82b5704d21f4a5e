"""NxD's own code on the expert-parallel ZeRO-1 files ckptconv writes (``reshard --optimizer-format nxd`` at ep > 1).

NxD's ``load_checkpoint`` of an ep > 1 tag needs a live model-parallel state with expert parallelism, which one
XLA:CPU process cannot build. What runs here instead is NxD's own code for every structural fact of those files,
unmodified (neuronx-distributed's source extracted outside this repository, ``--nxd-src``; stand-ins as
``stand_ins.py`` says):

* ``parallel_state.initialize_model_parallel(..., mesh_only=True)``: NxD's replica groups for a world of
  tp x pp x dp ranks (``torch.distributed``'s is_initialized, rank and world size answered for it: no process group is made).
  For every global rank: its file is ``optim/dp_rank_<its index in its dp group>_tp_rank_.._pp_rank_...pt``
  (``trainer/checkpoint.py``'s ``_get_path``), its ep rank its index in its expert-model-parallel group.
* ``NeuronEPZero1Optimizer.load_state_dict`` splits every file into the non-expert and expert
  ``NeuronZero1Optimizer`` states (recorded by two stand-in sub-optimizers); ``NeuronEPZero1Optimizer.state_dict``
  merges them back: the merge must give the file's dict again, key for key.
* torch-xla's ``ZeroRedundancyOptimizer._shard_tensor`` (pad dim 0, chunk, take ``group.index(rank)``) applied to the
  full moments of each parameter the rank holds, with NxD's dp group (non-expert) or expert-data-parallel group
  (experts): each must equal the split state's chunk. The full moments come from the model shards of the rank's
  own ep rank (tests/moe_tags.py: every component a function of its weight), its parameters in NxD's order (the
  shard's key order, the bias/norm groups of NxD's Llama example; an ep rank > 0's shard holds its experts only).

    NXD_SRC=<neuronx-distributed 2.29> .venv-xla/bin/python -m tools.nxd_check.ep_zero1 --out-root /tmp/ep

The tag is made in ``--out-root`` from a tiny Mixtral (tests/moe_tags.py), ep 1 -> ``reshard --optimizer-format nxd``
at each layout below. Prints one JSON line per layout; exits non-zero on the first difference.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import types
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from .stand_ins import install

LAYOUTS = [dict(ep=2, tp=1, dp=2), dict(ep=2, tp=2, dp=4), dict(ep=4, tp=1, dp=4), dict(ep=2, tp=1, dp=4),
           dict(ep=2, tp=1, dp=6), dict(ep=4, tp=2, dp=8)]  # the last two: padding experts
MOMENTS = ("exp_avg", "exp_avg_sq")


class _Sub:
    """A stand-in sub-optimizer: records what NxD's split hands it, gives it back to NxD's merge."""

    def __init__(self) -> None:
        self.loaded: dict | None = None

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state

    def state_dict(self) -> dict:
        return copy.deepcopy(self.loaded)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _shard(full: torch.Tensor, group: list[int], rank: int) -> torch.Tensor:
    """torch-xla's own ZeRO-1 shard of ``full`` for ``rank`` of ``group``."""
    from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer as Zero

    me = types.SimpleNamespace(local_world_size=len(group), local_rank=group.index(rank))
    me._pad_to_world_size = lambda t, w: Zero._pad_to_world_size(me, t, w)
    return Zero._shard_tensor(me, full)


def _model_shard(tag: Path, ep_rank: int, tp_rank: int) -> dict[str, torch.Tensor]:
    return torch.load(tag / "model" / f"dp_rank_00_ep_rank_{ep_rank:02d}_tp_rank_{tp_rank:02d}_pp_rank_00.pt",
                      weights_only=True)


def _order(names: list[str]) -> list[str]:
    """NxD's Llama example's param groups (weight decay; no decay for names with bias/norm), each in model order."""
    no_decay = [n for n in names if "bias" in n or "norm" in n]
    return [n for n in names if n not in no_decay] + no_decay


def check_tag(tag: Path, *, tp: int, ep: int, dp: int) -> dict:
    from neuronx_distributed.optimizer.zero_redundancy_optimizer import NeuronEPZero1Optimizer
    from neuronx_distributed.parallel_layers import parallel_state

    from tests.moe_tags import state_of

    world = tp * dp
    with mock.patch("torch.distributed.is_initialized", return_value=True), \
            mock.patch("torch.distributed.get_rank", return_value=0), \
            mock.patch("torch.distributed.get_world_size", return_value=world):
        groups = parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                                          mesh_only=True)
    find = lambda mesh, r: next(g for g in mesh if r in g)  # noqa: E731
    checked = 0
    for rank in range(world):
        dp_group, ep_group, edp_group = (find(m, rank) for m in (groups.dp_groups, groups.ep_model_groups,
                                                                    groups.ep_data_groups))
        tp_rank, dp_rank, ep_rank = find(groups.tp_groups, rank).index(rank), dp_group.index(rank), ep_group.index(rank)
        saved = torch.load(tag / "optim" / f"dp_rank_{dp_rank:02d}_tp_rank_{tp_rank:02d}_pp_rank_00.pt",
                           weights_only=True)
        optim = NeuronEPZero1Optimizer.__new__(NeuronEPZero1Optimizer)
        optim.non_ep_zero_optimizer, optim.ep_zero_optimizer = _Sub(), _Sub()
        NeuronEPZero1Optimizer.load_state_dict(optim, saved)  # NxD's split
        if not _same(NeuronEPZero1Optimizer.state_dict(optim), saved):  # NxD's merge
            raise SystemExit(f"rank {rank}: NxD's merge of its split does not give the file back")
        own, first, expert_keys = (_model_shard(tag, e, tp_rank) for e in (ep_rank, 0, 1))
        expert_keys = set(expert_keys)  # an ep rank > 0's shard holds its experts only
        experts = [k for k in own if k in expert_keys]
        dense = [k for k in first if k not in expert_keys and not k.endswith("inv_freq")]
        for sub, names, weights, group in ((optim.non_ep_zero_optimizer, _order(dense), first, dp_group),
                                           (optim.ep_zero_optimizer, _order(experts), own, edp_group)):
            state = sub.loaded
            if sorted(state) != ["base_state", "param_groups", "shape_info", "state"] or state["state"]:
                raise SystemExit(f"rank {rank}: a sub-optimizer state with keys {sorted(state)}")
            if [i for g in state["param_groups"] for i in g["params"]] != list(range(len(names))):
                raise SystemExit(f"rank {rank}: param groups {[g['params'] for g in state['param_groups']]}")
            for i, name in enumerate(names):
                full = state_of(weights[name])
                if state["shape_info"][i] != list(full["exp_avg"].shape):
                    raise SystemExit(f"rank {rank}: shape_info[{i}] {state['shape_info'][i]} for {name}")
                for m in MOMENTS:
                    want = _shard(full[m], group, rank)
                    if not torch.equal(state["base_state"][i][m], want):
                        raise SystemExit(f"rank {rank}: {name} {m} is not torch-xla's shard {group.index(rank)} "
                                         f"of group {group}")
                if float(state["base_state"][i]["step"]) != float(full["step"]):
                    raise SystemExit(f"rank {rank}: {name} step")
                checked += 1
    return {"tp": tp, "ep": ep, "dp": dp, "ranks": world, "parameters_checked": checked}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nxd-src", default=os.environ.get("NXD_SRC"), help="root of neuronx-distributed")
    parser.add_argument("--out-root", type=Path, required=True, help="a new folder for the tags")
    args = parser.parse_args(argv)
    if not args.nxd_src:
        raise SystemExit("--nxd-src: not given and $NXD_SRC unset")
    install(Path(args.nxd_src).resolve())
    import ckptconv
    from tests.moe_tags import tiny_moe, write_tag

    quiet = ckptconv.RunOptions(quiet=True, workers=1)
    hf = tiny_moe("mixtral", args.out_root / "hf")
    src = write_tag(hf, args.out_root / "src", dp=2, zero1=True)
    for layout in LAYOUTS:
        out = args.out_root / "ep{ep}_tp{tp}_dp{dp}".format(**layout)
        _reshard(src, out, layout, quiet)
        print(json.dumps(check_tag(out, **layout)), flush=True)
    return 0


def _reshard(src: Path, out: Path, layout: dict, quiet: Any) -> None:
    """``reshard --optimizer-format nxd`` with the tag's schedule made NxD's CosineAnnealing (its scheduler state)."""
    import ckptconv
    from ckptconv.io.digest import record_files
    from ckptconv.io.metadata import read_metadata, write_metadata

    torch.save({"step": 7, "schedule": "CosineAnnealing", "lr": 1e-3, "min_lr": 1e-4, "warmup": 2, "decay_steps": 20},
               src / "scheduler.pt")
    meta = read_metadata(src)
    meta.files.update({r: x.to_json() for r, x in record_files([src / "scheduler.pt"], src, "blake3").items()})
    write_metadata(src, meta)
    ckptconv.reshard(src, out, **layout, optimizer_format="nxd", drop_masters=True, options=quiet)


if __name__ == "__main__":
    sys.exit(main())
