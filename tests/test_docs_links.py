"""Every relative link in README.md and docs/*.md leads somewhere: the file exists and the #anchor is a heading of it.

Anchors follow GitHub's rule: the heading's text (markup removed) lowercased, every character that is not a letter,
digit, space, `-` or `_` dropped, spaces turned into `-`; a repeated heading gets `-1`, `-2`, ... in order.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked (links there are code)."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of one heading's text (before duplicates are numbered)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)        # a link shows its text
    text = CODE_SPAN.sub(lambda m: m.group(2), text)                  # code shows its content
    text = re.sub(r"<[^>]+>", "", text)                               # inline HTML is dropped
    text = text.replace("**", "")                                      # bold markers are dropped
    text = text.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor GitHub makes for the headings of a markdown text, duplicates numbered."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        if base in seen:
            seen[base] += 1
            name = f"{base}-{seen[base]}"
        else:
            seen[base] = 0
            name = base
        found.add(name)
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link outside code."""
    out = []
    for number, line in _prose_lines(text):
        line = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)
        out += [(number, m.group(1)) for m in LINK.finditer(line)]
    return out


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """One message per relative link of ``path`` (a markdown file) that does not resolve; [] when all do.

    External links (http, https, mailto) are not followed."""
    text = path.read_text() if text is None else text
    problems = []
    for number, target in links(text):
        if re.match(r"^(https?:|mailto:)", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path.resolve()
        where = f"{path.name}:{number}: [{target}]"
        if not dest.exists():
            problems.append(f"{where}: no such file {file_part}")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix != ".md":
                problems.append(f"{where}: an anchor into {file_part}, which is not a markdown file")
            elif anchor not in anchors(dest.read_text()):
                problems.append(f"{where}: {dest.name} has no heading with anchor #{anchor}")
    return problems


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_relative_link_resolves():
    problems = [p for doc in documents() for p in broken_links(doc)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_manual_is_linked_from_the_readme():
    """Every page of docs/ is reachable from README.md (directly, or through docs/ pages)."""
    reached, todo = set(), [REPO / "README.md"]
    while todo:
        doc = todo.pop()
        for _, target in links(doc.read_text()):
            file_part = target.partition("#")[0]
            if not file_part or re.match(r"^(https?:|mailto:)", file_part):
                continue
            dest = (doc.parent / file_part).resolve()
            if dest.suffix == ".md" and dest.is_file() and dest not in reached:
                reached.add(dest)
                todo.append(dest)
    orphans = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in reached]
    assert not orphans, f"docs pages no link reaches from README.md: {orphans}"


def test_slugs_follow_githubs_rule():
    assert slug("`nxdtrain run --resume` of NxD's own tags") == "nxdtrain-run---resume-of-nxds-own-tags"
    assert slug("Cluster launch: Slurm templates") == "cluster-launch-slurm-templates"
    assert slug("Moving a run to TorchTitan and back (AdamW state, schedule, step)") == \
        "moving-a-run-to-torchtitan-and-back-adamw-state-schedule-step"
    assert slug("3. Keys, slices and order") == "3-keys-slices-and-order"
    assert slug("snake_case and [a link](x.md)") == "snake_case-and-a-link"
    assert anchors("# Usage\n## Usage\n### Usage\n```\n# not a heading\n```\n") == {"usage", "usage-1", "usage-2"}


def test_a_planted_broken_link_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    (tmp_path / "dir").mkdir()
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md) [fine too](other.md#a-section) [here](#page) [a dir](dir/) [web](https://x.invalid/y)\n"
        "[gone](missing.md) and [bad anchor](other.md#no-such-section)\n"
        "`[in code](nowhere.md)`\n\n```\n[in a block](nowhere.md)\n```\n"
        "[self anchor](#nope)\n"
    )
    assert broken_links(page) == [
        "page.md:4: [missing.md]: no such file missing.md",
        "page.md:4: [other.md#no-such-section]: other.md has no heading with anchor #no-such-section",
        "page.md:10: [#nope]: page.md has no heading with anchor #nope",
    ]
