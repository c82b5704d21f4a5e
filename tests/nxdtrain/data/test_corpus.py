"""The bundled corpus: the tokenizer is byte-level and the committed files rebuild byte for byte."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[3] / "fixtures" / "corpus"


def test_rebuild_is_reproducible_and_byte_level(tmp_path):
    build = runpy.run_path(str(CORPUS / "build.py"))
    tokenizer_path, rows_path = build["build"](tmp_path)
    assert tokenizer_path.read_bytes() == (CORPUS / "tokenizer.json").read_bytes()
    assert rows_path.read_bytes() == (CORPUS / "train.jsonl").read_bytes()
    text = (CORPUS / "corpus.txt").read_text(encoding="utf-8")
    rows = [json.loads(line)["input_ids"] for line in rows_path.read_text().splitlines()]
    assert {len(r) for r in rows} == {build["SEQ_LEN"]} and len(rows) == len(text.encode()) // build["SEQ_LEN"]
    assert sum(rows, []) == list(text.encode("utf-8"))[: len(rows) * build["SEQ_LEN"]]
    tokenizer = build["build_tokenizer"]()
    sample = "Tide, four point two. Ça va\n"
    assert tokenizer.encode(sample).ids == list(sample.encode("utf-8"))
    assert tokenizer.decode(list(sample.encode("utf-8"))) == sample
