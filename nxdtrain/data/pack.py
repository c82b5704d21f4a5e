"""``nxdtrain data pack``: raw text -> the model's tokens -> rows of exactly ``seq_len`` -> ``save_to_disk``.

Every document is encoded with the tokenizer's own special-token rule (its post-processor: a
Llama tokenizer adds BOS, the bundled byte tokenizer adds nothing) and followed by EOS unless the
tokenizer already ended it with EOS. The documents' tokens, in input order, form one stream that is
cut into rows of ``seq_len``: a long document continues in the next row, short ones share a row.
The last partial row is dropped, or with ``pad=True`` filled up with the pad token (EOS when the
tokenizer has none). The same inputs give the same rows whatever the number of workers.

    >>> summary = pack(["corpus.txt"], "packed", tokenizer="llama-hf", seq_len=2048)   # doctest: +SKIP
    >>> summary.rows, summary.dropped_tokens                                           # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nxdtrain.config.extras import require
from nxdtrain.data.rows import load_column
from nxdtrain.errors import TrainError

TEXT_SUFFIXES = (".txt", ".txt.gz")
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
TXT_DOCS = ("file", "paragraph", "line")
CHUNK_DOCS = 64  # documents per tokenization task: small enough to spread, large enough to amortize
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class PackSummary:
    out: str
    documents: int
    tokens: int            # every token of every document, BOS/EOS included
    rows: int
    seq_len: int
    dropped_tokens: int    # tail tokens of the last partial row (0 with pad)
    pad_tokens: int        # padding added to the last row (0 without pad)
    bos_id: int | None     # what the tokenizer puts in front of a document, if anything
    eos_id: int
    workers: int


# --------------------------------------------------------------------------------------------
# tokenizer


@dataclass(frozen=True)
class LoadedTokenizer:
    backend_json: str      # the ``tokenizers`` serialization: what workers rebuild
    eos_id: int
    pad_id: int
    bos_id: int | None
    name: str


def tokenizer_dir(path: Path) -> Path:
    """The directory holding the tokenizer: an HF model dir, or a converted dir's ``hf/`` side files."""
    from ckptconv.core import HF_FILES_DIR

    side = path / HF_FILES_DIR
    if not any((path / f).exists() for f in TOKENIZER_FILES) and side.is_dir():
        return side
    return path


def load_tokenizer(spec: str | Path, *, eos_id: int | None = None) -> LoadedTokenizer:
    """The tokenizer of an HF model dir, a converted dir (its ``hf/``), or a ``tokenizer.json`` file."""
    from tokenizers import Tokenizer

    path = Path(spec)
    if not path.exists():
        raise TrainError(f"--tokenizer {spec}: no such file or directory")
    eos = pad = None
    # a bare tokenizer file; a tokenizer.json beside its tokenizer_config.json loads with that config (BOS/EOS names)
    if path.is_file() and not (path.name == "tokenizer.json" and (path.parent / "tokenizer_config.json").exists()):
        try:
            backend = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
            raise TrainError(f"--tokenizer {spec}: not a tokenizers JSON file ({exc})") from None
    else:
        AutoTokenizer = require("transformers", f"--tokenizer {spec} (a tokenizer directory)").AutoTokenizer

        directory = path.parent if path.is_file() else tokenizer_dir(path)
        if not any((directory / f).exists() for f in TOKENIZER_FILES):
            raise TrainError(f"--tokenizer {spec}: no {' or '.join(TOKENIZER_FILES)} in {directory}")
        try:
            auto = AutoTokenizer.from_pretrained(str(directory))
        except (OSError, ValueError) as exc:
            raise TrainError(f"--tokenizer {spec}: no tokenizer found in {directory} ({str(exc).splitlines()[0]})") \
                from None
        if not getattr(auto, "is_fast", False):
            raise TrainError(f"--tokenizer {spec}: a slow (Python) tokenizer; a tokenizer.json is needed")
        backend, eos, pad = auto.backend_tokenizer, auto.eos_token_id, auto.pad_token_id
    eos = eos_id if eos_id is not None else eos
    if eos is None:
        raise TrainError(f"--tokenizer {spec}: the tokenizer names no EOS token; pass --eos-id N")
    plain, special = backend.encode("x", add_special_tokens=False).ids, backend.encode("x").ids
    bos = special[0] if len(special) > len(plain) and special[1:len(plain) + 1] == plain else None
    return LoadedTokenizer(backend.to_str(), int(eos), int(pad if pad is not None else eos), bos, str(spec))


_WORKER_TOKENIZER: Any = None


def _init_worker(backend_json: str, single_thread: bool = False) -> None:
    global _WORKER_TOKENIZER
    from tokenizers import Tokenizer

    if single_thread:  # N worker processes x 1 thread, not N x (all cores) Rust threads
        os.environ["TOKENIZERS_PARALLELISM"] = "false"

    _WORKER_TOKENIZER = Tokenizer.from_str(backend_json)


def _encode_chunk(texts: list[str]) -> list[list[int]]:
    """Token ids of each text, with the tokenizer's special tokens (its post-processor)."""
    return [e.ids for e in _WORKER_TOKENIZER.encode_batch(texts, add_special_tokens=True)]


# --------------------------------------------------------------------------------------------
# documents


def _text_docs(path: Path, how: str) -> Iterator[str]:
    import gzip

    opener: Callable[..., Any] = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        if how == "file":
            yield f.read()
            return
        if how == "line":
            yield from (line.rstrip("\n") for line in f if line.strip())
            return
        paragraph: list[str] = []
        for line in f:
            if line.strip():
                paragraph.append(line)
            elif paragraph:
                yield "".join(paragraph).rstrip("\n")
                paragraph = []
        if paragraph:
            yield "".join(paragraph).rstrip("\n")


def _json_docs(path: Path, field: str) -> Iterator[str]:
    from nxdtrain.data.rows import JsonRows

    rows = JsonRows(path, column=field)
    for index in range(rows.size):
        text = rows.row(index)
        if not isinstance(text, str):
            raise TrainError(f"{path}: row {index} field {field!r} is {type(text).__name__}, expected text")
        yield text


def _parquet_docs(path: Path, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if field not in parquet.schema_arrow.names:
        raise TrainError(f"{path}: no column {field!r} (columns: {', '.join(parquet.schema_arrow.names)})")
    for batch in parquet.iter_batches(columns=[field], batch_size=1024):
        yield from batch.column(0).to_pylist()


def _dataset_docs(path: Path, field: str) -> Iterator[str]:
    for batch in load_column(path, field).iter(batch_size=1024):
        yield from batch[field]


def input_files(inputs: Iterable[str | Path]) -> list[Path]:
    """Each INPUT as given; a directory that is not a datasets dir stands for its text files, sorted."""
    from nxdtrain.data.rows import DATASET_MARKERS

    suffixes = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES
    out: list[Path] = []
    for spec in inputs:
        path = Path(spec)
        if not path.exists():
            raise TrainError(f"{spec}: no such file or directory")
        if path.is_dir() and not any((path / m).exists() for m in DATASET_MARKERS):
            files = sorted((p for p in path.iterdir() if p.is_file() and p.name.endswith(suffixes)), key=str)
            if not files:
                raise TrainError(f"{spec}: a directory with no {', '.join(suffixes)} files and no datasets dir")
            out.extend(files)
        elif path.is_file() and not path.name.endswith(suffixes):
            raise TrainError(f"{spec}: expected {', '.join(suffixes)}, or a datasets save_to_disk directory")
        else:
            out.append(path)
    return out


def documents(inputs: Iterable[str | Path], *, text_field: str = "text", txt_docs: str = "file") -> Iterator[str]:
    """Every document of every input, in order."""
    for path in input_files(inputs):
        if path.is_dir():
            yield from _dataset_docs(path, text_field)
        elif path.name.endswith(TEXT_SUFFIXES):
            yield from _text_docs(path, txt_docs)
        elif path.name.endswith(PARQUET_SUFFIXES):
            yield from _parquet_docs(path, text_field)
        else:
            yield from _json_docs(path, text_field)


def _chunks(docs: Iterator[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# --------------------------------------------------------------------------------------------
# packing


class Packer:
    """Cuts one token stream into rows of ``seq_len``; documents are fed in order."""

    def __init__(self, seq_len: int, eos_id: int) -> None:
        self.seq_len, self.eos_id = seq_len, eos_id
        self.buffer: list[int] = []
        self.documents = self.tokens = 0

    def add(self, ids: list[int]) -> list[list[int]]:
        """Append one document (its EOS added unless the tokenizer ended it with EOS); return full rows."""
        if not ids or ids[-1] != self.eos_id:
            ids = [*ids, self.eos_id]
        self.documents += 1
        self.tokens += len(ids)
        self.buffer.extend(ids)
        full = len(self.buffer) // self.seq_len * self.seq_len
        rows = [self.buffer[i:i + self.seq_len] for i in range(0, full, self.seq_len)]
        del self.buffer[:full]
        return rows

    def finish(self, pad_id: int | None) -> tuple[list[list[int]], int, int]:
        """(last rows, tokens dropped, pad tokens added): the partial tail dropped, or padded with ``pad_id``."""
        tail, self.buffer = self.buffer, []
        if not tail:
            return [], 0, 0
        if pad_id is None:
            return [], len(tail), 0
        pad = self.seq_len - len(tail)
        return [tail + [pad_id] * pad], 0, pad


def _ordered_map(pool: Any, chunks: Iterator[list[str]], *, ahead: int) -> Iterator[list[list[int]]]:
    """Results in input order (deterministic rows), with at most ``ahead`` chunks read but not yet packed.

    ``Executor.map`` would read the whole input ahead of the workers; this keeps memory bounded.
    """
    from collections import deque
    from concurrent.futures.process import BrokenProcessPool

    pending: deque[Any] = deque()
    try:
        for chunk in chunks:
            pending.append(pool.submit(_encode_chunk, chunk))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise TrainError("a tokenizing worker process died (out of memory?); rerun with fewer --workers") from None


def pack_rows(inputs: Iterable[str | Path], tokenizer: LoadedTokenizer, *, seq_len: int, pad: bool = False,
              workers: int = 1, text_field: str = "text", txt_docs: str = "file",
              on_document: Callable[[int], None] | None = None) -> Iterator[list[int] | tuple[int, int, int, int]]:
    """Yield the packed rows in order, then one ``(documents, tokens, dropped, padded)`` tuple."""
    packer = Packer(seq_len, tokenizer.eos_id)
    chunks = _chunks(documents(inputs, text_field=text_field, txt_docs=txt_docs), CHUNK_DOCS)
    pool = None
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # fork (as datasets.map(num_proc=...) does): no re-import of the caller's __main__; the parent has not
        # used the tokenizer's thread pool (encode_batch) before forking, so the workers' pools start clean.
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_init_worker,
                                   initargs=(tokenizer.backend_json, True))
        encoded: Iterator[list[list[int]]] = _ordered_map(pool, chunks, ahead=4 * workers)
    else:
        _init_worker(tokenizer.backend_json)
        encoded = map(_encode_chunk, chunks)
    try:
        for chunk in encoded:
            for ids in chunk:
                yield from packer.add(ids)
            if on_document is not None:
                on_document(len(chunk))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    rows, dropped, padded = packer.finish(tokenizer.pad_id if pad else None)
    yield from rows
    yield packer.documents, packer.tokens, dropped, padded


def _write_arrow(rows: Iterator[Any], path: Path) -> tuple[int, Any]:
    """Write rows into one Arrow file as they come; return (row count, the trailing stats tuple)."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
    count, batch, stats = 0, [], None
    with ArrowWriter(features=features, path=str(path)) as writer:
        for item in rows:
            if isinstance(item, tuple):
                stats = item
                break
            batch.append(item)
            if len(batch) == 1024:
                writer.write_batch({"input_ids": batch})
                count, batch = count + len(batch), []
        if batch:
            writer.write_batch({"input_ids": batch})
            count += len(batch)
        writer.finalize()
    return count, stats


def pack(inputs: Iterable[str | Path], out: str | Path, *, tokenizer: str | Path, seq_len: int, pad: bool = False,
         workers: int = 1, text_field: str = "text", txt_docs: str = "file", eos_id: int | None = None,
         progress: bool = False) -> PackSummary:
    """Pack ``inputs`` into ``out`` (a ``save_to_disk`` directory with an ``input_ids`` column)."""
    datasets = require("datasets", "nxdtrain pack (writes a save_to_disk dataset)")

    if seq_len < 2:
        raise TrainError(f"--seq-len must be an integer >= 2, got {seq_len}")
    if workers < 1:
        raise TrainError(f"--workers must be >= 1, got {workers}")
    if txt_docs not in TXT_DOCS:
        raise TrainError(f"--txt-docs must be one of {', '.join(TXT_DOCS)}, got {txt_docs!r}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TrainError(f"{out}: exists and is not empty; pack writes only into a new or empty directory")
    inputs = input_files(inputs)  # every input checked before the tokenizer loads
    loaded = load_tokenizer(tokenizer, eos_id=eos_id)
    tmp = out.parent / f".{out.name}.packing-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        with _progress(progress) as advance:
            rows = pack_rows(inputs, loaded, seq_len=seq_len, pad=pad, workers=workers, text_field=text_field,
                             txt_docs=txt_docs, on_document=advance)
            count, stats = _write_arrow(rows, tmp / "rows.arrow")
        documents_, tokens, dropped, padded = stats
        if count == 0:
            raise TrainError(f"the inputs hold {tokens} tokens, less than one row of --seq-len {seq_len}; "
                             "pass --pad or a smaller --seq-len")
        quiet = not datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # our own progress and summary say it
        try:
            datasets.Dataset.from_file(str(tmp / "rows.arrow")).save_to_disk(str(tmp / "out"))
        finally:
            if not quiet:
                datasets.enable_progress_bars()
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp / "out", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PackSummary(str(out), documents_, tokens, count, seq_len, dropped, padded, loaded.bos_id, loaded.eos_id,
                       workers)


class _progress:
    """A rich documents counter on stderr (a no-op when off or not a terminal)."""

    def __init__(self, enabled: bool) -> None:
        import sys

        self.enabled = enabled and sys.stderr.isatty()
        self.bar: Any = None

    def __enter__(self) -> Callable[[int], None]:
        if not self.enabled:
            return lambda n: None
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.bar = Progress(SpinnerColumn(), TextColumn("packing: {task.completed:,} documents"), TimeElapsedColumn(),
                            console=Console(stderr=True))
        task = self.bar.add_task("pack", total=None)
        self.bar.start()
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def summary_lines(summary: PackSummary, *, pad: bool) -> list[str]:
    """The human summary of a pack run."""
    tail = (f"last partial row padded with {summary.pad_tokens} pad tokens" if pad
            else f"last partial row dropped ({summary.dropped_tokens} tokens)")
    bos = f"BOS {summary.bos_id} before each document" if summary.bos_id is not None else "no BOS (tokenizer's rule)"
    return [f"packed {summary.documents:,} documents, {summary.tokens:,} tokens -> {summary.rows:,} rows of "
            f"{summary.seq_len} in {summary.out}",
            f"{bos}; EOS {summary.eos_id} after each document; {tail}"]


def summary_json(summary: PackSummary) -> str:
    return json.dumps(asdict(summary))
