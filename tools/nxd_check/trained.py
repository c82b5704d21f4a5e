"""A case folder for a tag that nxdtrain TRAINED (resumed from a fixture case, saved in NxD's format), so that
``check`` can have NxD's loader resume it and continue one step.

A trained tag has no uninterrupted NxD run to compare with, so the references are made here, independently of
the writer: ``params_at_save`` is what the tag's files hold (read with ``torch.load(weights_only=True)``; index to
name from the fixture case's param groups, which NxD's example rule also makes); ``grads_next`` is the fixture's
recorded gradient; ``params_after_next`` is one step of eager ``torch.optim.AdamW`` on the CPU from the tag's
state, at the learning rate NxD's example ``CosineAnnealing`` gives the next step of an uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ckptconv.io.safe_load import TensorReference, load_small

from .case import Case
from .stand_ins import import_example

RANK_FILE = "dp_rank_00_tp_rank_00_pp_rank_00.pt"


def _resolve(obj: Any, tensors: Path) -> Any:
    """An xser file's structure with each TensorReference replaced by its tensor file's tensor."""
    if isinstance(obj, TensorReference):
        return load_small(tensors / f"tensor_{obj.tid}.pt")
    if isinstance(obj, dict):
        return {k: _resolve(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_resolve(v, tensors) for v in obj]
    return obj


def read_torch(path: Path) -> Any:
    return _resolve(load_small(path), Path(f"{path}.tensors"))


def tag_state(case: Case, tag: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(values the optimizer updates, AdamW state) by parameter name, as the tag's files hold them."""
    names = [n for group in case.manifest["param_groups"] for n in group["params"]]  # optimizer index order
    optim = read_torch(tag / "optim" / RANK_FILE)
    if "base_state" in optim:  # ZeRO-1: the masters are the values (dp 1: whole tensors)
        state = optim["base_state"]
        masters = optim.get("sharded_master_weights")
        if masters is None:
            raise SystemExit(f"{tag}: a ZeRO-1 optimizer file without sharded_master_weights (no fp32 values)")
        values = {names[i]: masters[i] for i in range(len(names))}
    else:
        state = optim["state"]
        model = read_torch(tag / "model" / RANK_FILE)
        values = {n: model[n] for n in names}
    moments = {names[i]: {k: state[i][k] for k in ("step", "exp_avg", "exp_avg_sq")} for i in range(len(names))}
    return values, moments


def uninterrupted_lr(case: Case, step: int) -> float:
    """The learning rate of ``step`` under the case's schedule, from NxD's example ``CosineAnnealing``."""
    s = case.manifest["scheduler"]
    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=case.manifest["optimizer"]["lr"])
    scheduler = import_example("lr").CosineAnnealing(
        probe,
        max_steps=s["max_steps"],
        warmup_steps=s["warmup_steps"],
        min_lr=s["min_lr"],
        constant_steps=s["constant_steps"],
    )
    for _ in range(step - 1):
        probe.step()
        scheduler.step()
    return float(probe.param_groups[0]["lr"])


def adamw_step(
    case: Case,
    values: dict[str, torch.Tensor],
    moments: dict[str, dict[str, torch.Tensor]],
    grads: dict[str, torch.Tensor],
    lr: float,
) -> dict[str, torch.Tensor]:
    """One eager CPU ``torch.optim.AdamW`` step (single-tensor, as NxD's XLA one) from the given state."""
    opt = case.manifest["optimizer"]
    params = {n: torch.nn.Parameter(v.clone()) for n, v in values.items()}
    groups = [
        {"params": [params[n] for n in g["params"]], "weight_decay": g["weight_decay"]}
        for g in case.manifest["param_groups"]
    ]
    adamw = torch.optim.AdamW(groups, lr=lr, betas=tuple(opt["betas"]), eps=opt["eps"], foreach=False)
    for n, p in params.items():
        m = moments[n]
        adamw.state[p] = {
            "step": m["step"].clone().float(),
            "exp_avg": m["exp_avg"].clone().to(p.dtype),
            "exp_avg_sq": m["exp_avg_sq"].clone().to(p.dtype),
        }
        p.grad = grads[n].to(p.dtype)
    adamw.step()
    return {n: p.detach().clone() for n, p in params.items()}


def make_case(fixture: Path, tag: Path, out: Path, name: str) -> dict[str, Any]:
    """Write the case folder ``out`` for ``tag`` (nxdtrain's save, resumed from fixture case ``fixture``)."""
    case = Case.open(fixture)
    values, moments = tag_state(case, tag)
    steps = {float(m["step"]) for m in moments.values()}
    if len(steps) != 1:
        raise SystemExit(f"{tag}: AdamW steps differ between parameters: {sorted(steps)}")
    saved_step = int(steps.pop())
    lr = uninterrupted_lr(case, saved_step + 1)
    grads = case.reference("grads_next.nxd")
    after = adamw_step(case, values, moments, grads, lr)
    (out / "reference").mkdir(parents=True)
    (out / "hf").mkdir()
    shutil.copy(fixture / case.manifest["hf_config_file"], out / "hf" / "config.json")
    save_file({n: v.contiguous() for n, v in values.items()}, out / "reference" / "params_at_save.nxd.safetensors")
    save_file(grads, out / "reference" / "grads_next.nxd.safetensors")
    save_file({n: v.contiguous() for n, v in after.items()}, out / "reference" / "params_after_next.nxd.safetensors")
    manifest = {k: v for k, v in case.manifest.items() if k not in ("files", "resume_by_nxd", "second_run")}
    manifest.update(
        case=name,
        trained_from=case.name,
        saved_after_step=saved_step,
        next_step=saved_step + 1,
        next_lr=lr,
        hf_config_file="hf/config.json",
        reference={"params_after_next": "eager CPU torch.optim.AdamW, one step from the tag's state"},
    )
    (out / "case.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
