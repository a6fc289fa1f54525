"""The coordinator: request table, committed tokens (the source of truth), routing, recovery, accounting.

Each admitted request is placed on its own thread; its rounds run on the round driver
(`actors.driver`), which sends the calls waiting for a worker as one Batch call, so that one group
of requests drafts while another verifies. A request's rounds are the engine's own `start` /
`round_steps` (with its publish transaction) over a `RemoteRequest` (both sessions, one Round call a round). Routing is
sticky: a request keeps its draft and target worker until one is lost or retiring; then its caches
are rebuilt elsewhere from the committed tokens with `start`. Tokens reach the client only after
`RequestState.commit`, and a failed round commits nothing, so no committed token is lost or repeated
across a rebuild.

As a Ray actor, the coordinator brings up both pools (built by the factory the cluster floor
hands it) and serves the client-facing front doors: gRPC, and the OpenAI-compatible HTTP endpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import grpc
import ray
from transformers import AutoTokenizer

from eyas.autotree import Costs, TreeTuner
from eyas.errors import RequestError
from eyas.manifest import Manifest
from eyas.request import RequestState, StopRules, make_sampling, prompt_within
from eyas.rounds import RoundRecord, round_steps, start
from eyas.runtime.device import freeze_startup_objects
from eyas.steps import Steps
from eyas.trace.messages import verify_exchange
from eyas.trace.record import RequestRecorder
from eyas.trace.store import TraceWriter
from eyas.tree import TreeError, TreePolicy

from .config import ServiceConfig
from .draft_worker import DraftWorker
from .driver import RoundDriver
from .errors import ServiceError
from .frontdoor import FrontDoor
from .http_api import ServedModel
from .http_frontdoor import HttpFrontDoor
from .job import DEFAULT_MAX_NEW_TOKENS, SERVICE_PHASES, Chunk, Job
from .limits import check_id, check_prompt_text, check_stop
from .metrics import ServiceMetrics
from .proxy import RemoteRequest, SessionLost, WorkerLost
from .routing import Member, PoolError, PoolFactory, WorkerPool
from .server import advertised_address
from .target_worker import TargetWorker
from .worker import rss_bytes

log = logging.getLogger("eyas.service")


class EventLog(logging.Handler):
    """The service's progress lines (workers waiting for resources, loading, ready, lost), numbered, so whoever
    brought the service up can print them as they happen (`eyas serve`) instead of Ray's log forwarding."""

    def __init__(self, keep: int = 1000):
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(message)s"))
        self._lines: deque[tuple[int, str]] = deque(maxlen=keep)
        self._count = 0

    def emit(self, record: logging.LogRecord) -> None:
        with self.lock:
            self._lines.append((self._count, self.format(record)))
            self._count += 1

    def since(self, seen: int) -> tuple[int, list[str]]:
        """The lines after the first `seen`, and the new count."""
        with self.lock:
            return self._count, [line for number, line in self._lines if number >= seen]


class Coordinator:
    """Ray actor owning the request table and both pools; serves the front doors on 127.0.0.1 by default.

    With `trace`, every request's rounds are appended to that trace file (`eyas serve --trace`).
    """

    def __init__(self, config: ServiceConfig, make_pool: PoolFactory, trace: str | None = None):
        self.config = config
        self._make_pool = make_pool
        self.trace = TraceWriter(trace) if trace else None
        self.manifest: dict | None = None
        self.pools: dict[str, WorkerPool] = {}
        self.jobs: dict[str, Job] = {}
        self.manifest_id = ""
        self.tokenizer = None
        self.vocab_size = 0
        self.feature_width = 0
        self.max_positions = 0
        self.eos: frozenset[int] = frozenset()
        self.tuner: TreeTuner | None = None  # `tree: auto`: chooses every auto request's tree, on the workers' costs
        self._tuner_lock = threading.Lock()
        self.totals = {"completed": 0, "failed": 0, "cancelled": 0, "tokens": 0, "rounds": 0, "rebuilds": 0}
        self.stopping = False  # set by `stop`: requests still running then fail as UNAVAILABLE, not "cancelled"
        self._worker_key = secrets.token_urlsafe(32)  # the credential every worker call carries; never leaves Ray
        self.service_seconds = dict.fromkeys(SERVICE_PHASES, 0.0)
        self.started_at = time.monotonic()
        self.metrics = ServiceMetrics()
        self.metrics_address = ""
        self.running = 0  # requests being served now (the concurrency label of metrics)
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(config.max_active, thread_name_prefix="eyas-request")
        self.rounds: RoundDriver | None = None  # every request's rounds, on the event loop (`start`)
        self._frontdoor: FrontDoor | None = None
        self._http: HttpFrontDoor | None = None  # the OpenAI-compatible endpoint, when network.http_port is set
        self._stopped: asyncio.Event | None = None
        self.ray_address = ""
        self.log = EventLog()
        service_log = logging.getLogger("eyas")  # eyas.service here, eyas.cluster in the pools
        service_log.setLevel(logging.INFO)
        service_log.addHandler(self.log)
        service_log.propagate = False

    # -- lifecycle (Ray actor methods) -----------------------------------------------------------
    async def start(self, port: int = 50051) -> tuple[str, str]:
        """Take the front doors' ports (a busy one fails here, before any worker starts), bring up both pools, then
        serve; returns the gRPC front door's address and the HTTP endpoint's ("" when off) once every pool is ready."""
        self._stopped = asyncio.Event()
        self.rounds = RoundDriver(asyncio.get_running_loop(), lambda pool, calls: self.metrics.batch_calls.labels(pool).observe(calls))
        self.ray_address = ray.get_runtime_context().gcs_address
        self._frontdoor = FrontDoor(self)
        try:
            bound = self._frontdoor.bind(self.config.host, port, self.config.shared_token, self.config.max_request_bytes)
            if self.config.http_port:
                self._http = HttpFrontDoor(self, self.metrics, self.config.shared_token, self.config.max_request_bytes)
                http_bound = self._http.bind(self.config.host, self.config.http_port)
            await asyncio.to_thread(self.bring_up)
        except BaseException:
            await self._stop_doors()
            raise
        if self.config.metrics_port is not None:
            metrics_port = self.metrics.serve(self.config.metrics_port, self.config.host)
            self.metrics_address = advertised_address(self.config.host, metrics_port)
        await self._frontdoor.start()
        freeze_startup_objects()  # the pools are up: what exists now lives as long as the service
        http_address = ""
        if self._http is not None:
            target, drafter = ("", "") if self.config.emulate else self.config.models()
            model = ServedModel.of(target, drafter, self.manifest_id, self.max_positions, self.tokenizer, self.eos, self.config.emulate)
            await self._http.start(model)
            http_address = advertised_address(self.config.host, http_bound)
            log.info("http: the OpenAI-compatible API at http://%s/v1 (model %r)", http_address, model.name)
        return advertised_address(self.config.host, bound), http_address

    async def _stop_doors(self) -> None:
        for door in (self._frontdoor, self._http):
            if door is not None:
                await door.stop()

    def events(self, seen: int) -> tuple[int, list[str]]:
        """Progress lines after the first `seen` (see `EventLog`), and the new count."""
        return self.log.since(seen)

    async def stop(self) -> None:
        """Cancel every request, stop the front door, remove every worker (a request waiting on one fails), then join."""
        with self._lock:
            self.stopping = True
            jobs = list(self.jobs.values())
        for job in jobs:
            job.cancelled.set()
        await self._stop_doors()
        await asyncio.to_thread(lambda: [pool.stop() for pool in self.pools.values()])
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        if self.rounds is not None:
            self.rounds.close()
        self.metrics.close()
        if self.trace is not None:
            self.trace.close()
        if self._stopped is not None:
            self._stopped.set()

    async def wait_stopped(self) -> None:
        """Returns once `stop` has run; a caller waiting on it learns (from Ray) when this actor dies instead."""
        await self._stopped.wait()

    def bring_up(self) -> None:
        """Start both pools in parallel and check that every worker serves the same manifest."""
        log.info(
            "starting %d draft and %d target worker(s)%s", self.config.draft_pool.replicas, self.config.target_pool.replicas,
            f", emulated ({self.config.emulate})" if self.config.emulate else "",
        )
        target_dir = None if self.config.emulate else self.config.models()[0]
        if target_dir is not None and Path(target_dir, "tokenizer_config.json").exists():
            self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        for name, actor_class, pool_config in (
            ("draft", DraftWorker, self.config.draft_pool),
            ("target", TargetWorker, self.config.target_pool),
        ):
            spec = dataclasses.replace(self.config.worker_spec(pool_config), token=self._worker_key)
            self.pools[name] = self._make_pool(name, actor_class, pool_config, spec, self.config.ready_timeout_s, self.config.rpc_timeout_s)
        with ThreadPoolExecutor(2) as starter:
            futures = [starter.submit(pool.start) for pool in self.pools.values()]
            wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            for pool in self.pools.values():
                pool.stop()
            raise errors[0]
        members = [m for pool in self.pools.values() for m in pool.members()]
        manifests = {m.info.manifest_id for m in members}
        if len(manifests) != 1:
            for pool in self.pools.values():
                pool.stop()
            raise PoolError(f"manifest_id: draft and target workers disagree on the manifest ({sorted(manifests)})")
        self.manifest_id = manifests.pop()
        stored = None if self.config.emulate else Manifest.load(self.config.models()[1])
        self.manifest = stored.to_dict() if stored is not None and stored.id == self.manifest_id else None
        for pool in self.pools.values():
            pool.manifest_id = self.manifest_id
        info = self.pools["target"].members()[0].info
        self.vocab_size, self.feature_width, self.max_positions = info.vocab_size, info.feature_width, info.max_positions
        self.eos = frozenset(info.eos_token_ids)
        if self.config.policy == "auto":
            self.tuner = TreeTuner(self._measure_costs())

    def _measure_costs(self) -> Costs:
        """`tree: auto`'s prices: a target worker's verification time by rows and a draft worker's step time by rows,
        each measured on its own device (the pools' workers are alike). What a round spends beyond them (the RPCs
        among it) the tuner learns from the rounds themselves."""
        log.info("tree auto: measuring forward costs on a draft and a target worker")
        target = self.pools["target"].members()[0].client.costs()
        draft = self.pools["draft"].members()[0].client.costs()
        return Costs(*target, *draft)

    # -- admission --------------------------------------------------------------------------------
    def admit(
        self,
        prompt: str | Sequence[int],
        emit: Callable[[Chunk | Exception], None],
        request_id: str = "",
        max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS,
        sampling: dict | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        tree: TreePolicy | None = None,
        trace: bool = False,
        special_tokens: bool = True,
    ) -> Job:
        """Validate a request, enter it in the request table and queue it; `emit` receives its chunks
        (with this request's trace frames when `trace`). `max_new_tokens` None: up to the target's last position;
        `special_tokens` False: a text prompt is tokenized without the tokenizer's own (a rendered chat template)."""
        check_id(request_id, "request_id")
        check_stop(list(stop))
        sampling_params = make_sampling("sampling.", **(sampling or {}))
        eos = frozenset() if ignore_eos else self.eos
        rules = StopRules(max_new_tokens, eos, tuple(stop)) if max_new_tokens is not None else None
        if isinstance(prompt, str):
            check_prompt_text(prompt, self.max_positions)
        where = f"the target's {self.max_positions} positions"
        ids = prompt_within(prompt, self.tokenizer, self.vocab_size, max_new_tokens, self.max_positions, where, special_tokens)
        rules = rules or StopRules(self.max_positions - len(ids), eos, tuple(stop))  # None: as many new tokens as fit
        policy = self._check_tree(tree) if tree is not None else None if self.config.policy == "auto" else self.config.policy
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        state = RequestState(request_id or f"req-{uuid.uuid4().hex[:16]}", ids, sampling_params, rules, decode=decode)
        job = Job(state, policy, emit)
        with self._lock:
            if state.request_id in self.jobs:
                raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, "request_id", f"{state.request_id!r} is already running")
            self.jobs[state.request_id] = job
        if trace or self.trace is not None:
            job.trace_out = [] if trace else None
            header = policy if policy is not None else self.tuner.current  # an auto request's rounds each name their own
            job.recorder = RequestRecorder(self._trace_sink(job), state, header, self.manifest_id, self.manifest, "service")
        self._executor.submit(self._serve, job)
        return job

    def _tree_status(self) -> dict:
        """The fixed policy's knobs, or under auto the latest policy chosen at each concurrency (from the tuner's
        history: an exploration clears its current choices, not what it chose before) and the exploring rounds
        still to run before it chooses (a short request may end within the first exploration)."""
        if self.tuner is None:
            return {"tree": dataclasses.asdict(self.config.policy), "tree_auto": False}
        latest: dict[int, TreePolicy] = {}
        with self._tuner_lock:
            for entry in self.tuner.history:  # oldest first: the latest choice at each concurrency wins
                latest[entry["concurrent"]] = entry["policy"]
            exploring = self.tuner.exploring
        chosen = {str(n): dataclasses.asdict(p) for n, p in sorted(latest.items())}
        return {"tree_auto": True, "tree_chosen": chosen, "tree_exploring": exploring}

    def _trace_sink(self, job: Job) -> Callable[[bytes], None]:
        """Trace frames go to the service's trace file and, when the client asked, to its next chunk."""

        def sink(frames: bytes) -> None:
            if self.trace is not None:
                self.trace.write(frames)
            if job.trace_out is not None:
                job.trace_out.append(frames)

        return sink

    def _check_tree(self, tree: TreePolicy) -> TreePolicy:
        for knob in ("width", "depth", "budget"):
            limit = getattr(self.config.tree_limit, knob)
            if getattr(tree, knob) > limit:
                raise TreeError(f"tree.{knob}", f"{getattr(tree, knob)} exceeds the service's {limit}")
        return tree

    def cancel(self, request_id: str) -> None:
        with self._lock:
            job = self.jobs.get(request_id)
        if job is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, "request_id", f"no running request {request_id!r}")
        job.cancelled.set()

    # -- serving one request ----------------------------------------------------------------------
    def _serve(self, job: Job) -> None:
        """Place the request, run its rounds until it finishes, then free its caches and report."""
        job.started = True
        began = time.perf_counter()
        with self._lock:
            self.running += 1
            self.metrics.active.set(self.running)
        error: Exception | None = None
        try:
            while not job.state.done:
                if job.cancelled.is_set():
                    if self.stopping:
                        raise ServiceError(grpc.StatusCode.UNAVAILABLE, "service", "the service stopped before the request finished")
                    job.state.finish_reason = "cancelled"
                    break
                if job.session is None:
                    t0 = time.perf_counter()
                    self._place(job)
                    job.stats.add_prefill(time.perf_counter() - t0)
                    continue
                if job.draft.state != "ready" or job.target.state != "ready":
                    self._rebuild(job, None)
                    continue
                try:
                    self.rounds.run(self._rounds(job), (job.draft.client,))
                except (WorkerLost, SessionLost) as lost:
                    self._rebuild(job, lost)
        except Exception as exc:
            error = exc
        self.metrics.observe_request(time.perf_counter() - began, self.running)
        with self._lock:
            self.running -= 1
            self.metrics.active.set(self.running)
        self._close(job)
        self._conclude(job, error)

    def _rounds(self, job: Job) -> Steps[None]:
        """The request's rounds, run by the round driver, until it is done or cancelled or one of its workers is no
        longer ready (the request's thread then moves it); each round's tokens are streamed as it commits."""
        while not job.state.done and not job.cancelled.is_set() and job.draft.state == job.target.state == "ready":
            t0 = time.perf_counter()
            job.timing.reset()
            concurrent = self._stepping_together()
            policy = job.policy or self._auto_policy(concurrent)
            record = yield from round_steps(job.state, job.session, job.session, policy)
            if job.policy is None:
                self._observe(job, record, concurrent)
            job.stats.add_round(record)
            self.metrics.observe_round(record, job.timing.as_dict(), self.running)
            if job.recorder is not None:
                job.recorder.round(record, *verify_exchange(*job.session.exchange), job.timing.as_dict())
            self._emit(job, record.emitted)
            self._account(job, time.perf_counter() - t0)

    def _stepping_together(self) -> int:
        """Requests whose rounds share a target worker's forwards, on average: what `tree: auto` chooses for."""
        workers = max(1, len(self.pools["target"].members()))
        return max(1, -(-self.running // workers))

    def _observe(self, job: Job, record: RoundRecord, concurrent: int) -> None:
        """Feed an auto round to the tuner: its acceptance, and every forward its calls ran on the workers (rows,
        batch-mates' among them, and seconds), which the tuner sets against the measured curves (warm and alone
        there; inside rounds the other model has evicted their weights) for rounds of `concurrent` requests stepping
        together, as the engine feeds it every forward."""
        with self._tuner_lock:
            self.tuner.observe(record, concurrent, 0.0 if record.pre_built else job.session.off_worker)
            for rows, seconds in job.session.target_forwards:
                self.tuner.costs.observe("verify", rows, seconds, concurrent)
            if not record.pre_built:  # a tree drafted ahead computed beside the last verification
                for rows, seconds in job.session.draft_forwards:
                    self.tuner.costs.observe("draft", rows, seconds, concurrent)

    def _auto_policy(self, concurrent: int) -> TreePolicy:
        with self._tuner_lock:
            return self.tuner.policy(concurrent)

    def _place(self, job: Job, lost: Exception | None = None) -> None:
        """(Re)build the request's draft and target caches from its committed tokens on ready workers."""
        for _ in range(self.config.max_rebuilds + 1):
            if isinstance(lost, WorkerLost):
                for member in (job.draft, job.target):
                    if member is not None and member.client is lost.worker:
                        self.pools[member.client.role].lost(member)
            self._route(job)
            try:
                start(job.state, job.session, job.session)
                return
            except (WorkerLost, SessionLost) as exc:
                lost = exc
        raise ServiceError(
            grpc.StatusCode.UNAVAILABLE, "workers", f"could not rebuild the caches of {job.request_id}: {lost}"
        )

    def _route(self, job: Job) -> None:
        """Keep each ready worker (dropping its old session), replace any other with the least-loaded one."""
        for side in ("draft", "target"):
            member: Member | None = getattr(job, side)
            if member is not None and member.state == "ready":
                if job.session is not None:
                    job.session.release(side)
                continue
            pool = self.pools[side]
            if member is not None:
                if member.state == "retiring" and job.session is not None:
                    job.session.release(side)  # the worker lives on until its last request has moved
                pool.release(member)
            try:
                setattr(job, side, pool.acquire())
            except PoolError as exc:
                setattr(job, side, None)
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"pools.{side}", str(exc)) from None
        job.session = RemoteRequest(
            job.draft.client, job.target.client, job.request_id, self.manifest_id, job.timing, self.vocab_size,
            self.feature_width, job.state, with_features=job.recorder is not None,
            send_ahead=job.policy is not None and self.config.draft_ahead > 0,  # docs/wire.md, "Rounds", step 7
        )

    def _rebuild(self, job: Job, lost: Exception | None) -> None:
        """Move a request whose worker was lost or is retiring; bounded by service.max_rebuilds."""
        job.rebuilds += 1
        if job.rebuilds > self.config.max_rebuilds:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE, "workers", f"{job.request_id} needed more than {self.config.max_rebuilds} rebuilds: {lost}"
            )
        t0 = time.perf_counter()
        self._place(job, lost)
        job.service["rebuild"] += time.perf_counter() - t0

    def _emit(self, job: Job, tokens: list[int]) -> None:
        """Send a round's committed tokens with the text they add (held back while a character is incomplete)."""
        text = ""
        if job.state.decode is not None:
            full = job.state.decode(job.state.output)
            if job.state.done or not full.endswith("\ufffd"):
                text, job.text_sent = full[len(job.text_sent) :], full
        job.emit(Chunk(job.request_id, job.state.version, list(tokens), text, trace=job.take_trace()))

    def _account(self, job: Job, wall: float) -> None:
        t = job.timing
        for phase in ("compute", "rpc", "serialize", "queue", "batch"):
            job.service[phase] += getattr(t, phase)
        job.service["coordinator"] += wall - (t.compute + t.rpc + t.serialize + t.queue + t.batch)

    def _close(self, job: Job) -> None:
        """Free the request's caches on its workers (both at once) and drop it from the request table."""
        if job.session is not None:
            try:
                job.session.release("draft", "target")
            except Exception:  # the request is over either way; a worker that lost the session frees it when it goes
                log.warning("%s: could not free its sessions", job.request_id, exc_info=True)
        for side in ("draft", "target"):
            member = getattr(job, side)
            if member is not None:
                self.pools[side].release(member)
        with self._lock:
            self.jobs.pop(job.request_id, None)

    def _conclude(self, job: Job, error: Exception | None) -> None:
        with self._lock:
            outcome = "failed" if error else "cancelled" if job.state.finish_reason == "cancelled" else "completed"
            self.totals[outcome] += 1
            self.totals["tokens"] += len(job.state.output)
            self.totals["rounds"] += job.stats.rounds
            self.totals["rebuilds"] += job.rebuilds
            for phase, seconds in job.service.items():
                self.service_seconds[phase] += seconds
        if job.recorder is not None:
            job.recorder.end(job.state, "" if error is None else str(error))
        if error is not None:
            job.emit(error)
            return
        job.emit(Chunk(job.request_id, job.state.version, [], "", job.state.finish_reason, job.stats_dict(), job.take_trace()))

    # -- operations -------------------------------------------------------------------------------
    def scale(self, draft: int | None = None, target: int | None = None) -> dict:
        """Resize the pools (in parallel) without failing requests; returns the status afterwards."""
        sizes = {"draft": draft, "target": target}
        for name, size in sizes.items():
            if size is not None and (type(size) is not int or size < 1):
                raise RequestError(name, f"pool size must be an integer >= 1, got {size!r}")
        with ThreadPoolExecutor(2) as resizer:
            futures = [resizer.submit(self.pools[n].resize, s) for n, s in sizes.items() if s is not None]
        for future in futures:
            if future.exception() is not None:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "pools", str(future.exception()))
        return self.status()

    def status(self) -> dict:
        """Pools with each worker's health, request counts and acceptance so far."""
        pools = []
        ranks = {"draft": self.config.draft_pool.tensor_parallel, "target": self.config.target_pool.tensor_parallel}
        for name, pool in self.pools.items():
            workers = []
            for member in pool.members():
                entry = {
                    "worker_id": member.worker_id,
                    "state": member.state,
                    "node_id": member.info.node_id,
                    "address": member.info.address,
                    "pid": member.info.pid,
                    "assigned": member.load,
                }
                if member.ranks:  # a target group: each rank's device and shard (session KV bytes are per rank)
                    entry["ranks"] = [dataclasses.asdict(rank) for rank in member.ranks]
                try:
                    health = member.client.health()
                    entry.update(
                        sessions=health.sessions,
                        kv_bytes=health.kv_bytes,
                        rss_bytes=health.rss_bytes,
                        calls=health.calls,
                        busy_seconds=health.busy_seconds,
                        forwards=health.forwards,
                        forward_calls=health.forward_calls,
                        forward_seconds=health.forward_seconds,
                        **({"options_offered": health.options_offered, "options_taken": health.options_taken} if name == "target" else {}),
                    )
                except (grpc.RpcError, WorkerLost):
                    pool.lost(member)
                    entry["state"] = "lost"
                workers.append(entry)
            pools.append({"name": name, "size": pool.size, "tensor_parallel": ranks[name], "workers": workers})
        with self._lock:
            active = sum(job.started for job in self.jobs.values())
            return {
                "manifest_id": self.manifest_id,
                "pools": pools,
                "active": active,
                "queued": len(self.jobs) - active,
                **self.totals,
                "mean_accept_length": self.totals["tokens"] / self.totals["rounds"] if self.totals["rounds"] else 0.0,
                **self._tree_status(),
                "uptime_seconds": time.monotonic() - self.started_at,
                "service_seconds": dict(self.service_seconds),
                "metrics_address": self.metrics_address,
                "ray_address": self.ray_address,
                "coordinator_rss_bytes": rss_bytes(),
                "emulation": self.config.emulate or "",
                "metrics": self.metrics.snapshot(),
            }
