"""The data is checked before any process starts (issue 21): every row's length against --seq-len, short rows
refused naming their file and row, long rows cut / split / refused by --long-rows with what that drops said."""

from __future__ import annotations

import gzip
import json

import datasets
import pytest

from nxdtrain.cli import main
from nxdtrain.data.check import PARSE_ALL, check_rows
from nxdtrain.data.rows import PAD, Batches, open_rows
from nxdtrain.errors import TrainError
from nxdtrain.parallel import dist


def write_parts(directory, parts):
    directory.mkdir()
    for k, rows in enumerate(parts):
        text = json.dumps([{"input_ids": r} for r in rows]).encode()
        (directory / f"train-{k:03d}.json.gz").write_bytes(gzip.compress(text))
    return directory


def test_a_short_row_is_refused_before_the_first_process_starts(tmp_path, nxd_model, monkeypatch, capsys):
    """The issue's case: a short row deep in a SageMaker-style directory, named by its file and row there."""
    src = nxd_model("mha", tp=1, pp=1, attention="separate")
    data = write_parts(tmp_path / "parts", [[list(range(16))] * 10, [list(range(16))] * 6 + [list(range(9))]])

    def never(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(dist, "spawn", never)
    capsys.readouterr()  # the fixture's conversion
    argv = ["run", "--resume", str(src), "--nproc", "2", "--data", str(data), "--seq-len", "16", "--gbs", "2",
            "--steps", "4", "--checkpoint-dir", str(tmp_path / "ck")]
    assert main(argv) == 1
    assert capsys.readouterr().err == (f"nxdtrain: error: {data}/train-001.json.gz: row 6 has 9 tokens, fewer than "
                                       "--seq-len 16; pack the data into rows of 16 (nxdtrain data pack --seq-len 16), "
                                       "lower --seq-len, or pass --pad\n")
    assert not (tmp_path / "ck").exists()


def test_long_rows_cut_split_or_error(tmp_path):
    data = write_parts(tmp_path / "parts", [[list(range(10)), list(range(8))], [list(range(21))]])
    rows = open_rows(str(data), vocab=32, seq_len=8, seed=0)
    cut = check_rows(rows, seq_len=8, long_rows="cut")
    assert (cut.checked, cut.long_rows, cut.dropped_tokens, cut.rows.size) == (3, 2, 2 + 13, 3)
    assert cut.lines(8, "cut")[1] == ("2 rows longer than --seq-len 8 are cut to --seq-len (--long-rows cut): 15 tokens "
                                      "are never trained on; --long-rows split or error to change that")
    split = check_rows(rows, seq_len=8, long_rows="split")
    assert (split.rows.size, split.dropped_tokens) == (1 + 1 + 2, 2 + 5)
    assert [split.rows.row(i) for i in range(4)] == [list(range(8)), list(range(8)), list(range(8)),
                                                     list(range(8, 16))]
    with pytest.raises(TrainError, match=r"^.*/train-000.json.gz: row 0 has 10 tokens, more than --seq-len 8 "
                                         r"\(--long-rows error\); --long-rows cut or split to train on it$"):
        check_rows(rows, seq_len=8, long_rows="error")


def test_split_pieces_are_found_without_a_list_of_them(tmp_path):
    """--long-rows split over a datasets dir (lengths from its offsets): every piece is the slice a plain list
    of (row, start) pairs gives, and the plan holds 8 bytes per source row, not an entry per piece (measured
    before: about 250 bytes a row held, 380 at the peak, for 1M JSON rows; after: 8 and 16)."""
    import random
    import tracemalloc

    from nxdtrain.data.check import ListRows, SplitRows

    rng = random.Random(0)
    lengths = [rng.choice([3, 8, 9, 17, 40]) for _ in range(200)]
    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"input_ids": [list(range(100 * r, 100 * r + n)) for r, n in enumerate(lengths)]}
                               ).save_to_disk(str(path))
    plan = check_rows(open_rows(str(path), vocab=20_000, seq_len=8, seed=0), seq_len=8, long_rows="split", pad=True)
    pieces = [(r, k * 8) for r, n in enumerate(lengths) for k in range(max(n // 8, 1))]
    assert plan.rows.size == len(pieces) and plan.checked == 200
    for i, (r, start) in enumerate(pieces):
        assert plan.rows.row(i) == list(range(100 * r, 100 * r + lengths[r]))[start:start + 8]
        assert plan.rows.where(i) == (str(path), r)
    with pytest.raises(IndexError):
        plan.rows.row(len(pieces))

    many = [300 + (r * 7919) % 1000 for r in range(1_000_000)]  # 2.6M pieces of 256 tokens
    tracemalloc.start()
    split = SplitRows(ListRows("big", []), many, 256)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert split.size == sum(n // 256 for n in many)
    assert held < 9 * 2**20 and peak < 10 * 2**20, (held, peak)


def test_a_datasets_dir_is_checked_from_its_offsets(tmp_path):
    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"input_ids": [list(range(8))] * 5 + [list(range(3))]}).save_to_disk(str(path))
    with pytest.raises(TrainError, match=r"ds: row 5 has 3 tokens, fewer than --seq-len 8"):
        check_rows(open_rows(str(path), vocab=32, seq_len=8, seed=0), seq_len=8, long_rows="cut")


def test_a_large_file_is_sampled_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr("nxdtrain.data.check.PARSE_ALL", 10)
    monkeypatch.setattr("nxdtrain.data.check.SAMPLE", 4)
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [1] * 8}) + "\n" for _ in range(30)))
    plan = check_rows(open_rows(str(path), vocab=32, seq_len=8, seed=0), seq_len=8, long_rows="cut")
    assert plan.checked == 4 and plan.lines(8, "cut") == [
        f"data {path}: 30 rows, 4 of 30 rows (sampled) checked against --seq-len 8"]
    assert PARSE_ALL >= 10_000


def test_a_row_that_does_not_parse_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"input_ids": [1] * 8}) + "\n" + json.dumps({"input_ids": "hello world"}) + "\n")
    with pytest.raises(TrainError, match=r"bad.jsonl: row 1: input_ids is not a list of integer token ids"):
        check_rows(open_rows(str(path), vocab=32, seq_len=8, seed=0), seq_len=8, long_rows="cut")


def test_steps_prints_the_plan(tmp_path, capsys):
    data = write_parts(tmp_path / "parts", [[list(range(10))] * 4])
    assert main(["steps", "--data", str(data), "--gbs", "2", "--seq-len", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["rows_checked"], report["long_rows"], report["tokens_never_trained"]) == (4, 4, 8)
    assert main(["steps", "--data", str(data), "--gbs", "2", "--seq-len", "4", "--long-rows", "split", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 8  # 4 rows of 10 -> 2 rows of 4 each (2 tokens dropped)


def test_pad_keeps_short_rows_and_says_so(tmp_path):
    data = write_parts(tmp_path / "parts", [[list(range(8)), list(range(5))], [list(range(3)), list(range(12))]])
    rows = open_rows(str(data), vocab=32, seq_len=8, seed=0)
    plan = check_rows(rows, seq_len=8, long_rows="split", pad=True)
    assert (plan.short_rows, plan.pad_positions, plan.long_rows, plan.dropped_tokens) == (2, 3 + 5, 1, 4)
    assert plan.rows.size == 4  # 8 | 5 padded | 3 padded | 12 -> one row of 8 (4 dropped)
    assert "2 rows shorter than --seq-len 8 are padded (--pad): 8 positions hold no token and are not trained on" in (
        plan.lines(8, "split"))
    batches = Batches(plan.rows, seq_len=8, shuffle=False, seed=0, vocab=32, pad=True)
    assert batches.batch(consumed=1, count=2).tolist() == [[0, 1, 2, 3, 4, PAD, PAD, PAD],
                                                          [0, 1, 2, PAD, PAD, PAD, PAD, PAD]]


def test_padded_rows_train_on_their_real_tokens_only(tmp_path, nxd_model, hf_model):
    """The first loss with --pad equals transformers' cross-entropy over the real targets only (labels -100 after
    a row's last token), summed and divided by gbs x (seq_len - 1) as every nxdtrain loss is."""
    import torch
    from transformers import LlamaForCausalLM

    from tests.nxdtrain.harness import run_world, train_options

    rows = [list(range(3, 19)), list(range(40, 49)), list(range(60, 76)), list(range(90, 95))]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    log = run_world(1, resume=str(nxd_model("mha", tp=1, pp=1, attention="separate")), no_checkpoint=True,
                    log_jsonl=str(tmp_path / "log.jsonl"),
                    **train_options(data=str(path), pad=True, shuffle=False, gbs=4, seq_len=16, steps=1))
    ids = torch.tensor([r + [0] * (16 - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (16 - len(r)) for r in rows])
    model = LlamaForCausalLM.from_pretrained(hf_model("mha"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    summed = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                               ignore_index=-100, reduction="sum")
    assert abs(log[0]["loss"] - float(summed) / (4 * 15)) < 1e-5


def test_the_workers_use_the_launchers_check(tmp_path, nxd_model, monkeypatch):
    """--nproc's launcher checks the data (prepare) and hands what it found to its workers: their prepare reads
    the same rows (--long-rows split's pieces included) and says the same lines without checking again."""
    from nxdtrain.config.options import TrainConfig
    from nxdtrain.train import prepare
    from tests.nxdtrain.harness import read_log, train_options

    src = nxd_model("mha", tp=1, pp=1, attention="separate")
    data = write_parts(tmp_path / "parts", [[list(range(40)), list(range(16))], [list(range(37))] * 3])
    options = train_options(resume=str(src), data=str(data), long_rows="split", steps=2, gbs=2,
                            eval_every=1, eval_data=str(data), eval_batches=1, log_jsonl=str(tmp_path / "log.jsonl"))
    config = TrainConfig.from_flat({"no_checkpoint": True, **options})
    launcher = prepare(config, 2)
    assert launcher.rows.size == 2 + 1 + 3 * 2 and launcher.data_checks is not None

    def checked_again(*args, **kwargs):
        raise AssertionError("the data was checked again")

    with monkeypatch.context() as patch:
        patch.setattr("nxdtrain.data.check.check_rows", checked_again)
        worker = prepare(config, 2, launcher.data_checks)
    assert [worker.rows.row(i) for i in range(worker.rows.size)] == [
        launcher.rows.row(i) for i in range(launcher.rows.size)]
    assert worker.resume_notes == launcher.resume_notes
    assert any("--long-rows split: 5 rows became 9 rows of --seq-len 16" in n for n in worker.resume_notes)
    assert worker.eval_count == launcher.eval_count and worker.eval_rows.size == launcher.eval_rows.size
    argv = ["run", "--resume", str(src), "--nproc", "2", "--data", str(data), "--long-rows", "split", "--seq-len",
            "16", "--gbs", "2", "--steps", "2", "--precision", "fp32", "--no-checkpoint", "--log-jsonl",
            str(tmp_path / "run.jsonl")]
    assert main(argv) == 0  # the workers start from what the launcher passes them
    assert [r["step"] for r in read_log(tmp_path / "run.jsonl")] == [1, 2]
