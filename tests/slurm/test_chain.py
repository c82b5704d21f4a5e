"""The workflow as docs/slurm.md submits it: convert -> train -> export, three sbatch calls at once chained with
--dependency=afterok, on two nodes each; and a job given bad input, whose dependents Slurm must cancel."""

from __future__ import annotations

import json
from pathlib import Path

from tests.faults.helpers import looks_complete, tree
from tests.slurm.cluster import ended, job, losses, never_started, output, sbatch
from tests.slurm.conftest import MODEL, TRAIN_ARGS, template_env


def same_export(a: Path, b: Path) -> bool:
    """Two to-hf outputs hold the same bytes; their ckptconv.json differ only in the fingerprint, which names the
    input tag's path and modification time, and in the run id of the tag each came from (random per training run)."""
    meta = [json.loads((d / "ckptconv.json").read_text()) for d in (a, b)]
    for one in meta:
        del one["fingerprint"]
        one["extra"]["from_tag"].pop("run")
    files = [{k: v for k, v in tree(d).items() if k != "ckptconv.json"} for d in (a, b)]
    return meta[0] == meta[1] and files[0] == files[1] and len(files[0]) >= 2


def test_chain_equals_the_direct_commands(hf, reference, tmp_path):
    """Two srun tasks convert (each its part of the files), torchrun on two nodes trains (c10d rendezvous at the
    first node), two tasks export: the bytes of the conversion and of the export, and every step's loss, are those
    of one to-nxd, one ``nxdtrain run --nproc 2`` and one to-hf."""
    nxd, ckpt, out, log = tmp_path / "nxd", tmp_path / "ckpt", tmp_path / "hf", tmp_path / "train.jsonl"
    env = template_env(SRC=str(hf), OUT=str(nxd), INIT=str(nxd), CKPT=str(ckpt))
    convert = sbatch("convert.sbatch", ["--nodes", "2"], tmp_path, **env)
    train = sbatch("train.sbatch", ["--nodes", "2", f"--dependency=afterok:{convert}"], tmp_path,
                   (*TRAIN_ARGS, "--log-jsonl", str(log)), **env)
    export = sbatch("export.sbatch", ["--nodes", "2", f"--dependency=afterok:{train}"], tmp_path,
                    **{**env, "OUT": str(out)})
    records = {name: ended(job_id, timeout=600) for name, job_id in
               (("convert", convert), ("train", train), ("export", export))}
    for name, record in records.items():
        assert (record["JobState"], record["ExitCode"], record["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]"), name
    # afterok: each started only once the one before had ended
    assert records["convert"]["EndTime"] <= records["train"]["StartTime"] <= records["train"]["EndTime"]
    assert records["train"]["EndTime"] <= records["export"]["StartTime"]

    assert tree(nxd) == tree(reference.nxd)
    converted = output("convert.sbatch", convert, tmp_path).read_text()
    assert "part 0/2: " in converted and "part 1/2: " in converted, converted  # two srun tasks, one part each
    assert losses(log) == reference.losses
    assert sorted(losses(log)) == list(range(1, len(reference.losses) + 1))
    assert same_export(out, reference.hf)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == MODEL["layers"]
    assert f"nxdtrain: resume: auto: no completed tag in {ckpt} yet; weights only from {nxd}" in output(
        "train.sbatch", train, tmp_path).read_text()


def test_bad_input_fails_in_one_line_and_cancels_the_dependents(hf, tmp_path):
    """A config whose layer count the weights contradict: the convert job fails with ckptconv's one-line error in
    its output file and exit 1 in Slurm's record; train and export, chained afterok, are cancelled unstarted."""
    src = tmp_path / "bad"
    src.mkdir()
    for f in hf.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    config = json.loads((hf / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 9}))
    nxd, ckpt = tmp_path / "nxd", tmp_path / "ckpt"
    env = template_env(SRC=str(src), OUT=str(nxd), INIT=str(nxd), CKPT=str(ckpt))
    convert = sbatch("convert.sbatch", ["--nodes", "1"], tmp_path, **env)
    train = sbatch("train.sbatch", ["--nodes", "2", f"--dependency=afterok:{convert}"], tmp_path, TRAIN_ARGS, **env)
    export = sbatch("export.sbatch", ["--nodes", "2", f"--dependency=afterok:{train}"], tmp_path,
                    **{**env, "OUT": str(tmp_path / "hf")})

    record = ended(convert)
    assert (record["JobState"], record["ExitCode"]) == ("FAILED", "1:0")
    text = output("convert.sbatch", convert, tmp_path).read_text()
    errors = [line for line in text.splitlines() if line.startswith("ckptconv: error: ")]
    assert errors == [f"ckptconv: error: {src}/config.json: num_hidden_layers is 9 but the weights hold "
                      f"{MODEL['layers']} layers (0-{MODEL['layers'] - 1})"], text
    assert "Traceback" not in text
    for dependent in (train, export):
        ended(dependent)
        assert never_started(dependent), job(dependent)
    assert not output("train.sbatch", train, tmp_path).exists()
    assert not looks_complete(nxd) and not ckpt.exists()
