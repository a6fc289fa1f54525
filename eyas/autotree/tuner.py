"""The tuner: chooses each round's tree policy from measured costs and explored rounds."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..outcomes import Calibration
from ..rounds import RoundRecord
from ..tree import TreePolicy
from .costs import Costs, fit_line
from .explored import Explored, LevelCorrection, lockstep_shape
from .grid import EXPLORATIONS, EXPLORE, EXPLORE_CHAIN, EXPLORE_NARROW, Shape, full_shape, grid, grid_arrays, grid_index, priced_shape, under
from .replay import Replay


LOCKSTEP_ROUNDS = 8  # rounds at a concurrency before its lockstep cost per level counts (and the choice is redone)
RECORRECT_ROUNDS = 32  # chosen rounds between two updates of the level corrections and the choices made on them
REPLAYED_ROUNDS = 256  # latest chosen rounds that scored a policy exactly, kept for it (TreeTuner.replayed)
PREDICTION_ROUNDS = 8.0  # rounds the explored prediction counts as beside a policy's replayed rounds (TreeTuner.score)


class Kept(deque):
    """A policy's latest replayed rounds, (tokens, levels, rows) each, with their tokens' running sum."""

    def __init__(self, rounds: tuple[tuple[float, int, int], ...] | list = (), maxlen: int = REPLAYED_ROUNDS):
        super().__init__(maxlen=maxlen)
        self.tokens = 0.0
        for kept in rounds:
            self.append(kept)

    def append(self, kept: tuple[float, int, int]) -> None:
        if len(self) == self.maxlen:
            self.tokens -= self[0][0]
        super().append(kept)
        self.tokens += kept[0]

    def __reduce__(self) -> tuple:
        return type(self), (list(self), self.maxlen)  # a copy appends its rounds once, summing them anew


@dataclass
class Choice:
    """The policy chosen for one concurrency, with the tokens per round it is expected to commit."""

    policy: TreePolicy
    tokens: float
    variance: float  # of the predicted mean: per-round spread over the explored rounds / their count


@dataclass
class TreeTuner:
    """Chooses the next round's policy from measured costs and explored rounds, one choice per number of requests
    stepping together (docs/autotree.md)."""

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
    replayed: dict[TreePolicy, Kept] = field(default_factory=dict)
    factors: list[float] | None = None  # [D] weight of an accepted node at each depth (LevelCorrection.factors)
    refreshes: int = 0  # exploring rounds run since the first exploration
    explorations: int = 0  # exploring rounds handed out so far: the first exploration, after drifts, refreshes
    _credit: float = 0.0  # rounds towards the next exploring one: each of n requests stepping together adds 1 / n^2
    chosen_rounds: int = 0  # chosen rounds observed so far (every RECORRECT_ROUNDS, the choices are made again)

    def __post_init__(self) -> None:
        self.exploring = self.explore_rounds

    @property
    def current(self) -> TreePolicy:
        """The policy of a request running alone (EXPLORE until one is chosen); one lookup, safe outside the lock."""
        alone = self.choices.get(1)
        return alone.policy if alone is not None else EXPLORE

    def policy(self, concurrent: int = 1) -> TreePolicy:
        """The next round's policy when `concurrent` requests step together: EXPLORATIONS in turn while exploring, then
        the choice, with one exploring round in `explore_every` x `concurrent` rounds. After the first exploration,
        a whole exploration is left to a lone request (an exploring round costs every batch-mate its time), while
        requests stepping together explore by `explore_every`."""
        first = self.explorations < self.explore_rounds  # the first exploration's rounds are still being handed out
        if self.exploring and (concurrent == 1 or first or not self.explore_every):
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
        """Fold in one finished round run beside `concurrent - 1` others. `draft_off_worker`: of a service round's
        drafting time, the seconds its Draft call spent off the worker (wire, queue)."""
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
        """Keep, for every policy a chosen round's tree holds (`under`, `Replay.exact`), the tokens, levels and rows it
        would have had there."""
        if record.policy is None or record.draft_tree is None or record.row_probs is None:
            return  # a service round: the drafter's recorded nodes stay with the draft worker
        if record.pre_built:
            return  # drafted ahead on the drafter's own states: not the tree a fresh round of the policy drafts
        replay = Replay(record.draft_tree, dict(zip(record.row_nodes, record.row_probs.tolist())))
        for policy in under(record.policy):
            if replay.exact(policy):
                kept = self.replayed.setdefault(policy, Kept())
                kept.append((1.0 + replay.expected(policy), *replay.drafted(policy)))

    def _measure_round(self, record: RoundRecord, concurrent: int) -> bool:
        """Learn a round's own bookkeeping at `concurrent` > 1 (`Costs.per_round_at`): the median of what kept rounds
        took beyond their forwards, levels and rows at the current costs. Whether this round first measured it."""
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
        """Apply the level corrections; `concurrent` chooses again now, the other concurrencies when they next step."""
        self.factors = self.corrections.factors()
        before = self.choices.get(concurrent)
        self.choices = {} if before is None else {concurrent: before}
        since = self.since_choice
        if self.choose(concurrent) == (before and before.policy):
            self.since_choice = since

    def _explore_again(self, concurrent: int) -> None:
        """After drift or a long while on one choice: a lone request explores `explore_rounds` rounds again, requests
        stepping together one round."""
        if concurrent > 1 and self.explore_every:
            self._credit = float(self.explore_every)
        else:
            self.exploring = self.explore_rounds

    def _explored(self, record: RoundRecord, concurrent: int) -> None:
        """Keep an exploring round for replays; when it ran alone, learn the bookkeeping from it too."""
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
        """Learn a lone round's time outside the forwards: tree bookkeeping per level, the rest as a line over the
        verified rows, its slope from exploring rounds and its level from chosen ones once there are some."""
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
        """Learn what a drafting level costs requests stepping together beyond the drafter's forwards: the median over
        a concurrency's chosen rounds, less `off_worker` (a service call's time off the worker, the round's own)."""
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
        """Explored rounds that score `policy`: chain rounds for width 1, narrow ones for width 2, wide ones otherwise
        (any kind while that one has none)."""
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
        """(expected tokens per round, expected tokens per second of each request) of `policy` when `concurrent`
        requests step together."""
        tokens = self.tokens(policy)
        shape = self.shape(policy, concurrent) if policy.stop else None
        return tokens, tokens / self.costs.round_seconds(policy, tokens, concurrent, shape)

    def tokens(self, policy: TreePolicy) -> float:
        """`score`'s expected tokens per round of `policy`."""
        return self._with_replayed(policy, self.rounds_for(policy).tokens(policy, self.factors)[0])

    def _with_replayed(self, policy: TreePolicy, predicted: float) -> float:
        """The explored prediction averaged with `policy`'s replayed rounds, counting as PREDICTION_ROUNDS of them."""
        replayed = self.replayed.get(policy)
        if not replayed:
            return predicted
        return (replayed.tokens + PREDICTION_ROUNDS * predicted) / (len(replayed) + PREDICTION_ROUNDS)

    def _grid_tokens(self) -> np.ndarray:
        """[len(grid())] `tokens` of every grid policy, at once."""
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
        """The (levels, rows) a round of `policy`, one that stops, drafts and verifies beside `concurrent - 1` others,
        from its explored and replayed rounds weighed as `score` weighs them."""
        rounds = self.rounds_for(policy)
        weight = PREDICTION_ROUNDS / len(rounds)
        draws = [(*replay.drafted(policy), weight) for replay in rounds.replays]
        draws += [(levels, rows, 1.0) for _, levels, rows in self.replayed.get(policy, ())]
        return lockstep_shape(draws, concurrent)

    def choose(self, concurrent: int = 1) -> TreePolicy:
        """The grid policy with the highest `score` for `concurrent` requests stepping together (the first such),
        the whole grid priced at once."""
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
