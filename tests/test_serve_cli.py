"""`eyas serve` end to end: a subprocess with an embedded Ray instance, its ready line, the client and the CLI.

The service is configured with a shared token, so the test also shows that a call without it is refused. Its
embedded Ray has 2 CPUs and each of its two workers reserves one, so the cluster is full.
"""

import json
import os
import re
import signal
import subprocess

import grpc
import pytest
from tests.helpers.servicekit import EYAS, TREE, build_models, engine_outputs, start_serve

from eyas import Engine
from eyas.client.client import Client, EyasError

pytestmark = pytest.mark.slow  # `eyas serve` in subprocesses, each with its own Ray

TOKEN = "serve-test-token"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target, drafter = build_models(root)
    serve = start_serve(root, target, drafter, network={"token": TOKEN})
    proc = serve.proc
    yield {"address": serve.address, "proc": proc, "lines": serve.lines, "root": root, "engine": Engine.from_pretrained(target, drafter, tree=TREE)}
    if proc.poll() is None:
        proc.kill()


def eyas(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*EYAS, *args], capture_output=True, text=True, timeout=120, env={**os.environ, **env})


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

    lines = [{"id": "a", "prompt": [7, 9], "max_new_tokens": 6}, {"id": "big", "prompt": "w5 " * (5 << 18)}, {"id": "b", "prompt": [8, 9], "max_new_tokens": 6}]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))  # a 5 MB line between two good ones
    job = eyas("submit", str(source), str(out), "--server", address, "--token", TOKEN, "--no-progress")
    assert job.returncode == 2 and "2 written, 0 skipped (already done), 1 failed" in job.stderr, job.stderr
    assert "eyas submit: line 2 (id big): INVALID_ARGUMENT: prompt: the request is " in job.stderr
    assert "(service.max_request_bytes)" in job.stderr
    results = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert [results["a"], results["b"]] == engine_outputs(engine, [[7, 9], [8, 9]], [6] * 2)


def test_a_prompt_file_larger_than_the_service_takes_is_refused_naming_the_prompt(served):
    big = served["root"] / "big.txt"
    big.write_text("w5 " * (5 << 18))  # 3.9 MB: past any command line, past the front door's 1 MiB
    done = eyas("generate", "--server", served["address"], "--token", TOKEN, "--prompt-file", str(big))
    assert done.returncode == 2, done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("eyas generate: error: INVALID_ARGUMENT: prompt: the request is ") and error.endswith(
        f"over the service's limit of {1 << 20} (service.max_request_bytes)"), error


def test_generate_without_server_uses_the_service_at_the_default_address(served):
    done = eyas("generate", "--prompt", "w5 w17 w33", "--max-new-tokens", "12", "--json", EYAS_SERVER=served["address"], EYAS_TOKEN=TOKEN)
    assert done.returncode == 0, done.stderr
    assert f"using the eyas service at {served['address']}" in done.stderr
    assert json.loads(done.stdout)["token_ids"] == served["engine"].generate("w5 w17 w33", max_new_tokens=12).token_ids


def test_status_says_where_ray_is_and_survives_a_closed_pipe(served):
    status = eyas("status", "--server", served["address"], "--token", TOKEN)
    assert status.returncode == 0, status.stderr
    ray_line = status.stdout.splitlines()[-1]
    assert re.fullmatch(r"ray: (\S+:\d+) \(`ray status --address \1`\)", ray_line), ray_line
    assert "ray: an embedded Ray instance at " + ray_line.split()[1] in (served["root"] / "serve.log").read_text()

    proc = subprocess.Popen([*EYAS, "status", "--server", served["address"], "--token", TOKEN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # as `eyas status | head -0` would
    assert proc.wait(timeout=120) == 141
    assert proc.stderr.read() == ""


def test_a_scale_the_cluster_can_never_hold_fails_at_once_naming_what_is_missing(served):
    done = eyas("scale", "--draft", "2", "--server", served["address"], "--token", TOKEN)
    assert done.returncode == 1
    error = done.stderr.splitlines()[-1]
    assert error.startswith("eyas scale: error: RESOURCE_EXHAUSTED: pools: pools.draft: 1 more worker(s) of 1 CPU need 1 CPU;"), error
    assert re.search(r"the cluster has 2 CPU in all, 2 CPU held by eyas-draft-0-\w+, eyas-target-0-\w+: 1 CPU missing", error), error
    status = json.loads(eyas("status", "--server", served["address"], "--token", TOKEN, "--json").stdout)
    assert [(p["name"], p["size"], len(p["workers"])) for p in status["pools"]] == [("draft", 1, 1), ("target", 1, 1)]


def test_a_second_serve_on_the_same_port_is_refused_naming_it(served):
    port = served["address"].rsplit(":", 1)[1]
    done = eyas("serve", "--config", str(served["root"] / "service.yaml"), "--port", port)
    assert done.returncode == 1 and done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"eyas serve: error: port: 127.0.0.1:{port} is in use (another eyas serve?); choose another with --port"], done.stderr
    assert "Traceback" not in done.stderr


def test_serve_shows_its_progress_and_stops_cleanly_on_sigterm_after_printing_one_line(served):
    proc = served["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    assert served["lines"].get(timeout=10) is None, "eyas serve printed more than its ready line"
    log = (served["root"] / "serve.log").read_text()
    assert log.splitlines()[0] == "eyas serve: loading torch, transformers and Ray", log  # said before the long imports
    assert "Traceback" not in log and "Token authentication" not in log, log
    for progress in ("eyas serve: starting 1 draft and 1 target worker(s)", "eyas serve: pools.draft: draft-0 loading its models", "eyas serve: pools.target: target-0 ready at 127.0.0.1:"):
        assert progress in log, log
