"""Row sources and the order of samples: file order, seeded shuffles per epoch, resume offsets, dp slices."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from nxdtrain.data.rows import Batches, open_rows
from nxdtrain.errors import TrainError

ROWS = [[10 * r + t for t in range(6)] for r in range(10)]  # row r: r0 r1 .. r5, all distinct


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("data")
    lines = "".join(json.dumps({"input_ids": row, "text": "ignored"}) + "\n" for row in ROWS)
    (root / "rows.jsonl").write_text(lines + "\n")  # a trailing blank line is not a row
    with gzip.open(root / "rows.jsonl.gz", "wt") as f:
        f.write(lines)
    datasets.Dataset.from_dict({"input_ids": ROWS}).save_to_disk(str(root / "arrow"))
    return {name: str(root / name) for name in ("rows.jsonl", "rows.jsonl.gz", "arrow")}


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz", "arrow"])
def test_file_order_and_seq_len(sources, name):
    batches = Batches(open_rows(sources[name], vocab=100, seq_len=4, seed=0), seq_len=4, shuffle=False, seed=0)
    assert batches.source.size == 10
    # Global batch s of gbs 3 is samples [3s, 3s+3): rows 3..5, cut to 4 tokens; sample 10 wraps to row 0.
    assert batches.batch(consumed=3, count=3).tolist() == [row[:4] for row in ROWS[3:6]]
    assert batches.batch(consumed=9, count=2).tolist() == [ROWS[9][:4], ROWS[0][:4]]


def test_shuffle_is_a_seeded_permutation_per_epoch(sources):
    def order(seed: int, epochs: int = 2) -> list[int]:
        batches = Batches(open_rows(sources["rows.jsonl"], vocab=100, seq_len=6, seed=seed), seq_len=6, shuffle=True,
                          seed=seed)
        return [row[0] // 10 for row in batches.batch(consumed=0, count=10 * epochs).tolist()]

    first = order(1)
    assert sorted(first[:10]) == sorted(first[10:]) == list(range(10))
    assert first[:10] != first[10:] and first[:10] != list(range(10))
    assert order(1) == first and order(2) != first


def test_resume_continues_at_consumed_samples(sources):
    make = lambda: Batches(open_rows(sources["arrow"], vocab=100, seq_len=6, seed=3), seq_len=6, shuffle=True, seed=3)  # noqa: E731
    whole = make().batch(consumed=0, count=16)
    assert torch.equal(make().batch(consumed=8, count=8), whole[8:])  # a fresh reader, as after a restart
    # dp rank d takes the d-th quarter of a global batch of 8.
    parts = [make().dp_slice(consumed=8, gbs=8, dp_rank=d, dp=4) for d in range(4)]
    assert torch.equal(torch.cat(parts), whole[8:])


def test_synthetic_rows_depend_on_seed_and_index_only():
    rows = Batches(open_rows("synthetic", vocab=50, seq_len=8, seed=5), seq_len=8, shuffle=True, seed=5)
    again = Batches(open_rows("synthetic", vocab=50, seq_len=8, seed=5), seq_len=8, shuffle=False, seed=0)
    assert torch.equal(rows.batch(consumed=4, count=3), again.batch(consumed=0, count=7)[4:])
    assert int(rows.batch(consumed=0, count=64).max()) < 50


def test_errors(sources, tmp_path):
    short = Batches(open_rows(sources["rows.jsonl"], vocab=100, seq_len=7, seed=0), seq_len=7, shuffle=False, seed=0)
    with pytest.raises(TrainError, match=r"rows.jsonl: row 2 has 6 tokens; --seq-len 7 needs at least that many"):
        short.batch(consumed=2, count=1)
    small_vocab = Batches(open_rows(sources["rows.jsonl"], vocab=50, seq_len=6, seed=0), seq_len=6, shuffle=False,
                          seed=0, vocab=50)
    with pytest.raises(TrainError, match=r"token id 95 is outside the model's vocabulary \[0, 50\)"):
        small_vocab.batch(consumed=9, count=1)
    with pytest.raises(TrainError, match="--data /nope.jsonl: no such file or directory"):
        open_rows("/nope.jsonl", vocab=10, seq_len=4, seed=0)
    (tmp_path / "rows.txt").write_text("1 2 3\n")
    with pytest.raises(TrainError, match=r"rows.txt: expected a datasets save_to_disk dir, a .jsonl/.json\(.gz\) file, "
                                         "a directory or glob of those, or 'synthetic'"):
        open_rows(str(tmp_path / "rows.txt"), vocab=10, seq_len=4, seed=0)
    (tmp_path / "bad.jsonl").write_text('{"ids": [1, 2]}\n')
    with pytest.raises(TrainError, match="bad.jsonl: row 0 is not a JSON object with 'input_ids'"):
        open_rows(str(tmp_path / "bad.jsonl"), vocab=10, seq_len=2, seed=0).row(0)


@pytest.fixture(scope="module")
def sagemaker(tmp_path_factory):
    """The rows of ROWS as SageMaker model-parallel files: a JSON list, gzipped lines, a directory of .json.gz."""
    root = tmp_path_factory.mktemp("sagemaker")
    objects = [{"input_ids": row, "attention_mask": [1] * len(row), "text": 'a "}{][" b'} for row in ROWS]
    (root / "list.json").write_text(json.dumps(objects, indent=2))
    (root / "lines.json.gz").write_bytes(gzip.compress("".join(json.dumps(o) + "\n" for o in objects).encode()))
    parts = root / "parts"
    parts.mkdir()
    # written in another order than their names: reading follows the sorted names
    for name, chunk in (("part-2.json.gz", objects[7:]), ("part-0.json.gz", objects[:4]),
                        ("part-1.json", objects[4:7])):
        text = json.dumps(chunk) if name.endswith(".json") else "".join(json.dumps(o) + "\n" for o in chunk)
        (parts / name).write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    (parts / "README.md").write_text("not data")
    return root


@pytest.mark.parametrize("name", ["list.json", "lines.json.gz", "parts", "parts/part-*"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_sagemaker_files_read_like_jsonl(sources, sagemaker, name, shuffle):
    def make(spec):
        return Batches(open_rows(spec, vocab=100, seq_len=6, seed=4), seq_len=6, shuffle=shuffle, seed=4, gbs=3)

    jsonl = make(sources["rows.jsonl"]).batch(consumed=0, count=27)
    other = make(str(sagemaker / name))
    assert other.source.size == 10
    assert torch.equal(other.batch(consumed=0, count=27), jsonl)
    assert torch.equal(make(str(sagemaker / name)).batch(consumed=12, count=6), jsonl[12:18])  # resumed at 12
    if not shuffle:
        assert other.batch(consumed=0, count=10).tolist()[:9] == ROWS[:9]


def test_an_epoch_is_whole_global_batches(sources):
    """10 rows, gbs 4: an epoch is 8 samples (rows 8 and 9 unused); epoch 2 starts again at row 0."""
    batches = Batches(open_rows(sources["rows.jsonl"], vocab=100, seq_len=6, seed=0), seq_len=6, shuffle=False,
                      seed=0, gbs=4)
    assert batches.batch(consumed=4, count=8).tolist() == ROWS[4:8] + ROWS[0:4]
    shuffled = Batches(open_rows(sources["rows.jsonl"], vocab=100, seq_len=6, seed=2), seq_len=6, shuffle=True,
                       seed=2, gbs=4)
    epochs = [[r[0] // 10 for r in shuffled.batch(consumed=8 * e, count=8).tolist()] for e in range(3)]
    assert all(len(set(e)) == 8 for e in epochs) and len({tuple(e) for e in epochs}) == 3  # 8 distinct rows each


def test_json_errors(tmp_path):
    (tmp_path / "cut.json").write_text('[{"input_ids": [1, 2]}, {"input_ids": [3')
    with pytest.raises(TrainError, match="cut.json: a JSON list that does not end"):
        open_rows(str(tmp_path / "cut.json"), vocab=10, seq_len=2, seed=0)
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    with pytest.raises(TrainError, match="bad.json.gz: not a readable gzip file"):
        open_rows(str(tmp_path / "bad.json.gz"), vocab=10, seq_len=2, seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainError, match="empty: the directory holds no .jsonl/.json\\(.gz\\) files and is not a "
                                         "datasets save_to_disk directory"):
        open_rows(str(tmp_path / "empty"), vocab=10, seq_len=2, seed=0)
    with pytest.raises(TrainError, match="the glob matches no"):
        open_rows(str(tmp_path / "*.jsonl"), vocab=10, seq_len=2, seed=0)
