"""Training data: documents from JSONL, text files or the standard library, tokenized and packed.

JSONL lines hold {"text": ...} (every token supervised) or {"conversations": [...]} (the target
tokenizer's chat template, supervision on assistant turns only). Documents are packed into
fixed-length sequences of segments; each segment restarts its positions, and padding is invalid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .corpus import collect

TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst"}


class DataError(ValueError):
    """Training data cannot be used; the message names the file (and line)."""


@dataclass
class Document:
    tokens: list[int]
    supervise: list[bool]
    source: str


@dataclass
class Packed:
    """[N, S] packed sequences: tokens, validity, segment ids, position ids and source-row supervision."""

    tokens: torch.Tensor
    valid: torch.Tensor
    segment: torch.Tensor
    position: torch.Tensor
    supervise: torch.Tensor

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def select(self, index: torch.Tensor) -> "Packed":
        return Packed(*(getattr(self, f)[index] for f in ("tokens", "valid", "segment", "position", "supervise")))

    @property
    def supervised_tokens(self) -> int:
        return int((self.supervise & self.valid).sum())


def _role(message: dict) -> str:
    role = message.get("role", message.get("from"))
    return {"human": "user", "gpt": "assistant"}.get(role, role)


def encode_conversation(tokenizer, messages: list[dict], source: str) -> Document:
    """Apply the chat template and supervise the tokens each assistant turn adds to the rendering."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{source}: conversations need the target tokenizer's chat template, and it has none")
    turns = [{"role": _role(m), "content": m.get("content", m.get("value", ""))} for m in messages]
    tokens: list[int] = []
    supervise: list[bool] = []
    for i, turn in enumerate(turns):
        text = tokenizer.apply_chat_template(turns[: i + 1], tokenize=False, add_generation_prompt=False)
        rendered = tokenizer.encode(text, add_special_tokens=False)
        if rendered[: len(tokens)] != tokens:
            raise DataError(f"{source}: the chat template does not render turns as a growing prefix")
        added = rendered[len(tokens) :]
        tokens += added
        supervise += [turn["role"] == "assistant"] * len(added)
    return Document(tokens, supervise, source)


def encode_text(tokenizer, text: str, source: str) -> Document:
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return Document(tokens, [True] * len(tokens), source)


def read_documents(sources: list[str], tokenizer) -> list[Document]:
    """Tokenize every source: a JSONL file, a text file, a directory of text files, or stdlib:train / stdlib:heldout."""
    docs: list[Document] = []
    for source in sources:
        if source in ("stdlib:train", "stdlib:heldout"):
            corpus = collect()
            split = corpus.train if source == "stdlib:train" else corpus.heldout
            docs += [encode_text(tokenizer, d.text, f"stdlib/{d.path}") for d in split]
            continue
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES | {".jsonl"})
        elif path.exists():
            files = [path]
        else:
            raise DataError(f"{source}: no such file or directory")
        for file in files:
            docs += _read_jsonl(file, tokenizer) if file.suffix == ".jsonl" else [_read_text(file, tokenizer)]
    return docs


def _read_text(file: Path, tokenizer) -> Document:
    try:
        return encode_text(tokenizer, file.read_text(encoding="utf-8"), str(file))
    except UnicodeDecodeError as exc:
        raise DataError(f"{file}: not valid UTF-8 ({exc})") from None


def _read_jsonl(file: Path, tokenizer) -> list[Document]:
    docs = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not JSON ({exc.msg})") from None
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            docs.append(encode_text(tokenizer, record["text"], where))
        elif isinstance(record, dict) and isinstance(record.get("conversations"), list):
            docs.append(encode_conversation(tokenizer, record["conversations"], where))
        else:
            raise DataError(f'{where}: expected {{"text": ...}} or {{"conversations": [...]}}')
    return docs


def pack(docs: list[Document], seq_len: int, eos_id: int | None) -> Packed:
    """Pack documents (each followed by EOS when known) into [N, seq_len] sequences of segments."""
    if seq_len < 3:
        raise DataError(f"seq_len must be at least 3, got {seq_len}")
    stream_tokens: list[int] = []
    stream_super: list[bool] = []
    stream_doc: list[int] = []
    for index, doc in enumerate(docs):
        tail = [eos_id] if eos_id is not None else []
        stream_tokens += doc.tokens + tail
        stream_super += doc.supervise + [False] * len(tail)  # an EOS row never has a successor in its segment
        stream_doc += [index] * (len(doc.tokens) + len(tail))
    n = -(-len(stream_tokens) // seq_len)
    size = n * seq_len
    pad = size - len(stream_tokens)
    tokens = torch.tensor(stream_tokens + [0] * pad, dtype=torch.long).view(n, seq_len)
    valid = torch.tensor([True] * len(stream_tokens) + [False] * pad).view(n, seq_len)
    supervise = torch.tensor(stream_super + [False] * pad).view(n, seq_len)
    doc = torch.tensor(stream_doc + [-1] * pad).view(n, seq_len)
    # a segment is a run of one document inside one sequence; positions restart at its first token
    starts = torch.ones_like(valid)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    segment = torch.cumsum(starts.long(), dim=1) - 1
    index = torch.arange(seq_len).expand(n, seq_len)
    first = torch.cummax(torch.where(starts, index, 0), dim=1).values
    return Packed(tokens, valid, segment, index - first, supervise)


def segment_causal_mask(valid: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: a token sees earlier valid tokens of its own segment (padding sees only itself)."""
    s = valid.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    same = (segment[:, :, None] == segment[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    return ((same & causal) | torch.eye(s, dtype=torch.bool))[:, None]
