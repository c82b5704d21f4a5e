"""``ckptconv diff``: HF, NxD shards and DCP compared under HF names; each kind of damage found and named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptconv
from ckptconv.cli.main import main
from ckptconv.commands.api import to_nxd
from ckptconv.commands.dcp import to_dcp
from ckptconv.engine.options import RunOptions
from tests.conftest import make_tiny_llama

QUIET = RunOptions(quiet=True)


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One Llama (heads != kv heads, hidden != intermediate) as HF, NxD tp2 x pp2 and DCP."""
    root = tmp_path_factory.mktemp("diff")
    hf = make_tiny_llama(root / "hf")
    to_nxd(hf, root / "nxd", tp=2, pp=2, options=QUIET)
    to_dcp(hf, root / "dcp", options=QUIET)
    return {"hf": hf, "nxd": root / "nxd", "dcp": root / "dcp"}


def _statuses(result: dict) -> dict[str, str]:
    return {t["key"]: t["status"] for t in result["tensors"]}


@pytest.mark.parametrize("a, b", [("hf", "nxd"), ("hf", "dcp"), ("nxd", "dcp"), ("dcp", "nxd")])
def test_conversions_are_exact(three: dict[str, Path], a: str, b: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(three[a]), str(three[b]), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = load_file(three["hf"] / "model.safetensors")
    assert _statuses(result) == {key: "equal" for key in expected}  # every HF tensor, each bitwise equal
    assert result["ok"] and result["summary"] == f"{len(expected)} tensors: {len(expected)} equal (same model)"


def _edited_hf(src: Path, out: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(src, out)
    state = load_file(out / "model.safetensors")
    edit(state)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_swapped_head_is_named_with_its_difference(three: dict[str, Path], tmp_path: Path) -> None:
    def swap(state: dict[str, torch.Tensor]) -> None:  # heads 1 and 2 of layer 2's q_proj (head_dim 8)
        q = state["model.layers.2.self_attn.q_proj.weight"]
        state["model.layers.2.self_attn.q_proj.weight"] = torch.cat([q[:8], q[16:24], q[8:16], q[24:]])

    edited = _edited_hf(three["hf"], tmp_path / "swapped", swap)
    result = ckptconv.diff(edited, three["dcp"])
    q = load_file(three["hf"] / "model.safetensors")["model.layers.2.self_attn.q_proj.weight"]
    assert not result["ok"]
    assert {k: s for k, s in _statuses(result).items() if s != "equal"} == {"model.layers.2.self_attn.q_proj.weight": "differ"}
    (bad,) = [t for t in result["tensors"] if t["status"] == "differ"]
    assert bad["max_abs"] == pytest.approx((q[8:16] - q[16:24]).abs().max().item())
    assert result["problems"] == [f"model.layers.2.self_attn.q_proj.weight: max abs difference {bad['max_abs']:.3g}, "
                                  f"max relative {bad['max_rel']:.3g}"]


def test_tolerances_decide_the_exit_status(three: dict[str, Path], tmp_path: Path) -> None:
    def nudge(state: dict[str, torch.Tensor]) -> None:
        state["model.norm.weight"] = state["model.norm.weight"] + 1e-3

    edited = _edited_hf(three["hf"], tmp_path / "nudged", nudge)
    assert main(["diff", str(edited), str(three["nxd"]), "--quiet"]) == 1
    assert main(["diff", str(edited), str(three["nxd"]), "--quiet", "--atol", "2e-3"]) == 0
    assert _statuses(ckptconv.diff(edited, three["nxd"], atol=2e-3))["model.norm.weight"] == "close"


def test_dropped_bias_is_missing_by_name(tiny_models, tmp_path: Path) -> None:
    """Qwen2 (q/k/v biases): a bias dropped from the HF side is reported as only in the NxD side."""
    hf = make_tiny_llama(tmp_path / "qwen2", model_type="qwen2", head_dim=8)
    to_nxd(hf, tmp_path / "nxd", tp=2, pp=2, options=QUIET)
    assert ckptconv.diff(hf, tmp_path / "nxd")["ok"]
    dropped = _edited_hf(hf, tmp_path / "dropped", lambda s: s.pop("model.layers.1.self_attn.k_proj.bias"))
    result = ckptconv.diff(dropped, tmp_path / "nxd")
    assert {k: s for k, s in _statuses(result).items() if s != "equal"} == {"model.layers.1.self_attn.k_proj.bias": "missing"}
    assert result["problems"] == ["model.layers.1.self_attn.k_proj.bias: only in B"]


def test_truncated_dcp_item_is_named(three: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cut = tmp_path / "cut"
    shutil.copytree(three["dcp"], cut)
    data = sorted(cut.glob("*.distcp"))[0]
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 100)
    assert main(["diff", str(three["hf"]), str(cut)]) == 1
    assert data.name in capsys.readouterr().err


def test_bands_are_bounded_and_give_the_same_answer(three: dict[str, Path]) -> None:
    """A budget of a few rows: every tensor compared in many bands (RoPE periods kept whole), same verdicts."""
    small = ckptconv.diff(three["hf"], three["dcp"], max_memory=4096)
    assert small["ok"] and small["counts"] == ckptconv.diff(three["hf"], three["dcp"])["counts"]


def test_inspect_hf_and_dcp_json_field_by_field(three: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The same model as HF and DCP: each field against safetensors' / the config's own account."""
    state = load_file(three["hf"] / "model.safetensors")
    config = json.loads((three["hf"] / "config.json").read_text())
    model = {"family": "llama", "layers": config["num_hidden_layers"], "hidden": config["hidden_size"],
             "heads": config["num_attention_heads"], "kv_heads": config["num_key_value_heads"],
             "head_dim": config["head_dim"], "intermediate": config["intermediate_size"],
             "vocab": config["vocab_size"], "tied": False}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert main(["inspect", str(three["hf"]), "--json"]) == 0
    hf = json.loads(capsys.readouterr().out)
    assert hf == {"kind": "hf", "path": str(three["hf"]), "model": model, "tensors": len(state),
                  "parameters": sum(t.numel() for t in state.values()), "bytes": nbytes,
                  "dtypes": {"float32": len(state)}, "files": ["model.safetensors"], "complete": True,
                  "metadata": False}
    assert main(["inspect", str(three["dcp"]), "--json"]) == 0
    dcp = json.loads(capsys.readouterr().out)
    assert dcp == {"kind": "dcp", "path": str(three["dcp"]), "root": str(three["dcp"]), "found_as": "directory",
                   "holds": {"model": len(state), "optimizer": 0, "lr_scheduler": 0, "train_state": 0, "dataloader": 0},
                   "model": {**model, "from": "config"}, "tensors": len(state),
                   "parameters": sum(t.numel() for t in state.values()), "bytes": nbytes,
                   "dtypes": {"float32": len(state)}, "files": ["__0_0.distcp"], "metadata": True, "complete": True,
                   "problems": []}
