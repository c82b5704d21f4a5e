"""Both command lines: --version from package metadata, help for every argument, and no message naming a flag
its command does not have."""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import re
from pathlib import Path

import pytest

from ckptconv.cli.main import build_parser as ckptconv_parser
from ckptconv.cli.main import main as ckptconv_main
from nxdtrain.cli import build_parser as nxdtrain_parser
from nxdtrain.cli import main as nxdtrain_main

REPO = Path(__file__).resolve().parents[1]
PARSERS = {"ckptconv": ckptconv_parser, "nxdtrain": nxdtrain_parser}
FLAG = re.compile(r"--[a-z][a-z0-9_-]*[a-z0-9]")
# Calls whose string arguments are messages a user reads.
MESSAGE_CALLS = {"note", "warn", "print", "_check", "TrainError", "ConversionError", "VerificationError",
                 "ArgumentTypeError"}


def walk(parser: argparse.ArgumentParser, path: str = ""):
    """(where, action) for every action of ``parser`` and of its subcommands, recursively."""
    for action in parser._actions:
        yield path, action
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield f"{path} {choice.dest}", choice
            for name, sub in action.choices.items():
                yield from walk(sub, f"{path} {name}")


def cli_flags(name: str) -> set[str]:
    return {s for _, action in walk(PARSERS[name]()) for s in action.option_strings}


@pytest.mark.parametrize("name,main", [("ckptconv", ckptconv_main), ("nxdtrain", nxdtrain_main)])
def test_version_from_package_metadata(name, main, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"{name} {importlib.metadata.version('ckptconv')}\n"


@pytest.mark.parametrize("name", PARSERS)
def test_every_argument_has_help(name):
    missing = [f"{name}{where}: {action.option_strings or action.dest}" for where, action in walk(PARSERS[name]())
               if not (action.help and action.help.strip()) or action.help == argparse.SUPPRESS]
    assert missing == []
    assert len(list(walk(PARSERS[name]()))) > 20  # the walk did reach the subcommands


def message_strings(module: Path) -> list[str]:
    """The text of every string in a raise statement or a message call, f-string pieces joined."""
    tree = ast.parse(module.read_text())
    roots = [n for n in ast.walk(tree) if isinstance(n, ast.Raise)]
    roots += [n for n in ast.walk(tree) if isinstance(n, ast.Call)
              and getattr(n.func, "id", getattr(n.func, "attr", None)) in MESSAGE_CALLS]
    found: dict[int, str] = {}  # by node: a string inside both a raise and a call counts once
    pieces: set[int] = set()    # the constant parts of f-strings, read as part of their f-string
    for root in roots:
        for node in ast.walk(root):
            if isinstance(node, ast.JoinedStr):
                found[id(node)] = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
                pieces.update(id(v) for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found[id(node)] = node.value
    return [text for key, text in found.items() if key not in pieces]


@pytest.mark.parametrize("name", PARSERS)
def test_messages_name_only_flags_the_command_has(name):
    """Every --flag in a message of ckptconv/ (nxdtrain/) is a flag of the ckptconv (nxdtrain) command line.

    Allowed on purpose: a message that quotes a ckptconv command for the user to run (e.g. nxdtrain's
    "reshard first: ckptconv reshard ... --tp 2") may use ckptconv's flags.
    """
    own, ckptconv = cli_flags(name), cli_flags("ckptconv")
    wrong, seen = [], 0
    for module in sorted((REPO / name).rglob("*.py")):
        for text in message_strings(module):
            allowed = own | ckptconv if "ckptconv " in text else own
            for flag in FLAG.findall(text):
                seen += 1
                if flag not in allowed:
                    wrong.append(f"{module.relative_to(REPO)}: {flag} in {text!r}")
    assert wrong == []
    assert seen > 20  # the scan found the messages


def test_the_scan_catches_a_foreign_flag(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('def f(x):\n    raise TrainError(f"{x}: pass --overwrite to replace it")\n')
    (text,) = message_strings(module)
    assert FLAG.findall(text) == ["--overwrite"] and "--overwrite" not in cli_flags("nxdtrain")


def test_what_the_tool_says_it_is_names_every_family():
    """``ckptconv --help`` and the package's description say what the tool converts now: every registered family
    (not "HF Llama"), and TorchTitan's DCP."""
    from ckptconv.core.families import FAMILIES

    project = (REPO / "pyproject.toml").read_text()
    described = re.search(r'^description = "(.*)"$', project, re.M).group(1)  # type: ignore[union-attr]
    for text in (ckptconv_parser().description or "", described):
        assert [f.name for f in FAMILIES.values() if f.name not in text] == [], text
        assert "DCP" in text and "HF Llama" not in text


# What nxdtrain trains: the families with NxD shards (DeepSeek-V3 and GPT-OSS go into TorchTitan and back only)
TRAINED = ("Llama", "Mistral", "Qwen2", "Qwen3", "Mixtral", "Qwen3-MoE")


def test_what_the_trainer_says_it_is_names_every_family_it_trains():
    """``nxdtrain --help`` and docs/trainer.md's opening say what it trains now, not "a Llama model"."""
    trainer = (REPO / "docs" / "trainer.md").read_text()
    opening = trainer.split("\n## ", 1)[0]
    for text in (nxdtrain_parser().description or "", opening):
        assert [name for name in TRAINED if name not in text] == [], text
        assert "a Llama model" not in text and "HF Llama" not in text and ") Llama on" not in text


def test_to_nxd_help_says_what_a_degree_not_given_is():
    """to-nxd reads an HF model, which has no layout: its --tp/--pp help does not promise "the source's"."""
    sub = next(a for a in ckptconv_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    helps = {s: a.help for a in sub["to-nxd"]._actions for s in a.option_strings}
    assert helps["--tp"] == helps["--pp"].replace("pipeline", "tensor") and "source" not in helps["--tp"] + helps["--pp"]
    assert helps["--tp"] == "tensor-parallel degree (not given: 1; to-nxd needs --tp or --pp)"
    reshard = {s: a.help for a in sub["reshard"]._actions for s in a.option_strings}
    assert reshard["--tp"] == "tensor-parallel degree (not given: the source's, else 1)"
