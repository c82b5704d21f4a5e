"""A run says what it does and nothing else: no library warnings on stderr when it ends or is stopped, and an
error that every process hits is printed once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import wait_until
from tests.nxdtrain.parallel.test_signals import STOP_BOUND_S, descendants, kill_leftovers

VOCAB = 128  # the tiny models' vocabulary


@pytest.fixture(scope="module")
def arrow_rows(tmp_path_factory):
    """A datasets save_to_disk directory: loading one creates tqdm's lock in every process."""
    import datasets

    root = tmp_path_factory.mktemp("quiet") / "rows"
    rows = [[(7 * r + t) % VOCAB for t in range(16)] for r in range(32)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(root))
    return root


def ours(stderr: str) -> list[str]:
    """The lines nxdtrain did not write (it writes 'nxdtrain: ...' notes and 'step N/M ...' progress)."""
    return [line for line in stderr.splitlines() if not line.startswith(("nxdtrain: ", "step "))]


def run_argv(src, root, data, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nxdtrain.cli", "run", "--resume", str(src), "--nproc", "4", "--tp", "2",
            "--data", str(data), "--seq-len", "16", "--gbs", "4", "--mbs", "1", "--checkpoint-dir", str(root),
            *extra]


def test_a_normal_run_with_zero1_and_sequence_parallel_prints_no_warnings(tmp_path, nxd_model, arrow_rows):
    """tp 2 x dp 2 with --zero1 and --sequence-parallel (the all-gather/reduce-scatter once warned on every rank)."""
    src = nxd_model("gqa", tp=2, pp=1, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=2)
    done = subprocess.run(run_argv(src, tmp_path / "ckpt", arrow_rows, "--steps", "2", "--zero1",
                                   "--sequence-parallel"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert ours(done.stderr) == []
    assert "nxdtrain: saved" in done.stderr and "step 2/2" in done.stderr
    assert "nxdtrain: precision fp32 (the default on cpu; --precision bf16 to change it)" in done.stderr.splitlines()


def test_sigterm_stop_leaves_no_leaked_semaphore_warning(tmp_path, nxd_model, arrow_rows):
    src = nxd_model("gqa", tp=2, pp=1, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=2)
    launcher = subprocess.Popen(run_argv(src, tmp_path / "ckpt", arrow_rows, "--steps", "100000", "--optimizer",
                                         "sgd"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    workers: set[int] = set()
    try:
        started = time.monotonic()
        wait_until(lambda: len(descendants(launcher.pid)) >= 5 or launcher.poll() is not None, "the workers", 120)
        time.sleep(max(0.0, 20 - (time.monotonic() - started)))  # every process has loaded the rows by then
        workers = descendants(launcher.pid)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=STOP_BOUND_S)
        assert launcher.returncode == 128 + signal.SIGTERM, err
        assert ours(err) == [] and "leaked" not in err
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        kill_leftovers(workers)


def test_an_error_every_process_hits_is_printed_once(tmp_path, nxd_model, arrow_rows):
    src = nxd_model("gqa", tp=2, pp=1, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=2)
    argv = run_argv(src, tmp_path / "ckpt", arrow_rows, "--steps", "2")
    argv[argv.index("--seq-len") + 1] = "32"  # the rows have 16 tokens: every rank fails at its first batch
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("nxdtrain: error: ") and "--seq-len 32" in errors[0], done.stderr
    assert ours(done.stderr) == []  # no "Terminating process ..." lines from torch's launcher either
