"""Bringing a service up: Ray (an embedded local instance, or an existing cluster), the coordinator, its pools.

The coordinator actor is pinned to this process's node, so its front door's 127.0.0.1 address is
reachable from here. With an embedded Ray instance, stopping the service also stops Ray.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from eyas.actors.coordinator import Coordinator

from .config import ServiceConfig
from .pools import root_cause

DEFAULT_PORT = 50051


class Service:
    """A running eyas service; use as a context manager or call `start` / `stop`.

    With `trace` (a file path), every request's rounds are appended to that trace.
    """

    def __init__(self, config: ServiceConfig, address: str | None = None, port: int = DEFAULT_PORT, trace: str | None = None):
        self.config = config
        self.ray_address = address
        self.port = port
        self.trace = str(Path(trace).resolve()) if trace else None
        self.address = ""
        self.coordinator: ray.actor.ActorHandle | None = None
        self._owns_ray = False

    def start(self) -> "Service":
        """Start (or join) Ray, then the coordinator and both pools; returns once the front door serves."""
        self.config.models()  # a missing model directory is reported before anything starts
        if not ray.is_initialized():
            embedded = self.ray_address is None
            ray.init(
                address=self.ray_address,
                num_cpus=self.config.ray_num_cpus if embedded else None,
                include_dashboard=False,
                configure_logging=True,
                logging_level="warning",
            )
            self._owns_ray = True
        here = ray.get_runtime_context().get_node_id()
        self.coordinator = (
            ray.remote(Coordinator)
            .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False))
            .remote(self.config, self.trace)
        )
        try:
            self.address = ray.get(self.coordinator.start.remote(self.port))
        except BaseException as exc:
            self.stop()
            cause = root_cause(exc)
            if cause is exc:
                raise
            raise cause from None
        return self

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
    config: ServiceConfig, address: str | None, port: int, on_ready: Callable[[str], None], trace: str | None = None
) -> None:
    """Run a service until SIGINT or SIGTERM; `on_ready` gets the front door's address once every pool is ready."""
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    with Service(config, address, port, trace) as service:
        on_ready(service.address)
        stopping.wait()
