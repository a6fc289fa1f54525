"""Model loading for the command line: Hugging Face's progress bars and warnings off, so output stays readable."""

from __future__ import annotations

import warnings


def quiet_loading() -> None:
    """Silence transformers' progress bars and logging below errors, and show a warning as one line without its
    source (imports transformers: call it only when loading)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.formatwarning = lambda message, category, *_, **__: f"eyas: warning: {message}\n"
