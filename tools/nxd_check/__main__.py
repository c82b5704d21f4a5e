"""Load a training tag with NxD 2.28's own ``load_checkpoint`` and continue one step: does NxD resume it exactly?

Runs in the XLA environment (``make setup-xla``; torch 2.9 + torch-xla 2.9 on XLA:CPU) with NxD's source
extracted outside this repository (``--nxd-src`` or ``$NXD_SRC``: the root of neuronx-distributed v2.28.0).
Nothing of NxD is stored here; the stand-ins for Neuron-only packages are in ``stand_ins.py``.

Commands (from the repository root)::

    # both ways (objects, dicts) for one tag against one fixture case's references; JSON to --out
    .venv-xla/bin/python -m tools.nxd_check check --case fixtures/nxdt-official/zero1_fp32 --tag DIR/step_2
    # every fixture case's own tag; fails unless each matches its recorded case.json -> resume_by_nxd
    .venv-xla/bin/python -m tools.nxd_check fixtures
    # each case's tag rewritten by ckptconv's NxD-format writer, resumed by NxD, recorded in
    # fixtures/nxdt-official/written_by_ckptconv.json (tests/training/nxd_format/test_nxd_loader_record.py keeps it tied to the writer)
    # fixture tags rewritten as NxDT's (--nxd-trainer nxdt), resumed through lightning 2.5.0's own restore, recorded
    # in the same file under resumed_by_lightning (lightning_resume.py)
    .venv-xla/bin/python -m tools.nxd_check lightning --ckptconv .venv/bin/ckptconv --out-root /tmp/l --writer-repo .
    .venv-xla/bin/python -m tools.nxd_check prove --ckptconv .venv/bin/ckptconv --nxdtrain .venv/bin/nxdtrain \\
        --out-root /tmp/proof --writer-repo .

Each way runs in a fresh process (``resume``, the internal command), as NxD keeps its state in globals.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from .check import FIXTURES, case_names, check, fixtures


def _nxd_src(value: str | None) -> Path:
    chosen = value or os.environ.get("NXD_SRC")
    if not chosen:
        raise SystemExit(
            "--nxd-src: not given and $NXD_SRC unset (the root of an extracted neuronx-distributed v2.28.0)"
        )
    return Path(chosen).resolve()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.nxd_check", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("check", "resume", "fixtures", "prove", "lightning"):
        p = sub.add_parser(name)
        p.add_argument("--nxd-src", help="root of neuronx-distributed v2.28.0 (default $NXD_SRC)")
        p.add_argument("--out", type=Path, help="write the JSON result here (default: print it)")
        if name == "lightning":
            p.add_argument("--ckptconv", required=True, help="how to run the writer")
            p.add_argument("--out-root", type=Path, required=True, help="a new folder for the written tags")
            p.add_argument("--writer-repo", type=Path, help="the writer's git checkout (its commit is recorded)")
            p.add_argument("--manifest", type=Path, default=FIXTURES / "written_by_ckptconv.json")
            p.add_argument("--nxdtrain", help="how to run nxdtrain (its trained tags, as NxDT's, too), optional")
        if name == "prove":
            p.add_argument("--ckptconv", required=True, help="how to run the writer, e.g. '/path/.venv/bin/ckptconv'")
            p.add_argument("--out-root", type=Path, required=True, help="a new folder for the written tags")
            p.add_argument("--writer-repo", type=Path, help="the writer's git checkout (its commit is recorded)")
            p.add_argument("--nxdtrain", help="how to run nxdtrain (its NxD-format saves are checked too), optional")
            p.add_argument("--manifest", type=Path, default=FIXTURES / "written_by_ckptconv.json")
        if name in ("fixtures", "prove"):
            p.add_argument("cases", nargs="*", help="case names (default: all)")
        elif name != "lightning":
            p.add_argument("--case", type=Path, required=True, help="a fixture case folder (fixtures/nxdt-official/X)")
            p.add_argument("--tag", type=Path, required=True, help="the tag directory to load")
        if name == "resume":
            p.add_argument("--way", required=True, help="objects, dicts or lightning")
    args = parser.parse_args(argv)
    nxd_src = _nxd_src(args.nxd_src)
    if args.command == "fixtures":
        return fixtures(nxd_src, args.cases, args.out)
    if args.command == "lightning":
        from .lightning_resume import prove_lightning

        return prove_lightning(FIXTURES, shlex.split(args.ckptconv), args.out_root.resolve(), nxd_src,
                               args.manifest.resolve(), args.writer_repo,
                               shlex.split(args.nxdtrain) if args.nxdtrain else None)
    if args.command == "prove":
        from .prove import prove

        names = args.cases or case_names()
        return prove(
            FIXTURES,
            names,
            shlex.split(args.ckptconv),
            args.out_root.resolve(),
            nxd_src,
            args.manifest.resolve(),
            args.writer_repo,
            shlex.split(args.nxdtrain) if args.nxdtrain else None,
        )
    if args.command == "check":
        result = check(args.case.resolve(), args.tag.resolve(), nxd_src)
    else:
        from .stand_ins import install

        install(nxd_src)
        import torch.distributed
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" process-group backend)

        from .case import Case
        from .resume import resume

        torch.distributed.init_process_group("xla", init_method="xla://")
        if args.way == "lightning":  # NxDT's way through lightning's own restore (lightning_resume.py)
            from .lightning_resume import resume_with_lightning

            result = resume_with_lightning(Case.open(args.case.resolve()), args.tag.resolve(), nxd_src)
        else:
            result = resume(Case.open(args.case.resolve()), args.tag.resolve(), args.way, nxd_src)
    text = json.dumps(result, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
