"""examples/neuron: the dry runs of train.sh and slurm.sbatch for trn1 and trn2 (processes per node, the world
checked against tp x pp, the same --resume auto command at every start), and bash-4.2-safe array expansions in
every example script."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from nxdtrain.cli import build_parser as nxdtrain_parser

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NEURON = EXAMPLES / "neuron"
SCRIPTS = sorted(p for p in EXAMPLES.rglob("*") if p.suffix in (".sh", ".sbatch"))


def run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "NXDTRAIN_EXAMPLES": str(NEURON)}
    return subprocess.run(["bash", str(NEURON / script), *args], env={**base, **env}, capture_output=True, text=True,
                          timeout=30)


def nxdtrain_args(line: str):
    words = shlex.split(line)
    return nxdtrain_parser().parse_args(words[words.index("nxdtrain.cli") + 1:])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_bash_syntax(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == ""


@pytest.mark.parametrize("instance,lnc,procs", [("trn1", None, 32), ("trn2", None, 64), ("trn2", "1", 128)])
def test_train_sh_one_process_per_neuroncore(instance, lnc, procs):
    env = {"INSTANCE": instance, **({"NEURON_LOGICAL_NC_CONFIG": lnc} if lnc else {})}
    result = run("train.sh", "/fsx/llama-nxd-tp8", "/fsx/ckpt", "--lr", "1e-5", **env)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith(f"torchrun --nproc_per_node {procs} --nnodes 1 --node_rank 0 ")
    args = nxdtrain_args(line)
    assert (args.resume, args.init, args.checkpoint_dir, args.tp, args.pp, args.device, args.lr) == (
        "auto", "/fsx/llama-nxd-tp8", "/fsx/ckpt", 8, 1, "xla", 1e-5)


@pytest.mark.parametrize("instance,nodes", [("trn1", 4), ("trn2", 2)])
def test_slurm_sbatch_dry_run(instance, nodes):
    result = run("slurm.sbatch", "/fsx/llama-nxd-tp32", "/fsx/ckpt", "--steps", "1000", INSTANCE=instance, TP="32",
                 SLURM_JOB_NUM_NODES=str(nodes), SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=f"trn[007-{6 + nodes:03d}]")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    node0, launch = result.stdout.splitlines()
    procs = {"trn1": 32, "trn2": 64}[instance]
    assert node0.startswith(f"torchrun --nproc_per_node {procs} --nnodes {nodes} --node_rank 0 --master_addr trn007 "
                            "--master_port 14242 -m nxdtrain.cli ")
    args = nxdtrain_args(node0)
    assert (args.resume, args.init, args.checkpoint_dir, args.tp, args.steps) == (
        "auto", "/fsx/llama-nxd-tp32", "/fsx/ckpt", 32, 1000)
    assert shlex.split(launch)[:3] == ["srun", "--export=ALL", "bash"]
    assert shlex.split(launch)[-4:] == ["/fsx/llama-nxd-tp32", "/fsx/ckpt", "--steps", "1000"]


def test_slurm_sbatch_requeue_runs_the_same_command(tmp_path):
    """The script no longer decides from the files: an interrupted first save (step_* without done) or a completed
    tag give the same command, and nxdtrain's --resume auto picks the newest completed tag."""
    ckpt = tmp_path / "ckpt"
    env = dict(SLURM_JOB_NUM_NODES="1", SLURM_JOB_ID="1")
    first = run("slurm.sbatch", "/fsx/nxd", str(ckpt), **env).stdout
    (ckpt / "step_10").mkdir(parents=True)
    assert run("slurm.sbatch", "/fsx/nxd", str(ckpt), **env).stdout == first
    (ckpt / "step_10" / "done").write_text("")
    assert run("slurm.sbatch", "/fsx/nxd", str(ckpt), **env).stdout == first


@pytest.mark.parametrize("script,nodes,env,message", [
    ("slurm.sbatch", "4", dict(TP="32", PP="8"),
     "train.sh: 4 nodes x PROCS_PER_NODE 32 (INSTANCE trn1) = 128 processes; TP 32 x PP 8 = 256 does not divide them"),
    ("slurm.sbatch", "3", dict(INSTANCE="trn2", TP="128"),
     "train.sh: 3 nodes x PROCS_PER_NODE 64 (INSTANCE trn2) = 192 processes; TP 128 x PP 1 = 128 does not divide them"),
    ("train.sh", None, dict(TP="64"),
     "train.sh: 1 nodes x PROCS_PER_NODE 32 (INSTANCE trn1) = 32 processes; TP 64 x PP 1 = 64 does not divide them"),
])
def test_a_world_that_is_not_the_layout_is_refused_before_anything_starts(script, nodes, env, message):
    extra = {"SLURM_JOB_NUM_NODES": nodes} if nodes else {}
    result = run(script, "/fsx/nxd", "/fsx/ckpt", **env, **extra)
    assert result.returncode == 2 and result.stdout == ""  # no srun, no torchrun line
    assert result.stderr.startswith(message)


def test_possibly_empty_arrays_are_expanded_safely_for_bash_before_4_4():
    """bash 4.2 (Amazon Linux 2) calls an empty "${a[@]}" unbound under set -u: arrays that can be empty (assigned
    () or read with read -a) must be expanded as ${a[@]+"${a[@]}"}."""
    checked = 0
    for script in SCRIPTS:
        code = "\n".join(line for line in script.read_text().splitlines() if not line.lstrip().startswith("#"))
        maybe_empty = set(re.findall(r"\b(\w+)=\(\)", code)) | set(re.findall(r"read -r?a (\w+)", code))
        for name in maybe_empty:
            unguarded = re.findall(rf'(?<!{name}\[@\]\+)"\$\{{{name}\[@\]', code)
            assert not unguarded, f"{script.name}: {name} expanded without the guard"
            checked += 1
    assert checked >= 5  # convert's ckptconv/core/layout/revision, export's ckptconv/push
