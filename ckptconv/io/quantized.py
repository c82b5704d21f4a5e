"""Quantized HF weights read as plain ones: the seam every quantization method plugs into.

A checkpoint whose ``config.json`` has a ``quantization_config`` stores some weights in a packed form (FP8 with a
scale per block, MXFP4 blocks with their scales, ...). A *method* (one module per ``quant_method``, named in
:data:`METHODS`) looks at the stored tensors' names, dtypes and shapes, and says which weights are quantized, the
stored tensors each is made from, and how to dequantize any row range of it. :class:`Dequantized` then lets the HF
reader (``io/hf.py``) show every plan the plain weight under its HF name, dtype and shape, and read only the stored
rows (and scale rows) a band needs: nothing is dequantized whole.

A method module has two functions::

    quantized_tensors(qconfig: dict, stored: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], source: str)
        -> dict[str, Quantized]          # keyed by the plain weight's HF name; errors name ``source`` and the key
    describe(qconfig: dict) -> str       # one phrase for inspect: "fp8 float8_e4m3fn, blocks 128 x 128"

    >>> quantized_tensors({"model_type": "llama"}, {}, "config.json")
    {}
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptconv.errors import ConversionError

# quant_method (config.json's quantization_config) -> the module that reads it (lazily imported: most models have none)
METHODS: dict[str, str] = {"fp8": "ckptconv.io.fp8_blocks", "mxfp4": "ckptconv.io.mxfp4"}
DEFAULT_DTYPE = torch.bfloat16  # what a dequantized weight is read as unless the command says otherwise (--dtype)

RawRead = Callable[[str, int, int], torch.Tensor]  # a stored tensor's rows [start, stop), as stored
Stored = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


@dataclass(frozen=True)
class Quantized:
    """One quantized weight: its plain ``shape``, the stored tensors it is made from (``sources``, the packed
    weight first), and ``rows(read, start, stop)``: its rows ``[start, stop)`` dequantized, as float32, reading
    only the stored rows they need through ``read``."""

    key: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    rows: Callable[[RawRead, int, int], torch.Tensor]


def _method(config: dict[str, Any], source: str) -> tuple[dict[str, Any], Any] | None:
    qconfig = config.get("quantization_config")
    if qconfig is None:
        return None
    if not isinstance(qconfig, dict):
        raise ConversionError(f"{source}: quantization_config must be an object, got {qconfig!r}")
    name = qconfig.get("quant_method")
    if name not in METHODS:
        raise ConversionError(f"{source}: quantization_config.quant_method is {name!r}; ckptconv reads "
                              f"{', '.join(sorted(METHODS))} (dequantize the checkpoint first for another method)")
    return qconfig, importlib.import_module(METHODS[name])


def quantized_tensors(config: dict[str, Any], stored: Stored, source: str) -> dict[str, Quantized]:
    """The quantized weights of a checkpoint with HF config ``config`` whose tensors are ``stored`` (empty when the
    config has no ``quantization_config``); an unknown method, a missing or misshapen scale is refused in one line."""
    found = _method(config, source)
    if found is None:
        return {}
    qconfig, module = found
    result: dict[str, Quantized] = module.quantized_tensors(qconfig, stored, source)
    return result


def describe(config: dict[str, Any], source: str = "config.json") -> str | None:
    """What the config's quantization is, in one phrase (None: not quantized)."""
    found = _method(config, source)
    return None if found is None else str(found[1].describe(found[0]))


def plain_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` of the dequantized weights (no ``quantization_config``)."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


class Dequantized:
    """The quantized weights of one checkpoint, read as plain ones of ``dtype`` (bf16 unless set)."""

    def __init__(self, tensors: dict[str, Quantized], dtype: torch.dtype = DEFAULT_DTYPE) -> None:
        self.tensors = tensors
        self.dtype = dtype
        # stored tensors that are only a part of another (scales): not shown to plans
        self.hidden = {s for q in tensors.values() for s in q.sources if s not in tensors}

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...], bool]:
        return self.dtype, self.tensors[key].shape, False

    def read_rows(self, read: RawRead, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.tensors[key].rows(read, start, stop)
        return rows.to(self.dtype) if out is None else out.copy_(rows)
