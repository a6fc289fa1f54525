"""What the coordinator routes requests over: pools of workers, their members, and pool failures.

The coordinator owns requests, not machines: the cluster floor builds the pools (placement groups,
replacement, resizing) and hands the coordinator a factory for them, so the arrows run one way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import ray
from ray.util.placement_group import PlacementGroup

from .config import PoolConfig
from .proxy import WorkerClient
from .worker import WorkerInfo, WorkerSpec


class PoolError(RuntimeError):
    """A pool cannot reach its size (no resources, a worker failed to start, or no worker came up in time)."""


@dataclass(eq=False)
class Member:
    """One worker of a pool: its actor, placement group, what it reported at start, and its routing state."""

    worker_id: str
    actor: ray.actor.ActorHandle
    group: PlacementGroup
    info: WorkerInfo
    client: WorkerClient
    followers: tuple[ray.actor.ActorHandle, ...] = ()  # ranks 1..N-1 of a target group
    ranks: tuple = ()  # every rank's RankInfo (rank 0 first)
    state: str = "ready"  # ready -> retiring -> removed, or ready -> lost
    load: int = 0
    started: float = field(default_factory=time.monotonic)


class WorkerPool(Protocol):
    """The draft or target pool as the coordinator uses it; `eyas.cluster.pools.Pool` implements it."""

    name: str
    size: int
    manifest_id: str | None

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def members(self) -> list[Member]: ...

    def acquire(self) -> Member: ...

    def release(self, member: Member) -> None: ...

    def lost(self, member: Member) -> None: ...

    def resize(self, size: int) -> None: ...


# (name, actor class, pool config, worker spec, ready timeout s, rpc timeout s) -> a pool not yet started
PoolFactory = Callable[[str, type, PoolConfig, WorkerSpec, float, float], WorkerPool]
