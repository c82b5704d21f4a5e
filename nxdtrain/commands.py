"""The helper commands of ``nxdtrain``: ``data pack``, ``steps`` and ``plot`` (thin over their modules)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from nxdtrain.config.options import LONG_ROWS
from nxdtrain.errors import TrainError


def add_commands(sub: Any) -> None:
    """Register ``data pack``, ``steps`` and ``plot`` on the ``nxdtrain`` subparsers."""
    data = sub.add_parser("data", help="prepare training data")
    data_sub = data.add_subparsers(dest="data_command", required=True, help="what to do with the data")
    pack = data_sub.add_parser("pack", help="tokenize text and pack it into rows of --seq-len (a datasets dir)")
    pack.add_argument("inputs", nargs="+", metavar="INPUT",
                      help=".txt, .jsonl/.json (lines or a list; .gz too), .parquet, a datasets save_to_disk dir, "
                           "or a directory of such files (sorted)")
    pack.add_argument("out", metavar="OUT", help="new (or empty) directory for the save_to_disk dataset")
    pack.add_argument("--tokenizer", required=True, metavar="PATH",
                      help="HF model dir, a converted dir (its hf/ files), or a tokenizer.json")
    pack.add_argument("--seq-len", type=int, required=True, metavar="N", help="tokens per row")
    pack.add_argument("--text-field", default="text", metavar="NAME",
                      help="the text column of json/parquet/datasets inputs (default: text)")
    pack.add_argument("--txt-docs", default="file", choices=("file", "paragraph", "line"),
                      help="what one document of a .txt file is (default: the whole file)")
    pack.add_argument("--eos-id", type=int, metavar="ID",
                      help="token id between documents (default: the tokenizer's EOS)")
    pack.add_argument("--pad", action="store_true",
                      help="pad the last partial row (pad token, else EOS) instead of dropping it")
    pack.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizing processes (default: 1)")
    pack.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    pack.set_defaults(handler=_pack)

    steps = sub.add_parser("steps", help="steps per epoch, total and warmup steps for a dataset and a layout")
    steps.add_argument("--data", required=True, metavar="PATH", help="what nxdtrain run --data takes")
    steps.add_argument("--gbs", type=int, required=True, metavar="N", help="global batch size in rows")
    steps.add_argument("--mbs", type=int, default=1, metavar="N", help="microbatch size in rows (default: 1)")
    steps.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel degree (default: 1)")
    steps.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline-parallel degree (default: 1)")
    steps.add_argument("--context-parallel", type=int, default=1, metavar="N",
                       help="context-parallel degree (default: 1; its ranks read the same rows)")
    world = steps.add_mutually_exclusive_group()
    world.add_argument("--nproc", type=int, metavar="N", help="world size (default: tp x pp x cp, i.e. dp 1)")
    world.add_argument("--nodes", type=int, metavar="K", help="nodes (world = K x --cores-per-node)")
    steps.add_argument("--cores-per-node", type=int, metavar="C",
                       help="processes per node (NeuronCores or GPUs); with --nodes")
    steps.add_argument("--seq-len", type=int, metavar="N", help="tokens per row (default: the length of row 0)")
    steps.add_argument("--long-rows", default="cut", choices=LONG_ROWS,
                       help="rows longer than --seq-len, as nxdtrain run's --long-rows (default: cut)")
    steps.add_argument("--epochs", type=int, default=1, metavar="E", help="epochs (default: 1)")
    steps.add_argument("--warmup", type=float, default=0.0, metavar="R",
                       help="warmup as a fraction (< 1) of the total steps or a step count (default: 0)")
    steps.add_argument("--json", action="store_true", help="print one JSON object")
    steps.set_defaults(handler=_steps)

    plot = sub.add_parser("plot", help="draw loss, lr and tokens/s of a --log-jsonl file into a PNG")
    plot.add_argument("log", metavar="LOG.jsonl", help="the --log-jsonl file of a run")
    plot.add_argument("-o", "--out", default="curves.png", metavar="PNG", help="output image (default: curves.png)")
    plot.add_argument("--title", help="figure title (default: the log's name and step range)")
    plot.set_defaults(handler=_plot)


def _pack(args: argparse.Namespace) -> int:
    from nxdtrain.data.pack import pack, summary_json, summary_lines

    summary = pack(args.inputs, args.out, tokenizer=args.tokenizer, seq_len=args.seq_len, pad=args.pad,
                   workers=args.workers, text_field=args.text_field, txt_docs=args.txt_docs, eos_id=args.eos_id,
                   progress=not args.json)
    print(summary_json(summary) if args.json else "\n".join(summary_lines(summary, pad=args.pad)))
    return 0


def steps_report(*, data: str, gbs: int, mbs: int = 1, tp: int = 1, pp: int = 1, world: int | None = None,
                 seq_len: int | None = None, epochs: int = 1, warmup: float = 0.0, cp: int = 1,
                 long_rows: str = "cut") -> dict[str, Any]:
    """Everything ``nxdtrain steps`` prints; the numbers come from the functions ``run`` uses."""
    from nxdtrain.config.options import OptimConfig
    from nxdtrain.data.check import check_rows
    from nxdtrain.data.epochs import data_parallel, run_length
    from nxdtrain.data.rows import open_rows

    OptimConfig(warmup=warmup)  # the same check (and message) as run's --warmup
    for flag, value in (("--gbs", gbs), ("--mbs", mbs), ("--tp", tp), ("--pp", pp), ("--context-parallel", cp),
                        ("--epochs", epochs)):
        if value < 1:
            raise TrainError(f"{flag} must be an integer >= 1, got {value}")
    if data == "synthetic":
        raise TrainError("--data synthetic has no size; give a dataset")
    rows = open_rows(data, vocab=1, seq_len=seq_len or 2, seed=0)
    assert rows.size is not None
    seq = seq_len or len(rows.row(0))
    checked = check_rows(rows, seq_len=seq, long_rows=long_rows)  # what run checks before its first process
    rows = checked.rows
    assert rows.size is not None
    world = world or tp * pp * cp
    dp, microbatches = data_parallel(world=world, tp=tp, pp=pp, gbs=gbs, mbs=mbs, cp=cp)
    length = run_length(rows=rows.size, gbs=gbs, epochs=epochs, warmup=warmup)
    return {"data": data, "rows": rows.size, "seq_len": seq, "tokens": rows.size * seq, "world": world, "tp": tp,
            "pp": pp, "cp": cp, "dp": dp, "gbs": gbs, "mbs": mbs, "microbatches": microbatches,
            "steps_per_epoch": length.steps_per_epoch, "rows_dropped_per_epoch": length.dropped_per_epoch,
            "epochs": epochs, "steps": length.steps, "warmup": length.warmup,
            "tokens_trained": length.steps * gbs * seq, "rows_checked": checked.checked,
            "long_rows": checked.long_rows, "tokens_never_trained": checked.dropped_tokens}


STEPS_LABELS = {
    "rows": "rows", "seq_len": "tokens per row", "tokens": "tokens (rows x tokens per row)", "world": "world size", "dp": "data parallel (dp)",
    "microbatches": "microbatches per dp rank", "steps_per_epoch": "steps per epoch",
    "rows_dropped_per_epoch": "rows dropped per epoch", "epochs": "epochs", "steps": "total steps",
    "warmup": "warmup steps", "tokens_trained": "tokens trained", "rows_checked": "rows checked (lengths)",
    "long_rows": "rows longer than tokens per row", "tokens_never_trained": "their tokens never trained (--long-rows)",
}


def _steps(args: argparse.Namespace) -> int:
    if (args.nodes is None) != (args.cores_per_node is None):
        raise TrainError("--nodes and --cores-per-node go together (world = nodes x cores per node)")
    world = args.nproc if args.nodes is None else args.nodes * args.cores_per_node
    report = steps_report(data=args.data, gbs=args.gbs, mbs=args.mbs, tp=args.tp, pp=args.pp, world=world,
                          seq_len=args.seq_len, epochs=args.epochs, warmup=args.warmup, cp=args.context_parallel,
                          long_rows=args.long_rows)
    if args.json:
        print(json.dumps(report))
        return 0
    from ckptconv.cli import key_values

    key_values([(label, f"{report[key]:,}") for key, label in STEPS_LABELS.items()], right=True,
               title=f"{report['data']}: gbs {report['gbs']}, mbs {report['mbs']}, tp {report['tp']} x pp {report['pp']}"
                     + (f" x cp {report['cp']}" if report["cp"] > 1 else ""))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from nxdtrain.plot import plot_log

    plot_log(args.log, args.out, title=args.title)
    print(args.out)
    return 0
