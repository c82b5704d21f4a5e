"""``python -m tests.titan_torchrun ARGS``: what ``torchrun --nproc_per_node 1 -m torchtitan.train ARGS`` runs, on
this CPU machine under the harness shims of ``tests/titan_shims.py`` (test harness only; never in the product).

TorchTitan 0.3.0's own entry point (``torchtitan.train`` run as ``__main__``: its ``ConfigManager`` parses
``--module``/``--config`` and the CLI overrides, ``config.build()``, ``Trainer.train()``, its saves) in one process with
the environment torchrun sets for one rank. The parsed ``Trainer.Config`` gets the shims before the build: TorchTitan's
SDPA attention in every layer, the CPU device, and for the tokenizer and the data (``DATASET``/``HF_ASSETS_PATH``, which
need a download or a tokenizer) rows of token ids drawn from a fixed seed (``ROWS_SEED``) of the parsed batch and
sequence length, as many batches as ``training.steps``; the loss is logged every step."""

from __future__ import annotations

import runpy
import sys
from typing import Any

import pytest
import torch

from tests.test_titan_trainer import torchrun_env
from tests.titan_shims import cpu_device, rows_dataloader, rows_tokenizer, sdpa_attention

ROWS_SEED = 0


def shimmed(config: Any) -> Any:
    """The parsed ``Trainer.Config`` with the CPU shims and the seeded rows (in place; returned)."""
    sdpa_attention(config.model_spec.model)
    generator = torch.Generator().manual_seed(ROWS_SEED)
    shape = (config.training.local_batch_size, config.training.seq_len)
    vocab = config.model_spec.model.vocab_size
    rows = [torch.randint(vocab, shape, generator=generator) for _ in range(config.training.steps)]
    config.tokenizer = rows_tokenizer()
    config.dataloader = rows_dataloader(rows)
    config.training.disable_cuda_graphs = True  # 0.3.0 wraps its step in CUDA graphs by default
    config.metrics.log_freq = 1
    return config


def main(args: list[str]) -> None:
    from torchtitan.config import ConfigManager

    patch = pytest.MonkeyPatch()
    parse = ConfigManager.parse_args
    patch.setattr(ConfigManager, "parse_args", lambda self, argv=None: shimmed(parse(self, argv)))
    cpu_device(patch)
    torchrun_env(patch)
    sys.argv = ["torchtitan.train", *args]
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
