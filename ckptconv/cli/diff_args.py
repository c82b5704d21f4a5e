"""``ckptconv diff``'s flags and its one library call (kept apart from :mod:`ckptconv.cli.main`, near its size cap)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from ckptconv.engine.options import MIN_DEFAULT_WORKERS


def add_diff_parser(sub: Any, parse_size: Callable[[str], int], json_help: str) -> None:
    p = sub.add_parser("diff", help="compare two checkpoints of one model in any formats (HF, NxD, DCP) tensor by tensor")
    p.add_argument("a", help="a checkpoint: HF directory, NxD shards or training tag, DCP directory or TorchTitan root")
    p.add_argument("b", help="the other checkpoint, in any of those formats")
    p.add_argument("--config", help="HF config.json (for a side that records none, e.g. a TorchTitan run)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance, of B's values (default 0: exact)")
    p.add_argument("--max-memory", type=parse_size, default=2 << 30,
                   help="memory for the bands compared at once, both sides (default 2GiB)")
    rule = f"the usable cores, at least {MIN_DEFAULT_WORKERS}"
    workers = p.add_argument("--workers", type=int, default=None,
                             help=f"tensors compared at once, each in its share of --max-memory (default: {rule})")
    workers.default_rule = rule  # docs/cli.md's default column (tools/cli_reference.py)
    p.add_argument("--io", choices=("mmap", "read"), default="read", help="input reads: read (default) or mmap")
    p.add_argument("--quiet", action="store_true", help="no progress bar of the tensors compared")
    p.add_argument("--json", action="store_true", help=json_help)


def run_diff(args: argparse.Namespace) -> Any:
    from ckptconv.commands.diff import diff

    result = diff(args.a, args.b, config=args.config, atol=args.atol, rtol=args.rtol, max_memory=args.max_memory,
                  io=args.io, check=not args.no_check, workers=args.workers, progress=not (args.quiet or args.json) and sys.stderr.isatty())
    if args.json:
        return result
    # on a terminal: the tensors that are not equal (the JSON lists them all)
    return {**result, "tensors": [t for t in result["tensors"] if t["status"] != "equal"]}
