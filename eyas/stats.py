"""Per-request generation statistics, accumulated from round records."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

PHASES = ("prefill", "draft", "tree", "verify", "publish")


@dataclass
class GenerationStats:
    """Rounds, target forwards (prefill included), tokens, acceptance and seconds by phase.

    mean_accept_length is tokens committed per verification forward (accepted drafts + 1 frontier);
    accepted_length_histogram[k] counts rounds that accepted exactly k draft tokens.
    """

    rounds: int = 0
    target_forwards: int = 0
    tokens: int = 0
    accepted_length_histogram: list[int] = field(default_factory=list)
    nodes_expanded: int = 0
    nodes_verified: int = 0
    ahead_rounds: int = 0  # rounds that verified a tree drafted ahead (draft-ahead hits)
    ahead_tokens: int = 0  # tokens those rounds committed
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def add_prefill(self, seconds: float) -> None:
        self.target_forwards += 1
        self.seconds["prefill"] += seconds

    def add_round(self, record) -> None:
        """Fold one `RoundRecord` in."""
        self.rounds += 1
        self.target_forwards += 1
        self.tokens += len(record.emitted)
        accepted = record.decision.num_accepted
        if len(self.accepted_length_histogram) <= accepted:
            self.accepted_length_histogram += [0] * (accepted + 1 - len(self.accepted_length_histogram))
        self.accepted_length_histogram[accepted] += 1
        self.nodes_expanded += record.nodes_expanded
        self.nodes_verified += record.tree.num_rows
        if record.pre_built:
            self.ahead_rounds += 1
            self.ahead_tokens += len(record.emitted)
        for phase, seconds in record.seconds.items():
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @property
    def mean_accept_length(self) -> float:
        """Tokens committed per verification forward."""
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def target_forwards_per_token(self) -> float:
        """Verification forwards per committed token (prefill excluded)."""
        return self.rounds / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["mean_accept_length"] = self.mean_accept_length
        data["target_forwards_per_token"] = self.target_forwards_per_token
        return data
