"""The summary of ``benchmarks/gpu/newer-triton.sh``: the library under a Triton release newer
than the GPU machine's, on that GPU (the release carried in, torch 2.11 beside it): the GPU
tests' outcome (JUnit XML, and which selected tests the run's cap left unrun) and the kernel
benchmark of the Gluon path (``FLASHMASK3_GLUON_UNCHECKED=1``) against the portable tl path (what
that Triton runs by default while it is unchecked) and FlexAttention.

    python benchmarks/newer_triton.py --kernels K.json --junit pytest.xml \\
        [--selected collected.txt] --out benchmarks/results/newer_triton_3.8.0

``--selected``: the test ids the run selected, one per line (``pytest --collect-only -q`` with
the run's ``-m``/``-k``), to list those it did not reach.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.newer_torch_path import kernel_table, ratios, write_summary  # noqa: E402


def junit_outcomes(path: str) -> dict:
    """{test id: "passed" | "failed" | "skipped"} of a JUnit XML file (pytest's, any workers)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        a = case.attrib
        if "classname" not in a:  # (a worker's crash record)
            continue
        test_id = a["classname"].replace(".", "/") + ".py::" + a["name"]
        kinds = {child.tag for child in case}
        out[test_id] = ("failed" if kinds & {"failure", "error"} else
                        "skipped" if "skipped" in kinds else "passed")
    return out


def summarise(kernel_run: dict, outcomes: dict, selected: list[str]) -> dict:
    """One record: the kernel run's metadata and cases, the tests' counts, failures, not run."""
    meta = {k: kernel_run["meta"].get(k) for k in ("gpu", "torch", "triton", "cuda", "date",
                                                    "command", "not_run", "commit")}
    counts = {k: sum(v == k for v in outcomes.values()) for k in ("passed", "failed", "skipped")}
    return dict(meta=meta, kernels=kernel_run["results"], tests=counts,
                failed=sorted(t for t, v in outcomes.items() if v == "failed"),
                not_run=[t for t in selected if t not in outcomes])


def markdown(rec: dict, notes: list[str]) -> str:
    meta, tests = rec["meta"], rec["tests"]
    lines = [f"# The library under Triton {meta['triton']} on a GPU (torch {meta['torch']} beside it)", "",
             f"- **gpu**: `{meta['gpu']}`; **date**: `{meta['date']}`; **cuda** `{meta['cuda']}`; "
             f"commit read `{meta['commit']}` (GPU_RUNS.md names the tree sent)",
             f"- **kernels**: `{meta['command']}`" + (f" (not run: `{meta['not_run']}`)" if meta.get("not_run") else ""),
             f"- **GPU tests** (`pytest -m gpu`, benchmarks/gpu/newer-triton.sh): {tests['passed']} passed, "
             f"{tests['failed']} failed, {tests['skipped']} skipped, {len(rec['not_run'])} not reached "
             "before the run's cap", *[f"- {n}" for n in notes], ""]
    if rec["failed"]:
        lines += ["Failed:", "", *[f"- `{t}`" for t in rec["failed"]], ""]
    if rec["not_run"]:
        lines += ["Not reached:", "", *[f"- `{t}`" for t in rec["not_run"]], ""]
    lines += ["Kernels: `benchmarks/kernel.py`'s 32K cells (batch 4 x 32K tokens, 32 heads, D=128, bf16), "
              "fwd+bwd ms. default = the dispatch table with the Gluon kernels on "
              "(`FLASHMASK3_GLUON_UNCHECKED=1`); portable = the tl kernels (what this Triton runs while "
              "it is not in `GLUON_CHECKED_TRITON`). GPU = the interleaved CUDA-event timer; std = "
              "`triton.testing.do_bench` median, host work included.", "", *kernel_table(rec["kernels"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", required=True, help="kernel.py JSON file")
    ap.add_argument("--junit", required=True, help="the GPU tests' JUnit XML")
    ap.add_argument("--selected", help="the selected test ids, one per line")
    ap.add_argument("--note", action="append", default=[], help="a line for the header (repeat)")
    ap.add_argument("--out", required=True, help="output path without the extension")
    args = ap.parse_args(argv)
    selected = []
    if args.selected:
        selected = [line.strip() for line in open(args.selected) if "::" in line]
    rec = summarise(json.load(open(args.kernels)), junit_outcomes(args.junit), selected)
    rec["meta"]["notes"] = args.note
    for case in rec["kernels"]:
        case["ratios"] = ratios(case)
    write_summary(rec, markdown(rec, args.note), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
