"""Tags written before optimizer state by parameter name (format 1, a real one: fixtures/nxdtrain-format1) resume
with their full state: at the same layout and at dp 1 without ZeRO-1, steps 3-4 equal the run that wrote it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptconv.commands.api import RunOptions, reshard, to_hf
from tests.conftest import REPO, warns_no_tokenizer
from tests.nxdtrain.harness import DIST_TIMEOUT, run_world

FIXTURE = REPO / "fixtures" / "nxdtrain-format1"


@pytest.fixture()
def tag(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE / "step_2", tmp_path / "old" / "step_2"))


def _options() -> tuple[dict, list[float]]:
    run = json.loads((FIXTURE / "run.json").read_text())
    options = {**run["options"], "dist_timeout": DIST_TIMEOUT}
    return options, run["losses"]


def test_format1_zero1_tag_continues_bitwise(tag, tmp_path):
    options, losses = _options()
    log = run_world(4, resume=str(tag), checkpoint_dir=str(tmp_path / "ckpt"), log_jsonl=str(tmp_path / "log.jsonl"),
                    **options)
    assert [(r["step"], r["loss"]) for r in log] == [(3, losses[2]), (4, losses[3])]


def test_format1_zero1_tag_resumes_at_dp1_without_zero1(tag, tmp_path):
    options, losses = _options()
    log = run_world(2, resume=str(tag), checkpoint_dir=str(tmp_path / "ckpt"), log_jsonl=str(tmp_path / "log.jsonl"),
                    **{**options, "zero1": False})
    assert [r["step"] for r in log] == [3, 4]
    assert [r["loss"] for r in log] == losses[2:]  # dp 1 sums the same microbatch gradients: equal here


def test_masters_export_from_zero1_tags_of_both_formats(tag, tmp_path):
    """to-hf --masters finds every parameter's fp32 master whichever dp rank's file holds it: in the format-1 tag
    (every file has all masters) and after a reshard to format 2 (each dp rank has its own parameters')."""
    quiet = RunOptions(quiet=True, part=(0, 1))
    with warns_no_tokenizer():
        to_hf(tag, tmp_path / "hf1", masters=True, dtype="keep", options=quiet)
    moved = reshard(tag, tmp_path / "f2", tp=2, pp=1, dp=2, zero1=True, options=quiet).out
    with warns_no_tokenizer():
        to_hf(moved, tmp_path / "hf2", masters=True, dtype="keep", options=quiet)
    with warns_no_tokenizer():
        to_hf(tag, tmp_path / "shards", masters=False, dtype="keep", options=quiet)
    one, two = load_file(tmp_path / "hf1/model.safetensors"), load_file(tmp_path / "hf2/model.safetensors")
    shards = load_file(tmp_path / "shards/model.safetensors")
    assert one.keys() == two.keys() == shards.keys()
    for key in one:
        assert one[key].dtype == torch.float32 and torch.equal(one[key], two[key]), key
        assert torch.equal(one[key].to(torch.bfloat16), shards[key]), key  # the shards are the masters rounded


def test_inspect_describes_nxdtrain_optimizer_files_of_both_formats(tag, tmp_path):
    """inspect names nxdtrain's own optimizer format (not as an NxD file it failed to read), before and after a
    reshard that moves the ZeRO-1 partition to another dp."""
    from ckptconv.commands.inspect import inspect

    old = inspect(tag)["optimizer"]
    assert old == {"format": "nxdtrain 1", "zero1": True, "dp": 2, "files": 4, "masters": True, "param_groups": 2,
                   "components": ["step", "exp_avg", "exp_avg_sq", "master"]}
    moved = reshard(tag, tmp_path / "f2", tp=1, pp=1, dp=1, zero1=False, options=RunOptions(quiet=True)).out
    new = inspect(moved)["optimizer"]
    assert new == {**old, "format": "nxdtrain 2", "zero1": False, "dp": None, "files": 1}



def test_both_kinds_of_masters_are_one_weight_source(tag):
    """nxdtrain's masters are served as NxD's are (NxdCheckpoint.read_weights_from; they were a second mechanism
    with fields, closing and reports of its own): the weights read are the fp32 masters of the optimizer file
    (torch.load as the reference), inspect names the source by its label, and a second source is refused."""
    from ckptconv.commands.inspect import inspect
    from ckptconv.core.plan import Source
    from ckptconv.sources.nxd import open_nxd
    from ckptconv.training.nxdtrain_format.masters import use_masters

    file = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
    saved = torch.load(tag / "optim" / Path(file).name, weights_only=True)["master"]  # format 1: every master
    opened = open_nxd(tag, prefer_masters=True)
    ckpt, spec, layout = opened.ckpt, opened.spec, opened.layout
    with ckpt:
        assert ckpt.weight_source is not None and ckpt.weight_source.label == "nxdtrain's master weights"
        for key in ("model.norm.weight", "model.layers.0.self_attn.qkv_proj.weight_qkv"):
            rows = ckpt.info(Source(file, key))[1][0]
            read = ckpt.read_rows(Source(file, key), 0, rows)
            assert read.dtype == torch.float32 and torch.equal(read, saved[key]), key
        with pytest.raises(RuntimeError, match=r"read from another source already \(nxdtrain's master weights\)"):
            use_masters(ckpt, spec, layout, required=True)
    assert inspect(tag)["weights_from"] == "model files"
    assert inspect(tag, masters=True)["weights_from"] == "optim/ (nxdtrain's master weights)"


def test_the_masters_and_the_optimizer_state_share_one_parse(tag, tmp_path, monkeypatch):
    """reshard --masters and to-dcp of a bf16 tag read the weights from its masters and carry its optimizer state:
    one TagOptimizer (one parse of every optimizer file's header) serves both (two before); the resharded tag's
    weights are still the fp32 masters of the optimizer files (torch.load as the reference)."""
    from ckptconv.commands.dcp import to_dcp
    from ckptconv.io.nxd_read import load_shard
    from ckptconv.training.nxdtrain_format import state as training_state

    made = []
    real = training_state.TagOptimizer.__init__

    def counting(self, *args, **kwargs):
        made.append(args[0])
        real(self, *args, **kwargs)

    monkeypatch.setattr(training_state.TagOptimizer, "__init__", counting)
    quiet = RunOptions(quiet=True, part=(0, 1))
    out = reshard(tag, tmp_path / "r", tp=2, pp=1, masters=True, options=quiet).out
    assert len(made) == 1
    to_dcp(tag, tmp_path / "dcp", options=quiet)
    assert len(made) == 2  # one more, for to-dcp
    for rank in range(2):
        name = f"dp_rank_00_tp_rank_{rank:02d}_pp_rank_00.pt"
        saved = torch.load(tag / "optim" / name, weights_only=True)["master"]  # format 1: every master, this tp rank
        shard = load_shard(out / "model" / name)
        assert sorted(shard) == sorted(saved)
        assert all(shard[k].dtype == torch.float32 and torch.equal(shard[k], saved[k]) for k in saved)
