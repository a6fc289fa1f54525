"""Content digests of checkpoint parts that need no tensors (the tokenizer), shared by manifests and trace tools."""

from __future__ import annotations

import hashlib
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def tokenizer_digest(directory: str | Path) -> str:
    """Digest of the tokenizer files present, or "none" for a target without a tokenizer."""
    digest = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        path = Path(directory, name)
        if path.exists():
            found = True
            digest.update(name.encode() + b"|" + path.read_bytes())
    return digest.hexdigest() if found else "none"
