"""``demo.png``: what balancing changed, drawn from ``report.json`` (matplotlib, ``[bench]``).

Top: each rank's mean compute per step (CPU time of its training thread) and the step time
(wall clock), one bar per arm. Bottom: a few steps
of every arm on one time axis, one lane per rank and arm: compute in the arm's colour, the
wait at the gradient all-reduce (the slowest rank's excess) hatched grey. One colour per arm
everywhere, and the colour of "off" is never used for a balanced arm. The arms take turns, so
each lane has gaps where the other arms' steps run; the plot says so. Legends sit outside the
axes, so no bar hides behind one, at 2 ranks or at 8.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["ARM_COLOURS", "write_plot"]

#: One colour per arm: red means "off" and only "off".
ARM_COLOURS = {"off": "#d62728", "step": "#1f77b4", "window": "#2ca02c"}
_WAIT = "#bdbdbd"
_MAX_RANKS_SHOWN = 4
_STEPS_SHOWN = 4


def write_plot(report: dict[str, Any], path: Path) -> tuple[str | None, str | None]:
    """Draw ``path``; returns ``(path, None)`` or ``(None, why it was skipped)``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return None, "matplotlib is not installed (pip install 'evenflow[bench]')"
    arms = report["arms"]
    names = list(arms)
    num_ranks = report["config"]["ranks"]
    fig, (bars, timeline) = plt.subplots(
        2, 1, figsize=(12, 8.5), gridspec_kw={"height_ratios": [1, 1.3]}
    )
    _draw_bars(bars, arms, names, num_ranks)
    _draw_timeline(timeline, arms, names, num_ranks, Patch)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return str(path), None


def _draw_bars(ax: Any, arms: dict[str, Any], names: list[str], num_ranks: int) -> None:
    width = 0.8 / len(names)
    groups = [f"rank {r}\ncompute (CPU)" for r in range(num_ranks)] + ["step time\n(wall clock)"]
    for i, name in enumerate(names):
        arm = arms[name]
        values = [*arm["compute_cpu_per_rank_s"], arm["step_time_s"]]
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
        label = arm["label"]
        if name != "off":
            label += f" ({arm['speedup']:.2f}x measured, {arm['predicted_speedup']:.2f}x predicted)"
        drawn = ax.bar(xs, values, width, color=ARM_COLOURS[name], label=label)
        ax.bar_label(drawn, labels=[f"{v:.2f}" for v in values], fontsize=7, padding=1)
    ax.axvline(num_ranks - 0.5, color="black", linewidth=0.6)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel("seconds per step (mean)")
    ax.set_title(
        "Compute per rank and step time: a step lasts as long as its slowest rank", fontsize=10
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.margins(y=0.15)


def _draw_timeline(
    ax: Any, arms: dict[str, Any], names: list[str], num_ranks: int, patch: Any
) -> None:
    ranks = list(range(min(num_ranks, _MAX_RANKS_SHOWN)))
    first = arms[names[0]]["timeline"][0]
    shown = range(1, min(len(first), 1 + _STEPS_SHOWN))  # after the warm-up step
    if not shown:
        ax.set_axis_off()
        return
    origin = min(arms[n]["timeline"][r][shown[0]]["start_unix"] for n in names for r in ranks)
    labels = []
    y = 0
    for rank in ranks:
        for name in names:
            for s in shown:
                rec = arms[name]["timeline"][rank][s]
                start = rec["start_unix"] - origin + rec["wait_s"]
                ax.broken_barh(
                    [(start, rec["compute_s"])], (y - 0.35, 0.7), color=ARM_COLOURS[name]
                )
                ax.broken_barh(
                    [(start + rec["compute_s"], rec["sync_s"])],
                    (y - 0.35, 0.7),
                    facecolor=_WAIT,
                    hatch="///",
                    edgecolor="#808080",
                    linewidth=0,
                )
            labels.append(f"rank {rank}, {arms[name]['label']}")
            y += 1
        if rank != ranks[-1]:
            ax.axhline(y - 0.5, color="black", linewidth=0.5)  # one block of lanes per rank
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds (steps {shown[0]}-{shown[-1]} of every arm)")
    more = "" if len(ranks) == num_ranks else f"; ranks 0-{ranks[-1]} of {num_ranks} shown"
    ax.set_title(
        "Who waits: compute, then the wait at the gradient all-reduce for the slowest rank" + more,
        fontsize=10,
    )
    handles = [patch(color=ARM_COLOURS[n], label=f"compute, {arms[n]['label']}") for n in names]
    handles.append(
        patch(
            facecolor=_WAIT, hatch="///", edgecolor="#808080", label="waiting for the slowest rank"
        )
    )
    ax.legend(
        handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0
    )
    ax.annotate(
        "The arms take turns, one step\neach: the gaps in a lane are\nthe other arms' steps.",
        xy=(1.01, 0.0),
        xycoords="axes fraction",
        fontsize=8,
        va="bottom",
    )
