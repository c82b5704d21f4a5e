"""Files of a tag that one rank opens: a resume of an NxD tag, one ``--part r/world`` of
``ckptconv reshard --optimizer-format nxd`` of it, and the same part of a reshard of nxdtrain's format 2.

Builds a 70B-shaped tag with tiny tensors (64 query and 8 K/V heads, 80 layers, hidden 256) at tp x pp with
nxdtrain's format-2 optimizer files, rewrites it in NxD's format over dp ranks with ZeRO-1 (as ``nxdtrain run
--optimizer-format nxd`` saves), then counts, with an audit hook on ``open``, the files under each tag that one
rank opens (counts, not timings: they decide the load on a shared file system; every rank of a world
reads the same number of files).

    python benchmarks/reads.py WORKDIR --tp 8 --pp 4 --dp 2 --layers 80
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.reshard_optim import make_training_tag
from benchmarks.synth import write_model
from ckptconv.commands.api import RunOptions, reshard, to_nxd
from ckptconv.core.layout import MODEL_DIR, ParallelLayout
from ckptconv.io.tags import OPTIM_DIR

_RECORDING: list[tuple[Path, Counter[str]]] = []  # (root, opens by relative path) while a count is on


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _RECORDING and isinstance(args[0], (str, os.PathLike)):
        root, opened = _RECORDING[-1]
        path = os.path.abspath(args[0])
        if path.startswith(str(root) + os.sep):
            opened[os.path.relpath(path, root)] += 1


_installed = False


@contextlib.contextmanager
def opened_under(root: Path) -> Iterator[Counter[str]]:
    """The files under ``root`` opened inside the block, each with how often (an audit hook: every ``open``,
    mmap'ed or read, by this process)."""
    global _installed
    if not _installed:  # an audit hook cannot be removed: one, recording only inside this block
        sys.addaudithook(_hook)
        _installed = True
    opened: Counter[str] = Counter()
    _RECORDING.append((Path(os.path.abspath(root)), opened))
    try:
        yield opened
    finally:
        _RECORDING.pop()


def build_tags(work: Path, *, tp: int, pp: int, dp: int, layers: int) -> tuple[Path, Path]:
    """(nxdtrain's format-2 tag, the same tag in NxD's optimizer format over ``dp`` ranks with ZeRO-1)."""
    write_model(work / "hf", "70b-tiny", layers, vocab=512)
    ours = work / "format2"
    to_nxd(work / "hf", ours, tp=tp, pp=pp, attention="qkv_linear", fuse_qkv=True, kv_size_multiplier=max(1, tp // 8),
           options=RunOptions(quiet=True))
    make_training_tag(ours, "CosineAnnealing")
    nxd = work / "nxd"
    reshard(ours, nxd, tp=tp, pp=pp, dp=dp, zero1=True, optimizer_format="nxd", options=RunOptions(quiet=True))
    return ours, nxd


def resume_reads(tag: Path, *, tp_rank: int, pp_rank: int) -> Counter[str]:
    """What one training rank of the tag's own layout opens to restore its weights and optimizer state."""
    from nxdtrain.checkpoint.restore import StageReader  # noqa: PLC0415
    from nxdtrain.checkpoint.resume import resolve_resume  # noqa: PLC0415 (nxdtrain only for this count)

    source = resolve_resume(str(tag), weights_only=False)  # the launcher's, once (nxdtrain run --nproc)
    with opened_under(tag) as opened:
        stage = StageReader(source, source.layout, tp_rank=tp_rank, pp_rank=pp_rank, optimizer=True)
        try:
            for name in stage.weights():
                if not name.endswith("inv_freq"):
                    stage.optimizer_state(name)
            stage.finish()
        finally:
            stage.close()
    return opened


def part_reads(tag: Path, out: Path, *, part: tuple[int, int], layout: ParallelLayout, dp: int) -> Counter[str]:
    """What one ``--part`` of ``reshard --optimizer-format nxd`` at the tag's layout opens (nxdtrain's save in
    NxD's format runs one per rank)."""
    with opened_under(tag) as opened:
        reshard(tag, out, tp=layout.tp, pp=layout.pp, dp=dp, zero1=True, optimizer_format="nxd",
                options=RunOptions(quiet=True, part=part, workers=1))
    return opened


def summary(opened: Counter[str], tag: Path) -> str:
    size = sum((tag / p).stat().st_size for p in opened)
    return (f"{len(opened)} files ({sum(opened.values())} opens, {size / 1e6:.2f} MB of files), "
            + ", ".join(f"{_among(opened, tag, d)} in {d}/" for d in (OPTIM_DIR, MODEL_DIR)))


def _among(opened: Counter[str], tag: Path, directory: str) -> str:
    """How many of the files in ``tag/directory`` were opened: "k of the n"."""
    mine = [p for p in opened if p.startswith(directory + "/")]
    total = sum(1 for p in (tag / directory).rglob("*") if p.is_file())
    return f"{len(mine)} of the {total}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--rank", type=int, default=None, help="the rank counted (default: one in the middle of tp, pp and dp)")
    args = parser.parse_args()
    work = args.work
    shutil.rmtree(work, ignore_errors=True)
    ours, nxd = build_tags(work, tp=args.tp, pp=args.pp, dp=args.dp, layers=args.layers)
    world = args.tp * args.pp * args.dp
    middle = (world // 2 + args.tp * (args.pp // 2) + args.tp // 2) % world  # no rank 0 of tp, pp or dp
    rank = middle if args.rank is None else args.rank
    tp_rank, pp_rank = rank % args.tp, (rank // args.tp) % args.pp
    layout = ParallelLayout(tp=args.tp, pp=args.pp)
    print(f"70B-shaped tag ({args.layers} layers, tiny tensors), tp {args.tp} x pp {args.pp} x dp {args.dp} = "
          f"{world} ranks; rank {rank} (tp rank {tp_rank}, pp rank {pp_rank})")
    print(f"(a) resume of NxD's tag: {summary(resume_reads(nxd, tp_rank=tp_rank, pp_rank=pp_rank), nxd)}")
    for label, tag in (("(b) reshard --part of NxD's tag", nxd), ("(c) reshard --part of format 2", ours)):
        opened = part_reads(tag, work / f"out-{tag.name}", part=(rank, world), layout=layout, dp=args.dp)
        print(f"{label}: {summary(opened, tag)}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
