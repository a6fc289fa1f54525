"""Emulated accelerators: timed models with a synthetic law, for benchmarks and capacity planning, never for exactness
(docs/emulation.md)."""

from .profile import ForwardCost, Law, Profile, ProfileError, bundled_profiles, load_profile
from .timed import EmulatedDevice, SyntheticDrafter, TimedTarget, emulated_manifest

__all__ = [
    "EmulatedDevice",
    "ForwardCost",
    "Law",
    "Profile",
    "ProfileError",
    "SyntheticDrafter",
    "TimedTarget",
    "bundled_profiles",
    "emulated_manifest",
    "load_profile",
]
