"""The parallel layout a user asks for, spelled once: :class:`LayoutOverrides`, and :func:`apply_layout`.

Each field of :class:`LayoutOverrides` is a layout value the user gave, ``None`` when not given, so
"given" and "defaulted" cannot be confused; its metadata (:class:`FieldFlags`) says how the flag is
spelled in each command-line style (native ``ckptconv``, nxd-compat's official names, and reshard's
flags that describe an unrecorded source), its help text and its type. The command line builds its
layout flags from these fields (``ckptconv.cli.layout_args``), and every command lays them over a
base layout with the one function :func:`apply_layout`:

- a *target* (to-nxd, reshard, from-dcp ``--to nxd``, nxd-compat's sharding): flags given replace the
  base's values (the source's, or tp 1 x pp 1 when there is no source layout), and the kv multiplier
  not given is what tp needs (:func:`ckptconv.core.layout.default_kvm`);
- a *source* described by its ``ckptconv.json`` (to-hf, verify, to-dcp, reshard's source, nxd-compat's
  merge): what it records wins; a flag that contradicts it is refused, naming both values, unless
  ``--override-recorded-layout`` says to read the shards that way (and the notes say so);
- a *training run* resuming shards (nxdtrain, ``training=True``): a target, with the training rules: the kv
  multiplier not given stays the shards' while tp and attention do (a resume does not re-replicate K/V), vpp is 1
  (nxdtrain's schedules have no virtual stages), the trn2 K/V order and, at the shards' tp, the vocabulary padding
  are the shards'.

An error names a value as the user's (``--tp 4``) only where the user gave it; otherwise it says
``the source's tp 2`` or ``the default --tp 1``.

Example:
    >>> flags = LayoutOverrides(pp=2)
    >>> resolved = apply_layout(ParallelLayout(tp=2), flags, base_is="source", kv_heads=2)
    >>> (resolved.layout.tp, resolved.layout.pp), resolved.name("tp"), resolved.name("pp")
    ((2, 2), "the source's tp 2", '--pp 2')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any

from ckptconv.core.layout import NATIVE_FLAGS, Attention, Hardware, ParallelLayout, Trn2KvLayout, default_kvm
from ckptconv.errors import ConversionError, choice

OVERRIDE_FLAG = "--override-recorded-layout"
STYLES = ("native", "compat", "reshard")


@dataclass(frozen=True)
class Switch:
    """One flag of a field set by a switch (the attention mode's ``--qkv-linear``): the value it selects."""

    native: str
    compat: str
    value: Any
    help: str


@dataclass(frozen=True)
class FieldFlags:
    """How one layout field is spelled on the command line, and what it takes.

    ``kind``: ``int`` (a degree >= 1), ``choice`` (one of ``choices``), ``bool`` (``--x``/``--no-x``), or
    ``switch`` (several flags, each selecting a value: ``switches``). ``source``: reshard's flag for the
    value of an unrecorded source (None: reshard takes none). ``api``: the keyword of the Python API.
    ``carried``: a target keeps the base's value when the flag is not given (else the field's default).
    """

    native: str
    compat: str
    help: str
    kind: str
    api: str
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    switches: tuple[Switch, ...] = ()
    source: str | None = None
    source_help: str = ""
    carried: bool = True
    what: str = ""  # how an error names the value when it is not the user's ("kv multiplier")

    def flag(self, style: str) -> str:
        if style == "reshard" and self.source is not None:
            return self.source
        if self.switches:
            return "/".join(s.compat if style == "compat" else s.native for s in self.switches)
        return self.compat if style == "compat" else self.native


FROM_SOURCE = "(not given: the source's, else 1)"  # a degree's default where the source has a layout to keep


def _meta(**kwargs: Any) -> dict[str, FieldFlags]:
    return {"flags": FieldFlags(**kwargs)}


@dataclass(frozen=True, init=False, eq=True)
class LayoutOverrides(dict[str, Any]):
    """Layout values given on the command line or to the Python API (``None``: not given).

    Each field is a typed attribute; the object is also a read-only dict of the values given (what
    every function that took a dict of hints still takes).

    ``override``: a given value may contradict what a source's ``ckptconv.json`` records (``--override-
    recorded-layout``); ``style``: how errors name the flags (``native``, ``compat``, ``reshard``).
    Built from keywords or from a dict of field names (``LayoutOverrides({"hw": "trn2"})``); values are
    checked here (a degree >= 1, a known choice), so a bad one is refused before anything opens.
    """

    tp: int | None = field(default=None, metadata=_meta(
        native=NATIVE_FLAGS["tp"], compat="--tp_size", kind="int", api="tp", what="tp", help=f"tensor-parallel degree {FROM_SOURCE}"))
    pp: int | None = field(default=None, metadata=_meta(
        native=NATIVE_FLAGS["pp"], compat="--pp_size", kind="int", api="pp", what="pp", help=f"pipeline-parallel degree {FROM_SOURCE}"))
    ep: int | None = field(default=None, metadata=_meta(
        native=NATIVE_FLAGS["ep"], compat="--ep_size", kind="int", api="ep", what="ep",
        help="expert-parallel degree of a mixture-of-experts model: each ep rank holds E / ep contiguous experts "
             f"{FROM_SOURCE}"))
    vpp: int | None = field(default=None, metadata=_meta(
        native=NATIVE_FLAGS["vpp"], compat="--virtual_pp_size", kind="int", api="vpp", what="vpp",
        help=f"virtual pipeline stages per pp rank {FROM_SOURCE}"))
    kvm: int | None = field(default=None, metadata=_meta(
        native=NATIVE_FLAGS["kvm"], compat="--kv_size_multiplier", kind="int", api="kv_size_multiplier",
        aliases=("--kv-replicator",), what="kv multiplier",
        help="K/V head replication (kv_replicator in NxDT YAML; default: what tp needs, tp / kv heads when tp "
             "exceeds them with --qkv-linear, else 1)"))
    attention: Attention | None = field(default=None, metadata=_meta(
        native="--qkv-linear", compat="--qkv_linear", kind="switch", api="attention", what="attention",
        help="how q/k/v are stored", switches=(
            Switch("--qkv-linear", "--qkv_linear", Attention.QKV_LINEAR,
                   "GQAQKVColumnParallelLinear layout: weight_q/weight_k/weight_v"),
            Switch("--coalesce-qkv", "--coalesce_qkv", Attention.COALESCED,
                   "coalesced qkv_proj.weight (multi-head attention only)"))))
    fuse_qkv: bool | None = field(default=None, metadata=_meta(
        native=NATIVE_FLAGS["fuse_qkv"], compat="--fuse_qkv", kind="bool", api="fuse_qkv", what="fuse_qkv",
        help="one fused weight_qkv per layer (needs --qkv-linear; NxDT's default)"))
    hw: Hardware | None = field(default=None, metadata=_meta(
        native=NATIVE_FLAGS["hw"], compat="--hw_backend", kind="choice", api="hw_backend", what="hw backend",
        choices=tuple(h.value for h in Hardware), help="head order (default trn1)",
        source="--source-hw-backend",
        source_help="the hardware SRC was written for, where it has no ckptconv.json and its K/V replicas "
                    "cannot tell (tiled: trn1, or trn2 by the official converter)"))
    trn2_kv_layout: Trn2KvLayout | None = field(default=None, metadata=_meta(
        native=NATIVE_FLAGS["trn2_kv_layout"], compat="--trn2_kv_layout", kind="choice", api="trn2_kv_layout",
        what="trn2 K/V layout", choices=tuple(k.value for k in Trn2KvLayout), carried=False,
        help="trn2 K/V replica order: runtime (correct, default) or official (the official converter's)",
        source="--source-trn2-kv-layout", source_help="with --source-hw-backend trn2: SRC's K/V replica order"))
    override: bool = False
    style: str = "native"

    def __init__(self, values: Mapping[str, Any] | None = None, /, *, override: bool = False, style: str = "native",
                 **given: Any) -> None:
        merged = {**(values or {}), **given}
        unknown = sorted(set(merged) - set(LAYOUT_FIELDS))
        if unknown:
            raise ConversionError(f"unknown layout field {unknown[0]!r}; the fields are {', '.join(LAYOUT_FIELDS)}")
        if style not in STYLES:
            raise ConversionError(f"style must be one of {', '.join(STYLES)}, got {style!r}")
        object.__setattr__(self, "override", bool(override))
        object.__setattr__(self, "style", style)
        for name in LAYOUT_FIELDS:
            value = merged.get(name)
            object.__setattr__(self, name, None if value is None else self._checked(name, value))
        dict.__init__(self, {name: getattr(self, name) for name in LAYOUT_FIELDS if getattr(self, name) is not None})

    def _checked(self, name: str, value: Any) -> Any:
        spec = LAYOUT_FIELDS[name]
        flag = spec.flag(self.style)
        if spec.kind == "int":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConversionError(f"{flag} must be an integer >= 1, got {value!r}")
            return value
        if spec.kind == "bool":
            if not isinstance(value, bool):
                raise ConversionError(f"{flag} must be True or False, got {value!r}")
            return value
        kinds: dict[str, type[Enum]] = {"attention": Attention, "hw": Hardware, "trn2_kv_layout": Trn2KvLayout}
        return choice(kinds[name], value, flag)

    @classmethod
    def from_api(cls, **kwargs: Any) -> LayoutOverrides:
        """From the Python API's keywords (``tp``, ``kv_size_multiplier``, ``hw_backend``, ...; None: not given)."""
        by_api = {spec.api: name for name, spec in LAYOUT_FIELDS.items()}
        return cls({by_api[k]: v for k, v in kwargs.items()})

    def given(self) -> dict[str, Any]:
        return dict(self)

    def flag(self, key: str) -> str:
        return LAYOUT_FIELDS[key].flag(self.style) if key in LAYOUT_FIELDS else key

    def typed(self, key: str) -> str:
        """How the user typed the value of ``key``: ``--tp 4``, ``--qkv-linear``, ``--no-fuse-qkv``."""
        return typed_flag(key, getattr(self, key), self.style)

    def refuse_given(self, why: str, extra: tuple[str, ...] = ()) -> None:
        """Refuse a command that takes no layout: ``--tp is a layout flag; <why>`` naming the first flag given
        (then ``extra``, other flags given that it takes no more than these)."""
        given = [self.typed(k).split()[0] for k in self.given()] + list(extra)
        if given:
            raise ConversionError(f"{given[0]} is a layout flag; {why}")

    def _read_only(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("LayoutOverrides is read-only; build another (dataclasses.replace is not for it: pass a dict)")

    __setitem__ = __delitem__ = update = clear = pop = popitem = setdefault = _read_only  # type: ignore[assignment]
    __hash__ = None  # type: ignore[assignment]


LayoutHints = LayoutOverrides  # the earlier name, kept: LayoutHints({"hw": "trn2"}, override=True) still works
LAYOUT_FIELDS: dict[str, FieldFlags] = {f.name: f.metadata["flags"] for f in fields(LayoutOverrides)
                                        if "flags" in f.metadata}


def as_hints(hints: Mapping[str, Any] | LayoutOverrides | None) -> LayoutOverrides:
    """Overrides from what the API accepts: a :class:`LayoutOverrides`, a dict of field names, or None."""
    return hints if isinstance(hints, LayoutOverrides) else LayoutOverrides(hints)


def _text(value: Any) -> str:
    return str(getattr(value, "value", value))


def typed_flag(key: str, value: Any, style: str = "native") -> str:
    """The flag and value as a user types them: ``--tp 4``, ``--qkv-linear``, ``--no-fuse-qkv``."""
    spec = LAYOUT_FIELDS[key]
    compat = style == "compat"
    if spec.kind == "switch":
        for switch in spec.switches:
            if switch.value == value:
                return switch.compat if compat else switch.native
        first = spec.switches[0]
        return f"{first.compat} False" if compat else "--no-" + first.native.removeprefix("--")
    flag = spec.flag(style)
    if spec.kind == "bool":
        return (f"{flag} {value}" if compat else flag) if value else (f"{flag} False" if compat
                                                                        else "--no-" + flag.removeprefix("--"))
    return f"{flag} {_text(value)}"


@dataclass(frozen=True)
class ResolvedLayout:
    """A layout with where each value came from: ``given`` (the user typed it), ``source`` (the base
    checkpoint's), ``default`` (the base's default), ``needed`` (the kv multiplier tp needs)."""

    layout: ParallelLayout
    origins: dict[str, str]
    style: str = "native"
    notes: tuple[str, ...] = ()

    def name(self, key: str) -> str:
        """The value of ``key`` in an error: as the user typed it only where they did."""
        value = getattr(self.layout, key)
        origin = self.origins.get(key, "default")
        if origin == "given":
            return typed_flag(key, value, self.style)
        if origin == "source":
            return f"the source's {LAYOUT_FIELDS[key].what} {_text(value)}"
        if origin == "needed":
            return f"the kv multiplier {value} that tp {self.layout.tp} needs"
        spec = LAYOUT_FIELDS[key]
        return f"the default {spec.what if spec.switches else spec.flag(self.style)} {_text(value)}"

    def check_model(self, spec: Any) -> None:
        """:meth:`ParallelLayout.check_model`, its errors naming each value by where it came from."""
        self.layout.check_model(spec, name=self.name)

    def given(self) -> list[str]:
        return [k for k, origin in self.origins.items() if origin == "given"]


def apply_layout(base: ParallelLayout, flags: LayoutOverrides, *, base_is: str = "source",
                 kv_heads: int | None = None, recorded_at: str | None = None,
                 training: bool = False) -> ResolvedLayout:
    """``flags`` laid over ``base``: the one way every command does it.

    ``base_is``: ``source`` (a checkpoint's layout) or ``default`` (no layout to start from: tp 1 x pp 1).
    Without ``recorded_at`` the result is a *target*: given values replace the base's, the kv multiplier
    not given is what tp needs over ``kv_heads`` KV heads, and the vocabulary padding is left to be
    recomputed. With ``recorded_at`` (the ``ckptconv.json`` that records ``base``) the flags *describe*
    that source: a value contradicting the record is refused unless ``flags.override``. ``training``: the
    target is a training run's (the rules of the module docstring).
    """
    if recorded_at is not None:
        return _describe_recorded(base, flags, recorded_at)
    origins = {name: base_is for name in LAYOUT_FIELDS}
    values: dict[str, Any] = {name: getattr(base, name) for name in LAYOUT_FIELDS}
    for name, spec in LAYOUT_FIELDS.items():
        if not spec.carried and not training:
            values[name], origins[name] = getattr(ParallelLayout(), name), "default"
    if training:
        values["vpp"], origins["vpp"] = 1, "default"
    for name, value in flags.given().items():
        values[name], origins[name] = value, "given"
    if flags.attention not in (None, Attention.QKV_LINEAR) and flags.fuse_qkv is None:
        values["fuse_qkv"], origins["fuse_qkv"] = False, "default"  # fused weight_qkv exists on qkv_linear only
    same_split = values["tp"] == base.tp and values["attention"] is base.attention
    if flags.kvm is None and kv_heads is not None and not (training and same_split):
        values["kvm"], origins["kvm"] = default_kvm(values["tp"], kv_heads, values["attention"]), "needed"
    resolved = ResolvedLayout(ParallelLayout(), origins, flags.style)
    _check_pairs(values, resolved)
    # Else the padding is recomputed for the target's tp (a training run at the shards' tp keeps their rows).
    padded = base.padded_vocab if training and values["tp"] == base.tp else None
    return replace(resolved, layout=ParallelLayout(**values, padded_vocab=padded))


def _check_pairs(values: dict[str, Any], resolved: ResolvedLayout) -> None:
    """The checks :class:`ParallelLayout` makes of two fields together, naming each value by its origin."""
    probe = replace(resolved, layout=_unchecked(values))
    if values["fuse_qkv"] and values["attention"] is not Attention.QKV_LINEAR:
        raise ConversionError(f"{probe.name('fuse_qkv')} needs --qkv-linear (fused weight_qkv exists only on the "
                              f"qkv_linear path), but attention is {probe.name('attention')}")
    if values["kvm"] > 1 and values["attention"] is not Attention.QKV_LINEAR:
        raise ConversionError(f"{probe.name('kvm')} needs --qkv-linear (K/V replication exists only on the "
                              f"qkv_linear path), but attention is {probe.name('attention')}")


def _unchecked(values: dict[str, Any]) -> ParallelLayout:
    """A layout holding ``values`` before its pairwise checks (only to name them in an error)."""
    layout = ParallelLayout()
    for name, value in values.items():
        object.__setattr__(layout, name, value)
    return layout


def _describe_recorded(recorded: ParallelLayout, flags: LayoutOverrides, where: str) -> ResolvedLayout:
    """The recorded layout with ``flags`` applied: equal ones change nothing, a contradicting one is
    refused unless ``flags.override``."""
    origins = {name: "source" for name in LAYOUT_FIELDS}
    differing = {k: v for k, v in flags.given().items() if _text(getattr(recorded, k)) != _text(v)}
    if not differing:
        return ResolvedLayout(recorded, origins, flags.style)
    described = [f"{flags.flag(k)} {_text(v)} instead of the recorded {k} {_text(getattr(recorded, k))}"
                 for k, v in differing.items()]
    if not flags.override:
        key, value = next(iter(differing.items()))
        raise ConversionError(
            f"{flags.flag(key)} {_text(value)} contradicts {where}, which records {key} "
            f"{_text(getattr(recorded, key))} (what wrote these shards); drop {flags.flag(key)}, or pass "
            f"{OVERRIDE_FLAG} to read them that way"
        )
    origins.update({k: "given" for k in differing})
    return ResolvedLayout(replace(recorded, **differing), origins, flags.style,
                          (f"{OVERRIDE_FLAG}: reading with " + "; ".join(described),))


def apply_to_record(recorded: dict[str, Any], hints: LayoutOverrides, where: str) -> tuple[dict[str, Any], list[str]]:
    """:func:`apply_layout` over a recorded layout's JSON (what :mod:`ckptconv.sources.nxd` calls):
    the layout's JSON and notes."""
    resolved = apply_layout(ParallelLayout.from_json(recorded), as_hints(hints), recorded_at=where)
    return {**recorded, **resolved.layout.to_json()}, list(resolved.notes)


def with_api_kwargs(layout: LayoutOverrides | None, **kwargs: Any) -> LayoutOverrides:
    """``layout`` (the typed overrides) together with the Python API's layout keywords (``tp=``, ...; None:
    not given); a field given both ways is refused."""
    base = layout or LayoutOverrides()
    extra = LayoutOverrides.from_api(**kwargs)
    twice = sorted(set(base.given()) & set(extra.given()))
    if twice:
        raise ConversionError(f"{LAYOUT_FIELDS[twice[0]].api} is given twice: as a keyword and in layout=")
    return LayoutOverrides({**base.given(), **extra.given()}, override=base.override, style=base.style)
