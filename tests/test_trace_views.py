"""Seeing traces: `eyas trace show` (summary, one round's tree), `--html` in a real headless browser, `--png`,
and `eyas trace diff`.

The page is opened in Debian's chromium. Without it the page test is skipped, naming how to run it;
.ci/run installs chromium and sets EYAS_REQUIRE_BROWSER=1, under which a missing browser fails the test.
"""

import os
import re
import shutil
import subprocess

import pytest
from tests.helpers.servicekit import TREE, build_models, cli_in_fresh_process

from eyas import Engine, wire
from eyas.client.cli import main
from eyas.client.trace_png import draw_charts
from eyas.trace import TraceWriter, read_trace
from eyas.trace.format import encode
from eyas.trace.messages import decode_round
from eyas.trace.summary import Summary
from eyas.v1 import round_pb2 as pb

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("trace-views")
    target, drafter = build_models(root)
    engine = Engine.from_pretrained(target, drafter, tree=TREE)
    path = root / "run.trace"
    engine.generate("w5 w17 w33 w8", max_new_tokens=10, trace=path)
    engine.generate([4, 40, 20], max_new_tokens=10, temperature=0.9, seed=7, trace=path)
    return path, target


def test_trace_show_prints_the_summary_and_a_round_as_an_indented_tree(recorded, capsys):
    path, target = recorded
    assert main(["trace", "show", str(path), "--round", "2", "--target", str(target)]) == 0
    out = capsys.readouterr().out
    headings = ("2 requests", "acceptance length", "accepted length", "acceptance by depth", "draft confidence against observed")
    assert all(heading in out for heading in headings)
    assert re.search(r"req-0 +prompt 4 tokens, \d+ rounds, 10 tokens, length", out)
    tree, decision, _, _ = decode_round(read_trace(path).requests[0].rounds[2])
    nodes = re.findall(r"([* ])\[(\d+)\] ('w\d+')  (\d\.\d{3}) / (\d\.\d{3})", out)
    assert sorted(int(row) for _, row, *_ in nodes) == list(range(tree.num_rows))
    assert {int(row) for mark, row, *_ in nodes if mark == "*"} == set(decision.accepted_rows)
    assert "round 2 (version 2)" in out and "frontier token" in out


@pytest.mark.parametrize("command", [["show", "{trace}", "--round", "1", "--target", "{target}"], ["check", "{trace}"],
                                     ["diff", "{trace}", "{trace}"]], ids=["show", "check", "diff"])
def test_trace_commands_load_neither_torch_nor_transformers(recorded, command):
    """The trace tools decode and check rounds with the torch-free half of the tree contract (eyas.treerows), so they
    start in well under a second; they must still do their job (exit 0 and print the round, the checks, the diff)."""
    path, target = recorded
    argv = ["trace", *(a.format(trace=path, target=target) for a in command)]
    done, status, loaded = cli_in_fresh_process(argv)
    assert (status, loaded) == (0, []), done.stderr
    assert {"show": "round 1 (version 1)", "check": "all invariants hold", "diff": "identical"}[command[0]] in done.stdout.lower()


def test_replay_says_what_it_loads_then_shows_its_rounds_as_they_go(recorded, capsys):
    path, target = recorded
    rounds = sum(len(r.rounds) for r in read_trace(path).requests)
    assert main(["replay", str(path), "--target", str(target)]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == f"eyas replay: 2 request(s), {rounds} round(s); loading {target}"
    assert "eyas replay: 100%" in err and f"{rounds}/{rounds}" in err
    assert out.splitlines()[-1].startswith("identical")


def test_trace_show_names_a_request_that_is_not_there(recorded, capsys):
    path, _ = recorded
    assert main(["trace", "show", str(path), "--request", "req-1"]) == 0
    assert "1 requests" in capsys.readouterr().out
    assert main(["trace", "show", str(path), "--request", "nope"]) == 2
    assert "no request 'nope'" in capsys.readouterr().err


def test_trace_diff_names_the_first_differing_round_and_node(recorded, tmp_path, capsys):
    path, _ = recorded
    assert main(["trace", "diff", str(path), str(path)]) == 0
    assert capsys.readouterr().out.startswith("identical: 2 requests")
    trace = read_trace(path)
    record = trace.requests[1].rounds[4]
    msg = pb.FlattenedTree.FromString(record.tree)
    tree = wire.tree_from_proto(msg)
    siblings = {int(t) for t in tree.tokens[tree.parents == tree.parents[5]]}
    tree.tokens[5] = next(t for t in range(3, 96) if t not in siblings)
    record.tree = wire.tree_to_proto(tree, msg.ref).SerializeToString()
    other = tmp_path / "other.trace"
    with TraceWriter(other) as writer:
        writer.write(b"".join(encode(r) for r in trace.records))
    assert main(["trace", "diff", str(path), str(other)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("first difference: request 2 (A: req-1, B: req-1), round 4: draft tree at node 5: A has token")


REQUIRE_BROWSER = "EYAS_REQUIRE_BROWSER"  # set (as .ci/run does): a missing browser fails the page test


def chromium() -> str:
    """A headless-capable chromium on PATH; without one the page test is skipped, or fails where it must run."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    how = "install Debian's chromium (apt-get install -y chromium) to run it"
    if os.environ.get(REQUIRE_BROWSER):
        pytest.fail(f"chromium is not installed and {REQUIRE_BROWSER} is set: {how}")
    pytest.skip(f"chromium is not installed: {how} (.ci/run installs it and sets {REQUIRE_BROWSER}=1, so there it runs)")


@pytest.mark.slow  # a real browser
def test_the_html_page_draws_every_node_in_a_real_browser(recorded, tmp_path):
    path, target = recorded
    page = tmp_path / "trace.html"
    assert main(["trace", "show", str(path), "--html", str(page), "--target", str(target)]) == 0
    html = page.read_text()
    assert not re.search(r"""(src|href)\s*=|@import|url\(""", html), "the page is self-contained"
    requests = read_trace(path).requests
    expected = sum(decode_round(rnd)[0].num_rows for r in requests for rnd in r.rounds)
    rounds = sum(len(r.rounds) for r in requests)
    run = subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    dom = run.stdout
    assert f'data-rendered-nodes="{expected}"' in dom, f"chromium exit {run.returncode}: {run.stderr[-2000:]}"
    assert f'data-rendered-rounds="{rounds}"' in dom
    assert len(re.findall(r'<g class="node', dom)) == expected
    assert len(re.findall(r'<g class="node accepted', dom)) == sum(
        len(decode_round(rnd)[1].accepted_rows) for r in requests for rnd in r.rounds
    )
    assert dom.count('<svg width=') >= rounds + 3, "one picture per round, plus the three charts"


def test_the_png_holds_the_acceptance_and_calibration_charts(recorded, tmp_path):
    path, _ = recorded
    png = tmp_path / "charts.png"
    assert main(["trace", "show", str(path), "--png", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_every_count_label_of_the_calibration_chart_lies_inside_it():
    summary = Summary(requests=1, rounds=4, tokens=9, offered=[4, 4, 3], accepted_at=[4, 3, 1])
    corners = [(0.01, 0.0, 1200), (0.5, 0.5, 7), (0.99, 1.0, 31000), (0.99, 0.02, 900), (0.05, 1.0, 45)]  # confidence, acceptance, nodes
    for bucket, (confidence, acceptance, nodes) in zip(summary.calibration[::2], corners):
        bucket.nodes, bucket.accepted, bucket.confidence = nodes, round(acceptance * nodes), confidence * nodes
    fig = draw_charts("edges", summary)
    fig.canvas.draw()
    calib = fig.axes[1]
    inside = calib.get_window_extent()
    labels = {text.get_text(): text.get_window_extent() for text in calib.texts}
    assert sorted(labels) == sorted(str(n) for _, _, n in corners)
    for label, box in labels.items():
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, (label, box, inside)

