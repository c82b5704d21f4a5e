"""GPT-OSS into TorchTitan's DCP and back (issue 46), main lane: the family's names and refusals, HF -> DCP -> HF
bit-exact with every expert, sink and bias (TorchTitan's keys, shapes and order written out from its live model: the
TorchTitan lane checks them against it), the experts stacked transposed with gate/up interleave kept, MXFP4 input
converting to the same bytes as its twin dequantized by transformers' own function, its refusals, and inspect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptconv
from ckptconv.core.model_spec import ModelSpec
from ckptconv.errors import ConversionError
from ckptconv.titan.names import optimizer_params, titan_params
from tests.conftest import hf_state
from tests.gpt_oss_models import E, gpt_oss_config, make_gpt_oss, make_mxfp4_pair

pytest.importorskip("transformers")

QUIET = ckptconv.RunOptions(quiet=True)
X = "layers.{}.moe.routed_experts.inner_experts."


@pytest.fixture(scope="module")
def gpt_oss_hf(tmp_path_factory) -> Path:
    return make_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "hf")


def test_the_names_shapes_and_order_are_torchtitans(gpt_oss_hf):
    """Written out from TorchTitan 0.3.0's GptOssModel(...).state_dict() of this config."""
    spec = ModelSpec.from_file(gpt_oss_hf / "config.json")
    layer = [("attention.sinks", (4,)), ("attention.qkv_linear.wq.weight", (32, 32)),
             ("attention.qkv_linear.wk.weight", (16, 32)), ("attention.qkv_linear.wv.weight", (16, 32)),
             ("attention.qkv_linear.wq.bias", (32,)), ("attention.qkv_linear.wk.bias", (16,)),
             ("attention.qkv_linear.wv.bias", (16,)), ("attention.wo.weight", (32, 32)), ("attention.wo.bias", (32,)),
             ("attention_norm.weight", (32,)), ("ffn_norm.weight", (32,)), ("moe.expert_bias_E", (E,)),
             ("moe.routed_experts.inner_experts.mlp1_weight_EGD", (E, 48, 32)),
             ("moe.routed_experts.inner_experts.mlp1_bias_EG", (E, 48)),
             ("moe.routed_experts.inner_experts.mlp2_weight_EDF", (E, 32, 24)),
             ("moe.routed_experts.inner_experts.mlp2_bias_ED", (E, 32)),
             ("moe.router.gate.weight", (E, 32)), ("moe.router.gate.bias", (E,))]
    want = [("tok_embeddings.weight", (128, 32)), *((f"layers.{n}.{k}", s) for n in range(3) for k, s in layer),
            ("norm.weight", (32,)), ("lm_head.weight", (128, 32))]
    assert [(p.key, p.shape) for p in titan_params(spec)] == want
    trained = optimizer_params(spec)  # TorchTitan trains q/k/v as one fused weight and one fused bias
    assert trained[1:4] == ["layers.0.attention.sinks", "layers.0.attention.qkv_linear.wqkv.weight",
                            "layers.0.attention.qkv_linear.wqkv.bias"]
    assert not any("expert_bias_E" in k for k in trained)


def test_hf_to_dcp_to_hf_is_bit_exact_with_experts_transposed_and_interleaved(gpt_oss_hf, tmp_path):
    from tests.test_dcp import dcp_load

    result = ckptconv.to_dcp(gpt_oss_hf, tmp_path / "dcp", options=QUIET)
    assert sum("expert_bias_E of the 3" in n for n in result.notes) == 1
    spec = ModelSpec.from_file(gpt_oss_hf / "config.json")
    dcp = dcp_load(tmp_path / "dcp", {p.key: p.shape for p in titan_params(spec)})
    hf = hf_state(gpt_oss_hf)
    for n in range(3):  # by hand: TorchTitan's [E, out, in] is each expert's HF [in, out] transposed, columns kept
        gate_up = hf[f"model.layers.{n}.mlp.experts.gate_up_proj"]
        assert torch.equal(dcp[X.format(n) + "mlp1_weight_EGD"], gate_up.transpose(1, 2))
        assert torch.equal(dcp[X.format(n) + "mlp2_weight_EDF"], hf[f"model.layers.{n}.mlp.experts.down_proj"].transpose(1, 2))
        assert torch.equal(dcp[f"layers.{n}.attention.sinks"], hf[f"model.layers.{n}.self_attn.sinks"])
        assert torch.equal(dcp[f"layers.{n}.moe.router.gate.bias"], hf[f"model.layers.{n}.mlp.router.bias"])
        assert torch.equal(dcp[f"layers.{n}.moe.expert_bias_E"], torch.zeros(E))
        assert hf[f"model.layers.{n}.self_attn.sinks"].abs().min() > 0  # the test model's sinks are not zeros
    back = ckptconv.from_dcp(tmp_path / "dcp", tmp_path / "back", options=QUIET)
    assert any("expert_bias_E: zeros" in n for n in back.notes)
    out = hf_state(tmp_path / "back")
    assert sorted(out) == sorted(hf)
    for key, value in hf.items():
        assert value.dtype == out[key].dtype and torch.equal(value, out[key]), key
    import transformers  # and transformers loads what from-dcp wrote, with no quantization_config

    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in config
    transformers.GptOssForCausalLM.from_pretrained(tmp_path / "back")


def test_a_trained_expert_bias_is_refused(gpt_oss_hf, tmp_path):

    ckptconv.to_dcp(gpt_oss_hf, tmp_path / "dcp", options=QUIET)
    spec = ModelSpec.from_file(gpt_oss_hf / "config.json")
    from tests.test_dcp import dcp_load, dcp_save

    state = dcp_load(tmp_path / "dcp", {p.key: p.shape for p in titan_params(spec)})
    state["layers.1.moe.expert_bias_E"] = torch.tensor([0.0, 2e-3, 0.0, 0.0])
    dcp_save(state, tmp_path / "trained")
    with pytest.raises(ConversionError, match=r"'layers.1.moe.expert_bias_E' is not zero .* HF's GPT-OSS has no place"):
        ckptconv.from_dcp(tmp_path / "trained", tmp_path / "out", config=gpt_oss_hf / "config.json", options=QUIET)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))


def test_to_nxd_and_reshard_refuse_gpt_oss_pointing_to_to_dcp(gpt_oss_hf, tmp_path):
    with pytest.raises(ConversionError, match=r"^GPT-OSS \(model_type 'gpt_oss'\): there is no NxD training model "
                                              r"for it .*; convert it for TorchTitan with to-dcp$"):
        ckptconv.to_nxd(gpt_oss_hf, tmp_path / "nxd", tp=1, options=QUIET)
    from ckptconv.core.layout import ParallelLayout

    with pytest.raises(ConversionError, match="to-dcp"):  # the trainer's check (nxdtrain/train.py) is this one
        ParallelLayout(tp=1).check_model(ModelSpec.from_file(gpt_oss_hf / "config.json"))


def test_mxfp4_converts_to_the_bytes_of_its_dequantized_twin(tmp_path):
    quantized, twin = make_mxfp4_pair(tmp_path / "mxfp4", tmp_path / "twin")
    info = ckptconv.inspect(quantized)
    assert info["quantization"] == ("mxfp4 (FP4 e2m1 values in blocks of 32, an e8m0 scale per block): 6 weights, "
                                    "read as bfloat16")
    assert info["quantized_tensors"] == [f"model.layers.{n}.mlp.experts.{w}" for n in range(3)
                                         for w in ("down_proj", "gate_up_proj")]
    assert info["dtypes"] == {"bfloat16": len(hf_state(twin))}  # read as bf16, shown under the plain names
    assert "quantization" not in ckptconv.inspect(twin)
    ckptconv.to_dcp(quantized, tmp_path / "dq", options=QUIET)
    ckptconv.to_dcp(twin, tmp_path / "dt", options=QUIET)
    data = sorted(p.name for p in (tmp_path / "dt").glob("*.distcp"))
    assert data and data == sorted(p.name for p in (tmp_path / "dq").glob("*.distcp"))
    for name in data:  # (.metadata differs only in its save id, which names the source)
        assert (tmp_path / "dq" / name).read_bytes() == (tmp_path / "dt" / name).read_bytes(), name
    ckptconv.from_dcp(tmp_path / "dq", tmp_path / "back", options=QUIET)
    back, want = hf_state(tmp_path / "back"), hf_state(twin)
    assert sorted(back) == sorted(want) and all(torch.equal(back[k], want[k]) for k in want)
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())


def _rewrite(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def test_mxfp4_refusals_name_the_tensor(tmp_path):
    quantized, _ = make_mxfp4_pair(tmp_path / "mxfp4", tmp_path / "twin")
    key = "model.layers.1.mlp.experts.down_proj"
    _rewrite(quantized, lambda s: s.pop(key + "_scales"))
    with pytest.raises(ConversionError, match=rf"{key}_blocks has no {key}_scales \(expected uint8 \[4, 32, 1\]"):
        ckptconv.to_dcp(quantized, tmp_path / "o1", options=QUIET)
    _rewrite(quantized, lambda s: s.update({key + "_scales": torch.zeros(4, 32, 2, dtype=torch.uint8)}))
    with pytest.raises(ConversionError, match=rf"{key}_scales is uint8 \[4, 32, 2\]; {key}_blocks \[4, 32, 1, 16\] "
                                              r"needs uint8 \[4, 32, 1\]"):
        ckptconv.to_dcp(quantized, tmp_path / "o2", options=QUIET)
    assert not any((tmp_path / d).exists() and any((tmp_path / d).glob("*.distcp")) for d in ("o1", "o2"))


def test_what_torchtitans_gpt_oss_cannot_compute_is_refused_in_one_line(tmp_path):
    hf = make_gpt_oss(tmp_path / "alpha", swiglu_alpha=1.5)
    with pytest.raises(ConversionError, match=r"^config.json: swiglu_alpha is 1.5; TorchTitan gpt_oss's swiglu "
                                              r"computes alpha 1.702 only$"):
        ckptconv.to_dcp(hf, tmp_path / "o1", options=QUIET)
    config = json.loads((hf / "config.json").read_text())
    config.update(swiglu_alpha=1.702, layer_types=["sliding_attention", "full_attention", "banded"])
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"layer_types is \[.*'banded'\]; each layer's type must be one of "
                                              r"sliding_attention, full_attention"):
        ckptconv.to_dcp(hf, tmp_path / "o2", options=QUIET)
    assert not any((tmp_path / d).exists() for d in ("o1", "o2"))


def test_mxfp4_blocks_that_do_not_fit_the_config_are_refused(tmp_path):
    quantized, _ = make_mxfp4_pair(tmp_path / "mxfp4", tmp_path / "twin")
    key = "model.layers.0.mlp.experts.gate_up_proj"  # [E, H, 2I] = [4, 32, 64] plain: blocks [4, 64, 1, 16]
    _rewrite(quantized, lambda s: s.update({key + "_blocks": torch.zeros(4, 64, 2, 16, dtype=torch.uint8),
                                            key + "_scales": torch.zeros(4, 64, 2, dtype=torch.uint8)}))
    with pytest.raises(ConversionError, match=rf"{key}.*\[4, 64, 64\].*\[4, 32, 64\]"):
        ckptconv.to_dcp(quantized, tmp_path / "o", options=QUIET)


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "qwen3_moe", "llama"])
def test_every_moe_models_token_dispatch_is_the_one_set_name(family):
    """The generated torchtitan_config.py of an MoE model (GPT-OSS too, whose spec has no MoE seam: every layer is
    an MoE block) sets MOE_COMM_BACKEND once among the SET names and its model_config() builds the experts with it;
    a dense model has neither."""
    import ast

    import transformers

    from ckptconv.titan.config_file import config_module
    from tests.deepseek_models import config_kwargs

    config = {"gpt_oss": lambda: gpt_oss_config(),
              "deepseek_v3": lambda: transformers.DeepseekV3Config(**config_kwargs()),
              "qwen3_moe": lambda: transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, head_dim=8,
                                                               num_hidden_layers=2),
              "llama": lambda: transformers.LlamaConfig(num_hidden_layers=2)}[family]().to_dict()
    tree = ast.parse(config_module(ModelSpec.from_config(config), None, what="a test"))
    set_at_top = [node for node in tree.body if isinstance(node, ast.Assign)
                  and any(getattr(t, "id", None) == "MOE_COMM_BACKEND" for t in node.targets)]
    model_config = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "model_config")
    passed = [kw for node in ast.walk(model_config) if isinstance(node, ast.Call) for kw in node.keywords
              if kw.arg == "moe_comm_backend"]
    if family == "llama":
        assert not set_at_top and not passed
        return
    assert len(set_at_top) == 1 and ast.literal_eval(set_at_top[0].value) == "standard"
    assert passed and all(isinstance(kw.value, ast.Name) and kw.value.id == "MOE_COMM_BACKEND" for kw in passed)
