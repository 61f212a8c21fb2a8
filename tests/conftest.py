"""Shared fixtures. Test helpers (zoo, memcount, measure) import by module name from this folder, and
the benchmarks' measuring helpers (memprofile) from benchmarks/."""
from __future__ import annotations

import os
import sys

# CUDA tests cap the caching allocator (set_per_process_memory_fraction) at a few MiB above a plan's peak:
# its default fixed-size segments (20 MiB for a 1-10 MiB tensor) do not fit there, segments that grow do.
# Read when CUDA's allocator starts; an environment that sets it keeps its own.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, os.path.dirname(__file__))
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
