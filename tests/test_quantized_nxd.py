"""A quantized HF source (config.json's ``quantization_config``) of a family that has an NxD layout: to-nxd reads it
dequantized as to-dcp does, says so in one note, and records the dequantized model's config (no
``quantization_config``) in ckptconv.json and hf/config.json, so that to-hf and reshard write a config that loads the
plain weights. Reference: a twin of the same model whose weights were dequantized by the tests' own
``tests.deepseek_models.dequantize`` (element by element, fp32), converted with the same flags."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import ckptconv
from ckptconv.io.metadata import read_metadata
from tests.conftest import hf_state, make_tiny_llama, warns_no_tokenizer
from tests.deepseek_models import BLOCK, make_fp8

QUIET = ckptconv.RunOptions(quiet=True)
NOTE = f"quantized weight(s) (fp8 (float8 weights with a float32 scale per {BLOCK} x {BLOCK} block)) dequantized to "


def _config(path: Path) -> dict:
    return json.loads(path.read_text())


def test_an_fp8_llama_goes_to_nxd_dequantized_with_one_note_and_a_plain_config(tmp_path: Path):
    # hidden 40, intermediate 88: partial 16 x 16 blocks at the edges; 4 heads over 2 KV heads
    bf16 = make_tiny_llama(tmp_path / "bf16", hidden=40, heads=4, kv_heads=2, head_dim=10, layers=2,
                           intermediate=88, dtype=torch.bfloat16)
    names = make_fp8(bf16, tmp_path / "fp8", tmp_path / "twin")
    assert any(n.endswith("q_proj.weight") for n in names) and any(n.endswith("down_proj.weight") for n in names)
    result = ckptconv.to_nxd(tmp_path / "fp8", tmp_path / "nxd", tp=2, options=QUIET)
    said = [n for n in result.notes if "quantized" in n]
    assert said == [f"{len(names)} {NOTE}bfloat16 as they stream; config.json without its quantization_config"]
    ckptconv.to_nxd(tmp_path / "twin", tmp_path / "nxd-twin", tp=2, options=QUIET)
    model = sorted(p.name for p in (tmp_path / "nxd-twin" / "model").rglob("*") if p.is_file())
    assert model == sorted(p.name for p in (tmp_path / "nxd" / "model").rglob("*") if p.is_file()) and model
    for rel in (p.relative_to(tmp_path / "nxd-twin") for p in (tmp_path / "nxd-twin" / "model").rglob("*")
                if p.is_file()):
        assert (tmp_path / "nxd" / rel).read_bytes() == (tmp_path / "nxd-twin" / rel).read_bytes(), rel
    twin_config = _config(tmp_path / "twin" / "config.json")
    recorded = read_metadata(tmp_path / "nxd")
    assert recorded is not None and "quantization_config" not in recorded.hf_config
    assert recorded.hf_config == read_metadata(tmp_path / "nxd-twin").hf_config
    kept = _config(tmp_path / "nxd" / "hf" / "config.json")
    assert "quantization_config" not in kept and kept["dtype"] == "bfloat16"
    assert {k: v for k, v in kept.items() if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in twin_config.items() if k not in ("dtype", "torch_dtype")}

    with warns_no_tokenizer():  # the tiny model has none
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "back", options=QUIET)
    assert "quantization_config" not in _config(tmp_path / "back" / "config.json")
    twin = hf_state(tmp_path / "twin")
    back = hf_state(tmp_path / "back")
    assert set(back) == set(twin) and all(torch.equal(back[k], v) for k, v in twin.items())
    ckptconv.reshard(tmp_path / "nxd", tmp_path / "tp1", tp=1, options=QUIET)
    assert "quantization_config" not in read_metadata(tmp_path / "tp1").hf_config
    assert "quantization_config" not in _config(tmp_path / "tp1" / "hf" / "config.json")


def test_an_fp8_llama_cast_by_dtype_is_dequantized_straight_to_it(tmp_path: Path):
    bf16 = make_tiny_llama(tmp_path / "bf16", hidden=40, heads=4, kv_heads=2, head_dim=10, layers=1,
                           intermediate=88, dtype=torch.bfloat16)
    names = make_fp8(bf16, tmp_path / "fp8", tmp_path / "twin")
    result = ckptconv.to_nxd(tmp_path / "fp8", tmp_path / "nxd", dtype="fp32", options=QUIET)
    assert [n for n in result.notes if "quantized" in n] == [
        f"{len(names)} {NOTE}float32 as they stream; config.json without its quantization_config"]
    kept = _config(tmp_path / "nxd" / "hf" / "config.json")
    assert "quantization_config" not in kept and kept["dtype"] == "float32"
    with warns_no_tokenizer():
        ckptconv.to_hf(tmp_path / "nxd", tmp_path / "back", options=QUIET)
    back = hf_state(tmp_path / "back")
    with torch.no_grad():  # fp8 x fp32 scale, exactly (the twin holds the same products rounded to bf16)
        from safetensors.torch import load_file

        stored = load_file(tmp_path / "fp8" / "model.safetensors")
        for name in names:
            q, scale = stored[name], stored[name + "_scale_inv"]
            want = q.float() * scale.repeat_interleave(BLOCK, 0)[:q.shape[0]].repeat_interleave(BLOCK, 1)[:, :q.shape[1]]
            assert back[name].dtype == torch.float32 and torch.equal(back[name], want), name
