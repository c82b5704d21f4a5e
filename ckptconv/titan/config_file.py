"""``OUT/torchtitan_config.py``: the TorchTitan run that continues what ``to-dcp`` wrote, in TorchTitan's own form.

TorchTitan (pinned: :data:`~ckptconv.titan.names.TITAN_VERSION`) builds a run from a *config registry*: a Python
module whose functions return its ``Trainer.Config`` (``torchrun -m torchtitan.train --module M --config F``).
``to-dcp`` writes one such module beside the DCP, with ``continue_run()``: the model config from the HF config
(dims, heads, KV heads, head_dim, ffn, vocab, tying, norm eps, RoPE theta and scaling), the two AdamW param
groups with the run's values (norm weights without weight decay), the lr scheduler that continues the source's
schedule (:class:`~ckptconv.titan.state.TitanSchedule`), and the checkpoint block that loads the DCP with its
state. What ckptconv cannot know (data, tokenizer, batch, parallelism) are the ``SET`` names at the top.

The model comes from the same family table that names the DCP's tensors (:func:`ckptconv.titan.names.titan_model`):
the module builds TorchTitan's own layers (``_build_llama3_layers``/``_build_qwen3_layers``, and for Qwen3-MoE
``_build_qwen3_moe_layers`` for the sparse layers, the functions its presets use), never a preset, so a Llama-3.2 RoPE factor 32 or a Llama-3.0 without scaling is what runs.

    >>> titan_rope({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
    ...             "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    ...            complex_rope=True)["scaling_factor"]
    32.0
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ckptconv.core.model_spec import ModelSpec
from ckptconv.errors import ConversionError
from ckptconv.titan.names import TITAN_VERSION, moe_layers, titan_model

CONFIG_MODULE = "torchtitan_config"
CONFIG_FILE = f"{CONFIG_MODULE}.py"
# the TorchTitan main the generated file was last checked against (docs/torchtitan.md)
TITAN_MAIN_CHECKED = "2026-08-21 (b5bcd76c66d0)"
NORM_PATTERN = r"norm\.weight$"  # TorchTitan's param-group patterns are searched (re.search) in each FQN


def titan_rope(config: dict[str, Any], *, complex_rope: bool) -> dict[str, Any]:
    """TorchTitan's RoPE config fields for an HF config: theta and the scaling (``llama`` with its factor and
    frequency bounds, or ``none``); a scaling TorchTitan's RoPE does not compute is refused."""
    given = config.get("rope_parameters")
    params: dict[str, Any] = given if isinstance(given, dict) else {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling: dict[str, Any] = config.get("rope_scaling") or (params if params.get("rope_type") not in (None, "default")
                                                            else {})
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind in (None, "default"):
        return {"theta": theta, "scaling": "none"}
    if kind != "llama3" or not complex_rope:
        rope = "complex RoPE (llama3)" if complex_rope else "cos/sin RoPE (qwen3)"
        raise ConversionError(f"config.json: rope scaling {kind!r}: TorchTitan {TITAN_VERSION}'s {rope} does not "
                              "compute it (its llama3 model takes rope_type 'llama3' or none), so the model would "
                              "load and train with another RoPE")
    try:
        return {"theta": theta, "scaling": "llama", "scaling_factor": float(scaling["factor"]),
                "low_freq_factor": float(scaling["low_freq_factor"]),
                "high_freq_factor": float(scaling["high_freq_factor"]),
                "original_max_position_embeddings": int(scaling["original_max_position_embeddings"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise ConversionError(f"config.json: rope_scaling {scaling}: llama3 scaling needs {exc}") from None


@dataclass(frozen=True)
class TitanRun:
    """The optimizer and schedule of a continued run (None in :func:`config_module`: a model-only DCP)."""

    groups: tuple[dict[str, Any], dict[str, Any]]  # AdamW kwargs: matrices, norm weights
    warmup_steps: int
    decay_type: str
    min_lr_factor: float
    total_steps: int
    step: int
    seq_len: int | None
    max_norm: float | None
    comments: tuple[str, ...] = ()  # what has no TorchTitan equivalent (written as comments)


def _layer_lines(spec: ModelSpec, build: str, head_dim: str) -> list[str]:
    """The ``layers`` of ``model_config()``: TorchTitan's dense builder, and for a mixture of experts its MoE builder
    for the sparse layers (those the HF config routes: ``mlp_only_layers``, ``decoder_sparse_step``)."""
    common = (f"n_layers={spec.layers}, dim=dim, n_heads={spec.heads}, n_kv_heads={spec.kv_heads}, {head_dim}"
              "fuse_qkv=True, attn_backend=ATTN_BACKEND, rope=rope")
    dense = f"{build}({common}, hidden_dim={spec.intermediate})"
    if not spec.experts:
        return [f"    layers = {dense}"]
    moe = spec.family.moe
    assert moe is not None
    sparse = [n for n in range(spec.layers) if spec.sparse(n)]
    aux = spec.config.get("router_aux_loss_coef")
    return [f"    dense = {dense}" if len(sparse) < spec.layers else "    dense = None  # every layer is sparse",
            f"    moe = _build_qwen3_moe_layers({common}, moe_hidden_dim={spec.expert_intermediate}, "
            f"num_experts={spec.experts}, top_k={spec.top_k}, moe_comm_backend=MOE_COMM_BACKEND)",
            f"    sparse = {tuple(sparse)!r}  # the HF config's sparse layers (mlp_only_layers, decoder_sparse_step)",
            "    layers = [moe[n] if n in sparse else dense[n] for n in range(len(moe))]",
            "    for n in sparse:  # the HF router's renormalization of the top-k weights (norm_topk_prob)",
            f"        layers[n].moe.router.route_norm = {moe.norm_topk(spec.config)!r}",
            "    # expert_bias_E (zeros in the DCP) is TorchTitan's auxiliary-loss-free load balancing (its",
            "    # load_balance_coeff 1e-3): it replaces the source's router aux loss"
            + (f" (router_aux_loss_coef {aux!r})" if aux is not None else "")]


def _model_lines(spec: ModelSpec) -> list[str]:
    """``model_config()``: TorchTitan's model config of ``spec`` built with its own layer builders."""
    model = titan_model(spec)
    if model.module is not None:  # a model with a module of its own (DeepSeek-V3, GPT-OSS)
        lines: list[str] = importlib.import_module(model.module).model_lines(spec)
        return lines
    c = spec.config
    rope = titan_rope(c, complex_rope=model.complex_rope)
    eps = float(c.get("rms_norm_eps", 1e-6))
    max_pos = int(c.get("max_position_embeddings") or 4096)
    rope_cls = "ComplexRoPE" if model.complex_rope else "CosSinRoPE"
    rope_args = ", ".join(f"{k}={v!r}" for k, v in rope.items())
    is_qwen = model.name == "qwen3"
    build = "_build_qwen3_layers" if is_qwen else "_build_llama3_layers"
    cls = "Qwen3Model" if is_qwen else "Llama3Model"
    head_dim = f"head_dim={spec.head_dim}, " if is_qwen else ""
    lines = [
        "def model_config() -> " + cls + ".Config:",
        f'    """TorchTitan\'s {model.name} for the HF config this DCP was written from (hf/config.json)."""',
        f"    dim, vocab, eps = {spec.hidden}, {spec.vocab}, {eps!r}",
        f"    rope = {rope_cls}.Config(dim={spec.head_dim}, **_rope_length({rope_cls}, max(SEQ_LEN, {max_pos})), {rope_args})",
        *_layer_lines(spec, build, head_dim),
        "    for layer in layers:  # the HF config's norm eps (the builders' default may differ)",
        "        for norm in (layer.attention_norm, layer.ffn_norm, getattr(layer.attention, 'qk_norm', None)):",
        "            if norm is not None:",
        "                norm.eps = eps",
        f"    return {cls}.Config(",
        f"        dim=dim, vocab_size=vocab, enable_weight_tying={spec.tied!r}, layers=layers,",
        "        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_INIT),",
        "        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=_NORM_INIT),",
        "        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_INIT),",
        "    )",
    ]
    if spec.head_dim * spec.heads != spec.hidden and not is_qwen:
        raise ConversionError(f"config.json: head_dim {spec.head_dim} x {spec.heads} heads != hidden {spec.hidden}: "
                              "TorchTitan's llama3 takes head_dim = dim / n_heads")
    return lines


def _optimizer_lines(run: TitanRun | None) -> list[str]:
    if run is None:
        return ["def optimizer() -> OptimizersContainer.Config:",
                '    """The DCP holds no optimizer state (model only): SET your AdamW values."""',
                "    return default_adamw(lr=3e-4)  # SET", ""]
    matrices, norms = run.groups
    out = ["def optimizer() -> OptimizersContainer.Config:",
           '    """The run\'s AdamW: the norm weights in their own group (nxdtrain\'s, without weight decay), then the',
           "    rest; TorchTitan matches each parameter to the first pattern found in its name. The lr is the peak lr",
           '    (the schedule scales it; the DCP holds the lr of the next step)."""',
           "    return OptimizersContainer.Config(param_groups=["]
    for pattern, group in ((NORM_PATTERN, norms), (".*", matrices)):
        kwargs = ", ".join(f"{k!r}: {group[k]!r}" for k in ("lr", "betas", "eps", "weight_decay"))
        out.append(f"        ParamGroupConfig(pattern={pattern!r}, optimizer_name='AdamW', optimizer_kwargs={{{kwargs}}}),")
    return [*out, "    ])", ""]


def _scheduler_lines(run: TitanRun | None) -> list[str]:
    if run is None:
        return ["def lr_scheduler() -> LRSchedulersContainer.Config:",
                "    return LRSchedulersContainer.Config()  # SET", ""]
    return ["def lr_scheduler() -> LRSchedulersContainer.Config:",
            f'    """Warmup-stable-decay that continues the source\'s schedule past step {run.step} exactly (past warmup)."""',
            *(f"    # {line}" for line in run.comments),
            f"    return LRSchedulersContainer.Config(warmup_steps={run.warmup_steps}, total_steps={run.total_steps}, "
            f"decay_ratio=None, decay_type={run.decay_type!r}, min_lr_factor={run.min_lr_factor!r})", ""]


_HEADER = '''"""TorchTitan {version} config registry written by ckptconv to-dcp: continue {what} in TorchTitan.

Run it (this folder on PYTHONPATH; set the SET names first):

    {command}

The checkpoint block loads the DCP in this folder ({state}).
"""

import dataclasses
import importlib.metadata
import os
from functools import partial

import torch

# ---- which TorchTitan: chosen by what the installed one has (its main still calls itself 0.2.2, so its version
# cannot tell); checked against 0.3.0 and main as of {checked}
try:
    _VERSION = importlib.metadata.version("torchtitan")
except importlib.metadata.PackageNotFoundError:
    _VERSION = "(not installed)"
try:
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig, default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.hf_datasets import text_datasets
    from torchtitan.models.common import {rope_cls}, Embedding, Linear, RMSNorm
    from torchtitan.models.{model} import {model_cls}, {build}, model_registry
    from torchtitan.trainer import Trainer
except ImportError as exc:
    raise SystemExit(f"{{__file__}}: TorchTitan {{_VERSION}} cannot serve this file ({{exc}}): it needs TorchTitan "
                     "0.3.0 or later (its config registry: torchtitan.trainer, torchtitan.models.common)") from None
_GRAIN = not hasattr(text_datasets, "HuggingFaceTextDataLoader")  # main past #4088: one Grain data loader
if _GRAIN:
    from torchtitan.components.data import ConcatThenSplitPackingConfig, GrainDataLoader
_TRAINING_FIELDS = {{f.name for f in dataclasses.fields(TrainingConfig)}}
_TOKEN_BUDGET = "max_context_length" in _TRAINING_FIELDS  # main past #4121: batches of tokens, not rows
if not _TOKEN_BUDGET and "seq_len" not in _TRAINING_FIELDS:
    raise SystemExit(f"{{__file__}}: TorchTitan {{_VERSION}}: its TrainingConfig has neither seq_len (0.3.0) nor "
                     "max_context_length (main); this file cannot say the batch to it")

# ---- SET: what ckptconv cannot know --------------------------------------------------------------------
DATASET = "c4"                  # SET: a dataset TorchTitan knows (its text_datasets.DATASETS: c4, c4_test, ...)
DATASET_PATH = None             # SET: or that dataset's files at a local path
HERE = os.path.dirname(os.path.abspath(__file__))  # the DCP to-dcp wrote (this file lies beside it)
HF_ASSETS_PATH = os.path.join(HERE, "hf")  # SET: the tokenizer's folder{tokenizer_note}
LOCAL_BATCH_SIZE = 8            # SET
SEQ_LEN = {seq_len!r}                 # SET{seq_note}
STEPS = {steps!r}                   # SET: training.steps, the step TorchTitan stops at{steps_note}
DATA_PARALLEL_SHARD_DEGREE = -1  # SET: parallelism (FSDP over all ranks by default)
TENSOR_PARALLEL_DEGREE = 1       # SET
ATTN_BACKEND = "flex"            # SET: flex, flex_flash, varlen (all three need a GPU: FlexAttention has no CPU
                                 # backward) or sdpa (runs on a CPU too){moe_set}
MIXED_PRECISION_PARAM = {precision!r}  # the compute dtype{precision_note}
DUMP_FOLDER = "./outputs"       # where TorchTitan writes its own checkpoints
INITIAL_LOAD_PATH = HERE
# ---------------------------------------------------------------------------------------------------------

# every parameter is loaded from the checkpoint; these only initialize the model before the load
_INIT = {{"weight": partial(torch.nn.init.normal_, std=0.02)}}
_NORM_INIT = {{"weight": torch.nn.init.ones_}}

'''

_TAIL = '''
def _rope_length(rope, n: int) -> dict:
    """The RoPE's context length under the installed TorchTitan's name (main renamed max_seq_len, #4121)."""
    fields = {{f.name for f in dataclasses.fields(rope.Config)}}
    return {{"max_context_length" if "max_context_length" in fields else "max_seq_len": n}}


def _training(**kwargs) -> TrainingConfig:
    """LOCAL_BATCH_SIZE rows of SEQ_LEN tokens per dp rank: 0.3.0's fields, or main's token budget (#4121)."""
    if _TOKEN_BUDGET:
        return TrainingConfig(num_tokens_per_microbatch_per_dp_rank=LOCAL_BATCH_SIZE * SEQ_LEN,
                              max_context_length=SEQ_LEN, **kwargs)
    return TrainingConfig(local_batch_size=LOCAL_BATCH_SIZE, seq_len=SEQ_LEN, **kwargs)


def _dataloader():
    """DATASET (at DATASET_PATH) through 0.3.0's HuggingFaceTextDataLoader or main's Grain loader (#4088)."""
    if not _GRAIN:
        return text_datasets.HuggingFaceTextDataLoader.Config(dataset=DATASET, dataset_path=DATASET_PATH)
    dataset = text_datasets.DATASETS[DATASET]
    if DATASET_PATH is not None:
        dataset = dataclasses.replace(dataset, source=dataclasses.replace(dataset.source, path=DATASET_PATH))
    return GrainDataLoader.Config(dataset=ConcatThenSplitPackingConfig(dataset=dataset))


def continue_run() -> Trainer.Config:
    """TorchTitan's Trainer.Config that continues the run from INITIAL_LOAD_PATH."""
    model_spec = model_registry("{flavor}")
    model_spec.model = model_config()
    model_spec.flavor = "ckptconv"
    return Trainer.Config(
        model_spec=model_spec,
        hf_assets_path=HF_ASSETS_PATH,
        dump_folder=DUMP_FOLDER,
        loss={loss},
        optimizer=optimizer(),
        lr_scheduler=lr_scheduler(),
        training=_training(steps=STEPS, mixed_precision_param=MIXED_PRECISION_PARAM{max_norm}),
        dataloader=_dataloader(),
        parallelism=ParallelismConfig(data_parallel_shard_degree=DATA_PARALLEL_SHARD_DEGREE,
                                      tensor_parallel_degree=TENSOR_PARALLEL_DEGREE),
        checkpoint=CheckpointManager.Config(
            enable=True,
            initial_load_path=INITIAL_LOAD_PATH,
            initial_load_model_only={model_only!r},{exclude}
            last_save_model_only=False,
        ),
    )
'''


def run_command(out_dir: str) -> str:
    """The one command line that runs the generated config."""
    return (f"PYTHONPATH={out_dir} torchrun --nproc_per_node <gpus> -m torchtitan.train --module {CONFIG_MODULE} "
            "--config continue_run")


def excluded(names: list[str]) -> list[str]:
    """``exclude_from_loading``: TorchTitan's main refuses the optimizer left out while the lr scheduler is loaded
    (its #4168: the schedule's state belongs to the optimizer's); refused here too, so no file says it."""
    if "optimizer" in names and "lr_scheduler" not in names:
        raise ConversionError(f"exclude_from_loading {names}: lr_scheduler must be excluded when optimizer is "
                              "(TorchTitan refuses it)")
    return names


def _steps_note(run: TitanRun | None) -> str:
    if run is None:
        return ""
    if run.total_steps <= run.step:
        return (f" (the source's total; its run is at step {run.step} already, so TorchTitan would stop at once: "
                "raise it to train)")
    return f" (the source's total: {run.total_steps}; the run is at step {run.step})"


def config_module(spec: ModelSpec, run: TitanRun | None, *, what: str, precision: str = "bfloat16",
                  tokenizer: bool = True) -> str:
    """The text of ``torchtitan_config.py`` (``run`` None: a model-only DCP, ``initial_load_model_only=True``).
    ``precision``: the source's compute dtype (``float32`` for a run trained in fp32); ``tokenizer``: whether
    ``hf/`` holds one."""
    model = titan_model(spec)
    is_qwen = model.name == "qwen3"
    own = None if model.module is None else importlib.import_module(model.module)  # its model class and builders
    seq_len = run.seq_len if run is not None and run.seq_len else 2048
    rope_cls = "ComplexRoPE" if model.complex_rope else "CosSinRoPE"
    header = _HEADER.format(
        version=TITAN_VERSION, what=what, command=run_command("<this folder>"), checked=TITAN_MAIN_CHECKED,
        state="model only: initial_load_model_only=True" if run is None else
        f"model, AdamW state, lr schedule and step {run.step}: initial_load_model_only=False, the data loader "
        "excluded (TorchTitan's loader starts its data from the beginning)",
        rope_cls=rope_cls, model=model.name,
        model_cls=own.MODEL_CLS if own else "Qwen3Model" if is_qwen else "Llama3Model",
        build=own.BUILDERS if own else ("_build_qwen3_layers" if is_qwen else "_build_llama3_layers")
        + (", _build_qwen3_moe_layers" if spec.experts else ""), seq_len=seq_len,
        moe_set='\nMOE_COMM_BACKEND = "standard"     # SET: the experts\' token dispatch (standard, deepep, ...)'
        if moe_layers(spec) else "",  # any MoE block (GPT-OSS's every layer: its spec.experts is 0)
        seq_note="" if run is None or not run.seq_len else " (the source run's)",
        steps=run.total_steps if run is not None else 1000, steps_note=_steps_note(run),
        tokenizer_note=" (to-dcp copied the source's HF files here)" if tokenizer else
        " (hf/ holds NO tokenizer: point this at one, or rerun to-dcp with --tokenizer DIR)",
        precision=precision, precision_note=" (the source's: its weights are float32)" if precision == "float32"
        else " (TorchTitan's default; \"float32\" computes in fp32)")
    loss = (own.loss(spec) if own else None) or f"ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size={spec.vocab}))"
    tail = _TAIL.format(flavor="debugmodel", loss=loss, model_only=run is None,
                        max_norm="" if run is None or run.max_norm is None else f", max_norm={run.max_norm!r}",
                        exclude="" if run is None else f"\n            exclude_from_loading={excluded(['dataloader'])!r},")
    body = [*_model_lines(spec), "", "", *_optimizer_lines(run), "", *_scheduler_lines(run)]
    return header + "\n".join(body) + "\n" + tail
