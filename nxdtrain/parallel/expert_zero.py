"""ZeRO-1 with expert parallelism: the optimizer state of the non-expert parameters sharded over data parallel, of
this ep rank's experts over its expert-data-parallel ranks (the ranks holding the same experts), as NxD's
``NeuronEPZero1Optimizer`` shards them; each part is torch's ``ZeroRedundancyOptimizer`` (a plain optimizer where
its group has one rank).

:class:`ExpertZero` stands where :class:`nxdtrain.optim.Optimizer` keeps one ZeRO optimizer: ``param_groups``
(every part's, for the learning rate), ``step()`` and ``optim``, this rank's local state seen as one optimizer
whose param groups are the matrices' and the vectors' (each part's local groups merged, non-expert parameters
first), numbered in that order, so the saved state is format 2 as without experts (state by parameter name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class _Local:
    """This rank's local optimizers of both parts as one: merged param groups, state numbered in their order."""

    def __init__(self, locals_: list[torch.optim.Optimizer], slots: list[list[int]]) -> None:
        self.parts, self.slots = locals_, slots  # slots[k][j]: the merged group of part k's group j

    def _members(self) -> list[list[tuple[int, torch.Tensor]]]:
        """Per merged group, (part, parameter) in order."""
        merged: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(1 + max(max(s) for s in self.slots))]
        for k, part in enumerate(self.parts):
            for j, group in enumerate(part.param_groups):
                merged[self.slots[k][j]] += [(k, p) for p in group["params"]]
        return merged

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        hyper = {self.slots[k][j]: g for k, part in enumerate(self.parts) for j, g in enumerate(part.param_groups)}
        return [{**{n: v for n, v in hyper[g].items() if n != "params"}, "params": [p for _, p in members]}
                for g, members in enumerate(self._members())]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Both parts' state by parameter, as ``torch.optim.Optimizer.state`` (the trainer's memory count reads it)."""
        return {p: s for part in self.parts for p, s in part.state.items()}

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for group, members in zip(self.param_groups, self._members(), strict=True):
            ids = []
            for k, p in members:
                if p in self.parts[k].state:
                    state[index] = dict(self.parts[k].state[p])
                ids.append(index)
                index += 1
            groups.append({**{n: v for n, v in group.items() if n != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, merged: dict[str, Any]) -> None:
        """``merged`` numbered as :meth:`state_dict` numbers it; each part gets its own share."""
        where: dict[int, tuple[int, torch.Tensor]] = {}
        index = 0
        for members in self._members():
            for k, p in members:
                where[index] = (k, p)
                index += 1
        for k, part in enumerate(self.parts):
            local_id = {id(p): i for i, p in enumerate(p for g in part.param_groups for p in g["params"])}
            state = {local_id[id(p)]: value for i, value in merged["state"].items()
                     for kk, p in [where[i]] if kk == k}
            groups, start = [], 0
            for j, group in enumerate(part.param_groups):
                hyper = {n: v for n, v in merged["param_groups"][self.slots[k][j]].items() if n != "params"}
                groups.append({**hyper, "params": list(range(start, start + len(group["params"])))})
                start += len(group["params"])
            part.load_state_dict({"state": state, "param_groups": groups})


class ExpertZero:
    """The two ZeRO-1 parts of one stage's optimizer; ``make(groups, process_group)`` builds one part."""

    def __init__(self, groups: list[dict[str, Any]], experts: set[int], dp_group: Any, edp_group: Any,
                 make: Callable[[list[dict[str, Any]], Any], torch.optim.Optimizer]) -> None:
        self.parts: list[torch.optim.Optimizer] = []
        slots: list[list[int]] = []
        for mine, group_of in ((lambda p: id(p) not in experts, dp_group), (lambda p: id(p) in experts, edp_group)):
            split = [(g, {**group, "params": [p for p in group["params"] if mine(p)]}) for g, group in enumerate(groups)]
            split = [(g, group) for g, group in split if group["params"]]  # an expert part has matrices only
            if split:
                self.parts.append(make([group for _, group in split], group_of))
                slots.append([g for g, _ in split])
        self._slots = slots

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts for group in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    @property
    def optim(self) -> _Local:
        return _Local([getattr(part, "optim", part) for part in self.parts], self._slots)
