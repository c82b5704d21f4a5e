"""The layout flags of every command, generated from :class:`ckptconv.core.layout_flags.LayoutOverrides`.

One loop over its fields adds the flags (``--tp``, ``--qkv-linear``/``--no-qkv-linear``, ... or nxd-compat's
``--tp_size``, ``--qkv_linear BOOL``, ...), and one reads them back into the override object, so a
field added there is a flag of every command here, with the same help text.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence
from typing import Any, NoReturn

from ckptconv.core.layout import Attention
from ckptconv.core.layout_flags import FROM_SOURCE, LAYOUT_FIELDS, FieldFlags, LayoutOverrides, Switch
from ckptconv.errors import ConversionError

COMPAT_BOOL_HELP = " (True/False as written; the flag alone means True)"
# A source without a layout (an HF model: to-nxd) has none to keep; to-nxd refuses to guess the one to write.
WITHOUT_SOURCE_LAYOUT = {"tp": "(not given: 1; to-nxd needs --tp or --pp)", "pp": "(not given: 1; to-nxd needs --tp or --pp)"}


def parse_bool(text: str) -> bool:
    """``True/False/1/0/yes/no`` as written (the official parser would make ``False`` True)."""
    word = text.strip().lower()
    if word in {"true", "1", "yes", "y", "on"}:
        return True
    if word in {"false", "0", "no", "n", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"expected True/False/1/0/yes/no, got {text!r}")


def switch_dest(switch: Switch) -> str:
    return switch.native.removeprefix("--").replace("-", "_")


def add_layout_flags(p: argparse.ArgumentParser, *, style: str = "native", source_layout: bool = True) -> None:
    """Every layout field as a flag (default None: not given), spelled in ``style`` (native or compat).
    ``source_layout`` False: the command's source has no layout whose degrees a flag not given keeps (to-nxd)."""
    for name, spec in LAYOUT_FIELDS.items():
        if not source_layout:
            spec = dataclasses.replace(spec, help=spec.help.replace(
                FROM_SOURCE, WITHOUT_SOURCE_LAYOUT.get(name, "(not given: 1)")))
        if spec.kind == "switch":
            for switch in spec.switches:
                _add_bool(p, switch.compat if style == "compat" else switch.native, switch_dest(switch), switch.help,
                          style)
        elif spec.kind == "bool":
            _add_bool(p, spec.flag(style), name, spec.help, style)
        else:
            names = (spec.compat,) if style == "compat" else (spec.native, *spec.aliases)
            metavar = spec.compat.removeprefix("--").upper() if style == "compat" and spec.kind == "int" else None
            p.add_argument(*names, dest=name, default=None, metavar=metavar, help=spec.help, **_value_kwargs(spec))


def add_source_flags(p: argparse.ArgumentParser) -> None:
    """reshard's flags for the layout of an unrecorded source (``--source-hw-backend``, ...)."""
    for name, spec in LAYOUT_FIELDS.items():
        if spec.source is not None:
            p.add_argument(spec.source, dest=f"source_{name}", default=None, help=spec.source_help,
                           **_value_kwargs(spec))


def _value_kwargs(spec: FieldFlags) -> dict[str, Any]:
    return {"type": int} if spec.kind == "int" else {"choices": spec.choices}


def _add_bool(p: argparse.ArgumentParser, flag: str, dest: str, help_text: str, style: str) -> None:
    if style == "compat":
        p.add_argument(flag, dest=dest, type=parse_bool, nargs="?", const=True, default=None, metavar="BOOL",
                       help=help_text + COMPAT_BOOL_HELP)
    else:
        p.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)


def overrides_from(args: argparse.Namespace, *, style: str = "native", override: bool = False) -> LayoutOverrides:
    """The layout flags given on the command line. nxd-compat's ``--qkv_linear False`` (the official default,
    which scripts spell out) is read as not given: there, flags only add facts."""
    values: dict[str, Any] = {}
    for name, spec in LAYOUT_FIELDS.items():
        value = _attention(args, spec, style) if spec.kind == "switch" else getattr(args, name)
        if style == "compat" and spec.kind in ("bool", "switch") and value in (False, Attention.SEPARATE):
            value = None
        values[name] = value
    return LayoutOverrides(values, override=override, style=style)


def source_overrides(args: argparse.Namespace, *, override: bool = False) -> LayoutOverrides:
    """reshard's ``--source-*`` flags: what an unrecorded source was written for."""
    values = {name: getattr(args, f"source_{name}") for name, spec in LAYOUT_FIELDS.items() if spec.source}
    return LayoutOverrides(values, override=override, style="reshard")


def _attention(args: argparse.Namespace, spec: FieldFlags, style: str) -> Any:
    """The switches of one field (``--qkv-linear``, ``--coalesce-qkv``): the value of the one set to True;
    a switch set to False alone: the first value no switch selects (separate q/k/v); none: None."""
    chosen = [s for s in spec.switches if getattr(args, switch_dest(s)) is True]
    if len(chosen) > 1:
        names = [s.compat if style == "compat" else s.native for s in chosen]
        raise ConversionError(f"{' and '.join(names)} exclude each other; choose one")
    if chosen:
        return chosen[0].value
    if any(getattr(args, switch_dest(s)) is False for s in spec.switches):
        return Attention.SEPARATE
    return None


_WORD = re.compile(r"[^a-z0-9]+")


def _key(flag: str) -> str:
    return _WORD.sub("", flag.lower())


# Layout degrees spelled out as other tools spell them (Megatron's --tensor-model-parallel-size, torchrun-style
# --tensor-parallel 2), each with or without a -size / -degree ending.
_SPELLED_OUT = {"tp": ("tensorparallel", "tensormodelparallel"), "pp": ("pipelineparallel", "pipelinemodelparallel"),
                "ep": ("expertparallel", "expertmodelparallel"), "vpp": ("virtualpipeline", "virtualpipelineparallel")}
_ENDINGS = ("", "size", "degree")


def did_you_mean(token: str) -> str | None:
    """The native flag of a layout flag spelled another way (``--tp-size``, ``--tp_size``, ``--pp_size``,
    ``--kv_size_multiplier``, ``--hw_backend``, ``--tensor-parallel``...), with its value where it was glued on
    (``--tp2``: ``--tp 2``): None when ``token`` is no such spelling.

        >>> did_you_mean("--tp2"), did_you_mean("--tensor-model-parallel-size=8"), did_you_mean("--tp")
        ('--tp 2', '--tp', None)
    """
    flag = token.split("=", 1)[0]
    typed = _key(flag)
    glued = re.fullmatch(r"([a-z]+?)(\d+)", typed)  # --tp2: a value glued to the flag
    for candidate, value in [(typed, ""), *([(glued.group(1), f" {glued.group(2)}")] if glued else [])]:
        native = _native_of(candidate) if candidate else None
        if native is not None and (flag != native or value):
            return native + value
    return None


def _native_of(typed: str) -> str | None:
    """The native flag whose spellings (without punctuation or case) include ``typed``."""
    for name, spec in LAYOUT_FIELDS.items():
        natives = [s.native for s in spec.switches] or [spec.native]
        compats = [s.compat for s in spec.switches] or [spec.compat]
        for native, compat in zip(natives, compats, strict=True):
            spelled = {_key(compat), _key(native), _key(native) + "size"}
            spelled |= {word + ending for word in _SPELLED_OUT.get(name, ()) for ending in _ENDINGS}
            if typed in spelled:
                return native
    return None


class Parser(argparse.ArgumentParser):
    """argparse, with a hint for a layout flag spelled the official way (``--tp-size``: did you mean --tp?) where the
    command has that flag, and an unknown flag of a command (``data pack`` too) answered with that command's usage
    (not the top level's). Both CLIs parse with it."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            _command_of(self, parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            hints = [f"{token}: did you mean {native}?" for token in message.split(":", 1)[1].split()
                     if (native := did_you_mean(token)) is not None
                     and native.split()[0] in self._option_string_actions]
            if hints:
                message += "; " + "; ".join(hints)
        super().error(message)


def _command_of(parser: argparse.ArgumentParser, parsed: Any) -> argparse.ArgumentParser:
    """The innermost (sub)command parser ``parsed`` chose: ``nxdtrain data pack``'s, not ``data``'s."""
    while commands := [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]:
        chosen = commands[0].choices.get(str(getattr(parsed, commands[0].dest, "")))
        if chosen is None:
            break
        parser = chosen
    return parser
