"""Shared test setup: one torch thread per test process, one Ray instance per test session."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ray_session():
    """The session's one local Ray instance (workers, services, Ray Train), started by the first module that needs it
    and again after a module that ran a cluster of its own; logical CPUs enough for the largest service a test starts."""
    import ray  # only the tests that need Ray load it

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
