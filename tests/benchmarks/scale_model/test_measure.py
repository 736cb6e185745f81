"""The GPU script's measurement module on the CPU (the code path only: timings are wall time)."""

import json

import torch

from benchmarks.scale_model import measure


def test_overlap_times_off_cuda_counts_every_call():
    calls = []
    host_us, gpu_ms, hidden = measure.overlap_times(lambda: calls.append(1), torch.device("cpu"),
                                                    reset=None, calls=4, samples=3)
    assert len(calls) == 12 and host_us >= 0 and gpu_ms >= 0 and hidden


def test_dry_run_writes_gpu_and_host_columns(tmp_path):
    assert measure.main(["--out", str(tmp_path), "--device", "cpu", "--dry-run"]) == 0
    rows = json.loads((tmp_path / "scale_model_attention.json").read_text())["attention"]
    assert rows and all("error" not in r for r in rows)
    for r in rows:
        for k in ("fwd_ms", "fwd_bwd_ms", "gpu_fwd_ms", "gpu_fwd_bwd_ms", "host_fwd_us", "host_fwd_bwd_us"):
            assert r[k] > 0, k
