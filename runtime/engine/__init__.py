"""The engine: the one worker thread that owns MLX, its queue, watchdog and handles, and
the runner that serves a loaded model's batch (see engine.py's docstring)."""

from __future__ import annotations

from runtime.batch import RequestHandle
from runtime.engine.activity import Activity, ActivityView, RequestRecord, RowView
from runtime.engine.encoder import EncoderRunner, EncoderSettings
from runtime.engine.engine import Engine
from runtime.engine.memory import AllocatorBytes, allocator_bytes
from runtime.engine.runner import CacheView, ModelRunner, RunnerSettings
from runtime.engine.turns import Turn, Turns
from runtime.engine.types import (
    BatchRunner,
    EngineFailure,
    EngineHealth,
    EngineState,
    EngineStats,
    EngineStopped,
    EngineUnavailable,
    QueueFull,
    Runner,
)

__all__ = [
    "Activity",
    "ActivityView",
    "AllocatorBytes",
    "BatchRunner",
    "CacheView",
    "EncoderRunner",
    "EncoderSettings",
    "Engine",
    "EngineFailure",
    "EngineHealth",
    "EngineState",
    "EngineStats",
    "EngineStopped",
    "EngineUnavailable",
    "ModelRunner",
    "QueueFull",
    "RequestHandle",
    "RequestRecord",
    "RowView",
    "Runner",
    "RunnerSettings",
    "Turn",
    "Turns",
    "allocator_bytes",
]
