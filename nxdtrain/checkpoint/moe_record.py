"""What a tag records of an MoE run's routing (``run["moe"]``), and the resume check: another capacity factor, top-k
or aux loss than the tag's is refused unless ``--override-moe`` (as ``--override-schedule`` for the schedule)."""

from __future__ import annotations

from typing import Any

from nxdtrain.errors import TrainError
from nxdtrain.model.capacity import Routing

FLAGS = {"capacity_factor": "--capacity-factor", "top_k": "--moe-top-k", "normalize": "--normalize-top-k-affinities",
         "aux_coef": "--router-aux-loss-coef", "aux_scale": "--aux-loss-scale"}


def moe_record(r: Routing) -> dict[str, Any]:
    """The routing as a tag records it (``capacity_factor`` None: dropless; ``aux_coef`` 0: no aux loss)."""
    return {"capacity_factor": r.capacity, "top_k": r.top_k, "normalize": r.normalize,
            "aux_coef": r.coef if r.aux else 0.0, "aux_scale": "nxd" if r.aux_per_k else "transformers"}


def check_moe_resume(old: dict[str, Any] | None, new: dict[str, Any], before: dict[str, Any], *, tag: str,
                     override: bool) -> list[str]:
    """Lines for the log; raise when this run routes otherwise than ``old`` (the tag's record; a tag without one was
    trained as ``before``, the routing without any MoE option) and ``override`` is off."""
    notes = []
    if old is None:
        old = before
        if new != before:
            notes.append(f"{tag} records no MoE routing (an older tag): it trained dropless with config.json's routing")
    changed = [f"{FLAGS[k]} {old.get(k)} -> {new[k]}" for k in FLAGS if old.get(k) != new[k]]
    if not changed:
        return notes
    if not override:
        raise TrainError(f"--resume: this run routes otherwise than {tag} recorded: {'; '.join(changed)}; resume "
                         "with the recorded values, or pass --override-moe to change the run on purpose")
    return [*notes, f"--override-moe: the routing changes at this resume: {'; '.join(changed)}"]
