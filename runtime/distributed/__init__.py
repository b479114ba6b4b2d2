"""One model across several processes or hosts with mx.distributed (launched by mlx.launch).

- `Group` (group.py): the ranks, around mx.distributed.init.
- `shard_model` (shard.py): split a built model for tensor or pipeline parallel, in place.
- `load_sharded` (load.py): load only this rank's part of a checkpoint.
- `comm_bytes_per_token` (shard.py): what a forward sends per token, per rank.
"""

from __future__ import annotations

from runtime.distributed.group import Group, GroupLike
from runtime.distributed.load import load_sharded
from runtime.distributed.shard import (
    MODES,
    Mode,
    ShardInfo,
    comm_bytes_per_token,
    shard_info,
    shard_model,
    split_problems,
)

__all__ = [
    "MODES",
    "Group",
    "GroupLike",
    "Mode",
    "ShardInfo",
    "comm_bytes_per_token",
    "load_sharded",
    "shard_info",
    "shard_model",
    "split_problems",
]
