"""The pictures the evaluations and benchmarks draw (matplotlib, the `eval` extra): latency
CDFs on a log scale, a line over batch sizes, bars per variant."""

from __future__ import annotations

from typing import Mapping, Sequence

from nanoinfer.errors import RequestError


def pyplot():
    """matplotlib.pyplot on the file-only backend, or a RequestError saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RequestError("--plot needs matplotlib: pip install 'nanoinfer[eval]'", param="plot") from exc
    return plt


def cdf(ax, series: Mapping[str, Sequence[float]], title: str, xlabel: str = "ms (log scale)") -> None:
    """Each series' empirical CDF on `ax` (values <= 0 left out: a log axis cannot show them)."""
    for name, values in series.items():
        values = sorted(v for v in values if v > 0)
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    ax.set(xlabel=xlabel, ylabel="fraction", title=title)
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # (plain numbers, not 10^x)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.legend()


def bars(ax, groups: Mapping[str, Mapping[str, float]], title: str, ylabel: str, baseline: str | None = None) -> None:
    """Grouped bars: per group (e.g. a model shape) one bar per variant (e.g. an optimisation),
    each labelled with its value and, given a `baseline` variant, its speedup over it."""
    variants = list(dict.fromkeys(v for group in groups.values() for v in group))
    width = 0.8 / len(variants)
    for j, variant in enumerate(variants):
        xs = [i + (j - (len(variants) - 1) / 2) * width for i in range(len(groups))]
        values = [group.get(variant, float("nan")) for group in groups.values()]  # (NaN: no bar)
        drawn = ax.bar(xs, values, width, label=variant)
        labels = ["" if variant not in group else f"{v:.0f}" + (
            f"\n{v / group[baseline]:.1f}x" if group.get(baseline) else "") for v, group in zip(values, groups.values())]
        ax.bar_label(drawn, labels, fontsize=7)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set(ylabel=ylabel, title=title)
    ax.margins(y=0.12)  # (room for the tallest bar's label under the title)
    ax.legend(fontsize=8)


def save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    fig.clf()
