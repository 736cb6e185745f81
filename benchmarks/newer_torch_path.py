"""The summary of ``benchmarks/gpu/newer-torch-path.sh``: what a Triton outside the checked
lists runs on Hopper (every pass on its portable tl kernel, warm launches through
``compiled.run``), timed on torch 2.11 / Triton 3.6 as a proxy, against the library's default
path and FlexAttention.

Reads the script's outputs (one or more ``kernel.py`` JSON files with the ``flashmask3``,
``flashmask3_portable`` and ``flex`` rows; ``host_path.py`` JSON files of the host and the
small-problem tables run under ``FLASHMASK3_KERNELS=portable``) and writes one JSON and one
markdown file (``benchmarks/results/newer_torch_path.{json,md}``):

    python benchmarks/newer_torch_path.py --kernels K1.json [K2.json ...] \\
        --host-path H1.json [H2.json ...] --out benchmarks/results/newer_torch_path
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import host_path  # noqa: E402

#: How the script switches the raw C launch off (stated in the summary: ``kernel.py`` and
#: ``host_path.py`` record their own command line, not the prelude they ran under).
PRELUDE = ("each command run as `python - SCRIPT ARGS` with a stdin prelude that sets "
           "`flashmask3.kernels.launcher.RAW_LAUNCH_HERE = False` and then runs SCRIPT (runpy), "
           "as benchmarks/gpu/newer-torch-path.sh does")
WHAT = ("The path a Triton outside the checked lists runs on Hopper (torch 2.12-2.15's until "
        "sessions 44-45; every pass on its portable tl kernel, warm launches through "
        "compiled.run), emulated on torch 2.11 / Triton 3.6: "
        "FLASHMASK3_KERNELS=portable gives the kernel choice and RAW_LAUNCH_HERE=False the launch "
        "path. A proxy: Triton 3.7-3.9 compile the same tl source with their own compiler.")
DEFAULT, PORTABLE, FLEX = "flashmask3", "flashmask3_portable", "flex"


def summarise(kernel_files: list[dict], host_files: list[dict]) -> dict:
    """One record of the runs: their metadata, the kernel cases and the host-path rows."""
    first = kernel_files[0]["meta"] if kernel_files else host_files[0]["meta"]
    meta = {k: first.get(k) for k in ("gpu", "torch", "triton", "cuda")}
    meta.update(what=WHAT, prelude=PRELUDE,
                kernel_runs=[{k: f["meta"].get(k) for k in ("date", "command", "not_run")}
                             for f in kernel_files],
                host_path_runs=[{k: f["meta"].get(k) for k in ("date", "command", "commit")}
                                for f in host_files])
    return dict(meta=meta, kernels=[r for f in kernel_files for r in f["results"]],
                host=[r for f in host_files for r in f.get("host", [])],
                small=[r for f in host_files for r in f.get("small", [])])


def ratios(case: dict) -> dict:
    """fwd+bwd GPU ms of the three implementations and the two ratios of a kernel case."""
    ms = {name: case["impls"][name]["fwd_bwd_ms"] for name in (DEFAULT, PORTABLE, FLEX)}
    std = {name: case["impls"][name].get("std_fwd_bwd_ms") for name in (DEFAULT, PORTABLE, FLEX)}
    return dict(ms=ms, std=std, portable_over_default=ms[PORTABLE] / ms[DEFAULT],
                flex_over_portable=ms[FLEX] / ms[PORTABLE])


def kernel_table(cases: list[dict]) -> list[str]:
    """The markdown table of kernel cases: fwd+bwd ms of the three implementations, the two
    ratios, and the standard do_bench columns."""
    lines = ["| mask | default GPU | portable GPU | Flex GPU | portable / default | Flex / portable "
             "| default std | portable std | Flex std |", "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for case in cases:
        r = ratios(case)
        lines.append(f"| {case['mask']} | {fmt(r['ms'][DEFAULT])} | {fmt(r['ms'][PORTABLE])} | "
                     f"{fmt(r['ms'][FLEX])} | {r['portable_over_default']:.2f}x | "
                     f"{r['flex_over_portable']:.2f}x | {fmt(r['std'][DEFAULT])} | "
                     f"{fmt(r['std'][PORTABLE])} | {fmt(r['std'][FLEX])} |")
    return lines


def markdown(rec: dict) -> str:
    meta = rec["meta"]
    lines = ["# The portable path (tl kernels, compiled.run), timed on torch 2.11 (proxy)", "",
             f"- **gpu**: `{meta['gpu']}`",
             f"- **torch / triton / cuda**: `{meta['torch']}` / `{meta['triton']}` / `{meta['cuda']}`"]
    for run in meta["kernel_runs"]:
        lines.append(f"- **kernels** `{run['date']}`: `{run['command']}`"
                     + (f" (not run: `{run['not_run']}`)" if run.get("not_run") else ""))
    for run in meta["host_path_runs"]:
        lines.append(f"- **host path** `{run['date']}` (commit read `{run.get('commit')}`): `{run['command']}`")
    lines += [f"- **how the raw launch was off**: {meta['prelude']}",
              "- **trees**: a run's commit is what it read from the device copy's git metadata; "
              "`benchmarks/results/GPU_RUNS.md` names the working tree each device call sent", "",
              meta["what"], "",
              "Kernels: the README's 32K cells as `benchmarks/kernel.py` builds them (batch 4 x 32K "
              "tokens, 32 heads, D=128, bf16), fwd+bwd ms. GPU = the interleaved CUDA-event timer "
              "(host hidden); std = `triton.testing.do_bench` median (host work included). default = "
              "the library's path on torch 2.11 (Gluon where the dispatch picks it; here also launched "
              "through compiled.run); portable = FLASHMASK3_KERNELS=portable (the tl kernels, split "
              "backward: what 2.12-2.15 get).", "",
              *kernel_table(rec["kernels"])]
    if rec["host"] or rec["small"]:
        body = host_path.markdown({"path": "FLASHMASK3_KERNELS=portable, raw launch off (compiled.run)"},
                                  rec["host"], rec["small"]).split("\n", 1)[1]
        lines += ["", "## Host time per call and small problems on that path (benchmarks/host_path.py)",
                  body]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", nargs="*", default=[], help="kernel.py JSON files")
    ap.add_argument("--host-path", nargs="*", default=[], help="host_path.py JSON files")
    ap.add_argument("--out", required=True, help="output path without the extension")
    args = ap.parse_args(argv)
    if not args.kernels and not args.host_path:
        print("newer_torch_path: nothing to summarise (give --kernels and/or --host-path)",
              file=sys.stderr)
        return 1
    load = lambda p: json.load(open(p))  # noqa: E731
    rec = summarise([load(p) for p in args.kernels], [load(p) for p in args.host_path])
    write_summary(rec, markdown(rec), args.out)
    return 0


def write_summary(rec: dict, md: str, out: str) -> None:
    """``out``.json (the record) and ``out``.md (its markdown), and the markdown printed."""
    with open(out + ".json", "w") as f:
        json.dump(rec, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    sys.exit(main())
