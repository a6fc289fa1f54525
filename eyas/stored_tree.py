"""The tree picked for a drafter and target on one machine (`eyas bench tree --pick`), stored beside the drafter.

The engine and the service use it when no tree is given (docs/tree.md#the-default-tree).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .manifest import weight_digest
from .tree import TreeError, TreePolicy

TREE_FILE = "tree.json"


@dataclass(frozen=True)
class StoredTree:
    """A picked policy, the drafter and target it was picked for (weight digests) and how: machine, dtypes, every
    candidate's tokens/s, the prompts and the command that picked it."""

    policy: TreePolicy
    drafter: str
    target: str
    machine: dict = field(default_factory=dict)
    dtype: str = ""
    draft_dtype: str = ""
    tokens_per_s: dict[str, float] = field(default_factory=dict)
    prompts: str = ""
    command: str = ""

    def to_dict(self) -> dict:
        return {"tree": asdict(self.policy), **{k: v for k, v in asdict(self).items() if k != "policy"}}

    @classmethod
    def from_dict(cls, data: object, where: str = TREE_FILE) -> "StoredTree":
        """Check every field, naming the first bad one (`where`: the file, for the message)."""
        if not isinstance(data, dict):
            raise TreeError(where, "must be a JSON object")
        unknown = set(data) - {"tree", *(f for f in cls.__dataclass_fields__ if f != "policy")}
        if unknown:
            raise TreeError(f"{where}: {sorted(unknown)[0]}", "unknown field")
        if not isinstance(data.get("tree"), dict):
            raise TreeError(f"{where}: tree", "must be a mapping of width, depth, budget and stop")
        policy = _checked(TreePolicy.from_dict, data["tree"], where)
        for key in ("drafter", "target"):
            if not isinstance(data.get(key), str) or not data[key]:
                raise TreeError(f"{where}: {key}", f"must be the weight digest of the {key} the tree was picked for")
        for key in ("machine", "dtype", "draft_dtype", "tokens_per_s", "prompts", "command"):
            kind = dict if key in ("machine", "tokens_per_s") else str
            if not isinstance(data.get(key, kind()), kind):
                raise TreeError(f"{where}: {key}", f"must be a {kind.__name__}")
        return cls(policy, **{k: v for k, v in data.items() if k != "tree"})

    def save(self, drafter: str | Path) -> Path:
        path = Path(drafter, TREE_FILE)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, drafter: str | Path) -> "StoredTree | None":
        """The drafter's stored tree, None when it has none; a malformed file raises TreeError naming the field."""
        path = Path(drafter, TREE_FILE)
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise TreeError(str(path), f"not JSON ({exc})") from None
        return cls.from_dict(data, str(path))


def _checked(check: Callable, value: object, where: str) -> TreePolicy:
    """`check(value)`, a TreeError from it (naming `tree.<knob>`) prefixed with the stored file."""
    try:
        return check(value)
    except TreeError as exc:
        raise TreeError(f"{where}: {exc.field}", str(exc).removeprefix(f"{exc.field}: ")) from None


def stored_for(drafter: str | Path, target: str) -> StoredTree | None:
    """The drafter's stored tree when it was picked for these drafter weights and `target` (a weight digest)."""
    stored = StoredTree.load(drafter)
    if stored is None or stored.target != target or stored.drafter != weight_digest(drafter):
        return None
    return stored


def default_tree(drafter: str | Path, target: str, check: Callable[[TreePolicy], TreePolicy] = TreePolicy.from_dict) -> TreePolicy:
    """`stored_for`'s policy, passed through `check` (a KV slot's headroom), else TreePolicy() with a warning."""
    stored = stored_for(drafter, target)
    if stored is not None:
        return _checked(check, stored.policy, str(Path(drafter, TREE_FILE)))
    fallback = TreePolicy()
    why = f"its {TREE_FILE} was picked for other weights (drafter or target)"
    if not Path(drafter, TREE_FILE).exists():
        why = f"no {TREE_FILE}"
    warnings.warn(
        f"{drafter}: {why}; using the default tree {fallback.width}/{fallback.depth}/{fallback.budget}, seldom the "
        f"fastest (`eyas bench tree --pick` picks one for this machine: docs/tree.md#the-default-tree)",
        stacklevel=2,
    )
    return fallback
