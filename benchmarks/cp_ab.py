"""Per-rank A/B of two ``cp_single_gpu.py`` result files (the same ranks of the same plans, e.g.
the runtime before and after a change, run back to back on one GPU): for each (cp, layout) in
both, the layer time old/new per rank (min, median, max), the slowest rank of each, host time
and the profiled runtime ops (``--breakdown`` files).

    python benchmarks/cp_ab.py OLD.json NEW.json --out benchmarks/results/cp_keys_ab [--title T]
"""

from __future__ import annotations

import argparse
import json
import statistics


def compare(old: dict, new: dict) -> list[dict]:
    """One row per (cp, layout) present in both files, over the ranks timed in both."""
    rows = []
    for cp, layouts in new["cp"].items():
        for name, e in layouts.items():
            if name not in old["cp"].get(cp, {}):
                continue
            a = {r["rank"]: r for r in old["cp"][cp][name]["ranks"]}
            b = {r["rank"]: r for r in e["ranks"]}
            ranks = sorted(set(a) & set(b))
            if not ranks:
                continue
            ratio = [a[r]["seconds"] / b[r]["seconds"] for r in ranks]
            host = [a[r]["host_seconds"] / b[r]["host_seconds"] for r in ranks]

            def torch_ms(x):
                return statistics.mean(x[r]["breakdown"]["torch_ms"] for r in ranks) \
                    if all("breakdown" in x[r] for r in ranks) else None

            rows.append({"cp": int(cp), "layout": name, "ranks": len(ranks),
                         "speedup_min": min(ratio), "speedup_median": statistics.median(ratio),
                         "speedup_max": max(ratio),
                         "slowest_old_ms": max(a[r]["seconds"] for r in ranks) * 1e3,
                         "slowest_new_ms": max(b[r]["seconds"] for r in ranks) * 1e3,
                         "host_ratio_median": statistics.median(host),
                         "torch_ms_old": torch_ms(a), "torch_ms_new": torch_ms(b),
                         "launches_old": max(a[r]["launches"] for r in ranks),
                         "launches_new": max(b[r]["launches"] for r in ranks)})
    return sorted(rows, key=lambda r: (r["cp"], r["layout"]))


def markdown(rows: list[dict], old: dict, new: dict, title: str) -> str:
    env = new["env"]
    lines = [f"# {title}", "",
             f"{env.get('gpu', env.get('device'))}, torch {env.get('torch')}, triton {env.get('triton')}; "
             f"old: {old['env'].get('date')} `{old['env'].get('command', '')}`; new: {env.get('date')} "
             f"`{env.get('command', '')}`. Same ranks of the same plans, one process per side, back to back.",
             "", "Speed-up = old layer time / new layer time per rank (CUDA events around one rank's forward + "
             "backward); host = old / new host issue time (median over ranks); runtime ops = the profiled "
             "non-flashmask3 kernels per layer (mean over ranks); launches = kernel-launching torch ops outside "
             "attention (max).", "",
             "| cp | layout | ranks | speed-up min / median / max | slowest rank ms old -> new | host old/new | "
             "runtime ops ms old -> new | launches old -> new |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ops = (f"{r['torch_ms_old']:.2f} -> {r['torch_ms_new']:.2f}" if r["torch_ms_old"] is not None else "-")
        lines.append(f"| {r['cp']} | {r['layout']} | {r['ranks']} | {r['speedup_min']:.2f} / "
                     f"{r['speedup_median']:.2f} / {r['speedup_max']:.2f} | {r['slowest_old_ms']:.2f} -> "
                     f"{r['slowest_new_ms']:.2f} | {r['host_ratio_median']:.2f} | {ops} | "
                     f"{r['launches_old']} -> {r['launches_new']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--out", required=True, help="output path without extension (.json and .md written)")
    ap.add_argument("--title", default="CP runtime A/B per rank")
    args = ap.parse_args(argv)
    with open(args.old) as f:
        old = json.load(f)
    with open(args.new) as f:
        new = json.load(f)
    rows = compare(old, new)
    with open(args.out + ".json", "w") as f:
        json.dump({"old_env": old["env"], "new_env": new["env"], "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(rows, old, new, args.title))
    print(markdown(rows, old, new, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
