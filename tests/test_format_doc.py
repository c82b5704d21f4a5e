"""Every citation of docs/nxd-format.md in the code names a section (and subsection) the document has."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "nxd-format.md"
CITATION = re.compile(r"nxd-format\.md((?:,? ?(?:§\d+|and|\"[^\"]+\"))+)")


def _headings() -> tuple[set[str], set[str]]:
    text = DOC.read_text()
    numbers = set(re.findall(r"^## (\d+)\. ", text, re.M))
    names = set(re.findall(r"^##+ (?:\d+\. )?(.+)$", text, re.M))
    return numbers, names


def test_every_citation_names_an_existing_section():
    numbers, names = _headings()
    cited = 0
    for path in [*(REPO / "ckptconv").rglob("*.py"), *(REPO / "nxdtrain").rglob("*.py"), *(REPO / "tests").rglob("*.py")]:
        text = path.read_text()
        for match in CITATION.finditer(text):
            if path.name == Path(__file__).name:
                continue
            assert text[:match.start()].endswith("docs/"), f"{path}: cites nxd-format.md without its place, docs/"
            for number in re.findall(r"§(\d+)", match.group(1)):
                assert number in numbers, f"{path}: {match.group(0)!r} cites a section the document lacks"
            for name in re.findall(r"\"([^\"]+)\"", match.group(1)):
                assert name in names, f"{path}: {match.group(0)!r} cites a subsection the document lacks"
            cited += 1
    assert cited >= 10
