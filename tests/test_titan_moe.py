"""The TorchTitan lane for Qwen3-MoE (issue 29): TorchTitan 0.3.0's own qwen3 MoE model, built by the
``torchtitan_config.py`` to-dcp writes, loads the DCP through its ``CheckpointManager``; its weights are the HF
experts stacked (checked against the safetensors, not our table), its logits transformers' ``Qwen3MoeForCausalLM``'s
within the bf16 of TorchTitan's grouped expert matmuls; TorchTitan's own AdamW state comes back through an nxdtrain
tag (tp 2 x ep 2) onto the same experts. Runs in ``.venv-titan``; the main lane skips it.

The tiny model: tests/test_titan_moe_names.py's ``make_qwen3_moe`` (hidden != expert intermediate, 4 experts top-2,
GQA, one dense layer).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="the TorchTitan lane: make setup-titan test-titan")


import ckptconv  # noqa: E402
from ckptconv.core.model_spec import ModelSpec  # noqa: E402
from ckptconv.engine.options import RunOptions  # noqa: E402
from ckptconv.errors import ConversionError  # noqa: E402
from ckptconv.titan.names import titan_params  # noqa: E402
from ckptconv.titan.state import ScheduleFlags  # noqa: E402
from tests.conftest import hf_state, warns_no_tokenizer  # noqa: E402
from tests.test_titan import manager, train_one_step  # noqa: E402
from tests.test_titan_moe_names import expected_moe, make_qwen3_moe  # noqa: E402
from tests.titan_shims import generated_config, load_generated_block, sdpa_attention  # noqa: E402

QUIET = RunOptions(quiet=True)
pytestmark = pytest.mark.usefixtures("gloo_world")
E, SPARSE = 4, (0, 2)
W = "layers.{}.moe.routed_experts.inner_experts."
TOLERANCE = 1e-2  # relative to the largest logit: TorchTitan's bf16 expert matmuls (measured below it)


def generated_model(dcp: Path) -> torch.nn.Module:
    """The model of DCP's torchtitan_config.py (SDPA inner attention: tests/titan_shims.py), before any load."""
    model = sdpa_attention(generated_config(dcp).model_config()).build()
    model.init_states()
    return model


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)


def hf_logits(hf: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.Qwen3MoeForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_titans_qwen3_moe_loads_the_dcp_and_computes_transformers_logits(tmp_path, norm_topk_prob):
    hf = make_qwen3_moe(tmp_path / "hf", norm_topk_prob=norm_topk_prob)
    result = ckptconv.to_dcp(hf, tmp_path / "dcp", options=QUIET)
    assert sum("expert_bias_E" in n and "aux loss" in n for n in result.notes) == 1
    model = load_generated_block(generated_model(tmp_path / "dcp"), tmp_path / "dcp", tmp_path / "ck")
    state = model.state_dict()
    assert [n for n in range(3) if f"layers.{n}.moe.expert_bias_E" in state] == list(SPARSE)  # layer 1 is dense
    assert "layers.1.feed_forward.w1.weight" in state
    spec = ModelSpec.from_file(hf / "config.json")
    assert list(state) == [p.key for p in titan_params(spec)]  # TorchTitan's keys, in its order, are our table's
    for key, want in expected_moe(hf).items():  # each expert from the safetensors, by hand
        assert torch.equal(state[key], want), key
    for layer in SPARSE:
        assert model.layers[str(layer)].moe.router.route_norm is norm_topk_prob
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    ours, reference = logits(model, tokens), hf_logits(hf, tokens)
    # TorchTitan's experts multiply in bf16 (GroupedExperts casts x and w to bf16): logits within that precision
    scale = reference.abs().max()
    print("max |titan - transformers| / max |logit|:", ((ours - reference).abs().max() / scale).item())
    assert (ours - reference).abs().max() <= TOLERANCE * scale, (ours - reference).abs().max() / scale
    # the tolerance tells experts apart: experts 0 and 1 swapped (router kept) in one layer is far outside it
    inner = model.layers["2"].moe.routed_experts.inner_experts
    with torch.no_grad():
        for w in (inner.w1_EFD, inner.w2_EDF, inner.w3_EFD):
            w.copy_(w[[1, 0, 2, 3]].clone())
    print("experts swapped:", ((logits(model, tokens) - reference).abs().max() / scale).item())
    assert (logits(model, tokens) - reference).abs().max() > 10 * TOLERANCE * scale


def test_titans_adamw_state_comes_back_through_an_nxdtrain_tag_onto_its_experts(qwen3_moe_hf, tmp_path):
    """TorchTitan trains one step (its AdamW; its full checkpoint), from-dcp makes an nxdtrain tag at tp 2 x ep 2
    (experts split over I, gate/up stride 2, two experts per ep rank), to-dcp writes it back: a fresh TorchTitan
    model and optimizer load it with every expert's moments equal to TorchTitan's own, value for value."""
    ckptconv.to_dcp(qwen3_moe_hf, tmp_path / "dcp0", options=QUIET)
    model = load_generated_block(generated_model(tmp_path / "dcp0"), tmp_path / "dcp0", tmp_path / "ck0")
    ck, optimizers, schedulers = manager(model, tmp_path / "ck", interval=1)
    train_one_step(model, optimizers, schedulers)
    with torch.no_grad():  # TorchTitan's balancing (its trainer's optimizer hook) would have moved the bias
        model.layers["2"].moe.expert_bias_E.copy_(torch.tensor([1e-3, -1e-3, 0.0, 0.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck.save(curr_step=1)
    ck.close()
    config = qwen3_moe_hf / "config.json"
    with pytest.raises(ConversionError, match=r"'layers.2.moe.expert_bias_E' is not zero \(largest \|expert_bias_E\| "
                                              r"0.001\).*pass --drop-expert-bias"):
        ckptconv.from_dcp(tmp_path / "ck", tmp_path / "tag", to="nxd", tp=2, config=config, options=QUIET)
    result = ckptconv.from_dcp(tmp_path / "ck", tmp_path / "tag", to="nxd", tp=2, ep=2, config=config,
                               drop_expert_bias=True, options=QUIET)
    assert any("dropped the trained expert_bias_E" in n for n in result.notes)
    flags = ScheduleFlags("cosine", 1e-3, 1e-4, 2, 10)
    ckptconv.to_dcp(tmp_path / "tag", tmp_path / "dcp1", schedule=flags, options=QUIET)
    fresh = generated_model(tmp_path / "dcp1")
    ck2, optimizers2, _ = manager(fresh, tmp_path / "ck2", initial_load_path=str(tmp_path / "dcp1"),
                                 initial_load_model_only=False, exclude_from_loading=["dataloader"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ck2.load() is True
    ck2.close()
    theirs, ours = optimizers.state_dict(), optimizers2.state_dict()  # flat: state.<param>.<component>, ...
    names = dict(model.named_parameters())
    moments = {k for k in theirs if k.startswith("state.")}
    assert moments == {k for k in ours if k.startswith("state.")}
    assert moments == {f"state.{n}.{c}" for n in names for c in ("step", "exp_avg", "exp_avg_sq")}
    moved = 0
    for key in sorted(moments):
        assert torch.equal(ours[key], theirs[key]), key
        if key.endswith("exp_avg") and "inner_experts" in key:  # each expert's moments on its own expert
            moved += int((theirs[key].flatten(1).abs().sum(dim=1) > 0).sum())
    assert moved > 0  # the step routed tokens to experts: their moments are not all zero
    for key, value in model.state_dict().items():
        want = torch.zeros_like(value) if key.endswith("expert_bias_E") else value
        assert torch.equal(fresh.state_dict()[key], want), key
    with warns_no_tokenizer():  # and the tag's weights are TorchTitan's, as HF
        ckptconv.to_hf(tmp_path / "tag", tmp_path / "hf", options=QUIET)
    back = hf_state(tmp_path / "hf")
    for layer in SPARSE:
        w1 = model.state_dict()[W.format(layer) + "w1_EFD"]
        for e in range(E):
            assert torch.equal(back[f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"], w1[e])

