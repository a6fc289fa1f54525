"""`eyas serve` end to end: a subprocess with an embedded Ray instance, its ready line, the client and the CLI.

The service is configured with a shared token, so the test also shows that a call without it is refused.
"""

import json
import queue
import re
import signal
import subprocess
import sys
import threading

import grpc
import pytest
import yaml
from servicekit import TREE, build_models, engine_outputs

from eyas import Engine
from eyas.client.client import Client, EyasError

EYAS = [sys.executable, "-m", "eyas.client.cli"]
TOKEN = "serve-test-token"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target, drafter = build_models(root)
    config = {
        "models": {"target": str(target), "drafter": str(drafter)},
        "tree": TREE,
        "network": {"token": TOKEN},
        "ray": {"num_cpus": 2},
    }
    (root / "service.yaml").write_text(yaml.safe_dump(config))
    with (root / "serve.log").open("w") as log:
        proc = subprocess.Popen([*EYAS, "serve", "--config", str(root / "service.yaml"), "--port", "0"], stdout=subprocess.PIPE, stderr=log, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] and lines.put(None), daemon=True).start()
    try:
        ready = lines.get(timeout=240)
    except queue.Empty:
        proc.kill()
        pytest.fail(f"eyas serve printed nothing within 240s; log: {(root / 'serve.log').read_text()[-2000:]}")
    match = re.fullmatch(r"eyas ready at (127\.0\.0\.1:\d+)\n", ready or "")
    assert match, f"unexpected ready line {ready!r}; log: {(root / 'serve.log').read_text()[-2000:]}"
    yield {"address": match.group(1), "proc": proc, "lines": lines, "root": root, "engine": Engine.from_pretrained(target, drafter, tree=TREE)}
    if proc.poll() is None:
        proc.kill()


def eyas(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*EYAS, *args], capture_output=True, text=True, timeout=120)


def test_a_call_without_the_shared_token_is_refused(served):
    with Client(served["address"], token="") as client, pytest.raises(EyasError) as err:
        client.health()
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED.name


def test_client_and_cli_talk_to_the_served_front_door(served):
    address, engine = served["address"], served["engine"]
    with Client(address, token=TOKEN) as client:
        result = client.generate([5, 17, 33, 8, 9], max_new_tokens=16)
    assert result.token_ids == engine.generate([5, 17, 33, 8, 9], max_new_tokens=16).token_ids

    done = eyas("generate", "--server", address, "--token", TOKEN, "--prompt", "w5 w17 w33", "--max-new-tokens", "12", "--json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["token_ids"] == engine.generate("w5 w17 w33", max_new_tokens=12).token_ids

    status = eyas("status", "--server", address, "--token", TOKEN, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["completed"] == 2

    source, out = served["root"] / "job.jsonl", served["root"] / "out.jsonl"
    source.write_text("".join(json.dumps({"id": str(i), "prompt": [5 + i, 9], "max_new_tokens": 6}) + "\n" for i in range(3)))
    job = eyas("submit", str(source), str(out), "--server", address, "--token", TOKEN, "--no-progress")
    assert job.returncode == 0 and "3 written" in job.stderr, job.stderr
    results = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert [results[str(i)] for i in range(3)] == engine_outputs(engine, [[5 + i, 9] for i in range(3)], [6] * 3)


def test_serve_stops_cleanly_on_interrupt_after_printing_one_line(served):
    proc = served["proc"]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0
    assert served["lines"].get(timeout=10) is None, "eyas serve printed more than its ready line"
