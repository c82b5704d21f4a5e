"""docs/cli.md is what tools/cli_reference.py generates from the two CLIs' parsers today."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("cli_reference", REPO / "tools" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("cli_reference", module)
    spec.loader.exec_module(module)
    return module


def test_committed_page_is_current():
    tool = _tool()
    assert (REPO / "docs" / "cli.md").read_text() == tool.render(), \
        "docs/cli.md is stale: run python tools/cli_reference.py"


def test_page_holds_every_subcommand_and_flag_with_help_and_default():
    text = _tool().render()
    for heading in ("## `ckptconv`", "### `ckptconv to-nxd`", "### `ckptconv reshard`", "### `ckptconv from-dcp`",
                    "### `ckptconv nxd-compat`", "## `nxdtrain`", "### `nxdtrain run`", "#### `nxdtrain data pack`",
                    "### `nxdtrain steps`", "### `nxdtrain plot`"):
        assert f"\n{heading}\n" in text, heading
    lines = text.splitlines()
    # a flag row: name and choices, its help as the parser has it, its default
    assert "| `--dtype {keep,bf16,fp16,fp32}` | cast floating weights to this dtype (default keep; inv_freq keeps " \
           "its precision) | `keep` |" in lines
    assert any(line.startswith("| `--max-memory MAX_MEMORY` | ") and line.endswith(" | `2147483648` |") for line in lines)
    # a default decided when the command runs is written as its rule, not this machine's value
    assert any(line.startswith("| `--workers WORKERS` |")
               and line.endswith("| the usable cores, at least 8, but one per 32 MiB written |") for line in lines)
    pack = text.split("#### `nxdtrain data pack`", 1)[1].split("\n### ", 1)[0]
    assert "--seq-len" in pack and "--tokenizer" in pack


def test_output_does_not_depend_on_the_terminal(monkeypatch):
    tool = _tool()
    monkeypatch.setenv("COLUMNS", "40")
    narrow = tool.render()
    monkeypatch.setenv("COLUMNS", "250")
    assert tool.render() == narrow


def test_check_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
    tool = _tool()
    page = tmp_path / "cli.md"
    monkeypatch.setattr(tool, "OUT", page)
    page.write_text(tool.render().replace("HF checkpoint -> NxD", "HF checkpoint => NxD"))
    assert tool.main(["--check"]) == 1
    assert "docs/cli.md is stale: run python tools/cli_reference.py" in capsys.readouterr().err
    monkeypatch.setattr(tool, "REPO", tmp_path)
    assert tool.main([]) == 0
    assert tool.main(["--check"]) == 0
