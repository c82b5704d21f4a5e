"""Hugging Face checkpoints: a lazy reader over every layout HF uses, and the safetensors sink.

Reads (tensor by tensor, never the whole model):
  * a directory with ``model.safetensors.index.json`` (sharded) or ``model.safetensors``;
  * a directory with ``pytorch_model.bin.index.json`` or ``pytorch_model.bin`` (torch zip files);
  * a single state-dict file (``.safetensors``, ``.pt``, ``.bin``), as the official converter
    takes it, with ``config`` naming the HF ``config.json``.

Example:
    >>> ckpt = HfCheckpoint("llama-dir")                       # doctest: +SKIP
    >>> ckpt.read_rows(Source(None, "model.norm.weight"), 0, 4)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import torch

from ckptconv.core.families.moe import fused_views
from ckptconv.core.layout import MODEL_DIR
from ckptconv.core.model_spec import ModelSpec
from ckptconv.core.plan import OutFile, Source
from ckptconv.errors import ConversionError
from ckptconv.io.quantized import Dequantized, Quantized, plain_config, quantized_tensors
from ckptconv.io.readers import FileReader, open_tensor_file, try_read_columns

CONFIG = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
_WEIGHTS = (SAFETENSORS_INDEX, SAFETENSORS_SINGLE, BIN_INDEX, BIN_SINGLE)


def is_hf_dir(path: Path) -> bool:
    """An HF model folder: config.json beside its weights (or their index), and no NxD ``model/``."""
    return (path.is_dir() and (path / CONFIG).is_file() and not (path / MODEL_DIR).is_dir()
            and any((path / name).is_file() for name in _WEIGHTS))


# Small files a model directory carries besides weights; copied through conversions.
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


# Any one of these makes a directory loadable by AutoTokenizer (tokenizer_config.json alone does not).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(names: list[str]) -> bool:
    return any(name in TOKENIZER_FILES for name in names)


def tokenizer_side_files(directory: Path, flag: str = "--tokenizer") -> list[str]:
    """The side files (tokenizer, generation config) of ``directory``, which must hold a tokenizer."""
    if not directory.is_dir():
        raise ConversionError(f"{flag} {directory}: not a directory (pass the directory holding tokenizer.json)")
    names = [name for name in SIDE_FILES if (directory / name).is_file()]
    if not has_tokenizer(names):
        raise ConversionError(f"{flag} {directory}: holds none of {', '.join(TOKENIZER_FILES)}")
    return names


class HfCheckpoint:
    """An HF Llama checkpoint opened lazily; implements the executor's ``TensorReader``."""

    def __init__(self, path: str | Path, *, config: str | Path | None = None, io: str = "mmap") -> None:
        self.path = Path(path)
        self.io = io
        if not self.path.exists():
            raise ConversionError(f"{self.path}: no such file or directory")
        self.directory = self.path if self.path.is_dir() else self.path.parent
        config_path = Path(config) if config else self.directory / CONFIG
        if not config_path.is_file():
            raise ConversionError(
                f"{config_path}: HF config.json not found; pass --config PATH/config.json"
            )
        self.config_path = config_path
        self.spec = ModelSpec.from_file(config_path)
        self._readers: dict[Path, FileReader] = {}
        self._lock = threading.Lock()
        self._index_path: Path | None = None
        self._where = self._index()
        mtp = self.spec.check_counts(self._where, str(config_path))
        if mtp != self.spec.mtp_layers:  # the config's MTP layers are not in the weights (transformers drops them)
            self.spec = dataclasses.replace(self.spec, mtp_layers=mtp)
        # quantized weights (config.json's quantization_config) read as plain ones, dequantized band by band
        self.quantized = Dequantized(self._quantized(str(config_path)))
        # fused experts (transformers' in-memory names) read as the per-expert tensors every plan names
        self._views = fused_views(self.spec, set(self._where))
        self._fused = {view.key for view in self._views.values()}
        self._check_fused()

    def _check_fused(self) -> None:
        spec = self.spec
        want = {"gate_up_proj": (spec.experts, 2 * spec.expert_intermediate, spec.hidden),
                "down_proj": (spec.experts, spec.hidden, spec.expert_intermediate)}
        for key in self._fused:
            expected = want.get(key.rsplit(".", 1)[-1])
            shape = self.info(Source(None, key))[1]
            if expected is not None and tuple(shape) != expected:
                raise ConversionError(f"{self.path}: fused experts {key!r} have shape {list(shape)}, config.json "
                                      f"implies {list(expected)}")

    def _quantized(self, source: str) -> dict[str, Quantized]:
        if "quantization_config" not in self.spec.config:
            return {}
        stored = {key: self._raw_info(key)[:2] for key in self._where}
        return quantized_tensors(self.spec.config, stored, source)

    def dequantize_to(self, dtype: torch.dtype) -> None:
        """Read quantized weights as ``dtype`` (default bf16), dequantized straight into it."""
        self.quantized.dtype = dtype

    # -- discovery ------------------------------------------------------------------------

    def _index(self) -> dict[str, Path]:
        """Map every tensor key to the file holding it."""
        if self.path.is_file():
            return self._keys_of([self.path])
        for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
            index_path = self.path / index_name
            if index_path.is_file():
                return self._from_index(index_path)
        for single in (SAFETENSORS_SINGLE, BIN_SINGLE):
            if (self.path / single).is_file():
                return self._keys_of([self.path / single])
        raise ConversionError(
            f"{self.path}: no weights found; expected {SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE}, "
            f"{BIN_INDEX} or {BIN_SINGLE}"
        )

    def _from_index(self, index_path: Path) -> dict[str, Path]:
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            weight_map = None
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{index_path}: not an HF index (needs a 'weight_map' object)")
        where = {}
        for key, name in weight_map.items():
            if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
                raise ConversionError(f"{index_path}: weight_map[{key!r}] must be a file name inside "
                                      f"{self.path} (no directories, no '..'), got {name!r}")
            file = self.path / name
            if not file.is_file():
                raise ConversionError(f"{index_path}: {key!r} is in {name!r}, which does not exist")
            where[key] = file
        self._index_path = index_path
        return where

    def _keys_of(self, files: list[Path]) -> dict[str, Path]:
        where = {}
        for file in files:
            for key in self._reader(file).keys():
                where[key] = file
        return where

    def _reader(self, file: Path) -> FileReader:
        with self._lock:
            reader = self._readers.get(file)
            if reader is None:
                reader = self._readers[file] = open_tensor_file(file, io=self.io)
            return reader

    # -- TensorReader -----------------------------------------------------------------------

    def keys(self) -> list[str]:
        hidden = self._fused | self.quantized.hidden
        made = [key for key in self.quantized.tensors if key not in self._where]  # plain names no file stores
        return [key for key in self._where if key not in hidden] + made + list(self._views)

    def info(self, source: Source) -> tuple[torch.dtype, tuple[int, ...], bool]:
        view = self._views.get(source.key)
        if view is not None:
            dtype, shape, cm = self.info(Source(None, view.key))
            return (dtype, shape, cm) if view.expert is None else (dtype, (view.stop - view.start, shape[2]), False)
        if source.key in self.quantized:
            return self.quantized.info(source.key)
        return self._raw_info(source.key)

    def _raw_info(self, key: str) -> tuple[torch.dtype, tuple[int, ...], bool]:
        file = self._file(key)
        try:
            return self._reader(file).info(key)
        except KeyError:
            raise self._misplaced(key, file) from None

    def read_rows(self, source: Source, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        view = self._views.get(source.key)
        if view is not None:
            if view.expert is None:
                return self.read_rows(Source(None, view.key), start, stop, out)
            file = self._where.get(view.key)
            within = getattr(self._reader(file), "read_slab_rows", None) if file is not None else None
            if within is not None and view.key not in self.quantized:  # only the view's rows (into out: the budget)
                return within(view.key, view.expert, view.start + start, view.start + stop, out)
            rows = self.read_rows(Source(None, view.key), view.expert, view.expert + 1)[0]
            rows = rows[view.start + start:view.start + stop]
            return rows if out is None else out.copy_(rows)
        if source.key in self.quantized:
            return self.quantized.read_rows(self._raw_rows, source.key, start, stop, out)
        return self._raw_rows(source.key, start, stop, out)

    def read_columns(self, source: Source, start: int, stop: int, out: torch.Tensor) -> bool:
        """Columns ``[start, stop)`` of a stored matrix into ``out``, reading only them where the file's reader can
        (ckptconv.io.safetensors_io); False (nothing read) for views, quantized weights and other readers."""
        if source.key in self._views or source.key in self.quantized:
            return False
        return try_read_columns(self._reader(self._file(source.key)), source.key, start, stop, out)

    def _raw_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        file = self._file(key)
        try:
            return self._reader(file).read_rows(key, start, stop, out)
        except KeyError:
            raise self._misplaced(key, file) from None

    def _misplaced(self, key: str, file: Path) -> ConversionError:
        where = f"{self._index_path} says {key!r} is in {file.name}" if self._index_path else f"{key!r} should be in {file}"
        return ConversionError(f"{where}, but that file does not hold it")

    def _file(self, key: str) -> Path:
        try:
            return self._where[key]
        except KeyError:
            raise ConversionError(f"{self.path}: missing tensor {key!r}") from None

    def weight_files(self) -> list[Path]:
        """The files holding the tensors, sorted."""
        return sorted(set(self._where.values()))

    def dtypes(self) -> dict[str, torch.dtype]:
        return {key: self.info(Source(None, key))[0] for key in self.keys()}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: self.info(Source(None, key))[1] for key in self.keys()}

    def side_files(self) -> list[Path]:
        return [self.directory / name for name in SIDE_FILES if (self.directory / name).is_file()]

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self) -> HfCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def config_text(config: dict[str, Any], dtype: torch.dtype) -> str:
    """``config.json`` with the dtype actually written (both spellings: transformers 4 and 5), without a
    ``quantization_config``."""
    config = plain_config(config)  # the weights written are plain (an MXFP4/FP8 source dequantized)
    name = str(dtype).removeprefix("torch.")
    config["torch_dtype"] = name
    config["dtype"] = name
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def index_text(files: list[OutFile]) -> dict[str, str]:
    """``{SAFETENSORS_INDEX: text}`` when the weights span more than one file, else nothing."""
    if len(files) < 2:
        return {}
    weight_map = {t.key: f.path for f in files for t in f.tensors}
    index = {
        "metadata": {"total_size": sum(f.nbytes for f in files)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    return {SAFETENSORS_INDEX: json.dumps(index, indent=2) + "\n"}
