"""``nxdtrain export``: a training tag to HF through ckptconv's to-hf, one tag or every completed one (``--every``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nxdtrain.config.preflight import check_export_target, check_model_config
from nxdtrain.errors import TrainError


def export(src: str | Path, out: str | Path, *, quiet: bool = True, label: str = "OUT",
           tokenizer: str | Path | None = None) -> Any:
    """``nxdtrain export``: a tag (or a checkpoint root's newest completed tag) to an HF directory, via ckptconv's
    to-hf (``tokenizer``: its ``--tokenizer DIR``).

    An earlier HF export in OUT (a ckptconv.json of kind "hf") is replaced; anything else there is an error.
    """
    from ckptconv import RunOptions, to_hf
    from ckptconv.io import read_metadata, resolve_checkpoint

    check_export_target(out, label)  # in nxdtrain's words (ckptconv's would suggest its --overwrite)
    check_model_config(resolve_checkpoint(src)[0], takes_hf_config=False)
    out = Path(out)
    previous = read_metadata(out) if out.is_dir() else None
    # part=(0, 1): this one process writes the whole export, even inside a torchrun/srun world.
    options = RunOptions(part=(0, 1), quiet=quiet, overwrite=previous is not None and previous.kind == "hf")
    return to_hf(src, out, tokenizer=tokenizer, options=options)


def export_snapshots(root: str | Path, out: str | Path, *, watch: float | None = None, say: Any = None,
                     quiet: bool = True) -> Any:
    """``nxdtrain export ROOT OUT --every``: each completed tag of the checkpoint root (its ``done`` marker) not yet
    exported, to HF in ``OUT/step-N`` (:func:`ckptconv.engine.export_every`: resumable, idempotent; ``watch``
    seconds: again until Ctrl-C). Returns its :class:`~ckptconv.engine.snapshots.Snapshots`."""
    from ckptconv import RunOptions, to_hf
    from ckptconv.engine import export_every, outdir
    from ckptconv.io import DONE_MARKER, completed_tags, tag_step

    root, out = Path(root), Path(out)
    if not root.is_dir() or (root / DONE_MARKER).exists() or (root / "model").is_dir():
        raise TrainError(f"{root}: not a checkpoint root; --every takes the --checkpoint-dir that holds the "
                         "step_<N> tags" + ("" if root.is_dir() else " (no such directory)"))
    outdir.check_separate([root], out)
    options = RunOptions(part=(0, 1), quiet=quiet)  # one process writes each step, even inside a torchrun world

    def one(tag: Path, into: Path) -> Any:
        check_model_config(tag, takes_hf_config=False)
        return to_hf(tag, into, options=options)

    def steps() -> list[tuple[int, Path]]:
        return [(step, tag) for tag in completed_tags(root) if (step := tag_step(tag.name)) is not None]

    return export_every(steps, one, out, watch=watch, say=say, prog="nxdtrain")
