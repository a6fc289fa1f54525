"""The `eyas` command line without a service: light start, version, one exit status per kind of error.

Every command runs in its own process, as a user runs it.
"""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import yaml
from tests.helpers.servicekit import EYAS, TREE, build_models, cli_in_fresh_process, free_port
from tests.helpers.tiny import make_drafter, make_target

from eyas import Engine
from eyas.actors.config import ConfigError, ServiceConfig
from eyas.cluster.service import Service
from eyas.client.cli import build_parser, read_prompt

def eyas(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*EYAS, *args], capture_output=True, text=True, timeout=120, env={**os.environ, **env})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = make_target(root / "target")
    return target, make_drafter(root / "eagle1", target, "eagle1")


@pytest.mark.parametrize("argv", [["--help"], ["status", "--help"]])
def test_help_imports_neither_torch_nor_transformers(argv):
    done, status, loaded = cli_in_fresh_process(argv)
    assert (status, loaded) == (0, []), done.stderr


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
def test_serve_refuses_a_busy_port_before_loading_anything(host, tmp_path):
    config = tmp_path / "service.yaml"
    config.write_text(f"network: {{host: {host}, token: t}}\n")
    with socket.socket() as busy:
        busy.bind((host, 0))
        busy.listen()
        port = busy.getsockname()[1]
        done, status, loaded = cli_in_fresh_process(["serve", "--config", str(config), "--port", str(port)])
    assert (status, loaded) == (1, []), done.stderr
    assert done.stderr == f"eyas serve: error: port: {host}:{port} is in use (another eyas serve?); choose another with --port\n"


def test_version_names_the_installed_package():
    done = eyas("--version")
    assert (done.returncode, done.stdout.split()[0]) == (0, "eyas")


def test_a_missing_target_is_bad_input_locally_and_through_the_service(tmp_path):
    missing = str(tmp_path / "no-such-model")
    local = eyas("generate", "--local", "--target", missing, "--prompt", "x")
    served = eyas("generate", "--target", missing, "--prompt", "x", EYAS_SERVER=f"127.0.0.1:{free_port()}")
    for done in (local, served):
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and "Errno" not in done.stderr
        assert f"{missing} is not a model directory" in done.stderr.splitlines()[-1]
    assert "starting an embedded one" in served.stderr


def test_a_target_given_as_drafter_is_named_as_such_in_one_line_in_process_and_in_the_service(models, tmp_path):
    target, _ = models
    tied = make_target(tmp_path / "tied", tie_word_embeddings=True)  # no lm_head.weight of its own, as the demo target
    done = eyas("generate", "--local", "--target", str(target), "--drafter", str(tied), "--prompt", "x")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"eyas generate: error: drafter checkpoint {tied}: this is a target model (a full causal LM with model.layers.*), not a drafter"]
    config = ServiceConfig.from_dict({"models": {"target": str(target), "drafter": str(target)}})
    with pytest.raises(ConfigError, match=f"^models.drafter: drafter checkpoint {target}: this is a target model .*, not a drafter$"):
        Service(config, port=0).start()  # refused before Ray starts or is joined


def test_an_embedded_ray_without_token_authentication_is_refused_before_it_starts(models, tmp_path):
    target, drafter = models
    config = tmp_path / "service.yaml"
    config.write_text(yaml.safe_dump({"models": {"target": str(target), "drafter": str(drafter)}}))
    done = eyas("serve", "--config", str(config), "--port", "0", "--http-port", "0", RAY_AUTH_MODE="disabled")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "eyas serve: error: ray: RAY_AUTH_MODE=disabled would start Ray without token authentication: anyone who reaches "
        "its ports can run code in it; use token authentication (docs/deploy.md) or allow it with --allow-insecure-ray"
    )
    assert "ray: an embedded Ray instance" not in done.stderr  # refused before Ray started


@pytest.mark.slow
def test_joining_a_ray_cluster_without_token_authentication_needs_allow_insecure_ray(tmp_path):
    target, drafter = build_models(tmp_path)
    config = tmp_path / "service.yaml"
    config.write_text(yaml.safe_dump({"models": {"target": str(target), "drafter": str(drafter)}, "tree": TREE}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_AUTH_MODE": "disabled"}
    code = "import sys, ray; ray.init(num_cpus=2, include_dashboard=False); print(ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read()"
    open_ray = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    joined = []
    try:
        gcs = open_ray.stdout.readline().strip()
        serve = [*EYAS, "serve", "--address", gcs, "--config", str(config), "--port", "0", "--http-port", "0"]
        refused = subprocess.run(serve, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.splitlines()[-1].startswith(f"eyas serve: error: ray: the Ray cluster at {gcs} takes calls without a token: ")
        joined.append(subprocess.Popen([*serve, "--allow-insecure-ray"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        assert joined[0].stdout.readline().startswith("eyas ready at 127.0.0.1:")
        joined[0].send_signal(signal.SIGTERM)
        assert joined[0].wait(timeout=120) == 0
        warning = f"eyas serve: ray: warning: the Ray cluster at {gcs} takes calls without a token: anyone who reaches its ports can run code in it (allowed by --allow-insecure-ray)"
        assert warning in joined[0].stderr.read().splitlines()
    finally:
        for proc in joined:
            if proc.poll() is None:
                proc.kill()
        open_ray.communicate(timeout=60)  # end of input: the cluster's driver shuts it down


def test_no_service_is_a_failure_and_a_bad_value_is_bad_input():
    address = f"127.0.0.1:{free_port()}"
    down = eyas("status", "--server", address)
    assert down.returncode == 1 and down.stderr.count("\n") == 1
    assert f"no eyas service answers at {address}" in down.stderr
    assert eyas("scale", "--server", address).returncode == 2  # neither --draft nor --target
    assert eyas("generate", "--no-such-flag").returncode == 2



def test_a_prompt_comes_from_a_file_or_standard_input_exactly(tmp_path):
    target, drafter = build_models(tmp_path)
    text = "w5 w17 w33\n"
    done = subprocess.run(
        [*EYAS, "generate", "--local", "--target", str(target), "--drafter", str(drafter), "--json", "--max-new-tokens", "6",
         "--tree-width", "2", "--depth", "2", "--budget", "4", "--prompt-file", "-"],
        input=text, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    reference = Engine.from_pretrained(target, drafter, tree={"width": 2, "depth": 2, "budget": 4}).generate(text, max_new_tokens=6)
    assert (record["prompt"], record["token_ids"]) == (text, reference.token_ids)
    (tmp_path / "prompt.txt").write_text(text)
    assert read_prompt(str(tmp_path / "prompt.txt")) == text
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match=f"^--prompt-file: {tmp_path / 'latin1.txt'} is not UTF-8 \\(byte 3\\)$"):
        read_prompt(str(tmp_path / "latin1.txt"))
    with pytest.raises(SystemExit) as usage:
        build_parser().parse_args(["generate", "--prompt", "x", "--prompt-file", "-"])  # one or the other
    assert usage.value.code == 2


def test_top_k_means_sampling_only_and_the_old_tree_names_are_refused(tmp_path):
    done = eyas("generate", "--local", "--top-k", "4", "--prompt", "x")
    assert done.returncode == 2
    assert done.stderr.strip().endswith("the tree's expansion width is --tree-width, sampling top-k is --sample-top-k")
    config = tmp_path / "old.yaml"
    config.write_text("tree:\n  top_k: 4\n")
    done = eyas("serve", "--config", str(config), "--port", "0", "--http-port", "0")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().endswith("tree.top_k: the tree's expansion width is now called width (top_k is sampling top-k only)")
