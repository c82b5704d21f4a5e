"""Optimizer and fp32 master weights (the learning-rate schedule is ckptconv's, ``ckptconv.training.lr_at``).

The optimizer always steps fp32 tensors: the parameters themselves with ``--precision fp32``,
fp32 master copies with ``bf16`` (the bf16 parameters' gradients are accumulated into the
masters' fp32 gradients as each microbatch's backward produces them, and the masters are
copied back into the parameters after each step). Weight decay applies to matrices only, and to the
norm weights as well with ``--norm-weight-decay`` (their group takes the matrices' decay). With ZeRO-1 the optimizer state is sharded over the data-parallel ranks by
torch's ``ZeroRedundancyOptimizer``; each dp rank then saves its own part.

    >>> named = [("w", nn.Parameter(torch.zeros(2, 2))), ("norm", nn.Parameter(torch.zeros(2)))]
    >>> [group["weight_decay"] for group in param_groups(named, 0.1)]
    [0.1, 0.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckptconv.training import MASTER, OPTIMIZER_FORMAT, plain_group, state_key
from nxdtrain.config.options import OptimConfig
from nxdtrain.errors import TrainError
from nxdtrain.parallel.expert_zero import ExpertZero


def param_groups(named: list[tuple[str, nn.Parameter]], weight_decay: float, *,
                 norm_weight_decay: bool = False) -> list[dict[str, Any]]:
    """Group 0 the matrices, group 1 the vectors (norm weights), decayed only with ``norm_weight_decay``.

    Decayed, the norm weights keep a group of their own with the matrices' hyper-parameters: AdamW's update of a
    tensor depends on its group's values only, so this is exactly the norms in the decayed group, and every reader
    of the state (reshard, NxD's format, TorchTitan) keeps its matrices/vectors groups.
    """
    biases = [n for n, p in named if p.dim() < 2 and "bias" in n]
    if norm_weight_decay and biases:
        raise TrainError(f"--norm-weight-decay: the model has biases ({biases[0]}, ...), which NxDT never decays; "
                         "nxdtrain steps them in the norm weights' group, so it cannot decay one without the other")
    return [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": weight_decay if norm_weight_decay else 0.0},
    ]


def make_torch_optimizer(groups: list[dict[str, Any]], cfg: OptimConfig, *, lr: float,
                         zero_group: Any = None, capturable: bool = False) -> torch.optim.Optimizer:
    """torch's AdamW or plain SGD over ``groups``, wrapped in ZeRO-1 when ``zero_group`` is given.

    ``capturable`` (AdamW on xla): step count, bias corrections and a tensor lr stay on the device.
    """
    if cfg.optimizer == "adamw":
        cls: type[torch.optim.Optimizer] = torch.optim.AdamW
        kwargs: dict[str, Any] = {"lr": lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "capturable": capturable}
    else:
        cls, kwargs = torch.optim.SGD, {"lr": lr}
    if zero_group is None:
        return cls(groups, **kwargs)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=zero_group, **kwargs)


class Optimizer:
    """Steps fp32 (master) weights of one stage; see the module docstring."""

    def __init__(self, model: nn.Module, cfg: OptimConfig, *, initial: dict[str, torch.Tensor],
                 zero_group: Any = None, capturable: bool = False,
                 experts: tuple[tuple[str, ...], Any] | None = None) -> None:
        """``experts``: ZeRO-1 at ep > 1, (this ep rank's expert parameters, their expert-data-parallel group)."""
        self.model = model
        self.names = [name for name, _ in model.named_parameters()]
        self.params = dict(model.named_parameters())
        self.mixed = any(p.dtype != torch.float32 for p in self.params.values())
        if self.mixed:
            # Masters start from the loaded values at their stored precision, not the bf16 rounding.
            self.master = {n: nn.Parameter(initial[n].detach().to(p.device, torch.float32, copy=True))
                           for n, p in self.params.items()}
            for name, p in self.params.items():
                p.register_post_accumulate_grad_hook(self._accumulator(self.master[name]))
        else:
            self.master = self.params
        groups = param_groups([(n, self.master[n]) for n in self.names], cfg.weight_decay,
                              norm_weight_decay=cfg.norm_weight_decay)
        self.zero = zero_group is not None
        self.zero_group = zero_group
        self.zero_size = dist.get_world_size(zero_group) if self.zero else 1
        self.capturable = capturable
        self.torch_optimizer: Any = make_torch_optimizer(groups, cfg, lr=cfg.lr, zero_group=zero_group,
                                                         capturable=capturable) if experts is None else ExpertZero(
            groups, {id(self.master[n]) for n in experts[0]}, zero_group, experts[1],
            lambda part, group: make_torch_optimizer(part, cfg, lr=cfg.lr, zero_group=group, capturable=capturable))

    @staticmethod
    def _accumulator(master: nn.Parameter) -> Any:
        def hook(p: torch.Tensor) -> None:
            assert p.grad is not None
            if master.grad is None:
                master.grad = p.grad.to(torch.float32)
            else:
                master.grad.add_(p.grad)
            p.grad = None

        return hook

    def grads(self) -> dict[str, torch.Tensor]:
        """fp32 gradient of every parameter (zeros where this stage's backward produced none)."""
        out = {}
        for name in self.names:
            m = self.master[name]
            if m.grad is None:
                m.grad = torch.zeros_like(m)
            out[name] = m.grad
        return out

    def step(self, lr: float | torch.Tensor) -> None:
        for group in self.torch_optimizer.param_groups:
            group["lr"] = lr
        self.torch_optimizer.step()
        if self.mixed:
            with torch.no_grad():
                for name in self.names:
                    self.params[name].copy_(self.master[name])

    def zero_grad(self) -> None:
        for name in self.names:
            self.master[name].grad = None
            self.params[name].grad = None

    # ------------------------------------------------------------------ state

    def _local(self) -> torch.optim.Optimizer:
        """The optimizer holding this rank's state (ZeRO's local partition, or the whole one)."""
        return self.torch_optimizer.optim if self.zero else self.torch_optimizer  # type: ignore[attr-defined]

    def _owned(self) -> list[list[str]]:
        """Per param group, the names whose state this rank's optimizer holds, in its order."""
        name_of = {id(self.master[n]): n for n in self.names}
        return [[name_of[id(p)] for p in group["params"]] for group in self._local().param_groups]

    def state_dict(self) -> dict[str, Any]:
        """This rank's state in the neutral form (:mod:`ckptconv.training.nxdtrain_format.state`, format 2): plain data and
        tensors keyed by parameter name, loadable with ``torch.load(weights_only=True)``. With ZeRO-1 each
        dp rank saves the state, and the fp32 masters, of the parameters it owns."""
        local = self._local().state_dict()
        owned = [n for group in self._owned() for n in group]
        state: dict[str, Any] = {
            "format": OPTIMIZER_FORMAT, "names": list(self.names), "zero1": self.zero,
            "zero_size": self.zero_size, "dp_rank": dist.get_rank(self.zero_group) if self.zero else 0,
            "owned": owned,
            "param_groups": [plain_group(g) for g in local["param_groups"]],
        }
        for index, name in enumerate(owned):  # torch numbers parameters in group order
            for component, value in local["state"].get(index, {}).items():
                state[state_key(name, component)] = value
        if self.mixed:
            for name in owned:
                state[state_key(name, MASTER)] = self.master[name].detach().clone()
        return state

    def load_state(self, read: Callable[[str, str | None], dict[str, torch.Tensor]],
                   param_groups: list[dict[str, Any]], *, same_optimizer: bool = True) -> None:
        """Restore from the neutral form: ``read(name, only)`` gives a parameter's optimizer tensors by
        component (``master`` among them when the tag has fp32 masters; just that one with ``only``),
        already in this rank's layout. ``same_optimizer`` False (the tag was trained with another one): only the
        masters are taken, the optimizer starts its own state (the resume says so)."""
        local = self._local()
        groups: list[dict[str, Any]] = []
        state: dict[int, dict[str, torch.Tensor]] = {}
        index = 0
        masters: dict[str, torch.Tensor] = {}
        for g, names in enumerate(self._owned()):
            hyper = dict(param_groups[g]) if g < len(param_groups) and same_optimizer else {}
            if "capturable" in hyper:  # this device's setting, not the saver's (a tag moves between cpu and xla)
                hyper["capturable"] = self.capturable
            ids = []
            for name in names:
                found = read(name, None) if same_optimizer else read(name, MASTER)
                if MASTER in found:
                    masters[name] = found.pop(MASTER)
                if found:  # in the parameter's memory layout, as torch's own zeros_like state would be
                    state[index] = {c: torch.empty_like(self.master[name], dtype=t.dtype).copy_(t)
                                    if t.shape == self.master[name].shape else t for c, t in found.items()}
                ids.append(index)
                index += 1
            groups.append({**hyper, "params": ids})
        if same_optimizer:
            local.load_state_dict({"state": state, "param_groups": groups})
        with torch.no_grad():
            for name in self.names:
                master = masters.pop(name) if name in masters else read(name, MASTER).get(
                    MASTER)
                if master is not None:
                    self.master[name].copy_(master)
                    if self.mixed:
                        self.params[name].copy_(self.master[name])


def expert_zero(model: Any, groups: tuple[Any, Any] | None, zero_group: Any) -> tuple[tuple[str, ...], Any] | None:
    """ZeRO-1 at ep > 1: (this ep rank's expert parameters, their expert-data-parallel group), whose optimizer
    state is sharded apart from the rest (nxdtrain.parallel.expert_zero); None otherwise."""
    if zero_group is None or groups is None or model.ep.size == 1:
        return None
    return tuple(model.expert_params()), groups[1]
