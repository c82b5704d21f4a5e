"""``nxd-compat --convert_to_full_state``: NxD shards as the official converter's one ``checkpoint.pt`` with HF keys."""

from __future__ import annotations

from pathlib import Path

from ckptconv.core.plan import plan_to_full_state
from ckptconv.engine.finalize import FinalizeSpec
from ckptconv.engine.options import RunOptions
from ckptconv.engine.run import Result, Run, fingerprint
from ckptconv.io.nxd import Flavour
from ckptconv.io.nxd_write import sink_factory
from ckptconv.sources.nxd import open_nxd


def to_full_state(src: str | Path, out: str | Path, *, config: str | Path, hints: dict[str, object],
                  options: RunOptions | None = None) -> Result:
    """What the official ``--convert_to_full_state`` writes: ``<out>/checkpoint.pt`` with HF keys."""
    run = Run("to-full-state", options)
    out = Path(out)
    opened = open_nxd(src, config=config, hints=hints, io=run.options.io, check=run.options.check)
    ckpt, spec, layout = opened.ckpt, opened.spec, opened.layout
    run.notes += opened.notes
    with ckpt:
        plan = plan_to_full_state(spec, layout, ckpt.dtypes())
        identity = fingerprint("full", layout.to_json(), sorted(str(p) for p in ckpt.files.values()))
        # The official tool writes checkpoint.pt and nothing else; so do we (no ckptconv.json).
        result = run.write(plan, ckpt, out, sink_factory(Flavour.PLAIN), FinalizeSpec(identity),
                           sources=[Path(src), ckpt.root])
    return run.finish(result, layout.to_json())
