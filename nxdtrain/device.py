"""Where a run computes (``--device auto|cpu|cuda|xla``) and the few things that change with it.

``xla`` is torch-xla: Trainium through torch-neuronx's PJRT plugin, or XLA:CPU (``PJRT_DEVICE=CPU``)
where this project tests it. An XLA device traces operations lazily and compiles each distinct
graph once, so the trainer keeps one graph per optimizer step: the step is cut by
:meth:`Device.sync` at the same point every time, the learning rate enters as a device tensor
(a Python float would be baked into the graph), AdamW runs ``capturable`` (its step count and
bias corrections stay on the device), and nothing is read back to the host inside the step.

The process-group backend follows the device: gloo on cpu, nccl on cuda, torch-xla's ``xla``
backend (collectives lowered into the XLA graph) on xla.

    >>> BACKENDS["xla"], xla_limits(pp=2, optimizer="adamw")[:24]
    ('xla', '--pp 2 with --device xla')
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from nxdtrain.errors import TrainError

if TYPE_CHECKING:  # torch is imported where it is used: nxdtrain.config.options (flags, --help) needs none of this
    import torch

DEVICES = ("auto", "cpu", "cuda", "xla")
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xla": "xla"}


def xla_limits(*, pp: int, optimizer: str, cp: int = 1) -> str | None:
    """Why a run cannot use ``--device xla`` (one line), or None; needs no torch_xla, so flags fail early."""
    if cp > 1:
        return (f"--context-parallel {cp} with --device xla: ring attention passes K/V blocks between ranks with "
                "point-to-point send/recv (batch_isend_irecv), which nxdtrain cannot run or test multi-process under "
                "torch-xla 2.9 (XLA:CPU has no multi-process runtime); use --context-parallel 1 (--sequence-parallel "
                "splits activations over tp), or train with --context-parallel on --device cpu/cuda")
    if pp > 1:
        return (f"--pp {pp} with --device xla: torch.distributed.pipelining sends activations with point-to-point "
                "send/recv, which torch-xla's 'xla' process-group backend runs as one compiled graph and host sync "
                "per message; nxdtrain does not pipeline on xla. Reshard to --pp 1 (ckptconv reshard ... --pp 1) "
                "and use --tp/data parallelism, or train with --pp on --device cpu/cuda")
    if optimizer != "adamw":
        return (f"--optimizer {optimizer} with --device xla: torch's SGD reads a tensor learning rate on the host "
                "every step (a graph break); use --optimizer adamw")
    return None


def default_precision(kind: str) -> str:
    """``--precision auto``: bf16 (fp32 masters) on an accelerator, fp32 on a CPU, XLA:CPU included, where
    bf16 has no fast kernels (it trained 4-8x slower than fp32 on this project's CPU machine)."""
    accelerator = kind == "cuda" or (kind == "xla" and pjrt_accelerator() is not None)
    return "bf16" if accelerator else "fp32"


def torch_xla_api() -> ModuleType | None:
    """torch_xla when it imports and has the API this trainer calls (``device``, ``sync``, ``xla_model``,
    the ``xla`` process-group backend); None otherwise. A module of that name alone is not enough."""
    try:
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the "xla" backend)
        import torch_xla.runtime  # noqa: F401
    except Exception:  # ImportError, or a broken install failing at import time
        return None
    needed = (getattr(torch_xla, "device", None), getattr(torch_xla, "sync", None), getattr(xm, "all_reduce", None))
    return torch_xla if all(callable(f) for f in needed) else None


def pjrt_accelerator(environ: Mapping[str, str] | None = None) -> str | None:
    """The PJRT device torch_xla runs on when it is an accelerator (``NEURON``, ``TPU``, ...), else None.

    torch_xla picks its own default when ``PJRT_DEVICE`` is unset (NEURON where Neuron's plugin is
    installed, else CPU) and writes it into the environment; XLA:CPU is no accelerator: it is used
    only when asked for with ``--device xla``.
    """
    if torch_xla_api() is None:
        return None
    env = os.environ if environ is None else environ
    name = (env.get("PJRT_DEVICE") or os.environ.get("PJRT_DEVICE") or "").split("_")[0].upper()
    return name if name and name != "CPU" else None


def resolve_kind(requested: str, environ: Mapping[str, str] | None = None) -> str:
    """``auto``: xla when torch_xla works and its PJRT device is an accelerator, else cuda when available, else cpu.

    An explicit ``xla`` or ``cuda`` that this machine cannot give is an error, not a fallback.
    """
    import torch

    if requested == "xla":
        if torch_xla_api() is None:
            raise TrainError("--device xla: torch_xla does not import here (install torch-xla matching this torch, "
                             "or torch-neuronx on Trainium; `make setup-xla` builds such an environment)")
        return "xla"
    if requested == "auto" and pjrt_accelerator(environ) is not None:
        return "xla"
    if requested == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda: torch.cuda.is_available() is false on this machine")
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return "cuda"
    return "cpu"


@dataclass(frozen=True)
class Device:
    """The device of this process and what the training step does differently on it."""

    kind: str                 # "cpu", "cuda" or "xla"
    torch_device: torch.device

    @property
    def backend(self) -> str:
        return BACKENDS[self.kind]

    @property
    def is_xla(self) -> bool:
        return self.kind == "xla"

    def sync(self) -> None:
        """End of one optimizer step's graph: compile (once) and run everything traced since the last sync."""
        if self.is_xla:
            import torch_xla

            torch_xla.sync()

    def lr(self, value: float) -> float | torch.Tensor:
        """The learning rate as the optimizer should see it: on xla a device tensor, so a new value is new data
        for the same graph. Shape (1,), not (): torch-xla bakes a 0-dim 0.0 or 1.0 into the graph as a constant
        (a cosine decay ending at 0 would compile a new graph for its last step)."""
        import torch

        if not self.is_xla:
            return value
        return torch.tensor([value], dtype=torch.float32).to(self.torch_device)

    def describe(self) -> str:
        return f"device {self.torch_device} ({self.kind}), process-group backend {self.backend}"


def local_gpu_limits(nproc: int | None) -> str | None:
    """Why ``--nproc`` processes cannot each have a GPU of this node (one line), or None. The launcher of --nproc
    checks it: its processes see the GPUs it sees."""
    import torch

    gpus = torch.cuda.device_count()
    if nproc is None or nproc <= max(gpus, 1):
        return None
    return (f"--nproc {nproc} with --device cuda on a node with {gpus} CUDA device(s): NCCL runs one rank per GPU; "
            f"use --nproc {gpus} or fewer (more nodes for a larger world)")


def open_device(kind: str, local_rank: int) -> Device:
    """This process's device of a resolved ``kind`` (cuda: the local rank's GPU)."""
    import torch

    if kind == "cuda":
        gpus = torch.cuda.device_count()
        if local_rank >= gpus > 1:  # NCCL would refuse two ranks on one GPU, but only at the first collective
            raise TrainError(f"local rank {local_rank} has no GPU of its own: this process sees {gpus} CUDA devices "
                             f"and NCCL runs one rank per GPU; start at most {gpus} processes per node")
        # one visible GPU: the launcher bound this rank to it (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES)
        device = torch.device("cuda", local_rank if gpus > 1 else 0)
        torch.cuda.set_device(device)
        return Device("cuda", device)
    if kind == "xla":
        import torch_xla

        return Device("xla", torch_xla.device())
    return Device("cpu", torch.device("cpu"))


def to_host(obj: Any) -> Any:
    """``obj`` with every tensor copied to the CPU one at a time (CPU tensors are returned as they are)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj if obj.device.type == "cpu" else obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, to_host(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj
