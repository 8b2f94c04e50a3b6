"""Benchmark 17's pictures: each fault's goodput over time, the supervisors side by side.

    python -m bench.goodput_plot RESULTS.json DIR   (redraw from `bench.goodput --json`)

One PNG per fault (`DIR/goodput-FAULT.png`), one panel per concurrency: each supervisor's
goodput (good requests completed per second) in the windows `bench.aiperf_run.recovery_s`
judges (3 s, 2 s quick; one every 0.5 s, drawn at its middle, so a dip shows where it
happened, where the table's "s to 95 %" counts to the start of the first window back),
against seconds from the fault; a thin dashed line in the same colour at 95 % of that
run's goodput before the fault; the fault at 0, a SIGSTOP's 10 s shaded. Only the first
round's runs are drawn when the plan ran several. A run without its windows (a JSON
written before they were kept) is left out, and a fault with none is not drawn.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from bench.report import program, redraw_args

COLOURS = {"dynamod": "#1f77b4", "supervisord": "#ff7f0e"}
OTHER_COLOUR = "#2ca02c"  # no supervisor
SHADED = {"worker_stop": ("SIGSTOP", 10.0)}


def draw(
    results: list[dict[str, Any]], out: Path, labels: dict[str, str] | None = None
) -> list[Path]:
    """The pictures of `results` (bench.goodput's runs) into `out`; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    runs = [r for r in results if r.get("round", 1) == 1 and r.get("goodput_windows")]
    drawn = []
    for fault in dict.fromkeys(r["fault"] for r in runs if r["fault"] != "none"):
        mine = [r for r in runs if r["fault"] == fault]
        levels = sorted({r["concurrency"] for r in mine})
        fig, axes = plt.subplots(1, len(levels), figsize=(6.4 * len(levels), 4.2),
                                 squeeze=False)  # fmt: skip
        for ax, level in zip(axes[0], levels, strict=True):
            _panel(ax, [r for r in mine if r["concurrency"] == level], fault)
            ax.set_title(f"concurrency {level}")
        label = (labels or {}).get(fault, fault)
        fig.suptitle(f"goodput around the fault: {label}")
        fig.tight_layout()
        path = out / f"goodput-{fault}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        drawn.append(path)
    return drawn


def _panel(ax: Any, runs: list[dict[str, Any]], fault: str) -> None:
    end = 0.0
    for r in runs:
        win = r["goodput_windows"]
        at = r.get("fault_at_s", 0.0)
        middle = win["window_s"] / 2  # each window drawn at its middle
        xs = [i * win["step_s"] - at + middle for i in range(len(win["rps"]))]
        colour = COLOURS.get(r["supervisor"], OTHER_COLOUR)
        back = r.get("recovery_s")
        said = "never back" if back is None else f"back at 95 % in {back:.1f} s"
        ax.plot(xs, win["rps"], color=colour, label=f"{r['supervisor']} ({said})")
        before = r.get("pre_fault_goodput_rps")
        if before:
            ax.axhline(0.95 * before, color=colour, linestyle="--", linewidth=0.8)
        end = max(end, xs[-1] if xs else 0.0)
    ax.axvline(0.0, color="black", linewidth=1)
    if fault in SHADED:
        name, seconds = SHADED[fault]
        ax.axvspan(0.0, seconds, color="grey", alpha=0.15, label=name)
    ax.set_xlabel(f"s from the fault ({runs[0]['goodput_windows']['window_s']:g} s windows, "
                  "each at its middle)")  # fmt: skip
    ax.set_ylabel("goodput, good req/s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)


def main() -> None:
    runs, out = redraw_args("RESULTS.json DIR", "goodput", "runs")
    from bench.goodput import FAULTS

    drawn = draw(runs, out, FAULTS)
    if not drawn:
        print(f"{program()}: {sys.argv[1]}: no run with its goodput windows (written "
              "before they were kept)", file=sys.stderr)  # fmt: skip
        sys.exit(1)
    for path in drawn:
        print(path)


if __name__ == "__main__":
    main()
