"""Tree auto (`tree: auto`, opt-in): each round's tree chosen for the most tokens per second from this machine's costs
and replays of explored rounds (docs/autotree.md).

`grid`: the candidates; `costs`, `measure`: what a round costs; `replay`, `explored`: what a policy would accept;
`tuner`: the choice.
"""

from .costs import Costs
from .grid import EXPLORATIONS, EXPLORE
from .measure import measure_costs, measure_draft, measure_verify
from .replay import Replay, expected_accepted
from .tuner import TreeTuner

__all__ = ["EXPLORATIONS", "EXPLORE", "Costs", "Replay", "TreeTuner", "expected_accepted", "measure_costs", "measure_draft", "measure_verify"]
