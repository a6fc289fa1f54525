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
import uuid

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from eyas.actors.config import PoolConfig
from eyas.actors.proxy import WorkerClient
from eyas.actors.routing import Member, PoolError
from eyas.actors.worker import WorkerSpec

log = logging.getLogger("eyas.cluster")
WAIT_REPORT_S = 10.0  # how often a worker waiting for resources says so


def root_cause(exc: BaseException) -> BaseException:
    """The exception a chain of Ray task errors started from."""
    while isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    return exc


def _resources(amounts: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in sorted(amounts.items()))


def capacity_shortfall(bundle: dict[str, float], count: int) -> str | None:
    """Why `count` more bundles can never be reserved in this Ray cluster, or None when they may (now or later).

    A bundle needs one node holding all of it; all bundles together need the cluster's total resources beyond
    what live placement groups (this service's other workers among them) already hold.
    """
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    if not any(all(node.get(k, 0.0) >= v for k, v in bundle.items()) for node in nodes):
        return f"no node of the cluster has {_resources(bundle)} (each worker's bundle must fit on one node)"
    total = {k: sum(node.get(k, 0.0) for node in nodes) for k in bundle}
    held = dict.fromkeys(bundle, 0.0)
    holders = []
    for group in placement_group_table().values():
        if group["state"] in ("CREATED", "PENDING", "RESCHEDULING"):
            holders.append(group["name"] or group["placement_group_id"][:8])
            for reserved in group["bundles"].values():
                for k in bundle:
                    held[k] += reserved.get(k, 0.0)
    short = {k: held[k] + count * v - total[k] for k, v in bundle.items() if held[k] + count * v > total[k]}
    if not short:
        return None
    return (
        f"{count} more worker(s) of {_resources(bundle)} need {_resources({k: count * v for k, v in bundle.items()})}; "
        f"the cluster has {_resources(total)} in all, {_resources(held)} held by {', '.join(sorted(holders)) or 'nothing'}: "
        f"{_resources(short)} missing (add nodes, raise ray.num_cpus, or lower the pool's num_cpus / num_gpus)"
    )


class Pool:
    """The draft or target pool: spawns, routes to, replaces and retires workers of one actor class.

    Implements `eyas.actors.routing.WorkerPool`; the service hands this class to the coordinator as its pool factory.
    """

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
        self._follower = ray.remote(actor_class.follower) if config.tensor_parallel > 1 else None
        self._ready_timeout = ready_timeout
        self._rpc_timeout = rpc_timeout
        self.manifest_id: str | None = None  # once set, a worker serving another manifest is refused
        self._ids = itertools.count()
        self._tag = uuid.uuid4().hex[:8]
        self._members: list[Member] = []
        self._pending = 0
        self._cond = threading.Condition()
        self._closed = False

    # -- membership -----------------------------------------------------------------------------
    def _spawn(self) -> Member:
        """Reserve a worker's bundles (one per rank), start its ranks in them and wait until rank 0 serves.

        A group's rank 0 opens the rendezvous (on loopback when the group is packed on one node), the other
        ranks join it while rank 0 loads; a watcher reports the group lost as soon as any follower ends.
        """
        worker_id = f"{self.name}-{next(self._ids)}"
        bundle = self.config.bundle()
        name = f"eyas-{worker_id}-{self._tag}"  # unique per pool: several services may share a cluster
        ranks = self.config.tensor_parallel
        group = placement_group([bundle] * ranks, strategy=self.config.placement, name=name)
        began = time.monotonic()
        deadline = began + self._ready_timeout
        while not ray.wait([group.ready()], timeout=max(0.0, min(WAIT_REPORT_S, deadline - time.monotonic())))[0]:
            waited = time.monotonic() - began
            if waited >= self._ready_timeout:
                remove_placement_group(group)
                raise PoolError(
                    f"pools.{self.name}: no placement for {worker_id}'s {ranks} bundle(s) of {_resources(bundle)} "
                    f"({self.config.placement}) within "
                    f"{self._ready_timeout:.0f}s (`ray status --address {ray.get_runtime_context().gcs_address}` "
                    "shows the cluster's resources)"
                )
            free = ray.available_resources()
            log.info(
                "pools.%s: %s waits for %s (free now: %s; %.0fs of %.0fs)",
                self.name, worker_id, _resources(bundle), _resources({k: free.get(k, 0.0) for k in bundle}),
                waited, self._ready_timeout,
            )
        log.info("pools.%s: %s loading its models", self.name, worker_id)

        def place(actor_class, index: int, *args):
            return actor_class.options(
                num_cpus=self.config.num_cpus,
                num_gpus=self.config.num_gpus,
                resources=self.config.resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
                name=None,
            ).remote(*args)

        actor = place(self._remote, 0, self._spec)
        followers = tuple(place(self._follower, r, self._spec, r) for r in range(1, ranks))
        try:
            joined = []
            if followers:
                loopback = "127.0.0.1" if self.config.placement == "STRICT_PACK" else None
                host, port = actor.open_group.remote(loopback).future().result(timeout=self._ready_timeout)
                joined = [f.start.remote(host, port) for f in followers]
            info = actor.start.remote().future().result(timeout=self._ready_timeout)
            if self.manifest_id is not None and info.manifest_id != self.manifest_id:
                raise PoolError(f"manifest_id: the worker serves {info.manifest_id}, the service {self.manifest_id}")
            rank_infos = tuple(r.future().result(timeout=self._ready_timeout) for r in [actor.rank_info.remote(), *joined]) if followers else ()
        except Exception as exc:
            for handle in (actor, *followers):
                ray.kill(handle)
            remove_placement_group(group)
            cause = root_cause(exc)
            why = f"not ready within service.ready_timeout_s = {self._ready_timeout:.0f}s" if isinstance(cause, TimeoutError) else cause
            raise PoolError(f"pools.{self.name}: {worker_id} failed to start: {why}") from exc
        client = WorkerClient(self.name, worker_id, info.address, self._spec.token, self._rpc_timeout)
        log.info("pools.%s: %s ready at %s (%.1fs)", self.name, worker_id, info.address, time.monotonic() - began)
        member = Member(worker_id, actor, group, info, client, followers, rank_infos)
        if followers:
            follows = [f.follow.remote() for f in followers]
            threading.Thread(target=self._watch, args=(member, follows), name=f"eyas-watch-{worker_id}", daemon=True).start()
        return member

    def _watch(self, member: Member, follows: list) -> None:
        """A follower returns only when its group stops or breaks: then the whole group is lost (a no-op once removed)."""
        ray.wait(follows, num_returns=1, timeout=None)
        self.lost(member)

    def _add(self, count: int) -> None:
        """Start `count` workers in parallel and add them once ready; refused at once if they can never fit."""
        short = capacity_shortfall(self.config.bundle(), count * self.config.tensor_parallel)
        if short:
            raise PoolError(f"pools.{self.name}: {short}")
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
        for actor in (member.actor, *member.followers):
            ray.kill(actor)
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
        """Route a request to the least-loaded ready worker with a free KV slot.

        Admission is by KV capacity: while every ready worker holds `kv_slots` requests, the request
        waits (unbounded: a slot frees whenever a request finishes) instead of being refused by the
        worker; while no worker is ready at all, it waits at most service.ready_timeout_s.
        """
        deadline = time.monotonic() + self._ready_timeout
        with self._cond:
            while True:
                if self._closed:
                    raise PoolError(f"pools.{self.name}: the service is stopping")
                ready = [m for m in self._members if m.state == "ready"]
                free = [m for m in ready if m.load < self._spec.kv_slots]
                if free:
                    member = min(free, key=lambda m: (m.load, m.started))
                    member.load += 1
                    return member
                if ready:
                    deadline = time.monotonic() + self._ready_timeout
                    self._cond.wait()
                    continue
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
            self._cond.notify_all()  # requests waiting for a free slot re-check: none may be ready now
            short = 0 if self._closed else self.size - len([m for m in self._members if m.state == "ready"]) - self._pending
        log.warning("pools.%s: worker %s at %s lost; replacing it", self.name, member.worker_id, member.info.address)
        member.client.close()  # new calls fail over at once; calls in flight on the channel finish first
        threading.Thread(target=self._replace, args=(member, short), name=f"eyas-replace-{self.name}", daemon=True).start()

    def _replace(self, member: Member, count: int) -> None:
        """Off the request's path: remove the lost worker, then start `count` replacements."""
        self._remove(member)
        if count <= 0:
            return
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
