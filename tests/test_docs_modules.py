"""Every module of both packages is named in docs/architecture.md's floor plan (checked like the links): a module
``pkg/room/.../name.py`` by ``name.py`` in its room's entry of the plan, a top-level one in its package's own lines."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("ckptconv", "nxdtrain")
ROOM = re.compile(r"^  (\S+/)")  # a room's first line in the plan: two spaces, then its folder


def plan_entries(text: str) -> dict[tuple[str, str], str]:
    """(package, room folder or "" for the package's own modules) -> the text of its entry in the plan: the fenced
    block under "## Folders by role", a package at column 0, a room at column 2, its continuation lines deeper."""
    block = text.split("## Folders by role", 1)[1].split("```", 2)[1]
    out: dict[tuple[str, str], str] = {}
    package, room = "", ""
    for line in block.splitlines():
        if re.match(r"^\S+/", line):
            package, room = line.split("/")[0], ""
        elif m := ROOM.match(line):
            room = m.group(1).rstrip("/")
        elif re.match(r"^  \S", line):
            room = ""
        out[(package, room)] = out.get((package, room), "") + line + "\n"
    return out


def unnamed_modules(repo: Path, text: str) -> list[str]:
    """The modules of ``PACKAGES`` under ``repo`` whose file name the plan's entry for their room does not name."""
    entries = plan_entries(text)
    missing = []
    for package in PACKAGES:
        for path in sorted((repo / package).rglob("*.py")):
            rel = path.relative_to(repo / package)
            if rel.name in ("__init__.py", "__main__.py"):  # a package itself, and `python -m` of it
                continue
            room = rel.parts[0] if len(rel.parts) > 1 else ""
            if not re.search(r"(?<![\w.])" + re.escape(rel.name) + r"\b", entries.get((package, room), "")):
                missing.append(f"{package}/{rel.as_posix()}")
    return missing


def test_every_module_is_named_in_the_floor_plan():
    assert unnamed_modules(REPO, (REPO / "docs" / "architecture.md").read_text()) == []


def test_an_unnamed_module_is_found(tmp_path):
    for rel in ("ckptconv/core/plan.py", "ckptconv/core/heads.py", "ckptconv/errors.py", "nxdtrain/train.py",
                "nxdtrain/model/stage.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    text = ("## Folders by role\n\n```\nckptconv/\n  core/   plan.py (plans)\n           and more\n  errors.py  errors\n"
            "nxdtrain/\n  model/  heads.py\n  ...     train.py\n```\n")
    assert unnamed_modules(tmp_path, text) == ["ckptconv/core/heads.py", "nxdtrain/model/stage.py"]
