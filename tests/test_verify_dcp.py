"""``ckptconv verify HF DCP``: TorchTitan's layout computed without TorchTitan, layer by layer, against HF."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptconv.cli.main import main
from ckptconv.commands.dcp import to_dcp
from ckptconv.commands.verify import verify
from ckptconv.core.plan import Source
from ckptconv.engine.options import RunOptions
from ckptconv.io.dcp import DcpCheckpoint
from tests.conftest import make_tiny_llama

QUIET = RunOptions(quiet=True)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """llama (complex RoPE, rows permuted) and qwen3 (cos/sin RoPE, q/k norms, head_dim 16 != hidden / heads)."""
    root = tmp_path_factory.mktemp(f"verify-dcp-{request.param}")
    extra = {"model_type": "qwen3", "head_dim": 16} if request.param == "qwen3" else {}
    hf = make_tiny_llama(root / "hf", **extra)
    to_dcp(hf, root / "dcp", options=QUIET)
    return hf, root / "dcp"


def test_clean_dcp_passes(pair: tuple[Path, Path]) -> None:
    hf, dcp = pair
    assert main(["verify", str(hf), str(dcp), "--quiet"]) == 0
    result = verify(hf, dcp)
    assert result["ok"] and sorted(result["layers"]) == [0, 1, 2, 3] and result["lm_head"]["rel"] == 0


def test_a_corrupted_tensor_is_caught_in_its_layer(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """Bytes of layer 2's w2 changed in the .distcp file (--no-check: the digests would refuse it first)."""
    hf, dcp = pair
    bad = tmp_path / "dcp"
    shutil.copytree(dcp, bad)
    key = "layers.2.feed_forward.w2.weight"
    with DcpCheckpoint(bad) as ckpt:
        chunk = ckpt.entry(key).chunks[0]
        row = ckpt.read_rows(Source(None, key), 0, 1).numpy().tobytes()
    file = bad / chunk.file
    blob = file.read_bytes()
    assert blob.count(row) == 1  # random distinct values: the row's bytes are found once, where it is stored
    with open(file, "r+b") as f:  # the first row scaled by 3
        f.seek(blob.index(row))
        f.write((torch.frombuffer(bytearray(row), dtype=torch.float32) * 3).numpy().tobytes())
    assert main(["verify", str(hf), str(bad), "--quiet"]) == 1  # the digest check refuses the file
    result = verify(hf, bad, check=False)
    assert not result["ok"]
    assert [p.split(":")[0] for p in result["problems"]] == ["layer 2 mlp", "layer 2 output"]


def test_swapped_heads_are_named(pair: tuple[Path, Path], tmp_path: Path) -> None:
    hf, _ = pair
    swapped = tmp_path / "hf"
    shutil.copytree(hf, swapped)
    state = load_file(swapped / "model.safetensors")
    q = state["model.layers.1.self_attn.q_proj.weight"]
    hd = q.shape[0] // 8
    state["model.layers.1.self_attn.q_proj.weight"] = torch.cat([q[:hd], q[2 * hd:3 * hd], q[hd:2 * hd], q[3 * hd:]])
    save_file(state, swapped / "model.safetensors", metadata={"format": "pt"})
    to_dcp(swapped, tmp_path / "dcp", options=QUIET)
    result = verify(hf, tmp_path / "dcp")
    assert not result["ok"] and result["problems"][0].startswith("layer 1 attention")
    assert result["layers"][1]["attention"]["detail"] == "Q/K/V heads 1, 2 differ"
