"""Run NxD's resume of a tag in fresh processes (one per way) and compare outcomes with what a case recorded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures" / "nxdt-official"


def _environment(case_flags: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("XLA_DOWNCAST_BF16", None)
    if case_flags.get("XLA_DOWNCAST_BF16") is not None:  # the fp64-optimizer case ran with it set
        env["XLA_DOWNCAST_BF16"] = str(case_flags["XLA_DOWNCAST_BF16"])
    return env


def check(case_dir: Path, tag_dir: Path, nxd_src: Path, *, timeout_s: int = 600) -> dict[str, Any]:
    """Both ways, each in a fresh process; ``{"case", "tag", "objects": {...}, "dicts": {...}}``."""
    from .case import Case
    from .resume import WAYS

    case = Case.open(case_dir)
    if not tag_dir.is_dir():
        raise SystemExit(f"--tag {tag_dir}: not a directory (expected a tag directory inside a checkpoint root)")
    out: dict[str, Any] = {"case": case.name, "tag": str(tag_dir)}
    for way in WAYS:
        with tempfile.TemporaryDirectory(prefix="nxd_check_") as tmp:
            result_file = Path(tmp) / "result.json"
            command = [
                sys.executable,
                "-m",
                "tools.nxd_check",
                "resume",
                "--nxd-src",
                str(nxd_src),
                "--case",
                str(case_dir),
                "--tag",
                str(tag_dir),
                "--way",
                way,
                "--out",
                str(result_file),
            ]
            run = subprocess.run(
                command, cwd=REPO, env=_environment(case.flags), capture_output=True, text=True, timeout=timeout_s
            )
            if run.returncode != 0 or not result_file.is_file():
                tail = (run.stdout + run.stderr)[-3000:]
                raise SystemExit(f"nxd_check resume {case.name} {way}: exit {run.returncode}\n{tail}")
            out[way] = json.loads(result_file.read_text())
    return out


def _same_frame(ours: str, recorded: str) -> bool:
    """NxD frames compare exactly; others (torch) by their path below site-packages (the venv differs)."""

    def tail(frame: str) -> str:
        return frame.split("site-packages/")[-1]

    return tail(ours) == tail(recorded)


def compare_to_recorded(result: dict[str, Any], recorded: dict[str, Any], recorded_root: str, root: str) -> list[str]:
    """Differences between one way's result and ``case.json`` -> ``resume_by_nxd`` -> that way (empty: same)."""
    problems: list[str] = []
    if "error" in recorded:
        want = recorded["error"].replace(recorded_root, root)
        if result.get("error") != want:
            problems.append(f"error: recorded {want!r}, got {result.get('error')!r}")
        # the recorded traceback keeps the innermost frames only (at most 4): compare ours' tail with it
        got_where = result.get("where", [])[-len(recorded["where"]) :]
        if len(got_where) != len(recorded["where"]) or not all(map(_same_frame, got_where, recorded["where"])):
            problems.append(f"where: recorded {recorded['where']}, got {got_where}")
        return problems
    if result.get("load") != "ok":
        return [f"load: recorded ok, got {result.get('error')} at {result.get('where')}"]
    for key, want in recorded.items():
        if result.get(key) != want:
            problems.append(f"{key}: recorded {want!r}, got {result.get(key)!r}")
    return problems


def _copy_tag(case_dir: Path, into: Path) -> Path:
    """The case's checkpoint root copied under ``into``, with the empty directories git dropped made again."""
    manifest = json.loads((case_dir / "case.json").read_text())
    root = into / manifest["checkpoint_root"]
    shutil.copytree(case_dir / manifest["checkpoint_root"], root)
    for empty in manifest.get("empty_dirs", []):  # paths relative to the case folder, like the checkpoint root
        (into / empty).mkdir(parents=True, exist_ok=True)
    return root / manifest["tag"]


def case_names() -> list[str]:
    return sorted(p.name for p in FIXTURES.iterdir() if (p / "case.json").is_file())


def fixtures(nxd_src: Path, names: list[str], out: Path | None) -> int:
    """Each fixture case's own tag through NxD's loader; compared with what ``case.json`` recorded."""
    cases = names or case_names()
    report: dict[str, Any] = {}
    failed = 0
    for name in cases:
        case_dir = FIXTURES / name
        manifest = json.loads((case_dir / "case.json").read_text())
        with tempfile.TemporaryDirectory(prefix=f"nxd_check_{name}_") as tmp:
            tag = _copy_tag(case_dir, Path(tmp))
            result = check(case_dir, tag, nxd_src)
            recorded_root = f"/tmp/nxdt-official/{name}/{manifest['checkpoint_root']}"
            problems = {
                way: compare_to_recorded(result[way], manifest["resume_by_nxd"][way], recorded_root, str(tag.parent))
                for way in ("objects", "dicts")
            }
        report[name] = {"result": result, "problems": problems}
        for way, found in problems.items():
            failed += bool(found)
            print(f"{name:32s} {way:8s} {'as recorded' if not found else 'DIFFERS: ' + '; '.join(found)}")
    if out:
        out.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if failed else 0
