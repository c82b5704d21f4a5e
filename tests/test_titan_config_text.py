"""What the generated ``torchtitan_config.py`` tells a new user (no TorchTitan needed): the steps a SET value
with the source's total (and a run already at its end said), a missing tokenizer said by to-dcp and ``--tokenizer``
to add one, the precision of the run, which attention backends need a GPU, TorchTitan main's #4168 rule, and a
one-line refusal where TorchTitan cannot serve the file."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

import ckptconv
from ckptconv.commands.api import RunOptions
from ckptconv.core.model_spec import ModelSpec
from ckptconv.errors import ConversionError
from ckptconv.io.hf import CONFIG
from ckptconv.titan.config_file import TitanRun, config_module, excluded
from tests.conftest import make_tiny_llama

QUIET = RunOptions(quiet=True)
RUN = TitanRun(groups=({"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
                       {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}),
               warmup_steps=2, decay_type="linear", min_lr_factor=0.0, total_steps=40, step=40, seq_len=16,
               max_norm=None)


def line(text: str, name: str) -> str:
    return next(row for row in text.splitlines() if row.startswith(f"{name} = "))


def test_steps_are_a_set_value_with_the_source_total_and_a_finished_run_is_said(tmp_path):
    spec = ModelSpec.from_file(make_tiny_llama(tmp_path / "m", layers=1) / CONFIG)
    ended = line(config_module(spec, RUN, what="x"), "STEPS")
    assert ended.startswith("STEPS = 40 ") and "# SET" in ended
    assert "its run is at step 40 already, so TorchTitan would stop at once: raise it to train" in ended
    going = line(config_module(spec, dataclasses.replace(RUN, step=10), what="x"), "STEPS")
    assert "# SET" in going and "(the source's total: 40; the run is at step 10)" in going


def test_a_fp32_source_without_tokenizer_is_said_and_tokenizer_adds_one(tmp_path):
    src = make_tiny_llama(tmp_path / "fp32", layers=1)  # fp32, no tokenizer files
    result = ckptconv.to_dcp(src, tmp_path / "dcp", options=QUIET)
    text = (tmp_path / "dcp" / "torchtitan_config.py").read_text()
    assert line(text, "MIXED_PRECISION_PARAM") == ('MIXED_PRECISION_PARAM = \'float32\'  # the compute dtype '
                                                  "(the source's: its weights are float32)")
    assert "hf/ holds NO tokenizer" in line(text, "HF_ASSETS_PATH")
    assert any(n.startswith(f"no tokenizer: {tmp_path / 'dcp' / 'hf'}/ holds none") for n in result.notes)
    assert "steps" in result.notes[-1] and "attention" in result.notes[-1]  # the printed advice names them
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {}}')
    result = ckptconv.to_dcp(src, tmp_path / "with-tok", tokenizer=tok, options=QUIET)
    assert (tmp_path / "with-tok" / "hf" / "tokenizer.json").read_text() == '{"model": {}}'
    assert not any(n.startswith("no tokenizer") for n in result.notes)
    assert "NO tokenizer" not in (tmp_path / "with-tok" / "torchtitan_config.py").read_text()


def test_a_bf16_source_keeps_torchtitans_default_and_the_attention_note_names_the_gpu(tmp_path):
    src = make_tiny_llama(tmp_path / "bf16", layers=1, dtype=torch.bfloat16)
    ckptconv.to_dcp(src, tmp_path / "dcp", options=QUIET)
    text = (tmp_path / "dcp" / "torchtitan_config.py").read_text()
    assert line(text, "MIXED_PRECISION_PARAM").startswith("MIXED_PRECISION_PARAM = 'bfloat16'")
    attn = text[text.index("ATTN_BACKEND = "):].split("\n\n")[0]
    assert "need a GPU: FlexAttention has no CPU" in " ".join(attn.split()) and "sdpa (runs on a CPU too)" in attn


def test_the_optimizer_is_never_excluded_while_the_lr_scheduler_loads():
    assert excluded(["dataloader"]) == ["dataloader"]
    assert excluded(["optimizer", "lr_scheduler"]) == ["optimizer", "lr_scheduler"]
    with pytest.raises(ConversionError, match="lr_scheduler must be excluded when optimizer is"):
        excluded(["optimizer", "dataloader"])


def test_without_a_torchtitan_it_can_serve_the_file_refuses_in_one_line(tmp_path):
    pytest.importorskip("transformers")
    if __import__("importlib").util.find_spec("torchtitan") is not None:
        pytest.skip("a TorchTitan is installed here (the TorchTitan lane checks its names)")
    spec = ModelSpec.from_file(make_tiny_llama(tmp_path / "m", layers=1) / CONFIG)
    path = tmp_path / "torchtitan_config.py"
    path.write_text(config_module(spec, None, what="x"))
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr == (f"{path}: TorchTitan (not installed) cannot serve this file (No module named "
                           "'torchtitan'): it needs TorchTitan 0.3.0 or later (its config registry: torchtitan.trainer, "
                           "torchtitan.models.common)\n")
