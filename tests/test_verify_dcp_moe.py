"""``ckptconv verify HF DCP`` of a Qwen3-MoE DCP (experts routed and run from TorchTitan's stacked tensors, each expert
named when wrong) and of a DCP holding TorchTitan's fused ``wqkv`` (split as ``FusedQKVLinear`` splits it).

The MoE model has more experts than top-k (4, top-2) and expert intermediate 24 != hidden 16, so a stack in the wrong
orientation or an expert routed wrongly changes the output; the llama has 8 heads over 2 KV heads, so a fused
``wqkv`` split in q, k, v thirds (not by KV group) puts the wrong rows in every head."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptconv.cli.main import main
from ckptconv.commands.dcp import to_dcp
from ckptconv.commands.verify import verify
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import Source
from ckptconv.engine.options import RunOptions
from ckptconv.io.dcp import DcpCheckpoint
from ckptconv.titan.names import titan_params
from tests.conftest import make_tiny_llama
from tests.test_dcp import dcp_load, dcp_save
from tests.test_titan_moe_names import make_qwen3_moe

QUIET = RunOptions(quiet=True)
W1 = "layers.{}.moe.routed_experts.inner_experts.w1_EFD"


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("verify-dcp-moe")
    hf = make_qwen3_moe(root / "hf")
    to_dcp(hf, root / "dcp", options=QUIET)
    return hf, root / "dcp"


def _resaved(hf: Path, dcp: Path, out: Path, change) -> Path:
    """``dcp``'s model read by torch's own DCP reader, ``change(state)``, written by torch's DCP writer to ``out``."""
    shapes = {p.key: p.shape for p in titan_params(ModelSpec.from_file(hf / "config.json"))}
    state = dcp_load(dcp, shapes)
    change(state)
    dcp_save(state, out)
    return out


def test_a_clean_moe_dcp_passes(moe: tuple[Path, Path]) -> None:
    hf, dcp = moe
    assert main(["verify", str(hf), str(dcp), "--quiet"]) == 0
    result = verify(hf, dcp)
    assert result["ok"], result["problems"]
    assert sorted(result["layers"]) == [0, 1, 2]  # layer 1 dense (mlp_only_layers), 0 and 2 sparse
    assert all(result["layers"][n]["mlp"]["rel"] < 1e-6 for n in (0, 2))


def test_a_corrupted_expert_row_is_caught_and_named(moe: tuple[Path, Path], tmp_path: Path) -> None:
    """Bytes of expert 2's gate (w1_EFD, its first row) in layer 2 scaled by 3 in the .distcp file."""
    hf, dcp = moe
    bad = tmp_path / "dcp"
    shutil.copytree(dcp, bad)
    key = W1.format(2)
    with DcpCheckpoint(bad) as ckpt:
        chunk = ckpt.entry(key).chunks[0]
        row = ckpt.read_rows(Source(None, key), 2, 3)[0, 0].numpy().tobytes()  # expert 2, row 0
    file = bad / chunk.file
    blob = file.read_bytes()
    assert blob.count(row) == 1
    with open(file, "r+b") as f:
        f.seek(blob.index(row))
        f.write((torch.frombuffer(bytearray(row), dtype=torch.float32) * 3).numpy().tobytes())
    result = verify(hf, bad, check=False)
    assert not result["ok"]
    assert [p.split(":")[0] for p in result["problems"]] == ["layer 2 mlp", "layer 2 output"]
    assert result["layers"][2]["mlp"]["detail"] == ("expert 2 differs (its output matches no expert: gate/up/down "
                                                    "blocks wrong)")
    assert result["layers"][0]["mlp"]["detail"] == ""


def test_swapped_experts_are_named(moe: tuple[Path, Path], tmp_path: Path) -> None:
    """The DCP of an HF model whose layer 0 experts 1 and 3 trade places, against the original."""
    hf, _ = moe
    swapped = tmp_path / "hf"
    shutil.copytree(hf, swapped)
    state = load_file(swapped / "model.safetensors")
    for part in ("gate_proj", "up_proj", "down_proj"):
        one, three = (f"model.layers.0.mlp.experts.{e}.{part}.weight" for e in (1, 3))
        state[one], state[three] = state[three], state[one]
    save_file(state, swapped / "model.safetensors", metadata={"format": "pt"})
    to_dcp(swapped, tmp_path / "dcp", options=QUIET)
    result = verify(hf, tmp_path / "dcp")
    assert [p.split(":")[0] for p in result["problems"]] == ["layer 0 mlp", "layer 0 output"]
    assert result["layers"][0]["mlp"]["detail"] == "experts 1 and 3 swapped"


def test_a_nonzero_routing_bias_fails_its_layer(moe: tuple[Path, Path], tmp_path: Path) -> None:
    """TorchTitan chooses experts with ``expert_bias_E`` added; HF has none: verify says so for that layer."""
    hf, dcp = moe
    out = _resaved(hf, dcp, tmp_path / "dcp", lambda s: s["layers.2.moe.expert_bias_E"].copy_(torch.tensor(
        [0.0, 0.5, 0.0, 0.0])))
    result = verify(hf, out, config=hf / "config.json")
    assert [p.split(":")[0] for p in result["problems"]] == ["layer 2 expert_bias"]
    assert result["layers"][2]["expert_bias"]["max_abs"] == 0.5


def _fused(state: dict[str, torch.Tensor], spec: ModelSpec) -> None:
    """wq/wk/wv of every layer replaced by one ``wqkv`` as TorchTitan's ``FusedQKVLinear._merge_qkv_on_load``
    builds it: ``cat([q.reshape(kv, group, hd, H), k.reshape(kv, 1, hd, H), v...], dim=1)``."""
    hd, kv = spec.head_dim, spec.kv_heads
    for n in range(spec.layers):
        q, k, v = (state.pop(f"layers.{n}.attention.qkv_linear.{p}.weight") for p in ("wq", "wk", "wv"))
        parts = [t.reshape(kv, -1, hd, spec.hidden) for t in (q, k, v)]
        state[f"layers.{n}.attention.qkv_linear.wqkv.weight"] = torch.cat(parts, dim=1).reshape(-1, spec.hidden)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_fused_wqkv_dcp_is_checked_head_by_head(family: str, tmp_path: Path) -> None:
    extra = {"model_type": "qwen3", "head_dim": 16} if family == "qwen3" else {}
    hf = make_tiny_llama(tmp_path / "hf", **extra)
    spec = ModelSpec.from_file(hf / "config.json")
    to_dcp(hf, tmp_path / "dcp", options=QUIET)
    shapes = {p.key: p.shape for p in titan_params(spec)}
    state = dcp_load(tmp_path / "dcp", shapes)
    _fused(state, spec)
    dcp_save(state, tmp_path / "fused")
    result = verify(hf, tmp_path / "fused", config=hf / "config.json")
    assert result["ok"], result["problems"]
    # q heads 1 and 2 (in KV group 0: rows of group 0 are q0..q3, k0, v0) traded in layer 3's wqkv
    hd = spec.head_dim
    fused = state["layers.3.attention.qkv_linear.wqkv.weight"]
    fused[hd:2 * hd], fused[2 * hd:3 * hd] = fused[2 * hd:3 * hd].clone(), fused[hd:2 * hd].clone()
    dcp_save(state, tmp_path / "swapped")
    result = verify(hf, tmp_path / "swapped", config=hf / "config.json")
    said = [p.split(":")[0] for p in result["problems"]]
    assert said[0] == "layer 3 attention" and set(said) <= {"layer 3 attention", "layer 3 mlp", "layer 3 output"}
    assert result["layers"][3]["attention"]["detail"] == "Q/K/V heads 1, 2 differ"


def test_a_gpt_oss_dcp_is_refused_naming_diff(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.gpt_oss_models import make_gpt_oss

    hf = make_gpt_oss(tmp_path / "hf")
    to_dcp(hf, tmp_path / "dcp", options=QUIET)
    assert main(["verify", str(hf), str(tmp_path / "dcp"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert (f"{tmp_path / 'dcp'}: verify checks TorchTitan's llama3 and qwen3 (dense or MoE), not its gpt_oss; "
            "compare this one with ckptconv diff HF DCP") in err
