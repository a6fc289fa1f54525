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

from __future__ import annotations

import functools
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from .outcomes import Calibration, children_of
from .proposer import DraftModel
from .rounds import RoundRecord
from .runtime.batch import RowsCall
from .target import TargetModel
from .tree import DraftTree, TreePolicy


def reachable(width: int, depth: int) -> int:
    """Nodes a (width, depth) expansion records: `width` children of the root, then `width` children of each of the
    `width` nodes it expands at every further depth."""
    return width + (depth - 1) * width * width


EXPLORE = TreePolicy(width=8, depth=8, budget=64)
EXPLORE_CHAIN = TreePolicy(width=1, depth=EXPLORE.depth, budget=EXPLORE.depth)
EXPLORE_NARROW = TreePolicy(width=2, depth=EXPLORE.depth, budget=reachable(2, EXPLORE.depth))  # verifies all it records
EXPLORATIONS = (EXPLORE, EXPLORE_NARROW, EXPLORE_CHAIN)  # in the order exploring rounds take them
LOCKSTEP_ROUNDS = 8  # rounds at a concurrency before its lockstep cost per level counts (and the choice is redone)
TOP_KS = (1, 2, 3, 4, 6, 8)
STOPS = (0.05, 0.1, 0.2, 0.3)  # floors of the chains scored beside fixed depths (TreePolicy.stop, docs/tree.md#stopping)
BUDGETS = (2, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)
VERIFY_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 65, 128, 256)  # past 65: several requests' trees in one forward
DRAFT_ROWS = (1, 2, 4, 8, 16, 32, 64)
OBSERVED_FORWARDS = 64  # recent forwards per model whose time over the measured curve scales it
MIN_OBSERVED = 8  # forwards of a model before its scale moves from 1
LEVEL_PRIOR = 8.0  # pseudo-trials at the predicted rate that hold each level's correction near 1 (LevelCorrection)
RECORRECT_ROUNDS = 32  # chosen rounds between two updates of the level corrections and the choices made on them
REPLAYED_ROUNDS = 256  # latest chosen rounds that scored a policy exactly, kept for it (TreeTuner.replayed)
PREDICTION_ROUNDS = 8.0  # rounds the explored prediction counts as beside a policy's replayed rounds (TreeTuner.score)


@functools.cache
def grid() -> tuple[TreePolicy, ...]:
    """Candidate policies: chains of every depth, chains as deep as the exploring chain that stop at each of STOPS,
    and trees of every width, depth and budget that fits (built once: a choice scores them all)."""
    policies = [TreePolicy(1, d, d) for d in range(1, EXPLORE.depth + 1)]
    policies += [TreePolicy(1, EXPLORE.depth, EXPLORE.depth, stop) for stop in STOPS]
    for k in TOP_KS[1:]:
        for d in range(1, EXPLORE.depth + 1):
            policies += [TreePolicy(k, d, b) for b in BUDGETS if d <= b <= reachable(k, d)]
    return tuple(policies)


@functools.cache
def grid_index() -> dict[TreePolicy, int]:
    """Each grid policy's place in `grid()`."""
    return {policy: i for i, policy in enumerate(grid())}


@functools.cache
def under(policy: TreePolicy) -> tuple[TreePolicy, ...]:
    """Grid policies a round of `policy` may score exactly: no wider, deeper or larger, and stopping no later
    (`Replay.exact` says which of them a round does). Under a floor, only policies with a floor as high or higher:
    the floor stops where the drafter is unsure, so the rounds that went as deep as a policy without it would go are
    the easier ones."""
    return tuple(
        q for q in grid()
        if q.width <= policy.width and q.depth <= policy.depth and q.budget <= policy.budget and q.stop >= policy.stop
    )


def fit_line(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of y over x, both nonnegative: least squares through the median y of each x, so that the
    odd slow round (a warm-up, a batch-mate's prefill) does not move it; a flat line where x does not vary."""
    by_x: dict[float, list[float]] = {}
    for x, y in samples:
        by_x.setdefault(x, []).append(y)
    points = [(x, statistics.median(ys)) for x, ys in by_x.items()]
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread) if spread else 0.0
    intercept = mean_y - slope * mean_x
    if intercept < 0.0:  # through the origin instead
        intercept, slope = 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return intercept, slope


def _interpolate(xs: list[int], ys: list[float], x: float | np.ndarray) -> float | np.ndarray:
    """Piecewise-linear through measured points, flat before the first one and extended linearly past the last one;
    at a number, or at every element of an array (a choice prices the whole grid at once)."""
    past = ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (x - xs[-1])
    if isinstance(x, np.ndarray):
        return np.where(x > xs[-1], past, np.interp(x, xs, ys))
    return past if x > xs[-1] else float(np.interp(x, xs, ys))  # a Python float: forwards are fed back one by one


def _positive(x: float | np.ndarray) -> float | np.ndarray:
    """max(0, x), elementwise on an array (a number stays a Python float: a round's own price is asked every round)."""
    return np.maximum(0.0, x) if isinstance(x, np.ndarray) else max(0.0, x)


class GridArrays(NamedTuple):
    """The grid's policies as arrays, element i being grid()[i]: what `Costs` reads of a policy (width, depth) and
    the rows a round verifies when it verifies its whole budget (`full_shape`: its levels are the depth)."""

    width: np.ndarray
    depth: np.ndarray
    rows: np.ndarray


@functools.cache
def grid_arrays() -> GridArrays:
    """`grid()` as arrays (built once)."""
    policies = grid()
    return GridArrays(
        np.array([float(p.width) for p in policies]),
        np.array([float(p.depth) for p in policies]),
        np.array([p.budget + 1.0 for p in policies]),
    )


Shape = tuple[float, float]  # a round's drafting levels and verified rows (the root's included)


def full_shape(policy: TreePolicy) -> Shape:
    """The levels and rows of a round that drafts every level of `policy` and verifies its whole budget."""
    return float(policy.depth), float(policy.budget + 1)


def realised_shape(record: RoundRecord) -> Shape:
    """The levels a finished round drafted (its deepest recorded node, or verified row where the records stayed with
    the drafter) and the rows it verified."""
    tree = record.draft_tree
    levels = max(tree.depths) if tree is not None else int(record.tree.depths.max()) if record.tree.num_rows else 0
    return float(levels), float(record.tree.num_rows)


def priced_shape(record: RoundRecord, policy: TreePolicy) -> Shape:
    """The shape a finished round of `policy` is priced at: what it drafted and verified where the policy stops at a
    floor (its levels vary by round), else the policy's full shape."""
    return realised_shape(record) if policy.stop else full_shape(policy)


@dataclass
class Costs:
    """Seconds per target verification by rows, per drafter step by rows, and outside the models: tree bookkeeping
    per depth, and the rest of a round per round and per verified row (deciding a tree costs by its rows)."""

    verify_rows: list[int]
    verify_seconds: list[float]
    draft_rows: list[int]
    draft_seconds: list[float]
    overhead_per_depth: float = 0.0
    overhead_per_round: float = 0.0
    overhead_per_row: float = 0.0
    lockstep_per_level: dict[int, float] = field(default_factory=dict)  # concurrency -> extra seconds per drafting level
    round_at_concurrency: dict[int, float] = field(default_factory=dict)  # concurrency > 1 -> a round's own bookkeeping there
    observed: dict[str, deque] = field(default_factory=dict)  # "verify" / "draft" -> recent observed / measured ratios
    observed_at: dict[tuple[str, int], deque] = field(default_factory=dict)  # (kind, measured point) -> ratios nearest it
    point_scales: dict[tuple[str, int], float] = field(default_factory=dict)  # (kind, point) -> median of its own ratios
    scales: dict[str, float] = field(default_factory=dict)  # "verify" / "draft" -> median of all its ratios
    scaled: dict[str, list[float]] = field(default_factory=dict)  # "verify" / "draft" -> its curve, each point scaled
    # (kind, rows) -> seconds, until the next observed forward: a choice prices a few dozen row counts, many times each
    _at: dict[tuple[str, float], float] = field(default_factory=dict, repr=False, compare=False)

    def verify_at(self, rows: float) -> float:
        """Seconds of one target forward over `rows` rows, as measured, scaled by what forwards took in rounds."""
        return self._curve_at("verify", rows)

    def draft_at(self, rows: float) -> float:
        """Seconds of one drafter forward over `rows` rows, likewise."""
        return self._curve_at("draft", rows)

    def _curve_at(self, kind: str, rows: float | np.ndarray) -> float | np.ndarray:
        """`kind`'s scaled curve ("verify" or "draft") at `rows`: at a row count computed once between observed
        forwards, at an array of them (a choice's whole grid) at once."""
        key = None if isinstance(rows, np.ndarray) else (kind, rows)
        if key not in self._at:
            xs, ys = (self.verify_rows, self.verify_seconds) if kind == "verify" else (self.draft_rows, self.draft_seconds)
            value = _interpolate(xs, self.scaled.get(kind, ys), rows)
            if key is None:
                return value
            self._at[key] = value
        return self._at[key]

    def observe(self, kind: str, rows: int, seconds: float) -> None:
        """Fold in one forward a round ran: `kind` "verify" (the target) or "draft", over `rows` rows in `seconds`.
        Its ratio to the measured curve counts for the whole curve and for the measured point nearest its rows: a
        point with MIN_OBSERVED ratios of its own is scaled by their median, every other point by the median of all
        (after MIN_OBSERVED forwards). Forwards past the measured rows (a prefill) are left out."""
        xs, ys = (self.verify_rows, self.verify_seconds) if kind == "verify" else (self.draft_rows, self.draft_seconds)
        if not 0 < rows <= xs[-1]:
            return
        self._at.clear()
        ratio = seconds / _interpolate(xs, ys, rows)
        ratios = self.observed.setdefault(kind, deque(maxlen=OBSERVED_FORWARDS))
        ratios.append(ratio)
        nearest = min(range(len(xs)), key=lambda i: abs(math.log(xs[i] / rows)))
        own = self.observed_at.setdefault((kind, nearest), deque(maxlen=OBSERVED_FORWARDS))
        own.append(ratio)
        if len(own) >= MIN_OBSERVED:
            self.point_scales[kind, nearest] = statistics.median(own)
        if len(ratios) >= MIN_OBSERVED:
            overall = self.scales[kind] = statistics.median(ratios)
            self.scaled[kind] = [y * self.point_scales.get((kind, i), overall) for i, y in enumerate(ys)]

    def draft_seconds_for(self, policy: TreePolicy, seed_rows: float, concurrent: int = 1, levels: float | None = None) -> float:
        """Drafter steps (seed rows, then one step of width rows per further level), each one forward over the rows
        of `concurrent` requests; `levels` drafted (default the policy's depth, which a policy that stops may not
        reach). Here and in `model_seconds` and `round_seconds`, `policy` may also be `grid_arrays()`, with arrays
        for the seed rows and the shape: every grid policy's seconds at once."""
        levels = policy.depth if levels is None else levels
        n = concurrent
        drafting = self.draft_at(n * seed_rows) + _positive(levels - 1) * self.draft_at(n * policy.width)
        return drafting * (levels > 0)

    def model_seconds(self, policy: TreePolicy, seed_rows: float, concurrent: int = 1, shape: Shape | None = None) -> float:
        """The drafter steps plus one verification, each one forward over the rows of `concurrent` requests."""
        levels, rows = shape or full_shape(policy)
        return self.draft_seconds_for(policy, seed_rows, concurrent, levels) + self.verify_at(concurrent * rows)

    def round_seconds(self, policy: TreePolicy, seed_rows: float, concurrent: int = 1, shape: Shape | None = None) -> float:
        """Predicted wall time of one round under `policy` after a round that committed `seed_rows` tokens, with
        `concurrent` requests stepping together: the forwards, each request's bookkeeping per level and per verified
        row (they take turns at it), what each drafting level costs the lockstep (`lockstep_at`), and the round's own
        bookkeeping at that concurrency (`per_round_at`). `shape`: the levels drafted and rows verified, where they
        are not the policy's depth and budget + 1 (a policy that stops). Never less than the model forwards alone."""
        levels, rows = shape or full_shape(policy)
        model = self.model_seconds(policy, seed_rows, concurrent, (levels, rows))
        return model + _positive(self.levels_and_rows(levels, rows, concurrent) + self.per_round_at(concurrent))

    def levels_and_rows(self, levels: float | np.ndarray, rows: float | np.ndarray, concurrent: int) -> float | np.ndarray:
        """What a round's levels and verified rows cost beyond the forwards: each of `concurrent` requests'
        bookkeeping per level and per verified row (they take turns at it), and each level's lockstep cost."""
        per_request = levels * self.overhead_per_depth + rows * self.overhead_per_row
        return concurrent * per_request + levels * self.lockstep_at(concurrent)

    def lockstep_at(self, concurrent: int) -> float:
        """Extra seconds per drafting level when `concurrent` requests step together: as measured at that concurrency,
        else interpolated between the nearest measured ones (none extra for a lone request), and past the largest in
        proportion to the requests. A batch's tail runs ever fewer requests as they finish, each count for a few
        rounds only; priced at 0 there, they would draft as deep as a lone request."""
        return by_concurrency(self.lockstep_per_level, concurrent)

    def per_round_at(self, concurrent: int) -> float:
        """A round's own bookkeeping (beyond its levels' and verified rows') when `concurrent` requests step
        together: a lone round's fitted `overhead_per_round`; beside batch-mates, as measured at that concurrency
        (`TreeTuner._measure_round`), else between the nearest measured ones and a lone round's, and before any is
        measured, a lone round's times the requests. Measured whole, not as a correction to n lone copies: a lone
        round's fit moves with every lone round, and n copies of its noise would move the batch's price with it."""
        return by_concurrency(self.round_at_concurrency, concurrent, self.overhead_per_round)


def by_concurrency(measured: dict[int, float], concurrent: int, alone: float = 0.0) -> float:
    """A cost measured at some concurrencies, at `concurrent`: `alone` for a lone request, the measured value, else
    linear between the nearest measured ones and (1, `alone`), and past the largest (or with none measured, past 1) in
    proportion to the requests."""
    if concurrent <= 1:
        return alone
    if concurrent in measured:
        return measured[concurrent]
    points = sorted([(1, alone), *measured.items()])
    x0, y0 = max(point for point in points if point[0] < concurrent)
    above = [point for point in points if point[0] > concurrent]
    if not above:
        return y0 * concurrent / x0
    x1, y1 = min(above)
    return y0 + (y1 - y0) * (concurrent - x0) / (x1 - x0)


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


class Replay:
    """One explored round, prepared for replaying many policies on its recorded nodes.

    accept[node]: probability the node is accepted given its parent was (verified nodes). A node left unverified
    counts its rate under `rates` (`Calibration.rates`, frozen when the round was explored), or 0 without them.
    The children of every node are kept in the drafter's own top-k order, and each (width, depth, stop) expansion
    is replayed once: its nodes in global order give the expected accepted tokens of every budget as a prefix sum.
    """

    def __init__(self, tree: DraftTree, accept: dict[int, float], rates: list[float] | None = None):
        self.tree = tree
        self.accept = accept
        self.rates = rates
        self.children = children_of(tree, list(range(len(tree))))
        for kids in self.children.values():
            kids.sort(key=lambda n: -tree.confidences[n])
        self._expansions: dict[tuple[int, int, float], tuple[list[float], int, list[tuple[int, int, float]], int]] = {}

    def expected(self, policy: TreePolicy) -> float:
        """Expected accepted draft tokens had `policy` drafted this round."""
        by_budget, _, _, _ = self._expansion(policy)
        return by_budget[self._verified(policy)]

    def by_depth(self, policy: TreePolicy) -> list[float]:
        """`expected(policy)` split by depth: [D] the expected accepted nodes at depths 1 .. D (D = EXPLORE.depth)."""
        _, _, ranked, _ = self._expansion(policy)
        sums = [0.0] * EXPLORE.depth
        for _, depth, value in ranked[: self._verified(policy)]:
            sums[depth - 1] += value
        return sums

    def levels(self, policy: TreePolicy) -> list[tuple[float, float]]:
        """[D] for each depth k, had `policy` drafted this round: (the chance the accepted path reaches a node at depth
        k - 1 that has a verified child, the chance it reaches depth k). Their ratio is the acceptance at depth k of
        the policy's own tree, what `LevelCorrection` sets its rounds beside."""
        _, _, ranked, _ = self._expansion(policy)
        selected = ranked[: self._verified(policy)]
        parents = {self.tree.parents[node] for node, _, _ in selected}
        reached = [1.0 if 0 in parents else 0.0] + [0.0] * (EXPLORE.depth - 1)
        for node, depth, value in selected:
            if node in parents and depth < EXPLORE.depth:
                reached[depth] += value
        return list(zip(reached, self.by_depth(policy)))

    def drafted(self, policy: TreePolicy) -> tuple[int, int]:
        """The levels `policy` would have drafted this round and the rows it would have verified (root included)."""
        _, levels, _, _ = self._expansion(policy)
        return levels, self._verified(policy) + 1

    def exact(self, policy: TreePolicy) -> bool:
        """Whether this round scores `policy` exactly, with no calibrated rate: every node its expansion would have
        drafted and verified is recorded here with its acceptance. A chosen round does so for a policy whose tree its
        own holds (a narrower, shallower, smaller one, or the same). Whether it does depends on the drafter's
        confidences alone, never on what the target accepted: keeping only the rounds whose accepted path did not
        reach a missing node would keep the rounds that went badly."""
        _, _, _, exact = self._expansion(policy)
        return self._verified(policy) <= exact

    def _verified(self, policy: TreePolicy) -> int:
        """The nodes `policy` would have verified this round: its budget, or every node its expansion recorded."""
        by_budget, _, _, _ = self._expansion(policy)
        return min(policy.budget, len(by_budget) - 1)

    def _expansion(self, policy: TreePolicy) -> tuple[list[float], int, list[tuple[int, int, float]], int]:
        key = (policy.width, policy.depth, policy.stop)
        if key not in self._expansions:
            self._expansions[key] = self._replay(*key)
        return self._expansions[key]

    def _acceptance(self, node: int) -> float:
        probability = self.accept.get(node)
        if probability is not None:
            return probability
        return self.rates[Calibration.bin(self.tree.confidences[node])] if self.rates else 0.0

    def _replay(self, width: int, depth: int, stop: float) -> tuple[list[float], int, list[tuple[int, int, float]], int]:
        """[b] expected accepted tokens of the best b nodes the (width, depth, stop) expansion records, b = 0 .. all;
        the levels it drafts (fewer than `depth` where it stops); the recorded nodes' (node, depth, chance to be on
        the accepted path), best first; and the largest budget it scores exactly (`exact`)."""
        tree = self.tree
        frontier, recorded, levels, short = [0], [], 0, []
        for _ in range(depth):
            expanded = tree.best_of(frontier, width, stop)
            if not expanded:
                break
            levels += 1
            short += [n for n in expanded if len(self.children.get(n, ())) < width]  # this tree expanded it less
            frontier = [c for n in expanded for c in self.children.get(n, [])[:width]]
            recorded += frontier
        on_path = {0: 1.0}
        by_budget = [0.0]
        ranked = []
        exact = -1 if short else None  # with nodes it would have recorded missing, no budget of it is known here
        for rank, node in enumerate(tree.ranked(recorded)):  # every prefix of the global order is ancestor-closed
            if exact is None and node not in self.accept:
                exact = rank  # the first node whose acceptance is unknown
            on_path[node] = on_path[tree.parents[node]] * self._acceptance(node)
            by_budget.append(by_budget[-1] + on_path[node])
            ranked.append((node, tree.depths[node], on_path[node]))
        return by_budget, levels, ranked, len(ranked) if exact is None else exact


class Explored:
    """The last `size` explored rounds of one of EXPLORATIONS and, for every policy scored so far, its
    total expected tokens per round over them, kept up to date as rounds come and go: scoring the grid again after
    each new round costs one replay of that round, not one of every round."""

    def __init__(self, size: int = 32):
        self.size = size
        self.replays: deque[Replay] = deque()
        # policy -> sum and sum of squares of its tokens, and the sum of its accepted nodes at each depth
        self._sums: dict[TreePolicy, tuple[float, float, list[float]]] = {}
        self._levels: dict[TreePolicy, list[tuple[float, float]]] = {}  # policy -> its mean `Replay.levels`
        # policy -> `tokens(policy, factors)` for the factors in `_tokens_for` (a choice asks for all of them, and the
        # rounds and factors change far less often than choices are made)
        self._tokens: dict[TreePolicy, tuple[float, float]] = {}
        self._tokens_for: tuple[float, ...] | None = None

    def __len__(self) -> int:
        return len(self.replays)

    def append(self, replay: Replay) -> None:
        """Add an explored round, dropping the oldest once `size` are kept."""
        if len(self.replays) == self.size:
            self._add(self.replays.popleft(), -1.0)
        self.replays.append(replay)
        self._add(replay, 1.0)
        self._levels.clear()
        self._tokens.clear()

    def _add(self, replay: Replay, sign: float) -> None:
        for policy, (total, squares, depths) in self._sums.items():
            x = 1.0 + replay.expected(policy)
            depths = [d + sign * v for d, v in zip(depths, replay.by_depth(policy))]
            self._sums[policy] = (total + sign * x, squares + sign * x * x, depths)

    def tokens(self, policy: TreePolicy, factors: list[float] | None = None) -> tuple[float, float]:
        """(mean, variance of that mean) of the tokens per round `policy` would have committed on these rounds. With
        `factors` [D], its accepted nodes at depth k count `factors[k - 1]` each (`LevelCorrection`); the variance is
        that of the rounds as recorded."""
        key = None if factors is None else tuple(factors)
        if key != self._tokens_for:
            self._tokens.clear()
            self._tokens_for = key
        if policy not in self._tokens:
            self._tokens[policy] = self._mean(policy, factors)
        return self._tokens[policy]

    def means(self, policies: list[TreePolicy], factors: list[float] | None = None) -> np.ndarray:
        """[P] the mean of `tokens` of each of `policies`, at once (`tokens` asks for one): a choice asks for the
        whole grid, and after each level correction the cache of `tokens` is cold (one policy at a time, that took
        8-13 ms, once in 4 steps of a batch of 8 on the 2-core machine)."""
        sums = [self._sums_of(policy) for policy in policies]
        n = len(self.replays)
        if factors is None:
            return np.array([total for total, _, _ in sums]) / n
        depths = np.array([d for _, _, d in sums]).reshape(len(sums), -1)  # [P, D]
        accepted = np.zeros(len(sums))
        for k, factor in enumerate(factors[: depths.shape[1]]):  # depth by depth: a policy's mean whatever its batch
            accepted = accepted + factor * depths[:, k]
        return 1.0 + accepted / n

    def _sums_of(self, policy: TreePolicy) -> tuple[float, float, list[float]]:
        """The kept sums of `policy`'s tokens over these rounds (computed on first use, then kept up to date)."""
        if policy not in self._sums:
            values = [1.0 + replay.expected(policy) for replay in self.replays]
            depths = [sum(column) for column in zip(*(replay.by_depth(policy) for replay in self.replays))]
            self._sums[policy] = (sum(values), sum(x * x for x in values), depths)
        return self._sums[policy]

    def _mean(self, policy: TreePolicy, factors: list[float] | None) -> tuple[float, float]:
        """`tokens`, computed from the kept sums (the mean as `means` computes it for many)."""
        total, squares, _ = self._sums_of(policy)
        n = len(self.replays)
        mean = total / n
        spread = max(0.0, squares - n * mean * mean) / max(1, n - 1)
        return float(self.means([policy], factors)[0]), spread / n

    def levels(self, policy: TreePolicy) -> list[tuple[float, float]]:
        """`Replay.levels` of `policy` averaged over these rounds (kept until the rounds change)."""
        if policy not in self._levels:
            n = len(self.replays)
            columns = zip(*(replay.levels(policy) for replay in self.replays))
            self._levels[policy] = [(sum(r for r, _ in c) / n, sum(a for _, a in c) / n) for c in columns]
        return self._levels[policy]


def lockstep_shape(draws: list[tuple[int, int, float]], concurrent: int) -> Shape:
    """From weighted draws (levels drafted, rows verified, weight) of one request's rounds: the levels of the deepest
    of `concurrent` requests drafting together (their levels run in lockstep), each drawing from them, and the mean
    rows one request verifies."""
    total = sum(weight for _, _, weight in draws)
    by_level: dict[int, float] = {}
    for levels, _, weight in draws:
        by_level[levels] = by_level.get(levels, 0.0) + weight
    # E[max of `concurrent` draws] = sum over k >= 1 of P(max >= k) = 1 - P(one draw < k) ** concurrent
    deepest, below = 0.0, 0.0
    for k in range(1, max(by_level) + 1):
        below += by_level.get(k - 1, 0.0)
        deepest += 1.0 - (below / total) ** concurrent
    return deepest, sum(rows * weight for _, rows, weight in draws) / total


class LevelCorrection:
    """How much more or less often the target accepts a node at each depth in the rounds being run than in the rounds
    explored, measured like for like on chosen rounds.

    The explored rounds are few, and the first ones are one prompt's opening, so their acceptance can be far from
    that of the text being decoded, the more so the deeper a policy drafts (each level's error multiplies). A chosen
    round is a direct sample: at each depth k, whether its accepted path reached a node at depth k - 1 with a verified
    child, and whether it went on to depth k. Set beside what the explored rounds predict of the same policy
    (`Explored.levels`), the recent chosen rounds give at each depth k the ratio C_k of the acceptance seen to that
    predicted, and every policy's accepted nodes at depth k then count C_1 x ... x C_k each (`Explored.tokens`). Both
    sides count the policy's own tree: a fixed depth that ends a path whatever it accepts, a floor that stops where
    the drafter is unsure, a budget that leaves a node's children unverified.
    """

    def __init__(self, size: int = 256):
        """`size`: the rounds kept at each depth, the latest that could reach it (deep ones are rarer than shallow)."""
        # per depth: (reached, accepted) as run and as predicted, for the latest rounds either side says may reach it
        self.depths: list[deque[tuple[float, float, float, float]]] = [deque(maxlen=size) for _ in range(EXPLORE.depth)]

    def add(self, seen: list[tuple[float, float]], predicted: list[tuple[float, float]]) -> None:
        """One chosen round: per depth, [D] (reached, accepted) as it ran and as the explored rounds predict."""
        for kept, (reached, accepted), (predicted_reached, predicted_accepted) in zip(self.depths, seen, predicted):
            if reached or predicted_reached:
                kept.append((reached, accepted, predicted_reached, predicted_accepted))

    def factors(self) -> list[float]:
        """[D] the weight of an accepted node at depth 1 .. D: the product of the corrections C_1 .. C_k, each pulled
        towards 1 by LEVEL_PRIOR trials at the predicted rate, and capped where the corrected rate would exceed 1."""
        out, product = [], 1.0
        for kept in self.depths:
            sums = [sum(column) for column in zip(*kept)] if kept else [0.0] * 4
            reached, accepted, predicted_reached, predicted_accepted = sums
            if predicted_accepted > 0.0:
                rate = predicted_accepted / predicted_reached
                product *= min(1.0 / rate, (accepted + LEVEL_PRIOR * rate) / (reached + LEVEL_PRIOR) / rate)
            out.append(product)
        return out


def expected_accepted(tree: DraftTree, accept: dict[int, float], policy: TreePolicy) -> float:
    """Expected accepted draft tokens had `policy` drafted this round: replay its expansion on the recorded nodes."""
    return Replay(tree, accept).expected(policy)


@dataclass
class Choice:
    """The policy chosen for one concurrency, with the tokens per round it is expected to commit."""

    policy: TreePolicy
    tokens: float
    variance: float  # of the predicted mean: per-round spread over the explored rounds / their count


@dataclass
class TreeTuner:
    """Chooses the tree policy for the next round from measured costs and recent exploration rounds.

    The choice depends on how many requests step together: their trees share every forward, and
    once a forward is compute-bound, rows one request adds cost every other request time too, so
    a batch of requests gets smaller trees than a request alone (one choice per concurrency).
    """

    costs: Costs
    explore_rounds: int = 18  # the three EXPLORATIONS in turn: acceptance varies a lot from round to round
    explore_every: int = 48  # after those, one round in this many (per request) explores again; 0: never
    revisit_every: int = 400
    drift: float = 0.25
    explored: Explored = field(default_factory=Explored)  # the last EXPLORE rounds
    explored_narrow: Explored = field(default_factory=Explored)  # the last EXPLORE_NARROW rounds
    explored_chains: Explored = field(default_factory=Explored)  # the last EXPLORE_CHAIN rounds
    calibration: Calibration = field(default_factory=Calibration)  # for the nodes exploring rounds left unverified
    realised: deque = field(default_factory=lambda: deque(maxlen=48))  # (tokens, predicted tokens) per round
    overheads: deque = field(default_factory=lambda: deque(maxlen=32))  # lone exploring rounds: (tree/depth, rows, rest)
    chosen_overheads: deque = field(default_factory=lambda: deque(maxlen=32))  # lone chosen rounds, likewise
    levels: dict[int, deque] = field(default_factory=dict)  # concurrency > 1 -> drafting seconds per level beyond the model
    beside: dict[int, deque] = field(default_factory=dict)  # concurrency > 1 -> (seconds beyond the forwards, levels, rows)
    choices: dict[int, Choice] = field(default_factory=dict)  # concurrency -> choice since the last exploration
    exploring: int = 0  # exploring rounds still to hand out
    since_choice: int = 0
    history: deque = field(default_factory=lambda: deque(maxlen=256))  # the latest choices, for reports
    corrections: LevelCorrection = field(default_factory=LevelCorrection)  # chosen rounds against their predictions
    # policy -> (tokens, levels drafted, rows verified) it would have had on the latest chosen rounds that hold it
    replayed: dict[TreePolicy, deque] = field(default_factory=dict)
    factors: list[float] | None = None  # [D] weight of an accepted node at each depth (LevelCorrection.factors)
    refreshes: int = 0  # exploring rounds run since the first exploration
    explorations: int = 0  # exploring rounds handed out so far: the first exploration, after drifts, refreshes
    _credit: float = 0.0  # rounds towards the next exploring one: each of n requests stepping together adds 1 / n^2
    chosen_rounds: int = 0  # chosen rounds observed so far (every RECORRECT_ROUNDS, the choices are made again)

    def __post_init__(self) -> None:
        self.exploring = self.explore_rounds

    @property
    def current(self) -> TreePolicy:
        """The policy of a request running alone (EXPLORE until something was explored). One lookup, so a reader
        outside the engine's tuner lock never meets a choice cleared between a check and a read."""
        alone = self.choices.get(1)
        return alone.policy if alone is not None else EXPLORE

    def policy(self, concurrent: int = 1) -> TreePolicy:
        """The next round's policy when `concurrent` requests step together: exploration rounds take EXPLORATIONS
        in turn, then the chosen one, with one exploring round in every `explore_every` rounds of a lone request,
        and in every `explore_every` x n rounds of n requests stepping together: its deeper levels and wider
        verification hold up every batch-mate (at 8 requests on the demo models an exploring round took as long as
        four chosen ones), while it teaches no more than a lone request's, so a batch refreshes less often."""
        if self.exploring:
            turn = self.explore_rounds - self.exploring
            self.exploring -= 1
            self.explorations += 1
            return EXPLORATIONS[turn % len(EXPLORATIONS)]
        if self.explore_every:
            self._credit += 1.0 / concurrent**2
            if self._credit >= self.explore_every:
                self._credit = 0.0
                self.refreshes += 1
                self.explorations += 1
                return EXPLORATIONS[(self.refreshes - 1) % len(EXPLORATIONS)]
        return self.choice(concurrent).policy

    def choice(self, concurrent: int) -> Choice:
        if concurrent not in self.choices:
            self.choose(concurrent)
        return self.choices.get(concurrent) or Choice(EXPLORE, 0.0, 0.0)

    def observe(self, record: RoundRecord, concurrent: int = 1, draft_off_worker: float = 0.0) -> None:
        """Fold in one finished round (run beside `concurrent - 1` others): an exploring round is kept and every
        concurrency chooses again; a chosen round's acceptance is checked against its prediction, and on drift or
        after a while the tuner explores again; every RECORRECT_ROUNDS chosen rounds, the choice is made again on
        what they taught (`_choose_again`). `draft_off_worker`: of the round's drafting time, the seconds its Draft
        call spent on the wire, queued or waiting for batch-mates (a service's round; once a call, not a level)."""
        self._measure_lockstep(record, concurrent, draft_off_worker)
        if record.policy in EXPLORATIONS:
            self._explored(record, concurrent)
            self.choices.clear()  # every concurrency chooses again, on the rounds explored so far
            return
        if self.exploring:
            return  # drafted before an exploration began (requests stepping together have rounds in flight)
        first_measured = self._measure_round(record, concurrent)
        self._correct_levels(record)
        self._replay_chosen(record)
        self._check(record, concurrent)
        self.chosen_rounds += 1
        if (first_measured or self.chosen_rounds % RECORRECT_ROUNDS == 0) and not self.exploring:
            self._choose_again(concurrent)

    def _check(self, record: RoundRecord, concurrent: int) -> None:
        """A chosen round against the prediction it was chosen on: drift, or a long while on one choice, explores."""
        chosen = self.choices.get(concurrent)
        if chosen is None or chosen.policy != record.policy:
            return  # a round drafted before the latest choice predicts nothing about it
        if concurrent == 1 and not record.pre_built:  # a tree drafted ahead skipped its drafting time
            self._calibrate(record, exploring=False)
        self.since_choice += 1
        self.realised.append((record.decision.num_accepted + 1, chosen.tokens, chosen.variance))
        if len(self.realised) == self.realised.maxlen:
            if self.drifted() or self.since_choice >= self.revisit_every:
                self._explore_again(concurrent)
                self.realised.clear()

    def _correct_levels(self, record: RoundRecord) -> None:
        """Set a chosen round beside what the explored rounds it is scored on predict of its policy, depth by depth."""
        policy = record.policy
        if policy is None or not self._any_explored():
            return
        path = record.decision.accepted_rows  # the accepted rows, root first
        with_children = set(record.tree.parents.tolist()[1:])
        seen = [
            (float(len(path) > k and path[k] in with_children), float(len(path) > k + 1)) for k in range(EXPLORE.depth)
        ]
        self.corrections.add(seen, self.rounds_for(policy).levels(policy))

    def _replay_chosen(self, record: RoundRecord) -> None:
        """A chosen round is an exact sample, on the text being decoded, of every policy whose tree its own holds
        (`under`, `Replay.exact`): keep the tokens each would have committed there, and the levels it would have
        drafted and the rows verified (`score` and `shape` weigh them in)."""
        if record.policy is None or record.draft_tree is None or record.row_probs is None:
            return  # a service round: the drafter's recorded nodes stay with the draft worker
        if record.pre_built:
            return  # drafted ahead on the drafter's own states: not the tree a fresh round of the policy drafts
        replay = Replay(record.draft_tree, dict(zip(record.row_nodes, record.row_probs.tolist())))
        for policy in under(record.policy):
            if replay.exact(policy):
                kept = self.replayed.setdefault(policy, deque(maxlen=REPLAYED_ROUNDS))
                kept.append((1.0 + replay.expected(policy), *replay.drafted(policy)))

    def _measure_round(self, record: RoundRecord, concurrent: int) -> bool:
        """Learn a round's own bookkeeping when `concurrent` requests step together (`Costs.per_round_at`): each
        chosen round there keeps what it took beyond its forwards, with its levels and rows; once that concurrency's
        lockstep cost is in and LOCKSTEP_ROUNDS rounds are kept, the median over them of that time less their
        levels' and rows' price at the current costs is the round's own there. Kept raw and priced afresh at every
        round, so a cost learned later (the lockstep's, a lone round's per level and per row) is never left inside
        it. Whether this round was the one that first measured it (that concurrency then chooses again at once)."""
        policy = record.policy
        if concurrent == 1 or policy is None or not policy.depth or "draft" not in record.seconds:
            return False
        observed = sum(record.seconds.get(phase, 0.0) for phase in ("draft", "tree", "verify", "publish"))
        # a policy that stops waits for the deepest of its batch-mates' levels: set beside the price `score` gives it
        levels, rows = shape = self.shape(policy, concurrent) if policy.stop else full_shape(policy)
        model = self.costs.model_seconds(policy, record.decision.num_accepted + 1, concurrent, shape)
        samples = self.beside.setdefault(concurrent, deque(maxlen=64))
        samples.append((observed - model, levels, rows))
        costs = self.costs
        if concurrent not in costs.lockstep_per_level or len(samples) < LOCKSTEP_ROUNDS:
            return False
        first = concurrent not in costs.round_at_concurrency
        costs.round_at_concurrency[concurrent] = statistics.median(
            beyond - costs.levels_and_rows(drafted, verified, concurrent) for beyond, drafted, verified in samples
        )
        return first

    def _choose_again(self, concurrent: int) -> None:
        """Every RECORRECT_ROUNDS chosen rounds: the level corrections take in the rounds since, `concurrent`
        chooses again on them and on the costs learned meanwhile (keeping its count of rounds since the choice where
        the choice stands), and the other concurrencies when they next step (a choice scores the whole grid)."""
        self.factors = self.corrections.factors()
        before = self.choices.get(concurrent)
        self.choices = {} if before is None else {concurrent: before}
        since = self.since_choice
        if self.choose(concurrent) == (before and before.policy):
            self.since_choice = since

    def _explore_again(self, concurrent: int) -> None:
        """After drift, or a long while on one choice: a lone request explores `explore_rounds` rounds again. Requests
        stepping together would take those rounds within two or three steps, each step then verifying n exploration
        trees and drafting 8 levels for all of them (on the demo models a batch of 8 ran 26-33% slower for it), so
        beside batch-mates the next round explores, one round, as the periodic refresh does (a refresh rather than
        nothing: drift there means the explored rounds do not fit these requests' text, and each exploring round adds
        one of theirs)."""
        if concurrent > 1 and self.explore_every:
            self._credit = float(self.explore_every)
        else:
            self.exploring = self.explore_rounds

    def _explored(self, record: RoundRecord, concurrent: int) -> None:
        """Keep an exploring round for replays, and learn the bookkeeping cost from it when it ran alone: beside
        batch-mates its phases also wait on theirs, which draft other trees (what a level costs requests stepping
        together is learned from their chosen rounds, `_measure_lockstep`)."""
        if record.draft_tree is not None and record.row_probs is not None:
            accept = dict(zip(record.row_nodes, record.row_probs.tolist()))
            self.calibration.add(record.draft_tree, accept)
            replay = Replay(record.draft_tree, accept, self.calibration.rates())
            self.rounds_of(record.policy).append(replay)
        if concurrent == 1:
            self._calibrate(record, exploring=True)

    def drifted(self) -> bool:
        """Realised tokens per round differ from the prediction by more than `drift`, beyond three standard errors."""
        n = len(self.realised)
        mean = sum(r for r, _, _ in self.realised) / n
        predicted = sum(p for _, p, _ in self.realised) / n
        predicted_variance = sum(v for _, _, v in self.realised) / n
        variance = sum((r - mean) ** 2 for r, _, _ in self.realised) / max(1, n - 1) / n
        gap = abs(mean - predicted)
        return gap > self.drift * predicted and gap > 3.0 * (variance + predicted_variance) ** 0.5

    def _calibrate(self, record: RoundRecord, exploring: bool) -> None:
        """Learn the time a lone round spends outside model forwards: tree bookkeeping per depth, the rest per round
        and per verified row. The slope over rows is fitted over the exploration rounds, whose rows differ (a wide
        tree's rest costs several times a chain's, so one per-round figure would overcharge small trees). Once
        chosen rounds have run, they set the level: an exploring round also carries every node it recorded (over
        the wire, in a service, with its receipt checks), which a chosen round does not, so a level fitted on
        exploring rounds alone would overcharge every round and favour large trees. Requests stepping together take
        turns at it (`Costs.round_seconds`)."""
        seconds = record.seconds
        observed = sum(seconds.get(phase, 0.0) for phase in ("draft", "tree", "verify", "publish"))
        policy = record.policy or EXPLORE
        levels, rows = shape = priced_shape(record, policy)
        model = self.costs.model_seconds(policy, record.decision.num_accepted + 1, shape=shape)
        tree = seconds.get("tree", 0.0)
        rest = max(0.0, observed - model - tree)
        (self.overheads if exploring else self.chosen_overheads).append((tree / max(1.0, levels), rows, rest))
        lone = [*self.overheads, *self.chosen_overheads]
        self.costs.overhead_per_depth = sum(d for d, _, _ in lone) / len(lone)
        if exploring:  # the line moves only with the exploring rounds
            self.costs.overhead_per_round, self.costs.overhead_per_row = fit_line([(rows, r) for _, rows, r in self.overheads])
        if self.chosen_overheads:
            slope = self.costs.overhead_per_row
            self.costs.overhead_per_round = max(0.0, statistics.median(r - slope * rows for _, rows, r in self.chosen_overheads))

    def _measure_lockstep(self, record: RoundRecord, concurrent: int, off_worker: float = 0.0) -> None:
        """Learn what a drafting level costs requests stepping together beyond the drafter's forwards: the bookkeeping
        of all n requests plus their hand-offs. The extra, per concurrency, is the median over that concurrency's
        rounds, whole: a lone request's drafting bookkeeping is priced per round, not per level (`_calibrate` fits a
        lone round's rest over its rows), so taking n times it off each level, as this once did, took from the levels
        what was never charged to them (at 8 requests on the demo models, 5.3 ms a level less 8 x 0.67 came to
        nothing, and deep trees looked cheap in batches); a round's own bookkeeping there is measured whole too
        (`_measure_round`). Once a concurrency has enough rounds its choice is made again with it, and
        the concurrencies not yet measured, which are priced from the measured ones (`Costs.lockstep_at`), choose
        again too. A service's Draft call drafts every level in one call: its time off the worker (`off_worker`:
        wire, serialization, the queue behind the other group) is the round's, not its levels', and is left to the
        round's own (`_measure_round`)."""
        policy = record.policy
        if policy is None or not policy.depth or "draft" not in record.seconds:
            return
        if concurrent == 1 or policy in EXPLORATIONS:
            return  # alone: in the overheads; else its batch-mates drafted other trees, and its levels waited on theirs
        levels, _ = priced_shape(record, policy)
        model = self.costs.draft_seconds_for(policy, record.decision.num_accepted + 1, concurrent, levels)
        samples = self.levels.setdefault(concurrent, deque(maxlen=64))
        samples.append(max(0.0, record.seconds["draft"] - off_worker - model) / max(1.0, levels))
        if len(samples) < LOCKSTEP_ROUNDS:
            return
        self.costs.lockstep_per_level[concurrent] = statistics.median(samples)
        if len(samples) == LOCKSTEP_ROUNDS:  # a new measured concurrency: the others priced by it choose again
            for other in [c for c in self.choices if c > 1 and c not in self.costs.lockstep_per_level]:
                del self.choices[other]
            if not self.exploring and self._any_explored():
                self.choose(concurrent)

    def rounds_for(self, policy: TreePolicy) -> Explored:
        """Explored rounds that measure `policy`: the chain rounds for a chain, the narrow-tree rounds (which verify
        every node a policy of width 2 can record) for width 2, the wide-tree rounds otherwise; any kind there is
        while that one has none."""
        rounds = self.explored_chains if policy.width == 1 else self.explored_narrow if policy.width == 2 else self.explored
        return rounds or self.explored or self.explored_narrow or self.explored_chains

    def rounds_of(self, exploration: TreePolicy) -> Explored:
        """Where the rounds of one of EXPLORATIONS are kept."""
        if exploration == EXPLORE:
            return self.explored
        if exploration == EXPLORE_NARROW:
            return self.explored_narrow
        if exploration == EXPLORE_CHAIN:
            return self.explored_chains
        raise KeyError(exploration)

    def _any_explored(self) -> bool:
        """Whether any exploring round has been kept yet."""
        return bool(self.explored or self.explored_narrow or self.explored_chains)

    def score(self, policy: TreePolicy, concurrent: int = 1) -> tuple[float, float]:
        """(expected tokens per round, expected tokens per second of each request) of `policy` on the explored rounds
        of its kind, when `concurrent` requests step together. Where chosen rounds held its tree, the tokens are
        their mean with the explored prediction counted as PREDICTION_ROUNDS more; a policy that stops is priced at
        `shape`."""
        tokens = self.tokens(policy)
        shape = self.shape(policy, concurrent) if policy.stop else None
        return tokens, tokens / self.costs.round_seconds(policy, tokens, concurrent, shape)

    def tokens(self, policy: TreePolicy) -> float:
        """`score`'s expected tokens per round of `policy`."""
        return self._with_replayed(policy, self.rounds_for(policy).tokens(policy, self.factors)[0])

    def _with_replayed(self, policy: TreePolicy, predicted: float) -> float:
        """The explored prediction of `policy`'s tokens per round, averaged with its replayed rounds where it has any
        (the prediction counting as PREDICTION_ROUNDS of them)."""
        replayed = self.replayed.get(policy)
        if not replayed:
            return predicted
        return (sum(t for t, _, _ in replayed) + PREDICTION_ROUNDS * predicted) / (len(replayed) + PREDICTION_ROUNDS)

    def _grid_tokens(self) -> np.ndarray:
        """[len(grid())] `tokens` of every grid policy, at once: each kind of explored rounds prices its policies
        together (`Explored.means`), and the policies with replayed rounds take them in as `tokens` does."""
        policies = grid()
        by_rounds: dict[int, tuple[Explored, list[int]]] = {}
        for i, policy in enumerate(policies):
            rounds = self.rounds_for(policy)
            by_rounds.setdefault(id(rounds), (rounds, []))[1].append(i)
        tokens = np.empty(len(policies))
        for rounds, index in by_rounds.values():
            tokens[index] = rounds.means([policies[i] for i in index], self.factors)
        for policy in self.replayed:
            i = grid_index().get(policy)
            if i is not None:
                tokens[i] = self._with_replayed(policy, float(tokens[i]))
        return tokens

    def shape(self, policy: TreePolicy, concurrent: int = 1) -> Shape:
        """The levels and rows a round of `policy` (one that stops) drafts and verifies beside `concurrent - 1`
        others (`lockstep_shape`): on the explored rounds, which count as PREDICTION_ROUNDS rounds in all as
        `score` counts them, and on the chosen rounds that held it. How deep a floor lets a chain go depends on the
        drafter's confidence on the text being decoded, as its acceptance does (on the demo models' held-out
        prompts, a floor of 0.2 drafted 1.43 levels a round on the explored rounds and 2.08 in the batch)."""
        rounds = self.rounds_for(policy)
        weight = PREDICTION_ROUNDS / len(rounds)
        draws = [(*replay.drafted(policy), weight) for replay in rounds.replays]
        draws += [(levels, rows, 1.0) for _, levels, rows in self.replayed.get(policy, ())]
        return lockstep_shape(draws, concurrent)

    def choose(self, concurrent: int = 1) -> TreePolicy:
        """The grid policy with the highest expected tokens per second for `concurrent` requests stepping together
        (the first such in the grid): `score` of every grid policy, priced all at once (one policy at a time, the
        342 prices took 2.5 of a choice's 4.3 ms on the 2-core machine)."""
        if not self._any_explored():
            return self.current
        policies, arrays = grid(), grid_arrays()
        tokens = self._grid_tokens()
        levels, rows = arrays.depth.copy(), arrays.rows.copy()
        for i, policy in enumerate(policies):
            if policy.stop:
                levels[i], rows[i] = self.shape(policy, concurrent)
        rates = tokens / self.costs.round_seconds(arrays, tokens, concurrent, (levels, rows))
        i = int(np.argmax(rates))
        best, tokens, rate = policies[i], float(tokens[i]), float(rates[i])
        self.choices[concurrent] = Choice(best, tokens, self.rounds_for(best).tokens(best, self.factors)[1])
        self.since_choice = 0
        self.history.append({"policy": best, "concurrent": concurrent, "tokens_per_round": tokens, "tokens_per_s": rate})
        return best
