"""README.md: its first screen fits, it stays short, and it says what an install gives and what the lanes cost."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
FIRST_SCREEN_LINES = 30  # up to the first "## " heading: what a newcomer sees before scrolling


def test_the_first_screen_fits():
    first = README.split("\n## ", 1)[0].splitlines()
    assert len(first) <= FIRST_SCREEN_LINES, len(first)
    assert max(map(len, first)) <= 120
    assert len(README.splitlines()) <= 120


def test_it_says_what_pip_install_gives_and_every_extra():
    section = (REPO / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = re.findall(r"^([a-z][a-z0-9-]*) = \[", section, re.M)
    assert extras and "dev" in extras
    assert [name for name in extras if f"`[{name}]`" not in README] == []
    assert "**`pip install .`**" in README and "--index-url https://download.pytorch.org/whl/cpu" in README
    pin = re.search(r"pip install --quiet torch==([\d.]+)", (REPO / "Makefile").read_text())
    assert pin and README.count(f"torch=={pin.group(1)}") == 2  # make setup's pin, and the CPU wheel's install


def test_it_names_the_main_lane_and_the_whole_suite_with_its_cost():
    make_test = next(line for line in README.splitlines() if line.startswith("make test"))
    assert "the main test lane" in make_test and ".ci/run" in make_test
    assert re.search(r"~\d+ min", make_test) and re.search(r"~\d+ GB", make_test)
    assert (REPO / ".ci" / "run").is_file()
