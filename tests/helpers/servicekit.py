"""Shared setup of the service tests: tiny models on disk, service configs, references, waiting on conditions."""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from .tiny import add_tokenizer, make_drafter, make_target
from transformers import AutoModelForCausalLM

from eyas import Engine
from eyas.actors.config import ServiceConfig

TREE = {"width": 4, "depth": 4, "budget": 12}
EYAS = [sys.executable, "-m", "eyas.client.cli"]
EOS = 2  # the tiny tokenizer's end-of-sequence token


def cli_in_fresh_process(argv: list[str]) -> tuple[subprocess.CompletedProcess, int, list[str]]:
    """Run `eyas argv` in a fresh interpreter: the process, the command's exit status, and which of torch,
    transformers and ray it loaded."""
    probe = (
        "import json, sys\n"
        "from eyas.client.cli import main\n"
        "try:\n"
        f"    status = main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    status = exc.code\n"
        "print(json.dumps([status, sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules)]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    status, loaded = json.loads(done.stdout.splitlines()[-1]) if done.stdout else (None, None)
    return done, status, loaded


def build_models(root: Path, kind: str = "eagle1") -> tuple[Path, Path]:
    """A tiny Llama target with a word-level tokenizer and a random drafter of `kind`."""
    target = make_target(root / "target")
    add_tokenizer(target)
    return target, make_drafter(root / kind, target, kind)


def service_config(target: Path, drafter: Path, draft: int = 1, targets: int = 1, **sections) -> ServiceConfig:
    """A config for the tiny models with the given pool sizes; `sections` override whole YAML sections. No HTTP
    endpoint unless `network` sets one (tests never count on a fixed port being free)."""
    data = {
        "models": {"target": str(target), "drafter": str(drafter)},
        "tree": TREE,
        "pools": {"draft": {"replicas": draft}, "target": {"replicas": targets}},
        "service": {"ready_timeout_s": 120, "rpc_timeout_s": 60},
    }
    data.update(sections)
    data["network"] = {"http_port": 0, **(data.get("network") or {})}
    return ServiceConfig.from_dict(data)


def hf_greedy(model_dir: Path, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Hugging Face greedy continuations, cut after the first EOS (where eyas stops)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    out = []
    for prompt, n in zip(prompts, lengths):
        ids = torch.tensor([prompt])
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()
        out.append(tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens)
    return out


def engine_outputs(engine: Engine, prompts: list[list[int]], lengths: list[int], **options) -> list[list[int]]:
    return [engine.generate(p, max_new_tokens=n, **options).token_ids for p, n in zip(prompts, lengths)]


def with_unknown_field(msg, number: int) -> bytes:
    """`msg`'s bytes with a varint field `number` (value 1) appended, a field its schema does not define."""
    tag, key = number << 3, b""
    while tag > 0x7F:
        key, tag = key + bytes([tag & 0x7F | 0x80]), tag >> 7
    return msg.SerializeToString() + key + bytes([tag, 1])


def wait_until(condition: Callable[[], object], timeout: float, what: str, poll: float = 0.1) -> object:
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def stream_while(
    client, prompts: list[list[int]], length: int, action: Callable[[], object], join_s: float = 180, options: list[dict] | None = None
) -> tuple[list, list, object]:
    """Stream every prompt (with its sampling `options`); once each has committed a round, run `action` (e.g. kill
    a worker); return each request's tokens, its final chunk, and what `action` returned."""
    started = [threading.Event() for _ in prompts]
    outputs, finals = [None] * len(prompts), [None] * len(prompts)

    def run(i):
        tokens = []
        for chunk in client.stream(prompts[i], max_new_tokens=length, **(options[i] if options else {})):
            tokens += chunk.token_ids
            started[i].set()
        outputs[i], finals[i] = tokens, chunk

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    wait_until(lambda: all(e.is_set() for e in started), 60, "every request's first round")
    done = action()
    for t in threads:
        t.join(join_s)
    return outputs, finals, done


@dataclass
class Served:
    """An `eyas serve` subprocess that printed its ready line: its address, its later stdout lines, its stderr log."""

    proc: subprocess.Popen
    address: str
    lines: queue.Queue
    log: Path


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_serve(root: Path, target: Path, drafter: Path, env: dict[str, str] | None = None, **sections) -> Served:
    """Run `eyas serve` on the tiny models (2 Ray CPUs; `sections` add YAML sections, `env` environment variables)
    until it is ready; its HTTP endpoint is off unless `network` sets network.http_port."""
    config = {"models": {"target": str(target), "drafter": str(drafter)}, "tree": TREE, "ray": {"num_cpus": 2}, **sections}
    config["network"] = {"http_port": 0, **(config.get("network") or {})}
    (root / "service.yaml").write_text(yaml.safe_dump(config))
    log = root / "serve.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [*EYAS, "serve", "--config", str(root / "service.yaml"), "--port", "0"], stdout=subprocess.PIPE, stderr=stderr, text=True,
            env={**os.environ, **(env or {})},
        )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] and lines.put(None), daemon=True).start()
    try:
        ready = lines.get(timeout=240)
    except queue.Empty:
        proc.kill()
        raise AssertionError(f"eyas serve printed nothing within 240s; log: {log.read_text()[-2000:]}") from None
    match = re.fullmatch(r"eyas ready at (127\.0\.0\.1:\d+)\n", ready or "")
    assert match, f"unexpected ready line {ready!r}; log: {log.read_text()[-2000:]}"
    return Served(proc, match.group(1), lines, log)
