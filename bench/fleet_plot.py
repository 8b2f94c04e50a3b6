"""Benchmark 16's picture: how the fleet's costs grow with the node count.

    python -m bench.fleet_plot RESULTS.json OUT.png   (redraw from `bench.fleet --json`)

Log-log, nodes across: each value scaled so that it sits on the linear line (y = nodes) at
the smallest size it was measured at, so a line's slope is its growth exponent (the
growth table's: 1 linear, 2 quadratic, 0 flat) and lines that start together can be
compared; the linear and quadratic lines are drawn dashed, each value's exponent is in the
legend. Two panels: what the push, the start, status and the faults take (time and CPU);
what etcd holds and is asked for. A value measured at fewer than two sizes is left out.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from bench.fleet_growth import GROWTH, exponent, pick
from bench.report import program, redraw_args

# the growth table's values (bench.fleet_growth.GROWTH) worth a line, by panel
TIMES = [
    "push: trainer's stall, s",
    "push: the daemons' CPU, s",
    "push: the shards' CPU, s",
    "push --serving 1: trainer's stall, s",
    "start until every shard routed, s",
    "status --json, slowest node, s",
    "cut: out of routing, s",
    "kill 10 %: serving again, s",
]
ETCD = [
    "etcd keys",
    "etcd keys written per push",
    "etcd history KB per push",
    "etcd reads / s, idle",
    "etcd watchers",
]


def series(
    fleets: list[dict[str, Any]], path: tuple[str, ...]
) -> tuple[list[float], list[float], float] | None:
    """(nodes, scaled values, exponent) of one value, or None if measured at < 2 sizes."""
    found = [(float(f["nodes"]), pick(f, *path)) for f in fleets]
    points = [(n, float(v)) for n, v in found
              if isinstance(v, int | float) and math.isfinite(v) and v > 0]  # fmt: skip
    if len(points) < 2:
        return None
    n0, v0 = points[0]
    return [n for n, _ in points], [v / v0 * n0 for _, v in points], exponent(points)


def draw(fleets: list[dict[str, Any]], path: Path) -> Path | None:
    """The picture of `fleets` (bench.fleet's, one per node count) at `path`; None with
    fewer than two node counts."""
    if len({f["nodes"] for f in fleets}) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    sizes = sorted({float(f["nodes"]) for f in fleets})
    per_node = fleets[-1]["shards"] // fleets[-1]["nodes"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for ax, (title, values) in zip(axes, [("time and CPU", TIMES), ("etcd", ETCD)],
                                   strict=True):  # fmt: skip
        ax.plot(sizes, sizes, color="black", linestyle="--", linewidth=0.8, label="linear")
        ax.plot(sizes, [n * n / sizes[0] for n in sizes], color="grey", linestyle=":",
                linewidth=0.8, label="quadratic")  # fmt: skip
        for label in values:
            got = series(fleets, GROWTH[label])
            if got is not None:
                xs, ys, b = got
                ax.plot(xs, ys, marker="o", markersize=3, label=f"{label} ({b:.2f})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(sizes, [f"{n:g}" for n in sizes])
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel(f"nodes ({per_node} shards each)")
        ax.set_ylabel("value, scaled to the linear line at its first size")
        ax.set_title(f"{title}: slope = growth exponent (in the legend)")
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    fleets, out = redraw_args("RESULTS.json OUT.png", "fleet", "fleets")
    drawn = draw(fleets, out)
    if drawn is None:
        print(f"{program()}: {sys.argv[1]}: fewer than two node counts: no growth to draw",
              file=sys.stderr)  # fmt: skip
        sys.exit(1)
    print(drawn)


if __name__ == "__main__":
    main()
