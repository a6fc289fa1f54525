"""eyas: EAGLE feature drafting with dynamic trees, exact verification and an explicit publish transaction.

The public names below load their module (and torch) on first use, so light modules such as
`eyas.rpc` or `eyas.trace.store`, which the client needs, do not pull the engine in.
"""

from __future__ import annotations

from importlib import import_module

_EXPORTS = {
    "Engine": "engine",
    "Generation": "engine",
    "FeatureAddress": "manifest",
    "Manifest": "manifest",
    "ManifestMismatch": "manifest",
    "SamplingParams": "sampling",
    "GenerationStats": "stats",
    "FlattenedTree": "tree",
    "TreeError": "tree",
    "TreePolicy": "tree",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    """Resolve a public name from its defining module (PEP 562) and keep it here for next time."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'eyas' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
