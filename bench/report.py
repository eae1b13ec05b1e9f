"""Gathers the raw results of one bench/run.sh run into its JSON file and a table.

Input: the run's work directory (limits.json; per run res/ID.run.json, one summary per
rank res/ID-train-rR.json, and for lazy the daemon's status, the restore summaries and
the daemon's peak RSS). Output: the JSON of the issue (limits, runs) and a table on stdout.
Node figures from per-rank ones: a data-parallel step waits for its slowest rank, so
stall and iteration times are the maximum over ranks and throughputs are the node's bytes
over the slowest rank's time.
"""
import argparse
import datetime
import glob
import json
import os
import platform
import statistics


def load(path):
    with open(path) as f:
        return json.load(f)


def worst(ranks, key):
    values = [r[key] for r in ranks if r.get(key) is not None]
    return max(values) if values else None


def lazy_flush_mbps(status, job, world):
    """Median over versions of the node's flush throughput: all ranks' bytes over the time
    from the slowest rank's snapshot call to its shard being durable."""
    by_version = {}
    for s in status.get("shards", []):
        if s["job"] == job and s.get("durable_ms", 0) > 0 and not s.get("error"):
            by_version.setdefault(s["version"], []).append(s)
    figures = [sum(int(s["total_bytes"]) for s in v) / 1e6 / (max(s["durable_ms"] for s in v) / 1000)
               for v in by_version.values() if len(v) == world]
    return statistics.median(figures) if figures else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--elapsed-s", type=int, required=True)
    ap.add_argument("--command", required=True)
    a = ap.parse_args()

    limits = load(os.path.join(a.work, "limits.json"))
    res = os.path.join(a.work, "res")
    metas = sorted((load(p) for p in glob.glob(os.path.join(res, "*.run.json"))), key=lambda m: int(m["id"][3:]))
    runs, baseline = [], {}
    for m in metas:
        ranks = [load(os.path.join(res, f"{m['id']}-train-r{r}.json")) for r in range(m["ranks"])]
        state_bytes = sum(r["state_bytes"] for r in ranks)
        stall_p50, stall_p99 = worst(ranks, "stall_ms_p50"), worst(ranks, "stall_ms_p99")
        iter_mean = worst(ranks, "iter_ms_mean")
        key = (m["state_mib"], m["ranks"], m["every"])
        if m["strategy"] == "none":
            baseline[key] = iter_mean
        base = baseline.get(key)
        flush = restore = rss = adjacent = None
        if m["strategy"] in ("sync", "staged"):
            slowest = worst(ranks, "flush_ms_p50")
            flush = state_bytes / 1e6 / (slowest / 1000) if slowest else None
        if m["strategy"] == "lazy":
            flush = lazy_flush_mbps(load(os.path.join(res, f"{m['id']}.status.json")), m["id"], m["ranks"])
            restored = [load(os.path.join(res, f"{m['id']}-restore-r{r}.json")) for r in range(m["ranks"])]
            slowest = worst(restored, "restore_ms")
            restore = state_bytes / 1e6 / (slowest / 1000) if slowest else None
            fio_path = os.path.join(res, f"{m['id']}.fio.json")
            adjacent = load(fio_path) if os.path.exists(fio_path) else None
            with open(os.path.join(res, f"{m['id']}.rss_kib")) as f:
                rss = int(f.read()) / 1024
        runs.append({
            "strategy": m["strategy"], "ranks": m["ranks"], "state_bytes": state_bytes, "ckpt_every": m["every"],
            "compute": {"mode": m["compute"], "ms": m["compute_ms"]}, "iters": m["iters"],
            "stall_ms_p50": stall_p50, "stall_ms_p99": stall_p99, "iter_ms_p50": worst(ranks, "iter_ms_p50"),
            "overhead_pct": 100 * (iter_mean - base) / base if base else None,
            "trainer_visible_GBps": state_bytes / 1e9 / (stall_p50 / 1000) if stall_p50 else None,
            "flush_MBps": flush, "restore_MBps": restore, "daemon_peak_rss_MB": rss,
            # fio measured again just before this run (lazy only): the disk drifts.
            "fio_adjacent": adjacent,
        })

    result = {
        "command": a.command,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()}: {os.cpu_count()} cores, "
                   f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, {platform.release()}",
        "dir": a.dir,
        "state": "per node, split evenly across the ranks; 16 tensors per rank",
        "overhead": "mean iteration time against none of the same configuration",
        "elapsed_s": a.elapsed_s,
        "limits": limits,
        "runs": runs,
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    def frac(v, limit):
        return "" if v is None else f" ({100 * v / limit:.0f}%)"

    def adj(v, adjacent, key):
        return "" if v is None or not adjacent else f" [{100 * v / adjacent[key]:.0f}% adj]"

    print(f"== results (limits: fio write {limits['write_MBps']:.0f} MB/s, read {limits['read_MBps']:.0f} MB/s, "
          f"memcpy {limits['memcpy_GBps']:.1f} GB/s; compute phase {runs[0]['compute']['mode'] if runs else '-'})")
    head = ("strategy", "state", "ranks", "every", "compute", "iters", "stall p50", "stall p99", "iter p50",
            "overhead", "visible", "flush MB/s (of fio at start) [adjacent fio]", "restore MB/s (...)", "RSS MB")
    rows = [head]
    for r in runs:
        rows.append((
            r["strategy"], f"{r['state_bytes'] / 2**30:.0f} GiB", str(r["ranks"]), str(r["ckpt_every"]),
            f"{r['compute']['ms']} ms", str(r["iters"]), num(r["stall_ms_p50"], ".2f") + " ms",
            num(r["stall_ms_p99"], ".2f") + " ms", num(r["iter_ms_p50"], ".0f") + " ms",
            num(r["overhead_pct"], "+.1f") + " %", num(r["trainer_visible_GBps"], ".2f") + " GB/s",
            num(r["flush_MBps"], ".0f") + frac(r["flush_MBps"], limits["write_MBps"])
            + adj(r["flush_MBps"], r["fio_adjacent"], "write_MBps"),
            num(r["restore_MBps"], ".0f") + frac(r["restore_MBps"], limits["read_MBps"])
            + adj(r["restore_MBps"], r["fio_adjacent"], "read_MBps"),
            num(r["daemon_peak_rss_MB"], ".0f")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for i, row in enumerate(rows):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print(f"   JSON: {a.out}")


if __name__ == "__main__":
    main()
