"""Layout flags the user gave, and how they meet what a checkpoint recorded in ``ckptconv.json``.

What ``ckptconv.json`` records wins over every default. A flag given on the command line that
contradicts the record is refused, naming both values, unless ``--override-recorded-layout`` says
to read the shards another way (and then the notes say what was overridden). A flag left out is
``None`` here, never a default value, so "given" and "defaulted" cannot be confused.

Example:
    >>> hints = LayoutHints({"hw": "trn1", "tp": None}, style="compat")
    >>> hints.given()
    {'hw': 'trn1'}
    >>> hints.flag("hw")
    '--hw_backend'
"""

from __future__ import annotations

from typing import Any

from ckptconv.errors import ConversionError

OVERRIDE_FLAG = "--override-recorded-layout"

# hint key -> the flag that sets it, per command-line style (native ckptconv, or nxd-compat's official names)
_FLAGS = {
    "native": {"tp": "--tp", "pp": "--pp", "vpp": "--vpp", "kvm": "--kv-size-multiplier",
               "attention": "--qkv-linear/--coalesce-qkv", "fuse_qkv": "--fuse-qkv", "hw": "--hw-backend",
               "trn2_kv_layout": "--trn2-kv-layout"},
    "compat": {"tp": "--tp_size", "pp": "--pp_size", "vpp": "--virtual_pp_size", "kvm": "--kv_size_multiplier",
               "attention": "--qkv_linear/--coalesce_qkv", "fuse_qkv": "--fuse_qkv", "hw": "--hw_backend",
               "trn2_kv_layout": "--trn2_kv_layout"},
    # reshard: its layout flags describe the output; these describe an unrecorded source
    "reshard": {"hw": "--source-hw-backend", "trn2_kv_layout": "--source-trn2-kv-layout"},
}


class LayoutHints(dict[str, Any]):
    """Layout values given on the command line (``None``: not given), with how to name their flags
    and whether they may override a recorded layout. A plain dict is accepted wherever this is."""

    def __init__(self, values: dict[str, Any] | None = None, *, override: bool = False, style: str = "native") -> None:
        super().__init__(values or {})
        self.override = override
        self.style = style

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in self.items() if v is not None}

    def flag(self, key: str) -> str:
        return _FLAGS[self.style].get(key, key)


def as_hints(hints: dict[str, Any] | None) -> LayoutHints:
    return hints if isinstance(hints, LayoutHints) else LayoutHints(hints)


def _text(value: Any) -> str:
    return str(getattr(value, "value", value))


def apply_to_record(recorded: dict[str, Any], hints: LayoutHints, where: str) -> tuple[dict[str, Any], list[str]]:
    """The recorded layout with the given flags applied: equal ones change nothing, a contradicting
    one is refused unless ``hints.override``; returns the layout's JSON and notes."""
    differing = {k: v for k, v in hints.given().items() if _text(recorded.get(k)) != _text(v)}
    if not differing:
        return dict(recorded), []
    described = [f"{hints.flag(k)} {_text(v)} instead of the recorded {k} {_text(recorded.get(k))}"
                 for k, v in differing.items()]
    if not hints.override:
        key, value = next(iter(differing.items()))
        raise ConversionError(
            f"{hints.flag(key)} {_text(value)} contradicts {where}, which records {key} {_text(recorded.get(key))} "
            f"(what wrote these shards); drop {hints.flag(key)}, or pass {OVERRIDE_FLAG} to read them that way"
        )
    return {**recorded, **differing}, [f"{OVERRIDE_FLAG}: reading with " + "; ".join(described)]
