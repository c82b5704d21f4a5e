"""What the verbs of ckptconv.commands share beyond the run itself (:mod:`ckptconv.engine.run`): the input files a
conversion reads, the HF config a converted checkpoint records, and the training a tag records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptconv.core.layout import HF_FILES_DIR
from ckptconv.core.plan import Plan
from ckptconv.io.hf import CONFIG, config_text
from ckptconv.io.quantized import plain_config
from ckptconv.sources.masters import MasterWeights
from ckptconv.training import RECORD_KEY
from ckptconv.training.nxd_format.read import OPTIM_DIR

EXPORTED_FROM = "from_tag"  # an HF export's ckptconv.json: the record of the tag it was exported from


def input_files(ckpt: Any) -> list[Path]:
    """The files a conversion of ``ckpt`` reads: its model shards, and the optimizer files when the
    weights are NxD's masters (so that an output is never "up to date" with other inputs)."""
    files = sorted(ckpt.files.values())
    if isinstance(ckpt.weight_source, MasterWeights):  # nxdtrain's masters: named apart (ckpt.masters_identity)
        files += sorted(p for p in (ckpt.root / OPTIM_DIR).rglob("*") if p.is_file())
    return files


def config_as_written(config: dict[str, Any], dtype: str, plan: Plan, copies: list[tuple[str, str]]
                       ) -> tuple[dict[str, Any], list[tuple[str, str]], dict[str, str]]:
    """(HF config to record, side-file copies, texts) of a converted checkpoint: after a deliberate
    ``--dtype`` cast the written dtype becomes the model's, in ckptconv.json and in the kept
    ``hf/config.json`` (so ``to-hf --dtype source`` keeps it); otherwise all as they were. The weights written are
    plain: the config recorded has no ``quantization_config`` (a quantized source is dequantized as read)."""
    name = dtype_name(plan)
    config = plain_config(config)
    if dtype == "keep" or "," in name:
        return config, copies, {}
    config = {**config, "torch_dtype": name, "dtype": name}
    kept = f"{HF_FILES_DIR}/{CONFIG}"
    return config, [c for c in copies if c[1] != kept], {kept: config_text(config, plan.files[0].tensors[0].dtype)}


def dtype_name(plan: Plan) -> str:
    names = sorted({str(t.dtype).removeprefix("torch.") for f in plan.files for t in f.tensors
                    if not t.key.endswith("inv_freq")})
    return names[0] if len(names) == 1 else ",".join(names)


def trained_record(meta: Any, key: str = RECORD_KEY) -> dict[str, Any] | None:
    """The run record of a tag that was trained (its ``ckptconv.json`` records step 1 or later), else None;
    ``key`` EXPORTED_FROM: the record of the trained tag an HF export was made from."""
    record = (getattr(meta, "extra", None) or {}).get(key)
    if not isinstance(record, dict) or not isinstance(record.get("step"), int) or record["step"] < 1:
        return None
    return record
