"""An MoE training tag's optimizer state across expert parallelism (issue 29, training state): ``reshard`` carries
each expert's moments and fp32 masters with its expert, exactly, between ep 1 and ep 2 (and to other tp, dp and
ZeRO-1 settings), in nxdtrain's format 2 as docs/nxd-optimizer-format.md places it; the resharded tag verifies,
inspects and exports its masters; what is not done yet is refused in one line.

The tags are hand-written (tests/moe_tags.py); expectations come from the HF weights (every component an
elementwise function of its weight) and are read out of the tags by hand in NxD's expert layout.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptconv
from ckptconv.commands.verify import verify
from ckptconv.core.plan import Source
from ckptconv.errors import ConversionError
from ckptconv.io.nxd_read import load_shard
from ckptconv.sources.nxd import open_nxd
from ckptconv.training import TagOptimizer
from ckptconv.training.nxdtrain_format.state import component_source
from tests.conftest import warns_no_tokenizer
from tests.moe_tags import COMPONENTS, E, all_state, expected_expert, expert_in_tag, state_of, write_tag

QUIET = ckptconv.RunOptions(quiet=True, workers=1)
LAYERS = {"mixtral": (0, 1), "qwen3_moe": (0, 2)}  # Qwen3-MoE's layer 1 is dense


def _check_tag(tag: Path, hf_dir: Path, family: str) -> int:
    """Every optimizer tensor of ``tag`` is its weight's function (so it sits where its weight sits, and the weights
    are the HF model's: tests/test_moe.py), held once; every expert's state equals the HF expert's, read by hand."""
    held = all_state(tag)
    count = 0
    for shard in sorted((tag / "model").iterdir()):
        for key, weight in load_shard(shard).items():
            if key.endswith("inv_freq"):
                continue
            for component, want in state_of(weight).items():
                got = held[(shard.name, f"state.{key}.{component}")]
                assert got.dtype == want.dtype and torch.equal(got, want), (tag.name, shard.name, key, component)
                count += 1
    assert count == len(held)  # nothing else, nothing twice
    for layer in LAYERS[family]:
        for expert in range(E):
            for component in COMPONENTS:
                got = expert_in_tag(tag, layer, expert, component)
                want = expected_expert(hf_dir, family, layer, expert, component)
                for name, a, b in zip(("gate", "up", "down"), got, want, strict=True):
                    assert torch.equal(a, b), (tag.name, layer, expert, component, name)
    return count


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_reshard_ep1_ep2_ep1_carries_each_experts_state(moe_hf, tmp_path: Path, family: str):
    """ep 1 (ZeRO-1 over dp 2) -> ep 2 x tp 2 (ZeRO-1 over dp 4: 2 expert-data-parallel ranks per ep rank) -> ep 1
    without ZeRO-1: every expert's moments and masters with it; back at ep 1 every tensor as the tag had it."""
    src = write_tag(moe_hf(family), tmp_path / "ep1", dp=2, zero1=True)
    _check_tag(src, moe_hf(family), family)
    ckptconv.reshard(src, tmp_path / "ep2", ep=2, tp=2, dp=4, options=QUIET)
    names = sorted(p.name for p in (tmp_path / "ep2" / "optim").iterdir())
    assert names == [f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt" for d in range(4) for t in range(2)]
    _check_tag(tmp_path / "ep2", moe_hf(family), family)
    ckptconv.reshard(tmp_path / "ep2", tmp_path / "back", ep=1, tp=1, zero1=False, options=QUIET)
    _check_tag(tmp_path / "back", moe_hf(family), family)
    before, after = all_state(src), all_state(tmp_path / "back")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(("source", "target"), [
    (dict(ep=2, dp=2, zero1=False), dict(ep=1, tp=2, dp=3, zero1=True)),
    (dict(ep=2, dp=4, zero1=True), dict(ep=4, pp=2, dp=4, zero1=True)),
    (dict(ep=2, tp=2, dp=2, zero1=True), dict(ep=2, tp=1, zero1=False)),
], ids=["ep2-to-tp2-dp3-zero1", "ep2-dp4-to-ep4-pp2", "ep2-tp2-to-ep2-no-zero1"])
def test_reshard_of_an_ep_tag_to_other_tp_dp_zero1(moe_hf, tmp_path: Path, source: dict, target: dict):
    family = "mixtral"
    src = write_tag(moe_hf(family), tmp_path / "src", **source)
    _check_tag(src, moe_hf(family), family)
    ckptconv.reshard(src, tmp_path / "out", options=QUIET, **target)
    _check_tag(tmp_path / "out", moe_hf(family), family)


def test_zero1_placement_follows_nxds_expert_data_parallel_groups(moe_hf, tmp_path: Path):
    """dp 4, ep 2: dp rank d holds ep rank d % 2's experts (partitioned over its 2 expert-data-parallel ranks) and a
    part of the non-expert state (over all 4); every file records ep and its ep rank, none names the ep rank."""
    src = write_tag(moe_hf("mixtral"), tmp_path / "src")
    ckptconv.reshard(src, tmp_path / "out", ep=2, dp=4, zero1=True, options=QUIET)
    files = [torch.load(tmp_path / "out" / "optim" / f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt", weights_only=True)
             for d in range(4)]
    assert [(f["ep"], f["ep_rank"], f["dp_rank"], f["zero_size"]) for f in files] == [
        (2, 0, 0, 4), (2, 1, 1, 4), (2, 0, 2, 4), (2, 1, 3, 4)]
    experts = {d: {n for n in f["owned"] if "expert_mlps" in n} for d, f in enumerate(files)}
    assert experts[0] | experts[2] == experts[1] | experts[3] and not experts[0] & experts[2]
    assert experts[0] and experts[2]  # both expert-data-parallel ranks of ep rank 0 hold some
    dense = [n for f in files for n in f["owned"] if "expert_mlps" not in n]
    assert len(dense) == len(set(dense))  # each non-expert parameter's state in exactly one of the four files


def test_resharded_tag_verifies_inspects_and_exports_its_masters(moe_hf, tmp_path: Path):
    family = "qwen3_moe"
    src = write_tag(moe_hf(family), tmp_path / "src", dp=2, zero1=True)
    ckptconv.reshard(src, tmp_path / "out", ep=2, tp=2, options=QUIET)
    report = verify(moe_hf(family), tmp_path / "out")
    assert report["ok"], report["problems"]
    info = ckptconv.inspect(tmp_path / "out")
    assert info["layout"]["ep"] == 2
    assert info["optimizer"]["components"] == ["step", "exp_avg", "exp_avg_sq", "master"]
    assert (info["optimizer"]["zero1"], info["optimizer"]["dp"], info["optimizer"]["files"]) == (True, 2, 4)
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "out", tmp_path / "moe_hf", masters=True, options=QUIET)
    exported, original = load_file(tmp_path / "moe_hf" / "model.safetensors"), load_file(moe_hf(family) / "model.safetensors")
    assert exported.keys() == original.keys()
    for key, value in original.items():  # the masters (weight + 0.25), not the shards' weights
        assert torch.equal(exported[key], COMPONENTS["master"](value)), key


def test_one_ranks_files_only(moe_hf, tmp_path: Path):
    """TagOptimizer(only=...), the files one training rank opens: ep rank 1's experts (shard (1, 0, 0)) from dp ranks
    1 and 3 only; the non-expert state of ep rank 0's shard (0, 0, 0) may lie in any dp rank's file."""
    src = write_tag(moe_hf("mixtral"), tmp_path / "src", ep=2, dp=4, zero1=True)
    opened = open_nxd(src)
    expert_shard, dense_shard = (f"model/dp_rank_00_ep_rank_{e:02d}_tp_rank_00_pp_rank_00.pt" for e in (1, 0))
    expert, dense = "model.layers.1.mlp.expert_mlps.mlp_op.down_proj.weight", "model.norm.weight"
    with opened.ckpt:
        optim = TagOptimizer(src, opened.spec, opened.layout, only={(1, 0, 0)})
        try:
            assert sorted(f.path.name[:10] for f in optim.files) == ["dp_rank_01", "dp_rank_03"]
            got = optim.read_rows(component_source(Source(expert_shard, expert), "exp_avg"), 0, 2)
            assert torch.equal(got, state_of(load_shard(src / expert_shard)[expert])["exp_avg"])
            optim.widen({(0, 0, 0)})
            assert len(optim.files) == 4
            got = optim.read_rows(component_source(Source(dense_shard, dense), "master"), 0, 8)
            assert torch.equal(got, state_of(load_shard(src / dense_shard)[dense])["master"])
        finally:
            optim.close()


def test_refusals(moe_hf, tmp_path: Path):
    src = write_tag(moe_hf("mixtral"), tmp_path / "src", dp=3, zero1=True)
    with pytest.raises(ConversionError, match=r"--dp 3 with ZeRO-1 at ep 2: dp must be a multiple of ep"):
        ckptconv.reshard(src, tmp_path / "a", ep=2, options=QUIET)
    with pytest.raises(ConversionError, match=r"ep 2, --part: a training tag with ep > 1 is resharded by one process"):
        ckptconv.reshard(src, tmp_path / "c", ep=2, dp=2, options=ckptconv.RunOptions(quiet=True, part=(0, 2)))
    assert not any((tmp_path / d).exists() for d in "abc")


def test_optimizer_files_of_another_ep_are_refused(moe_hf, tmp_path: Path):
    """A file whose recorded ep rank is not its dp rank's is never read as that rank's experts."""
    src = write_tag(moe_hf("mixtral"), tmp_path / "src", ep=2, dp=2, zero1=True)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    path = bad / "optim" / "dp_rank_01_tp_rank_00_pp_rank_00.pt"
    state = torch.load(path, weights_only=True)
    state["ep_rank"] = 0
    torch.save(state, path)
    with pytest.raises(ConversionError, match=r"dp_rank_01_tp_rank_00_pp_rank_00.pt: optimizer state of ep 2 \(ep "
                                              r"rank 0\), but the shards are of ep 2 \(dp rank 1: ep rank 1\)"):
        ckptconv.reshard(bad, tmp_path / "out", ep=1, options=ckptconv.RunOptions(quiet=True, check=False))


def test_full_state_of_ep_shards_is_the_hf_model(moe_hf, tmp_path: Path):
    """``nxd-compat --convert_to_full_state`` of ep 2 shards (refused before: all_shard_records had no ep): every HF
    tensor, each expert read from its ep rank's shard, in the key order of the same shards at ep 1."""
    from ckptconv.commands.full_state import to_full_state

    for ep in (1, 2):
        ckptconv.to_nxd(moe_hf("mixtral"), tmp_path / f"ep{ep}", ep=ep, tp=2, options=QUIET)
        to_full_state(tmp_path / f"ep{ep}", tmp_path / f"full{ep}", config=moe_hf("mixtral") / "config.json", hints={},
                      options=QUIET)
    one, two = (torch.load(tmp_path / f"full{ep}" / "checkpoint.pt", weights_only=True) for ep in (1, 2))
    original = load_file(moe_hf("mixtral") / "model.safetensors")
    assert list(two) == list(one) and set(two) == set(original)
    assert all(torch.equal(two[k], original[k]) for k in original)


def test_one_training_ranks_resume_reads_its_state_at_another_ep(moe_hf, tmp_path: Path):
    """What a training rank's resume does (nxdtrain/checkpoint/restore.py's steps, through ckptconv's entry points):
    the reshard plan of an ep 2 tag to the run's layout, the rank's own shard, only the optimizer files its pieces
    read, each parameter's state read in the rank's layout: equal to the state of the weight it reads there."""
    from ckptconv.core import ParallelLayout, all_ep_shard_records, layout_shard_file, plan_reshard
    from ckptconv.engine import read_tensor
    from ckptconv.training import TagReader, state_tensors

    src = write_tag(moe_hf("qwen3_moe"), tmp_path / "src", ep=2, dp=4, zero1=True)
    opened = open_nxd(src)
    with opened.ckpt as ckpt:
        records = all_ep_shard_records(opened.spec, opened.layout)
        dtypes = {r.key: torch.float32 for shard in records.values() for r in shard}
        for run in (ParallelLayout(tp=2), ParallelLayout(ep=4)):
            plan = plan_reshard(opened.spec, opened.layout, run, dtypes)
            for ep in range(run.ep):
                wanted = layout_shard_file(run, ep_rank=ep, tp_rank=run.tp - 1, pp_rank=0)
                tensors = {t.key: t for f in plan.files if f.path == wanted for t in f.tensors}
                read_from = {p.source.shard for t in tensors.values() for p in t.pieces}  # (ep, tp, pp), from the plan
                optim = TagOptimizer(src, opened.spec, opened.layout,
                                     only={r for r in read_from if r is not None})
                try:
                    reader = TagReader(ckpt, optim)
                    for key, weight in tensors.items():
                        if key.endswith("inv_freq"):
                            continue
                        want = state_of(read_tensor(weight, reader))
                        for component, planned in state_tensors(weight, optim).items():
                            assert torch.equal(read_tensor(planned, reader), want[component]), (run, ep, key)
                finally:
                    optim.close()


def test_nxds_own_ep_optimizer_files_are_refused_by_name(moe_hf, tmp_path: Path):
    """An ep > 1 tag whose optim/ is not NeuronEPZero1Optimizer's merged files (read by
    tests/training/nxd_format/test_ep_files.py): refused in one line naming the file and the key; --weights-only then works."""
    ckptconv.to_nxd(moe_hf("mixtral"), tmp_path / "nxd", ep=2, options=QUIET)
    (tmp_path / "nxd" / "optim").mkdir()
    for d in range(2):  # NeuronZero1Optimizer's keys, as at ep 1
        torch.save({"state": {}, "param_groups": [], "base_state": {}, "shape_info": {}},
                   tmp_path / "nxd" / "optim" / f"dp_rank_{d:02d}_tp_rank_00_pp_rank_00.pt")
    unchecked = ckptconv.RunOptions(quiet=True, workers=1, check=False)  # optim/ is not in ckptconv.json
    with pytest.raises(ConversionError, match=r"dp_rank_00_tp_rank_00_pp_rank_00.pt: no 'ep_param_id_offset'; the "
                                              r"shards are expert-parallel, so NxD's files are "
                                              r"NeuronEPZero1Optimizer's \(ep_param_id_offset, "):
        ckptconv.reshard(tmp_path / "nxd", tmp_path / "a", ep=1, options=unchecked)
    ckptconv.reshard(tmp_path / "nxd", tmp_path / "b", ep=1, weights_only=True, options=unchecked)
    assert not (tmp_path / "b" / "optim").exists()
