"""Shared fixtures. Test helpers (zoo, memcount, measure) import by module name from this folder."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
