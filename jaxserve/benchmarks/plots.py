"""The sweep's figures (matplotlib, Agg: no display needed), small PNGs."""

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _concurrency_axis(ax, xs: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    _pyplot().close(fig)
    return path


def concurrency_plots(rows: list[dict], out_dir: Path, knee: int | None,
                      slo: dict[str, float], pct: str) -> list[Path]:
    """Throughput vs concurrency (knee marked); p99 TTFT and TPOT vs concurrency (SLO lines)."""
    plt = _pyplot()
    xs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(xs, [r["output_throughput"] for r in rows], "o-", label="output tok/s")
    ax.plot(xs, [r["total_token_throughput"] for r in rows], "s--", label="total tok/s")
    if knee is not None:
        ax.axvline(knee, color="gray", linestyle=":", label=f"knee: {knee}")
    ax.set(xlabel="concurrency (requests in flight)", ylabel="tokens/s",
           title="Throughput vs concurrency")
    _concurrency_axis(ax, xs)
    ax.legend()
    ax.grid(alpha=0.3)
    paths = [_save(fig, out_dir / "throughput_vs_concurrency.png")]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    for ax, name in zip(axes, ("ttft", "tpot"), strict=True):
        ax.plot(xs, [r[f"{pct}_{name}_ms"] for r in rows], "o-", label=f"{pct} {name.upper()}")
        ax.plot(xs, [r[f"median_{name}_ms"] for r in rows], "s--", label=f"median {name.upper()}")
        if name in slo:
            ax.axhline(slo[name], color="red", linestyle=":", label=f"SLO {slo[name]:g} ms")
        _concurrency_axis(ax, xs)
        ax.set_yscale("log")
        ax.set(xlabel="concurrency", ylabel="ms (log scale)",
               title=f"{name.upper()} vs concurrency")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    paths.append(_save(fig, out_dir / "latency_vs_concurrency.png"))
    return paths


def window_plot(rows: list[dict], out_dir: Path, slo: dict[str, float], pct: str) -> Path:
    """window_ms vs throughput (left) and the SLO metrics' tail latency (right), per mode."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.4))
    right = ax.twinx()
    name = next(iter(slo), "e2el")
    for i, mode in enumerate(sorted({r["batching"] for r in rows})):
        sub = [r for r in rows if r["batching"] == mode]
        xs = [r["window_ms"] for r in sub]
        ax.plot(xs, [r["output_throughput"] for r in sub], "o-", color=f"C{i}",
                label=f"{mode}: output tok/s")
        right.plot(xs, [r[f"{pct}_{name}_ms"] for r in sub], "x--", color=f"C{i}",
                   label=f"{mode}: {pct} {name.upper()}")
    if name in slo:
        right.axhline(slo[name], color="red", linestyle=":", label=f"SLO {slo[name]:g} ms")
    ax.set(xlabel="window_ms", ylabel="output tokens/s", title="Batching window sweep")
    right.set_ylabel(f"{pct} {name.upper()} (ms)")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, ncol=3, loc="upper center",
              bbox_to_anchor=(0.5, -0.2))
    ax.grid(alpha=0.3)
    return _save(fig, out_dir / "window_sweep.png")


def modes_plot(rows: list[dict], out_dir: Path, pct: str) -> Path:
    """Throughput and tail latency vs concurrency for static, dynamic and continuous batching."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    for i, mode in enumerate(dict.fromkeys(r["batching"] for r in rows)):
        sub = [r for r in rows if r["batching"] == mode]
        xs = [r["concurrency"] for r in sub]
        axes[0].plot(xs, [r["output_throughput"] for r in sub], "o-", color=f"C{i}", label=mode)
        axes[1].plot(xs, [r[f"{pct}_e2el_ms"] for r in sub], "o-", color=f"C{i}", label=mode)
    axes[0].set(ylabel="output tokens/s", title="Throughput")
    axes[1].set(ylabel="ms (log scale)", title=f"{pct} end-to-end latency", yscale="log")
    for ax in axes:
        _concurrency_axis(ax, sorted({r["concurrency"] for r in rows}))
        ax.set_xlabel("concurrency")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return _save(fig, out_dir / "batching_modes.png")
