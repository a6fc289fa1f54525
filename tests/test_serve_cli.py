"""`eyas serve` end to end: a subprocess with an embedded Ray instance, its ready line, the client and the CLI.

The service is configured with a shared token, so the test also shows that a call without it is refused. Its
embedded Ray takes the default logical CPUs (twice what its two workers reserve, or the machine's cores) and
its own Ray token from a file; every Ray server listens on loopback only.
"""

import ipaddress
import json
import os
import re
import secrets
import signal
import subprocess
import sys

import grpc
import psutil
import pytest
from tests.helpers.servicekit import EYAS, TREE, build_models, engine_outputs, start_serve, wait_until

from eyas import Engine
from eyas.client.client import Client, EyasError
from eyas.cluster import rayenv

pytestmark = pytest.mark.slow  # `eyas serve` in subprocesses, each with its own Ray

TOKEN = "serve-test-token"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target, drafter = build_models(root)
    (root / "ray_token").write_text(secrets.token_hex(32))
    env = {"RAY_AUTH_TOKEN_PATH": str(root / "ray_token")}
    serve = start_serve(root, target, drafter, env=env, network={"token": TOKEN}, ray={"num_cpus": None})
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
    assert re.search(r"  coordinator rss [1-9]\d* MiB$", status.stdout.splitlines()[0]), status.stdout  # its own resident memory
    ray_line = status.stdout.splitlines()[-1]
    assert re.fullmatch(r"ray: (\S+:\d+) \(`ray status --address \1`\)", ray_line), ray_line
    assert "ray: an embedded Ray instance at " + ray_line.split()[1] in (served["root"] / "serve.log").read_text()

    proc = subprocess.Popen([*EYAS, "status", "--server", served["address"], "--token", TOKEN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # as `eyas status | head -0` would
    assert proc.wait(timeout=120) == 141
    assert proc.stderr.read() == ""


def ray_client(gcs: str, **env: str) -> subprocess.Popen:
    """A fresh process connecting to the Ray cluster at `gcs` as a driver on its loopback node, with `env` for Ray's
    token settings only."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {rayenv.SINGLE_NODE: "0"}
    code = f"import ray; ray.init(address={gcs!r}, logging_level='error'); print(ray.cluster_resources()['CPU'])"
    return subprocess.Popen([sys.executable, "-c", code], env={**clean, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_embedded_ray_listens_on_loopback_only_and_refuses_a_client_without_its_token(served):
    serve = psutil.Process(served["proc"].pid)
    session = json.loads(eyas("status", "--server", served["address"], "--token", TOKEN, "--json").stdout)["ray_address"]
    listening = {
        (c.laddr.ip, c.laddr.port, p.name())
        for p in [serve, *serve.children(recursive=True)]
        for c in p.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }
    assert session.split(":")[0] == "127.0.0.1" and len(listening) >= 5, listening  # GCS, raylet, agents, workers, front door
    assert all(ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback for ip, _, _ in listening), listening
    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(served["root"] / "ray_token")}
    clients = {
        "without a token": ray_client(session),
        "with a wrong token": ray_client(session, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64),
        "with the token": ray_client(session, **token),
    }
    done = {}
    for name, proc in clients.items():
        out, err = proc.communicate(timeout=120)
        done[name] = (proc.returncode, out, err)
    for name in ("without a token", "with a wrong token"):
        code, out, err = done[name]
        assert code != 0 and "InvalidAuthToken" in err and out == "", (name, err[-2000:])
    assert done["with the token"][0] == 0, done["with the token"][2][-2000:]
    with Client(served["address"], token=TOKEN) as client:  # eyas still serves
        assert client.generate([5, 17, 33], max_new_tokens=8).token_ids == served["engine"].generate([5, 17, 33], max_new_tokens=8).token_ids


def test_joining_a_token_cluster_without_its_token_is_refused_in_one_line(served):
    gcs = json.loads(eyas("status", "--server", served["address"], "--token", TOKEN, "--json").stdout)["ray_address"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    done = subprocess.run([*EYAS, "serve", "--address", gcs, "--config", str(served["root"] / "service.yaml"), "--port", "0"],
                          capture_output=True, text=True, timeout=120, env=clean)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"eyas serve: error: ray: the Ray cluster at {gcs} requires its token: set RAY_AUTH_MODE=token and the token "
        "(RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN; docs/deploy.md)"
    )


def test_the_readme_scaling_works_on_the_embedded_default(served):
    done = eyas("scale", "--draft", "2", "--server", served["address"], "--token", TOKEN)
    assert done.returncode == 0, done.stderr
    with Client(served["address"], token=TOKEN) as client:
        status = client.scale(draft=2, target=1)
        assert [(p["name"], p["size"], [w["state"] for w in p["workers"]]) for p in status["pools"]] == [
            ("draft", 2, ["ready", "ready"]), ("target", 1, ["ready"])]
        assert client.generate([5, 17, 33], max_new_tokens=8).token_ids == served["engine"].generate([5, 17, 33], max_new_tokens=8).token_ids
        status = client.scale(draft=1)
    assert wait_until(lambda: len(json.loads(eyas("status", "--server", served["address"], "--token", TOKEN, "--json").stdout)["pools"][0]["workers"]) == 1,
                      120, "the retired draft worker to go")


def test_a_scale_the_cluster_can_never_hold_fails_at_once_naming_what_is_missing(served):
    done = eyas("scale", "--draft", "250", "--server", served["address"], "--token", TOKEN)
    assert done.returncode == 1
    error = done.stderr.splitlines()[-1]
    assert error.startswith("eyas scale: error: RESOURCE_EXHAUSTED: pools: pools.draft: 249 more worker(s) of 1 CPU need 249 CPU;"), error
    assert re.search(r"the cluster has (\d+) CPU in all, 2 CPU held by eyas-draft-0-\w+, eyas-target-0-\w+: (\d+) CPU missing", error), error
    status = json.loads(eyas("status", "--server", served["address"], "--token", TOKEN, "--json").stdout)
    assert [(p["name"], p["size"], len(p["workers"])) for p in status["pools"]] == [("draft", 1, 1), ("target", 1, 1)]


def test_a_second_serve_on_the_same_port_is_refused_naming_it(served):
    port = served["address"].rsplit(":", 1)[1]
    done = eyas("serve", "--config", str(served["root"] / "service.yaml"), "--port", port)
    assert done.returncode == 1 and done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"eyas serve: error: port: 127.0.0.1:{port} is in use (another eyas serve?); choose another with --port"], done.stderr
    assert "Traceback" not in done.stderr


def test_a_lost_worker_is_replaced_and_says_so_on_stderr_only(served):
    def draft_workers():
        status = json.loads(eyas("status", "--server", served["address"], "--token", TOKEN, "--json").stdout)
        return [w for w in status["pools"][0]["workers"] if w["state"] == "ready"]

    victim = draft_workers()[0]["pid"]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: [w["pid"] for w in draft_workers()] not in ([], [victim]), 180, "a new draft worker")
    with Client(served["address"], token=TOKEN) as client:
        assert client.generate([5, 17, 33], max_new_tokens=8).token_ids == served["engine"].generate([5, 17, 33], max_new_tokens=8).token_ids
    assert "eyas serve: pools.draft:" in (served["root"] / "serve.log").read_text()


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
