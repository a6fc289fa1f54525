"""EAGLE drafters: EAGLE-1 (feature regression) and EAGLE-3 (three taps, own draft vocabulary)."""

from .base import Drafter
from .checkpoint import CheckpointError, LoadReport, build_drafter, drafter_config, load_drafter, save_drafter
from .eagle1 import Eagle1Drafter
from .eagle3 import Eagle3Drafter
from .layers import KVCache

__all__ = [
    "CheckpointError",
    "Drafter",
    "Eagle1Drafter",
    "Eagle3Drafter",
    "KVCache",
    "LoadReport",
    "build_drafter",
    "drafter_config",
    "load_drafter",
    "save_drafter",
]
