"""eyas's execution layer: its own Llama-family forward, a preallocated KV pool, batches, devices (docs/runtime.md)."""

from .batch import Lockstep, RowsCall, Scheduler, pack
from .device import resolve_device, resolve_dtype
from .kv import KVCapacityError, KVPool, PassThroughKV, SlotBatch
from .model import SUPPORTED_MODEL_TYPES, CausalLM

__all__ = [
    "CausalLM",
    "KVCapacityError",
    "KVPool",
    "Lockstep",
    "PassThroughKV",
    "RowsCall",
    "SUPPORTED_MODEL_TYPES",
    "Scheduler",
    "SlotBatch",
    "pack",
    "resolve_device",
    "resolve_dtype",
]
