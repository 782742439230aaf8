"""A picture of the speedup over the best peer, by preset: one panel per pass.

Kept apart from the harness so that a machine without matplotlib still benchmarks; also runs
on its own: `python -m bench.plot results.json speedup.png`.
"""
import json
import sys

from bench import report


def plotted_rows(rows):
    """The rows the picture draws: those with a speedup, of the first such row's dtype (one dtype
    a picture). A row not lowered as its mode names (report.not_lowered) is left out, even where a
    JSON written before that check gave it a speedup: its bar would be another path's time."""
    ok = [r for r in rows if r.get("speedup") and not report.not_lowered(r)]
    return [r for r in ok if r["dtype"] == ok[0]["dtype"]]


def plot_speedup(rows, path):
    """Bars of speedup per preset and mode (best spelling of each mode); returns a message."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    ok = plotted_rows(rows)
    if not ok:
        return "plot skipped: no row has a speedup"
    passes = list(dict.fromkeys(r["pass"] for r in ok))
    presets = list(dict.fromkeys(r["preset"] for r in ok))
    modes = list(dict.fromkeys(r["mode"] for r in ok))
    fig, axes = plt.subplots(1, len(passes), figsize=(6 * len(passes), 4), squeeze=False)
    width = 0.8 / len(modes)
    for ax, pass_ in zip(axes[0], passes):
        for i, mode in enumerate(modes):
            best = [max((r["speedup"] for r in ok if (r["pass"], r["preset"], r["mode"]) == (pass_, p, mode)),
                        default=0.0) for p in presets]
            ax.bar([x + i * width for x in range(len(presets))], best, width, label=mode)
        ax.axhline(1.0, color="black", linewidth=0.8)
        if pass_ == "fwd+bwd":  # issue 4's target is on training steps only
            ax.axhline(8.0, color="red", linewidth=0.8, linestyle="--", label="target 8×")
        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(presets))], presets)
        ax.set_title(f"{pass_}: speedup over the best peer (dtype {ok[0]['dtype']})")
        ax.set_ylabel("× best peer (higher is better)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(plot_speedup(json.load(f)["rows"], sys.argv[2]))
