"""The OpenAI API's requests and responses, mapped onto the coordinator's requests (docs/http.md).

`parse_request` turns a decoded JSON body into a `Generation`: the options of `Coordinator.admit` and what
only HTTP has (n, streaming, the parameter names the client used). Only JSON types and the API's own
fields are checked here; every value the coordinator bounds (sampling ranges, stop strings, prompt
length, new tokens against the context) is checked once, by `admit`, and its error's field is renamed to
the parameter the client sent (`Generation.param`). `Reply` shapes the chunks the coordinator emits into
a response body or its stream chunks.
"""

from __future__ import annotations

import hashlib
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from jinja2 import TemplateError

from eyas.errors import RequestError

from .errors import status_of
from .job import Chunk
from .limits import MAX_CHOICES

COMPLETION_MAX_TOKENS = 16  # the OpenAI API's default max_tokens of /v1/completions
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
STATS = ("rounds", "target_forwards", "tokens", "mean_accept_length")  # the `eyas` extension of a finished choice
PARAMS = frozenset(
    {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
     "n", "stream", "stream_options", "ignore_eos", "return_token_ids"}
)
# Parameters of the OpenAI API (and vLLM's extensions) eyas does not implement: refused unless left at these values.
UNSUPPORTED = {
    "logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "suffix": ("",), "best_of": (1,), "logit_bias": ({},),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,), "min_tokens": (0,),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "response_format": ({"type": "text"},), "use_beam_search": (False,),
}
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error"}  # other 4xx: invalid_request_error, 5xx: server_error
JSON_TYPES = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "an array"), (dict, "an object"))


class ApiError(Exception):
    """A refusal as the OpenAI error object: HTTP status, message, the parameter concerned, and a code (the status
    the gRPC front door gives the same failure)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = "INVALID_ARGUMENT"):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def of(cls, exc: BaseException, param_of: Callable[[str], str | None] | None = None) -> "ApiError":
        """The error a failure maps to; an internal one says nothing of its cause (the service log has it)."""
        if isinstance(exc, ApiError):
            return exc
        code, field, details = status_of(exc)
        status = HTTP_STATUS.get(code, 500)
        if status == 500:
            return cls(500, "internal error (the service log has the details)", None, "INTERNAL")
        param = (param_of or request_param)(field)
        if param and param != field and details.startswith(f"{field}: "):
            details = f"{param}: {details[len(field) + 2 :]}"
        return cls(status, details, param, code.name)

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def request_param(field: str) -> str | None:
    """The request parameter an error's field names, or None for a field of the service's own."""
    name = field.split(".")[0].split("[")[0]
    return field if name in PARAMS or name in UNSUPPORTED else None


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `n > 1`: the request's own for choice 0, else the first 63 bits of
    SHA-256 of "{seed}:{index}" (docs/http.md#n)."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "big") >> 1


@dataclass(frozen=True)
class Generation:
    """One OpenAI request: the coordinator's options, and what only HTTP has."""

    kind: str  # "completion" or "chat"
    model: str | None
    prompt: str | list[int] | list[dict]  # text or token ids; chat: the messages, content flattened to text
    max_tokens: int | None  # None: up to the target's last position
    max_tokens_param: str
    sampling: dict
    stop: list[str]
    ignore_eos: bool
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool

    def options(self, index: int) -> dict:
        """`Coordinator.admit`'s options for choice `index`."""
        return dict(
            max_new_tokens=self.max_tokens,
            sampling={**self.sampling, "seed": choice_seed(self.sampling["seed"], index)},
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            special_tokens=self.kind != "chat",  # a chat template writes the special tokens it wants
        )

    def param(self, field: str) -> str | None:
        """The parameter of this request that a coordinator error's field concerns (its sampling options are
        parameters of their own over HTTP)."""
        renamed = {"max_new_tokens": self.max_tokens_param, "prompt": "messages" if self.kind == "chat" else "prompt"}
        return renamed.get(field) or request_param(field.removeprefix("sampling."))


def parse_request(kind: str, body: dict) -> Generation:
    """A /v1/completions ("completion") or /v1/chat/completions ("chat") body as a Generation; a wrong JSON type,
    a missing prompt or an unsupported parameter is a RequestError naming the parameter."""
    for name, neutral in UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise RequestError(name, "is not supported by this service (docs/http.md#parameters)")
    if kind == "chat":
        prompt = _messages(body.get("messages"))
        given = {name: _get(body, name, int) for name in ("max_completion_tokens", "max_tokens")}
        max_param = next((name for name, value in given.items() if value is not None), "max_completion_tokens")
        max_tokens = given[max_param]
    else:
        prompt = _prompt(body.get("prompt"))
        max_param, max_tokens = "max_tokens", _get(body, "max_tokens", int, COMPLETION_MAX_TOKENS)
    seed = _get(body, "seed", int)
    top_k = _get(body, "top_k", int, 0)
    sampling = {
        "temperature": _number(body, "temperature", 1.0),
        "top_p": _number(body, "top_p", 1.0),
        "top_k": 0 if top_k == -1 else top_k,  # -1: every token, as vLLM accepts
        "seed": secrets.randbelow(2**63) if seed is None else seed,
    }
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise RequestError("n", f"must be an integer in [1, {MAX_CHOICES}], got {n}")
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict)
    if options is not None and not stream:
        raise RequestError("stream_options", "is only allowed with stream: true")
    return Generation(
        kind=kind,
        model=_get(body, "model", str),
        prompt=prompt,
        max_tokens=max_tokens,
        max_tokens_param=max_param,
        sampling=sampling,
        stop=_stop(body.get("stop")),
        ignore_eos=_get(body, "ignore_eos", bool, False),
        n=n,
        stream=stream,
        include_usage=_get(options or {}, "include_usage", bool, False, "stream_options.include_usage"),
        return_token_ids=_get(body, "return_token_ids", bool, False),
    )


def render_chat(tokenizer: Any, messages: list[dict]) -> str:
    """The prompt text of a conversation, through the target tokenizer's chat template, with the assistant's turn opened."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("messages", "the target's tokenizer has no chat template; use /v1/completions")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as exc:
        raise RequestError("messages", f"the chat template refused the conversation: {exc}") from None


def _type_name(value: object) -> str:
    return next(name for kind, name in JSON_TYPES if isinstance(value, kind)) if value is not None else "null"


def _get(body: dict, name: str, kind: type, default: Any = None, param: str | None = None) -> Any:
    """body[name] when it is of JSON type `kind` (null: `default`), else a RequestError naming it."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise RequestError(param or name, f"must be {dict(JSON_TYPES)[kind]}, got {_type_name(value)}")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(name, f"must be a number, got {_type_name(value)}")
    try:
        return float(value)
    except OverflowError:
        raise RequestError(name, f"{value} is out of range") from None


def _prompt(value: object) -> str | list[int]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        raise RequestError("prompt", "several prompts in one request are not supported; send one request per prompt")
    what = "is required" if value is None else f"must be a string or an array of token ids, got {_type_name(value)}"
    raise RequestError("prompt", what)


def _stop(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise RequestError("stop", f"must be a string or an array of strings, got {_type_name(value)}")


def _messages(value: object) -> list[dict]:
    """Chat messages as {role, content} with text content (an array of text parts joined by newlines, as vLLM does)."""
    if not isinstance(value, list) or not value:
        raise RequestError("messages", f"must be a non-empty array of messages, got {_type_name(value)}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}]", f"must be an object with role and content, got {_type_name(message)}")
        role = _get(message, "role", str, param=f"messages[{i}].role")
        if role is None:
            raise RequestError(f"messages[{i}].role", "is required")
        messages.append({"role": role, "content": _content(message.get("content"), f"messages[{i}].content")})
    return messages


def _content(value: object, param: str) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
        return "\n".join(p["text"] for p in value)
    raise RequestError(param, "must be a string or an array of text parts ({type: text, text})")


@dataclass(frozen=True)
class ServedModel:
    """The model /v1/models lists and the requests name: the target (its directory's name) with its drafter."""

    name: str
    root: str
    drafter: str
    drafter_root: str
    manifest_id: str
    max_positions: int
    tokenizer: Any
    eos_texts: dict[int, str]  # each end-of-sequence token's text, dropped from the output as vLLM drops special tokens
    created: int

    @classmethod
    def of(
        cls, target: str, drafter: str, manifest_id: str, max_positions: int, tokenizer: Any, eos: frozenset[int], emulate: str | None = None
    ) -> "ServedModel":
        """The model of a service on these directories; an emulated one (no directories) is named after its profile."""
        texts = {t: tokenizer.decode([t]) for t in eos} if tokenizer is not None else {}
        names = (f"emulated-{Path(emulate).stem}", "emulated") if emulate else (Path(target).name, Path(drafter).name)
        return cls(names[0], target, names[1], drafter, manifest_id, max_positions, tokenizer, texts, int(time.time()))

    def card(self) -> dict:
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "eyas",
            "root": self.root,
            "parent": None,
            "max_model_len": self.max_positions,
            "eyas": {"drafter": self.drafter, "drafter_root": self.drafter_root, "manifest_id": self.manifest_id},
        }


class Choice:
    """One sample as the client sees it: its tokens, its text without the end-of-sequence token's and cut before a
    stop string; while it runs, the last characters that could begin a stop string are held back."""

    def __init__(self, index: int, stop: list[str], eos_texts: dict[int, str]):
        self.index = index
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.eos_texts = eos_texts
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.held = ""
        self.finish_reason: str | None = None
        self.stats: dict | None = None

    def add(self, chunk: Chunk) -> str:
        """Fold in one of the coordinator's chunks; returns the text it makes safe to show."""
        text = chunk.text
        if chunk.token_ids and chunk.token_ids[-1] in self.eos_texts:  # the last token: commit stops at an EOS
            text = text.removesuffix(self.eos_texts[chunk.token_ids[-1]])
        self.tokens += chunk.token_ids
        text, self.held = self.held + text, ""
        stop = min((i for i in map(text.find, self.stop) if i >= 0), default=-1)
        if stop >= 0:  # the round that completed a stop string is the request's last
            text, self.hold = text[:stop], 0
        elif self.hold and not chunk.finish_reason:
            cut = max(0, len(text) - self.hold)
            text, self.held = text[:cut], text[cut:]
        if chunk.finish_reason:
            self.finish_reason = FINISH_REASONS[chunk.finish_reason]
            self.stats = {key: chunk.stats[key] for key in STATS}
        self.text.append(text)
        return text


class Reply:
    """One request's response: the whole body, or its stream chunks, built from the chunks of its choices."""

    def __init__(self, gen: Generation, model: ServedModel):
        self.gen = gen
        self.model = model.name
        self.chat = gen.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        eos_texts = {} if gen.ignore_eos else model.eos_texts
        self.choices = [Choice(i, gen.stop, eos_texts) for i in range(gen.n)]
        self.prompt_tokens = 0

    @property
    def done(self) -> bool:
        return all(c.finish_reason for c in self.choices)

    def usage(self) -> dict:
        completion = sum(len(c.tokens) for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion, "total_tokens": self.prompt_tokens + completion}

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _entry(self, choice: Choice, text: str, tokens: list[int], chunk: bool) -> dict:
        if not self.chat:
            entry = {"index": choice.index, "text": text}
        elif chunk:
            entry = {"index": choice.index, "delta": {"content": text} if text or not choice.finish_reason else {}}
        else:
            entry = {"index": choice.index, "message": {"role": "assistant", "content": text}}
        entry.update(logprobs=None, finish_reason=choice.finish_reason)
        if self.gen.return_token_ids:
            entry["token_ids"] = tokens
        if choice.finish_reason:
            entry["eyas"] = choice.stats
        return entry

    def body(self) -> dict:
        """The response of a request that did not stream (every choice finished)."""
        entries = [self._entry(c, "".join(c.text), c.tokens, chunk=False) for c in self.choices]
        return {**self._envelope(entries, chunk=False), "usage": self.usage()}

    def chunk(self, index: int, item: Chunk) -> dict:
        """The stream chunk of one coordinator chunk of choice `index` (a round's tokens, or its finish)."""
        choice = self.choices[index]
        text = choice.add(item)
        return self._stream(self._entry(choice, text, item.token_ids, chunk=True))

    def role_chunk(self, index: int) -> dict:
        """A chat stream's first chunk of a choice: the assistant's role, as OpenAI and vLLM send it."""
        entry = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._stream(entry)

    def usage_chunk(self) -> dict:
        """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
        return {**self._envelope([], chunk=True), "usage": self.usage()}

    def _stream(self, entry: dict) -> dict:
        chunk = self._envelope([entry], chunk=True)
        if self.gen.include_usage:
            chunk["usage"] = None  # every chunk but the last, as the OpenAI API sends them
        return chunk
