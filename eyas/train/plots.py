"""Training curves from a trainer log: loss, evaluation accuracy by step, and loss by rollout step."""

from __future__ import annotations

import json
from pathlib import Path


def plot_log(log_path: str | Path, out_path: str | Path) -> None:
    """Write a PNG with the training loss and the evaluation metrics recorded in a log.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = [], []
    for line in Path(log_path).read_text().splitlines():
        record = json.loads(line)
        if "eval" in record and record["eval"]:
            evals.append(record)
        elif "loss" in record:
            train.append(record)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train])
    axes[0].set(title="training loss", xlabel="step")
    for key in sorted({k for r in evals for k in r["eval"] if k.startswith(("top1/", "recall@"))}):
        axes[1].plot([r["step"] for r in evals], [r["eval"].get(key) for r in evals], label=key)
    axes[1].set(title="evaluation: top-1 and top-k recall by rollout step", xlabel="step")
    axes[1].legend(fontsize=7)
    if evals:
        last = evals[-1]["eval"]
        steps = sorted(int(k.split("/")[1]) for k in last if k.startswith("loss/"))
        axes[2].bar(steps, [last[f"loss/{s}"] for s in steps])
        axes[2].set(title="final evaluation loss by rollout step", xlabel="rollout step")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def plot_lm_curves(reports: dict[str, dict], out_path: str | Path) -> None:
    """Write a PNG with the training and held-out loss by step of base LMs (the `curve` of their train reports)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, report in reports.items():
        curve = report.get("curve", [])
        steps = [c["step"] for c in curve]
        line, = ax.plot(steps, [c["train_loss"] for c in curve], label=f"{name}: train")
        ax.plot(steps, [c["heldout_loss"] for c in curve], "--", color=line.get_color(), label=f"{name}: held-out")
    ax.set(title="base models: next-token loss (nats)", xlabel="step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
