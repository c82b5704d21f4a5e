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


@pytest.mark.parametrize("argv,missing", [
    (["to-nxd", "gone", "out", "--tp", "2", "--pp", "1"], "gone: no such file or directory"),
    (["to-hf", "gone", "out"], "gone: no such directory"),
    (["reshard", "gone", "out", "--tp", "2"], "gone: no such directory"),
    (["to-dcp", "gone", "out"], "gone: no such file or directory"),
    (["from-dcp", "gone", "out", "--to", "nxd", "--tp", "2"], "gone: no such directory"),
    (["verify", "gone-hf", "gone"], "gone: no such directory"),
    (["inspect", "gone"], "gone: no such file or directory"),
])
def test_missing_source_refused_without_torch(tmp_path, argv, missing):
    """A conversion of a source that does not exist says so in one line, before torch is imported."""
    proc = subprocess.run([sys.executable, "-c", PROBE.format(module="ckptconv.cli.main", heavy=HEAVY), *argv],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"status": 1, "loaded": []}
    assert proc.stderr.strip() == f"ckptconv: error: {missing}"
    assert not (tmp_path / "out").exists()


def test_missing_source_hub_id_goes_to_the_library(monkeypatch):
    """An ``org/name`` that is no local path is a hub id where a command takes one: not refused as missing."""
    from ckptconv.cli.main import build_parser, check_sources

    monkeypatch.chdir("/")
    check_sources(build_parser().parse_args(["to-nxd", "meta-llama/Llama-3.1-8B", "out", "--tp", "1"]))
    with pytest.raises(Exception, match="no-org/x: no such directory"):
        check_sources(build_parser().parse_args(["to-hf", "no-org/x", "out"]))


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
    (tmp_path / "empty").mkdir()  # exists, so the library looks at it (and finds no model)
    result = probe("ckptconv.cli.main", ["to-nxd", str(tmp_path / "empty"), str(tmp_path / "out"), "--tp", "1"], tmp_path)
    assert result["status"] == 1 and "torch" in result["loaded"]


def test_cli_pauses_the_collector_for_the_import_only(tmp_path, monkeypatch):
    """The CLI pauses the cyclic collector while it imports a conversion's library (torch's import triggered full
    collections that found nothing), not while the conversion runs (cycles it makes must be collected for its memory
    to stay bounded), and leaves it on after, also when the command fails: main() is called in-process too."""
    import gc
    import importlib

    import ckptconv.cli.main as cli
    from ckptconv.errors import ConversionError

    seen: dict[str, bool] = {}
    real_import = importlib.import_module

    def spy_import(name, *args):
        if name == "ckptconv.commands.api":
            seen.setdefault("import", gc.isenabled())
        return real_import(name, *args)

    def spy_run(args):
        seen["run"] = gc.isenabled()
        raise ConversionError("stopped by the test")

    monkeypatch.setattr(importlib, "import_module", spy_import)
    monkeypatch.setattr(cli, "run", spy_run)
    (tmp_path / "empty").mkdir()
    assert gc.isenabled()
    assert cli.main(["to-nxd", str(tmp_path / "empty"), str(tmp_path / "out"), "--tp", "1"]) == 1
    assert seen == {"import": False, "run": True}
    assert gc.isenabled()


# What a conversion of a training tag must not import: libraries of other paths (the HF hub, transformers, safetensors'
# package), rich (progress bars only; these run --quiet) and torch's DCP package (which imports sympy with
# torch.distributed.tensor: ~0.5 s; ckptconv writes and reads DCP files itself, ckptconv.io.dcp_classes).
NOT_ON_A_TAG_PATH = ("transformers", "safetensors", "huggingface_hub", "datasets", "rich", "sympy",
                     "torch.distributed.checkpoint")


@pytest.fixture(scope="module")
def training_tag(tiny_models, tmp_path_factory):
    """A training tag as the start-up benchmark's (benchmarks/training_rows.py: nxdtrain's format 2 with AdamW state,
    every file recorded; here a tiny GQA model at tp 2, fused QKV) and its TorchTitan DCP."""
    import ckptconv
    from benchmarks.reshard_optim import make_training_tag
    from ckptconv.engine.options import RunOptions

    root = tmp_path_factory.mktemp("startup-tag")
    hf = tiny_models("startup-gqa", kv_heads=2, layers=2, seed=3)
    quiet = RunOptions(quiet=True)
    ckptconv.to_nxd(hf, root / "tag", tp=2, attention="qkv_linear", fuse_qkv=True, options=quiet)
    make_training_tag(root / "tag", "CosineAnnealing", tp=2)  # as the benchmark's tag: NxD has it
    ckptconv.to_dcp(root / "tag", root / "dcp", options=quiet)
    return {"tag": root / "tag", "dcp": root / "dcp"}


@pytest.mark.parametrize("argv,src,never", [
    (["reshard", "SRC", "OUT", "--tp", "1"], "tag", ("ckptconv.titan",)),
    (["reshard", "SRC", "OUT", "--tp", "1", "--optimizer-format", "nxd"], "tag", ("ckptconv.titan",)),
    (["to-dcp", "SRC", "OUT"], "tag", ()),
    (["from-dcp", "SRC", "OUT", "--to", "nxd", "--tp", "2"], "dcp", ()),
])
def test_a_conversion_of_a_training_tag_imports_only_its_path(training_tag, tmp_path, argv, src, never):
    """The four training-state commands (issue #33's start-up rows) convert without importing what their path does
    not use; the probe sees torch, so it sees imports."""
    heavy = (*NOT_ON_A_TAG_PATH, *never, "torch")
    args = [str(training_tag[src]) if a == "SRC" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    proc = subprocess.run([sys.executable, "-c", PROBE.format(module="ckptconv.cli.main", heavy=heavy), *args,
                           "--quiet"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"status": 0, "loaded": ["torch"]}, proc.stderr
    assert (tmp_path / "out" / "ckptconv.json").is_file()


DCP_PROBE = """
import json, sys
from unittest import mock
import torch
from ckptconv.core.plan import OutFile, OutTensor, Piece, Source
from ckptconv.io import dcp, dcp_classes

def tensor(key, dtype, shape):
    return OutTensor(key, dtype, shape, 0, (Piece(Source(None, key), 0, shape[0] if shape else 1),))

specs = [tensor(key, dtype, shape) for key, dtype, shape in (
    ("model.layers.0.attention.wqkv.weight", torch.bfloat16, (24, 8)), ("norm.weight", torch.float32, (8,)),
    ("optimizer.state.tok_embeddings.weight.step", torch.float32, ()), ("ids", torch.int64, (3, 2)))]
files = [OutFile(dcp.distcp_name(0), "dcp", tuple(specs[:2])), OutFile(dcp.distcp_name(1), "dcp", tuple(specs[2:]))]
items = dcp.layout_items(files, {dcp.distcp_name(1): {"train_state.step": 7, "lr_scheduler.last_epoch": 7}})
ours = dcp.encode_metadata(items, lambda key: tuple(key.split(".")), "save-1")
imported = [m for m in ("torch.distributed.checkpoint", "sympy") if m in sys.modules]
with mock.patch.object(dcp_classes, "KNOWN_SOURCES", set()):  # torch's own classes, pickled by pickle.dumps
    torchs = dcp.encode_metadata(items, lambda key: tuple(key.split(".")), "save-1")
from torch.distributed.checkpoint.metadata import Metadata
import pickle
print(json.dumps({"imported": imported, "same": ours == torchs, "bytes": len(ours),
                  "loads": type(pickle.loads(ours)) is Metadata}))
"""


def test_dcp_metadata_is_torchs_pickle_without_importing_torchs_dcp_package(tmp_path):
    """to-dcp's .metadata, pickled from ckptconv.io.dcp_classes' stand-ins, is byte for byte what pickle.dumps writes
    of torch's own DCP classes (tensors of three dtypes, a 0-d one, bytes items, two files), and writing it imports
    neither torch.distributed.checkpoint nor sympy (fresh interpreter)."""
    proc = subprocess.run([sys.executable, "-c", DCP_PROBE], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["imported"] == [] and result["same"] and result["loads"] and result["bytes"] > 1000, proc.stderr


def test_dcp_metadata_classes_are_torchs_own_once_torch_defines_them_differently(monkeypatch):
    """The stand-ins copy torch 2.13's definitions: any other definition (another torch) gets torch's own classes."""
    from ckptconv.io import dcp_classes

    assert dcp_classes.metadata_classes().Metadata is dcp_classes.Metadata
    real = dcp_classes.class_sources
    monkeypatch.setattr(dcp_classes, "class_sources", lambda module, names: real(module, names) + "\n    extra: int = 0")
    classes = dcp_classes.metadata_classes()
    assert classes.Metadata.__module__ == "torch.distributed.checkpoint.metadata"
    assert classes.StorageInfo.__module__ == "torch.distributed.checkpoint.filesystem"


EXIT_PROBE = """
import atexit, os, sys
import ckptconv.cli.main as cli

class Teardown:  # a global of __main__: its __del__ runs when the interpreter tears its modules down
    def __del__(self, write=os.write):  # bound now: the module's globals are gone by then
        write(2, b"torn down\\n")

keep = Teardown()
real_main = cli.main

def main_then_register(argv=None):  # an exit handler registered during the run, as torch's are
    status = real_main(argv)
    atexit.register(lambda: os.write(2, b"later handler ran\\n"))
    return status

cli.main = main_then_register
mode, sys.argv = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
if mode == "handler-first":  # a script's own exit handler, registered before it starts the CLI
    atexit.register(lambda: os.write(2, b"earlier handler ran\\n"))
if mode == "in-process":
    sys.exit(cli.main(sys.argv[1:]))
if mode == "main-then-fail":  # a script that calls main() and then fails: its own status is the process's
    cli.main()
    sys.exit(3)
cli.console()
"""


@pytest.mark.parametrize("mode", ["process", "in-process", "handler-first", "main-then-fail"])
def test_a_conversion_process_ends_without_tearing_torch_down(training_tag, tmp_path, mode):
    """Run as the process (console(): the console script, python -m ckptconv.cli), a conversion flushes its output,
    lets every exit handler registered after its own (torch's) and the thread joins run, and ends with main's status
    without the module teardown (~0.1-0.3 s). main() called by a script, with or without argv, and console() after
    the script registered an exit handler of its own leave the interpreter's exit alone: that handler runs, and a
    script that fails after main() exits with its own status."""
    argv = ["reshard", str(training_tag["tag"]), str(tmp_path / "out"), "--tp", "1", "--json"]
    proc = subprocess.run([sys.executable, "-c", EXIT_PROBE, mode, *argv], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == (3 if mode == "main-then-fail" else 0), proc.stderr
    assert json.loads(proc.stdout)["complete"] is True  # all of stdout, flushed
    assert "later handler ran" in proc.stderr
    assert ("torn down" in proc.stderr) == (mode != "process")
    assert ("earlier handler ran" in proc.stderr) == (mode == "handler-first")
