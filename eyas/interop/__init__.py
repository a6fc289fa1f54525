"""Interoperability with other serving stacks: export eyas drafters for vLLM and run vLLM in its own venv."""

from .vllm_env import VllmEnvError, ensure_vllm_python, run_vllm
from .vllm_export import VllmExport, export_for_vllm

__all__ = ["VllmEnvError", "VllmExport", "ensure_vllm_python", "export_for_vllm", "run_vllm"]
