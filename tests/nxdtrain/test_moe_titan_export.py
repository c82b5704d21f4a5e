"""The TorchTitan export of a Qwen3-MoE tag nxdtrain trained at tp 2 x ep 2 (issue 30, item 4): ``ckptconv to-dcp``
of the tag writes its weights and AdamW state; read back with torch.distributed.checkpoint's own reader, every
expert's weights are the tag's exported HF expert's (``--export-hf``), and every expert's AdamW moments are those
of the transformers class trained on the same rows (tests/nxdtrain/moe_reference.py)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

import ckptconv
from nxdtrain.config.options import TrainConfig
from nxdtrain.train import export
from tests.conftest import hf_state, warns_no_tokenizer
from tests.nxdtrain.harness import convert, run_world, train_options
from tests.nxdtrain.moe_reference import make_moe, train_moe_reference

EXPERTS, SPARSE = 4, (0, 2)  # moe_reference's Qwen3-MoE: layer 1 dense (mlp_only_layers)
INNER = "layers.{}.moe.routed_experts.inner_experts."
HF = "model.layers.{}.mlp.experts.{}.{}.weight"
# TorchTitan's stacked expert tensor -> the HF projection each expert's slab is (both [out, in]), and where it sits
# in transformers' fused parameter (gate_up_proj [E, 2I, H]: gate rows then up rows; down_proj [E, H, I])
STACKED = {"w1_EFD": ("gate_proj", "gate_up_proj", 0), "w3_EFD": ("up_proj", "gate_up_proj", 1),
           "w2_EDF": ("down_proj", "down_proj", 0)}
TOL = 1e-5
MOMENT_TOL = 1e-4  # AdamW's tolerance of issue 30 (exp_avg_sq of ~1e-8 gradients squared: relative)


def read_dcp(path: Path) -> dict[str, Any]:
    """Every key of a DCP directory, by torch.distributed.checkpoint's own reader (no process group)."""
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return state


OPTIONS = train_options(optimizer="adamw", lr=1e-3, gbs=4, mbs=1, seq_len=16, steps=2, decay_steps=2)


def trained_tag(root: Path) -> tuple[Path, Path]:
    """(the HF model, its tag after 2 AdamW steps at tp 2 x ep 2: 4 processes, dp 2 = the two ep ranks)."""
    hf = make_moe(root / "hf", "qwen3_moe")
    run_world(4, resume=str(convert(hf, root / "nxd")), tp=2, ep=2, checkpoint_dir=str(root / "ck"),
              log_jsonl=str(root / "log.jsonl"), **OPTIONS)
    return hf, root / "ck" / "step_2"


def test_a_trained_qwen3_moe_tag_exports_to_torchtitan_with_its_adamw_state(tmp_path):
    options = OPTIONS
    hf, tag = trained_tag(tmp_path)
    result = ckptconv.to_dcp(tag, tmp_path / "dcp", options=ckptconv.RunOptions(quiet=True))
    assert any("expert_bias_E" in note for note in result.notes)
    dcp = read_dcp(tmp_path / "dcp")
    with warns_no_tokenizer():
        export(tag, tmp_path / "exported")
    exported = hf_state(tmp_path / "exported")
    moments: dict[str, dict[str, torch.Tensor]] = {}
    cfg = TrainConfig.from_flat({**options, "resume": "x"})
    train_moe_reference(hf, cfg, tmp_path / "ref", moments=moments)
    assert dcp["train_state"]["step"] == 2
    state = dcp["optimizer"]  # TorchTitan's flat optimizer keys: state.<param>.<field>
    for layer in SPARSE:
        assert torch.equal(dcp[f"layers.{layer}.moe.expert_bias_E"], torch.zeros(EXPERTS))
        for stacked, (proj, fused, half) in STACKED.items():
            key = INNER.format(layer) + stacked
            assert dcp[key].shape[0] == EXPERTS
            for e in range(EXPERTS):  # each expert's slab is that expert's exported HF weight, bit for bit
                name = HF.format(layer, e, proj)
                assert torch.equal(dcp[key][e], exported[name]), name
                for field in ("exp_avg", "exp_avg_sq"):
                    ref = moments[f"model.layers.{layer}.mlp.experts.{fused}"][field][e]
                    got, want = state[f"state.{key}.{field}"][e], ref.chunk(2)[half] if fused != proj else ref
                    assert want.abs().max() > 0, name  # the expert was routed to: a moment that can be wrong
                    assert (got - want).abs().max() <= MOMENT_TOL * want.abs().max(), (name, field)
    # the rest of the model too: the router and a dense layer's MLP
    assert torch.equal(dcp["layers.0.moe.router.gate.weight"], exported["model.layers.0.mlp.gate.weight"])
    assert torch.equal(dcp["layers.1.feed_forward.w1.weight"], exported["model.layers.1.mlp.gate_proj.weight"])


@pytest.mark.usefixtures("gloo_world")  # TorchTitan's CheckpointManager loads in a process group
def test_torchtitans_qwen3_moe_loads_the_trained_tags_dcp(tmp_path):
    """The TorchTitan lane (skipped without torchtitan): TorchTitan's own qwen3 MoE model and AdamW, built by the
    generated torchtitan_config.py, load the DCP's full state through its CheckpointManager; each of its experts is
    the tag's exported HF expert, bit for bit, and its experts' moments are the DCP's."""
    pytest.importorskip("torchtitan", reason="the TorchTitan lane: make setup-titan test-titan")
    from tests.test_titan import manager
    from tests.test_titan_moe import generated_model

    _, tag = trained_tag(tmp_path)
    dcp = tmp_path / "dcp"
    ckptconv.to_dcp(tag, dcp, options=ckptconv.RunOptions(quiet=True))
    with warns_no_tokenizer():
        export(tag, tmp_path / "exported")
    exported = hf_state(tmp_path / "exported")
    model = generated_model(dcp)
    ck, optimizers, _ = manager(model, tmp_path / "titan", initial_load_path=str(dcp), initial_load_model_only=False,
                                exclude_from_loading=["dataloader"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ck.load() is True
    ck.close()
    state, moments, written = model.state_dict(), optimizers.state_dict(), read_dcp(dcp)["optimizer"]
    for layer in SPARSE:
        for stacked, (proj, _, _) in STACKED.items():
            key = INNER.format(layer) + stacked
            for e in range(EXPERTS):
                name = HF.format(layer, e, proj)
                assert torch.equal(state[key][e], exported[name]), name
            for field in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(moments[f"state.{key}.{field}"], written[f"state.{key}.{field}"]), (key, field)


def test_to_dcp_of_nxds_ep_zero1_files_carries_the_same_state(tmp_path):
    """A Qwen3-MoE run at ep 2 x dp 4 with ZeRO-1 saved in NxD's EP ZeRO-1 files (``--optimizer-format nxd``) and the
    same run saved in nxdtrain's format 2: their DCPs hold the same weights and AdamW state."""
    from tests.nxdtrain.checkpoint.test_moe_nxd_format_save import _options

    src = convert(make_moe(tmp_path / "hf", "qwen3_moe"), tmp_path / "converted")
    dcps = []
    for fmt in ("nxdtrain", "nxd"):
        run_world(4, resume=str(src), checkpoint_dir=str(tmp_path / fmt), log_jsonl=str(tmp_path / f"{fmt}.jsonl"),
                  **_options(optimizer_format=fmt, steps=1, decay_steps=1))
        ckptconv.to_dcp(tmp_path / fmt / "step_1", tmp_path / f"dcp-{fmt}", options=ckptconv.RunOptions(quiet=True))
        dcps.append(read_dcp(tmp_path / f"dcp-{fmt}"))
    ours, nxds = dcps
    model = [k for k in ours if k.startswith(("layers.", "tok_embeddings", "norm", "lm_head"))]
    assert all(torch.equal(ours[k], nxds[k]) for k in model)
    moments = [k for k in ours["optimizer"] if k.startswith("state.") and k.endswith(("exp_avg", "exp_avg_sq"))]
    assert set(moments) == {k for k in nxds["optimizer"] if k.startswith("state.") and k.endswith(("exp_avg", "exp_avg_sq"))}
    assert any("inner_experts" in k for k in moments)
    for key in moments:
        assert torch.allclose(ours["optimizer"][key], nxds["optimizer"][key], rtol=0, atol=TOL), key
