"""Shared test setup: one torch thread per test process."""

import torch

torch.set_num_threads(1)
