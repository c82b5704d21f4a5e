"""The TorchTitan lane for DeepSeek-V3 (issue 45): TorchTitan 0.3.0's own ``deepseek_v3`` model, built by the
``torchtitan_config.py`` to-dcp writes, loads the DCP through its ``CheckpointManager``: its ``state_dict()`` keys,
in order, are our table's; its weights are the safetensors' (by hand: tests/test_deepseek_v3.py's
``expected_titan``); its dense layer and its attention compute transformers' within 1e-5; its logits are
transformers' ``DeepseekV3ForCausalLM``'s (fp32) within the bf16 of its grouped expert matmuls, and its MTP layer's
logits are the reference math's (:mod:`ckptconv.core.reference_mla`) within the same; two swapped experts or a
dropped router bias fall far outside. Runs in ``.venv-titan``; the main lane skips it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="the TorchTitan lane: make setup-titan test-titan")

import ckptconv  # noqa: E402
from ckptconv.core.model_spec import ModelSpec  # noqa: E402
from ckptconv.core.reference import rms_norm  # noqa: E402
from ckptconv.core.reference_mla import decoder_layer, mtp_input  # noqa: E402
from ckptconv.titan.names import titan_params  # noqa: E402
from tests.conftest import hf_state  # noqa: E402
from tests.deepseek_models import LAYERS, V, make_deepseek  # noqa: E402
from tests.test_deepseek_v3 import expected_titan  # noqa: E402
from tests.titan_shims import generated_config, load_generated_block, sdpa_attention  # noqa: E402

QUIET = ckptconv.RunOptions(quiet=True)
pytestmark = pytest.mark.usefixtures("gloo_world")
# relative to the largest logit: TorchTitan 0.3.0 multiplies the routed experts in bf16 (GroupedExperts casts x and w);
# measured 1.9e-3 (q_lora_rank 24) and 2.9e-3 (q_proj) on these models
TOLERANCE = 5e-3
EXACT = 1e-5  # the dense layer and the attention: fp32 throughout


def generated_model(dcp: Path) -> torch.nn.Module:
    """The model of DCP's torchtitan_config.py (SDPA inner attention: tests/titan_shims.py), before any load."""
    model = sdpa_attention(generated_config(dcp).model_config()).build()
    model.init_states()
    return model


def titan_outputs(model: torch.nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(tokens)
    return out if isinstance(out, list) else [out]


def hooked(modules: dict[str, torch.nn.Module]) -> tuple[dict[str, torch.Tensor], list]:
    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        return lambda mod, args, out: seen.__setitem__(name, (out[0] if isinstance(out, tuple) else out).detach())
    return seen, [m.register_forward_hook(keep(n)) for n, m in modules.items()]


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_titans_deepseek_v3_loads_the_dcp_and_computes_transformers_logits(tmp_path, q_lora_rank):
    import transformers

    hf = make_deepseek(tmp_path / "hf", q_lora_rank=q_lora_rank)
    ckptconv.to_dcp(hf, tmp_path / "dcp", options=QUIET)
    model = load_generated_block(generated_model(tmp_path / "dcp"), tmp_path / "dcp", tmp_path / "ck")
    state = model.state_dict()
    assert list(state) == [p.key for p in titan_params(ModelSpec.from_file(hf / "config.json"))]
    weights = hf_state(hf)
    for key, want in expected_titan(weights, q_lora=q_lora_rank is not None, mtp=True).items():
        assert torch.equal(state[key], want), key
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokens = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(0))
    ours, hooks = hooked({"dense": model.layers["0"], "attention": model.layers["1"].attention,
                          "last": model.layers[str(LAYERS - 1)]})
    theirs, hf_hooks = hooked({"dense": reference.model.layers[0], "attention": reference.model.layers[1].self_attn,
                               "last": reference.model.layers[LAYERS - 1]})
    logits, mtp_logits = titan_outputs(model, tokens)
    with torch.no_grad():
        want = reference(tokens).logits
    for h in hooks + hf_hooks:
        h.remove()
    for part in ("dense", "attention"):  # no expert in them: TorchTitan computes them in fp32 like transformers
        torch.testing.assert_close(ours[part], theirs[part], atol=EXACT, rtol=0)
    scale = want.abs().max()
    error = ((logits - want).abs().max() / scale).item()
    print(f"max |titan - transformers| / max |logit| (q_lora_rank {q_lora_rank}): {error:.2e}")
    assert error <= TOLERANCE
    # the MTP layer: the next token's embedding and the last layer's output (TorchTitan's: the same input on both
    # sides) through layer LAYERS, by the reference math
    mtp = {k.split(".", 3)[3]: v for k, v in weights.items() if k.startswith(f"model.layers.{LAYERS}.")}
    config = reference.config.to_dict()
    embeds = torch.nn.functional.embedding(tokens[:, 1:], weights["model.embed_tokens.weight"])
    h = decoder_layer(mtp_input(ours["last"][:, :-1], embeds, mtp, config), mtp, config)
    want_mtp = rms_norm(h, mtp["shared_head.norm.weight"], 1e-6) @ weights["lm_head.weight"].t()
    mtp_error = ((mtp_logits[:, :-1] - want_mtp).abs().max() / want_mtp.abs().max()).item()
    print(f"MTP layer: max |titan - reference| / max |logit|: {mtp_error:.2e}")
    assert mtp_error <= TOLERANCE
    # swapped experts (two pairs, in different groups, router kept) or a dropped router bias: far outside
    saved = {k: v.clone() for k, v in state.items()}
    inner = model.layers[str(LAYERS - 1)].moe.routed_experts.inner_experts
    with torch.no_grad():
        for w in (inner.w1_EFD, inner.w2_EDF, inner.w3_EFD):
            w.copy_(w[[0, 2, 1, 3, 4, 6, 5, 7]].clone())
    swapped = ((titan_outputs(model, tokens)[0] - want).abs().max() / scale).item()
    model.load_state_dict(saved)
    with torch.no_grad():
        for n in range(1, LAYERS):
            model.layers[str(n)].moe.expert_bias_E.zero_()
    unbiased = ((titan_outputs(model, tokens)[0] - want).abs().max() / scale).item()
    print(f"experts swapped: {swapped:.2e}; bias dropped: {unbiased:.2e}")
    assert swapped > 10 * TOLERANCE and unbiased > 10 * TOLERANCE
