"""benchmarks/newer_triton.py: the summary of a GPU run under a newer Triton (no GPU)."""

from __future__ import annotations

import json

from benchmarks import newer_triton as NT
from tests.benchmarks.test_newer_torch_path import _kernel_file

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.kernels.test_a" name="test_ok[1]" time="1.0"/>
<testcase classname="tests.kernels.test_a" name="test_bad" time="1.0"><failure message="x">E</failure></testcase>
<testcase classname="tests.test_api" name="test_skip" time="0.0"><skipped message="s"/></testcase>
<testcase classname="tests.test_api" name="test_err" time="0.0"><error message="e"/></testcase>
</testsuite></testsuites>
"""


def test_outcomes_counts_failures_and_the_tests_a_capped_run_did_not_reach(tmp_path):
    (tmp_path / "k.json").write_text(json.dumps(_kernel_file({"shared_question": (30.0, 38.0, 41.0)})))
    (tmp_path / "p.xml").write_text(JUNIT)
    (tmp_path / "sel.txt").write_text("tests/kernels/test_a.py::test_ok[1]\ntests/kernels/test_a.py::test_late\n"
                                      "\n3 tests collected\n")
    out = tmp_path / "s"
    assert NT.main(["--kernels", str(tmp_path / "k.json"), "--junit", str(tmp_path / "p.xml"),
                    "--selected", str(tmp_path / "sel.txt"), "--note", "a note", "--out", str(out)]) == 0
    rec = json.loads((tmp_path / "s.json").read_text())
    assert rec["tests"] == {"passed": 1, "failed": 2, "skipped": 1}
    assert rec["failed"] == ["tests/kernels/test_a.py::test_bad", "tests/test_api.py::test_err"]
    assert rec["not_run"] == ["tests/kernels/test_a.py::test_late"]
    md = (tmp_path / "s.md").read_text()
    assert "1 passed, 2 failed, 1 skipped, 1 not reached" in md and "- a note" in md
    assert "| shared_question | 30.00 | 38.00 | 41.00 | 1.27x | 1.08x |" in md
