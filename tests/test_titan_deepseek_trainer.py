"""The TorchTitan lane for DeepSeek-V3: TorchTitan 0.3.0's own trainer (``torchtitan.train``'s ``Trainer`` from the
generated ``continue_run()``) trains the model to-dcp wrote, one step; its own module (the Trainer makes and destroys
its own process group). Runs in ``.venv-titan``; the main lane skips it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="the TorchTitan lane: make setup-titan test-titan")

import ckptconv  # noqa: E402
from ckptconv.core.reference import rms_norm  # noqa: E402
from ckptconv.core.reference_mla import decoder_layer, mtp_input  # noqa: E402
from tests.conftest import hf_state  # noqa: E402
from tests.deepseek_models import LAYERS, V, make_deepseek  # noqa: E402
from tests.test_titan_deepseek import QUIET, TOLERANCE  # noqa: E402
from tests.titan_shims import train_generated  # noqa: E402


@pytest.mark.parametrize("mtp", [False, True])
def test_titans_own_trainer_trains_the_generated_deepseek_model(tmp_path, monkeypatch, mtp):
    """One step of TorchTitan's Trainer from the generated file (CPU shims of tests/titan_shims.py): without MTP its
    loss is transformers' cross entropy on the rows (within the bf16 of its expert matmuls); with the MTP layer it
    trains through TorchTitan's MTPLoss. Its load balancing moves expert_bias_E; from-dcp of the checkpoint it saves
    writes that trained bias as HF's e_score_correction_bias, value for value."""
    import transformers

    hf = make_deepseek(tmp_path / "src", mtp=mtp)
    ckptconv.to_dcp(hf, tmp_path / "dcp", options=QUIET)
    text = (tmp_path / "dcp" / "torchtitan_config.py").read_text()
    assert ("loss=MTPLoss.Config(global_vocab_size=96)" in text) is mtp
    rows = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(4))
    losses, biases = train_generated(
        tmp_path / "dcp", rows, monkeypatch, tmp_path / "titan", positions=mtp,  # TorchTitan's MTPLoss needs them
        after=lambda t: {n: t.model_parts[0].layers[str(n)].moe.expert_bias_E.clone() for n in range(1, LAYERS)})
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(rows).logits
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), rows[:, 1:].reshape(-1)).item()
    assert len(losses) == 1 and torch.isfinite(torch.tensor(losses[0]))
    if not mtp:
        assert losses[0] == pytest.approx(want, rel=TOLERANCE), (losses, want)
    else:  # MTPLoss: the main loss + 0.3 x the MTP layer's (token i + 2 from position i; TorchTitan divides its sum
        # by the main loss's count of tokens, one more per row), by the reference math
        weights = hf_state(hf)
        mtp = {k.split(".", 3)[3]: v for k, v in weights.items() if k.startswith(f"model.layers.{LAYERS}.")}
        last = {}
        hook = reference.model.layers[LAYERS - 1].register_forward_hook(lambda m, a, out: last.setdefault("h", out))
        with torch.no_grad():
            reference(rows)
        hook.remove()
        h = last["h"][0] if isinstance(last["h"], tuple) else last["h"]
        cfg = reference.config.to_dict()
        embeds = torch.nn.functional.embedding(rows[:, 1:], weights["model.embed_tokens.weight"])
        out = decoder_layer(mtp_input(h[:, :-1], embeds, mtp, cfg), mtp, cfg)
        mtp_logits = rms_norm(out, mtp["shared_head.norm.weight"], 1e-6) @ weights["lm_head.weight"].t()
        mtp_loss = torch.nn.functional.cross_entropy(mtp_logits[:, :-1].reshape(-1, V), rows[:, 2:].reshape(-1)).item()
        seq = rows.shape[1]
        assert losses[0] == pytest.approx(want + 0.3 * mtp_loss * (seq - 2) / (seq - 1), rel=TOLERANCE), (losses, want)
    source = hf_state(hf)
    for n, bias in biases.items():  # TorchTitan's bias balancing ran after its optimizer step
        assert not torch.equal(bias, source[f"model.layers.{n}.mlp.gate.e_score_correction_bias"])
    ckptconv.from_dcp(tmp_path / "titan" / "checkpoint", tmp_path / "back", config=hf / "config.json", options=QUIET)
    back = hf_state(tmp_path / "back")
    assert set(back) == set(source)
    for n, bias in biases.items():
        assert torch.equal(back[f"model.layers.{n}.mlp.gate.e_score_correction_bias"], bias)
