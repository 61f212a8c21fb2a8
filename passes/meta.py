"""The key under which the passes record their decisions in ``node.meta``.

Each node a pass inserts, and each saved value of a swapped or recomputed activation, gets
``node.meta[META_KEY] = {"activation": name, "decision": "swap" | "recompute"}``; a recomputed copy
also names the node it ``recomputes``.
"""
from __future__ import annotations

META_KEY = "fxpooch"
