"""Timing this machine's forwards by rows: the measured points of `Costs`."""

from __future__ import annotations

import time

import torch

from ..proposer import DraftModel
from ..runtime.batch import RowsCall
from ..target import TargetModel
from .costs import DRAFT_ROWS, VERIFY_ROWS, Costs


def _best_of(run, repeats: int) -> float:
    """The fastest of `repeats` runs, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


@torch.no_grad()
def measure_verify(target: TargetModel, prefix_len: int = 192, repeats: int = 3) -> tuple[list[int], list[float]]:
    """Seconds of a target verification of each of VERIFY_ROWS rows on top of a `prefix_len` prefix (one borrowed
    slot): the target's half of `Costs`, which a target worker measures on its own device."""
    prefix_len = max(1, min(prefix_len, target.pool.slot_len - VERIFY_ROWS[-1]))
    longest = max(prefix_len, VERIFY_ROWS[-1])
    tokens = torch.randint(0, target.vocab_size, (longest,), generator=torch.Generator().manual_seed(0))
    causal = torch.ones(longest, longest, dtype=torch.bool).tril()
    slot = target.pool.acquire(prefix_len + VERIFY_ROWS[-1], wait=True)
    try:
        prefix = tokens[:prefix_len]
        target.run([target.call(slot, 0, prefix, torch.arange(prefix_len), causal[:prefix_len, :prefix_len], with_logits=False)])
        seconds = []
        for rows in VERIFY_ROWS:
            call = target.call(slot, prefix_len, tokens[:rows], torch.arange(prefix_len, prefix_len + rows), causal[:rows, :rows])
            seconds.append(_best_of(lambda: target.run([call]), repeats))
    finally:
        target.pool.release(slot)
    return list(VERIFY_ROWS), seconds


@torch.no_grad()
def measure_draft(draft: DraftModel, prefix_len: int = 192, repeats: int = 3) -> tuple[list[int], list[float]]:
    """Seconds of a drafter step of each of DRAFT_ROWS rows (with their top-8 candidates) on top of a `prefix_len`
    prefix: the drafter's half of `Costs`, which a draft worker measures on its own device."""
    prefix_len = max(1, min(prefix_len, draft.pool.slot_len - DRAFT_ROWS[-1]))
    longest = max(prefix_len, DRAFT_ROWS[-1])
    tokens = torch.randint(0, draft.drafter.embed.num_embeddings, (longest,), generator=torch.Generator().manual_seed(0))
    state = torch.zeros(longest, draft.drafter.hidden_size, dtype=draft.drafter.dtype)
    slot = draft.pool.acquire(prefix_len + DRAFT_ROWS[-1], wait=True)
    try:
        causal = torch.ones(prefix_len, prefix_len, dtype=torch.bool).tril()
        draft.run([RowsCall(slot, 0, tokens[:prefix_len], torch.arange(prefix_len), causal, state[:prefix_len])])
        seconds = []
        for rows in DRAFT_ROWS:
            visible = torch.ones(rows, prefix_len + rows, dtype=torch.bool)
            call = RowsCall(slot, prefix_len, tokens[:rows], torch.arange(prefix_len, prefix_len + rows), visible, state[:rows], 8)
            seconds.append(_best_of(lambda: draft.run([call]), repeats))
    finally:
        draft.pool.release(slot)
    return list(DRAFT_ROWS), seconds


def measure_costs(target: TargetModel, draft: DraftModel, prefix_len: int = 192, repeats: int = 3) -> Costs:
    """Time target verifications and drafter steps of each size on top of a `prefix_len` prefix (one borrowed slot each)."""
    return Costs(*measure_verify(target, prefix_len, repeats), *measure_draft(draft, prefix_len, repeats))
