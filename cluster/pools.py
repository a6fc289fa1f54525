"""Worker pools: one placement group per worker, least-loaded routing, replacement of lost workers, resizing.

Each worker reserves one bundle (its pool's num_cpus / num_gpus / custom resources) in its own
placement group, so a pool grows and shrinks one worker at a time and can be pinned to its own
kind of node through custom resources. A pool never drops below its requested size for long:
a worker reported lost is killed and replaced in the background. Shrinking marks workers as
retiring; the coordinator moves their requests away at the next round boundary, then the
worker and its placement group are removed.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from eyas.actors.proxy import WorkerClient
from eyas.actors.worker import WorkerInfo, WorkerSpec

from .config import PoolConfig

log = logging.getLogger("eyas.cluster")


def root_cause(exc: BaseException) -> BaseException:
    """The exception a chain of Ray task errors started from."""
    while isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    return exc


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
    state: str = "ready"  # ready -> retiring -> removed, or ready -> lost
    load: int = 0
    started: float = field(default_factory=time.monotonic)


class Pool:
    """The draft or target pool: spawns, routes to, replaces and retires workers of one actor class."""

    def __init__(
        self,
        name: str,
        actor_class: type,
        config: PoolConfig,
        spec: WorkerSpec,
        ready_timeout: float,
        rpc_timeout: float,
    ):
        self.name = name
        self.config = config
        self.size = config.replicas
        self._spec = spec
        self._remote = ray.remote(actor_class)
        self._ready_timeout = ready_timeout
        self._rpc_timeout = rpc_timeout
        self.manifest_id: str | None = None  # once set, a worker serving another manifest is refused
        self._ids = itertools.count()
        self._members: list[Member] = []
        self._pending = 0
        self._cond = threading.Condition()
        self._closed = False

    # -- membership -----------------------------------------------------------------------------
    def _spawn(self) -> Member:
        """Reserve a bundle, start one worker in it and wait until it serves."""
        worker_id = f"{self.name}-{next(self._ids)}"
        group = placement_group([self.config.bundle()], strategy="STRICT_PACK", name=f"eyas-{worker_id}")
        ready, _ = ray.wait([group.ready()], timeout=self._ready_timeout)
        if not ready:
            remove_placement_group(group)
            raise PoolError(
                f"pools.{self.name}: no node could reserve {self.config.bundle()} for {worker_id} within "
                f"{self._ready_timeout:.0f}s (see `ray status` for the cluster's resources)"
            )
        actor = self._remote.options(
            num_cpus=self.config.num_cpus,
            num_gpus=self.config.num_gpus,
            resources=self.config.resources,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
            name=None,
        ).remote(self._spec)
        try:
            info = actor.start.remote().future().result(timeout=self._ready_timeout)
            if self.manifest_id is not None and info.manifest_id != self.manifest_id:
                raise PoolError(f"manifest_id: the worker serves {info.manifest_id}, the service {self.manifest_id}")
        except Exception as exc:
            ray.kill(actor)
            remove_placement_group(group)
            raise PoolError(f"pools.{self.name}: {worker_id} failed to start: {root_cause(exc)}") from exc
        client = WorkerClient(self.name, worker_id, info.address, self._spec.token, self._rpc_timeout)
        return Member(worker_id, actor, group, info, client)

    def _add(self, count: int) -> None:
        """Start `count` workers in parallel and add them once ready."""
        errors: list[Exception] = []

        def one() -> None:
            try:
                member = self._spawn()
            except Exception as exc:
                errors.append(exc)
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
                return
            with self._cond:
                self._pending -= 1
                if self._closed:
                    self._remove(member)
                    return
                self._members.append(member)
                self._cond.notify_all()

        with self._cond:
            self._pending += count
        threads = [threading.Thread(target=one, name=f"eyas-spawn-{self.name}") for _ in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def start(self) -> None:
        """Bring the pool up to its configured size."""
        self._add(self.size)

    def _remove(self, member: Member) -> None:
        member.client.close()
        ray.kill(member.actor)
        remove_placement_group(member.group)

    def stop(self) -> None:
        with self._cond:
            self._closed = True
            members, self._members = self._members, []
            self._cond.notify_all()
        for member in members:
            self._remove(member)

    # -- routing ------------------------------------------------------------------------------
    def members(self) -> list[Member]:
        with self._cond:
            return list(self._members)

    def acquire(self) -> Member:
        """Route a request to the least-loaded ready worker, waiting (bounded) while none is ready."""
        deadline = time.monotonic() + self._ready_timeout
        with self._cond:
            while True:
                if self._closed:
                    raise PoolError(f"pools.{self.name}: the service is stopping")
                ready = [m for m in self._members if m.state == "ready"]
                if ready:
                    member = min(ready, key=lambda m: (m.load, m.started))
                    member.load += 1
                    return member
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PoolError(f"pools.{self.name}: no ready worker within {self._ready_timeout:.0f}s")
                self._cond.wait(left)

    def release(self, member: Member) -> None:
        """A request no longer uses `member`."""
        with self._cond:
            member.load -= 1
            self._cond.notify_all()

    def lost(self, member: Member) -> None:
        """A worker stopped answering: kill it, drop it, and start a replacement in the background."""
        with self._cond:
            if member.state == "lost" or member not in self._members:
                return
            member.state = "lost"
            self._members.remove(member)
            short = 0 if self._closed else self.size - len([m for m in self._members if m.state == "ready"]) - self._pending
        log.warning("pools.%s: worker %s at %s lost; replacing it", self.name, member.worker_id, member.info.address)
        self._remove(member)
        if short > 0:
            threading.Thread(target=self._replace, args=(short,), name=f"eyas-replace-{self.name}", daemon=True).start()

    def _replace(self, count: int) -> None:
        try:
            self._add(count)
        except Exception:
            log.exception("pools.%s: could not replace a lost worker", self.name)

    # -- sizing -------------------------------------------------------------------------------
    def resize(self, size: int) -> None:
        """Grow by starting workers, or shrink by retiring the least-loaded ones once their requests moved."""
        if type(size) is not int or size < 1:
            raise ValueError(f"{self.name}: pool size must be an integer >= 1, got {size!r}")
        with self._cond:
            self.size = size
            ready = sorted((m for m in self._members if m.state == "ready"), key=lambda m: (m.load, -m.started))
            grow = size - len(ready) - self._pending
            retiring = ready[: max(0, len(ready) - size)]
            for member in retiring:
                member.state = "retiring"
            self._cond.notify_all()
        if grow > 0:
            try:
                self._add(grow)
            except PoolError:
                with self._cond:
                    self.size = len([m for m in self._members if m.state == "ready"]) + self._pending
                raise
        deadline = time.monotonic() + self._ready_timeout
        with self._cond:
            while any(m.load for m in retiring):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PoolError(f"pools.{self.name}: retiring workers still serve requests after {self._ready_timeout:.0f}s")
                self._cond.wait(left)
            retired = [m for m in retiring if m in self._members]
            for member in retired:
                self._members.remove(member)
                member.state = "removed"
        for member in retired:
            self._remove(member)
