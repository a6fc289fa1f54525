"""`eyas trace show --png`: acceptance by depth and the calibration chart, side by side (matplotlib)."""

from __future__ import annotations

from pathlib import Path

from eyas.trace.summary import Summary

EDGE = 0.85  # a count label of a point past this share of an axis is drawn on the point's inner side


def write_png(out: str | Path, title: str, summary: Summary) -> None:
    import matplotlib.pyplot as plt

    fig = draw_charts(title, summary)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def draw_charts(title: str, summary: Summary):
    """The two charts on one matplotlib figure (Agg), every label inside its chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (depth_ax, calib_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    depths = summary.depth_acceptance()
    depth_ax.bar([d for d, _, _ in depths], [a / o if o else 0.0 for _, o, a in depths], color="#6a8fd8")
    depth_ax.set(xlabel="depth", ylabel="rounds accepting a token there / rounds reaching it", ylim=(0, 1))
    depth_ax.set_title("acceptance by depth")
    buckets = [b for b in summary.calibration if b.nodes]
    calib_ax.plot([0, 1], [0, 1], "--", color="#d55", label="perfect calibration")
    calib_ax.plot([b.mean_confidence for b in buckets], [b.acceptance for b in buckets], "o-", color="#1a7f37", label="observed")
    for b in buckets:
        right, top = b.mean_confidence > EDGE, b.acceptance > EDGE
        calib_ax.annotate(
            str(b.nodes), (b.mean_confidence, b.acceptance), textcoords="offset points", xytext=(-5 if right else 5, -5 if top else 5),
            ha="right" if right else "left", va="top" if top else "bottom", fontsize=7,
        )
    calib_ax.set(xlabel="draft confidence (bucket mean)", ylabel="accepted share of tried nodes", xlim=(0, 1.03), ylim=(0, 1.04))
    calib_ax.set_title("calibration (labels: nodes per bucket)")
    calib_ax.legend(loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
