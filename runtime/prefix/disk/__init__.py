"""The prefix cache's disk tier: evicted state kept in a directory, across restarts.

`DiskTier` (tier.py) is what the engine opens and the prefix cache talks to; the file
format (files.py) names a model's state by `model_identity`.
"""

from __future__ import annotations

from runtime.prefix.disk.files import SUFFIX, TMP_SUFFIX, BadEntry, model_identity, read_header
from runtime.prefix.disk.tier import DiskTier

__all__ = ["SUFFIX", "TMP_SUFFIX", "BadEntry", "DiskTier", "model_identity", "read_header"]
