"""The TorchTitan lane for Qwen3-MoE: TorchTitan 0.3.0's own trainer (``torchtitan.train``'s ``Trainer`` from the
generated ``continue_run()``) trains the MoE model to-dcp wrote. Its own module: the Trainer makes (and destroys) its
own process group, where tests/test_titan_moe.py's module holds one. Runs in ``.venv-titan``; the main lane skips it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="the TorchTitan lane: make setup-titan test-titan")

import ckptconv  # noqa: E402
from ckptconv.errors import ConversionError  # noqa: E402
from tests.test_titan_moe import QUIET, TOLERANCE, hf_logits  # noqa: E402
from tests.test_titan_moe_names import make_qwen3_moe  # noqa: E402
from tests.titan_shims import train_generated  # noqa: E402


def test_titans_own_trainer_trains_the_generated_moe_model(tmp_path, monkeypatch):
    """``torchtitan.train``'s Trainer from the generated ``continue_run()`` (model-only DCP of the HF model, the CPU
    shims of tests/titan_shims.py) trains one step: its loss is transformers' on the same rows within the bf16 of
    its expert matmuls, its load balancing moves expert_bias_E, and from-dcp of the checkpoint it saves refuses
    that trained bias unless told to drop it."""
    moe_hf = make_qwen3_moe(tmp_path / "src")
    ckptconv.to_dcp(moe_hf, tmp_path / "dcp", options=QUIET)
    rows = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    losses, bias = train_generated(tmp_path / "dcp", rows, monkeypatch, tmp_path / "titan",
                                   after=lambda t: t.model_parts[0].layers["0"].moe.expert_bias_E.clone())
    reference = hf_logits(moe_hf, rows)
    want = torch.nn.functional.cross_entropy(reference[:, :-1].reshape(-1, 128), rows[:, 1:].reshape(-1)).item()
    assert len(losses) == 1 and losses[0] == pytest.approx(want, rel=TOLERANCE), (losses, want)
    assert bias.abs().max() > 0  # TorchTitan's bias balancing ran after its optimizer step
    saved = tmp_path / "titan" / "checkpoint"
    with pytest.raises(ConversionError, match=r"'layers.0.moe.expert_bias_E' is not zero"):
        ckptconv.from_dcp(saved, tmp_path / "hf", config=moe_hf / "config.json", options=QUIET)
    ckptconv.from_dcp(saved, tmp_path / "hf", config=moe_hf / "config.json", drop_expert_bias=True, options=QUIET)
