"""One model across several processes or hosts with mx.distributed (launched by mlx.launch).

- `Group` (group.py): the ranks, around mx.distributed.init.
- `shard_model` (shard.py): split a built model for tensor or pipeline parallel, in place.
- `load_sharded` (load.py): load only this rank's part of a checkpoint.
- `comm_bytes_per_token` (shard.py): what a forward sends per token, per rank.
- `LockstepRunner` (lockstep.py) on rank 0 and `follow` (follower.py) on the others:
  serving in lockstep over a `Channel` (channel.py).
"""

from __future__ import annotations

from runtime.distributed.channel import Channel
from runtime.distributed.follower import follow
from runtime.distributed.group import Group, GroupLike
from runtime.distributed.load import load_sharded
from runtime.distributed.lockstep import LockstepRunner
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
    "Channel",
    "Group",
    "GroupLike",
    "LockstepRunner",
    "Mode",
    "ShardInfo",
    "comm_bytes_per_token",
    "follow",
    "load_sharded",
    "shard_info",
    "shard_model",
    "split_problems",
]
