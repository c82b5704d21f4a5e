"""One optimizer step's forward and backward: microbatches through ``torch.distributed.pipelining``.

Loss definition: the mean token cross-entropy over every predicted token of the *global* batch,
``sum over all rows r and positions t < seq_len-1 of CE(logits[r, t], ids[r, t+1])`` divided by
``gbs·(seq_len-1)`` — what ``LlamaForCausalLM(ids, labels=ids).loss`` gives for the whole batch
at once. Each microbatch contributes its token sum divided by that global count (so the
schedule must not rescale: ``scale_grads=False``); gradients accumulate over microbatches and are
summed over data-parallel ranks, and the reported loss is the same sum over microbatches and dp.

At pp 1 the microbatches run in a plain loop (the same forward, loss and backward calls the
schedules make, without their machinery); at pp > 1 the stage is given the shapes it sends and
receives, so the first step runs no extra forward for shape inference. With sequence
parallelism the hidden states passed between stages are each tp rank's sequence slice. With
context parallelism every cp rank gets the same rows and keeps its zigzag chunks of the ids and
of the targets (shifted on the whole row first); its loss is its tokens' share of the same global
sum, and the trainer sums losses and gradients over cp as over dp.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from nxdtrain.data.rows import PAD
from nxdtrain.errors import TrainError
from nxdtrain.model.moe import with_counts
from nxdtrain.model.stage import LlamaStage
from nxdtrain.parallel.context import split_sequence
from nxdtrain.parallel.layers import vocab_parallel_cross_entropy

IGNORE = -100
SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def shifted_targets(ids: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t+1; the last position predicts nothing (-100), as transformers pads labels;
    nor does a position followed by padding (``--pad``: :data:`nxdtrain.data.rows.PAD`)."""
    target = torch.full_like(ids, IGNORE)
    target[:, :-1] = ids[:, 1:]
    return target.masked_fill(target == PAD, IGNORE)


class PipelineStep:
    """Runs the microbatches of one data-parallel rank's slice of a global batch."""

    def __init__(self, model: LlamaStage, *, pp_group: Any, pp_size: int, microbatches: int, schedule: str,
                 tokens_per_batch: int, device: torch.device, mbs: int, seq_len: int) -> None:
        if schedule == "1f1b" and microbatches < pp_size:
            raise TrainError(f"--pp-schedule 1f1b needs at least --pp {pp_size} microbatches per data-parallel rank, "
                             f"got {microbatches} (gbs / (mbs x dp)); raise --gbs, lower --mbs or use --pp-schedule gpipe")
        self.model, self.device, self.pp_group = model, device, pp_group
        self.tokens, self.microbatches = tokens_per_batch, microbatches
        self.schedule: Any = None
        if pp_size > 1:
            inputs, outputs = exchanged_shapes(model, mbs=mbs, seq_len=seq_len)
            x, y = _examples(inputs, device), _examples(outputs, device)  # type: Any, Any
            if model.carries:  # MoE's router counts travel with the activations (nxdtrain.model.moe)
                counts = ((model.spec.experts,), torch.float32)
                x = (x, _examples(counts, device)) if not model.is_first else x
                y = (y, _examples(counts, device))
            stage = PipelineStage(model, model.pp_rank, pp_size, device, group=pp_group, input_args=x, output_args=y,
                                  input_grads=None if model.is_first else x, output_grads=None if model.is_last else y)
            self.schedule = SCHEDULES[schedule](stage, microbatches, loss_fn=self._loss, scale_grads=False)
        self._has_return_outputs = "return_outputs" in inspect.signature(SCHEDULES[schedule].step).parameters

    def _loss(self, output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], target: torch.Tensor,
              overwrite: bool = False) -> torch.Tensor:
        """``overwrite``: the logits are this call's alone (pp 1; a pipeline schedule keeps its stage's outputs)."""
        logits, counts = output if isinstance(output, tuple) else (output, None)
        per_token = vocab_parallel_cross_entropy(logits.flatten(0, 1), target.flatten(), self.model.tp,
                                                 ignore_index=IGNORE, overwrite=overwrite)
        loss = per_token.sum() / self.tokens
        return loss if counts is None or not torch.is_grad_enabled() else with_counts(loss, counts)

    def _inputs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This cp rank's ids and targets of whole rows (all of them without context parallelism)."""
        cp = self.model.cp
        # Padded positions (after a row's last token) are fed as token 0: causal attention keeps them out of
        # every real position, and they predict nothing.
        return split_sequence(ids.clamp(min=0), cp), split_sequence(shifted_targets(ids), cp)

    def run(self, rows: torch.Tensor) -> torch.Tensor:
        """Forward and backward of all microbatches; the summed loss on the last stage, 0 elsewhere."""
        ids, targets = self._inputs(rows)
        if (aux := self.model.aux) is not None:  # MoE: the router statistics of this step's micro-batches
            aux.start_step()
        if self.schedule is None:
            return self._run_one_stage(ids, targets)
        losses: list[torch.Tensor] = []
        args = (ids,) if self.model.is_first else ()
        # return_outputs (torch >= 2.10) keeps the last stage's logits out of the result; older torch has no such flag.
        kwargs: dict[str, Any] = {"return_outputs": False} if self._has_return_outputs else {}
        if self.model.is_last:
            kwargs.update(target=targets, losses=losses)
        self.schedule.step(*args, **kwargs)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum()

    def evaluate(self, rows: torch.Tensor) -> torch.Tensor:
        """Forward only (call under ``torch.no_grad``): the summed loss of all microbatches on the last stage,
        0 elsewhere; the same loss definition as :meth:`run`."""
        ids, all_targets = self._inputs(rows)
        if self.schedule is None:
            targets = all_targets.tensor_split(self.microbatches)
            chunks = ids.tensor_split(self.microbatches)
            return torch.stack([self._loss(self.model(c), t, overwrite=True).float()
                                for c, t in zip(chunks, targets, strict=True)]).sum()
        losses = self._evaluate_stages(ids, all_targets)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum()

    def _evaluate_stages(self, ids: torch.Tensor, all_targets: torch.Tensor) -> list[torch.Tensor]:
        """The schedule's forward of every microbatch (pp > 1); the last stage's losses."""
        losses: list[torch.Tensor] = []
        args = (ids,) if self.model.is_first else ()
        kwargs: dict[str, Any] = {"target": all_targets, "losses": losses} if self.model.is_last else {}
        self.schedule.eval(*args, **kwargs)
        return losses

    def _run_one_stage(self, ids: torch.Tensor, all_targets: torch.Tensor) -> torch.Tensor:
        losses = []
        targets = all_targets.tensor_split(self.microbatches)
        for chunk, target in zip(ids.tensor_split(self.microbatches), targets, strict=True):
            loss = self._loss(self.model(chunk), target, overwrite=True)
            loss.backward()
            losses.append(loss.detach().float())
        return torch.stack(losses).sum()


Shape = tuple[tuple[int, ...], torch.dtype]


def exchanged_shapes(model: LlamaStage, *, mbs: int, seq_len: int) -> tuple[Shape, Shape]:
    """(input, output) shape and dtype of one microbatch through this stage (what the stages exchange)."""
    tp = model.tp
    dtype = next(model.parameters()).dtype
    seq_len //= model.cp.size  # this cp rank's chunks
    local_seq = seq_len // tp.size if tp.sequence_parallel else seq_len
    hidden: Shape = ((mbs, local_seq, model.spec.hidden), dtype)
    inputs: Shape = ((mbs, seq_len), torch.long) if model.is_first else hidden
    vocab_local = model.layout.vocab_rows(model.spec) // tp.size  # a padded vocabulary included
    outputs: Shape = ((mbs, seq_len, vocab_local), dtype) if model.is_last else hidden
    return inputs, outputs


def _examples(shape: Shape, device: torch.device) -> torch.Tensor:
    # requires_grad marks the hidden states as differentiable: the stage receives them with it set.
    return torch.empty(shape[0], dtype=shape[1], device=device, requires_grad=shape[1].is_floating_point)
