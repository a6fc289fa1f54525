"""eyas's execution layer: its own Llama-family forward, a preallocated KV pool, batched rows, devices.

See docs/runtime.md for the KV layout, how a tree is written and committed, and how a batch is packed.
"""

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
