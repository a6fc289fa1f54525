"""Target-generated training data (docs/training.md#target-generated-data): the frozen target continues each window.

A window (evenly spread over the data when `windows` caps their number) keeps the first
`prompt_tokens` tokens of its first segment as an unsupervised prompt; the target continues it to
the window's length with batched plain decoding, greedy or sampled (window i at
temperatures[i % len(temperatures)], seed i), and the continuation is supervised. The result is
cached under a digest of the target's fingerprint, the source windows and the settings, batch by batch as they
end, so that an interrupted regeneration resumes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..drafters import build_drafter, drafter_config
from ..engine import Engine
from ..manifest import DRAFTER_ABI, FeatureAddress, Manifest
from ..target import TargetModel
from .data import Packed
from .features import tokens_digest
from .recipe import Regeneration

DATA_FILE = "windows.safetensors"
META_FILE = "regenerated.json"
FIELDS = ("tokens", "valid", "segment", "position", "supervise")


def prompts(data: Packed, prompt_tokens: int) -> list[list[int]]:
    """The first `prompt_tokens` valid tokens of each window's first segment."""
    first = data.valid & (data.segment == 0)
    return [row[keep][:prompt_tokens].tolist() for row, keep in zip(data.tokens, first)]


def spread(data: Packed, windows: int | None) -> Packed:
    """At most `windows` windows of `data`, evenly spread over it in order."""
    if windows is None or windows >= len(data):
        return data
    return data.select(torch.linspace(0, len(data) - 1, windows).round().long())


def cache_key(target: TargetModel, data: Packed, settings: Regeneration) -> dict:
    settings = {k: v for k, v in asdict(settings).items() if k != "batch"}
    return {"fingerprint": asdict(target.fingerprint), "windows": tokens_digest(data), "sequences": len(data),
            "seq_len": int(data.tokens.shape[1]), "settings": settings}


def plain_engine(target_dir: str | Path, slots: int, seq_len: int) -> Engine:
    """An engine that only decodes plainly: the target with a KV pool, and an untrained drafter it never runs."""
    address = FeatureAddress.eagle1()
    target = TargetModel.from_pretrained(target_dir, address, kv_slots=slots, max_seq_len=seq_len)
    unused = build_drafter("eagle1", drafter_config("eagle1", target.config)).bind_target(target.embed, target.lm_head)
    return Engine(target, unused, Manifest(target.fingerprint, address, DRAFTER_ABI["eagle1"]), tree=None)


def generate_windows(target_dir: str | Path, data: Packed, settings: Regeneration, progress: bool = True,
                     parts: Path | None = None) -> Packed:
    """[N, S] windows: each prompt (unsupervised) and the target's continuation to S tokens (supervised). With
    `parts`, each batch's rows are kept there as it ends, and a rerun generates only the batches not kept."""
    data = spread(data, settings.windows)
    n, seq_len = data.tokens.shape
    heads = prompts(data, settings.prompt_tokens)
    temps = settings.temperatures
    groups = [[i for i in range(n) if i % len(temps) == k] for k in range(len(temps))]  # one temperature per batch
    step = settings.batch
    batches = [(temps[k], g[i : i + step]) for k, g in enumerate(groups) for i in range(0, len(g), step)]
    rows: dict[int, list[int]] = {}
    engine = None
    for b, (temperature, chunk) in enumerate(tqdm(batches, desc="regenerating windows", unit="batch", disable=not progress)):
        part = parts / f"batch-{b:05d}.json" if parts is not None else None
        kept = {int(i): row for i, row in json.loads(part.read_text()).items()} if part is not None and part.exists() else {}
        if sorted(kept) == chunk:  # kept by a run with the same batch size
            rows.update(kept)
            continue
        engine = engine or plain_engine(target_dir, settings.batch, seq_len)
        lengths = [seq_len - len(heads[i]) for i in chunk]
        made = engine.generate_batch([heads[i] for i in chunk], lengths, temperature=float(temperature), seed=list(chunk),
                                     stop_at_eos=True, speculate=False)
        done = {i: heads[i] + list(gen.token_ids) for i, gen in zip(chunk, made)}
        if part is not None:  # written whole or not at all
            part.with_suffix(".tmp").write_text(json.dumps(done))
            part.with_suffix(".tmp").replace(part)
        rows.update(done)
    tokens = torch.zeros(n, seq_len, dtype=torch.long)
    valid = torch.zeros(n, seq_len, dtype=torch.bool)
    supervise = torch.zeros(n, seq_len, dtype=torch.bool)
    for i, row in rows.items():
        tokens[i, : len(row)] = torch.tensor(row)
        valid[i, : len(row)] = True
        supervise[i, len(heads[i]) : len(row)] = True
    position = torch.arange(seq_len).expand(n, seq_len).clone()
    return Packed(tokens, valid, torch.zeros(n, seq_len, dtype=torch.long), position, supervise)


def regenerated(target_dir: str | Path, target: TargetModel, data: Packed, settings: Regeneration, cache_root: str | Path,
                progress: bool = True) -> Packed:
    """The regenerated windows of `data`, read from cache_root/<key digest> or generated and written there."""
    key = cache_key(target, data, settings)
    path = Path(cache_root) / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    if (path / META_FILE).exists() and json.loads((path / META_FILE).read_text()) == key:
        tensors = load_file(str(path / DATA_FILE))
        return Packed(*(tensors[f] for f in FIELDS))
    (path / "parts").mkdir(parents=True, exist_ok=True)
    windows = generate_windows(target_dir, data, settings, progress, parts=path / "parts")
    save_file({f: getattr(windows, f).contiguous() for f in FIELDS}, str(path / DATA_FILE))
    (path / META_FILE).write_text(json.dumps(key, indent=2, sort_keys=True))  # written last: a cache is complete
    shutil.rmtree(path / "parts")
    return windows
