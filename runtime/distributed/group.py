"""The process group a distributed model is split over: a thin layer on mx.distributed.

`mlx.launch` (or any launcher MLX supports: a hostfile for the ring backend, MPI,
JACCL over Thunderbolt RDMA, NCCL on CUDA) starts one process per rank and tells each
its rank through the environment; `Group.init` joins them. Nothing here runs at import:
the group exists only once a caller asks for it, after the process chose its device.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import mlx.core as mx

BACKENDS = ("any", "ring", "mpi", "nccl", "jaccl")


@dataclass(frozen=True)
class Group:
    """The ranks a model is split over; `handle` is what mx.distributed ops take."""

    handle: mx.distributed.Group
    backend: str = "any"

    @classmethod
    def init(cls, backend: str = "any", *, strict: bool = True) -> Group:
        """Join the group this process was launched into.

        `strict`: a process started without a launcher is an error (the usual mistake:
        `mlx-gateway serve --distributed` run directly instead of through mlx.launch);
        without it such a process gets a group of one.
        """
        if backend not in BACKENDS:
            raise ValueError(f"unknown distributed backend {backend!r}; use one of {BACKENDS}")
        if strict and not mx.distributed.is_available(backend):
            raise RuntimeError(
                f"this MLX build has no {backend!r} distributed backend "
                f"(mx.distributed.is_available({backend!r}) is False)"
            )
        try:
            handle = mx.distributed.init(strict=strict, backend=backend)
        except RuntimeError as exc:
            raise RuntimeError(
                f"could not join a distributed group over {backend!r}: {exc}. Start every "
                "rank with mlx.launch (e.g. `mlx.launch --hosts a,b --backend ring ...`)"
            ) from exc
        return cls(handle, backend)

    @classmethod
    def single(cls) -> Group:
        """A group of one (no communication): the unsharded model."""
        return cls(mx.distributed.init(strict=False, backend="any"), "any")

    @property
    def rank(self) -> int:
        return int(self.handle.rank())

    @property
    def size(self) -> int:
        return int(self.handle.size())

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def describe(self) -> str:
        """One line for logs: which rank this is, of how many, where, over what."""
        return f"rank {self.rank} of {self.size} on {socket.gethostname()} ({self.backend})"


GroupLike = Group | mx.distributed.Group


def handle_of(group: GroupLike) -> mx.distributed.Group:
    """The mx.distributed group of a `Group` or of an mx.distributed group itself."""
    return group.handle if isinstance(group, Group) else group


__all__ = ["BACKENDS", "Group", "GroupLike", "handle_of"]
