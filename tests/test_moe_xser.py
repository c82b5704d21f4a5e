"""xser-split MoE shards at ep > 1 (NxD's ``use_xser`` save, docs/nxd-format.md §8): ``.info.pt`` marks
``expert_model_parallel`` True exactly on the stacked expert weights (NxD's ``_mark_expert_parallel_weights`` marks
them when ep > 1; its loader reads a marked tensor from the file's own ep rank, any other from ep rank 0's), ep
rank > 0 files hold expert tensor data only, ep 1 marks nothing, and the shards read back exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptconv
from ckptconv.io.safe_load import load_small
from tests.conftest import hf_state, warns_no_tokenizer
from tests.moe_tags import tiny_moe

QUIET = ckptconv.RunOptions(quiet=True, part=(0, 1))
# NxD's stacked expert weights (ExpertFusedColumnParallelLinear / ExpertFusedRowParallelLinear), by suffix
EXPERT_SUFFIXES = (".mlp.expert_mlps.mlp_op.gate_up_proj.weight", ".mlp.expert_mlps.mlp_op.down_proj.weight")


def marks(shard: Path) -> dict[str, bool]:
    """Each key of an xser-split shard and its ``expert_model_parallel`` mark (refs file -> tid -> .info.pt)."""
    refs, info = load_small(shard), load_small(Path(f"{shard}.info.pt"))
    assert sorted(info) == sorted(ref.tid for ref in refs.values())
    assert all(isinstance(info[tid]["expert_model_parallel"], bool) for tid in info)
    return {key: info[ref.tid]["expert_model_parallel"] for key, ref in refs.items()}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_ep2_xser_marks_exactly_the_expert_tensors_and_reads_back(family, tmp_path):
    hf = tiny_moe(family, tmp_path / "hf")
    out = ckptconv.to_nxd(hf, tmp_path / "nxd", tp=2, ep=2, flavour="xser-split", options=QUIET).out
    shards = sorted((out / "model").glob("*_ep_rank_*_pp_rank_??.pt"))
    assert len(shards) == 4  # ep 2 x tp 2
    experts_seen = 0
    for shard in shards:
        marked = marks(shard)
        for key, mark in marked.items():
            assert mark == key.endswith(EXPERT_SUFFIXES), (shard.name, key)
        experts_seen += sum(marked.values())
        if "_ep_rank_00_" not in shard.name:  # NxD's loader takes every unmarked tensor from ep rank 0's files
            assert all(marked.values()), shard.name
    assert experts_seen == 4 * 2 * 2  # 4 files x (gate_up, down) x 2 sparse layers (qwen3_moe: layer 1 dense)
    with warns_no_tokenizer():
        back = ckptconv.to_hf(out, tmp_path / "back", options=QUIET).out
    want, got = hf_state(hf), hf_state(back)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_ep1_xser_marks_nothing(tmp_path):
    """At ep 1 NxD does not mark its experts (the expert-parallel group has one rank)."""
    out = ckptconv.to_nxd(tiny_moe("mixtral", tmp_path / "hf"), tmp_path / "nxd", tp=2, flavour="xser-split",
                          options=QUIET).out
    shard = out / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    marked = marks(shard)
    assert any(key.endswith(EXPERT_SUFFIXES) for key in marked) and not any(marked.values())
