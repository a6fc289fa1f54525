"""Interoperability with other serving stacks: export eyas drafters for vLLM and run vLLM in its own venv."""

from .vllm_export import VllmExport, export_for_vllm

__all__ = ["VllmExport", "export_for_vllm"]
