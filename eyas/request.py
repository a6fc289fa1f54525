"""One request's committed state: the output tokens (the source of truth), its version, and stop rules.

The last committed token is append-required: it has no target KV or feature yet and becomes
row 0 of the next tree. Output never overshoots max_new_tokens, EOS or a stop string, even when
a round accepts more. Prompts become checked token ids here, and EOS ids come from the
target's generation config, for the engine and the service alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .errors import RequestError, VersionError
from .sampling import SamplingError, SamplingParams


@dataclass(frozen=True)
class StopRules:
    max_new_tokens: int = 64
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if type(self.max_new_tokens) is not int or self.max_new_tokens < 1:
            raise RequestError("max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        for i, s in enumerate(self.stop_strings):
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop[{i}]", f"a stop string must be a non-empty string, got {s!r}")


def make_sampling(within: str = "", **options) -> SamplingParams:
    """SamplingParams from keyword options, with a bad value reported as a RequestError naming the option after
    `within` (`sampling.` where the options travel in a message's `sampling` field)."""
    try:
        return SamplingParams(**options)
    except TypeError as exc:
        raise RequestError(within.rstrip(".") or "sampling", f"unknown sampling option ({exc})") from None
    except SamplingError as exc:
        raise RequestError(within + str(exc).split(" ")[0], str(exc)) from None


@dataclass
class RequestState:
    """Prompt, committed output, version and finish reason of one generation request."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: StopRules
    decode: Callable[[list[int]], str] | None = None
    output: list[int] = field(default_factory=list)
    version: int = 0
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise RequestError("prompt", "the prompt is empty")
        if self.stop.stop_strings and self.decode is None:
            raise RequestError("stop", "stop strings need a tokenizer to decode the output")

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def root_token(self) -> int:
        """The append-required token: the last committed one, root of the next tree."""
        return self.output[-1] if self.output else self.prompt_ids[-1]

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output

    def commit(self, version: int, tokens: Sequence[int]) -> list[int]:
        """Append a round's accepted tokens and frontier token up to the first stop; returns what was emitted."""
        if version != self.version:
            raise VersionError(f"request {self.request_id}", self.version, version)
        if self.done:
            raise RuntimeError(f"request {self.request_id} already finished ({self.finish_reason})")
        emitted = []
        for token in tokens:
            self.output.append(int(token))
            emitted.append(int(token))
            self.finish_reason = self._finished()
            if self.done:
                break
        self.version += 1
        return emitted

    def _finished(self) -> str | None:
        if self.output[-1] in self.stop.eos_token_ids:
            return "eos"
        if self.stop.stop_strings and any(s in self.decode(self.output) for s in self.stop.stop_strings):
            return "stop"
        if len(self.output) >= self.stop.max_new_tokens:
            return "length"
        return None


def tokenize_prompt(prompt: str | Sequence[int], tokenizer, vocab_size: int) -> list[int]:
    """A prompt string (through `tokenizer`) or a list of token ids, checked against the vocabulary.

    Shared by the engine and the service's coordinator, which holds the tokenizer but no model.
    """
    return _checked_ids(_prompt_ids(prompt, tokenizer, None), vocab_size)


def prompt_within(
    prompt: str | Sequence[int],
    tokenizer,
    vocab_size: int,
    max_new_tokens: int | None,
    capacity: int,
    where: str,
    special_tokens: bool = True,
) -> list[int]:
    """`tokenize_prompt` for a request of `max_new_tokens` (None: as many as fit) within `capacity` positions (`where`
    names them): a prompt leaving no room for one new token is refused naming `prompt` (a text stops tokenizing once
    that is known), one leaving room for fewer than `max_new_tokens` naming `max_new_tokens`. `special_tokens` False
    tokenizes a text without the tokenizer's own special tokens (a rendered chat template writes those it wants)."""
    ids = _prompt_ids(prompt, tokenizer, capacity - 1, special_tokens)
    if ids is None or len(ids) >= capacity:
        count = f"more than {capacity - 1}" if ids is None else len(ids)
        raise RequestError("prompt", f"{count} tokens leave no room for a new token within {where}")
    ids = _checked_ids(ids, vocab_size)
    if max_new_tokens is not None and len(ids) + max_new_tokens > capacity:
        raise RequestError(
            "max_new_tokens",
            f"{max_new_tokens} new tokens after a prompt of {len(ids)} tokens exceed {where}: at most {capacity - len(ids)} fit",
        )
    return ids


CUT_SLACK = 16  # tokens a cut through a text may add next to it, beyond the whole text's tokens over the same span


def _prompt_ids(prompt: str | Sequence[int], tokenizer, limit: int | None, special_tokens: bool = True) -> list[int] | None:
    """A prompt's token ids; None for a text found to hold more than `limit` tokens before all of it was tokenized."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if tokenizer is None:
        raise RequestError("prompt", "a text prompt needs the target's tokenizer; pass token ids instead")
    if limit is None:
        return tokenizer.encode(prompt, verbose=False, add_special_tokens=special_tokens)
    cut = 4 * limit  # characters: most texts hold fewer tokens than this, and are tokenized once, whole
    while True:
        ids = tokenizer.encode(prompt[:cut], verbose=False, add_special_tokens=special_tokens)
        if cut >= len(prompt):
            return ids
        if len(ids) > limit + CUT_SLACK:
            return None
        cut *= 2


def _checked_ids(ids: list[int], vocab_size: int) -> list[int]:
    if not ids:
        raise RequestError("prompt", "the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def eos_token_ids(generation_config, tokenizer) -> frozenset[int]:
    """End-of-sequence ids from a generation config, else from the tokenizer; empty when neither names one."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
