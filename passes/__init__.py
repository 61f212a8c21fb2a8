"""FX graph-rewrite passes: realise a schedule in the captured forward/backward GraphModules.

Shipped as ``fxpooch.passes``. :func:`rewrite_pair` is the entry point; each pass lives in its
own module and records what it did in ``node.meta[META_KEY]`` (``"fxpooch"``, :mod:`.meta`).
"""
from __future__ import annotations

from .rewrite import RewrittenPair, rewrite_pair

__all__ = ["RewrittenPair", "rewrite_pair"]
