"""diff and inspect of a training run: nxdtrain's tags one step apart, and their TorchTitan DCP (AdamW state)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptconv
from ckptconv.cli.main import main
from ckptconv.commands.dcp import to_dcp
from ckptconv.engine.options import RunOptions
from ckptconv.titan.names import hf_name
from tests.conftest import make_tiny_llama

QUIET = RunOptions(quiet=True)
FUSED = "qkv_linear.wqkv.weight"  # TorchTitan's fused QKV (to-dcp of a fused-QKV tag keeps it fused)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """nxdtrain at tp 2: two AdamW steps of a tiny GQA Llama, a tag after each; each tag as DCP in a TorchTitan root."""
    from tests.nxdtrain.harness import convert, run_world, train_options

    root = tmp_path_factory.mktemp("diff-run")
    hf = make_tiny_llama(root / "hf", heads=8, kv_heads=2, layers=3)
    src = convert(hf, root / "nxd", tp=2, attention="qkv_linear", fuse_qkv=True)
    options = train_options(optimizer="adamw", steps=2, decay_steps=2, warmup=1, checkpoint_freq=1, keep=3, tp=2)
    log = run_world(2, resume=str(src), checkpoint_dir=str(root / "ckpt"), log_jsonl=str(root / "log.jsonl"), **options)
    assert [r["step"] for r in log] == [1, 2]
    for step in (1, 2):
        to_dcp(root / "ckpt" / f"step_{step}", root / "titan" / f"step-{step}", options=QUIET)
        with pytest.warns(UserWarning, match="no tokenizer"):
            ckptconv.to_hf(root / "ckpt" / f"step_{step}", root / f"hf-{step}", dtype="keep", options=QUIET)
    return root


def _torch_dcp(path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """A DCP read by torch's own DCP package (the independent reference)."""
    dcp_to_torch_save(path, tmp / "whole.pt")
    return _flat(torch.load(tmp / "whole.pt", weights_only=True))


def _flat(tree: dict, prefix: str = "") -> dict:
    """torch's nested state dict under DCP's flat key names (``optimizer.state.<param>.exp_avg``)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: (a[k].double() - b[k].double()).abs().max().item() for k in a if not torch.equal(a[k], b[k])}


def test_one_step_names_exactly_what_moved(run: Path, tmp_path: Path) -> None:
    """Weights (to-hf's safetensors) and AdamW moments and steps (torch's DCP reader of to-dcp's output): the keys
    that differ and by how much, against diff of the two tags."""
    weights = _moved(load_file(run / "hf-1" / "model.safetensors"), load_file(run / "hf-2" / "model.safetensors"))
    one, two = _torch_dcp(run / "titan" / "step-1", tmp_path), _torch_dcp(run / "titan" / "step-2", tmp_path)
    state: dict[str, float | None] = {}
    fused: dict[str, float] = {}
    for key, value in one.items():
        if isinstance(key, str) and key.startswith("optimizer.state."):
            param, component = key.removeprefix("optimizer.state.").rsplit(".", 1)
            if torch.equal(value, two[key]):
                continue
            moved = (value.double() - two[key].double()).abs().max().item()
            if param.endswith(FUSED):  # the tag's fused QKV: its three HF parts, the largest move among them
                fused[f"{param}.{component}"] = moved
                parts = [param.replace(FUSED, f"qkv_linear.{w}.weight") for w in ("wq", "wk", "wv")]
                state.update({f"state.{hf_name(p)}.{component}": None for p in parts})
            else:
                state[f"state.{hf_name(param)}.{component}"] = moved
    assert state and weights  # a step moved something of both
    result = ckptconv.diff(run / "ckpt" / "step_1", run / "ckpt" / "step_2")
    found = {t["key"]: t["max_abs"] for t in result["tensors"] if t["status"] == "differ"}
    assert found.keys() == {**weights, **state}.keys()
    for key, expected in {**weights, **state}.items():
        if expected is not None:
            assert found[key] == pytest.approx(expected, rel=1e-12, abs=0), key
    for key, expected in fused.items():
        param, component = key.rsplit(".", 1)
        parts = [hf_name(param.replace(FUSED, f"qkv_linear.{w}.weight")) for w in ("wq", "wk", "wv")]
        assert max(found[f"state.{p}.{component}"] for p in parts) == pytest.approx(expected, rel=1e-12, abs=0)
    assert {t["status"] for t in result["tensors"]} == {"differ"} | ({"equal"} if len(found) < len(result["tensors"]) else set())
    assert not result["ok"]


def test_a_tag_and_its_dcp_hold_the_same_training_state(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(run / "ckpt" / "step_2"), str(run / "titan"), "--json"]) == 0  # the root: step-2
    result = json.loads(capsys.readouterr().out)
    keys = {t["key"] for t in result["tensors"]}
    assert {t["status"] for t in result["tensors"]} == {"equal"}
    assert "state.model.layers.2.self_attn.q_proj.weight.exp_avg_sq" in keys
    assert "state.model.embed_tokens.weight.step" in keys
    moments = [k for k in keys if k.startswith("state.")]
    assert len(moments) == 3 * (len(keys) - len(moments))  # exp_avg, exp_avg_sq, step of every weight


def test_weights_against_state_one_sided_state_is_listed_not_failed(run: Path) -> None:
    result = ckptconv.diff(run / "hf-2", run / "titan")
    assert result["ok"] and result["counts"]["missing"] == 3 * result["counts"]["equal"]
    assert result["summary"].endswith("(same weights; optimizer state on one side only)")


def test_inspect_of_a_titan_root(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "checkpoint"
    shutil.copytree(run / "titan", root)
    (root / "step-3").mkdir()  # a save still being written: no .metadata yet
    assert main(["inspect", str(root), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    whole = _torch_dcp(root / "step-2", tmp_path)
    families: dict[str, int] = {}
    for key in whole:
        head = key.split(".", 1)[0]
        head = head if head in ("optimizer", "lr_scheduler", "train_state", "dataloader") else "model"
        families[head] = families.get(head, 0) + 1
    tensors = {k: v for k, v in whole.items() if isinstance(v, torch.Tensor)}
    assert got["kind"] == "dcp" and got["root"] == str(root / "step-2")
    assert got["steps"] == [{"step": 1, "dir": "step-1", "complete": True}, {"step": 2, "dir": "step-2", "complete": True},
                            {"step": 3, "dir": "step-3", "complete": False}]
    assert got["newest_complete"] == 2
    assert {k: v for k, v in got["holds"].items() if v} == families and got["holds"]["dataloader"] == 0
    assert got["train_state"]["train_state.step"] == 2
    assert got["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert got["dtypes"] == {"float32": len(tensors)}
    config = json.loads((run / "hf" / "config.json").read_text())
    assert got["model"] == {"family": "llama", "layers": 3, "hidden": 64, "heads": 8, "kv_heads": 2, "head_dim": 8,
                            "intermediate": 96, "vocab": config["vocab_size"], "tied": False, "from": "config"}
    (root / "step-2" / "ckptconv.json").unlink()  # as a TorchTitan run saves it: no HF config anywhere
    shutil.rmtree(root / "step-2" / "hf", ignore_errors=True)
    assert main(["inspect", str(root), "--json", "--no-check"]) == 0
    inferred = json.loads(capsys.readouterr().out)["model"]
    assert inferred == {"layers": 3, "vocab": config["vocab_size"], "hidden": 64, "tied": False, "qk_norm": False,
                        "family": "llama3", "q_rows": 64, "kv_rows": 16, "intermediate": 96,
                        "from": "key names and shapes"}
