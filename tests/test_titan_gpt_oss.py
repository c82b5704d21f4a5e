"""The TorchTitan lane for GPT-OSS (issue 46): TorchTitan 0.3.0's own ``gpt_oss`` model, built by the
``torchtitan_config.py`` to-dcp writes, loads the DCP through its ``CheckpointManager``: its live state_dict's keys,
shapes and order are our table's, its experts are the HF experts transposed (checked against the safetensors by hand),
each layer's attention (sinks, sliding window or full, YaRN) is transformers' within 1e-5, and its logits are
transformers' fp32 within the bf16 of its grouped expert matmuls; a dropped sink, an un-interleaved gate_up or another
YaRN factor is far outside that. Runs in ``.venv-titan``; the main lane skips it.

CPU shims (tests/titan_shims.py): TorchTitan's FlexAttention run by eager ``flex_attention`` (its compiled CPU kernel
has no log-sum-exp, which the sinks need), and its GPT-OSS experts' bf16 output cast to the model's dtype.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="the TorchTitan lane: make setup-titan test-titan")

import ckptconv  # noqa: E402
from ckptconv.core.model_spec import ModelSpec  # noqa: E402
from ckptconv.titan.names import titan_params  # noqa: E402
from tests.conftest import hf_state  # noqa: E402
from tests.gpt_oss_models import make_gpt_oss  # noqa: E402
from tests.titan_shims import (  # noqa: E402
    eager_flex,
    generated_config,
    gpt_oss_experts_in_model_dtype,
    load_generated_block,
    math_flex,
)

QUIET = ckptconv.RunOptions(quiet=True)
pytestmark = pytest.mark.usefixtures("gloo_world")
TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
TOLERANCE = 2e-2  # of the largest logit: TorchTitan's GPT-OSS experts multiply in bf16 (measured ~8e-3)
ATTENTION = 1e-5  # of the largest attention output: fp32 throughout


def titan_forward(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)  # one document per row
    with torch.no_grad():
        return model(tokens, attention_masks=model.get_attention_masks(positions))


def transformers_attention(hf: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """transformers' fp32 logits, and each layer's attention input (after its norm) and output."""
    import transformers

    model = transformers.GptOssForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(
            lambda m, args, kwargs, out: seen.append((kwargs.get("hidden_states", args[0] if args else None), out[0])),
            with_kwargs=True)
    with torch.no_grad():
        return model(tokens).logits, seen


def test_titans_gpt_oss_loads_the_dcp_and_computes_transformers_logits(tmp_path, monkeypatch):
    eager_flex(monkeypatch)
    gpt_oss_experts_in_model_dtype(monkeypatch)
    hf = make_gpt_oss(tmp_path / "hf")
    ckptconv.to_dcp(hf, tmp_path / "dcp", options=QUIET)
    module = generated_config(tmp_path / "dcp")
    model = module.model_config().build()
    model.init_states()
    model = load_generated_block(model, tmp_path / "dcp", tmp_path / "ck")
    state = model.state_dict()
    spec = ModelSpec.from_file(hf / "config.json")
    assert [(k, tuple(v.shape)) for k, v in state.items()] == [(p.key, p.shape) for p in titan_params(spec)]
    source = hf_state(hf)
    for n in range(3):  # by hand, from the safetensors: [E, out, in] of HF's [E, in, out], the interleave kept
        inner = f"layers.{n}.moe.routed_experts.inner_experts."
        assert torch.equal(state[inner + "mlp1_weight_EGD"], source[f"model.layers.{n}.mlp.experts.gate_up_proj"].mT)
        assert torch.equal(state[inner + "mlp2_weight_EDF"], source[f"model.layers.{n}.mlp.experts.down_proj"].mT)
        assert torch.equal(state[f"layers.{n}.attention.sinks"], source[f"model.layers.{n}.self_attn.sinks"])
        assert model.layers[str(n)].attention.inner_attention is not None
    assert [model.config.layers[n].attention.sliding_window_size for n in range(3)] == [4, None, 4]

    reference, attention = transformers_attention(hf, TOKENS)
    positions = torch.arange(24).repeat(2, 1)
    masks = model.get_attention_masks(positions)
    for n, (x, want) in enumerate(attention):  # each layer's attention alone: sinks, its window, YaRN, biases
        layer = model.layers[str(n)]
        with torch.no_grad():
            got = layer.attention(x, masks[layer.attn_mask_key], None)
        error = ((got - want).abs().max() / want.abs().max()).item()
        print(f"layer {n} ({layer.attn_mask_key}): max |titan - transformers| / max |attention| = {error:.2e}")
        assert error <= ATTENTION, (n, error)

    ours = titan_forward(model, TOKENS)
    scale = reference.abs().max()
    error = ((ours - reference).abs().max() / scale).item()
    print("logits: max |titan - transformers| / max |logit| =", error)
    assert error <= TOLERANCE
    math_flex(monkeypatch)  # the trainer test's CPU kernel (it has a backward) computes what eager flex does
    assert torch.allclose(titan_forward(model, TOKENS), ours, rtol=0, atol=1e-5 * scale)
    eager_flex(monkeypatch)

    def far(edit) -> float:
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            edit()
        off = ((titan_forward(model, TOKENS) - reference).abs().max() / scale).item()
        model.load_state_dict(saved)
        return off

    inner = model.layers["1"].moe.routed_experts.inner_experts
    halves = torch.cat([torch.arange(0, 48, 2), torch.arange(1, 48, 2)])  # gate rows then up rows: not interleaved
    for what, edit in {"dropped sinks": lambda: [model.layers[str(n)].attention.sinks.fill_(-1e4) for n in range(3)],
                       "un-interleaved gate_up": lambda: inner.mlp1_weight_EGD.copy_(inner.mlp1_weight_EGD[:, halves]),
                       }.items():
        off = far(edit)
        print(f"{what}: {off:.3g}")
        assert off > 5 * TOLERANCE, what


def test_the_generated_yarn_factor_moves_titans_attention(tmp_path, monkeypatch):
    """The YaRN factor the config carries matters to TorchTitan's attention: factor 32 and factor 1 differ."""
    eager_flex(monkeypatch)
    hf = make_gpt_oss(tmp_path / "hf")
    ckptconv.to_dcp(hf, tmp_path / "dcp", options=QUIET)
    config = generated_config(tmp_path / "dcp").model_config()
    x = torch.randn(2, 24, 32)
    outs = []
    for factor in (32.0, 1.0):
        for layer in config.layers:
            layer.attention.rope.rope_factor = factor
        model = config.build()
        model.init_states()
        model = load_generated_block(model, tmp_path / "dcp", tmp_path / f"ck{factor}")
        masks = model.get_attention_masks(torch.arange(24).repeat(2, 1))
        with torch.no_grad():
            outs.append(model.layers["1"].attention(x, masks["basic_mask"], None))
    assert not torch.allclose(outs[0], outs[1], atol=1e-3)
