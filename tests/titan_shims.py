"""CPU shims the TorchTitan lane needs around TorchTitan 0.3.0 (test harness only; never in the product).

* ``sdpa_attention(model_config)``: TorchTitan's language models take FlexAttention (``attn_backend`` flex), which
  compiles for ~40 s per shape on CPU and has no CPU backward; the lane swaps each layer's inner attention for
  TorchTitan's own ``ScaledDotProductAttention`` module (causal), which computes the same attention for one
  document per row. The checkpoint layout and every other module are TorchTitan's as configured.
* ``cpu_device(monkeypatch)``: TorchTitan's trainer on a machine without an accelerator (it assumes ``cuda``).
* ``rows_tokenizer()`` / ``rows_dataloader(batches)``: the trainer's tokenizer and data loader for rows of token ids
  (nxdtrain's own batches), so ``Trainer.train()`` trains on exactly what nxdtrain trained on.

And two harness helpers: ``generated_config(out)`` imports ``OUT/torchtitan_config.py`` as TorchTitan's ``--module``
would; ``load_generated_block(model, out, folder)`` loads a model from OUT with that config's checkpoint block.
"""

from __future__ import annotations

from typing import Any


def sdpa_attention(model_config: Any) -> Any:
    """``model_config`` with every layer's inner attention TorchTitan's SDPA module (in place; returned)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in [*model_config.layers, *getattr(model_config, "mtp_layers", [])]:  # DeepSeek-V3's MTP layers too
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return model_config


# ---- the trainer loop on CPU (torchtitan.train's Trainer and its train()) ------------------------------------


class _CpuDeviceModule:
    """What TorchTitan 0.3.0 calls on its ``device_module`` (``torch.cuda`` where no accelerator is found), for
    the CPU: no device to select or synchronize, one device, a memory monitor that reports zeros."""

    class _Properties:
        total_memory = 1 << 30

    set_device = staticmethod(lambda *args, **kwargs: None)
    synchronize = staticmethod(lambda *args, **kwargs: None)
    reset_peak_memory_stats = staticmethod(lambda *args, **kwargs: None)
    empty_cache = staticmethod(lambda *args, **kwargs: None)
    device_count = staticmethod(lambda: 1)
    current_device = staticmethod(lambda: 0)
    get_device_name = staticmethod(lambda *args: "cpu")
    get_device_properties = staticmethod(lambda *args: _CpuDeviceModule._Properties())
    memory_stats = staticmethod(lambda *args: {})


def cpu_device(monkeypatch: Any) -> None:
    """Point TorchTitan's device (``device_type``/``device_module``, copied into four of its modules at import)
    at the CPU: it picks ``cuda`` when no accelerator is available and then calls ``torch.cuda``."""
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as utils

    for module in (utils, metrics, parallel_dims, dist_utils):
        monkeypatch.setattr(module, "device_type", "cpu", raising=False)
        if hasattr(module, "device_module"):
            monkeypatch.setattr(module, "device_module", _CpuDeviceModule)
    monkeypatch.setattr(utils, "get_peak_flops", lambda name: 1e12)  # its lspci probe is GPU-only


def rows_tokenizer() -> Any:
    """``Trainer.Config.tokenizer``: a tokenizer that is never asked to tokenize (the rows are token ids already)."""
    from dataclasses import dataclass

    from torchtitan.components.tokenizer import BaseTokenizer

    class RowsTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Any = None, **kwargs: Any) -> None:
            super().__init__()

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError("the lane's rows are token ids already")

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError("the lane's rows are token ids already")

        def get_vocab_size(self) -> int:
            return 0

    return RowsTokenizer.Config()


def rows_dataloader(batches: list[Any], *, positions: bool = False) -> Any:
    """``Trainer.Config.dataloader``: yields TorchTitan's ``({"input": rows}, labels)`` for each global batch of
    token rows, in order: the labels are the rows shifted by one, the last position ignored (``IGNORE_INDEX``), so
    the loss is the mean over the same next-token predictions nxdtrain's is. ``positions``: each row one document
    (``"positions"`` 0..seq-1, as TorchTitan's text loader gives them): DeepSeek-V3's MTP loss needs them, and the
    trainer builds GPT-OSS's FlexAttention masks from them."""
    from dataclasses import dataclass, field

    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import IGNORE_INDEX

    with_positions = positions

    class RowsDataLoader(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            batches: list[Any] = field(default_factory=list)

        def __init__(self, config: Any, **kwargs: Any) -> None:
            self.batches = config.batches
            self.taken = 0

        def __iter__(self) -> Any:
            for rows in self.batches[self.taken:]:
                self.taken += 1
                labels = torch.full_like(rows, IGNORE_INDEX)
                labels[:, :-1] = rows[:, 1:]
                extra = {"positions": torch.arange(rows.shape[1]).expand_as(rows).clone()} if with_positions else {}
                yield {"input": rows.clone(), **extra}, labels

        def state_dict(self) -> dict[str, Any]:
            return {"taken": self.taken}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.taken = state["taken"]

    return RowsDataLoader.Config(batches=list(batches))


def generated_config(out: Any) -> Any:
    """``OUT/torchtitan_config.py`` imported as TorchTitan's ``--module`` would import it."""
    import importlib.util
    from pathlib import Path

    path = Path(out) / "torchtitan_config.py"
    spec = importlib.util.spec_from_file_location(f"torchtitan_config_{abs(hash(str(path)))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_generated_block(model: Any, out: Any, folder: Any) -> Any:
    """``model`` loaded by TorchTitan's CheckpointManager with the checkpoint block of OUT's generated config
    (``continue_run()``), its own folder ``folder``; returned in eval mode."""
    import warnings
    from pathlib import Path

    from torchtitan.components.checkpointer import CheckpointManager

    folder = Path(folder)
    block = generated_config(out).continue_run().checkpoint
    block.folder = folder.name
    ck = CheckpointManager(block, dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None,
                           states={}, sd_adapter=None, base_folder=str(folder.parent))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ck.load() is True
    ck.close()
    return model.eval()


def train_generated(out: Any, rows: Any, monkeypatch: Any, dump: Any, *, positions: bool = False,
                    attention: Any = None, after: Any = None) -> tuple[list[float], Any]:
    """TorchTitan's ``Trainer`` of OUT's ``continue_run()`` (the SET names: one batch of ``rows``, fp32 compute,
    checkpoints under ``dump``; the shims above; the environment torchrun sets) trains one step: its logged losses,
    and what ``after(trainer)`` returns before the trainer closes (its process group destroyed). ``attention(config)``
    sets the CPU attention (default: :func:`sdpa_attention` in every layer; GPT-OSS's sinks need FlexAttention)."""
    import torch.distributed as dist

    from tests.test_titan_trainer import torchrun_env

    module = generated_config(out)
    for name, value in dict(LOCAL_BATCH_SIZE=rows.shape[0], SEQ_LEN=rows.shape[1], STEPS=1,
                            MIXED_PRECISION_PARAM="float32", DUMP_FOLDER=str(dump)).items():
        monkeypatch.setattr(module, name, value)
    config = module.continue_run()
    if attention is None:
        sdpa_attention(config.model_spec.model)
    else:
        attention(config)
    config.tokenizer = rows_tokenizer()
    config.dataloader = rows_dataloader([rows], positions=positions)
    config.training.disable_cuda_graphs = True
    config.metrics.log_freq = 1
    cpu_device(monkeypatch)
    torchrun_env(monkeypatch)
    trainer = config.build()
    losses: list[float] = []
    log = trainer.metrics_processor.log

    def record(step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> Any:
        losses.append(global_avg_loss)
        return log(step, global_avg_loss, *args, **kwargs)

    monkeypatch.setattr(trainer.metrics_processor, "log", record)
    try:
        trainer.train()
        kept = None if after is None else after(trainer)
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return losses, kept


# ---- GPT-OSS on CPU -----------------------------------------------------------------------------------------


def eager_flex(monkeypatch: Any) -> None:
    """TorchTitan's ``FlexAttention`` (the one backend that gives GPT-OSS its sinks, through the log-sum-exp, and its
    sliding-window block masks) run by torch's eager ``flex_attention``: its compiled kernel on CPU supports neither
    ``return_lse`` nor a backward. Same module, masks, scale and sink rescale; only the kernel is not compiled."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", staticmethod(flex_attention))


def gpt_oss_experts_in_model_dtype(monkeypatch: Any) -> None:
    """TorchTitan 0.3.0's ``GptOssGroupedExperts`` returns its bf16 grouped-matmul output as bf16, which its MoE's
    scatter-add into an fp32 model refuses (on GPU the model computes in bf16 under FSDP's mixed precision): its
    output cast to the tokens' dtype, its arithmetic unchanged."""
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    forward = GptOssGroupedExperts.forward
    monkeypatch.setattr(GptOssGroupedExperts, "forward", lambda self, x, counts: forward(self, x, counts).to(x.dtype))


def math_flex(monkeypatch: Any) -> None:
    """TorchTitan's ``FlexAttention`` with its kernel computed in plain torch, so that it has a CPU backward (the
    trainer's step): the block mask's own ``mask_mod`` (causal, document, sliding window) evaluated over every
    (query, key), softmax with the scale given, the log-sum-exp returned for the sinks' rescale. The forward is
    checked against eager ``flex_attention`` in tests/test_titan_gpt_oss.py."""
    from types import SimpleNamespace

    import torch
    from torch.nn.attention.flex_attention import create_mask
    from torchtitan.models.common.attention import FlexAttention

    def attend(q: Any, k: Any, v: Any, *, score_mod: Any = None, block_mask: Any, scale: Any, enable_gqa: bool,
               return_aux: Any = None, kernel_options: Any = None) -> Any:
        assert score_mod is None, "the lane's math kernel takes masks only"
        if enable_gqa:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        seq, keys = q.shape[2], k.shape[2]
        visible = create_mask(block_mask.mask_mod, q.shape[0], 1, seq, keys, device=q.device)
        scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v, SimpleNamespace(lse=torch.logsumexp(scores, dim=-1))

    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", staticmethod(attend))
