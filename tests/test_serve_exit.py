"""`eyas serve` as a supervisor sees it: eyas's own ports are bound to loopback, and when its coordinator
dies the command exits non-zero with one line saying why (instead of hanging with nothing listening).

One `eyas serve` subprocess with its embedded Ray; sockets are read from /proc (Linux).
"""

import ipaddress
import os
import signal
import socket
from pathlib import Path

import pytest
from tests.helpers.servicekit import build_models, start_serve

from eyas.client.client import Client

pytestmark = [
    pytest.mark.slow,  # `eyas serve` in subprocesses, each with its own Ray
    pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from /proc"),
]


def listening() -> dict[int, tuple[str, int]]:
    """Socket inode -> (bound address, port) of every TCP socket listening on this machine."""
    out = {}
    for name, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(name).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            host, port = fields[1].split(":")
            raw = bytes.fromhex(host)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # /proc writes 32-bit words little-endian
            ip = ipaddress.ip_address(raw)
            out[int(fields[9])] = (str(getattr(ip, "ipv4_mapped", None) or ip), int(port, 16))  # ::ffff:a.b.c.d as a.b.c.d
    return out


def owner_of(port: int) -> int:
    """The pid of the process listening on `port`."""
    inodes = {inode for inode, (_, p) in listening().items() if p == port}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any(link.startswith("socket:[") and int(link[8:-1]) in inodes for link in links):
            return int(pid)
    raise AssertionError(f"nothing listens on port {port}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-exit")
    serve = start_serve(root, *build_models(root), service={"metrics_port": 0})
    proc = serve.proc
    yield {"address": serve.address, "proc": proc, "log": serve.log}
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=60)


def test_eyas_ports_are_bound_to_loopback(served):
    with Client(served["address"]) as client:
        status = client.status()
    addresses = [served["address"], status["metrics_address"]] + [w["address"] for p in status["pools"] for w in p["workers"]]
    bound = {port: host for host, port in listening().values()}
    for address in addresses:
        port = int(address.rsplit(":", 1)[1])
        assert ipaddress.ip_address(bound[port]).is_loopback, f"{address} listens on {bound[port]}"


def test_serve_exits_with_one_line_when_its_coordinator_dies(served):
    proc = served["proc"]
    coordinator = owner_of(int(served["address"].rsplit(":", 1)[1]))
    assert coordinator != proc.pid
    os.kill(coordinator, signal.SIGKILL)
    assert proc.wait(timeout=120) == 1
    errors = [line for line in served["log"].read_text().splitlines() if line.startswith("eyas serve: error")]
    assert len(errors) == 1 and errors[0].startswith("eyas serve: error: the coordinator died"), errors
