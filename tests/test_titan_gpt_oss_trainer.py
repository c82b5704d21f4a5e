"""The TorchTitan lane for GPT-OSS: TorchTitan 0.3.0's own trainer (``torchtitan.train``'s ``Trainer`` from the
generated ``continue_run()``) trains the GPT-OSS model to-dcp wrote, one step; its loss is transformers' on the same
rows within the bf16 of its expert matmuls, and from-dcp of the checkpoint it saves comes back to HF (the trained
routing bias refused unless dropped). Its own module: the Trainer makes (and destroys) its own process group.
Runs in ``.venv-titan``; the main lane skips it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="the TorchTitan lane: make setup-titan test-titan")

import ckptconv  # noqa: E402
from ckptconv.errors import ConversionError  # noqa: E402
from tests.conftest import hf_state  # noqa: E402
from tests.gpt_oss_models import make_gpt_oss  # noqa: E402
from tests.test_titan_gpt_oss import QUIET, TOLERANCE  # noqa: E402
from tests.titan_shims import gpt_oss_experts_in_model_dtype, math_flex, train_generated  # noqa: E402


def test_titans_own_trainer_trains_the_generated_gpt_oss_model(tmp_path, monkeypatch):
    hf = make_gpt_oss(tmp_path / "src")
    ckptconv.to_dcp(hf, tmp_path / "dcp", options=QUIET)
    rows = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))

    def attention(config):  # FlexAttention (the sinks), its kernel in plain torch for a CPU backward
        math_flex(monkeypatch)
        gpt_oss_experts_in_model_dtype(monkeypatch)

    losses, bias = train_generated(tmp_path / "dcp", rows, monkeypatch, tmp_path / "titan", positions=True,
                                   attention=attention,
                                   after=lambda t: t.model_parts[0].layers["0"].moe.expert_bias_E.clone())
    import transformers

    reference = transformers.GptOssForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(rows).logits
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), rows[:, 1:].reshape(-1)).item()
    print("TorchTitan's loss", losses, "transformers'", want)
    assert len(losses) == 1 and losses[0] == pytest.approx(want, rel=TOLERANCE), (losses, want)
    assert bias.abs().max() > 0  # TorchTitan's bias balancing ran after its optimizer step
    saved = tmp_path / "titan" / "checkpoint"
    with pytest.raises(ConversionError, match=r"'layers.0.moe.expert_bias_E' is not zero"):
        ckptconv.from_dcp(saved, tmp_path / "hf", config=hf / "config.json", options=QUIET)
    ckptconv.from_dcp(saved, tmp_path / "hf", config=hf / "config.json", drop_expert_bias=True, options=QUIET)
    back, before = hf_state(tmp_path / "hf"), hf_state(hf)
    assert sorted(back) == sorted(before)
    moved = [k for k in before if not torch.equal(back[k].float(), before[k].float())]
    assert any("experts.gate_up_proj" in k for k in moved) and any("sinks" in k for k in moved)  # one AdamW step
