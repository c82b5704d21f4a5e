"""Write each fixture case's tag again with ckptconv's NxD-format writer, have NxD's loader resume it, record both.

The record, ``fixtures/nxdt-official/written_by_ckptconv.json``, holds per case the writer's command (paths as
``{case}``/``{out}`` placeholders), the written tag's content (``tests.torch_rows.tag_tree``: key tree, dtypes,
shapes, a sha256 of every tensor's values) and what NxD's ``load_checkpoint`` did with it both ways.
``tests/training/nxd_format/test_nxd_loader_record.py`` re-runs the commands with the current writer and compares the content, so the
proof stays tied to what the writer writes.
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from tests.torch_rows import tag_tree

from .case import Case
from .check import check


def writer_command(case: Case, *, name: str | None = None, trainer: str | None = None) -> list[str]:
    """ckptconv's arguments that rewrite ``case``'s tag in NxD's format at its own layout (tp 1, pp 1, dp 1),
    as ``name`` (default: the tag's own) with ``trainer``'s side files (default: the source's trainer)."""
    command = [
        "reshard",
        f"{{case}}/{case.manifest['checkpoint_root']}/{case.manifest['tag']}",
        f"{{out}}/{name or case.manifest['tag']}",
        "--tp",
        "1",
        "--pp",
        "1",
        "--optimizer-format",
        "nxd",
        "--zero1" if case.flags["zero1"] else "--no-zero1",
    ]
    command += ["--nxd-trainer", trainer] if trainer else []
    return command + ["--config", f"{{case}}/{case.manifest['hf_config_file']}"]


def filled(command: list[str], case_dir: Path, out: Path) -> list[str]:
    return [part.format(case=case_dir, out=out) for part in command]


# nxdtrain resumes these fixture tags (NxD's own), trains steps 3 and 4 on synthetic data and saves step 4 in NxD's
# format; NxD's loader then resumes that and does step 5 (tools/nxd_check/trained.py makes the references)
TRAINED = {
    "plain_fp32": ["--no-zero1", "--precision", "fp32"],
    "zero1_fp32": ["--zero1", "--precision", "fp32"],
    "zero1_bf16_masters": ["--zero1", "--precision", "bf16"],
}
NXDTRAIN_RUN = [
    "run",
    "--resume",
    "{src}",
    "--steps",
    "4",
    "--data",
    "synthetic",
    "--seq-len",
    "16",
    "--gbs",
    "4",
    "--mbs",
    "1",
    "--checkpoint-dir",
    "{out}",
    "--checkpoint-freq",
    "4",
    "--optimizer-format",
    "nxd",
    "--tp",
    "1",
    "--nproc",
    "1",
    "--schedule",
    "CosineAnnealing",
    "--lr",
    "0.01",
    "--min-lr",
    "0.001",
    "--warmup",
    "2",
    "--decay-steps",
    "10",
]


def trained(fixtures: Path, name: str, nxdtrain: list[str], out: Path, nxd_src: Path) -> dict[str, Any]:
    """nxdtrain trains from fixture case ``name`` and saves in NxD's format; NxD resumes that; the record."""
    from .stand_ins import install
    from .trained import make_case

    install(nxd_src)  # the references take the next step's learning rate from NxD's example scheduler
    case = Case.open(fixtures / name)
    src = out / "src" / case.manifest["tag"]  # the fixture's tag, plus the hf/config.json nxdtrain asks for
    shutil.copytree(fixtures / name / case.manifest["checkpoint_root"] / case.manifest["tag"], src)
    (src / "hf").mkdir()
    shutil.copy(fixtures / name / case.manifest["hf_config_file"], src / "hf" / "config.json")
    command = NXDTRAIN_RUN + TRAINED[name]
    run = subprocess.run(
        nxdtrain + [p.format(src=src, out=out / "ckpt") for p in command], capture_output=True, text=True, cwd=out
    )  # cwd: not this repository, whose own nxdtrain/ its worker processes would import instead
    if run.returncode != 0:
        raise SystemExit(f"nxdtrain from {name} failed (exit {run.returncode}): {(run.stdout + run.stderr)[-2000:]}")
    tag = out / "ckpt" / "step_4"
    reference = make_case(fixtures / name, tag, out / "case", f"nxdtrain_from_{name}")
    result = check(out / "case", tag, nxd_src)
    return {
        "command": ["nxdtrain", *command[:2], "{case}/ckpt/step_2 (with hf/config.json added)", *command[3:]],
        "tag": "step_4",
        "reference": {
            "next_step": reference["next_step"],
            "next_lr": reference["next_lr"],
            "params_after_next": "one eager CPU torch.optim.AdamW step from the tag's own state",
        },
        "nxd_resume": {way: {k: v for k, v in result[way].items() if k != "way"} for way in ("objects", "dicts")},
        "files": tag_tree(tag),
    }


def _git_head(repo: Path | None) -> dict[str, Any] | None:
    if repo is None:
        return None
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    dirty = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=True,
    )
    return {"commit": head.stdout.strip(), "uncommitted_changes": bool(dirty.stdout.strip())}


def _runtime() -> dict[str, str]:
    import torch
    import torch_xla
    import transformers

    return {
        "torch": torch.__version__,
        "torch_xla": torch_xla.__version__,
        "transformers": transformers.__version__,
        "device": "XLA:CPU (PJRT_DEVICE=CPU), one process, world size 1",
    }


def dumps(record: dict[str, Any]) -> str:
    """JSON, indented, with each key row of a file and each command on one line (readable in a diff, a third of the size)."""
    rows: list[str] = []

    def mark(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {
                k: [mark_row(r) for r in v] if k == "keys" else mark_row(v) if k == "command" else mark(v)
                for k, v in obj.items()
            }
        return [mark(v) for v in obj] if isinstance(obj, list) else obj

    def mark_row(row: list) -> str:
        rows.append(json.dumps(row))
        return f"@row{len(rows) - 1}@"

    text = json.dumps(mark(record), indent=1)
    return re.sub(r'"@row(\d+)@"', lambda m: rows[int(m.group(1))], text) + "\n"


def prove(
    fixtures: Path,
    names: list[str],
    ckptconv: list[str],
    out_root: Path,
    nxd_src: Path,
    manifest: Path,
    writer_repo: Path | None,
    nxdtrain: list[str] | None = None,
) -> int:
    """Write, load and record every case in ``names`` (and, given ``nxdtrain``, every ``TRAINED`` run); the manifest
    is written whole at the end (temp + rename)."""
    record: dict[str, Any] = {
        "about": "Tags written by ckptconv's NxD-format writer from each fixture case, then resumed by NxD 2.28's own "
        "load_checkpoint (tools/nxd_check; README: 'tags written by ckptconv, loaded by NxD').",
        "nxd": {
            "repository": "aws-neuron/neuronx-distributed",
            "tag": "v2.28.0",
            "commit": "22cadad34418fb8b5939bd8cdfc7a376eede9981",
        },
        "runtime": _runtime(),
        "writer": {"command": "ckptconv", **(_git_head(writer_repo) or {})},
        "recorded": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "cases": {},
    }
    for name in names:
        case_dir = fixtures / name
        case = Case.open(case_dir)
        out = out_root / name
        out_root.mkdir(parents=True, exist_ok=True)
        if out.exists():  # never overwrite what may not be ours
            raise SystemExit(f"--out-root {out_root}: {out} exists; choose a new --out-root")
        command = writer_command(case)
        run = subprocess.run(ckptconv + filled(command, case_dir, out), capture_output=True, text=True, cwd=out_root)
        if run.returncode != 0:
            raise SystemExit(f"{name}: the writer failed (exit {run.returncode}): {(run.stdout + run.stderr)[-2000:]}")
        tag = out / case.manifest["tag"]
        result = check(case_dir, tag, nxd_src)
        record["cases"][name] = {
            "command": ["ckptconv", *command],
            "tag": case.manifest["tag"],
            "nxd_resume": {way: {k: v for k, v in result[way].items() if k != "way"} for way in ("objects", "dicts")},
            "files": tag_tree(tag),
        }
        for way in ("objects", "dicts"):
            r = result[way]
            print(
                f"{name:32s} {way:8s} load {r['load']:6s} step-3 max abs diff {r.get('after_next_max_abs_diff')}"
                f"{'  ' + r['error'] if r.get('error') else ''}"
            )
    if nxdtrain:
        record["trained_by_nxdtrain"] = {}
        for name in TRAINED:
            entry = trained(fixtures, name, nxdtrain, out_root / "trained" / name, nxd_src)
            record["trained_by_nxdtrain"][f"nxdtrain_from_{name}"] = entry
            for way, r in entry["nxd_resume"].items():
                print(
                    f"nxdtrain_from_{name:18s} {way:8s} load {r['load']:6s} step-5 max abs diff from eager AdamW "
                    f"{r.get('after_next_max_abs_diff')}{'  ' + r['error'] if r.get('error') else ''}"
                )
    temporary = manifest.with_name(manifest.name + ".tmp")
    temporary.write_text(dumps(record))
    temporary.rename(manifest)
    return 0
