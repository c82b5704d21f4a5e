"""Writing NxD's own optimizer format (``ckptconv reshard --optimizer-format nxd``), checked against NxD's files.

The independent reference is what NxD 2.28 wrote itself (fixtures/nxdt-official/, made by NxD's own
``save_checkpoint``): a tag of NxD's read and written again in NxD's format at the same layout gives the same
key tree, dtypes, shapes and values in every file, compared after ``torch.load(weights_only=True)`` of both
(``torch.save`` writes a random ``serialization_id``, so bytes are not compared). Resharded to tp 2 x pp 2 with
ZeRO-1 over dp 2 or 3 and back to tp 1, the files equal NxD's again; at tp 2 x pp 2 every parameter's state
equals what nxdtrain's format (moved by the reshard tested elsewhere) holds, chunk by chunk as NxD cuts them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptconv.cli.main import main as ckptconv_main
from ckptconv.commands.api import reshard, to_hf
from ckptconv.engine.options import RunOptions
from ckptconv.errors import ConversionError
from ckptconv.io.safe_load import load_small
from ckptconv.training.nxd_format.read import NxdOptimizer
from tests.conftest import hf_state, warns_no_tokenizer
from tests.training.nxd_format.test_read import FIXTURES, reference, tag_of

QUIET = RunOptions(quiet=True, workers=1)
OPTIM = "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt"
MODEL = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
# the cases whose files NxD wrote plain (not xser-split, not DCP): the writer's output is compared with them
CASES = ["plain_fp32", "plain_bf16", "zero1_fp32", "zero1_bf16", "zero1_bf16_masters", "zero1_downcast_fp64_masters"]
MASTERS = "sharded_master_weights"


def _config(case: str) -> Path:
    return FIXTURES / case / "hf" / "config.json"


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


def assert_same(ours: Any, theirs: Any, where: str = "") -> None:
    """Equal structures: the same keys in the same order, types, dtypes, shapes and values (bit for bit)."""
    assert type(ours) is type(theirs), (where, type(ours), type(theirs))
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), (where, list(ours), list(theirs))
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, list):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        assert (ours.dtype, ours.shape, ours.stride()) == (theirs.dtype, theirs.shape, theirs.stride()), (
            where, ours.dtype, ours.shape, ours.stride(), theirs.dtype, theirs.shape, theirs.stride())
        assert torch.equal(ours, theirs), where
    else:
        assert ours == theirs, (where, ours, theirs)


def _nxd(src: Path, out: Path, **kwargs: Any) -> Path:
    reshard(src, out, optimizer_format="nxd", options=QUIET, **kwargs)
    return out


@pytest.mark.parametrize("case", CASES)
def test_written_again_equals_nxds_files(case: str, tmp_path: Path) -> None:
    """NxD's tag read and written again in NxD's format at tp 1 x pp 1 x dp 1: NxD's files, key for key."""
    zero1 = case.startswith("zero1")
    out = _nxd(tag_of(case), tmp_path / "out", tp=1, pp=1, zero1=zero1, config=_config(case))
    src = tag_of(case)
    ours, theirs = _load(out / OPTIM), _load(src / OPTIM)
    if zero1 and MASTERS not in theirs:  # saved without use_master_weights_in_ckpt: we write them always
        masters = ours.pop(MASTERS)
        model = _load(src / MODEL)
        with NxdOptimizer.open(src) as optim:
            names = optim.names()  # NxD's optimizer index order (checked in tests/training/nxd_format/test_read.py)
        for i, master in masters.items():
            assert master.dtype == ours["base_state"][i]["exp_avg"].dtype
            assert torch.equal(master, model[names[i]].to(master.dtype)), i  # the weights widened
    assert_same(ours, theirs)
    for side in ("scheduler.pt", "user_content.pt", MODEL):
        assert_same(_load(out / side), _load(src / side), side)
    for marker in ("checkpoint", "done"):
        assert (out / marker).read_bytes() == (src / marker).read_bytes()
    recorded = json.loads((out / "ckptconv.json").read_text())["extra"]["nxd_optimizer"]
    assert recorded["format"] == "nxd" and recorded["param_groups"] == "bias-norm" and recorded["zero1"] is zero1


@pytest.mark.parametrize("case", ["zero1_bf16_masters", "plain_fp32"])
@pytest.mark.parametrize("dp", [2, 3])
def test_reshard_tp2_pp2_and_back(case: str, dp: int, tmp_path: Path) -> None:
    """tp 2 x pp 2 (ZeRO-1 over dp 2, or 3 with padding rows) and back to tp 1: NxD's own files again; at tp 2 x
    pp 2 every chunk is the state nxdtrain's format holds for that parameter, cut as NxD cuts it."""
    zero1 = case.startswith("zero1")
    wide = _nxd(tag_of(case), tmp_path / "wide", tp=2, pp=2, dp=dp, zero1=zero1, config=_config(case))
    back = _nxd(wide, tmp_path / "back", tp=1, pp=1, dp=1, zero1=zero1)
    for rel in (OPTIM, MODEL, "scheduler.pt", "user_content.pt"):
        assert_same(_load(back / rel), _load(tag_of(case) / rel), rel)
    ours = reshard(tag_of(case), tmp_path / "format2", tp=2, pp=2, zero1=False, config=_config(case), options=QUIET)
    assert ours.finalized
    with NxdOptimizer.open(wide) as optim:
        assert optim.dp == (dp if zero1 else 1) and optim.naming().startswith("names containing 'bias' or 'norm'")
        read = 0
        for param in optim.params():
            f2 = _load(tmp_path / "format2" / f"optim/dp_rank_00_tp_rank_{param.tp_rank:02d}_pp_rank_"
                                               f"{param.pp_rank:02d}.pt")
            for component, value in (("exp_avg", param.exp_avg), ("exp_avg_sq", param.exp_avg_sq),
                                     ("master", param.master)):
                key = f"state.{param.name}.{component}"
                if value is None:
                    assert key not in f2
                    continue
                assert torch.equal(value, f2[key].to(value.dtype)) and value.dtype == f2[key].dtype, key
            assert param.step == float(f2[f"state.{param.name}.step"])
            read += 1
        assert read == sum(len(_load(p)) for p in (wide / "model").iterdir())  # every parameter of every rank
    if zero1:  # NxD's chunking: dim 0 padded to a multiple of dp with zero rows, cut in dp equal parts
        for r in range(dp):
            saved = _load(wide / f"optim/dp_rank_{r:02d}_tp_rank_00_pp_rank_01.pt")
            for i, shape in saved["shape_info"].items():
                rows = math.ceil(shape[0] / dp)
                for tensor in (*(saved["base_state"][i][m] for m in ("exp_avg", "exp_avg_sq")), saved[MASTERS][i]):
                    assert list(tensor.shape) == [rows, *shape[1:]] and tensor.dtype == torch.float32
                    pad = max(0, (r + 1) * rows - shape[0]) if r * rows < shape[0] else rows
                    if pad:
                        assert not tensor[rows - pad:].any(), (r, i)  # the pad rows hold zeros
                assert saved["base_state"][i]["step"].shape == ()


def test_param_group_rules_refused_where_they_mix(tmp_path: Path) -> None:
    """NxD's fixture stepped norms without weight decay: a rule that puts them with the matrices (one group;
    bias-LayerNorm, which finds no LayerNorm in a Llama) would change their update: refused, naming the key."""
    case = "plain_fp32"
    for rule in ("one", "bias-LayerNorm"):
        with pytest.raises(ConversionError, match=r"would hold matrices and vectors.*'weight_decay': \(0.01, 0.0\)"):
            _nxd(tag_of(case), tmp_path / rule, tp=1, pp=1, nxd_param_groups=rule, config=_config(case))


def test_bf16_masters_need_zero1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bf16 model's fp32 masters do not fit NxD's files without ZeRO-1: refused naming --zero1, unless
    --drop-masters (masters dropped, moments rounded to bf16, said)."""
    case = "zero1_bf16_masters"
    argv = ["reshard", str(tag_of(case)), str(tmp_path / "plain"), "--tp", "1", "--pp", "1", "--no-zero1",
            "--optimizer-format", "nxd", "--config", str(_config(case)), "--quiet"]
    assert ckptconv_main(argv) == 1
    err = capsys.readouterr().err
    assert "pass --zero1, or --drop-masters" in err and len(err.strip().splitlines()) == 1
    out = reshard(tag_of(case), tmp_path / "dropped", tp=1, pp=1, zero1=False, optimizer_format="nxd",
                  drop_masters=True, config=_config(case), options=QUIET)
    assert any(n.startswith("--drop-masters:") for n in out.notes)
    saved = _load(tmp_path / "dropped" / OPTIM)
    assert set(saved) == {"state", "param_groups"}
    source = _load(tag_of(case) / OPTIM)["base_state"]
    for i, state in saved["state"].items():
        assert state["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(state["exp_avg"], source[i]["exp_avg"].to(torch.bfloat16))


def test_flags_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case = "plain_fp32"
    with pytest.raises(ConversionError, match="apply to --optimizer-format nxd only"):
        reshard(tag_of(case), tmp_path / "x", tp=1, pp=1, nxd_param_groups="one", config=_config(case), options=QUIET)
    with pytest.raises(ConversionError, match="--optimizer-format nxd writes optimizer state; --weights-only writes none"):
        reshard(tag_of(case), tmp_path / "y", tp=1, pp=1, weights_only=True, optimizer_format="nxd",
                config=_config(case), options=QUIET)


ALL_CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "case.json").is_file())


@pytest.mark.parametrize("case", ALL_CASES)
def test_every_case_read_back_equals_nxds(case: str, tmp_path: Path) -> None:
    """Every fixture case (xser-split, DCP, masters only, NxDT's) written in NxD's format with ZeRO-1: read back
    by NxD's reader, every parameter's step, moments and masters equal NxD's own tag's (exactly); the param
    groups are NxD's tag's own (one group for the DCP case, whose NxD run cannot load two)."""
    out = _nxd(tag_of(case), tmp_path / tag_of(case).name, tp=1, pp=1, zero1=True, config=_config(case))  # NxDT: its name
    with NxdOptimizer.open(tag_of(case)) as theirs, NxdOptimizer.open(out) as ours:
        assert len(ours.groups()) == len(theirs.groups()) and ours.names() == theirs.names()
        for a, b in zip(ours.params(), theirs.params(), strict=True):
            assert (a.name, a.step, a.group) == (b.name, b.step, b.group)
            for mine, nxd in ((a.exp_avg, b.exp_avg), (a.exp_avg_sq, b.exp_avg_sq)):
                assert mine.dtype in (torch.float32, torch.float64) and torch.equal(mine, nxd.to(mine.dtype)), a.name
            if b.master is not None:
                assert a.master is not None and a.master.dtype == b.master.dtype and torch.equal(a.master, b.master)


def test_to_hf_of_a_written_tag_takes_its_masters(tmp_path: Path) -> None:
    """A tag written here in NxD's format (ckptconv.json records the bf16 model files) exports its fp32 masters:
    NxD's own values at the save (the case's reference), exactly."""
    case = "zero1_bf16_masters"
    wide = _nxd(tag_of(case), tmp_path / "wide", tp=2, pp=2, dp=2, zero1=True, config=_config(case))
    with warns_no_tokenizer():
        to_hf(wide, tmp_path / "hf", dtype="keep", options=QUIET)
    back, held = hf_state(tmp_path / "hf"), reference(case, "params_at_save.hf")
    assert sorted(back) == sorted(held)
    for key, value in held.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


def _xser(path: Path) -> tuple[Any, Any, dict[int, torch.Tensor]]:
    """An xser-split file as (structure with tids for its TensorReferences, .info.pt, tensor by tid)."""
    def tids(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: tids(v) for k, v in value.items()}
        if isinstance(value, list):
            return [tids(v) for v in value]
        return ("tid", value.tid) if type(value).__name__ == "TensorReference" else value

    info = load_small(Path(f"{path}.info.pt"))
    tensors = {tid: _load(Path(f"{path}.tensors") / f"tensor_{tid}.pt") for tid in info}
    return tids(load_small(path)), info, tensors


@pytest.mark.parametrize("case", ["plain_fp32_xser", "zero1_bf16_masters_xser", "nxdt_zero1_bf16_masters_xser"])
def test_xser_split_as_nxd_writes_it(case: str, tmp_path: Path) -> None:
    """Shards xser-split (NxD's use_xser): the optimizer file too, as NxD splits it: the same structure with
    TensorReferences numbered depth-first, the same .info.pt, the same tensor per tid; the model files too."""
    zero1 = case.startswith(("zero1", "nxdt_zero1"))
    src = tag_of(case)
    out = _nxd(src, tmp_path / src.name, tp=1, pp=1, zero1=zero1, config=_config(case))  # NxDT: its name
    for rel in (OPTIM, MODEL):
        if rel == MODEL and not (src / MODEL).with_name(Path(MODEL).name + ".info.pt").is_file():
            continue
        ours, theirs = _xser(out / rel), _xser(src / rel)
        assert_same(ours[0], theirs[0], rel)
        assert ours[1] == theirs[1], rel
        assert_same(ours[2], theirs[2], rel)
