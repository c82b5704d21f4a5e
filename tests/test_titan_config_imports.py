"""Every TorchTitan name the generated ``torchtitan_config.py`` uses, imported from the installed TorchTitan (the
TorchTitan lane), for each model family; the file picks its branch by what that TorchTitan has (0.3.0 here:
``components.checkpointer``, ``HuggingFaceTextDataLoader``, ``seq_len`` rows; main: the Grain loader and the token
budget) and builds TorchTitan's own ``Trainer.Config``. Reference: TorchTitan's modules themselves."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="the TorchTitan lane: make setup-titan test-titan")

from ckptconv.core.model_spec import ModelSpec  # noqa: E402
from ckptconv.titan.config_file import TitanRun, config_module  # noqa: E402
from tests.conftest import make_tiny_llama  # noqa: E402
from tests.deepseek_models import config_kwargs  # noqa: E402
from tests.gpt_oss_models import gpt_oss_config  # noqa: E402
from tests.titan_shims import generated_config  # noqa: E402

RUN = TitanRun(groups=({"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
                       {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}),
               warmup_steps=10, decay_type="cosine", min_lr_factor=0.1, total_steps=100, step=40, seq_len=64,
               max_norm=1.0)


def _configs(tmp: Path) -> dict[str, dict]:
    import json

    import transformers

    llama = json.loads((make_tiny_llama(tmp / "llama", layers=2) / "config.json").read_text())
    qwen3 = {**llama, "model_type": "qwen3", "head_dim": 8}
    qwen3_moe = {**qwen3, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 16, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    deepseek = transformers.DeepseekV3Config(**config_kwargs()).to_dict()
    return {"llama": llama, "qwen3": qwen3, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek,
            "gpt_oss": gpt_oss_config().to_dict()}


def titan_imports(text: str, taken: dict[str, bool]) -> list[tuple[str, str]]:
    """(module, name) of every ``from torchtitan... import`` in the file, those under ``if FLAG:`` only when the
    installed TorchTitan takes that branch (``taken``: the module's flags)."""
    found: list[tuple[str, str]] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchtitan"):
                found.extend((node.module or "", alias.name) for alias in node.names)
            elif isinstance(node, ast.Try):
                walk(node.body)
            elif isinstance(node, ast.If) and isinstance(node.test, ast.Name):
                walk(node.body if taken[node.test.id] else node.orelse)

    walk(ast.parse(text).body)
    return found


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("run", [None, RUN], ids=["model-only", "with-state"])
def test_every_name_the_generated_file_imports_is_in_the_installed_torchtitan(tmp_path, name, run):
    spec = ModelSpec.from_config(_configs(tmp_path)[name])
    out = tmp_path / "dcp"
    out.mkdir()
    text = config_module(spec, run, what="a test")
    (out / "torchtitan_config.py").write_text(text)
    module = generated_config(out)
    names = titan_imports(text, {"_GRAIN": module._GRAIN})
    assert ("torchtitan.components.checkpointer", "CheckpointManager") in names  # on 0.3.0 and main alike
    for mod, attr in names:
        assert hasattr(importlib.import_module(mod), attr), f"{mod}.{attr}"
    from torchtitan.config import TrainingConfig
    from torchtitan.hf_datasets import text_datasets
    from torchtitan.trainer import Trainer

    # the branch taken is the one the installed TorchTitan's own classes call for
    assert module._GRAIN is not hasattr(text_datasets, "HuggingFaceTextDataLoader")
    fields = {f.name for f in dataclasses.fields(TrainingConfig)}
    assert module._TOKEN_BUDGET is ("max_context_length" in fields)
    config = module.continue_run()
    assert isinstance(config, Trainer.Config)
    batch = (config.training.max_context_length if module._TOKEN_BUDGET else config.training.seq_len)
    assert batch == module.SEQ_LEN and config.training.steps == module.STEPS
    assert config.checkpoint.exclude_from_loading == ([] if run is None else ["dataloader"])
