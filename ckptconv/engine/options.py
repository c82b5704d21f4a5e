"""How to run a conversion (not what to convert): :class:`RunOptions` and its defaults.

Kept apart from :mod:`ckptconv.commands.api` and without torch, so the CLI can build its parser, and
refuse bad options, before anything heavy is imported.

Example:
    >>> RunOptions(workers=4).digest
    'blake3'
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptconv.errors import ConversionError
from ckptconv.io.digest import DEFAULT as DEFAULT_HASH
from ckptconv.io.digest import check_algorithm
from ckptconv.io.direct_io import WRITE_IO_MODES

MIN_DEFAULT_WORKERS = 8
# A conversion given no --workers runs at most one worker per this many bytes written: on a few MB, eight threads
# spend more passing the GIL than they overlap (the benchmark's 19 MB training tag: 0.12-0.16 s converting with
# 1-2 workers, 0.19-0.23 s with 8), while a 256 MiB conversion already gets all eight.
BYTES_PER_DEFAULT_WORKER = 32 * 2**20
# the rule, as --help and docs/cli.md state it
DEFAULT_WORKERS_RULE = f"the usable cores, at least {MIN_DEFAULT_WORKERS}, but one per {BYTES_PER_DEFAULT_WORKER >> 20} MiB written"
# to-dcp's default --max-file-size. Many files rather than few: writers of one file share its inode lock, and
# a file is hashed only once complete (70B x4 layers: 700MB files 1.63x cp, 5GB files 2.40x, one pair each on a
# loaded machine).
DEFAULT_DCP_FILE_SIZE = 10**9
# --dtype names -> the torch dtype attribute they cast to (None: keep); api maps them to torch dtypes.
DTYPES: dict[str, str | None] = {"keep": None, "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def usable_cpus(cgroup_cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota.

    ``os.cpu_count()`` counts the machine's cores, ignoring ``taskset``, Slurm's binding and a
    container's ``--cpus`` limit.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(cgroup_cpu_max) as limit:  # closed at once (a ResourceWarning otherwise)
            quota, period = limit.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def default_workers() -> int:
    """The usable cores, but at least 8: workers mostly wait on reads and writes, and the disk
    needs several requests in flight (on the 2-core CI machine 8 workers convert ~10% faster than 2)."""
    return max(usable_cpus(), MIN_DEFAULT_WORKERS)


def workers_for(nbytes: int, requested: int | None) -> int:
    """The worker threads for a conversion writing ``nbytes``: ``requested`` (``--workers``) when given, else
    :func:`default_workers`, but no more than one per :data:`BYTES_PER_DEFAULT_WORKER` written."""
    if requested is not None:
        return requested
    return max(1, min(default_workers(), -(-nbytes // BYTES_PER_DEFAULT_WORKER)))


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How to run a conversion (not what to convert)."""

    workers: int | None = None
    """Parallel workers (threads) over independent tensors; None: :func:`workers_for` the bytes written
    (:data:`DEFAULT_WORKERS_RULE`)."""
    max_memory: int = 2 * 2**30
    """Working-memory budget in bytes for tensor data in flight."""
    io: str = "read"
    """How to read inputs: 'read' (plain positional reads, the default: one copy, as fast as mmap
    on local disks, and safe on Lustre/NFS where mmap is slow and can SIGBUS) or 'mmap'."""
    write_io: str = "direct"
    """How to write outputs: 'direct' (the default: the page-aligned middle of each write of 1 MiB or more skips
    the page cache with O_DIRECT, saving the kernel's copy of every byte; a filesystem that refuses it, such as
    tmpfs, is written buffered) or 'buffered' (every byte through the page cache)."""
    quiet: bool = False
    """No progress bars or notes on stderr."""
    overwrite: bool = False
    """Replace an earlier, different ckptconv conversion in the output directory: only the files its
    ckptconv.json (or its temporary directory) lists are removed; anything else there is refused."""
    part: tuple[int, int] = (0, 1)
    """(K, N): convert the K-th of N disjoint sets of output files (the CLI fills it from --part,
    srun or torchrun; a library call converts everything unless told)."""
    hash: str = DEFAULT_HASH
    """Per-file digest recorded in ckptconv.json: 'blake3' (default, ~4.5 GB/s per core), 'sha256'
    (~0.4 GB/s per core without SHA instructions: slower than converting), or 'none' (sizes only)."""
    check: bool = True
    """Check every NxD input file read: its size and digest against the source's ckptconv.json and
    each torch zip record's CRC-32, computed from the bytes as they are read. False (--no-check)
    reads damaged or mismatched files anyway, for forensics."""

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ConversionError(f"--workers must be >= 1, got {self.workers}")
        if self.max_memory < 2**20:
            raise ConversionError(f"--max-memory must be at least 1 MiB, got {self.max_memory} bytes")
        if self.io not in ("mmap", "read"):
            raise ConversionError(f"--io must be 'mmap' or 'read', got {self.io!r}")
        if self.write_io not in WRITE_IO_MODES:
            raise ConversionError(f"--write-io must be {' or '.join(map(repr, WRITE_IO_MODES))}, got {self.write_io!r}")
        check_algorithm(self.digest)

    @property
    def digest(self) -> str | None:
        """The digest algorithm to record, or None for sizes only."""
        return None if self.hash == "none" else self.hash

# `--nxd-param-groups`: the rules of ckptconv.training.nxd_format.ranks.PARAM_GROUP_RULES and "one" (named here,
# where the CLI can read them without importing torch; ckptconv.training.nxd_format.write checks the two agree)
NXD_PARAM_GROUPS = ("bias-norm", "bias-LayerNorm", "bias", "one")
# `--nxd-trainer`: whose side files an NxD-format tag gets (ckptconv.training.nxd_format.side_files): NxD's example trainers'
# (scheduler.pt, user_content.pt with total_steps/batch_idx) or NxDT's (lightning's checkpoint dict)
NXD_TRAINERS = ("nxd-example", "nxdt")
