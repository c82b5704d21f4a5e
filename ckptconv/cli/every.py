"""``--every`` and ``--watch SECONDS``, the flags of a snapshot export (``ckptconv from-dcp``, ``nxdtrain export``):
parsed here, run by :func:`ckptconv.engine.snapshots.export_every`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ckptconv.errors import ConversionError

EVERY_HELP = ("SRC is a run's checkpoint folder: export each completed {step} not yet in OUT into OUT/step-N (one "
              "line each; a step half-exported by a killed call is redone, an exported one skipped, one the run "
              "deleted meanwhile skipped with a note)")
WATCH_HELP = "with --every: look again every SECONDS until Ctrl-C (which finishes the step in flight, then exits 0)"


def every_flags(p: argparse.ArgumentParser, step: str) -> None:
    """``--every`` and ``--watch SECONDS`` (from-dcp, nxdtrain export)."""
    p.add_argument("--every", action="store_true", help=EVERY_HELP.format(step=step))
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS", help=WATCH_HELP)


def every_said(args: argparse.Namespace, prog: str) -> Callable[[str], None] | None:
    """The one line per step of ``--every`` (on stderr; none with --quiet/--json); ``--watch`` without it refused."""
    if args.watch is not None and not args.every:
        raise ConversionError(f"--watch {args.watch:g} needs --every (it watches a checkpoint folder for new steps)")
    return None if getattr(args, "quiet", False) or getattr(args, "json", False) else lambda line: print(f"{prog}: {line}", file=sys.stderr, flush=True)
