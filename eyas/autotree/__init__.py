"""Hardware-aware trees (`tree: auto`): choose width, depth and budget for the most tokens per second.

At start the tuner measures this machine's costs: target verification time by number of rows and
drafter step time by number of rows. It then drafts a few rounds with a wide exploration tree.
Because a drafter's output at a node depends only on that node's path, every smaller policy's
tree is a sub-tree of the exploration tree, and the target has verified its nodes: replaying the
smaller policy's expansion and reranking on the recorded nodes gives its expected accepted length
exactly (greedy) or in expectation (sampling), as far as the target verified those nodes. A wide
tree's budget goes to the highest-confidence nodes, so where the drafter's confidence is flat (a
high-entropy target decoded greedily) its deep paths go unverified. Exploration therefore takes three
trees in turn: the wide one (scores width 3 and up), a narrow one of width 2 whose budget verifies
every node it records (scores width 2 exactly), and a deep chain (scores chains exactly). Nodes a wide
round left unverified count at the acceptance rate verified nodes of the same drafter probability had
(`Calibration`), not at 0. Chains that stop where the path's value falls under a floor (`TreePolicy.stop`) are
replayed on the chain rounds the same way, which also gives the levels each would have drafted: their predicted
time is that of the levels they draft on those rounds, not of their full depth. Expected tokens per round over
predicted round time picks the policy.
Realised acceptance is watched; when it drifts from the prediction, or after a while, the tuner
explores again. Chosen rounds also correct the predictions: at each depth, how often their accepted paths went on
against how often the explored rounds say the same policy's would (`LevelCorrection`), and beside batch-mates,
what their rounds took beyond the forwards (`Costs.per_round_at`); every RECORRECT_ROUNDS chosen rounds the choice is
made again on them. A chosen round is itself a sample, exact and on the text being decoded, of every smaller policy
its tree holds (`Replay.exact`): those policies' scores take in what they would have committed there
(`TreeTuner.replayed`), so a choice whose smaller neighbours did better on the same rounds moves to them.

A few first rounds are one prompt's opening, a poor sample of the acceptance to come: after them, one round
in `explore_every` explores again (the three trees in turn), each policy's score is kept over the last rounds
explored, and every concurrency chooses again on them. n requests stepping together explore once in
`explore_every` x n rounds of theirs, since an exploring round holds up every batch-mate. For the same reason
an exploration's rounds are counted as they are handed out, not as they finish: requests stepping together
ask for their next tree before the others' rounds are in, and would otherwise all explore at once.

The costs measured at start are warm and alone; inside rounds the same forwards cost more (the other
model's weights have left the cache, batch-mates' rows share the forward), and a start-up measurement
taken under a passing load can be off at some row counts only. Every batched forward the engine runs
is fed back (`Costs.observe`): each measured point of a model's curve is scaled by the median ratio of
what recent forwards of about its rows took to what the curve predicted, once it has enough of them,
and otherwise by that median over all the model's recent forwards.
"""

from .costs import Costs
from .grid import EXPLORATIONS, EXPLORE
from .measure import measure_costs, measure_draft, measure_verify
from .replay import Replay, expected_accepted
from .tuner import TreeTuner

__all__ = ["EXPLORATIONS", "EXPLORE", "Costs", "Replay", "TreeTuner", "expected_accepted", "measure_costs", "measure_draft", "measure_verify"]
