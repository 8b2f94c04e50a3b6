"""The timeline picture of a run (PNG): unit states as coloured bands, each shard's applied
policy version against the ledger's (with the kv prefix-cache hit rate), and every
request's latency (errors in red), all on one time axis with the faults marked. What an
operator would rather look at than read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynamod.chaos.history import History

STATE_COLOURS = {
    "ready": "#4caf50", "completed": "#a5d6a7", "held": "#ffb300", "degraded": "#fb8c00",
    "starting": "#90caf9", "inactive": "#e0e0e0", "backoff": "#ef5350", "failed": "#b71c1c",
    "stopping": "#9e9e9e", "stopped": "#616161", "none": "#ffffff",
}


def _bands(history: History, end: float) -> dict[str, list[tuple[float, float, str]]]:
    bands: dict[str, list[tuple[float, float, str]]] = {}
    open_: dict[str, tuple[float, str]] = {}
    for change in history.states:
        if change.unit in open_:
            start, state = open_[change.unit]
            bands.setdefault(change.unit, []).append((start, change.at, state))
        open_[change.unit] = (change.at, change.new)
    for unit, (start, state) in open_.items():
        bands.setdefault(unit, []).append((start, end, state))
    return bands


def draw(history: History, title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max([history.end] + [r.done for r in history.requests] + [0.1])
    fig, (ax_units, ax_ver, ax_req) = plt.subplots(
        3, 1, figsize=(12, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2, 3]})
    rows = _draw_units(ax_units, history, end)
    ax_units.set_title(title)
    _draw_versions(ax_ver, history)
    _draw_requests(ax_req, history)
    for fault in history.faults:
        for ax in (ax_units, ax_ver, ax_req):
            ax.axvline(fault.at, color="#c62828", linestyle="--", linewidth=1)
            if fault.healed_at is not None:
                ax.axvspan(fault.at, fault.healed_at, color="#ffcdd2", alpha=0.3)
        ax_units.annotate(fault.name, (fault.at, rows - 0.5), fontsize=7, rotation=20,
                          color="#c62828")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _draw_units(ax: Any, history: History, end: float) -> int:
    """Each unit's states as coloured bands, one row a unit; the number of rows."""
    from matplotlib.patches import Patch

    bands = _bands(history, end)
    names = sorted(bands)
    for row, unit in enumerate(names):
        for start, stop, state in bands[unit]:
            ax.broken_barh([(start, max(stop - start, 0.01))], (row - 0.4, 0.8),
                           color=STATE_COLOURS.get(state, "#000000"))
    ax.set_yticks(range(len(names)), names, fontsize=8)
    seen = sorted({s for b in bands.values() for _, _, s in b})
    ax.legend(handles=[Patch(color=STATE_COLOURS.get(s, "#000"), label=s) for s in seen],
              loc="upper right", fontsize=7, ncol=len(seen) or 1)
    return len(names)


def _draw_versions(ax: Any, history: History) -> None:
    """The ledger's version and each shard's, with the kv prefix-cache hit rate."""
    times = [v.at for v in history.versions]
    ax.step(times, [v.current if v.current is not None else float("nan")
                    for v in history.versions], where="post", color="black",
            linewidth=2, label="ledger")
    shard_names = sorted({n for v in history.versions for n in v.shards})
    for name in shard_names:
        ys = [v.shards.get(name) for v in history.versions]
        ax.step(times, [y if y is not None else float("nan") for y in ys], where="post",
                label=name, alpha=0.8)
    ax.set_ylabel("policy version")
    if shard_names:
        ax.legend(loc="upper left", fontsize=7)
    if history.cache:
        ax_hit = ax.twinx()
        ax_hit.plot([c.at for c in history.cache], [c.hit_rate for c in history.cache],
                    color="#6a1b9a", linewidth=1, linestyle=":", label="kv hit rate")
        ax_hit.set_ylim(-0.05, 1.05)
        ax_hit.set_ylabel("kv hit rate", color="#6a1b9a")


def _draw_requests(ax: Any, history: History) -> None:
    ok = [r for r in history.requests if r.ok]
    bad = [r for r in history.requests if not r.ok]
    ax.scatter([r.sent for r in ok], [r.latency for r in ok], s=6, color="#2e7d32",
               label=f"ok ({len(ok)})")
    ax.scatter([r.sent for r in bad], [r.latency for r in bad], s=14, color="#c62828",
               marker="x", label=f"error ({len(bad)})")
    ax.set_ylabel("latency (s)")
    ax.set_xlabel("seconds since start")
    ax.legend(loc="upper left", fontsize=7)
