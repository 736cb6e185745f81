"""The sustained-load probe's CPU parts: rebuilding committed calls, reading the clock samples."""

import json

from benchmarks.scale_model import sustained_probe as sp
from benchmarks.scale_model.calibrate import tile_counts


def test_rebuild_gives_the_committed_calls_tiles():
    data = json.load(open(sp.FILE))
    for idx in (sp.ROWS[0], sp.ROWS[-1]):
        row = data["attention"][idx]
        fm, keys = sp.rebuild(row, data["spreads"], data["args"]["tolerance"])
        t = tile_counts(fm.startend_row_indices, False, fm.seqlen_q, keys)
        assert (fm.seqlen_q, keys, t.full, t.partial) == (row["q_rows"], row["keys"], row["full_tiles"],
                                                           row["partial_tiles"])


def test_clock_summary_takes_the_samples_inside_the_span(tmp_path):
    path = tmp_path / "clocks.csv"
    path.write_text("2026/12/07 07:00:00.000, 1980 MHz, 2619 MHz, 100.0 W, 40, 0x0000000000000000\n"
                    "2026/12/07 07:00:00.020, 1700 MHz, 2619 MHz, 690.0 W, 41, 0x0000000000000004\n"
                    "2026/12/07 07:00:00.040, 1600 MHz, 2619 MHz, 700.0 W, 41, 0x0000000000000004\n"
                    "not a sample line\n")
    t0 = 1796626800.0  # 2026-12-07 07:00:00 UTC
    samples = sp.read_clocks(str(path))
    assert len(samples) == 3
    out = sp.clock_summary(samples, (t0 + 0.01, t0 + 0.05))
    assert out == {"sm_mhz": 1650.0, "power_w": 695.0, "throttle": ["0x0000000000000004"], "samples": 2}
    assert sp.clock_summary(samples, (t0 + 10, t0 + 11)) is None
