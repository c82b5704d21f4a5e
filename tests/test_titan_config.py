"""The TorchTitan lane: the model ``OUT/torchtitan_config.py`` builds (TorchTitan 0.3.0's own layers, from the HF
config: RoPE theta and scaling, head_dim, q/k norms, norm eps, tying) loads what to-dcp wrote and computes
transformers' logits. Runs in ``.venv-titan``; the main lane skips it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="the TorchTitan lane: make setup-titan test-titan")


import ckptconv  # noqa: E402
from ckptconv.engine.options import RunOptions  # noqa: E402
from tests.conftest import make_tiny_llama  # noqa: E402
from tests.titan_shims import generated_config, load_generated_block, sdpa_attention  # noqa: E402

QUIET = RunOptions(quiet=True)
pytestmark = pytest.mark.usefixtures("gloo_world")
LLAMA32_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16, "rope_theta": 500000.0}


def load_generated(out: Path, tmp: Path) -> torch.nn.Module:
    """The model of OUT's continue_run() (SDPA inner attention: tests/titan_shims.py), loaded by TorchTitan's
    CheckpointManager with OUT's checkpoint block."""
    config = generated_config(out).continue_run()
    assert config.checkpoint.initial_load_path == str(out.resolve())
    model = sdpa_attention(config.model_spec.model).build()
    model.init_states()
    return load_generated_block(model, out, tmp)


def hf_logits(hf: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("name,kwargs", [
    ("llama-3.2-shaped", dict(model_type="llama", tied=True, rope_parameters=LLAMA32_ROPE, rms_norm_eps=1e-5)),
    ("qwen3", dict(model_type="qwen3", head_dim=16, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
])
def test_the_generated_model_loads_the_dcp_and_computes_transformers_logits(tmp_path, name, kwargs):
    hf = make_tiny_llama(tmp_path / "hf", layers=2, seed=7, **kwargs)
    ckptconv.to_dcp(hf, tmp_path / "dcp", options=QUIET)
    model = load_generated(tmp_path / "dcp", tmp_path / "ck")
    tokens = torch.randint(0, 128, (2, 96), generator=torch.Generator().manual_seed(0))  # past 16: scaling matters
    with torch.no_grad():
        ours = model(tokens)
    reference = hf_logits(hf, tokens)
    assert torch.allclose(ours, reference, atol=1e-5, rtol=0), (ours - reference).abs().max()
    if name.startswith("llama"):  # TorchTitan's presets' factor 8 would be off: the factor is what loads
        config = generated_config(tmp_path / "dcp").model_config()
        for layer in config.layers:
            layer.attention.rope.scaling_factor = 8.0
        preset = sdpa_attention(config).build()
        preset.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (preset.eval()(tokens) - reference).abs().max() > 1e-3
