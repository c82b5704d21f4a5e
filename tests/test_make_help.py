"""``make help`` lists every target of the Makefile, each with its one-line description."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_help_lists_every_phony_target_with_a_description():
    phony = re.search(r"^\.PHONY:(.*)$", (REPO / "Makefile").read_text(), re.M).group(1).split()
    out = subprocess.run(["make", "-s", "--no-print-directory", "help"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    listed = dict(re.findall(r"^  make (\S+) +(.+)$", out, re.M))
    assert sorted(listed) == sorted(phony)
    assert all(len(text) > 10 for text in listed.values()), listed


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_no_description_is_cut_mid_sentence():
    """``make help`` shows the first comment line of a target: that line must be whole (its brackets closed, not
    ending on a word that leads on), else the list reads as cut off."""
    out = subprocess.run(["make", "-s", "--no-print-directory", "help"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    listed = dict(re.findall(r"^  make (\S+) +(.+)$", out, re.M))
    cut = {target: text for target, text in listed.items()
           if text.count("(") != text.count(")") or re.search(r"(;|,|\b(of|and|the|a|to|with))$", text)}
    assert cut == {}
