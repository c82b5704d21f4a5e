"""A nested state written by ckptconv's torch-zip writer (ckptconv.io.torch_save) is torch.save's file byte for byte;
what the planner would pickle otherwise than torch is declined and left to torch.save."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptconv.io.torch_save import plan_object, save_object


def _torch_saved(obj: Any, path: Path) -> bytes:
    """torch.save's bytes for ``obj`` at a file of ``path``'s name (the archive name comes from it)."""
    reference = path.parent / "ref" / path.name
    reference.parent.mkdir(exist_ok=True)
    torch.save(obj, reference)
    return reference.read_bytes()


def _adamw_state() -> dict[str, Any]:
    """torch's own AdamW state_dict after a step: int keys, zero-dim steps, param_groups of plain values."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7, dtype=torch.bfloat16))]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    sum((p.float() ** 2).sum() for p in params).backward()
    optimizer.step()
    return optimizer.state_dict()


def _by_name_state() -> dict[str, Any]:
    """The shape of nxdtrain's format 2: moments and fp32 masters by parameter name, a column-major one, ep fields."""
    w = torch.randn(6, 4)
    return {"format": 2, "step": 3,
            "state": {"layers.0.w": {"exp_avg": torch.randn(6, 4), "exp_avg_sq": torch.rand(6, 4),
                                     "master": w.t().contiguous().t()},  # column-major, owns its storage
                      "norm": {"exp_avg": torch.randn(4), "exp_avg_sq": torch.zeros(0)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": ["layers.0.w", "norm"]}],
            "dp_rank": 1, "ep": 2, "ep_rank": 1, "scalar": torch.tensor(2.5), "dtype": torch.bfloat16}


@pytest.mark.parametrize("make", [_adamw_state, _by_name_state, lambda: OrderedDict(w=torch.arange(6.0), n=1)])
def test_planned_states_are_torch_saves_bytes(tmp_path: Path, make):
    state = make()
    path = tmp_path / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    assert save_object(state, path)
    assert path.read_bytes() == _torch_saved(state, path)
    loaded = torch.load(path, weights_only=True)
    flat = [(a, b) for a, b in zip(_tensors(state), _tensors(loaded), strict=True)]
    assert flat and all(torch.equal(a, b) and a.stride() == b.stride() for a, b in flat)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _shared_container() -> dict[str, Any]:
    moments = {"exp_avg": torch.zeros(2)}
    return {"a": moments, "b": moments}  # one memo entry in torch.save's pickle


def _shared_storage() -> dict[str, Any]:
    base = torch.zeros(4)
    return {"a": base, "b": base.view(2, 2)}


DECLINED = {
    "a view of a larger storage": lambda: {"w": torch.zeros(4, 4)[1]},
    "two tensors on one storage": _shared_storage,
    "one container twice": _shared_container,
    "a tensor that needs grad": lambda: {"w": torch.zeros(2, requires_grad=True)},
    "an int key at the top": lambda: {0: torch.zeros(2)},
    "a value pickled by its class": lambda: {"w": torch.zeros(2), "when": Path("/x")},
    "not a dict": lambda: [torch.zeros(2)],
}


@pytest.mark.parametrize("name", DECLINED)
def test_what_the_planner_cannot_write_as_torch_does_is_declined_and_nothing_is_written(tmp_path: Path, name):
    path = tmp_path / "x.pt"
    assert not save_object(DECLINED[name](), path)
    assert not path.exists()


def test_a_declined_state_falls_back_to_torch_save_through_save_torch(tmp_path: Path):
    from ckptconv.engine.tags import save_torch

    state = _shared_storage()
    path = save_torch(state, tmp_path / "x.pt")
    partial = tmp_path / ".x.pt.partial"  # what torch.save named the archive after, as before
    assert path.read_bytes() == _torch_saved(state, partial)
    assert plan_object(_by_name_state()) is not None
