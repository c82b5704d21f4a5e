"""A wrong load is caught before it costs compute: the first batch's loss of a resumed or converted start.

Weights read with the wrong layout (attention flags, kv_size_multiplier, trn1/trn2 head order, a tied
head) still have every shape right, so nothing else notices; the run then trains from scrambled weights
(AWS's own 70B continual-pretraining sample logged 13.4 against ln V = 11.8 from "pretrained" weights).
Before step 1, one forward of the first batch (no update, no RNG drawn) gives the loss the weights have
on the run's own data; the run stops, in one line naming the likely causes, when that loss is

* worse than guessing: above ``ln(vocab) +`` :data:`ABOVE_GUESSING` (a random initialisation sits at about
  ``ln(vocab)``, so a fresh model never trips it), or
* far above the loss recorded in the tag it resumes: above ``recorded +`` :data:`ABOVE_RECORDED`,

unless ``--allow-high-loss``. The margins come from measurements (README, "A wrong load is caught"):
``tests/nxdtrain/measure_loss_check.py`` trains a tiny Llama below ln V, then loads it right and wrong.
``--data synthetic`` (random tokens) is not checked: on random tokens no model beats guessing.

    >>> verdict(2.1, vocab=32000, recorded=None) is None
    True
    >>> verdict(13.4, vocab=32000, recorded=None)[:38]
    'the first batch loss 13.400 is above l'
"""

from __future__ import annotations

import math

ABOVE_GUESSING = 1.0  # nats above ln(vocab)
ABOVE_RECORDED = 1.0  # nats above the loss the resumed tag recorded

CAUSES = ("the weights were most likely read with the wrong layout: check the conversion's --qkv-linear/--fuse-qkv, "
          "--kv-size-multiplier, the trn1/trn2 head order (--hw-backend) and a tied lm_head (tie_word_embeddings)")


def verdict(loss: float, *, vocab: int, recorded: float | None) -> str | None:
    """Why ``loss`` (the first batch's, before step 1) says the load is wrong; None when it does not."""
    guess = math.log(vocab)
    if not math.isfinite(loss) or loss > guess + ABOVE_GUESSING:
        return (f"the first batch loss {loss:.3f} is above ln(vocab {vocab}) = {guess:.3f} + {ABOVE_GUESSING:g}, worse "
                "than guessing")
    if recorded is not None and loss > recorded + ABOVE_RECORDED:
        return (f"the first batch loss {loss:.3f} is far above the loss {recorded:.3f} recorded in the tag "
                f"(+ {ABOVE_RECORDED:g})")
    return None


# A mixture of experts read with its experts in the wrong places (ep rank files swapped, slabs out of order) has every
# shape right too: only the loss sees it.
EXPERT_CAUSES = "the experts' order (ep rank r's files hold experts r*E/ep to (r+1)*E/ep - 1, stacked in that order)"


def refusal(why: str, source: str, *, experts: bool = False) -> str:
    causes = f"{CAUSES}, {EXPERT_CAUSES}" if experts else CAUSES
    return f"{source}: {why}; {causes}; or pass --allow-high-loss to train anyway"
