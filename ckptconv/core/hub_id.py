"""What a Hugging Face Hub repository id looks like (``org/name``), without importing anything heavy: the CLI
tells a missing local path from a hub id with it before a conversion imports torch.

    >>> is_hub_id("meta-llama/Llama-3.1-8B"), is_hub_id("./llama-hf"), is_hub_id("llama-hf")
    (True, False, False)
"""

from __future__ import annotations

import re

# org/name: each part as the Hub allows (letters, digits, '-', '_', '.'), no leading dot.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_hub_id(text: str) -> bool:
    """True for ``org/name`` as the Hub spells repository ids ("--" and ".." are not allowed)."""
    return bool(_HUB_ID.match(text)) and "--" not in text and ".." not in text and not text.endswith(".git")
