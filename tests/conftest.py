"""Shared test setup: one torch thread per test process, and tests/ on the import path for `tiny`."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)
