"""``nxdtrain data pack``: exact rows from the bundled byte tokenizer (token id = byte), the BOS/EOS rules of
real tokenizers, determinism across workers, the inputs it reads, its refusals, and training from its output."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from nxdtrain.cli import main
from nxdtrain.data.pack import pack
from nxdtrain.errors import TrainError
from tests.nxdtrain.harness import run_world, train_options

CORPUS = Path(__file__).resolve().parents[3] / "fixtures" / "corpus"
TOKENIZER = CORPUS / "tokenizer.json"
EOS = 0  # NUL: a byte the texts never contain
B = lambda text: list(text.encode())  # noqa: E731  (the bundled tokenizer's ids are the UTF-8 bytes)


def packed_rows(path: Path) -> list[list[int]]:
    import datasets

    data = datasets.load_from_disk(str(path))
    assert data.column_names == ["input_ids"]
    return list(data["input_ids"])


@pytest.fixture()
def docs(tmp_path) -> Path:
    """Four documents: one longer than a row, three short ones."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(["abcdefghijk", "xy", "pq",
                                                                                          "rst"])))
    return path


def test_exact_rows_split_join_and_dropped_tail(tmp_path, docs, capsys):
    assert main(["data", "pack", str(docs), str(tmp_path / "out"), "--tokenizer", str(TOKENIZER), "--seq-len", "8",
                 "--eos-id", str(EOS), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    # stream: abcdefghijk E xy E pq E rst E (22 tokens); rows of 8; the last 6 tokens (q E r s t E) dropped
    assert packed_rows(tmp_path / "out") == [B("abcdefgh"), B("ijk") + [EOS] + B("xy") + [EOS] + B("p")]
    assert {k: summary[k] for k in ("documents", "tokens", "rows", "dropped_tokens", "pad_tokens", "bos_id",
                                    "eos_id")} == {"documents": 4, "tokens": 22, "rows": 2, "dropped_tokens": 6,
                                                   "pad_tokens": 0, "bos_id": None, "eos_id": EOS}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "out"]  # no temporary left behind

    assert main(["data", "pack", str(docs), str(tmp_path / "padded"), "--tokenizer", str(TOKENIZER), "--seq-len", "8",
                 "--eos-id", str(EOS), "--pad"]) == 0
    assert "last partial row padded with 2 pad tokens" in capsys.readouterr().out
    assert packed_rows(tmp_path / "padded")[2] == B("q") + [EOS] + B("rst") + [EOS, EOS, EOS]  # pad: EOS (no pad)


def test_bos_and_eos_follow_the_tokenizer(tmp_path, docs):
    """A Llama-style tokenizer (BOS from its post-processor, EOS from its config) in a converted dir's hf/."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    tokenizer.add_special_tokens(["<s>", "</s>"])  # ids 256, 257
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    side = tmp_path / "converted" / "hf"
    side.mkdir(parents=True)
    tokenizer.save(str(side / "tokenizer.json"))
    (side / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    summary = pack([docs], tmp_path / "out", tokenizer=tmp_path / "converted", seq_len=8)
    bos, eos = 256, 257
    # stream: <s> abcdefghijk </s> <s> xy </s> <s> pq </s> <s> rst </s> (26 tokens; "t </s>" dropped)
    assert packed_rows(tmp_path / "out") == [[bos] + B("abcdefg"), B("hijk") + [eos, bos] + B("xy"),
                                             [eos, bos] + B("pq") + [eos, bos] + B("rs")]
    assert (summary.bos_id, summary.eos_id, summary.tokens, summary.dropped_tokens) == (bos, eos, 26, 2)

    # A tokenizer that ends documents with EOS itself (TemplateProcessing "$A </s>") gets no second EOS.
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", eos)])
    tokenizer.save(str(tmp_path / "eos-tokenizer.json"))
    pack([docs], tmp_path / "out2", tokenizer=tmp_path / "eos-tokenizer.json", seq_len=8, eos_id=eos)
    assert packed_rows(tmp_path / "out2") == [B("abcdefgh"), B("ijk") + [eos] + B("xy") + [eos] + B("p")]


def test_workers_give_the_same_rows_and_every_input_format(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document {i}: " + "lorem ipsum " * (i % 7) for i in range(300)]  # > CHUNK_DOCS: several tasks
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n"
                                                                for t in texts[:100]).encode()))
    (tmp_path / "b.json").write_text(json.dumps([{"text": t} for t in texts[100:150]], indent=1))
    pq.write_table(pa.table({"text": texts[150:200]}), tmp_path / "c.parquet")
    datasets.Dataset.from_dict({"text": texts[200:299]}).save_to_disk(str(tmp_path / "d"))
    (tmp_path / "e.txt").write_text(texts[299])
    inputs = [tmp_path / n for n in ("a.jsonl.gz", "b.json", "c.parquet", "d", "e.txt")]
    stream = [t for text in texts for t in B(text) + [EOS]]
    expected = [stream[i:i + 16] for i in range(0, len(stream) - 15, 16)]
    one = pack(inputs, tmp_path / "w1", tokenizer=TOKENIZER, seq_len=16, eos_id=EOS, workers=1)
    two = pack(inputs, tmp_path / "w2", tokenizer=TOKENIZER, seq_len=16, eos_id=EOS, workers=2)
    assert packed_rows(tmp_path / "w1") == packed_rows(tmp_path / "w2") == expected
    assert (one.documents, one.tokens, one.rows, one.dropped_tokens) == (300, len(stream), len(expected),
                                                                         len(stream) % 16)
    assert (two.documents, two.rows) == (one.documents, one.rows)


def test_txt_documents_and_refusals(tmp_path):
    (tmp_path / "t.txt").write_text("one\ntwo\n\nthree\n")
    for how, docs in (("file", ["one\ntwo\n\nthree\n"]), ("paragraph", ["one\ntwo", "three"]),
                      ("line", ["one", "two", "three"])):
        pack([tmp_path / "t.txt"], tmp_path / how, tokenizer=TOKENIZER, seq_len=2, eos_id=EOS, txt_docs=how, pad=True)
        stream = [t for d in docs for t in B(d) + [EOS]]
        stream += [EOS] * (-len(stream) % 2)
        assert packed_rows(tmp_path / how) == [stream[i:i + 2] for i in range(0, len(stream), 2)], how

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(TrainError, match="full: exists and is not empty; pack writes only into a new or empty"):
        pack([tmp_path / "t.txt"], tmp_path / "full", tokenizer=TOKENIZER, seq_len=4, eos_id=EOS)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    with pytest.raises(TrainError, match="the inputs hold 16 tokens, less than one row of --seq-len 32; pass --pad"):
        pack([tmp_path / "t.txt"], tmp_path / "short", tokenizer=TOKENIZER, seq_len=32, eos_id=EOS)
    assert not (tmp_path / "short").exists()
    with pytest.raises(TrainError, match=f"--tokenizer {tmp_path}: no tokenizer.json or tokenizer_config.json in "):
        pack([tmp_path / "t.txt"], tmp_path / "x", tokenizer=tmp_path, seq_len=4, eos_id=EOS)
    with pytest.raises(TrainError, match="tokenizer.json: the tokenizer names no EOS token; pass --eos-id N"):
        pack([tmp_path / "t.txt"], tmp_path / "x", tokenizer=TOKENIZER, seq_len=4)
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(TrainError, match="bad.jsonl: row 0 is not a JSON object with 'text'"):
        pack([tmp_path / "bad.jsonl"], tmp_path / "y", tokenizer=TOKENIZER, seq_len=4, eos_id=EOS)
    assert not (tmp_path / "y").exists() and not list(tmp_path.glob(".y.packing-*"))
    with pytest.raises(TrainError, match="rows.csv: expected .txt, .txt.gz, .jsonl"):
        (tmp_path / "rows.csv").write_text("a,b\n")
        pack([tmp_path / "rows.csv"], tmp_path / "z", tokenizer=TOKENIZER, seq_len=4, eos_id=EOS)


def test_train_two_steps_from_the_packed_directory(tmp_path, nxd_model, reference):
    text = (CORPUS / "corpus.txt").read_text()
    shutil.copy(CORPUS / "corpus.txt", tmp_path / "corpus.txt")
    summary = pack([tmp_path / "corpus.txt"], tmp_path / "packed", tokenizer=TOKENIZER, seq_len=16, eos_id=EOS,
                   txt_docs="paragraph")
    assert max(text.encode()) < 128  # the tiny models' vocabulary
    assert summary.rows >= 8
    options = train_options(data=str(tmp_path / "packed"), seq_len=16, gbs=4, steps=2, shuffle=False)
    log = run_world(1, resume=str(nxd_model("mha", tp=1, pp=1)), log_jsonl=str(tmp_path / "log.jsonl"),
                    checkpoint_dir=str(tmp_path / "ckpt"), **options)
    ref_losses, _ = reference("mha", **options)
    assert [(r["step"], r["consumed_samples"]) for r in log] == [(1, 4), (2, 8)]
    assert max(abs(r["loss"] - ref) for r, ref in zip(log, ref_losses, strict=True)) <= 1e-5


def test_a_failing_worker_is_an_error_not_a_hang(docs):
    from nxdtrain.data.pack import LoadedTokenizer, pack_rows

    broken = LoadedTokenizer(backend_json="not a tokenizer", eos_id=EOS, pad_id=EOS, bos_id=None, name="broken")
    with pytest.raises(TrainError, match="a tokenizing worker process died"):
        list(pack_rows([docs], broken, seq_len=4, workers=2))
