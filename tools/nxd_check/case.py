"""One fixture case of ``fixtures/nxdt-official/``: its manifest, its references and its weights recipe.

Everything the NxD run needs comes from the case folder (``case.json``, ``hf/config.json``, ``reference/``),
never from the tag being checked: the tag is the thing under test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


@dataclass(frozen=True)
class Case:
    """A fixture case folder, read once."""

    folder: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, folder: Path) -> Case:
        path = folder / "case.json"
        if not path.is_file():
            raise SystemExit(f"--case {folder}: no case.json (expected a folder of fixtures/nxdt-official/)")
        return cls(folder, json.loads(path.read_text()))

    @property
    def name(self) -> str:
        return str(self.manifest["case"])

    @property
    def flags(self) -> dict[str, Any]:
        return dict(self.manifest["flags"])

    @property
    def nxdt_style(self) -> bool:
        """NxDT (lightning) saves: no ``scheduler.pt``, the schedule lives in ``user_content["lr_schedulers"]``."""
        return self.flags["style"] == "nxdt"

    def reference(self, name: str) -> dict[str, torch.Tensor] | None:
        """``reference/<name>.safetensors`` (e.g. ``grads_next.nxd``), or None where the case has none."""
        path = self.folder / "reference" / f"{name}.safetensors"
        return load_file(path) if path.is_file() else None

    def hf_config(self) -> dict[str, Any]:
        return json.loads((self.folder / self.manifest["hf_config_file"]).read_text())


def recipe_weights(case: Case, *, init_seed: int) -> dict[str, torch.Tensor]:
    """The case's ``weights_recipe`` in NxD names at tp 1, fp32, with ``torch.manual_seed(init_seed)``.

    The recipe: transformers' ``LlamaForCausalLM`` default init, every ``*norm.weight`` plus 0.1 x randn from a
    generator seeded ``seed + 7`` (the case's seed, whatever ``init_seed`` is), q/k/v rows fused into
    ``weight_qkv`` and gate/up rows into ``gate_up_proj``. The resumes start from ``init_seed = seed + 1``
    ("other starting weights": with them the ``zero1_fp32`` objects-way resume is off by the recorded 0.1208).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    seed = int(case.manifest["seed"])
    torch.manual_seed(init_seed)
    hf = LlamaForCausalLM(LlamaConfig(**case.manifest["hf_config"])).state_dict()
    weights = {k: v.detach().float().clone() for k, v in hf.items()}
    norms = torch.Generator().manual_seed(seed + 7)
    for key in weights:  # in the model's order: the generator's draws depend on it
        if key.endswith("norm.weight"):
            weights[key] += 0.1 * torch.randn(weights[key].shape, generator=norms)
    nxd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": weights["model.embed_tokens.weight"]}
    for i in range(int(case.manifest["hf_config"]["num_hidden_layers"])):
        p = f"model.layers.{i}."
        nxd[p + "self_attn.qkv_proj.weight_qkv"] = torch.cat([weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        nxd[p + "self_attn.o_proj.weight"] = weights[p + "self_attn.o_proj.weight"]
        nxd[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]
        )
        nxd[p + "mlp.down_proj.weight"] = weights[p + "mlp.down_proj.weight"]
        nxd[p + "input_layernorm.weight"] = weights[p + "input_layernorm.weight"]
        nxd[p + "post_attention_layernorm.weight"] = weights[p + "post_attention_layernorm.weight"]
    nxd["model.norm.weight"] = weights["model.norm.weight"]
    nxd["lm_head.weight"] = weights["lm_head.weight"]
    return nxd
