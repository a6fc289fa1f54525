"""The training row compiler (docs/rows.md): plan boundary-valid rows before any gather.

Row t pairs the teacher feature f_t with the advanced token x_{t+1}; its soft targets are
f_{t+1} and q_{t+2} = softmax(W_U f_{t+1}); a hard-label row also needs x_{t+2}. A row exists
only when t and t+1 are valid and in one segment; it is supervised when, besides, the source
row is flagged. Unsupervised rows stay as causal context. Invalid addresses are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowPlan:
    """Legal rows laid out per batch item: [B, L] with L the most rows any item has.

    source: storage index t of each row; valid: the row exists; soft/hard: loss masks;
    segment/position: the source row's original identities; mask: [B, 1, L, L] causal,
    segment-isolated attention among the rows.
    """

    source: torch.Tensor
    valid: torch.Tensor
    soft: torch.Tensor
    hard: torch.Tensor
    segment: torch.Tensor
    position: torch.Tensor
    mask: torch.Tensor

    @property
    def num_soft(self) -> int:
        return int(self.soft.sum())

    @property
    def num_hard(self) -> int:
        return int(self.hard.sum())


def compile_rows(
    valid: torch.Tensor,
    segment: torch.Tensor,
    position: torch.Tensor,
    supervise: torch.Tensor,
) -> RowPlan:
    """Plan rows from [B, S] validity, segment ids, position ids and source-row supervision flags."""
    valid = valid.bool()
    b, s = valid.shape
    pair = torch.zeros(b, s, dtype=torch.bool)  # b_t = [seg(t) = seg(t+1)] v_t v_{t+1}
    pair[:, :-1] = valid[:, :-1] & valid[:, 1:] & (segment[:, :-1] == segment[:, 1:])
    soft = pair & supervise.bool()
    hard = torch.zeros_like(soft)  # m_t^hard = m_t^soft v_{t+2} [seg(t+1) = seg(t+2)]
    hard[:, :-2] = soft[:, :-2] & valid[:, 2:] & (segment[:, 1:-1] == segment[:, 2:])

    counts = pair.sum(dim=1)
    width = max(int(counts.max()) if b else 0, 1)
    order = torch.sort((~pair).to(torch.int8), dim=1, stable=True).indices[:, :width]  # legal t first, in order
    rows_valid = torch.arange(width)[None, :] < counts[:, None]
    source = torch.where(rows_valid, order, 0)

    def take(x: torch.Tensor) -> torch.Tensor:
        return torch.where(rows_valid, x.gather(1, source), torch.zeros((), dtype=x.dtype))

    row_segment, row_position = take(segment), take(position)
    same = (row_segment[:, :, None] == row_segment[:, None, :]) & rows_valid[:, :, None] & rows_valid[:, None, :]
    causal = row_position[:, None, :] <= row_position[:, :, None]
    eye = torch.eye(width, dtype=torch.bool)[None]
    mask = (same & causal) | eye  # padding rows see only themselves, never NaN
    return RowPlan(
        source=source,
        valid=rows_valid,
        soft=take(soft.to(torch.int8)).bool(),
        hard=take(hard.to(torch.int8)).bool(),
        segment=row_segment,
        position=row_position,
        mask=mask[:, None],
    )


def gather_rows(plan: RowPlan, tokens: torch.Tensor, features: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gather f_t, x_{t+1}, f_{t+1} (and x_{t+2} for hard rows) at planned addresses only.

    tokens: [B, S]; features: [B, S, F] -> source_feature [B, L, F], advanced_token [B, L],
    target_feature [B, L, F], hard_label [B, L] (-100 where the row has no hard label).
    """
    nxt = torch.where(plan.valid, plan.source + 1, 0)
    after = torch.where(plan.hard, plan.source + 2, 0)
    f = features.shape[-1]
    return {
        "source_feature": features.gather(1, plan.source[..., None].expand(-1, -1, f)),
        "advanced_token": torch.where(plan.valid, tokens.gather(1, nxt), 0),
        "target_feature": features.gather(1, nxt[..., None].expand(-1, -1, f)),
        "hard_label": torch.where(plan.hard, tokens.gather(1, after), -100),
    }
