"""Shared fixtures. Test helpers (zoo, memcount, measure) import by module name from this folder, and
the benchmarks' measuring helpers (memprofile) from benchmarks/."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
