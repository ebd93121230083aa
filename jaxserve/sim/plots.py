"""Plots of simulation results (matplotlib, the Agg backend: files, no display)."""

from pathlib import Path

import numpy as np

from jaxserve.sim.metrics import RequestRecord


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(result, path: str | Path, title: str = "") -> Path:
    """KV usage, running / waiting requests and cumulative preemptions over virtual time."""
    plt = _pyplot()
    tl = result.timeline
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    axes[0].plot(tl.time, np.asarray(tl.kv_usage) * 100, lw=0.8)
    axes[0].set_ylabel("KV usage (%)")
    axes[1].plot(tl.time, tl.running, lw=0.8, label="running")
    axes[1].plot(tl.time, tl.waiting, lw=0.8, label="waiting")
    axes[1].set_ylabel("requests")
    axes[1].legend(loc="upper right")
    axes[2].plot(tl.time, tl.preemptions, lw=0.8)
    axes[2].set_ylabel("preemptions")
    axes[2].set_xlabel("time (s)")
    fig.suptitle(title or "simulated engine")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_ttft_cdf(records: dict[str, list[RequestRecord]], path: str | Path,
                  title: str = "") -> Path:
    """One TTFT CDF per named set of records (e.g. per policy), log time axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, recs in records.items():
        ttft = np.sort([r.ttft * 1000 for r in recs if r.times])
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or "time to first token")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_bars(values: dict[str, dict[str, float]], path: str | Path, ylabel: str,
              title: str = "", log: bool = False) -> Path:
    """Grouped bars: values[group][series] (e.g. [policy][class])."""
    plt = _pyplot()
    groups = list(values)
    series = sorted({s for v in values.values() for s in v})
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(groups)), 4.5))
    for i, name in enumerate(series):
        ax.bar(np.arange(len(groups)) + i * width, [values[g].get(name, 0.0) for g in groups],
               width, label=name)
    ax.set_xticks(np.arange(len(groups)) + width * (len(series) - 1) / 2, groups)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
