"""`make setup` builds the package without warnings: the metadata build runs with every warning an error."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD_METADATA = ("from setuptools import build_meta; import sys; "
                  "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")


def build_metadata(project: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """What pip runs first in `pip install -e .` (PEP 517 metadata hook), with warnings turned into errors."""
    return subprocess.run([sys.executable, "-W", "error", "-c", BUILD_METADATA, str(out)], cwd=project,
                          capture_output=True, text=True, timeout=300)


def test_package_metadata_builds_with_warnings_as_errors(tmp_path):
    done = build_metadata(REPO, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    metadata = (tmp_path / done.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()
    import ckptconv

    assert f"Version: {ckptconv.__version__}" in metadata.splitlines()  # the one version, read from the package
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_the_old_license_table_would_fail_this_check(tmp_path):
    """The check can fail: `license = { text = ... }` (what setup printed pages about) is an error under -W error."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "pkg").mkdir()
    (project / "pkg" / "__init__.py").write_text("")
    shutil.copy(REPO / "README.md", project / "README.md")
    text = (REPO / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"\nlicense-files = ["LICENSE"]\n' in text
    text = text.replace('license = "Apache-2.0"\nlicense-files = ["LICENSE"]\n', 'license = { text = "Apache-2.0" }\n')
    (project / "pyproject.toml").write_text(text.replace('include = ["ckptconv*", "nxdtrain*"]', 'include = ["pkg*"]'))
    done = build_metadata(project, tmp_path / "meta")
    assert done.returncode != 0 and "project.license" in done.stderr
