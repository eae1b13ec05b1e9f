"""Plots one bench/run.sh result: stall per checkpoint (p50) and iteration-time overhead,
by strategy, for every configuration (state size, ranks, checkpoint interval).

Usage: plot.py RESULT.json OUT.png (needs matplotlib: Debian's python3-matplotlib).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STRATEGIES = ("none", "sync", "staged", "lazy")
COLORS = {"none": "#999999", "sync": "#d62728", "staged": "#ff7f0e", "lazy": "#2ca02c"}


def main():
    result = json.load(open(sys.argv[1]))
    runs = result["runs"]
    configs = []
    for r in runs:
        key = (r["state_bytes"], r["ranks"], r["ckpt_every"])
        if key not in configs:
            configs.append(key)
    labels = [f"{s / 2**30:.0f} GiB\n{n} rank{'s' if n > 1 else ''}\nevery {e}" for s, n, e in configs]
    fig, (ax_stall, ax_over) = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(configs) + 2), 8))
    shown = [s for s in STRATEGIES if s != "none"]
    width = 0.8 / len(STRATEGIES)

    def offsets(i, n):
        return [c + (i - (n - 1) / 2) * width for c in range(len(configs))]

    for i, strategy in enumerate(STRATEGIES):
        by_key = {(r["state_bytes"], r["ranks"], r["ckpt_every"]): r for r in runs if r["strategy"] == strategy}
        if strategy in shown:
            stall = [by_key[k]["stall_ms_p50"] if k in by_key and by_key[k]["stall_ms_p50"] else 0 for k in configs]
            bars = ax_stall.bar(offsets(shown.index(strategy), len(shown)), stall, width, label=strategy,
                                color=COLORS[strategy])
            ax_stall.bar_label(bars, fmt="%.3g", fontsize=7)
        xs = offsets(i, len(STRATEGIES))
        over = [by_key[k]["overhead_pct"] if k in by_key and by_key[k]["overhead_pct"] is not None else 0
                for k in configs]
        bars = ax_over.bar(xs, over, width, label=strategy, color=COLORS[strategy])
        ax_over.bar_label(bars, fmt="%.1f", fontsize=7)
    limits = result["limits"]
    compute = runs[0]["compute"]["mode"] if runs else "?"
    fig.suptitle(f"ckptd bench: fio write {limits['write_MBps']:.0f} MB/s, read {limits['read_MBps']:.0f} MB/s, "
                 f"memcpy {limits['memcpy_GBps']:.1f} GB/s\ncompute phase: {compute}; state per node", fontsize=10)
    ax_stall.set_yscale("log")
    ax_stall.set_ylabel("stall per checkpoint, p50 (ms, log)")
    ax_over.set_ylabel("iteration time overhead vs none (%)")
    ax_over.axhline(0, color="black", linewidth=0.5)
    for ax in (ax_stall, ax_over):
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)
    print(f"   plot: {sys.argv[2]}")


if __name__ == "__main__":
    main()
