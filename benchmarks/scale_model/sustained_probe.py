"""Probe: does a GPU-bound attention call run slower under sustained load than right after idle?

The calibration's GPU time per call (``measure.overlap_times``) is timed over 5 calls behind a
sleep kernel, from an idle GPU; its stream time (``measure.stream_times``) over the last 3 of 6
back-to-back calls. Long GPU-bound calls run up to ~12% slower in the stream (NOTES, session
50). This probe takes calls of the committed calibration file (by index), rebuilds them exactly
(``measure.plan_calls``) and times, per pass:

* ``overlap``: ``measure.overlap_times`` as the calibration runs it;
* ``overlap_loaded``: the same with :class:`GpuLoad` (``--load-ms`` of bf16 matmuls) in
  place of the sleep kernel: the GPU under sustained load when the timed calls start;
* ``stream`` and ``stream_loaded``: ``measure.stream_times`` (3 samples), without and with the
  load before each sample;
* ``curve``: ``--curve-ms`` of back-to-back calls after 100 ms of idle GPU, CUDA events between
  calls: the time of every call, so the transient (if any) shows call by call.

``nvidia-smi`` samples SM clock, power and throttle reasons every 20 ms beside it; each phase's
wall-clock span is recorded, so the clock of every phase can be read off the samples.

    python benchmarks/scale_model/sustained_probe.py --out $OUT/probe
    python benchmarks/scale_model/sustained_probe.py --out $OUT/probe --replay 78 79 80 81 82 83

``--replay``: the calibration's own sequence (per row: forward overlap loop, its stream, then the
same for forward+backward) over committed rows, once per ``--idle-s`` (seconds of idle GPU before
every stream): does a stream run slow because of the calls before it?

Session 51's run (one H100, 2026-12-07): benchmarks/results/sustained_probe_h100.json; session
52's replay of rows 76-83: benchmarks/results/sustained_probe_replay_h100.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from benchmarks.environment import run_environment  # noqa: E402
from benchmarks.scale_model import measure  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FILE = os.path.join(HERE, "..", "results", "scale_model_attention.json")
#: Calls of the committed file: fwd stream misses / 12-13% slow (81, 101, 100), fwd+bwd 7-9%
#: slow (0, 273), one under 1 ms (1).
ROWS = (81, 101, 100, 0, 273, 1)


class GpuLoad:
    """``load(factor)`` enqueues about ``factor x ms`` of bf16 4096^3 matmuls: sustained
    tensor-core load that costs the host a few microseconds a matmul. On an H100 it reproduces
    the power-capped state that ~50-70 ms of back-to-back attention calls bring in, overshooting
    attention's own slowdown there by up to 11% (session 51). The calibration (``measure.py``)
    does not use it: its attention and matmul times are the uncapped speed (NOTES, session 52)."""

    def __init__(self, ms: float, device):
        self.ms = ms
        self.a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            self.a @ self.b
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            self.a @ self.b
        e1.record()
        torch.cuda.synchronize()
        self.per_matmul_ms = e0.elapsed_time(e1) / 20

    def __call__(self, factor: float = 1.0) -> None:
        for _ in range(max(1, round(factor * self.ms / self.per_matmul_ms))):
            self.a @ self.b


def rebuild(row: dict, spreads: dict, tolerance: float):
    """``(FlashMask, keys)`` of a committed row: the same plan call ``measure.py`` timed."""
    for meta, fm, keys in measure.plan_calls(spreads[row["spread"]], row["spread"], row["cp"],
                                             row["balance"], ranks={row["rank"]}, nodes=row["nodes"],
                                             tolerance=tolerance):
        if meta["stage"] == row["stage"]:
            return fm, keys
    raise LookupError(f"no call {row['spread']} cp {row['cp']} rank {row['rank']} stage {row['stage']}")


def curve(fn, per_call_ms: float, total_ms: float, idle_s: float = 0.1) -> list[float]:
    """Per-call GPU times of ~``total_ms`` of back-to-back calls after ``idle_s`` of idle GPU."""
    n = max(10, min(200, round(total_ms / max(per_call_ms, 1e-3))))
    torch.cuda.synchronize()
    time.sleep(idle_s)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]


def replay(rows: list[int], committed: dict, device, idle_s: float) -> list[dict]:
    """The calibration's own sequence over committed ``rows`` (``measure.measure_attention``: per
    row, the forward's overlap loop then its stream, then the same for forward+backward), each
    phase's wall-clock span kept; ``idle_s`` of idle GPU (host asleep) before every stream."""
    out = []
    for idx in rows:
        row = committed["attention"][idx]
        fm, keys = rebuild(row, committed["spreads"], committed["args"]["tolerance"])
        fwd, step = _row_calls(row, fm.to(device), keys, device, idx)
        rec = {"index": idx, "heads": row["heads"]}
        for name, fn in (("fwd", fwd), ("fwd_bwd", step)):
            fn()
            t = time.time()
            host, gpu, _ = measure.overlap_times(fn, device, key=name)
            spans = {"overlap": (t, time.time())}
            torch.cuda.synchronize()
            time.sleep(idle_s)
            t = time.time()
            sms, _, _ = measure.stream_times(fn, device, max(gpu, host * 1e-3))
            spans["stream"] = (t, time.time())
            rec[name] = dict(committed_gpu_ms=row[f"gpu_{name}_ms"], committed_stream_ms=row[f"stream_{name}_ms"],
                             gpu_ms=gpu, stream_ms=sms, spans=spans)
        print(f"replay idle {idle_s:g} s row {idx}: fwd GPU {rec['fwd']['gpu_ms']:.3f} stream "
              f"{rec['fwd']['stream_ms']:.3f} (committed {row['gpu_fwd_ms']:.3f} / {row['stream_fwd_ms']:.3f}); "
              f"fwd+bwd {rec['fwd_bwd']['gpu_ms']:.3f} / {rec['fwd_bwd']['stream_ms']:.3f}", flush=True)
        out.append(rec)
    return out


def _row_calls(row: dict, fm, keys: int, device, seed: int):
    """``measure._calls`` of a committed row's shapes on fresh random inputs."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = lambda n, h: torch.randn(1, n, h, row["head_dim"], device=device,  # noqa: E731
                                      dtype=torch.bfloat16, generator=g)
    q, k, v = shape(row["q_rows"], row["heads"]), shape(keys, row["kv_heads"]), shape(keys, row["kv_heads"])
    return measure._calls(q, k, v, fm, torch.randn_like(q))


def start_sampler(path: str):
    """``nvidia-smi`` sampling clocks / power / throttle reasons every 20 ms into ``path``."""
    q = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    try:
        return subprocess.Popen(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader", "-lms", "20"],
                                stdout=open(path, "w"), stderr=subprocess.STDOUT)
    except OSError:
        return None


def read_clocks(path: str) -> list[tuple[float, float, float, str]]:
    """The ``nvidia-smi`` samples in ``path`` as ``(UTC seconds, SM MHz, W, throttle reasons)``;
    lines that are not samples are skipped."""
    rows = []
    for line in open(path):
        f = [x.strip() for x in line.split(",")]
        try:
            t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").replace(
                tzinfo=datetime.timezone.utc).timestamp()
            rows.append((t, float(f[1].split()[0]), float(f[3].split()[0]), f[5]))
        except (ValueError, IndexError):
            continue
    return rows


def clock_summary(samples: list, span: tuple[float, float]) -> dict | None:
    """Median SM clock (MHz) and power (W) of the :func:`read_clocks` ``samples`` within ``span``
    (wall-clock seconds, UTC), and the throttle reasons seen (0x4: software power cap)."""
    inside = [r for r in samples if span[0] <= r[0] <= span[1]]
    if not inside:
        return None
    return {"sm_mhz": statistics.median(r[1] for r in inside), "power_w": statistics.median(r[2] for r in inside),
            "throttle": sorted({r[3] for r in inside}), "samples": len(inside)}


def add_clocks(out_dir: str) -> None:
    """Write each phase's :func:`clock_summary` into ``sustained_probe.json`` of ``out_dir``."""
    path = os.path.join(out_dir, "sustained_probe.json")
    data = json.load(open(path))
    samples = read_clocks(os.path.join(out_dir, "clocks.csv"))
    for rec in data["rows"] + [r for rep in data.get("replays", []) for r in rep["rows"]]:
        for name in ("fwd", "fwd_bwd"):
            rec[name]["clocks"] = {k: clock_summary(samples, tuple(v)) for k, v in rec[name]["spans"].items()}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--load-ms", type=float, default=20.0)
    ap.add_argument("--curve-ms", type=float, default=300.0)
    ap.add_argument("--replay", type=int, nargs="+", default=None,
                    help="instead: replay the calibration's sequence over these rows, once per --idle-s")
    ap.add_argument("--idle-s", type=float, nargs="+", default=[0.0, 0.3, 0.0])
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    committed = json.load(open(FILE))
    spreads = committed["spreads"]
    tol = committed["args"]["tolerance"]
    sampler = start_sampler(os.path.join(args.out, "clocks.csv"))
    out = {"env": run_environment(device), "args": vars(args), "rows": []}
    if args.replay:
        out["replays"] = [{"idle_s": s, "rows": replay(args.replay, committed, device, s)} for s in args.idle_s]
        return _finish(out, args.out, sampler)
    load = GpuLoad(args.load_ms, device)
    for idx in args.rows:
        row = committed["attention"][idx]
        fm, keys = rebuild(row, spreads, tol)
        fwd, step = _row_calls(row, fm.to(device), keys, device, idx)
        rec = {"index": idx, **{k_: row[k_] for k_ in ("spread", "cp", "balance", "rank", "stage", "heads",
                                                      "kv_heads", "q_rows", "keys")}}
        for name, fn in (("fwd", fwd), ("fwd_bwd", step)):
            fn()
            spans = {}
            t = time.time()
            _, gpu, hidden = measure.overlap_times(fn, device, key=name)
            spans["overlap"] = (t, time.time())
            t = time.time()
            _, lgpu, lhidden = measure.overlap_times(fn, device, key=name + "_loaded", fill=load)
            spans["overlap_loaded"] = (t, time.time())
            t = time.time()
            sms, scalls, _ = measure.stream_times(fn, device, gpu, samples=3)
            spans["stream"] = (t, time.time())
            t = time.time()
            lsms, _, _ = measure.stream_times(fn, device, gpu, samples=3, before=load)
            spans["stream_loaded"] = (t, time.time())
            t = time.time()
            c = curve(fn, gpu, args.curve_ms)
            spans["curve"] = (t, time.time())
            rec[name] = dict(committed_gpu_ms=row[f"gpu_{name}_ms"], committed_stream_ms=row[f"stream_{name}_ms"],
                             overlap_ms=gpu, overlap_hidden=hidden, overlap_loaded_ms=lgpu,
                             overlap_loaded_hidden=lhidden, stream_ms=sms, stream_calls=scalls,
                             stream_loaded_ms=lsms,
                             curve_ms=c, spans=spans)
            third = max(1, len(c) // 3)
            print(f"row {idx} {name}: committed GPU {row[f'gpu_{name}_ms']:.3f} stream {row[f'stream_{name}_ms']:.3f}"
                  f" | now overlap {gpu:.3f} loaded {lgpu:.3f} stream {sms:.3f} loaded {lsms:.3f} | curve first "
                  f"{statistics.median(c[:3]):.3f} mid {statistics.median(c[third:2 * third]):.3f} last "
                  f"{statistics.median(c[-third:]):.3f} ({len(c)} calls)", flush=True)
        out["rows"].append(rec)
        _save(out, args.out)
        del fwd, step
    return _finish(out, args.out, sampler)


def _save(out: dict, out_dir: str) -> None:
    with open(os.path.join(out_dir, "sustained_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


def _finish(out: dict, out_dir: str, sampler) -> int:
    """Save ``out``, stop the clock sampler and add each phase's clock summary."""
    _save(out, out_dir)
    if sampler is not None:
        sampler.terminate()
        add_clocks(out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
