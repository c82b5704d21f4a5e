"""Both CLIs answer --version, --help and bad options without importing torch (or transformers, datasets, rich).

Start-up time itself is measured by ``benchmarks/startup.py``, not here: this checks the behaviour that makes
it fast, in a fresh interpreter per command (``sys.modules`` after the CLI has answered).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "datasets", "rich", "huggingface_hub", "numpy", "matplotlib")

PROBE = """
import json, sys
from {module} import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:
    status = exc.code
print(json.dumps({{"status": status or 0, "loaded": [m for m in {heavy!r} if m in sys.modules]}}), file=sys.__stdout__)
"""


def probe(module: str, argv: list[str], cwd: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(module=module, heavy=HEAVY), *argv],
                          capture_output=True, text=True, cwd=cwd, timeout=120)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv,status", [
    (["--version"], 0),
    (["--help"], 0),
    (["to-nxd", "--help"], 0),
    (["nxd-compat", "--help"], 0),
    (["to-nxd"], 2),                                         # missing SRC OUT
    (["to-nxd", "src", "out", "--tp", "two"], 2),            # not an integer
    (["to-nxd", "src", "out", "--tp", "1", "--workers", "0"], 1),  # RunOptions refuses it
    (["to-nxd", "src", "out"], 2),                           # no layout: --tp and --pp needed
    (["to-hf", "src", "out", "--private"], 1),               # --private without --push-to-hub
    (["reshard", "src", "out", "--qkv-linear", "--coalesce-qkv"], 1),
    (["verify", "hf", "nxd", "--layers", "many"], 1),
    (["to-dcp", "src", "out", "--workers", "0"], 1),
    (["from-dcp", "src", "out", "--to", "hf", "--tp", "2"], 1),  # a layout flag without --to nxd
])
def test_ckptconv_answers_without_torch(tmp_path, argv, status):
    result = probe("ckptconv.cli.main", argv, tmp_path)
    assert result == {"status": status, "loaded": []}


@pytest.mark.parametrize("argv,status", [
    (["--version"], 0),
    (["--help"], 0),
    (["run", "--help"], 0),
    (["data", "pack", "--help"], 0),
    (["run", "--tp"], 2),                                    # missing value
    (["run", "--resume", "x", "--lr", "-1"], 1),             # TrainConfig refuses it
    (["run", "--config", "bad.yaml"], 1),                    # unknown YAML keys
    (["run", "--config", "missing.yaml"], 1),
])
def test_nxdtrain_answers_without_torch(tmp_path, argv, status):
    (tmp_path / "bad.yaml").write_text("resume: /fsx/llama-nxd\nlearning_rate: 3.0e-4\nglobal_batch: 8\n")
    result = probe("nxdtrain.cli", argv, tmp_path)
    assert result == {"status": status, "loaded": []}


def test_the_probe_sees_torch_when_a_command_computes(tmp_path):
    """The check above can fail: a command that reaches the library does import torch."""
    result = probe("ckptconv.cli.main", ["to-nxd", str(tmp_path / "missing"), str(tmp_path / "out"), "--tp", "1"], tmp_path)
    assert result["status"] == 1 and "torch" in result["loaded"]
