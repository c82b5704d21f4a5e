"""Real processes against one OUT: kill -9 at random moments, two writers at once, a full disk.

After each fault the rerun of the same command must produce exactly the bytes of an uninterrupted
run, and at no moment may OUT hold a ckptconv.json that does not match its files.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptconv.cli.main import main
from ckptconv.engine.outdir import LOCK_FILE, TMP_DIR
from tests.faults.helpers import command, consistent, env, looks_complete, one_line_error, run, tree

SLOW_FLAGS = ["--workers", "1", "--max-memory", "1MiB", "--hash", "sha256"]  # a longer window to kill in
KILLS_DEFAULT, KILLS_SLOW = 3, 12
RACE_TRIALS = 10


def _argv(direction: str, src: Path, out: Path) -> list[str]:
    flags = ["--tp", "2", "--pp", "2"] if direction == "to-nxd" else ["--max-shard-size", "2MB"]
    return [direction, str(src), str(out), *flags, *SLOW_FLAGS, "--quiet"]


@pytest.fixture(scope="module")
def sources(medium_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, float]]:
    """{direction: (SRC, reference OUT of an uninterrupted run, seconds that run took)}."""
    root = tmp_path_factory.mktemp("fault-references")
    nxd = root / "src-nxd"
    assert main(_argv("to-nxd", medium_hf, nxd)) == 0
    refs = {}
    for direction, src in (("to-nxd", medium_hf), ("to-hf", nxd)):
        started = time.monotonic()
        assert main(_argv(direction, src, root / f"ref-{direction}")) == 0
        refs[direction] = (src, root / f"ref-{direction}", time.monotonic() - started)
    return refs


def _kill_during(argv: list[str], out: Path, delay: float) -> int | None:
    """Start the CLI, wait until it has begun writing OUT, kill -9 it ``delay`` seconds later."""
    with subprocess.Popen(command("ckptconv", *argv), env=env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE) as proc:  # the with closes the stderr pipe
        deadline = time.monotonic() + 120
        while not (out / ".ckptconv-tmp").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return proc.returncode


def _kill_points(direction: str, count: int, window: float) -> list[float]:
    """Seconds after OUT's temporary directory appears: spread over the conversion's own duration
    (a little past it too, to kill during finalize and after)."""
    rng = random.Random(f"{direction}-{count}")
    return sorted(rng.uniform(0.0, 1.1) * window for _ in range(count))


def _kill_then_rerun(sources: dict[str, tuple[Path, Path, float]], direction: str, tmp_path: Path, count: int) -> None:
    src, reference, window = sources[direction]
    for i, delay in enumerate(_kill_points(direction, count, window)):
        out = tmp_path / f"out{i}"
        _kill_during(_argv(direction, src, out), out, delay)
        if looks_complete(out):  # killed after the end: then it must really be complete
            assert consistent(out)
        assert main(_argv(direction, src, out)) == 0, f"rerun after kill at +{delay:.3f}s"
        assert tree(out) == tree(reference), f"kill at +{delay:.3f}s"
        assert not (out / ".ckptconv-tmp").exists()


@pytest.mark.parametrize("direction", ["to-nxd", "to-hf"])
def test_kill9_then_rerun_is_byte_identical(sources, direction: str, tmp_path: Path):
    _kill_then_rerun(sources, direction, tmp_path, KILLS_DEFAULT)


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["to-nxd", "to-hf"])
def test_kill9_many_points(sources, direction: str, tmp_path: Path):
    _kill_then_rerun(sources, direction, tmp_path, KILLS_SLOW)


# --------------------------------------------------------------------------------------------
# One writer


def test_second_writer_is_refused_and_a_killed_holder_releases(fault_hf: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from ckptconv.engine.outdir import acquire; "
         "lock = acquire(Path(sys.argv[1]), fingerprint='other', command='holder'); print('ready', flush=True); "
         "time.sleep(600)", str(out)], env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        assert main(["to-nxd", str(fault_hf), str(out), "--tp", "2", "--quiet"]) == 1
        assert one_line_error(capsys.readouterr().err) == (
            f"ckptconv: error: {out}: in use by another writer (pid {holder.pid} on {socket.gethostname()}: holder); "
            "wait for it to finish or choose another OUT")
    finally:
        holder.kill()  # kill -9: the kernel releases its lock
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    assert main(["to-nxd", str(fault_hf), str(out), "--tp", "2", "--quiet"]) == 0
    assert consistent(out)


def test_writer_paused_mid_run_keeps_out_to_itself(medium_hf: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]):
    """Writer A is stopped (SIGSTOP) just after it starts on OUT; writer B of another layout runs
    meanwhile. B must be refused, and A, continued, must finish OUT as if alone. (Before #10 B
    wrote its conversion and A then mixed its own into it: both exited 0.)"""
    out, ref = tmp_path / "out", tmp_path / "ref"
    a_flags, b_flags = ["--tp", "2"], ["--tp", "1", "--pp", "2"]
    writer = subprocess.Popen(command("ckptconv", "to-nxd", medium_hf, out, *a_flags, *SLOW_FLAGS, "--quiet"), env=env())
    while not _holds_lock(out, writer.pid) and writer.poll() is None:  # A holds OUT's lock (its record is in)
        time.sleep(0.002)
    writer.send_signal(signal.SIGSTOP)
    try:
        assert main(["to-nxd", str(medium_hf), str(out), *b_flags, *SLOW_FLAGS, "--quiet"]) == 1
        assert f"in use by another writer (pid {writer.pid} on " in one_line_error(capsys.readouterr().err)
    finally:
        writer.send_signal(signal.SIGCONT)
    assert writer.wait(timeout=300) == 0
    assert main(["to-nxd", str(medium_hf), str(ref), *a_flags, *SLOW_FLAGS, "--quiet"]) == 0
    assert consistent(out) and tree(out) == tree(ref)


def _holds_lock(out: Path, pid: int) -> bool:
    """The lock file names ``pid``: the holder writes its record only once it has the flock."""
    try:
        return json.loads((out / TMP_DIR / LOCK_FILE).read_text() or "{}").get("pid") == pid
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def _race(medium_hf: Path, out: Path) -> list[tuple[int, str]]:
    layouts = (["--tp", "2"], ["--tp", "1", "--pp", "2"])
    procs = [subprocess.Popen(command("ckptconv", "to-nxd", medium_hf, out, *flags, *SLOW_FLAGS, "--quiet"),
                              env=env(), stderr=subprocess.PIPE, text=True) for flags in layouts]
    return [(p.wait(timeout=300), p.stderr.read() if p.stderr else "") for p in procs]


def _concurrent_trials(medium_hf: Path, tmp_path: Path, trials: int) -> None:
    refs = {}
    for name, flags in (("tp2", ["--tp", "2"]), ("pp2", ["--tp", "1", "--pp", "2"])):
        assert main(["to-nxd", str(medium_hf), str(tmp_path / name), *flags, *SLOW_FLAGS, "--quiet"]) == 0
        refs[name] = tree(tmp_path / name)
    for trial in range(trials):
        out = tmp_path / f"out{trial}"
        results = _race(medium_hf, out)
        assert sorted(code for code, _ in results) == [0, 1], results
        err = one_line_error(next(e for code, e in results if code == 1))
        assert "in use by another writer (pid " in err or "not empty; holds another conversion" in err, err
        assert consistent(out)
        assert tree(out) == refs["tp2" if results[0][0] == 0 else "pp2"]


@pytest.mark.slow
def test_two_writers_started_together(medium_hf: Path, tmp_path: Path):
    _concurrent_trials(medium_hf, tmp_path, RACE_TRIALS)


# --------------------------------------------------------------------------------------------
# A full disk (RLIMIT_FSIZE: any file past the limit fails with EFBIG)


def test_disk_full_while_writing_shards(fault_hf: Path, tmp_path: Path):
    out = tmp_path / "out"
    proc = run("ckptconv", "to-nxd", fault_hf, out, "--tp", "2", "--quiet", limit=50_000)
    assert proc.returncode == 1
    line = one_line_error(proc.stderr)
    assert line.startswith(f"ckptconv: error: {out}/.ckptconv-tmp/model/dp_rank_00_tp_rank_0")
    assert "file size limit reached while writing; needs " in line and "rerun to resume" in line
    assert not looks_complete(out)
    assert main(["to-nxd", str(fault_hf), str(out), "--tp", "2", "--quiet"]) == 0
    assert main(["to-nxd", str(fault_hf), str(tmp_path / "ref"), "--tp", "2", "--quiet"]) == 0
    assert tree(out) == tree(tmp_path / "ref")


@pytest.mark.parametrize("parts", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_disk_full_during_finalize_then_rerun_completes(hf_copy: Path, tmp_path: Path, parts: int):
    """Finalize fails (the tokenizer copy is larger than the limit); the rerun must finish OUT.

    Before #10 the failed finalize left ``finalize.lock`` behind and every rerun said "other parts
    are still running" with exit 0, forever."""
    (hf_copy / "tokenizer.json").write_text('{"vocab": "' + "x" * 400_000 + '"}')
    out, ref = tmp_path / "out", tmp_path / "ref"
    argv = ["to-nxd", hf_copy, out, "--tp", "2", "--quiet"]
    if parts == 2:
        assert main([*map(str, argv), "--part", "0/2"]) == 0
        argv += ["--part", "1/2"]
    failed = run("ckptconv", *argv, limit=300_000)
    assert failed.returncode == 1
    assert not looks_complete(out)
    proc = run("ckptconv", *argv, "--json")
    assert proc.returncode == 0, proc.stderr
    assert '"complete": true' in proc.stdout
    assert main(["to-nxd", str(hf_copy), str(ref), "--tp", "2", "--quiet"]) == 0
    assert tree(out) == tree(ref)
    assert one_line_error(failed.stderr) == (
        f"ckptconv: error: {out}/hf/tokenizer.json: file size limit reached while writing; needs 400013 more bytes; "
        "free space (or raise the limit) and rerun to resume")
