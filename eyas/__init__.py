"""eyas: EAGLE feature drafting with dynamic trees, exact verification and an explicit publish transaction."""

from .engine import Engine, Generation
from .manifest import FeatureAddress, Manifest, ManifestMismatch
from .sampling import SamplingParams
from .stats import GenerationStats
from .tree import FlattenedTree, TreeError, TreePolicy

__all__ = [
    "Engine",
    "FeatureAddress",
    "FlattenedTree",
    "Generation",
    "GenerationStats",
    "Manifest",
    "ManifestMismatch",
    "SamplingParams",
    "TreeError",
    "TreePolicy",
]
