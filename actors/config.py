"""The service configuration (YAML): models, tree policy, pools, network, service limits, embedded Ray.

Every section and key is checked on load; an unknown or ill-typed key is refused with its dotted
name, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml
from transformers import AutoConfig

from eyas.assets import DEFAULT_DRAFTER, demo_model
from eyas.autotree import EXPLORE
from eyas.drafters.checkpoint import CheckpointError
from eyas.emulation import Profile, ProfileError, load_profile
from eyas.engine import tree_setting
from eyas.manifest import Manifest
from eyas.pairing import plan_drafter, target_num_layers
from eyas.rpc import MIN_REQUEST_BYTES
from eyas.runtime.device import DTYPES
from eyas.runtime.shard import ShardError, check_shardable
from eyas.stored_tree import default_tree
from eyas.tree import TreePolicy

from .server import DEFAULT_HOST, DEFAULT_HTTP_PORT
from .worker import WorkerSpec


MAX_DRAFT_AHEAD = 16  # trees a draft worker may pre-build per request and round


class ConfigError(ValueError):
    """A configuration key is unknown or has a bad value; the message names it."""


PLACEMENTS = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")  # Ray placement-group strategies


@dataclass(frozen=True)
class PoolConfig:
    """One pool of identical workers: how many, and what each one reserves from Ray."""

    replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    threads: int = 1
    tensor_parallel: int = 1  # ranks per worker, each reserving one bundle (target only; docs/groups.md)
    placement: str = "STRICT_PACK"  # how a worker's bundles are placed: STRICT_PACK keeps a group on one node

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle one worker (one rank of a group) reserves."""
        bundle = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: float(v) for k, v in bundle.items() if v}

    def check(self, name: str) -> None:
        if type(self.replicas) is not int or self.replicas < 1:
            raise ConfigError(f"pools.{name}.replicas: must be an integer >= 1, got {self.replicas!r}")
        if type(self.threads) is not int or self.threads < 1:
            raise ConfigError(f"pools.{name}.threads: must be an integer >= 1, got {self.threads!r}")
        for key in ("num_cpus", "num_gpus"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"pools.{name}.{key}: must be a number >= 0, got {value!r}")
        if not isinstance(self.resources, dict) or any(
            not isinstance(v, (int, float)) or v < 0 for v in self.resources.values()
        ):
            raise ConfigError(f"pools.{name}.resources: must map resource names to numbers >= 0")
        if not self.bundle():
            raise ConfigError(f"pools.{name}: a worker must reserve some resource (num_cpus, num_gpus or resources)")
        if type(self.tensor_parallel) is not int or self.tensor_parallel < 1:
            raise ConfigError(f"pools.{name}.tensor_parallel: must be an integer >= 1, got {self.tensor_parallel!r}")
        if self.tensor_parallel > 1 and name != "target":
            raise ConfigError(f"pools.{name}.tensor_parallel: only target workers run as groups, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and self.num_gpus != int(self.num_gpus):
            raise ConfigError(f"pools.{name}.num_gpus: each rank of a group needs whole devices, got {self.num_gpus}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"pools.{name}.placement: {self.placement!r} is not one of {list(PLACEMENTS)}")

    def check_fits(self, name: str, gpus: int, cpus: int | None) -> None:
        """Refuse, before Ray starts, a group needing more devices (or CPUs) than the one machine of an embedded Ray has."""
        ranks = self.tensor_parallel
        if self.num_gpus and ranks * self.num_gpus > gpus:
            raise ConfigError(f"pools.{name}.tensor_parallel: {ranks} ranks of {self.num_gpus:g} GPU each exceed the {gpus} visible devices")
        if cpus is not None and ranks * self.num_cpus > cpus:
            raise ConfigError(f"pools.{name}.tensor_parallel: {ranks} ranks of {self.num_cpus:g} CPU each exceed ray.num_cpus {cpus}")


@dataclass(frozen=True)
class ServiceConfig:
    """Everything `eyas serve` needs; see configs/local.yaml for the annotated default."""

    target: str | None = None
    drafter: str | None = None
    emulate: str | None = None  # a cost profile (eyas.emulation): timed models stand in for both
    dtype: str = "auto"
    draft_dtype: str = "auto"
    feature_layers: tuple[int, ...] | None = None
    allow_manifest_mismatch: bool = False
    tree: TreePolicy | str | None = None  # None: the drafter's stored tree (`policy`); "auto": tree auto (eyas.autotree)
    draft_pool: PoolConfig = PoolConfig()
    target_pool: PoolConfig = PoolConfig()
    host: str = DEFAULT_HOST
    token: str | None = None
    http_port: int = DEFAULT_HTTP_PORT  # the OpenAI-compatible HTTP endpoint (docs/http.md); 0: none
    max_active: int = 32
    kv_slots: int = 16  # requests one worker's KV pool holds at once; more wait for a slot (admission by capacity)
    rpc_timeout_s: float = 120.0
    ready_timeout_s: float = 600.0
    max_rebuilds: int = 8
    draft_ahead: int = 0
    metrics_port: int | None = None
    max_request_bytes: int = 1 << 20  # largest front-door message, refused before it is decoded
    ray_num_cpus: int | None = None

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> "ServiceConfig":
        """Read a YAML config (defaults when None), then apply keyword overrides of top-level fields."""
        data = {}
        if path is not None:
            data = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(data, dict):
                raise ConfigError(f"{path}: the config must be a mapping of sections")
        return replace(cls.from_dict(data), **overrides)

    @classmethod
    def from_dict(cls, data: dict) -> "ServiceConfig":
        sections = _take(data, "", {"models", "tree", "pools", "network", "service", "ray"})
        models = _take(sections.get("models") or {}, "models.", {"target", "drafter", "emulate", "dtype", "draft_dtype", "feature_layers", "allow_manifest_mismatch"})
        pools = _take(sections.get("pools") or {}, "pools.", {"draft", "target"})
        network = _take(sections.get("network") or {}, "network.", {"host", "token", "http_port"})
        service = _take(sections.get("service") or {}, "service.", {"max_active", "kv_slots", "rpc_timeout_s", "ready_timeout_s", "max_rebuilds", "metrics_port", "max_request_bytes", "draft_ahead"})
        ray_section = _take(sections.get("ray") or {}, "ray.", {"num_cpus"})
        tree = sections.get("tree")
        if isinstance(tree, str):
            if tree != "auto":
                raise ConfigError(f'tree: "auto" or a mapping of width, depth and budget, got {tree!r}')
        elif tree is not None:
            try:
                tree = TreePolicy.from_dict(tree)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        layers = models.get("feature_layers")
        config = cls(
            target=_path(models.get("target")),
            drafter=_path(models.get("drafter")),
            emulate=models.get("emulate"),
            dtype=models.get("dtype", "auto"),
            draft_dtype=models.get("draft_dtype", "auto"),
            feature_layers=tuple(layers) if layers is not None else None,
            allow_manifest_mismatch=bool(models.get("allow_manifest_mismatch", False)),
            tree=tree,
            draft_pool=_pool(pools.get("draft") or {}, "draft"),
            target_pool=_pool(pools.get("target") or {}, "target"),
            host=network.get("host", DEFAULT_HOST),
            token=network.get("token"),
            http_port=network.get("http_port", DEFAULT_HTTP_PORT),
            **service,
            ray_num_cpus=ray_section.get("num_cpus"),
        )
        config.check()
        return config

    def check(self) -> None:
        for key in ("dtype", "draft_dtype"):
            if getattr(self, key) != "auto" and getattr(self, key) not in DTYPES:
                raise ConfigError(f"models.{key}: {getattr(self, key)!r} is not auto or one of {sorted(DTYPES)}")
        self.draft_pool.check("draft")
        self.target_pool.check("target")
        if self.emulation is not None and self.target_pool.tensor_parallel > 1:  # a bad profile is refused as it loads
            raise ConfigError("pools.target.tensor_parallel: an emulated target is one worker (its profile prices the group)")
        if type(self.max_active) is not int or self.max_active < 1:
            raise ConfigError(f"service.max_active: must be an integer >= 1, got {self.max_active!r}")
        if type(self.kv_slots) is not int or self.kv_slots < 1:
            raise ConfigError(f"service.kv_slots: must be an integer >= 1, got {self.kv_slots!r}")
        if type(self.max_request_bytes) is not int or not MIN_REQUEST_BYTES <= self.max_request_bytes <= 256 << 20:
            raise ConfigError(f"service.max_request_bytes: must be an integer {MIN_REQUEST_BYTES}..{256 << 20}, got {self.max_request_bytes!r}")
        if type(self.draft_ahead) is not int or not 0 <= self.draft_ahead <= MAX_DRAFT_AHEAD:
            raise ConfigError(f"service.draft_ahead: must be an integer in [0, {MAX_DRAFT_AHEAD}], got {self.draft_ahead!r}")
        if type(self.max_rebuilds) is not int or self.max_rebuilds < 0:
            raise ConfigError(f"service.max_rebuilds: must be an integer >= 0, got {self.max_rebuilds!r}")
        if self.metrics_port is not None and (type(self.metrics_port) is not int or not 0 <= self.metrics_port < 65536):
            raise ConfigError(f"service.metrics_port: must be null or a port number 0..65535 (0: any free port), got {self.metrics_port!r}")
        if self.ray_num_cpus is not None and (type(self.ray_num_cpus) is not int or self.ray_num_cpus < 1):
            raise ConfigError(f"ray.num_cpus: must be null or an integer >= 1, got {self.ray_num_cpus!r}")
        if type(self.http_port) is not int or not 0 <= self.http_port < 65536:
            raise ConfigError(f"network.http_port: must be a port number 1..65535, or 0 for no HTTP endpoint, got {self.http_port!r}")
        for key in ("rpc_timeout_s", "ready_timeout_s"):
            if not isinstance(getattr(self, key), (int, float)) or getattr(self, key) <= 0:
                raise ConfigError(f"service.{key}: must be a positive number of seconds")

    def embedded_cpus(self) -> int:
        """Logical CPUs of an embedded Ray: `ray.num_cpus`, else this machine's cores or, when more, twice what the
        pools reserve, so each pool can double at run time (`eyas scale`) on any machine (docs/deploy.md)."""
        if self.ray_num_cpus is not None:
            return self.ray_num_cpus
        pools = sum(p.replicas * p.tensor_parallel * p.num_cpus for p in (self.draft_pool, self.target_pool))
        return max(os.cpu_count() or 1, math.ceil(2 * pools))

    @functools.cached_property
    def policy(self) -> TreePolicy | str:
        """The configured tree; else auto for emulated models, else the tree stored beside the drafter for its
        manifest's target, else TreePolicy()."""
        if self.tree is not None or self.emulate:
            return self.tree or "auto"
        drafter = self.models()[1]
        manifest = Manifest.load(drafter)
        return default_tree(drafter, manifest.target.weight_digest if manifest else "", tree_setting)

    @property
    def tree_limit(self) -> TreePolicy:
        """The largest tree a round may draft, knob by knob: the configured fixed policy; under auto, or with none
        configured, the widest tree auto explores (and the stored tree where it is wider)."""
        if isinstance(self.tree, TreePolicy):
            return self.tree
        widest = [EXPLORE] if self.policy == "auto" else [EXPLORE, self.policy]
        return TreePolicy(*(max(getattr(p, knob) for p in widest) for knob in ("width", "depth", "budget")))

    @property
    def shared_token(self) -> str | None:
        """The configured token, else EYAS_TOKEN from the environment."""
        return self.token or os.environ.get("EYAS_TOKEN") or None

    @property
    def emulation(self) -> Profile | None:
        """The cost profile of `models.emulate`, or None when the service runs real models."""
        if self.emulate is None:
            return None
        try:
            return load_profile(self.emulate)
        except ProfileError as exc:
            raise ConfigError(f"models.emulate: {exc}") from None

    def models(self) -> tuple[str, str]:
        """Absolute target and drafter directories (the bundled demo models when not configured)."""
        target = Path(self.target or demo_model("target")).resolve()
        drafter = Path(self.drafter or demo_model(DEFAULT_DRAFTER)).resolve()
        for key, path in (("models.target", target), ("models.drafter", drafter)):
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"{key}: {path} is not a model directory (no config.json)")
        return str(target), str(drafter)

    def worker_spec(self, pool: PoolConfig) -> WorkerSpec:
        target, drafter = ("", "") if self.emulate else self.models()
        return WorkerSpec(
            target=target,
            drafter=drafter,
            tree_limit=self.tree_limit,
            dtype=self.dtype,
            draft_dtype=self.draft_dtype,
            feature_layers=self.feature_layers,
            allow_manifest_mismatch=self.allow_manifest_mismatch,
            host=self.host,
            threads=pool.threads,
            tensor_parallel=pool.tensor_parallel,
            draft_ahead=self.draft_ahead,
            kv_slots=self.kv_slots,
            emulate=self.emulate,
            rpc_timeout_s=self.rpc_timeout_s,
        )

    def check_drafter(self) -> None:
        """Refuse a drafter directory that holds no drafter (a target model, say) before any worker loads it."""
        target, drafter = self.models()
        try:
            plan_drafter(drafter, target_num_layers(target), self.feature_layers)
        except CheckpointError as exc:
            raise ConfigError(f"models.drafter: {exc}") from None

    def check_target_split(self) -> None:
        """Refuse a target group that would not split the target's heads, kv heads, experts or vocabulary evenly."""
        if self.emulate:
            return
        target, _ = self.models()
        config = AutoConfig.from_pretrained(target).get_text_config(decoder=True)
        try:
            check_shardable(config, self.target_pool.tensor_parallel)
        except ShardError as exc:
            raise ConfigError(f"pools.target.{exc}") from None


def _take(section: Any, prefix: str, allowed: set[str]) -> dict:
    if not isinstance(section, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: must be a mapping")
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key (expected one of {sorted(allowed)})")
    return section


def _pool(section: dict, name: str) -> PoolConfig:
    allowed = {f.name for f in fields(PoolConfig)}
    return PoolConfig(**_take(section, f"pools.{name}.", allowed))


def _path(value: str | None) -> str | None:
    return None if value is None else str(Path(value).expanduser().resolve())
