"""Processes and process groups: who am I, who are my tp/pp/dp peers, and how the world starts.

NxD's rank order (``parallel_state.initialize_model_parallel`` reshapes ``arange(world)`` to
``[pp, dp, cp, tp]``): ``rank = pp_rank·(dp·cp·tp) + dp_rank·(cp·tp) + cp_rank·tp + tp_rank`` (tp
fastest, then context parallel, then dp, pp slowest), so the tp ranks of one stage are adjacent (one
node) and pipeline stages span nodes. With cp 1 this is ``pp_rank·(dp·tp) + dp_rank·tp + tp_rank``.

    >>> coords(5, tp=2, dp=2, pp=2)
    Coords(tp=1, dp=0, pp=1, cp=0)
    >>> group_ranks("dp", tp=2, dp=2, pp=2)
    [[0, 2], [1, 3], [4, 6], [5, 7]]

tp 8, cp 2, dp 2 (32 ranks): the cp groups pair ranks one tp group apart, the dp groups two:

    >>> group_ranks("cp", tp=8, dp=2, pp=1, cp=2)[:3]
    [[0, 8], [1, 9], [2, 10]]
    >>> group_ranks("dp", tp=8, dp=2, pp=1, cp=2)[:2]
    [[0, 16], [1, 17]]
    >>> coords(25, tp=8, dp=2, pp=1, cp=2)
    Coords(tp=1, dp=1, pp=0, cp=1)
    >>> first_slurm_host("gpu-[017-020,031],cpu7")
    'gpu-017'
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import astuple, dataclass
from datetime import timedelta
from typing import Any, NamedTuple

from ckptconv.engine import detect_launch, local_world_size  # noqa: F401  (local_world_size: re-exported)
from ckptconv.training import ep_fits, expert_dp_groups, optimizer_ep_rank
from nxdtrain.errors import TrainError, failure_line
from nxdtrain.parallel.experts import EpGroup
from nxdtrain.parallel.lifeline import die_with, start_time
from nxdtrain.parallel.preempt import handle, restore

DEFAULT_PORT = 29500
# Set in the processes spawn() starts: the file their process group meets in (a free port found first could
# be taken by another program before the store binds it).
RENDEZVOUS_ENV = "NXDTRAIN_RENDEZVOUS_FILE"


class Coords(NamedTuple):
    tp: int
    dp: int
    pp: int
    cp: int = 0  # context-parallel rank (last: a cp-1 world's coordinates read as before)


def rank_of(c: Coords, *, tp: int, dp: int, cp: int = 1) -> int:
    """Global rank of coordinates (NxD order)."""
    return ((c.pp * dp + c.dp) * cp + c.cp) * tp + c.tp


def coords(rank: int, *, tp: int, dp: int, pp: int, cp: int = 1) -> Coords:
    """(tp, dp, pp, cp) coordinates of a global rank (NxD order)."""
    assert 0 <= rank < tp * dp * pp * cp, (rank, tp, dp, pp, cp)
    return Coords(rank % tp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp), (rank // tp) % cp)


GROUP_KINDS = {"tp": ("tp",), "dp": ("dp",), "pp": ("pp",), "cp": ("cp",), "mp": ("tp", "pp"), "dpcp": ("dp", "cp")}


def group_ranks(kind: str, *, tp: int, dp: int, pp: int, cp: int = 1) -> list[list[int]]:
    """All groups of one kind as lists of global ranks.

    ``tp``/``dp``/``pp``/``cp``: ranks that differ only in that coordinate; ``mp`` (model parallel): the
    tp x pp ranks of one data-parallel (and context-parallel) replica, over which a gradient norm is
    summed; ``dpcp``: the dp x cp ranks holding the same shard (gradients are summed and ZeRO-1 shards
    over them, dp-major as NxD's zero1 sharding groups).
    """
    varying = GROUP_KINDS[kind]
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(tp * dp * pp * cp):
        c = coords(rank, tp=tp, dp=dp, pp=pp, cp=cp)
        fixed = tuple(getattr(c, name) for name in Coords._fields if name not in varying)
        groups.setdefault(fixed, []).append(rank)
    return list(groups.values())


# --------------------------------------------------------------------------------------------
# Environment: torchrun, Slurm, or a single process


@dataclass(frozen=True)
class WorldEnv:
    """Where this process sits in the job and how to reach rank 0."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


_HOSTLIST_RE = re.compile(r"^([^\[,]+)(?:\[([^\]]+)\])?")


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list (``node[001-004,9],x`` -> ``node001``)."""
    m = _HOSTLIST_RE.match(nodelist.strip())
    if not m:
        raise TrainError(f"SLURM_JOB_NODELIST {nodelist!r}: cannot read the first host name")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def detect_env(environ: Mapping[str, str] | None = None) -> WorldEnv:
    """The launcher's place for this process (:func:`ckptconv.engine.launcher.detect_launch`: torchrun over Slurm) and
    how to reach rank 0."""
    env = os.environ if environ is None else environ
    rank, world, local, launcher = astuple(detect_launch(env))
    if launcher == "single":
        return WorldEnv(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT", "0") or 0), "single")
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if launcher == "slurm" and nodelist:
            addr = first_slurm_host(nodelist)
        elif world == 1:
            addr = "127.0.0.1"
        else:
            raise TrainError(f"{launcher}: MASTER_ADDR is not set (and no SLURM_JOB_NODELIST to take it from)")
    port = env.get("MASTER_PORT")
    if not port and launcher == "slurm" and env.get("SLURM_JOB_ID"):
        port = str(10000 + int(env["SLURM_JOB_ID"]) % 20000)  # one port per job: two jobs on a node don't collide
    return WorldEnv(rank, world, local, addr, int(port or DEFAULT_PORT), launcher)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_world(env: WorldEnv, timeout_s: float, device: str = "auto") -> Any:
    """Join the process group of ``device``'s backend (gloo / nccl / xla); return this process's
    :class:`nxdtrain.device.Device`."""
    import torch.distributed as dist

    from nxdtrain.device import open_device, resolve_kind

    dev = open_device(resolve_kind(device), env.local_rank)
    port = env.master_port or (free_port() if env.world_size == 1 else DEFAULT_PORT)
    if dev.is_xla:
        # torch-xla's rendezvous ("xla://") takes rank and world size from the PJRT runtime and the
        # address from MASTER_ADDR/MASTER_PORT; both must agree with the launcher's.
        given = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
        os.environ.update(MASTER_ADDR=given["MASTER_ADDR"] or env.master_addr, MASTER_PORT=given["MASTER_PORT"] or str(port))
        try:
            dist.init_process_group("xla", init_method="xla://", timeout=timedelta(seconds=timeout_s))
        finally:  # a later world in this process (tests) picks its own port again
            for name, value in given.items():
                if value is None:
                    os.environ.pop(name, None)
        if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
            found = f"rank {dist.get_rank()} of {dist.get_world_size()}"
            dist.destroy_process_group()
            raise TrainError(f"--device xla: the XLA runtime sees this process as {found}, the launcher "
                             f"({env.launcher}) as rank {env.rank} of {env.world_size}; multi-process XLA needs a "
                             "PJRT device with distributed support (Neuron, TPU), not XLA:CPU")
        return dev
    timeout = timedelta(seconds=timeout_s)
    # NCCL told its rank's GPU up front: otherwise it guesses from the global rank and barrier() warns
    bound: dict[str, Any] = {"device_id": dev.torch_device} if dev.kind == "cuda" else {}
    rendezvous = os.environ.get(RENDEZVOUS_ENV)
    if rendezvous:  # a world spawned here: a file in the launcher's temp dir, no port another process can take
        dist.init_process_group(dev.backend, init_method=f"file://{rendezvous}", rank=env.rank,
                                world_size=env.world_size, timeout=timeout, **bound)
    elif env.world_size == 1 and not env.master_port:  # the OS picks the port as the store binds it
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
        dist.init_process_group(dev.backend, store=store, rank=0, world_size=1, timeout=timeout, **bound)
    else:
        dist.init_process_group(dev.backend, init_method=f"tcp://{env.master_addr}:{port}", rank=env.rank,
                                world_size=env.world_size, timeout=timeout, **bound)
    return dev


def host_group(timeout_s: float) -> Any:
    """A gloo group of the whole world, for Python objects on the host (None: the default group is gloo already):
    the xla backend broadcasts no Python objects, and nccl's would go through the GPU. Its collectives wait up to
    ``timeout_s`` (--dist-timeout, as the run's other groups; torch's default would be 30 minutes). Collective; the
    caller destroys it (``dist.destroy_process_group(group)``) when it is not None."""
    import torch.distributed as dist

    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _portable(exc: Exception) -> Exception:
    """``exc`` as another process can raise it: itself if it survives pickling, else its message."""
    import pickle

    try:
        return pickle.loads(pickle.dumps(exc))  # type: ignore[no-any-return]
    except Exception:
        return TrainError(f"{type(exc).__name__}: {exc}")


def from_rank0(compute: Callable[[], Any], group: Any = None) -> Any:
    """``compute()`` run on rank 0 only; its result on every rank of ``group`` (:func:`host_group`), or, when it
    raised, its exception raised on every rank: a refusal on rank 0 stops the others with the same message instead
    of leaving them waiting in their next collective. Collective. The result travels pickled: it must pickle, and it
    is read only by this job's own processes."""
    import torch.distributed as dist

    failure: Exception | None = None
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", compute())
        except Exception as exc:  # every kind the CLI describes in one line (OSError, ConversionError, ...)
            failure = exc
            payload[0] = ("error", _portable(exc))
    dist.broadcast_object_list(payload, src=0, group=group)
    if failure is not None:
        raise failure  # rank 0: its own exception, with its traceback
    kind, value = payload[0]
    if kind == "error":
        raise value
    return value


def stop_together(failure: Exception | None, group: Any = None) -> None:
    """Collective: if any rank of ``group`` failed, every rank raises (a failed rank its own exception, the others the
    lowest failed rank's), so that no rank goes on to wait for one that stopped."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, None if failure is None else _portable(failure), group=group)
    if failure is not None:
        raise failure
    first = next((f for f in gathered if f is not None), None)
    if first is not None:
        raise first


# --------------------------------------------------------------------------------------------
# Process groups of one run


class Mesh:
    """This rank's coordinates and process groups for a tp x cp x dp x pp world.

    Every rank creates every group in the same order (``new_group`` is collective), and keeps
    the one it belongs to. A group of one rank is kept as ``None``: collectives over it are no-ops.
    """

    def __init__(self, *, tp: int, pp: int, timeout_s: float, cp: int = 1, ep: int = 1) -> None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        if world % (tp * pp * cp):
            raise TrainError(f"world size {world} is not a multiple of --tp {tp} x --pp {pp} x --context-parallel {cp}")
        self.tp, self.pp, self.cp, self.dp = tp, pp, cp, world // (tp * pp * cp)
        self.ep = ep  # carved out of dp (NxD's expert mesh): its groups are made by expert_groups, for MoE models
        self.rank, self.world = rank, world
        self.coords = coords(rank, tp=tp, dp=self.dp, pp=pp, cp=cp)
        self._timeout = timedelta(seconds=timeout_s)
        self.xla = dist.get_backend() == "xla"
        # Barriers and object gathers (checkpoint bookkeeping) on the host: the xla backend's barrier
        # returns at once and it gathers no Python objects.
        self.host_group = dist.new_group(backend="gloo", timeout=self._timeout) if self.xla else None
        sizes = {"tp": tp, "dp": self.dp, "pp": pp, "cp": cp}
        self.tp_group = self._mine(group_ranks("tp", **sizes))
        self.dp_group = self._mine(group_ranks("dp", **sizes))
        self.mp_group = self._mine(group_ranks("mp", **sizes))
        # The pipeline always gets a real group: torch.distributed.pipelining addresses peers through it.
        self.pp_group = self._mine(group_ranks("pp", **sizes), keep_single=True)
        # Created only with cp > 1, so a cp-1 world makes exactly the groups it made before.
        self.cp_ranks = next(r for r in group_ranks("cp", **sizes) if rank in r)  # this rank's ring, in cp order
        self.cp_group = self._mine(group_ranks("cp", **sizes)) if cp > 1 else None
        self.dpcp_group = self._mine(group_ranks("dpcp", **sizes)) if cp > 1 else self.dp_group

    @property
    def dpcp_rank(self) -> int:
        """This rank's index in the dp x cp group (dp-major): its ZeRO-1 shard."""
        return self.coords.dp * self.cp + self.coords.cp

    def _mine(self, groups: Sequence[Sequence[int]], *, keep_single: bool = False) -> Any:
        import torch.distributed as dist

        found = None
        # On xla a collective is one XLA op over replica groups: torch-xla takes them all from pg_options.
        options: dict[str, Any] = {"pg_options": {"xla_pg_options": {"mesh": [list(r) for r in groups]}}} if self.xla else {}
        for ranks in groups:
            if len(ranks) == 1 and not keep_single:
                continue
            group = dist.new_group(list(ranks), timeout=self._timeout, **options)
            if self.rank in ranks:
                found = group
        return found

    def tp_subgroups(self, partition: Sequence[Sequence[int]]) -> Any:
        """Groups of tp ranks (e.g. the replicas of one K/V head) inside every tp group; this rank's one."""
        sizes = {"tp": self.tp, "dp": self.dp, "cp": self.cp}
        groups = [
            [rank_of(Coords(t, dp, pp, c), **sizes) for t in part]
            for pp in range(self.pp) for dp in range(self.dp) for c in range(self.cp) for part in partition
        ]
        return self._mine(groups)

    @property
    def ep_rank(self) -> int:
        """This rank's ep rank: which experts it holds (ckptconv's ``optimizer_ep_rank`` of its dp rank)."""
        return optimizer_ep_rank(self.coords.dp, self.ep)

    def expert_groups(self) -> tuple[Any, Any]:
        """(ep group, expert-data-parallel group) of this rank, NxD's ``[PP, DP_exp, EP, TP]`` expert mesh
        (ckptconv's ``expert_dp_groups``: ``dp_rank = dp_exp_rank * ep + ep_rank``). The ep group: the ep ranks of one
        (pp, dp_exp, tp); the expert-data-parallel group: the dp_exp ranks of one (pp, ep, tp), over which expert
        gradients are summed. Collective; made only for MoE models (cp is 1: refused with experts, moe_refusal)."""
        if not ep_fits(self.dp, self.ep):
            raise TrainError(f"--ep {self.ep} must divide the data-parallel size {self.dp}")
        sizes = {"tp": self.tp, "dp": self.dp, "cp": self.cp}
        ep_dp, edp_dp = expert_dp_groups(self.dp, self.ep)
        ep_groups = [[rank_of(Coords(t, d, p), **sizes) for d in ranks]
                     for p in range(self.pp) for ranks in ep_dp for t in range(self.tp)]
        edp_groups = [[rank_of(Coords(t, d, p), **sizes) for d in ranks]
                      for p in range(self.pp) for ranks in edp_dp for t in range(self.tp)]
        return self._mine(ep_groups), self._mine(edp_groups)

    def experts(self) -> tuple[EpGroup, tuple[Any, Any]]:
        """This rank's :class:`EpGroup` (the ep degree, its ep rank, its ep group) and its (ep, expert-data-parallel)
        groups (:meth:`expert_groups`). Collective."""
        groups = self.expert_groups()
        return EpGroup(self.ep, self.ep_rank, groups[0]), groups

    def shard_groups(self, degree: int) -> tuple[list[list[int]], list[Any]]:
        """The FSDP mesh over this rank's dp ranks sharded in groups of ``degree`` (--shard-params: dp; --hybrid-shard
        N): its global ranks (one row a shard group, NxD's dp order) and its process groups, outermost first. At
        degree = dp: the run's own dp group (at dp 1, where the run keeps none, a one-rank group made here); else
        the (replicate, shard) groups, made here: dp ranks ``k·N .. k·N + N - 1`` shard one copy, the ranks at the
        same place in each copy replicate. Collective (pp and cp are 1: refused with sharding, config.checks)."""
        everyone = group_ranks("dp", tp=self.tp, dp=self.dp, pp=self.pp, cp=self.cp)
        mine = next(ranks for ranks in everyone if self.rank in ranks)
        rows = [mine[k:k + degree] for k in range(0, self.dp, degree)]
        if degree == self.dp:
            return rows, [self.dp_group if self.dp_group is not None else self._mine(everyone, keep_single=True)]
        shard = [ranks[k:k + degree] for ranks in everyone for k in range(0, self.dp, degree)]
        replicate = [ranks[j::degree] for ranks in everyone for j in range(degree)]
        return rows, [self._mine(replicate), self._mine(shard)]

    def first_last_stage_group(self) -> Any:
        """The first and last pipeline ranks of each (tp, dp): where a tied embedding lives twice."""
        sizes = {"tp": self.tp, "dp": self.dp, "cp": self.cp}
        groups = [
            [rank_of(Coords(t, dp, 0, c), **sizes), rank_of(Coords(t, dp, self.pp - 1, c), **sizes)]
            for dp in range(self.dp) for c in range(self.cp) for t in range(self.tp)
        ]
        return self._mine(groups) if self.pp > 1 else None

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.pp - 1

    def describe(self) -> str:
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        return f"world {self.world} = tp {self.tp} x pp {self.pp} x dp {self.dp}{cp}"


# --------------------------------------------------------------------------------------------
# Starting N local processes


LAUNCHER_ENV = "NXDTRAIN_LAUNCHER_PID"  # set in the processes of --nproc: whom to name as the run's owner
ERROR_FILE = "rank-{}.txt"  # in the launcher's error directory: a failed process's one-line message


def _child(local_rank: int, fn: Callable[..., Any], args: tuple[Any, ...], world: int, port: int,
           errors: str, launcher: tuple[int, int | None]) -> None:
    die_with(*launcher)  # a launcher killed by SIGKILL (the OOM killer) takes its workers with it
    os.environ[LAUNCHER_ENV] = str(launcher[0])
    os.environ[RENDEZVOUS_ENV] = os.path.join(errors, "rendezvous")
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        fn(*args)
    except Exception as exc:
        # Not printed here: every rank often fails alike (a bad row, a missing file), or because a peer
        # failed (a lost connection); the launcher prints the first message written, once.
        line, debug = failure_line(exc)
        if debug:
            import traceback

            traceback.print_exc()
        with open(os.path.join(errors, ERROR_FILE.format(local_rank)), "w") as fh:
            fh.write(line)
        sys.exit(1)


def spawn(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int, *, timeout_s: float | None = None,
          preload: Sequence[str] = ("torch",)) -> int:
    """Run ``fn(*args)`` in ``nprocs`` local processes forming one world; return 0 or the first failure's code.

    Processes are forked from a forkserver that imported ``preload`` once, so a world starts in
    well under a second instead of importing torch in every process. When one process fails the
    others are terminated and the first error written is printed once (``nxdtrain: error: ...``;
    with ``--debug`` every process prints its traceback); a run past ``timeout_s`` is terminated too (exit code 124). SIGTERM or
    SIGINT to this process is forwarded to every worker, and the launcher waits for them all
    (killing those still alive after :data:`STOP_GRACE_S`: time to finish a save) before it returns 128 + the signal: a
    supervisor (``timeout``, Slurm, a shell's ``kill``) never leaves headless workers behind. A
    launcher killed by SIGKILL takes them along too (:mod:`nxdtrain.parallel.lifeline`).
    """
    import multiprocessing
    import tempfile

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(list(preload))
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="nxdtrain-errors-") as errors:
        launcher = (os.getpid(), start_time(os.getpid()))
        context = mp.start_processes(_child, args=(fn, args, nprocs, port, errors, launcher), nprocs=nprocs, join=False,
                                     start_method="forkserver")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with _Forwarding(context) as forwarding:
            failed = _wait(context, forwarding, deadline)
            if forwarding.signum is not None:
                # Not signalled again: the workers finish a save in progress and stop together (parallel.preempt).
                _terminate(context, grace_s=STOP_GRACE_S, signalled=True)
                name = signal.Signals(forwarding.signum).name
                print(f"nxdtrain: {name}: stopped all {nprocs} processes; tags without a 'done' marker are never "
                      "resumed", file=sys.stderr)
                return 128 + forwarding.signum
        if failed is None:
            _terminate(context)
            print(f"nxdtrain: error: {nprocs} processes still running after {timeout_s:.0f}s; terminated",
                  file=sys.stderr)
            return 124
        if not failed:
            return 0
        _terminate(context)  # the others, quietly: their errors are the first one's consequences or copies of it
        print(f"nxdtrain: error: {_first_error(context, failed, errors)}", file=sys.stderr)
        code = context.processes[failed[0]].exitcode
        return code if code and code > 0 else 1


def _wait(context: Any, forwarding: _Forwarding, deadline: float | None) -> list[int] | None:
    """Until all processes exit 0 (``[]``), one fails (the failed indexes in the order seen), a signal
    arrives (``[]``; the caller looks at ``forwarding``) or the deadline passes (None)."""
    from multiprocessing.connection import wait

    running = {p.sentinel: i for i, p in enumerate(context.processes)}
    failed: list[int] = []
    while running:
        for sentinel in wait(list(running), timeout=0.2):
            index = running.pop(sentinel)
            context.processes[index].join()
            if context.processes[index].exitcode != 0:
                failed.append(index)
        if failed or forwarding.signum is not None:
            return failed
        if deadline is not None and time.monotonic() > deadline:
            return None
    return failed


def _first_error(context: Any, failed: list[int], errors: str) -> str:
    """The message written first (the others are usually copies of it, or peers' lost connections);
    a process that died without one is described by its exit status."""
    import fnmatch

    # Only the processes' messages: the directory also holds the process group's rendezvous file (RENDEZVOUS_ENV)
    # once a world has started, which a failure after the start would otherwise find first.
    written = [os.path.join(errors, name) for name in fnmatch.filter(os.listdir(errors), ERROR_FILE.format("*"))]
    if written:
        first = min(written, key=lambda path: (os.stat(path).st_mtime_ns, path))
        with open(first) as fh:
            return fh.read().strip()
    code = context.processes[failed[0]].exitcode
    return (f"process {failed[0]} was killed by {signal.Signals(-code).name}" if code < 0
            else f"process {failed[0]} exited with status {code}")


STOP_GRACE_S = 30.0  # how long workers get to exit after a forwarded signal before SIGKILL
FORWARDED = (signal.SIGTERM, signal.SIGINT)


class _Forwarding:
    """While active, SIGTERM/SIGINT to this process are sent on to the workers (and remembered)."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _forward(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        for process in self.context.processes:
            if process.is_alive():
                try:
                    os.kill(process.pid, signum)
                except ProcessLookupError:
                    pass

    def __enter__(self) -> _Forwarding:
        self._previous = handle(FORWARDED, self._forward)
        return self

    def __exit__(self, *exc: Any) -> None:
        restore(self._previous)


def _terminate(context: Any, grace_s: float = 5.0, signalled: bool = False) -> None:
    """SIGTERM the workers still alive (unless ``signalled`` already), wait up to ``grace_s`` for all, then SIGKILL
    the rest and reap them."""
    for process in context.processes:
        if process.is_alive() and not signalled:
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in context.processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in context.processes:
        if process.is_alive():
            process.kill()
            process.join()
