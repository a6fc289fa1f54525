"""Row compiler contract (docs/rows.md): boundary-valid rows before any gather, padding, packing, supervision."""

import torch

from eyas.train.data import Document, pack, segment_causal_mask
from eyas.train.rows import compile_rows, gather_rows


def plan_of(valid, segment, supervise):
    valid, segment, supervise = (torch.tensor([x]) for x in (valid, segment, supervise))
    position = torch.zeros_like(segment)
    for i in range(1, segment.shape[1]):
        position[0, i] = 0 if segment[0, i] != segment[0, i - 1] else position[0, i - 1] + 1
    return compile_rows(valid, segment, position, supervise)


def test_packed_segments_never_pair_across_a_boundary():
    # segments [a a a | b b | c c c], all valid and supervised
    plan = plan_of([1] * 8, [0, 0, 0, 1, 1, 2, 2, 2], [1] * 8)
    legal = plan.source[0][plan.valid[0]].tolist()
    assert legal == [0, 1, 3, 5, 6]  # t=2 and t=4 would pair with the next segment
    assert plan.hard[0][plan.valid[0]].tolist() == [True, False, False, True, False]
    assert plan.num_soft == 5 and plan.num_hard == 2


def test_attention_over_packed_rows_is_causal_and_segment_isolated():
    plan = plan_of([1] * 8, [0, 0, 0, 1, 1, 2, 2, 2], [1] * 8)
    mask = plan.mask[0, 0][:5, :5].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    assert plan.segment[0, :5].tolist() == [0, 0, 1, 2, 2]
    assert plan.position[0, :5].tolist() == [0, 1, 0, 0, 1]


def test_unsupervised_rows_stay_as_context_without_loss():
    plan = plan_of([1] * 6, [0] * 6, [0, 0, 1, 1, 0, 0])
    assert plan.valid[0].sum() == 5
    assert plan.soft[0].tolist() == [False, False, True, True, False]
    assert plan.mask[0, 0, 3, :4].all()  # a supervised row attends to the unsupervised rows before it


def test_padding_is_never_read():
    tokens = torch.tensor([[11, 12, 13, 0, 0]])
    plan = compile_rows(torch.tensor([[1, 1, 1, 0, 0]]), torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None], torch.ones(1, 5))
    poisoned = torch.tensor([[[0.0], [1.0], [2.0], [float("nan")], [float("nan")]]])
    rows = gather_rows(plan, tokens, poisoned)
    real = plan.valid
    assert not torch.isnan(rows["source_feature"][real]).any()
    assert not torch.isnan(rows["target_feature"][real]).any()
    assert rows["advanced_token"][real].tolist() == [12, 13]


def test_zero_eligible_rows():
    plan = compile_rows(torch.tensor([[1, 0, 1, 0]]), torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], torch.ones(1, 4))
    assert plan.num_soft == 0 and plan.valid.sum() == 0
    plan = plan_of([1] * 4, [0] * 4, [0] * 4)
    assert plan.num_soft == 0 and plan.valid.sum() == 3  # context rows exist, none supervised


def test_batched_plans_keep_batch_identity():
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    plan = compile_rows(valid, torch.zeros(2, 4, dtype=torch.long), torch.arange(4).expand(2, 4), torch.ones(2, 4))
    assert plan.valid.sum(1).tolist() == [3, 1]
    assert plan.source[1, 0].item() == 0 and not plan.valid[1, 1:].any()


def test_packing_restarts_positions_per_document_and_pads():
    docs = [Document([5, 6, 7], [True] * 3, "a"), Document([8, 9], [False, True], "b")]
    packed = pack(docs, seq_len=4, eos_id=1)
    assert packed.tokens.tolist() == [[5, 6, 7, 1], [8, 9, 1, 0]]
    assert packed.segment.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1]]
    assert packed.position.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]
    assert packed.valid.tolist() == [[True] * 4, [True, True, True, False]]
    assert packed.supervise.tolist() == [[True, True, True, False], [False, True, False, False]]
    mask = segment_causal_mask(packed.valid, packed.segment)
    assert mask[1, 0, 3].tolist() == [False, False, False, True]
