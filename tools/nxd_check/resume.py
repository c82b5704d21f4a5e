"""One resume by NxD's own loader, in this process: build, load a tag one way, run the next step, measure.

Run once per process (NxD keeps its parallel state in module globals). The steps follow
``fixtures/nxdt-official/README.md`` → "What was run": NxD's example ``LlamaForCausalLM`` at tp 1 / pp 1 with
the case's ZeRO-1 and mixed-precision flags, the example's param groups, AdamW and ``CosineAnnealing`` (NxDT's
linear warmup ``LambdaLR`` for the NxDT case); then ``load_checkpoint`` in one of two ways:

- ``objects``: ``load_checkpoint(root, tag, model=model, optimizer=optimizer, scheduler=...)`` (NxD's examples);
- ``dicts``: ``load_checkpoint(root, tag, model={}, optimizer={})``, then ``model.load_state_dict`` and
  ``optimizer.load_state_dict`` in that order (NxDT's way, as lightning restores).

Then the next step with the case's recorded gradients (backward of ``sum(p * G)``, so NxD's fp32
gradient-accumulation hooks run), ``optimizer.step()``, ``zero_grad()``, ``scheduler.step()``, ``mark_step()``.
"""

from __future__ import annotations

import functools
import os
import traceback
from pathlib import Path
from typing import Any

import torch

from .case import Case, recipe_weights
from .stand_ins import import_example

WAYS = ("objects", "dicts")


def _nxd_config(case: Case) -> dict[str, Any]:
    from neuronx_distributed.trainer import neuronx_distributed_config

    flags = case.flags
    return neuronx_distributed_config(
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        optimizer_config={"zero_one_enabled": flags["zero1"], "grad_clipping": True, "max_grad_norm": 1.0},
        mixed_precision_config={
            "use_master_weights": flags["use_master_weights"],
            "use_fp32_grad_acc": flags["use_fp32_grad_acc"],
            "use_master_weights_in_ckpt": flags["use_master_weights_in_ckpt"],
        },
    )


def _llama(case: Case) -> torch.nn.Module:
    """NxD's example model with the settings of the fixtures (qkv_linear and fuse_qkv on, kv group 1)."""
    from transformers import LlamaConfig

    LlamaForCausalLM = import_example("modeling_llama_nxd").LlamaForCausalLM

    config = LlamaConfig(**case.hf_config())
    config.use_cache = False
    config.kv_shared_group_size = 1
    config.qkv_linear = True
    config.fuse_qkv = True
    config.use_flash_attention = False
    config.transpose_nki_inputs = False
    config.sequence_parallel_enabled = False
    config.selective_checkpoint_enabled = False
    config.head_dim = config.hidden_size // config.num_attention_heads
    model = LlamaForCausalLM(config)
    if case.flags["model_dtype"] == "bfloat16":  # the whole model, as NxDT does unless XLA_DOWNCAST_BF16=1
        model = model.to(torch.bfloat16)
    return model


def _param_groups(case: Case, model: torch.nn.Module) -> list[dict[str, Any]]:
    get_param_groups_by_weight_decay = import_example("training_utils").get_param_groups_by_weight_decay
    if case.flags["param_groups"] == 1:  # the DCP case: NxD's DCP save fails with two groups
        return [{"params": [p for _, p in model.named_parameters()]}]
    return get_param_groups_by_weight_decay(model)


def _scheduler(case: Case, optimizer: torch.optim.Optimizer) -> Any:
    s = case.manifest["scheduler"]
    if case.nxdt_style:
        from torch.optim.lr_scheduler import LambdaLR
        from transformers.optimization import _get_linear_schedule_with_warmup_lr_lambda

        rule = functools.partial(
            _get_linear_schedule_with_warmup_lr_lambda,
            num_warmup_steps=s["num_warmup_steps"],
            num_training_steps=s["num_training_steps"],
        )
        return LambdaLR(optimizer, rule)
    return import_example("lr").CosineAnnealing(
        optimizer,
        max_steps=s["max_steps"],
        warmup_steps=s["warmup_steps"],
        min_lr=s["min_lr"],
        constant_steps=s["constant_steps"],
    )


def held_values(model: torch.nn.Module, optimizer: Any, zero1: bool) -> dict[str, torch.Tensor]:
    """What the optimizer updates, by parameter name, on the CPU: the ZeRO-1 master shards, else the parameters."""
    import torch_xla.core.xla_model as xm

    xm.mark_step()
    names = {id(p): n for n, p in model.named_parameters()}
    if not zero1:
        return {n: p.detach().cpu() for n, p in model.named_parameters()}
    zero = optimizer.optimizer  # NxDOptimizer -> NeuronZero1Optimizer
    out = {}
    for group, shards in zip(zero.param_groups, zero.base_optimizer.param_groups, strict=True):
        for param, shard in zip(group["params"], shards["params"], strict=True):
            out[names[id(param)]] = shard.detach().cpu()
    return out


def max_abs_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    if set(got) != set(want):
        raise SystemExit(f"parameter names differ from the reference: {sorted(set(got) ^ set(want))}")
    return max(float((got[k].double() - want[k].double()).abs().max()) for k in want)


def _steps_in_state(state_dict: dict[str, Any]) -> list[float]:
    """The distinct AdamW ``step`` values NxD's optimizer holds (ZeRO-1 keeps them in ``base_state``)."""
    states = state_dict.get("base_state") or state_dict.get("state") or {}
    return sorted({float(s["step"]) for s in states.values() if "step" in s})


def _where(error: BaseException, nxd_src: Path) -> list[str]:
    """The traceback from the first frame outside this harness, as ``file:line``; NxD's files relative to its src."""
    frames = traceback.extract_tb(error.__traceback__)
    here = str(Path(__file__).parent)
    inner = [f for f in frames if not f.filename.startswith(here)]
    src = str(nxd_src / "src") + os.sep
    return [f"{f.filename.removeprefix(src)}:{f.lineno}" for f in inner]


def _small_ints(user_content: Any) -> dict[str, Any]:
    keys = ("total_steps", "batch_idx", "epoch", "global_step")
    if not isinstance(user_content, dict):
        return {}
    return {k: user_content[k] for k in keys if isinstance(user_content.get(k), int)}


def resume(case: Case, tag_dir: Path, way: str, nxd_src: Path) -> dict[str, Any]:
    """Resume ``tag_dir`` (a tag directory; its parent is the checkpoint root) ``way``; one result dict."""
    import torch_xla.core.xla_model as xm
    from neuronx_distributed.trainer import initialize_parallel_model, initialize_parallel_optimizer, load_checkpoint

    if way not in WAYS:
        raise SystemExit(f"--way {way}: expected one of {', '.join(WAYS)}")
    zero1 = bool(case.flags["zero1"])
    nxd_config = _nxd_config(case)
    model = initialize_parallel_model(nxd_config, _llama, False, case)
    device = xm.xla_device()
    start = recipe_weights(case, init_seed=int(case.manifest["seed"]) + 1)
    names = [n for n, _ in model.named_parameters()]
    if names != case.manifest["param_names"]:
        raise SystemExit(f"{case.name}: NxD's model names {names} differ from case.json param_names")
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n].to(device=device, dtype=p.dtype))
    opt = case.manifest["optimizer"]
    optimizer = initialize_parallel_optimizer(
        nxd_config,
        torch.optim.AdamW,
        _param_groups(case, model),
        lr=opt["lr"],
        betas=tuple(opt["betas"]),
        weight_decay=opt["weight_decay"],
    )
    scheduler = _scheduler(case, optimizer)
    xm.mark_step()

    # NxD's caller says whether the optimizer is a DCP directory; a resumed run says what its tag holds
    use_zero1_dcp = (tag_dir / "optim" / ".metadata").is_file()
    result: dict[str, Any] = {"way": way, "use_zero1_dcp": use_zero1_dcp}
    root, tag = str(tag_dir.parent), tag_dir.name
    try:
        if way == "objects":
            user_content = load_checkpoint(
                root,
                tag,
                model=model,
                optimizer=optimizer,
                scheduler=None if case.nxdt_style else scheduler,
                use_zero1_dcp=use_zero1_dcp,
            )
        else:
            model_sd: dict[str, Any] = {}
            optimizer_sd: dict[str, Any] = {}
            user_content = load_checkpoint(root, tag, model=model_sd, optimizer=optimizer_sd)
            model.load_state_dict(model_sd)
            optimizer.load_state_dict(optimizer_sd)
        if case.nxdt_style:  # lightning restores the schedule from the checkpoint dict NxDT saved as user_content
            scheduler.load_state_dict(user_content["lr_schedulers"][0])
    except Exception as error:  # the outcome under test: recorded, not raised
        result.update(load="failed", error=f"{type(error).__name__}: {error}", where=_where(error, nxd_src))
        return result
    xm.mark_step()

    # NxDT's dicts way restores no scheduler.pt (lightning takes the schedule from user_content)
    scheduler_restored = way == "objects" or case.nxdt_style
    at_save = case.reference("params_at_save.nxd")
    held = held_values(model, optimizer, zero1)
    result.update(
        load="ok",
        user_content_keys=sorted(user_content) if isinstance(user_content, dict) else None,
        user_content_counters=_small_ints(user_content),
        scheduler_restored=scheduler_restored,
        scheduler_last_epoch=getattr(scheduler, "last_epoch", None),
        optimizer_steps_after_load=_steps_in_state(optimizer.state_dict()),
        masters_equal_save_after_load=max_abs_diff(held, at_save) == 0.0,
        lr_after_load=[g["lr"] for g in optimizer.param_groups],
    )

    grads = case.reference("grads_next.nxd")
    terms = [(p * grads[n].to(device=device, dtype=p.dtype)).sum().float() for n, p in model.named_parameters()]
    torch.stack(terms).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    xm.mark_step()

    after = held_values(model, optimizer, zero1)
    diff = max_abs_diff(after, case.reference("params_after_next.nxd"))
    result.update(
        after_next_equal=diff == 0.0,
        after_next_max_abs_diff=diff,
        lr_after_next=[g["lr"] for g in optimizer.param_groups] if scheduler_restored else None,
    )
    resumed = case.reference("params_after_next_resumed.nxd")
    if resumed is not None:  # zero1_bf16: the files cannot give the uninterrupted step; NxD's own resume can
        result["after_next_max_abs_diff_vs_nxd_resumed"] = max_abs_diff(after, resumed)
    return result
