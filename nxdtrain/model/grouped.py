"""The local experts' SwiGLU MLPs over rows grouped by expert, forward and backward written out.

``out[rows of e] = (silu(x_e @ gate_up[e][:, :I]) * (x_e @ gate_up[e][:, I:])) @ down[e]`` for each local expert e,
``sizes[e]`` rows each, in order. Autograd of the per-expert expression costs what this does not: a ``cat`` of the
expert outputs, one of each expert's gate and up gradients (``chunk``'s backward), and for every expert a zeroed
copy of the whole weight to hold its slice's gradient (``select``'s backward), then their sum. Here each matmul writes
its slice of one buffer and the elementwise ops run once over all rows. The arithmetic is autograd's, op for op
(``mm``'s backward ``grad @ w.T`` and ``x.T @ grad``, ``mul``'s and ``silu``'s), so the values are the same.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def grouped_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``x`` ``(N, H)`` grouped by local expert (``sizes``, summing to N); ``gate_up`` ``[E, H, 2I]`` (each expert's
    last dim ``[gate | up]``), ``down`` ``[E, I, H]``."""
    out: torch.Tensor = _GroupedMlp.apply(x, gate_up, down, sizes)
    return out


def _spans(sizes: list[int]) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each expert with rows."""
    spans, start = [], 0
    for e, n in enumerate(sizes):
        if n:
            spans.append((e, start, start + n))
        start += n
    return spans


class _GroupedMlp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        inter = down.shape[1]
        pre = x.new_empty(x.shape[0], 2 * inter)  # [gate | up] of every row
        out = x.new_empty(x.shape[0], down.shape[2])
        spans = _spans(sizes)
        for e, a, b in spans:
            torch.mm(x[a:b], gate_up[e], out=pre[a:b])
        gate, up = pre[:, :inter], pre[:, inter:]
        act = F.silu(gate)
        hidden = act * up
        for e, a, b in spans:
            torch.mm(hidden[a:b], down[e], out=out[a:b])
        ctx.save_for_backward(x, gate_up, down, pre, act, hidden)  # hidden kept: down's gradient needs it
        ctx.spans = spans
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, gate_up, down, pre, act, hidden = ctx.saved_tensors
        inter = down.shape[1]
        gate, up = pre[:, :inter], pre[:, inter:]
        grad = grad.contiguous()
        d_hidden = grad.new_empty(grad.shape[0], inter)
        d_down = torch.zeros_like(down) if len(ctx.spans) < len(down) else torch.empty_like(down)
        for e, a, b in ctx.spans:
            torch.mm(grad[a:b], down[e].t(), out=d_hidden[a:b])
            torch.mm(hidden[a:b].t(), grad[a:b], out=d_down[e])
        d_pre = grad.new_empty(pre.shape)
        torch.ops.aten.silu_backward(d_hidden * up, gate, grad_input=d_pre[:, :inter])
        torch.mul(d_hidden, act, out=d_pre[:, inter:])
        d_x = grad.new_empty(x.shape)
        d_gate_up = torch.zeros_like(gate_up) if len(ctx.spans) < len(gate_up) else torch.empty_like(gate_up)
        for e, a, b in ctx.spans:
            torch.mm(x[a:b].t(), d_pre[a:b], out=d_gate_up[e])
            torch.mm(d_pre[a:b], gate_up[e].t(), out=d_x[a:b])
        return d_x, d_gate_up, d_down, None
