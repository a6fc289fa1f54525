"""Bringing a service up: Ray (an embedded local instance, or an existing cluster), the coordinator, its pools.

The coordinator actor is pinned to this process's node, so its front door's 127.0.0.1 address is
reachable from here. With an embedded Ray instance, stopping the service also stops Ray. A Ray the
service starts or joins must refuse calls without its token (docs/deploy.md), unless the caller
allows an insecure one.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from eyas.actors.config import ConfigError, ServiceConfig
from eyas.actors.coordinator import Coordinator
from eyas.actors.server import HTTP_PORT, check_port

from . import rayenv
from .pools import Pool, root_cause

DEFAULT_PORT = 50051
PROGRESS_POLL_S = 0.5  # how often a starting service's progress lines are fetched


class _DropTokenAuthNotice(logging.Filter):
    """Ray says on every start that it enabled token authentication; eyas says where its Ray is instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_DropTokenAuthNotice())


INSECURE_RISK = "anyone who reaches its ports can run code in it"


def _refusal(what: str) -> ConfigError:
    return ConfigError(f"ray: {what}: {INSECURE_RISK}; use token authentication (docs/deploy.md) or allow it with --allow-insecure-ray")


class ServiceLost(RuntimeError):
    """The coordinator died: nothing serves any more, so `eyas serve` exits (a supervisor restarts it)."""


class Service:
    """A running eyas service; use as a context manager or call `start` / `stop`.

    With `trace` (a file path), every request's rounds are appended to that trace. `on_progress` receives
    one line per step of bringing it up (Ray, each worker waiting, loading, ready) and, through `report`, later.
    `allow_insecure_ray` lets it start or join a Ray whose control plane takes calls without a token.
    """

    def __init__(
        self,
        config: ServiceConfig,
        address: str | None = None,
        port: int = DEFAULT_PORT,
        trace: str | None = None,
        on_progress: Callable[[str], None] | None = None,
        allow_insecure_ray: bool = False,
    ):
        self.config = config
        self.allow_insecure_ray = allow_insecure_ray
        self.ray_address = address
        self.port = port
        self.trace = str(Path(trace).resolve()) if trace else None
        self.address = ""
        self.http_address = ""  # the OpenAI-compatible endpoint's host:port, when the config's network.http_port is set
        self.coordinator: ray.actor.ActorHandle | None = None
        self._owns_ray = False
        self._on_progress = on_progress
        self._reported = 0

    def start(self) -> "Service":
        """Start (or join) Ray, then the coordinator and both pools; returns once the front door serves."""
        if not self.config.emulate:
            self.config.models()  # a missing model directory is reported before anything starts
            self.config.check_drafter()  # so is a drafter directory holding no drafter
        self.config.check_target_split()  # so is a target group that cannot split the target evenly
        check_port(self.config.host, self.port)  # so is a busy front-door port (the coordinator runs on this node)
        check_port(self.config.host, self.config.http_port, *HTTP_PORT)  # and a busy HTTP port
        if not ray.is_initialized():
            embedded = self.ray_address is None
            if embedded:  # this machine is the whole cluster: a group must fit its devices
                self.config.target_pool.check_fits("target", torch.cuda.device_count(), self.config.embedded_cpus())
                if rayenv.auth_mode() not in ("", "token") and not self.allow_insecure_ray:
                    raise _refusal(f"{rayenv.AUTH_MODE}={os.environ[rayenv.AUTH_MODE]} would start Ray without token authentication")
            else:
                self._check_cluster(self.ray_address)
            ray.init(
                address=self.ray_address or "local",  # embedded: a new instance, never one `ray start` left here
                num_cpus=self.config.embedded_cpus() if embedded else None,
                include_dashboard=False,
                configure_logging=True,
                logging_level="warning",
            )
            self._owns_ray = True
            gcs = ray.get_runtime_context().gcs_address
            if embedded and not rayenv.requires_token(gcs):  # checked, not assumed from the settings
                try:
                    self._insecure(f"the embedded Ray at {gcs} takes calls without a token")
                except ConfigError:
                    self.stop()
                    raise
        context = ray.get_runtime_context()
        where = "an embedded Ray instance" if self._owns_ray and self.ray_address is None else "the Ray cluster"
        self._say(f"ray: {where} at {context.gcs_address} ({ray.cluster_resources().get('CPU', 0):g} CPUs)")
        here = context.get_node_id()
        self.coordinator = (
            ray.remote(Coordinator)
            .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False))
            .remote(self.config, Pool, self.trace)
        )
        try:
            started = self.coordinator.start.remote(self.port)
            while not ray.wait([started], timeout=PROGRESS_POLL_S)[0]:
                self.report()
            self.report()
            self.address, self.http_address = ray.get(started)
        except BaseException as exc:
            self.stop()
            cause = root_cause(exc)
            if cause is exc:
                raise
            raise cause from None
        return self

    def _check_cluster(self, address: str) -> None:
        """Before joining the cluster whose GCS is at `address`: it must refuse a call without its token, and this
        process must then hold that token (RAY_AUTH_MODE=token), or Ray's own refusal would take it many seconds."""
        if not rayenv.requires_token(address):
            self._insecure(f"the Ray cluster at {address} takes calls without a token")
        elif rayenv.auth_mode() != "token":
            raise ConfigError(
                f"ray: the Ray cluster at {address} requires its token: set {rayenv.AUTH_MODE}=token and the token "
                "(RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN; docs/deploy.md)"
            )

    def _insecure(self, what: str) -> None:
        """Refuse a Ray control plane open to anyone who reaches its ports, or say it is allowed."""
        if not self.allow_insecure_ray:
            raise _refusal(what)
        self._say(f"ray: warning: {what}: {INSECURE_RISK} (allowed by --allow-insecure-ray)")

    def _say(self, line: str) -> None:
        if self._on_progress is not None:
            self._on_progress(line)

    def report(self) -> None:
        """Hand the service's progress lines since the last report to `on_progress`."""
        if self._on_progress is not None and self.coordinator is not None:
            self._reported, lines = ray.get(self.coordinator.events.remote(self._reported))
            for line in lines:
                self._on_progress(line)

    def stop(self) -> None:
        """Stop the coordinator (which removes every worker), then Ray if this service started it."""
        if self.coordinator is not None:
            try:
                ray.get(self.coordinator.stop.remote(), timeout=60)
            except Exception:
                pass
            ray.kill(self.coordinator)
            self.coordinator = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> "Service":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(
    config: ServiceConfig,
    address: str | None,
    port: int,
    on_ready: Callable[[str], None],
    trace: str | None = None,
    on_progress: Callable[[str], None] | None = None,
    allow_insecure_ray: bool = False,
) -> None:
    """Run a service until SIGINT or SIGTERM; `on_ready` gets the front door's address once every pool is ready,
    `on_progress` every progress line (bring-up, then workers lost, replaced or added by scaling)."""
    stopping = threading.Event()

    def stop_on_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stopping.set())

    stop_on_signals()
    with Service(config, address, port, trace, on_progress, allow_insecure_ray) as service:
        stop_on_signals()  # ray.init replaced the SIGTERM handler with one that exits mid-call
        on_ready(service.address)
        lost: list[BaseException] = []

        def watch() -> None:
            try:
                ray.get(service.coordinator.wait_stopped.remote())
            except Exception as exc:  # the coordinator died (or Ray went away): no front door is left
                lost.append(exc)
            stopping.set()

        threading.Thread(target=watch, name="eyas-watch-coordinator", daemon=True).start()
        while not stopping.wait(PROGRESS_POLL_S):
            try:
                service.report()
            except ray.exceptions.RayError:
                stopping.wait()  # the coordinator is gone: the watcher says why
        if lost:
            raise ServiceLost(f"the coordinator died ({type(root_cause(lost[0])).__name__}); nothing serves at {service.address} any more")
