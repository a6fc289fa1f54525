"""What rounds cost: forward times by rows, scaled by what forwards took in rounds, plus the bookkeeping."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..tree import TreePolicy
from .grid import Shape, full_shape


VERIFY_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 65, 128, 256)  # past 65: several requests' trees in one forward
DRAFT_ROWS = (1, 2, 4, 8, 16, 32, 64)
OBSERVED_FORWARDS = 64  # recent forwards per model whose time over the measured curve scales it
MIN_OBSERVED = 8  # forwards of a model before its scale moves from 1


def fit_line(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of y over x, both nonnegative: least squares through the median y of each x (flat where x
    does not vary), so an odd slow round does not move it."""
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
    """Piecewise-linear through measured points, flat before the first, extended linearly past the last; at a number
    or elementwise on an array."""
    past = ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (x - xs[-1])
    if isinstance(x, np.ndarray):
        return np.where(x > xs[-1], past, np.interp(x, xs, ys))
    return past if x > xs[-1] else float(np.interp(x, xs, ys))


def _positive(x: float | np.ndarray) -> float | np.ndarray:
    """max(0, x), elementwise on an array; a number stays a Python float."""
    return np.maximum(0.0, x) if isinstance(x, np.ndarray) else max(0.0, x)


@dataclass
class Costs:
    """Seconds per verification and per drafter step by rows (measured, then scaled by what rounds' forwards took),
    and outside the models: bookkeeping per level, per round and per verified row, alone and per concurrency."""

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
    # (kind, calls > 1) -> recent seconds that forwards of that many requests' calls took beyond the curve at their rows
    beyond: dict[tuple[str, int], deque] = field(default_factory=dict)
    calls_extra: dict[tuple[str, int], float] = field(default_factory=dict)  # (kind, calls) -> the median of its `beyond`
    # (kind, rows) -> seconds, until the next observed forward
    _at: dict[tuple[str, float], float] = field(default_factory=dict, repr=False, compare=False)

    def verify_at(self, rows: float, calls: int = 1) -> float:
        """Seconds of one target forward over `rows` rows of `calls` requests: as measured, scaled by what forwards
        took in rounds, plus what forwards of `calls` calls took beyond that."""
        return self._curve_at("verify", rows, calls)

    def draft_at(self, rows: float, calls: int = 1) -> float:
        """Seconds of one drafter forward over `rows` rows of `calls` requests, likewise."""
        return self._curve_at("draft", rows, calls)

    def _measured(self, kind: str) -> tuple[list[int], list[float]]:
        """`kind`'s measured curve: rows, seconds."""
        return (self.verify_rows, self.verify_seconds) if kind == "verify" else (self.draft_rows, self.draft_seconds)

    def _curve_at(self, kind: str, rows: float | np.ndarray, calls: int = 1) -> float | np.ndarray:
        """`kind`'s scaled curve ("verify" or "draft") at `rows` (a number, cached, or an array), plus the extra of
        forwards of `calls` calls."""
        extra = self.calls_extra.get((kind, calls), 0.0)
        if isinstance(rows, np.ndarray):
            return _positive(_interpolate(*self._scaled(kind), rows) + extra)
        key = (kind, rows)
        if key not in self._at:
            self._at[key] = _interpolate(*self._scaled(kind), rows)
        return _positive(self._at[key] + extra)

    def _scaled(self, kind: str) -> tuple[list[int], list[float]]:
        """`kind`'s curve as forwards in rounds scaled it: rows, seconds."""
        xs, ys = self._measured(kind)
        return xs, self.scaled.get(kind, ys)

    def observe(self, kind: str, rows: int, seconds: float, calls: int = 1) -> None:
        """Fold in one forward of `kind` ("verify" or "draft") over `rows` rows of `calls` requests that took
        `seconds`. A lone call's ratio to the measured curve scales the point nearest its rows and the whole curve;
        several calls' time beyond the scaled curve is their number's extra (medians; prefills past the curve left
        out)."""
        xs, ys = self._measured(kind)
        if not 0 < rows <= xs[-1]:
            return
        if calls > 1:
            beyond = self.beyond.setdefault((kind, calls), deque(maxlen=OBSERVED_FORWARDS))
            beyond.append(seconds - self._curve_at(kind, rows))
            if len(beyond) >= MIN_OBSERVED:
                self.calls_extra[kind, calls] = statistics.median(beyond)
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
        """The drafter's forwards for `levels` levels (default the depth) of `concurrent` requests: the seed rows, then
        width rows a level. Here and below `policy` may be `grid_arrays()`, with arrays for the rest: the whole grid."""
        levels = policy.depth if levels is None else levels
        n = concurrent
        drafting = self.draft_at(n * seed_rows, n) + _positive(levels - 1) * self.draft_at(n * policy.width, n)
        return drafting * (levels > 0)

    def model_seconds(self, policy: TreePolicy, seed_rows: float, concurrent: int = 1, shape: Shape | None = None) -> float:
        """The drafter steps plus one verification, each one forward over the rows of `concurrent` requests."""
        levels, rows = shape or full_shape(policy)
        return self.draft_seconds_for(policy, seed_rows, concurrent, levels) + self.verify_at(concurrent * rows, concurrent)

    def round_seconds(self, policy: TreePolicy, seed_rows: float, concurrent: int = 1, shape: Shape | None = None) -> float:
        """Predicted seconds of a round of `policy` after one that committed `seed_rows`, `concurrent` requests stepping
        together: forwards plus bookkeeping, never less than the forwards. `shape`: (levels, rows) where not full."""
        levels, rows = shape or full_shape(policy)
        model = self.model_seconds(policy, seed_rows, concurrent, (levels, rows))
        return model + _positive(self.levels_and_rows(levels, rows, concurrent) + self.per_round_at(concurrent))

    def levels_and_rows(self, levels: float | np.ndarray, rows: float | np.ndarray, concurrent: int) -> float | np.ndarray:
        """Bookkeeping of `concurrent` requests' levels and verified rows, plus each level's lockstep cost."""
        per_request = levels * self.overhead_per_depth + rows * self.overhead_per_row
        return concurrent * per_request + levels * self.lockstep_at(concurrent)

    def lockstep_at(self, concurrent: int) -> float:
        """Extra seconds per drafting level when `concurrent` requests step together (`by_concurrency`)."""
        return by_concurrency(self.lockstep_per_level, concurrent)

    def per_round_at(self, concurrent: int) -> float:
        """A round's own bookkeeping beyond its levels and rows when `concurrent` requests step together
        (`by_concurrency` from a lone round's `overhead_per_round`)."""
        return by_concurrency(self.round_at_concurrency, concurrent, self.overhead_per_round)


def by_concurrency(measured: dict[int, float], concurrent: int, alone: float = 0.0) -> float:
    """A cost measured at some concurrencies, at `concurrent`: `alone` at 1, linear between the nearest measured
    points and (1, `alone`), proportional to the requests past the largest."""
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
