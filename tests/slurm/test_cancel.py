"""scancel of the convert job while it writes, with train and export chained after it: nothing in OUT looks complete,
Slurm cancels the dependents before they start, and the same sbatch again writes what one uninterrupted to-nxd
writes.

The first job runs with the hold shim (tests/slurm/hold): once it has written shard bytes it waits while a hold file
exists, so the cancel lands mid-write every time instead of racing a conversion that takes a tenth of a second."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import wait_until
from tests.faults.helpers import looks_complete, tree
from tests.slurm.cluster import ENDED, POLL, completions, ended, job, never_started, output, sbatch, slurm
from tests.slurm.conftest import LAYOUT, SLOW_CONVERT, TRAIN_ARGS, template_env

HOLD_SHIM = Path(__file__).resolve().parent / "hold"


def writing(out: Path) -> bool:
    """A sized shard is in OUT (in its temporary directory while written, ``.ckptconv-tmp/model``) and nothing says
    OUT is complete yet."""
    shards = [p for p in out.rglob("model/*") if p.is_file()]
    return any(p.stat().st_size > 0 for p in shards) and not looks_complete(out)


def test_convert_cancelled_mid_write_then_submitted_again(big_hf, tmp_path):
    from ckptconv.cli.main import main as ckptconv

    nxd, ckpt = tmp_path / "nxd", tmp_path / "ckpt"
    env = template_env(SRC=str(big_hf), OUT=str(nxd), INIT=str(nxd), CKPT=str(ckpt))
    hold = tmp_path / "hold"
    hold.touch()
    held = {"CKPTCONV_TEST_HOLD": str(hold), "PYTHONPATH": os.pathsep.join(
        [str(HOLD_SHIM), *filter(None, [os.environ.get("PYTHONPATH")])])}
    convert = sbatch("convert.sbatch", ["--nodes", "2"], tmp_path, SLOW_CONVERT, **env, **held)
    train = sbatch("train.sbatch", ["--nodes", "2", f"--dependency=afterok:{convert}"], tmp_path, TRAIN_ARGS, **env)
    export = sbatch("export.sbatch", ["--nodes", "1", f"--dependency=afterok:{train}"], tmp_path,
                    **{**env, "OUT": str(tmp_path / "hf")})
    try:
        wait_until(lambda: writing(nxd) or job(convert)["JobState"] in ENDED, "the convert job to start writing", 300,
                   poll=POLL)
        slurm("scancel", str(convert))
        assert writing(nxd), "the conversion ended before it could be cancelled mid-write"
        assert ended(convert)["JobState"] == "CANCELLED"
    finally:
        hold.unlink()  # a job still held (this test failed) goes on and ends
    assert not looks_complete(nxd)
    for dependent in (train, export):
        ended(dependent)
        assert never_started(dependent), completions(dependent)
    assert not output("train.sbatch", train, tmp_path).exists() and not ckpt.exists()

    again = sbatch("convert.sbatch", ["--nodes", "2"], tmp_path, SLOW_CONVERT, **env)
    record = ended(again)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), output("convert.sbatch", again, tmp_path)
    assert ckptconv(["to-nxd", str(big_hf), str(tmp_path / "one"), *LAYOUT, *SLOW_CONVERT, "--quiet"]) == 0
    assert tree(nxd) == tree(tmp_path / "one")
