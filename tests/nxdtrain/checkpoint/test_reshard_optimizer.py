"""A run moves with its optimizer state: 4 AdamW steps == 2 steps at tp 2 x pp 2 + 2 steps at another layout.

The step-2 tag of an uninterrupted tp 2 x pp 2 run is continued (a) after ``ckptconv reshard`` to tp 1 x dp 2
with ZeRO-1, (b) directly at tp 4 with kv_size_multiplier 2, (c) after ``ckptconv reshard`` to pp 2 x vpp 2
(4 layers: interleaved stages), resumed directly at pp 1, (d) in bf16 with fp32 masters, resumed directly at pp 1: the losses of steps 3-4 and
the exported HF weights equal the uninterrupted run's within 1e-5. A fresh optimizer at step 3 would not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptconv.cli.main import main as ckptconv_main
from ckptconv.commands.api import RunOptions, reshard
from nxdtrain.config.options import TrainConfig
from nxdtrain.train import export, prepare
from tests.conftest import warns_no_tokenizer
from tests.nxdtrain.checkpoint.test_resume import tree_bytes
from tests.nxdtrain.harness import run_world, train_options

TOL = 1e-5
SOURCE = dict(tp=2, pp=2, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=1)


def _options(precision: str) -> dict[str, Any]:
    return train_options(optimizer="adamw", steps=4, decay_steps=4, warmup=2, gbs=4, mbs=1, precision=precision,
                         checkpoint_freq=2, keep=2)


def _hf(tag: Path, out: Path) -> dict[str, torch.Tensor]:
    with warns_no_tokenizer():
        export(tag, out)
    return load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def straight(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             nxd_model: Any) -> dict[str, Any]:
    """The uninterrupted run at tp 2 x pp 2: its log, its step-2 tag and its exported step-4 weights."""
    root = tmp_path_factory.mktemp(f"straight-{request.param}")
    src = nxd_model("gqa2-4", **SOURCE)
    options = _options(request.param)
    log = run_world(4, resume=str(src), checkpoint_dir=str(root / "ckpt"), log_jsonl=str(root / "log.jsonl"),
                    tp=2, pp=2, **options)
    return {"precision": request.param, "log": log, "tag": root / "ckpt/step_2", "options": options,
            "weights": _hf(root / "ckpt/step_4", root / "hf")}


def _continue(straight: dict[str, Any], tmp: Path, resume: Path, nproc: int, **layout: Any) -> None:
    log = run_world(nproc, resume=str(resume), checkpoint_dir=str(tmp / "ckpt"), log_jsonl=str(tmp / "log.jsonl"),
                    **{**straight["options"], **layout})
    assert [r["step"] for r in log] == [3, 4]
    want = straight["log"][2:]
    for mine, theirs in zip(log, want, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=TOL), (mine, theirs)
        assert mine["lr"] == theirs["lr"]
    weights = _hf(tmp / "ckpt/step_4", tmp / "hf")
    assert weights.keys() == straight["weights"].keys()
    for key, value in weights.items():
        torch.testing.assert_close(value.float(), straight["weights"][key].float(), atol=TOL, rtol=0, msg=key)


def _reshard(tag: Path, out: Path, **kwargs: Any) -> Path:
    reshard(tag, out, options=RunOptions(quiet=True, part=(0, 1)), **kwargs)
    return out


def test_a_reshard_to_tp1_dp2_zero1(straight, tmp_path):
    if straight["precision"] != "fp32":
        pytest.skip("(a) is the fp32 case")
    out = tmp_path / "tag"
    assert ckptconv_main(["reshard", str(straight["tag"]), str(out), "--tp", "1", "--pp", "1", "--dp", "2", "--zero1",
                          "--quiet"]) == 0
    assert sorted(p.name for p in (out / "optim").iterdir()) == [
        "dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_01_tp_rank_00_pp_rank_00.pt"]
    assert (out / "done").is_file()
    _continue(straight, tmp_path, out, 2, tp=1, pp=1, zero1=True)


def test_reshard_flags_of_a_training_tag(straight, tmp_path, nxd_model, capsys):
    """--weights-only writes the shards alone, as before; --dp needs optimizer state to place."""
    if straight["precision"] != "fp32":
        pytest.skip("one precision is enough")
    out = tmp_path / "weights"
    assert ckptconv_main(["reshard", str(straight["tag"]), str(out), "--tp", "1", "--pp", "1", "--weights-only",
                          "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["ckptconv.json", "hf", "model"]
    converted = nxd_model("gqa2-4", **SOURCE)
    assert ckptconv_main(["reshard", str(converted), str(tmp_path / "x"), "--tp", "1", "--dp", "2"]) == 1
    assert capsys.readouterr().err.strip().endswith(
        f"{converted}: --dp and --zero1 place optimizer state; this is not a training tag (no optim/)")


def test_reshard_of_a_training_tag_in_parts(straight, tmp_path):
    """--part K/N splits the optimizer files over processes as it does the shards: the same tag as one process."""
    if straight["precision"] != "bf16":
        pytest.skip("one precision is enough")
    whole = _reshard(straight["tag"], tmp_path / "whole", tp=1, pp=2, dp=2, zero1=True)
    for k in range(2):
        reshard(straight["tag"], tmp_path / "parts", tp=1, pp=2, dp=2, zero1=True,
                options=RunOptions(quiet=True, part=(k, 2)))
    assert tree_bytes(tmp_path / "parts") == tree_bytes(whole)
    assert len(list((whole / "optim").iterdir())) == 4 and (whole / "done").is_file()


def test_another_optimizer_is_said(straight, tmp_path):
    """The tag's AdamW state is not fed to another optimizer silently: said before any step, masters still taken."""
    if straight["precision"] != "bf16":
        pytest.skip("the bf16 tag has masters to take")
    options = {**straight["options"], "optimizer": "sgd", "resume": str(straight["tag"]),
               "checkpoint_dir": str(tmp_path / "ckpt"), "log_jsonl": str(tmp_path / "log.jsonl"), "tp": 2, "pp": 2}
    plan = prepare(TrainConfig.from_flat(options), world_size=4)
    assert plan.resume_notes == ("not carried: the tag's adamw state (this run is --optimizer sgd; it starts its own "
                                 "state at the tag's weights and step)",)
    log = run_world(4, **options)
    assert [r["step"] for r in log] == [3, 4]
    assert log[0]["loss"] == pytest.approx(straight["log"][2]["loss"], abs=TOL)  # step 3 sees the step-2 weights


def test_b_direct_resume_at_tp4_kvm2(straight, tmp_path):
    if straight["precision"] != "fp32":
        pytest.skip("(b) is the fp32 case")
    _continue(straight, tmp_path, straight["tag"], 4, tp=4, pp=1, kv_replicator=2)


def test_c_pp2_vpp2_then_pp1(straight, tmp_path):
    if straight["precision"] != "fp32":
        pytest.skip("(c) is the fp32 case")
    out = _reshard(straight["tag"], tmp_path / "tag", tp=2, pp=2, vpp=2)  # layers 0, 2 on pp rank 0; 1, 3 on 1
    assert {k.split(".")[2] for k in torch.load(out / "model/dp_rank_00_tp_rank_00_pp_rank_01.pt", weights_only=True)
            if k.startswith("model.layers.")} == {"1", "3"}
    _continue(straight, tmp_path, out, 2, tp=2, pp=1)


def test_d_bf16_masters_direct_at_pp1(straight, tmp_path):
    if straight["precision"] != "bf16":
        pytest.skip("(d) is the bf16 case")
    _continue(straight, tmp_path, straight["tag"], 2, tp=2, pp=1)
