"""The EAGLE-3 and HASS objectives against numbers the official training code gave on the same world.

tests/helpers/ttt_world.py builds a seeded tiny target, drafters and batch; the official training
forwards (docs/training.md#checked-against-the-official-trainers) were run on that world once,
and their per-step masked loss sums and gradients are written below. eyas's rollout must give the
same numbers step by step: the same rows, masks, positions, feedback and detachment.
"""

import pytest
import torch
from tests.helpers.ttt_world import batch, make_world

from eyas.drafters import load_drafter
from eyas.manifest import FeatureAddress
from eyas.target import TargetModel
from eyas.train.data import segment_causal_mask
from eyas.train.features import teacher_features
from eyas.train.objectives import Objective, rollout_loss, teacher_rows
from eyas.train.rows import compile_rows, gather_rows

# SafeAILab/EAGLE eagle/traineagle3/cnets.py Model.forward, float32: per step, the masked soft-CE sum
# (the official mean times B * S), rows whose drafted argmax agrees, the gradient norm of that sum
# over the drafter's parameters and the sum of its fc.weight gradient.
OFFICIAL_EAGLE3 = [
    (87.56393432617188, 0, 28.196759665359906, 0.1756147435244202),
    (82.3686752319336, 1, 28.24549512167382, 15.919153420986731),
    (78.36822509765625, 0, 29.110813196623525, -5.908149516308185),
    (74.35037994384766, 0, 30.408122603127573, -20.399802395950246),
    (63.523216247558594, 0, 26.618626533597517, -3.6140179883132078),
    (58.98585891723633, 0, 28.324095940161342, -18.319486806376062),
    (60.07351303100586, 0, 32.65780208992619, 5.245540324124704),
]
# HArmonizedSS/HASS train/main_hass.py loop on model/cnets_hass.py, float32, no noise, with keys the
# alignment mask hides given -inf before the softmax (the official training attention leaves them at
# 0, docs/training.md): per step, 1.0 feature + 0.1 soft CE + 1.0 top-10 summed over rows with a root,
# the feature (SmoothL1) sum, agreeing rows, the gradient norm and the fc.weight gradient sum.
OFFICIAL_HASS = [
    (92.57101440429688, 16.121074676513672, 0, 32.034145380922126, 17.400971421112445),
    (78.59490203857422, 12.59826374053955, 1, 22.104862962877725, 17.719863942445954),
    (71.65641021728516, 11.324429512023926, 1, 18.445443806392497, -10.339758679445367),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_world(tmp_path_factory.mktemp("ttt"))


def per_step(world, kind: str, steps: int):
    """Yield (step, masked loss sum, agreeing rows, metrics, gradients) of each rollout step of the world's drafter."""
    layers = 8
    address = FeatureAddress.eagle3(layers) if kind == "eagle3" else FeatureAddress.eagle1()
    target = TargetModel.from_pretrained(world["target"], address, kv_slots=0)
    drafter, _ = load_drafter(world[kind], target.embed, target.lm_head)
    drafter.float().train().requires_grad_(True)
    tokens, supervise = batch()
    b, s = tokens.shape
    valid, segment, position = torch.ones(b, s, dtype=torch.bool), torch.zeros(b, s, dtype=torch.long), torch.arange(s).expand(b, s)
    plan = compile_rows(valid, segment, position, supervise)
    feats, hidden = teacher_features(target, tokens, position, segment_causal_mask(valid, segment))
    rows = gather_rows(plan, tokens, feats)
    teacher = teacher_rows(drafter, rows, gather_rows(plan, tokens, hidden)["target_feature"])
    recipe = "eagle3" if kind == "eagle3" else "hass"
    for step in range(steps):
        objective = Objective.preset(recipe, noise="none", step_weights=[float(i == step) for i in range(steps)])
        drafter.zero_grad()
        counts = []
        loss, metrics = rollout_loss(drafter, plan, teacher, objective, denominator=lambda m: counts.append(float(m.sum())) or 1.0)
        loss.backward()
        grads = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
        yield step, float(loss.detach()), round(metrics[f"top1/{step}"] * counts[step]), metrics, grads


def norm(grads: dict) -> float:
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))


def test_eagle3_training_time_test_matches_the_official_trainer_step_by_step(world):
    for step, loss, correct, _, grads in per_step(world, "eagle3", 7):
        want_loss, want_correct, want_norm, want_fc = OFFICIAL_EAGLE3[step]
        assert loss == pytest.approx(want_loss, rel=1e-5), step
        assert norm(grads) == pytest.approx(want_norm, rel=1e-5), step
        assert float(grads["fc.weight"].double().sum()) == pytest.approx(want_fc, rel=1e-4, abs=1e-4), step
        assert correct == want_correct, step


def test_hass_alignment_steps_match_the_official_trainer_step_by_step(world):
    for step, loss, correct, metrics, grads in per_step(world, "eagle1", 3):
        want_total, want_feature, want_correct, want_norm, want_fc = OFFICIAL_HASS[step]
        assert loss == pytest.approx(want_total, rel=1e-5), step
        assert metrics[f"feature_error/{step}"] == pytest.approx(want_feature, rel=1e-5), step
        assert norm(grads) == pytest.approx(want_norm, rel=1e-5), step
        assert float(grads["fc.weight"].double().sum()) == pytest.approx(want_fc, rel=1e-4, abs=1e-4), step
        assert correct == want_correct, step
