"""Bundled demo models: a small Llama target and draft LM trained on the Python standard library's source."""
