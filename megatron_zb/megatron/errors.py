"""The errors megatron-zb's Megatron layer raises: each message names what is wrong and what
would be right, in one line (the entry points print it and exit 2)."""
from __future__ import annotations

__all__ = ["ZeroBubbleConfigError", "ZeroBubbleArgumentError"]


class ZeroBubbleConfigError(ValueError):
    """A schedule or Megatron configuration the plugin cannot run; raised before any communication."""


class ZeroBubbleArgumentError(ValueError):
    """A megatron-zb flag or flag combination that cannot run; the message says which and why."""
