"""Shared test setup: one torch thread per test process, one Ray instance per test session."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for every test of the session that needs one (workers, services, Ray Train): each
    starts in seconds, so a session pays for it once. Logical CPUs enough for the largest service a test starts."""
    import ray  # only the tests that need Ray load it

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
