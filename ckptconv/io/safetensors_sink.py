"""The executor's sink for HF safetensors output files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ckptconv.core.plan import OutFile
from ckptconv.io.safetensors_io import SafetensorsWriter, plan_safetensors

HF_METADATA = {"format": "pt"}


class SafetensorsSink:
    def __init__(self, out_file: OutFile, tmp: Path) -> None:
        self.path = tmp / out_file.path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if any(t.column_major for t in out_file.tensors):
            raise AssertionError(f"{out_file.path}: safetensors stores row-major tensors only")
        entries = {t.key: (t.dtype, t.shape) for t in out_file.tensors}
        self._writer = SafetensorsWriter(self.path, plan_safetensors(entries, HF_METADATA))

    def write_extent(self, key: str, offset: int, data: torch.Tensor) -> None:
        self._writer.write_extent(key, offset, data)

    def file_offset(self, key: str, offset: int) -> int:
        return self._writer.file_offset(key, offset)

    def claim(self, key: str, offset: int, nbytes: int) -> Callable[[], None]:
        return self._writer.claim(key, offset, nbytes)

    def finish(self) -> list[Path]:
        self._writer.finish()
        return [self.path]


def safetensors_sink(out_file: OutFile, tmp: Path) -> SafetensorsSink:
    return SafetensorsSink(out_file, tmp)
