"""`eyas trace show --html`: one self-contained page (no network) with every round's tree and the summary charts.

The trace's rounds are embedded as JSON; a small inline script draws each tree as an SVG (accepted
path highlighted, node details on hover) and the charts (acceptance by depth, calibration, accepted
length). When it has drawn everything it sets `data-rendered-nodes` on <body>.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from eyas.errors import WireError
from eyas.treerows import TreeError, check_decision, check_tree
from eyas.trace.compare import Label
from eyas.trace.invariants import UNBOUNDED_VOCAB
from eyas.trace.messages import decode_round
from eyas.trace.store import TracedRequest
from eyas.trace.summary import Summary

MAX_ROUNDS = 500

STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.6em; } h3 { font-size: 1em; margin: 1.2em 0 .3em; }
.charts { display: flex; flex-wrap: wrap; gap: 2em; }
.chart text, .tree text { font: 11px ui-monospace, monospace; }
.bar { fill: #6a8fd8; } .bar.conf { fill: #c8c8c8; } .axis { stroke: #888; } .diag { stroke: #d55; stroke-dasharray: 4 3; }
.edge { stroke: #bbb; fill: none; } .edge.accepted { stroke: #1a7f37; stroke-width: 2.5; }
.node circle { fill: #fff; stroke: #888; } .node.accepted circle { fill: #1a7f37; stroke: #1a7f37; }
.node:hover circle { stroke: #d55; stroke-width: 2; } .node .frontier { fill: #b35c00; }
#details { position: fixed; right: 1em; top: 1em; width: 20em; background: #fffbe6; border: 1px solid #e0c060;
  padding: .6em; font: 12px ui-monospace, monospace; white-space: pre-wrap; min-height: 3em; }
.meta { color: #555; }
"""

SCRIPT = r"""
const data = JSON.parse(document.getElementById('trace-data').textContent);
const NS = 'http://www.w3.org/2000/svg';
function el(name, attrs, parent) {
  const e = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}
function text(parent, x, y, s, anchor) {
  const t = el('text', {x: x, y: y, 'text-anchor': anchor || 'start'}, parent);
  t.textContent = s;
  return t;
}
const details = document.getElementById('details');
function bars(title, labels, values, extra, maxValue) {
  const w = Math.max(380, 40 + labels.length * 34), h = 190, svg = el('svg', {width: w + 20, height: h + 40, class: 'chart'});
  text(svg, 5, 14, title);
  const top = maxValue || Math.max(1e-9, ...values);
  el('line', {x1: 35, y1: h, x2: w, y2: h, class: 'axis'}, svg);
  labels.forEach((label, i) => {
    const x = 40 + i * 34, v = values[i], bh = (h - 30) * v / top;
    if (extra) {
      const ch = (h - 30) * extra[i] / top;
      el('rect', {x: x, y: h - ch, width: 14, height: ch, class: 'bar conf'}, svg);
    }
    el('rect', {x: x + (extra ? 15 : 0), y: h - bh, width: extra ? 14 : 26, height: bh, class: 'bar'}, svg);
    text(svg, x + 14, h + 14, label, 'middle');
    text(svg, x + 14, h - bh - 3, maxValue === 1 ? (100 * v).toFixed(0) + '%' : String(v), 'middle');
  });
  document.getElementById('charts').appendChild(svg);
}
const s = data.summary;
bars('acceptance by depth (share of rounds reaching the depth)', s.depths.map(d => d[0]),
     s.depths.map(d => d[1] ? d[2] / d[1] : 0), null, 1);
const tried = s.calibration.filter(b => b.nodes);
bars('calibration: mean draft confidence (grey) vs accepted share (blue), by confidence bucket',
     tried.map(b => b.low.toFixed(1)), tried.map(b => b.acceptance), tried.map(b => b.confidence), 1);
bars('accepted length (rounds)', s.accepted_lengths.map((_, k) => k), s.accepted_lengths);

let drawn = 0;
const DX = 150, DY = 24;
for (const round of data.rounds) {
  const section = document.createElement('section');
  const h = document.createElement('h3');
  h.textContent = `request ${round.request}, round ${round.round} (version ${round.version})`;
  const meta = document.createElement('div');
  meta.className = 'meta';
  meta.textContent = `${round.rows.length} rows on a prefix of ${round.prefix}; accepted ${round.accepted.length - 1} ` +
    `draft tokens, frontier ${round.frontier} (target p ${round.frontier_p.toFixed(3)}); emitted ${round.emitted.join(' ')}`;
  section.append(h, meta);
  const children = round.rows.map(() => []);
  round.rows.forEach((r, i) => { if (r.parent >= 0) children[r.parent].push(i); });
  for (const c of children) c.sort((a, b) => round.rows[b].draft_p - round.rows[a].draft_p || a - b);
  const y = new Array(round.rows.length);
  let slot = 0;
  (function place(i) {
    if (!children[i].length) { y[i] = slot++; return; }
    children[i].forEach(place);
    y[i] = (y[children[i][0]] + y[children[i][children[i].length - 1]]) / 2;
  })(0);
  const depth = Math.max(...round.rows.map(r => r.depth));
  const svg = el('svg', {width: (depth + 1) * DX + 160, height: slot * DY + 20, class: 'tree'}, section);
  const accepted = new Set(round.accepted);
  const pos = i => [20 + round.rows[i].depth * DX, 15 + y[i] * DY];
  round.rows.forEach((r, i) => {
    if (r.parent < 0) return;
    const [x1, y1] = pos(r.parent), [x2, y2] = pos(i);
    el('path', {d: `M${x1},${y1} C${x1 + DX / 2},${y1} ${x2 - DX / 2},${y2} ${x2},${y2}`,
                class: 'edge' + (accepted.has(i) ? ' accepted' : '')}, svg);
  });
  round.rows.forEach((r, i) => {
    const [x, yy] = pos(i);
    const g = el('g', {class: 'node' + (accepted.has(i) ? ' accepted' : ''), 'data-row': i}, svg);
    el('circle', {cx: x, cy: yy, r: 6}, g);
    text(g, x + 10, yy + 4, r.token);
    const info = `row ${i}  depth ${r.depth}  parent ${r.parent}\ntoken ${r.token}\ndraft confidence ${r.draft_p.toFixed(4)}\n` +
      `target probability ${r.target_p === null ? '?' : r.target_p.toFixed(4)}\n${accepted.has(i) ? 'accepted' : 'not accepted'}`;
    el('title', {}, g).textContent = info;
    g.addEventListener('mouseover', () => { details.textContent = info; });
    drawn++;
  });
  const last = round.accepted[round.accepted.length - 1], [fx, fy] = pos(last);
  text(svg, fx + 10, fy + 16, '→ ' + round.frontier).setAttribute('class', 'frontier');
  document.getElementById('rounds').appendChild(section);
}
document.body.dataset.renderedNodes = drawn;
document.body.dataset.renderedRounds = data.rounds.length;
"""


def page_data(requests: list[TracedRequest], summary: Summary, label: Label, max_rounds: int = MAX_ROUNDS) -> dict:
    """The JSON the page draws from: the summary and up to `max_rounds` well-formed rounds."""
    rounds = []
    for request in requests:
        for rnd in request.rounds:
            if len(rounds) >= max_rounds:
                break
            try:
                tree, decision, _, _ = decode_round(rnd)
                check_tree(tree, vocab_size=UNBOUNDED_VOCAB)
                check_decision(decision, tree, UNBOUNDED_VOCAB)
            except (TreeError, WireError):
                continue
            target = list(decision.token_probs) or [None] * tree.num_rows
            rows = [
                {"token": label(t), "parent": p, "depth": d, "draft_p": q, "target_p": target[i]}
                for i, (t, p, d, q) in enumerate(
                    zip(tree.tokens, tree.parents, tree.depths, tree.draft_probs)
                )
            ]
            rounds.append(
                {
                    "request": request.key,
                    "round": rnd.round,
                    "version": rnd.version,
                    "prefix": tree.prefix_len,
                    "rows": rows,
                    "accepted": list(decision.accepted_rows),
                    "frontier": label(decision.frontier_token),
                    "frontier_p": decision.frontier_prob,
                    "emitted": [label(t) for t in rnd.emitted],
                }
            )
    calibration = [
        {"low": b.low, "acceptance": b.acceptance, "confidence": b.mean_confidence, "nodes": b.nodes} for b in summary.calibration
    ]
    return {
        "summary": {
            "depths": summary.depth_acceptance(),
            "calibration": calibration,
            "accepted_lengths": summary.accepted_lengths,
        },
        "rounds": rounds,
    }


def write_html(out: str | Path, title: str, requests: list[TracedRequest], summary: Summary, label: Label) -> int:
    """Write the page; returns the number of tree nodes it will draw."""
    data = page_data(requests, summary, label)
    shown = len(data["rounds"])
    total = sum(len(r.rounds) for r in requests)
    note = f" (the first {shown} of {total} rounds)" if shown < total else ""
    payload = json.dumps(data).replace("</", "<\\/")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p class="meta">{summary.requests} requests, {summary.rounds} rounds, {summary.tokens} tokens, acceptance length
{summary.acceptance_length:.2f} tokens per target forward. Accepted path in green; hover a node for its details.</p>
<div id="details">hover a node</div>
<h2>Summary</h2><div class="charts" id="charts"></div>
<h2>Rounds{html.escape(note)}</h2><div id="rounds"></div>
<script type="application/json" id="trace-data">{payload}</script>
<script>{SCRIPT}</script>
</body></html>
"""
    Path(out).write_text(page, encoding="utf-8")
    return sum(len(r["rows"]) for r in data["rounds"])
