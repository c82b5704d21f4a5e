"""``ckptconv inspect`` of a DCP directory or a TorchTitan checkpoint root: its steps, what a step holds (model and
which state families), the model it can infer, dtypes and bytes. Reads ``.metadata`` only (and the small values
``train_state.step``, ``lr_scheduler.last_epoch``); the data files are checked for their size, not read."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from ckptconv.errors import ConversionError
from ckptconv.io.dcp import METADATA, DcpCheckpoint
from ckptconv.titan.names import STATE_FAMILIES, family

_STEP = re.compile(r"step-(\d+)")  # TorchTitan's step-N folders (its own discovery: re.search)
_LAYER = re.compile(r"^layers\.(\d+)\.")


def is_dcp(path: Path) -> bool:
    """A DCP directory (``.metadata``) or a TorchTitan checkpoint root (``step-N`` directories)."""
    return path.is_dir() and ((path / METADATA).is_file() or bool(titan_steps(path)))


def titan_steps(root: Path) -> list[dict[str, Any]]:
    """The ``step-N`` folders of a TorchTitan checkpoint root, by N: complete when DCP's ``.metadata`` (written
    last) or a final HF save's ``model.safetensors.index.json`` is there, as TorchTitan decides which to resume."""
    steps = []
    for p in root.iterdir():
        if p.is_dir() and (m := _STEP.search(p.name)):
            complete = (p / METADATA).is_file() or (p / "model.safetensors.index.json").is_file()
            steps.append({"step": int(m.group(1)), "dir": p.name, "complete": complete})
    return sorted(steps, key=lambda s: s["step"])


def inspect_dcp(path: Path, config: str | Path | None, check: bool) -> dict[str, Any]:
    """What :func:`ckptconv.commands.inspect.inspect` says of a DCP directory or a TorchTitan root."""
    steps = None if (path / METADATA).is_file() else titan_steps(path)
    with DcpCheckpoint(path, check=check) as ckpt:
        tensors = {k: e for k, e in ckpt.entries.items() if e.is_tensor}
        held = Counter(family(k) for k in ckpt.entries)
        dtypes = Counter(str(e.dtype).removeprefix("torch.") for e in tensors.values())
        nbytes = sum(_numel(e.size) * e.dtype.itemsize for e in tensors.values() if e.dtype is not None)
        model_keys = {k: e.size for k, e in tensors.items() if family(k) == "model"}
        values = {k: _value(ckpt, k) for k in ("train_state.step", "lr_scheduler.last_epoch") if k in ckpt.entries}
        files = [p.name for p in ckpt.data_files()]
        problems = [f"{f.name}: missing" for f in ckpt.data_files() if not f.is_file()]
        out: dict[str, Any] = {
            "kind": "dcp",
            "path": str(path),
            "root": str(ckpt.root),
            "found_as": ckpt.found_as,
            **({"steps": steps, "newest_complete": max((s["step"] for s in steps if s["complete"]), default=None)}
               if steps is not None else {}),
            "holds": {name: held.get(name, 0) for name in ("model", *STATE_FAMILIES)},
            "model": _model(ckpt, config, model_keys),
            "tensors": len(tensors),
            "parameters": sum(_numel(s) for s in model_keys.values()),
            "bytes": nbytes,
            "dtypes": dict(dtypes),
            "files": files,
            "metadata": ckpt.metadata is not None,
            "complete": not problems,
            "problems": problems,
            **({"train_state": values} if values else {}),
        }
    return out


def _value(ckpt: DcpCheckpoint, key: str) -> Any:
    value = ckpt.read_value(key) if not ckpt.entries[key].is_tensor else ckpt.read_rows(_source(key), 0, 1)
    return value.item() if hasattr(value, "item") else value


def _source(key: str) -> Any:
    from ckptconv.core.plan import Source

    return Source(None, key)


def _model(ckpt: DcpCheckpoint, config: str | Path | None, keys: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The model's HF config where the DCP records one (to-dcp writes it into ckptconv.json) or ``config`` gives it;
    else what TorchTitan's key names and shapes say."""
    from ckptconv.sources.nxd import model_spec_of

    try:
        return {**model_summary(model_spec_of(ckpt.root, ckpt.metadata, config, missing="no config")), "from": "config"}
    except ConversionError:
        pass  # a TorchTitan run's own checkpoint records none
    return {**infer_titan_model(keys), "from": "key names and shapes"}


def infer_titan_model(keys: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Dims a TorchTitan model's keys give away (no head count without a q/k norm: a head's width is not stored)."""
    layers = {int(m.group(1)) for k in keys if (m := _LAYER.match(k))}
    out: dict[str, Any] = {"layers": len(layers)}
    if "tok_embeddings.weight" in keys:
        out["vocab"], out["hidden"] = keys["tok_embeddings.weight"]
    out["tied"] = "lm_head.weight" not in keys
    out["qk_norm"] = "layers.0.attention.q_norm.weight" in keys
    out["family"] = "qwen3" if out["qk_norm"] else "llama3"  # TorchTitan's model names, as its keys tell them
    q, k = keys.get("layers.0.attention.qkv_linear.wq.weight"), keys.get("layers.0.attention.qkv_linear.wk.weight")
    if q and k:
        out["q_rows"], out["kv_rows"] = q[0], k[0]
        if out["qk_norm"]:
            head_dim = keys["layers.0.attention.q_norm.weight"][0]
            out.update(head_dim=head_dim, heads=q[0] // head_dim, kv_heads=k[0] // head_dim)
    if fused := keys.get("layers.0.attention.qkv_linear.wqkv.weight"):
        out["qkv_rows"] = fused[0]  # heads and kv heads fused: their split is not stored
    if "layers.0.feed_forward.w1.weight" in keys:
        out["intermediate"] = keys["layers.0.feed_forward.w1.weight"][0]
    experts = [s for key, s in keys.items() if key.endswith("moe.routed_experts.inner_experts.w1_EFD")]
    if experts:
        out["experts"], out["moe_intermediate"] = experts[0][0], experts[0][1]
    return out


def model_summary(spec: Any) -> dict[str, Any]:
    """What inspect says of a model (any format)."""
    return {
        "family": spec.model_type, "layers": spec.layers, "hidden": spec.hidden, "heads": spec.heads, "kv_heads": spec.kv_heads,
        "head_dim": spec.head_dim, "intermediate": spec.intermediate, "vocab": spec.vocab, "tied": spec.tied,
        **({"mtp_layers": spec.mtp_layers} if spec.mtp_layers else {}),
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
