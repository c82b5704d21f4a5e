"""``nxdtrain`` command line: ``run`` trains, ``export`` writes an HF directory; ``data pack``, ``steps`` and
``plot`` are in :mod:`nxdtrain.commands`. Exit 0 ok, 1 error, 2 usage.

The ``run`` flags are generated from :mod:`nxdtrain.config.options` (one flag per leaf option, its help
from the field), so the flags, the YAML keys and the Python API cannot drift apart.

Parsing and the config checks import no torch (a test checks ``sys.modules``): ``--version``,
``--help`` and a bad flag or YAML key are answered at once; training imports it when it starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from ckptconv.cli import (
    DEBUG_ENV,
    DEBUG_HELP,
    Parser,
    every_flags,
    every_said,
    reported,
    run_guarded,
    warnings_as_notes,
)
from ckptconv.errors import ConversionError
from ckptconv.io import add_version_flag
from nxdtrain.commands import add_commands
from nxdtrain.config.options import GROUPS, REQUIRED_USAGE, TrainConfig, explain, flag_of, leaf_fields
from nxdtrain.config.yaml_config import read_yaml
from nxdtrain.errors import TrainError

PRELOAD = ("nxdtrain.train", "nxdtrain.model.pipeline")  # what the processes of --nproc need, imported once


def _add_option(parser: Any, f: Any) -> None:
    meta, kind = f.metadata, str(f.type)
    default = "" if f.default is None else f" (default: {f.default})"
    kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": meta["help"] + default}
    if "bool" in kind:
        # A switch named no_<x> is already the negative: --no-checkpoint, not --no-checkpoint/--no-no-checkpoint.
        kwargs["action"] = "store_true" if f.name.startswith("no_") else argparse.BooleanOptionalAction
    else:
        kwargs["type"] = float if "float" in kind else int if "int" in kind else str
        kwargs["metavar"] = f.name.upper()
        if meta["choices"]:
            kwargs.update(choices=meta["choices"], metavar=None)
    parser.add_argument(flag_of(f), *meta["aliases"], **kwargs)


# What the trainer is (docs/trainer.md's opening says the same; tests/test_cli_text.py holds both to the families)
DESCRIPTION = ("continual pretraining from NxD shards (tp x pp, ep for the mixtures of experts) of Llama, Mistral, "
               "Qwen2, Qwen3, Mixtral and Qwen3-MoE models, with exports to Hugging Face")
# The flags nxdtrain export shares with ckptconv to-hf, worded as there
TOKENIZER_HELP = ("directory whose tokenizer files (tokenizer.json, tokenizer_config.json, ...) go with the "
                  "export, replacing the tag's")
QUIET_HELP = "no progress or notes on stderr (the result, notes included, still prints)"
JSON_HELP = "print the result as JSON on stdout"
RUN_DESCRIPTION = ("Continue training an NxD checkpoint. Every run needs a weights source (--resume), rows (--data, "
                   "or --data synthetic for random tokens) and a place for its tags (--checkpoint-dir, or "
                   "--no-checkpoint to save nothing); each may come from --config FILE.yaml instead of a flag.")


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """One flag per config leaf, in the ``--help`` section its field names (``GROUPS`` order; required flags
    first in their section, then declaration order)."""
    sections = {title: parser.add_argument_group(title, description) for title, description in GROUPS.items()}
    order = list(GROUPS)
    fields = sorted((f for _, f in leaf_fields()),
                    key=lambda f: (order.index(f.metadata["group"]), not f.metadata["required"]))
    for f in fields:
        _add_option(sections[f.metadata["group"]], f)


def build_parser() -> argparse.ArgumentParser:
    # ckptconv's parser: a layout flag spelled another way (--tp2, --tp_size) gets "did you mean", an unknown flag
    # of a command that command's usage
    parser = Parser(prog="nxdtrain", description=DESCRIPTION)
    add_version_flag(parser)
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do (COMMAND --help for its flags)")
    run = sub.add_parser("run", help="train from --resume PATH (NxD shards) on --data, write NxD checkpoints",
                         usage=f"%(prog)s {REQUIRED_USAGE}\n{' ' * 20}[--config FILE.yaml] [OPTION ...]",
                         description=RUN_DESCRIPTION)
    run.add_argument("--config", dest="config_file", metavar="FILE.yaml",
                     help="YAML with the same options as the flags (or NxDT-shaped keys); flags override it")
    add_run_options(run)
    export = sub.add_parser("export", help="a checkpoint tag (or a root's newest completed tag) -> HF directory")
    export.add_argument("src", metavar="TAG_OR_ROOT",
                        help="a step_<N> tag, or a checkpoint root (its newest completed tag)")
    export.add_argument("out", metavar="OUT",
                        help="new HF directory (empty, or an earlier HF export, which is replaced)")
    export.add_argument("--tokenizer", metavar="DIR", default=None, help=TOKENIZER_HELP)
    export.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    export.add_argument("--json", action="store_true", help=JSON_HELP)
    every_flags(export, "step_<N> tag (its done marker)")
    add_commands(sub)  # data pack, steps, plot
    return parser


def load_config(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the YAML file, then the flags given on the command line."""
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config_file", "debug")}
    if not args.config_file:
        return TrainConfig.from_flat(flags, source="flags")
    options = read_yaml(args.config_file)
    values, origins = options.under(flags)
    for line in options.notes:
        print(f"nxdtrain: {line}", file=sys.stderr)
    return TrainConfig.from_flat(values, source=f"--config {args.config_file}", origins=origins)


def _run(args: argparse.Namespace) -> int:
    config = load_config(args)  # a bad flag or YAML key fails here, before torch is imported
    try:
        return _train(config, debug=args.debug)
    except TrainError as exc:  # name the YAML key where a value came from the file
        raise TrainError(explain(str(exc), config.origins)) from None


def _train(config: TrainConfig, *, debug: bool) -> int:
    from nxdtrain.parallel.dist import spawn
    from nxdtrain.train import prepare, run_worker, train

    if not config.nproc:
        train(config)
        return 0
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise ConversionError("--nproc starts its own processes; under torchrun or srun leave it out")
    plan = prepare(config, config.nproc)  # fail here, once, before starting anything
    if debug:
        os.environ[DEBUG_ENV] = "1"  # the processes print their tracebacks too
    # the data checked and the tag read once: the workers get what the launcher found
    return spawn(run_worker, (config, plan.data_checks, plan.resolved), config.nproc, preload=PRELOAD)


def _export(args: argparse.Namespace) -> int:
    say = every_said(args, "nxdtrain")
    from nxdtrain.checkpoint.export import export, export_snapshots

    if args.every:
        if args.tokenizer:  # each step's export would need it copied: not built, so refused rather than dropped
            raise ConversionError("--tokenizer with --every: export the steps without it, or each step with "
                                  "`nxdtrain export TAG OUT --tokenizer DIR`")
        done = export_snapshots(args.src, args.out, watch=args.watch, say=say, quiet=args.quiet or args.json)
        print(f"exported {len(done.exported)} step(s) of {args.src} into {done.out} ({len(done.up_to_date)} exported "
              f"before, {len(done.skipped)} removed by the run)")
        return 0
    reported("nxdtrain", lambda: export(args.src, args.out, quiet=args.quiet or args.json, tokenizer=args.tokenizer),
             as_json=args.json, quiet=args.quiet)  # printed as ckptconv to-hf prints its result
    return 0


def _dispatch(args: argparse.Namespace) -> int:
    if hasattr(args, "handler"):  # data pack, steps, plot
        return int(args.handler(args))
    return _run(args) if args.command == "run" else _export(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # One line per failure (ckptconv's handler); --debug or CKPTCONV_DEBUG=1 shows the traceback. A warning (no
    # tokenizer in an export...) is said once as "nxdtrain: note:", never as Python's file:line: UserWarning.
    return run_guarded("nxdtrain", lambda: _noted(args), debug=args.debug, as_json=getattr(args, "json", False),
                       resume_hint="rerun with --resume CHECKPOINT_DIR to continue from the last tag")


def _noted(args: argparse.Namespace) -> int:
    with warnings_as_notes("nxdtrain", quiet=getattr(args, "quiet", False) or getattr(args, "json", False)):
        return _dispatch(args)


if __name__ == "__main__":
    sys.exit(main())
