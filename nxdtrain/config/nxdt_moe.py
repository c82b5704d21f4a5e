"""An NxDT YAML's ``model.moe`` as NxDT's HF Mixtral reads it, turned into nxdtrain's MoE options.

NxDT (neuronx-distributed-training 2.26) lays ``model.moe`` over config.json in ``HFMixtralModule._get_model``: every
key wins over config.json, and a key the file lacks takes NxDT's default (:data:`NXDT_MOE_DEFAULTS`), not
config.json's. Its ``training_orchestrator.py`` reads ``dropless`` and ``capacity_factor`` before: dropless sets the
factor to 0.0, dropping needs a factor > 0. Its loss is NxD's ``load_balancing_loss_func``: transformers' / top_k.
"""

from __future__ import annotations

from typing import Any

from nxdtrain.errors import TrainError

# Key -> (nxdtrain option, NxDT's default where the key is absent): HFMixtralModule._get_model's `moe.get(key, DEFAULT)`
NXDT_MOE_DEFAULTS: dict[str, tuple[str, Any]] = {
    "num_experts": ("num_experts", 1),
    "top_k": ("moe_top_k", 1),
    "normalize_top_k_affinities": ("normalize_top_k_affinities", True),
    "router_aux_loss_coef": ("router_aux_loss_coef", 0.02),
    "output_router_logits": ("output_router_logits", True),
}
# Read, but with no option of their own (handled in nxdt_moe); sinkhorn_*: NxDT's Megatron models only
OTHER_KEYS = ("frequency", "dropout", "capacity_factor", "dropless", "routing_algorithm", "glu_mlp",
              "sinkhorn_iterations", "sinkhorn_tol")
MOE_KEYS = (*NXDT_MOE_DEFAULTS, *OTHER_KEYS)


def nxdt_moe(moe: dict[str, Any], where: str) -> tuple[dict[str, tuple[Any, str]], list[str]]:
    """``{option: (value, key)}`` for ``model.moe``'s mapping ``moe``, and notes; raise TrainError (``where``: the
    file) in one line where NxDT would fail or where nxdtrain cannot do what NxDT does."""
    out: dict[str, tuple[Any, str]] = {}
    notes = []
    for key, (option, default) in NXDT_MOE_DEFAULTS.items():
        out[option] = (moe.get(key, default), f"model.moe.{key}" if key in moe else f"model.moe ({key} absent: "
                                                                                    f"NxDT's default {default})")
    out["aux_loss_scale"] = ("nxd", "model.moe")
    frequency = moe.get("frequency", 1)
    if frequency != 1:
        raise TrainError(f"{where}: model.moe.frequency {frequency!r}: NxDT's Mixtral makes only layers 0, "
                         f"{frequency}, ... sparse and the others dense MLPs, which an HF Mixtral checkpoint does not "
                         "have; nxdtrain trains frequency 1 (every layer sparse)")
    dropout = moe.get("dropout", 0)
    if dropout:
        notes.append(f"model.moe.dropout {dropout}: NxDT's HF Mixtral writes it to attention_dropout, which its "
                     "attention never reads: no dropout in NxDT, none in nxdtrain")
    algorithm = moe.get("routing_algorithm", "top_k")
    if algorithm != "top_k":
        notes.append(f"model.moe.routing_algorithm {algorithm}: NxDT's HF Mixtral always routes top-k "
                     "(RouterTopK); so does nxdtrain")
    if not moe.get("glu_mlp", True):
        raise TrainError(f"{where}: model.moe.glu_mlp false: Mixtral's experts are gated (GLU); set true")
    factor = moe.get("capacity_factor")
    if moe.get("dropless", False):
        if factor:
            notes.append(f"model.moe.capacity_factor {factor} with dropless true: NxDT sets it to 0.0 (dropless)")
        out["capacity_factor"] = (0.0, "model.moe.dropless")
    elif not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise TrainError(f"{where}: model.moe.capacity_factor {factor!r} with dropless false: NxDT's dropping needs a "
                         "capacity factor > 0 (or dropless: true)")
    else:
        out["capacity_factor"] = (float(factor), "model.moe.capacity_factor")
    return out, notes
