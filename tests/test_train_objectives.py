"""Objective contracts (docs/training.md): loss values, unnormalised Top-K, noise, ownership and dtype."""

import pytest
import torch
import torch.nn.functional as F

from eyas.train.losses import masked_smooth_l1, masked_soft_ce, masked_topk_ce
from eyas.train.objectives import Objective, feature_noise


def test_masked_losses_average_over_supervised_rows_only():
    predicted = torch.tensor([[[0.0, 0.0], [3.0, 0.0], [100.0, 100.0]]])
    target = torch.tensor([[[0.5, 0.5], [0.0, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[True, True, False]])
    # row 0: smoothL1(0.5) = 0.125 on both dims; row 1: (2.5 + 0) / 2 = 1.25
    assert masked_smooth_l1(predicted, target, mask).item() == pytest.approx((0.125 + 1.25) / 2)
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [1.0, 1.0, 1.0]]]))
    q = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    expected = (-torch.log(torch.tensor(0.5)) - torch.log(torch.tensor(0.8))) / 2
    assert masked_soft_ce(logits, q, mask).item() == pytest.approx(expected.item(), rel=1e-6)


def test_empty_supervision_is_refused_rather_than_divided_by_zero():
    with pytest.raises(ValueError, match="skip the optimizer step"):
        masked_soft_ce(torch.zeros(1, 2, 3), torch.ones(1, 2, 3) / 3, torch.zeros(1, 2, dtype=torch.bool))


def test_topk_loss_does_not_renormalise_the_target_mass():
    q = torch.tensor([[[0.4, 0.3, 0.2, 0.1]]])
    logits = torch.log(torch.tensor([[[0.25, 0.25, 0.25, 0.25]]]))
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss = masked_topk_ce(logits, q, mask, k=2).item()
    assert loss == pytest.approx(-(0.4 + 0.3) * torch.log(torch.tensor(0.25)).item())  # Z_K = 0.7 scales it
    renormalised = -(1.0) * torch.log(torch.tensor(0.25)).item()
    assert loss != pytest.approx(renormalised)


def test_losses_reduce_in_float32_from_low_precision_inputs():
    logits = torch.randn(2, 3, 50, dtype=torch.bfloat16)
    q = torch.softmax(torch.randn(2, 3, 50), -1).to(torch.bfloat16)
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss = masked_soft_ce(logits, q, mask)
    assert loss.dtype == torch.float32
    exact = -(q.float() * F.log_softmax(logits.float(), -1)).sum(-1).mean()
    assert loss.item() == pytest.approx(exact.item(), rel=1e-6)


def test_noise_variants():
    generator = torch.Generator().manual_seed(0)
    paper = feature_noise(torch.Size([20000]), Objective(noise="paper"), 128, generator)
    assert paper.abs().max() <= 0.1 and paper.abs().max() > 0.099
    pinned = feature_noise(torch.Size([20000]), Objective(noise="pinned"), 128, generator)
    assert pinned.abs().max() <= 0.4 and pinned.abs().max() > 0.39  # 0.1 * 512 / 128
    assert torch.equal(feature_noise(torch.Size([5]), Objective(noise="none"), 128, generator), torch.zeros(5))


def test_presets_are_the_published_defaults():
    e1, hass, e3 = Objective.preset("eagle1"), Objective.preset("hass"), Objective.preset("eagle3")
    assert (e1.feature_weight, e1.token_weight, e1.steps, e1.topk_weight) == (1.0, 0.1, 1, 0.0)
    assert (hass.steps, hass.topk, hass.topk_weight, hass.detach_state) == (3, 10, 1.0, True)
    assert e3.steps == 7 and e3.feature_weight == 0.0 and e3.step_weights == pytest.approx([0.8**s for s in range(7)])
    with pytest.raises(ValueError, match="noise"):
        Objective(noise="gaussian")
