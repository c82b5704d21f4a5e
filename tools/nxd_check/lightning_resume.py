"""The NxDT way of resuming, with lightning's OWN restore: ``Trainer.fit(ckpt_path=<tag>)``.

NxDT itself needs NeMo, which is not installable here; what it adds to lightning for a resume is its
``CheckpointIO`` (``NLPCheckpointIO.load_checkpoint``, read in neuronx-distributed-training at 9169aa03):
NxD's ``load_checkpoint(dir, tag, model={}, optimizer={})`` returns ``user_content.pt``; the model and optimizer
dicts go back in as ``state_dict`` and ``optimizer_states``; ``pytorch-lightning_version`` is filled in when
missing. :class:`NxdtWayIO` does that (our code, written from that description). The rest is lightning 2.5.0's
own: the model state through the module's ``load_state_dict`` (NxDT's module forwards to the NxD model), the
optimizer state into the live NxD optimizer, the loops' progress, ``global_step``, the callbacks and the
schedulers from the checkpoint dict, then one training step (step 3) under lightning's automatic optimization
(the backward of ``sum(p * G)`` with the case's recorded gradients inside the optimizer's closure).

NxDT's own checkpoint callback is NeMo's ``NeMoModelCheckpoint``; a lightning ``ModelCheckpoint`` subclass of that
name with NxDT's example settings (monitor step, mode max, every_n_train_steps 2) stands in for it, so that the
state key the writer used is the one lightning looks up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .case import Case, recipe_weights
from .resume import (
    _llama,
    _nxd_config,
    _param_groups,
    _scheduler,
    _steps_in_state,
    _where,
    held_values,
    max_abs_diff,
)


def _fit_progress(trainer: Any) -> dict[str, int]:
    loop = trainer.fit_loop
    optim = loop.epoch_loop.automatic_optimization.optim_progress.optimizer
    return {
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "optimizer_steps": optim.step.total.completed,
        "batches_completed": loop.epoch_loop.batch_progress.total.completed,
        "batches_that_stepped": loop.epoch_loop._batches_that_stepped,
        "scheduler_steps": loop.epoch_loop.scheduler_progress.total.completed,
    }


def resume_with_lightning(case: Case, tag_dir: Path, nxd_src: Path) -> dict[str, Any]:
    """Resume ``tag_dir`` through lightning 2.5.0's ``Trainer.fit(ckpt_path=...)``; one result dict."""
    import lightning.pytorch as pl
    import torch_xla.core.xla_model as xm
    from lightning.pytorch.accelerators import XLAAccelerator
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import XLACheckpointIO
    from lightning.pytorch.strategies import SingleDeviceXLAStrategy
    from neuronx_distributed.trainer import initialize_parallel_model, initialize_parallel_optimizer, load_checkpoint

    zero1 = bool(case.flags["zero1"])
    nxd_config = _nxd_config(case)
    model = initialize_parallel_model(nxd_config, _llama, False, case)
    device = xm.xla_device()
    start = recipe_weights(case, init_seed=int(case.manifest["seed"]) + 1)  # other weights: the load must matter
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n].to(device=device, dtype=p.dtype))
    opt = case.manifest["optimizer"]
    optimizer = initialize_parallel_optimizer(
        nxd_config, torch.optim.AdamW, _param_groups(case, model), lr=opt["lr"], betas=tuple(opt["betas"]),
        weight_decay=opt["weight_decay"],
    )
    scheduler = _scheduler(case, optimizer)
    grads = case.reference("grads_next.nxd")
    result: dict[str, Any] = {"way": "lightning", "lightning": pl.__version__}

    class NxdtWayIO(XLACheckpointIO):  # as NxDT's NLPCheckpointIO (the XLA strategy takes no other)
        """What NxDT's NLPCheckpointIO.load_checkpoint does (NxD's loader into dicts); no saving here."""

        def load_checkpoint(self, path: Any, map_location: Any = None) -> dict[str, Any]:
            model_sd: dict[str, Any] = {}
            optimizer_sd: dict[str, Any] = {}
            checkpoint = load_checkpoint(os.path.dirname(path), os.path.basename(path), model=model_sd,
                                         optimizer=optimizer_sd) or {}
            checkpoint["state_dict"] = model_sd
            checkpoint.setdefault("pytorch-lightning_version", "1.8.6")  # NxDT's default when absent
            checkpoint["optimizer_states"] = [optimizer_sd]
            result["user_content_keys"] = sorted(k for k in checkpoint if k not in ("state_dict", "optimizer_states"))
            return checkpoint

        def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("the resume check saves nothing")

        def remove_checkpoint(self, path: Any) -> None:
            raise AssertionError("the resume check removes nothing")

    class NeMoModelCheckpoint(ModelCheckpoint):
        """Stands in for NxDT's (NeMo's) checkpoint callback: same class name and settings, so the same state key."""

    NeMoModelCheckpoint.__qualname__ = "NeMoModelCheckpoint"  # lightning's state key names the class by qualname

    # NxDT's own tags hold NeMoModelCheckpoint's state; the fixture's (made without NeMo) lightning's own class's
    saved = torch.load(tag_dir / "user_content.pt", weights_only=True).get("callbacks", {})
    callback_class = ModelCheckpoint if any(k.startswith("ModelCheckpoint{") for k in saved) else NeMoModelCheckpoint

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # as NxDT's BaseModelModule: the NxD model's
            return self.model.state_dict(*args, **kwargs)

        def load_state_dict(self, state_dict: Any, strict: bool = False) -> Any:
            return self.model.load_state_dict(state_dict, strict=strict)

        def configure_optimizers(self) -> Any:
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def on_train_start(self) -> None:  # after lightning's restore, before step 3
            xm.mark_step()
            held = held_values(model, optimizer, zero1)
            result.update(
                load="ok",
                progress_after_load=_fit_progress(self.trainer),
                scheduler_last_epoch_after_load=scheduler.last_epoch,
                scheduler_last_lr_after_load=list(scheduler.get_last_lr()),
                optimizer_steps_after_load=_steps_in_state(optimizer.state_dict()),
                masters_equal_save_after_load=max_abs_diff(held, case.reference("params_at_save.nxd")) == 0.0,
                lr_after_load=[g["lr"] for g in optimizer.param_groups],
                callback_restored={"class": type(callback).__name__, "best_model_path": callback.best_model_path,
                                   "best_model_score": None if callback.best_model_score is None
                                   else float(callback.best_model_score)},
            )

        def on_train_end(self) -> None:  # step 3 taken, before lightning's teardown moves the model to the CPU
            xm.mark_step()
            after = held_values(model, optimizer, zero1)
            diff = max_abs_diff(after, case.reference("params_after_next.nxd"))
            result.update(
                progress_after_next=_fit_progress(self.trainer),
                after_next_equal=diff == 0.0,
                after_next_max_abs_diff=diff,
                lr_after_next=[g["lr"] for g in optimizer.param_groups],
                scheduler_last_epoch_after_next=scheduler.last_epoch,
            )
            resumed = case.reference("params_after_next_resumed.nxd")
            if resumed is not None:  # zero1_bf16: NxD's own resume of the files
                result["after_next_max_abs_diff_vs_nxd_resumed"] = max_abs_diff(after, resumed)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            terms = [(p * grads[n].to(device=device, dtype=p.dtype)).sum().float() for n, p in model.named_parameters()]
            return torch.stack(terms).sum()

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(list(range(16)), batch_size=1)

    saved_step = int(case.manifest["saved_after_step"])  # a run saving every that many steps saved this tag
    callback = callback_class(dirpath=str(tag_dir.parent), filename="unused--{step}-{consumed_samples}",
                              monitor="step", mode="max", save_top_k=1, every_n_train_steps=saved_step,
                              every_n_epochs=0)
    class XlaCpu(XLAAccelerator):
        """Lightning's XLA accelerator counts TPU chips only; here the one XLA device is XLA:CPU's."""

        @staticmethod
        def is_available() -> bool:
            return True

        @staticmethod
        def auto_device_count() -> int:
            return 1

        @staticmethod
        def parse_devices(devices: Any) -> int:
            return 1

        @staticmethod
        def get_parallel_devices(devices: Any) -> list[torch.device]:
            return [device]

    strategy = SingleDeviceXLAStrategy(device=device, accelerator=XlaCpu(), checkpoint_io=NxdtWayIO())
    trainer = pl.Trainer(
        strategy=strategy, devices=1, max_steps=saved_step + 1, max_epochs=-1, logger=False,
        callbacks=[callback], enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    try:
        trainer.fit(Module(), ckpt_path=str(tag_dir))
    except Exception as error:  # the outcome under test: recorded, not raised
        result.update(load=result.get("load", "failed"), error=f"{type(error).__name__}: {error}",
                      where=_where(error, nxd_src))
        return result
    if "after_next_equal" not in result:
        result.update(load=result.get("load", "failed"), error="lightning stopped before step 3")
    return result


# --------------------------------------------------------------------------------------------
# The record: fixture cases rewritten with --nxd-trainer nxdt, resumed by lightning

NXDT_NAME = "hf_llama--step=2-consumed_samples=8.0.ckpt"  # 2 steps x micro batch 4 x dp 1, as the NxDT case
LIGHTNING_CASES = ("nxdt_zero1_bf16_masters_xser", "zero1_fp32", "zero1_bf16_masters", "plain_fp32")


def nxdt_command(case: Case) -> list[str]:
    """ckptconv's arguments that rewrite ``case``'s tag as NxDT's (NxDT's name and side files)."""
    from .prove import writer_command  # noqa: PLC0415 (prove imports this module's neighbours; imported when used)

    return writer_command(case, name=NXDT_NAME, trainer="nxdt")


def trained_as_nxdt(fixtures: Path, name: str, nxdtrain: list[str], ckptconv: list[str], out: Path,
                    nxd_src: Path) -> dict[str, Any]:
    """nxdtrain trains steps 3-4 from fixture case ``name`` and saves in NxD's format (prove.py's TRAINED run); that
    tag rewritten with --nxd-trainer nxdt, resumed by lightning for step 5 (references: trained.py's)."""
    import shutil
    import subprocess

    from tests.torch_rows import placeholder_paths, tag_tree

    from .check import run_way
    from .prove import NXDTRAIN_RUN, TRAINED, filled
    from .stand_ins import install
    from .trained import make_case

    install(nxd_src)  # the references take the next step's rate from NxD's example scheduler
    case = Case.open(fixtures / name)
    src = out / "src" / case.manifest["tag"]
    shutil.copytree(fixtures / name / case.manifest["checkpoint_root"] / case.manifest["tag"], src)
    (src / "hf").mkdir()
    shutil.copy(fixtures / name / case.manifest["hf_config_file"], src / "hf" / "config.json")
    command = NXDTRAIN_RUN + TRAINED[name]
    run = subprocess.run(nxdtrain + [p.format(src=src, out=out / "ckpt") for p in command], capture_output=True,
                         text=True, cwd=out)
    if run.returncode != 0:
        raise SystemExit(f"nxdtrain from {name} failed (exit {run.returncode}): {(run.stdout + run.stderr)[-2000:]}")
    make_case(fixtures / name, out / "ckpt" / "step_4", out / "case", f"nxdtrain_from_{name}")
    tag_name = "hf_llama--step=4-consumed_samples=16.0.ckpt"  # 4 steps x --gbs 4
    rewrite = ["reshard", "{case}/ckpt/step_4", f"{{out}}/{tag_name}", "--tp", "1", "--pp", "1", "--optimizer-format",
               "nxd", "--zero1" if case.flags["zero1"] else "--no-zero1", "--nxd-trainer", "nxdt"]
    written = subprocess.run(ckptconv + filled(rewrite, out, out / "nxdt"), capture_output=True, text=True)
    if written.returncode != 0:
        raise SystemExit(f"{name}: the writer failed: {(written.stdout + written.stderr)[-2000:]}")
    result = run_way(out / "case", out / "nxdt" / tag_name, "lightning", nxd_src)
    print(f"nxdtrain_from_{name:18s} lightning load {result.get('load')} step-5 max abs diff from eager AdamW "
          f"{result.get('after_next_max_abs_diff')}{'  ' + result['error'] if result.get('error') else ''}")
    return {"nxdtrain": ["nxdtrain", *command[:2], "{case}/ckpt/step_2 (with hf/config.json added)", *command[3:]],
            "command": ["ckptconv", *rewrite], "tag": tag_name,
            "lightning_resume": {k: v for k, v in result.items() if k != "way"},
            "files": placeholder_paths(tag_tree(out / "nxdt" / tag_name), out / "nxdt")}


def prove_lightning(fixtures: Path, ckptconv: list[str], out_root: Path, nxd_src: Path, manifest: Path,
                    writer_repo: Path | None, nxdtrain: list[str] | None = None) -> int:
    """The NxDT fixture's own tag (the harness against lightning's record) and each ``LIGHTNING_CASES`` tag
    rewritten with ``--nxd-trainer nxdt``, resumed by lightning; written into the record's
    ``resumed_by_lightning`` (the rest of the record kept; temp + rename)."""
    import datetime
    import shutil
    import subprocess

    import lightning

    from tests.torch_rows import placeholder_paths, tag_tree

    from .check import run_way
    from .prove import TRAINED, _git_head, dumps, filled

    if out_root.exists():
        raise SystemExit(f"--out-root {out_root}: exists; choose a new folder")
    own = out_root / "own" / "ckpt"
    shutil.copytree(fixtures / LIGHTNING_CASES[0] / "ckpt", own)
    section: dict[str, Any] = {
        "about": "Fixture tags rewritten by ckptconv with --nxd-trainer nxdt, resumed the NxDT way through lightning's "
        "own Trainer.fit(ckpt_path=...) with a CheckpointIO doing what NxDT's NLPCheckpointIO.load_checkpoint does "
        "(tools/nxd_check/lightning_resume.py), then step 3 with the case's recorded gradients.",
        "lightning": lightning.__version__,
        "writer": {"command": "ckptconv", **(_git_head(writer_repo) or {})},
        "recorded": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "harness_on_nxdts_own_tag": run_way(fixtures / LIGHTNING_CASES[0], own / NXDT_NAME, "lightning", nxd_src),
        "cases": {},
    }
    if nxdtrain:
        section["trained_by_nxdtrain"] = {
            name: trained_as_nxdt(fixtures, name, nxdtrain, ckptconv, out_root / "trained" / name, nxd_src)
            for name in TRAINED
        }
    for name in LIGHTNING_CASES:
        case_dir = fixtures / name
        case = Case.open(case_dir)
        out = out_root / name
        command = nxdt_command(case)
        run = subprocess.run(ckptconv + filled(command, case_dir, out), capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"{name}: the writer failed (exit {run.returncode}): {(run.stdout + run.stderr)[-2000:]}")
        result = run_way(case_dir, out / NXDT_NAME, "lightning", nxd_src)
        section["cases"][name] = {
            "command": ["ckptconv", *command],
            "tag": NXDT_NAME,
            "lightning_resume": {k: v for k, v in result.items() if k != "way"},
            "files": placeholder_paths(tag_tree(out / NXDT_NAME), out),
        }
        print(f"{name:32s} lightning load {result.get('load')} step-3 max abs diff "
              f"{result.get('after_next_max_abs_diff')}{'  ' + result['error'] if result.get('error') else ''}")
    record = json.loads(manifest.read_text())
    record["resumed_by_lightning"] = section
    temporary = manifest.with_name(manifest.name + ".tmp")
    temporary.write_text(dumps(record))
    temporary.rename(manifest)
    return 0
