"""Where a model runs and in which dtype (docs/runtime.md, "Devices and dtypes"), and the process settings its
forwards need."""

from __future__ import annotations

import ctypes
import gc
import json
import platform
from pathlib import Path

import torch

from .linear import packs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
HEAP_BUFFERS = 32 << 20  # glibc's largest mmap threshold: buffers up to this size come from the heap
KEPT_FREE = 64 << 20  # freed heap kept for the next call's buffers


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch device from a name; refuses CUDA where none is visible, naming what was asked."""
    device = torch.device(device or "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device} was requested but no CUDA device is visible to this process")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {device} is not cpu, cuda or cuda:N")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, stored: str | None = None) -> torch.dtype:
    """None or "auto": float32 on CPU; on CUDA the checkpoint's `stored` half dtype, else bfloat16. Otherwise the
    named dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cpu":
            return torch.float32
        return DTYPES[stored] if stored in ("bfloat16", "float16") else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not auto or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_draft_dtype(draft_dtype: str | torch.dtype | None, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The drafter's dtype beside a target in `dtype`. None or "auto": bfloat16 where the target runs in float32 on
    a CPU whose oneDNN has bfloat16 products, else the target's `dtype`. Otherwise the named dtype."""
    if draft_dtype in (None, "auto"):
        on_bf16_units = packs(torch.bfloat16, device)  # a CPU whose oneDNN has bf16 products
        return torch.bfloat16 if dtype == torch.float32 and on_bf16_units else dtype
    return resolve_dtype(draft_dtype, device)


def prepare(device: torch.device) -> None:
    """Set the process-wide options the runtime's forwards on `device` need; an engine or a worker calls it once at
    start. Freed memory stays for reuse (`keep_freed_memory`); on CUDA, cuDNN's attention is off (docs/runtime.md,
    "Attention on CUDA")."""
    keep_freed_memory()
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def freeze_startup_objects() -> None:
    """In a process that serves until it exits (a worker, the coordinator; not an engine, which lives in its caller's
    process): move every object alive now (modules, models: some 400,000) out of the cyclic collector's generations,
    so that its full collections walk only what serving allocates (docs/runtime.md, "Objects from start")."""
    gc.freeze()


def keep_freed_memory() -> bool:
    """Under glibc, serve buffers up to 32 MiB from the heap and keep 64 MiB of it free, so that a call's megabyte
    buffers (a prompt's features, encoded and decoded) reuse pages instead of faulting in fresh ones
    (docs/runtime.md, "Freed memory"). Returns whether the allocator took the settings."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_BUFFERS)) and bool(mallopt(M_TRIM_THRESHOLD, KEPT_FREE))


def attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's dtype: the model's on CUDA, float32 on CPU (k and v stored exactly)."""
    return torch.float32 if device.type == "cpu" else dtype


def stored_dtype(model_dir: str | Path) -> str | None:
    """The dtype a Hugging Face checkpoint declares in its config.json (`dtype` or `torch_dtype`), if any."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config") or config
    return config.get("dtype") or config.get("torch_dtype")
