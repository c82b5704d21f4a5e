"""Shared fixtures: tiny Llama checkpoints made by transformers at test time, golden cases."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptconv.engine import options as run_options

# Nothing in the suite may reach the Hub: a lookup that is not in a test's own cache fails at once.
os.environ["HF_HUB_OFFLINE"] = "1"

REPO = Path(__file__).resolve().parents[1]
# The official converter's golden outputs (fixtures/nxd-official/README.md): every test reads them from here.
GOLDEN = REPO / "fixtures" / "nxd-official"


def fixture_cases(root: Path) -> list[str]:
    """The case folders (those holding a ``case.json``) of the in-repo fixture folder ``root``, sorted. A missing or
    caseless folder is a broken checkout: it fails (at collection, where a module calls this), never skips."""
    cases = sorted(p.name for p in root.iterdir() if (p / "case.json").is_file()) if root.is_dir() else []
    if not cases:
        pytest.fail(f"fixture folder missing or without any case.json: {root}", pytrace=False)
    return cases


def require(path: Path) -> Path:
    """``path``, which a fixture folder must hold; a failure naming it if it is absent."""
    if not path.exists():
        pytest.fail(f"fixture missing: {path}", pytrace=False)
    return path


# What ckptconv warns, on purpose, when a to-hf (or nxdtrain export) writes an HF directory without tokenizer
# files: the tiny models made here carry none, so every such test asserts the warning (``warns_no_tokenizer``).
NO_TOKENIZER = r"will have no tokenizer \(.+ holds none\), so AutoTokenizer cannot load it; ckptconv to-hf --tokenizer DIR"
# What ckptconv warns when asked for the official converter's trn2 K/V order (kvm > 1).
OFFICIAL_TRN2_KV = r"--trn2-kv-layout official writes the official converter's trn2 K/V order, which pairs query heads"


def warns_no_tokenizer() -> pytest.WarningsRecorder:
    """``with warns_no_tokenizer(): to_hf(...)``: the HF output of a checkpoint without tokenizer files is warned
    about (and the test fails if it is not)."""
    return pytest.warns(UserWarning, match=NO_TOKENIZER)


def warns_official_trn2_kv() -> pytest.WarningsRecorder:
    """``with warns_official_trn2_kv(): to_nxd(..., trn2_kv_layout="official")`` (kvm > 1): the warning is given."""
    return pytest.warns(UserWarning, match=OFFICIAL_TRN2_KV)


FAMILY_CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


def wait_until(condition: Callable[[], object], what: str, timeout: float, poll: float = 0.1) -> None:
    """Poll ``condition`` every ``poll`` seconds until it holds; past ``timeout`` seconds, fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def meta_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s layout (shape, strides, dtype) on the meta device, no memory: how a memory budget sees a
    pair it plans for (ckptconv.engine.slabs.copy_scratch, ckptconv.io.transpose.native_takes)."""
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")


def make_tiny_llama(
    path: Path,
    *,
    hidden: int = 64,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int | None = 8,
    layers: int = 4,
    vocab: int = 128,
    intermediate: int = 96,
    tied: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_shard_size: str | None = None,
    model_type: str = "llama",
    **extra,
) -> Path:
    """``save_pretrained`` of a random tiny model of ``model_type`` (llama, mistral, qwen2, qwen3; ``extra``: more
    config fields); every weight distinct, norms not all ones, biases not zero."""
    import transformers

    family = FAMILY_CLASSES[model_type]
    config_class, model_class = (getattr(transformers, family + suffix) for suffix in ("Config", "ForCausalLM"))
    torch.manual_seed(seed)
    config = config_class(
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        num_hidden_layers=layers, vocab_size=vocab, intermediate_size=intermediate,
        tie_word_embeddings=tied, max_position_embeddings=128, **extra,
    )
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def hf_state(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors directory, read with the safetensors library."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(path / name))
    return state


@pytest.fixture(autouse=True)
def default_workers_as_for_a_large_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversion given no ``--workers`` runs one worker per 32 MiB written (``workers_for``): one for every
    model here. A test's own conversions run the whole default pool, as a conversion of a real model does, so they
    keep exercising concurrent bands (module- and session-scoped fixtures are set up before this patch and run the
    rule's one worker; so do the CLI's subprocesses); ``tests/engine/test_usable_cpus.py`` tests the rule itself."""
    monkeypatch.setattr(run_options, "BYTES_PER_DEFAULT_WORKER", 1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory):
    """Factory of cached tiny models: ``tiny_models(name, **kwargs) -> Path``."""
    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[str, Path] = {}

    def get(name: str, **kwargs) -> Path:
        if name not in cache:
            cache[name] = make_tiny_llama(root / name, **kwargs)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory: pytest.TempPathFactory):
    """``moe_hf(family)``: a tiny HF Mixtral or Qwen3-MoE (tests/moe_tags.py), made once per module."""
    from tests.moe_tags import tiny_moe

    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            made[family] = tiny_moe(family, tmp_path_factory.mktemp(family))
        return made[family]

    return make


@pytest.fixture(scope="module")
def qwen3_moe_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The TorchTitan tests' tiny Qwen3-MoE (tests/test_titan_moe_names.py's ``make_qwen3_moe``), once per module."""
    from tests.test_titan_moe_names import make_qwen3_moe

    return make_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe"))


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    """``GOLDEN``; a test using it fails (never skips) when the folder is missing."""
    fixture_cases(GOLDEN)
    return GOLDEN


@pytest.fixture
def nxd_optimizers_made(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The model root of every ``NxdOptimizer`` made while the test runs: how often NxD's optimizer files are
    parsed (each making parses them)."""
    from ckptconv.training.nxd_format.read import NxdOptimizer

    made: list[Path] = []
    real = NxdOptimizer.__init__

    def counting(self: NxdOptimizer, model: Any, **kwargs: Any) -> None:
        made.append(model.root)
        real(self, model, **kwargs)

    monkeypatch.setattr(NxdOptimizer, "__init__", counting)
    return made


@pytest.fixture(scope="module")
def gloo_world():
    """A one-process gloo group, as torchrun gives one rank (TorchTitan's CheckpointManager and DCP run in it)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()

