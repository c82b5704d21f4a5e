"""examples/slurm/*.sbatch: valid bash, and their DRY_RUN=1 commands for 1 and 4 nodes (Slurm emulated by its variables).

These run anywhere; the templates themselves run under a real Slurm in the Slurm lane (tests/slurm, make test-slurm)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from ckptconv.cli.main import build_parser as ckptconv_parser
from nxdtrain.cli import build_parser as nxdtrain_parser

SLURM = Path(__file__).resolve().parents[1] / "examples" / "slurm"
SCRIPTS = ("convert.sbatch", "train.sbatch", "export.sbatch")


def dry_run(script: str, nodes: int | None, *args: str, **env: str) -> list[str]:
    """The script's printed commands, in an environment with nothing of Slurm but what sbatch would set."""
    base = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1"}
    if nodes is not None:
        base.update(SLURM_JOB_NUM_NODES=str(nodes), SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=f"trn[007-{6 + nodes:03d}]")
    result = subprocess.run(["bash", str(SLURM / script), *args], env={**base, **env}, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout.splitlines()


def tool_args(line: str, marker: str) -> list[str]:
    """The arguments after the tool in a printed command (``ckptconv`` or ``nxdtrain.cli``)."""
    words = shlex.split(line)
    return words[words.index(marker) + 1:]


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
    result = subprocess.run(["bash", "-n", str(SLURM / script)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == ""


def test_convert(tmp_path):
    assert dry_run("convert.sbatch", 4, SRC="acme/tiny-llama", REVISION="v1", OUT="/fsx/out", TP="32", PP="8",
                   LAYOUT_FLAGS="--qkv-linear --fuse-qkv --kv-size-multiplier 4") == [
        "srun --nodes=1 --ntasks=1 ckptconv inspect acme/tiny-llama --revision v1 --json",
        "srun --nodes=4 --ntasks-per-node=1 --ntasks=4 ckptconv to-nxd acme/tiny-llama /fsx/out --revision v1 "
        "--tp 32 --pp 8 --qkv-linear --fuse-qkv --kv-size-multiplier 4 --quiet",
        "srun --nodes=1 --ntasks=1 ckptconv finalize /fsx/out",
    ]
    # One node, a local SRC (no fetch step), the python -m form; a completed OUT needs no finalize.
    (tmp_path / "out").mkdir()
    (tmp_path / "out/ckptconv.json").write_text("{}")
    lines = dry_run("convert.sbatch", 1, SRC=str(tmp_path), OUT=str(tmp_path / "out"), CKPTCONV="python -m ckptconv.cli")
    assert lines == [f"srun --nodes=1 --ntasks-per-node=1 --ntasks=1 python -m ckptconv.cli to-nxd {tmp_path} "
                     f"{tmp_path}/out --tp 8 --pp 1 --qkv-linear --fuse-qkv --kv-size-multiplier 1 --quiet"]
    args = ckptconv_parser().parse_args(tool_args(lines[0], "ckptconv.cli"))
    assert (args.command, args.tp, args.pp, args.qkv_linear, args.fuse_qkv, args.kvm) == ("to-nxd", 8, 1, True, True, 1)


def test_train_runs_the_same_command_at_every_start_and_nxdtrain_chooses(tmp_path):
    """--resume auto --init INIT: a requeue resumes the newest completed tag of CKPT (nxdtrain's rule, which skips
    a tag whose save was cut short), the first start loads INIT; the script decides nothing from the files."""
    ckpt = tmp_path / "ckpt"
    env = dict(INIT="/fsx/llama-nxd", CKPT=str(ckpt), TP="8", PP="2", CONFIG="run.yaml")
    first = dry_run("train.sbatch", 4, "--lr", "3e-5", **env)
    assert first == [
        "srun --nodes=4 --ntasks-per-node=1 --ntasks=4 python -m torch.distributed.run --nnodes=4 --nproc-per-node=32 "
        "--rdzv-backend=c10d --rdzv-endpoint=trn007:14242 --rdzv-id=4242 -m nxdtrain.cli run --resume auto --init "
        f"/fsx/llama-nxd --tp 8 --pp 2 --checkpoint-dir {ckpt} --checkpoint-freq 100 --config run.yaml --lr 3e-5",
    ]
    (ckpt / "step_100").mkdir(parents=True)  # an interrupted first save
    assert dry_run("train.sbatch", 4, "--lr", "3e-5", **env) == first
    (ckpt / "step_100/done").write_text("1")
    assert dry_run("train.sbatch", 4, "--lr", "3e-5", **env) == first
    args = nxdtrain_parser().parse_args(tool_args(first[0], "nxdtrain.cli"))
    assert (args.resume, args.init, args.tp, args.pp, args.checkpoint_dir, args.lr) == (
        "auto", "/fsx/llama-nxd", 8, 2, str(ckpt), 3e-5)


@pytest.mark.parametrize("instance,lnc,procs", [("trn1", None, 32), ("trn2", None, 64), ("trn2", "1", 128),
                                                ("gpu", None, 8)])
def test_train_processes_per_node_follow_the_instance(instance, lnc, procs):
    env = dict(INIT="/fsx/nxd", CKPT="/fsx/ckpt", TP="8", INSTANCE=instance)
    if lnc:
        env["NEURON_LOGICAL_NC_CONFIG"] = lnc
    (line,) = dry_run("train.sbatch", 2, **env)
    assert f" --nnodes=2 --nproc-per-node={procs} " in line
    (line,) = dry_run("train.sbatch", 2, LAUNCHER="srun", **env)
    assert line.startswith(f"srun --nodes=2 --ntasks-per-node={procs} --ntasks={2 * procs} ")


@pytest.mark.parametrize("nodes,extra,needs", [
    (4, dict(TP="32", PP="8"), "a multiple of TP 32 x PP 8 = 256"),           # 128 processes, tp x pp 256
    (4, dict(TP="32", PP="4", DP="2"), "exactly TP 32 x PP 4 x DP 2 = 256"),
    (3, dict(TP="64", PP="1", INSTANCE="trn2", PROCS_PER_NODE="40"), "a multiple of TP 64 x PP 1 = 64"),
])
def test_train_refuses_a_world_that_is_not_the_layout(nodes, extra, needs):
    env = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_ID": "1",
           "INIT": "/fsx/nxd", "CKPT": "/fsx/ckpt", **extra}
    result = subprocess.run(["bash", str(SLURM / "train.sbatch")], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and result.stdout == ""  # nothing printed, nothing started
    assert result.stderr.startswith(f"train.sbatch: {nodes} nodes x PROCS_PER_NODE ")
    assert f"the layout needs {needs}; change the nodes, PROCS_PER_NODE or the layout" in result.stderr


def test_train_one_node_and_srun_launcher():
    env = dict(INIT="/fsx/nxd", CKPT="/fsx/ckpt")
    assert dry_run("train.sbatch", 1, **env) == [
        "srun --nodes=1 --ntasks-per-node=1 --ntasks=1 python -m torch.distributed.run --nnodes=1 --nproc-per-node=32 "
        "--rdzv-backend=c10d --rdzv-endpoint=trn007:14242 --rdzv-id=4242 -m nxdtrain.cli run --resume auto --init "
        "/fsx/nxd --tp 8 --pp 1 --checkpoint-dir /fsx/ckpt --checkpoint-freq 100",
    ]
    assert dry_run("train.sbatch", 4, LAUNCHER="srun", PROCS_PER_NODE="32", **env) == [
        "srun --nodes=4 --ntasks-per-node=32 --ntasks=128 --export=ALL\\,MASTER_ADDR=trn007\\,MASTER_PORT=14242 python -m "
        "nxdtrain.cli run --resume auto --init /fsx/nxd --tp 8 --pp 1 --checkpoint-dir /fsx/ckpt --checkpoint-freq 100",
    ]
    # DATA is the run's --data (without it, CONFIG or the extra arguments must give the rows: nxdtrain refuses none)
    (line,) = dry_run("train.sbatch", 1, DATA="/fsx/tokenized", **env)
    assert line.endswith(" --checkpoint-dir /fsx/ckpt --checkpoint-freq 100 --data /fsx/tokenized")
    assert nxdtrain_parser().parse_args(tool_args(line, "nxdtrain.cli")).data == "/fsx/tokenized"
    # A MASTER_ADDR the user set is where both launchers meet
    assert "--rdzv-endpoint=10.0.0.5:14242 " in dry_run("train.sbatch", 2, MASTER_ADDR="10.0.0.5", **env)[0]
    assert "MASTER_ADDR=10.0.0.5" in dry_run("train.sbatch", 2, LAUNCHER="srun", MASTER_ADDR="10.0.0.5", **env)[0]
    # Outside Slurm (no SLURM_* at all): one node, job 0, the local host.
    assert dry_run("train.sbatch", None, **env)[0].startswith(
        "srun --nodes=1 --ntasks-per-node=1 --ntasks=1 python -m torch.distributed.run --nnodes=1 --nproc-per-node=32 "
        "--rdzv-backend=c10d --rdzv-endpoint=localhost:10000 --rdzv-id=0 ")


def test_export():
    assert dry_run("export.sbatch", 4, CKPT="/fsx/ckpt", OUT="/fsx/hf", PUSH_TO_HUB="acme/llama-cpt", PRIVATE="1",
                   DTYPE="bf16") == [
        "srun --nodes=4 --ntasks-per-node=1 --ntasks=4 ckptconv to-hf /fsx/ckpt /fsx/hf --dtype bf16 "
        "--max-shard-size 5GB --push-to-hub acme/llama-cpt --private --quiet",
    ]
    (line,) = dry_run("export.sbatch", 1, CKPT="/fsx/ckpt", OUT="/fsx/hf")
    assert line == "srun --nodes=1 --ntasks-per-node=1 --ntasks=1 ckptconv to-hf /fsx/ckpt /fsx/hf --dtype source --max-shard-size 5GB --quiet"
    args = ckptconv_parser().parse_args(tool_args(line, "ckptconv"))
    assert (args.command, args.src, args.out, args.max_shard_size, args.push_to_hub) == ("to-hf", "/fsx/ckpt", "/fsx/hf",
                                                                                         5 * 10**9, None)


def test_missing_required_variable_fails_with_its_name():
    result = subprocess.run(["bash", str(SLURM / "train.sbatch")], env={"PATH": os.environ["PATH"], "DRY_RUN": "1"},
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "INIT: set INIT: the converted NxD directory" in result.stderr
