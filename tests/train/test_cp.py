"""The dp x cp mesh on 4 gloo CPU ranks: dp 2 x cp 2, dp 1 x cp 4 and dp 4 x cp 1 reproduce the
single-process losses on the same global batches (dual_chunk and sparse, allgather and overlap,
dense and MoE), resume exactly from a checkpoint (also one written by a single process), and a
rank that fails makes every rank raise instead of hanging."""

import shutil
import time

import pytest
import torch

from flashmask3.train.config import from_preset
from flashmask3.train.parallel import Layout, launch
from flashmask3.train.trainer import train
from tests.helpers import logged
from tests.train.cp_worker import fail_on_rank, run_layouts

TOL = dict(rel=2e-5, abs=2e-5)  # fp32: FSDP2 sums the gradients in another order


def _cfg(tmp_path, name, corpus, **kw):
    settings = dict(data=corpus, out_dir=str(tmp_path / name), steps=4, checkpoint_every=0,
                    seq_len=256, batch_size=4, time_attention=False, dist_timeout=120.0)
    return from_preset("tiny", **{**settings, **kw})


def test_mesh_shapes_match_one_process(tmp_path, jsonl_corpus):
    moe = dict(moe_experts=4, moe_top_k=2)
    train(_cfg(tmp_path, "ref", jsonl_corpus, checkpoint_every=2))
    train(_cfg(tmp_path, "ref_moe", jsonl_corpus, **moe))
    # a single-process checkpoint (step 2) resumed on dp 2 x cp 2
    shutil.copytree(tmp_path / "ref", tmp_path / "from1")
    (tmp_path / "from1" / "checkpoints" / "step_00000004.pt").unlink()
    c = lambda name, **kw: _cfg(tmp_path, name, jsonl_corpus, **kw)  # noqa: E731
    resumable = dict(checkpoint_every=2, balance="sparse", comm="overlap")
    jobs = [
        ((2, 2), [c("m22_dual_allgather", balance="dual_chunk", comm="allgather"),
                  c("m22_dual_overlap", balance="dual_chunk", comm="overlap"),
                  c("m22_sparse_allgather", balance="sparse", comm="allgather"),
                  c("m22_sparse_overlap", balance="sparse", comm="overlap"),
                  c("m22_moe", **moe),
                  c("m22_resume", stop_at=2, **resumable),   # interrupted after step 2,
                  c("m22_resume", **resumable),              # then resumed on the same mesh
                  c("from1", **resumable)]),
        ((1, 4), [c("m14_sparse_overlap", balance="sparse", comm="overlap"),
                  c("m14_dual_allgather", balance="dual_chunk", comm="allgather")]),
        ((4, 1), [c("m41", prefetch=False)]),
    ]
    summaries = launch(run_layouts, 4, torch.device("cpu"), jobs, timeout=120.0)
    assert len(summaries) == sum(len(cfgs) for _, cfgs in jobs)
    want = logged(tmp_path / "ref")
    assert len(want) == 4 and want[-1] < want[0]
    for name in ("m22_dual_allgather", "m22_dual_overlap", "m22_sparse_allgather",
                 "m22_sparse_overlap", "m14_sparse_overlap", "m14_dual_allgather", "m41"):
        assert logged(tmp_path / name) == pytest.approx(want, **TOL), name
    assert logged(tmp_path / "m22_moe") == pytest.approx(logged(tmp_path / "ref_moe"), **TOL)
    by_name = {s["final_step"]: s for s in summaries[5:7]}
    assert by_name[2]["steps_run"] == 2 and by_name[4]["steps_run"] == 2
    assert logged(tmp_path / "m22_resume") == logged(tmp_path / "m22_sparse_overlap")
    assert logged(tmp_path / "from1") == pytest.approx(want, **TOL)
    assert summaries[7]["steps_run"] == 2
    assert [(s["dp"], s["cp"]) for s in (summaries[0], summaries[8], summaries[10])] == \
        [(2, 2), (1, 4), (4, 1)]
    ref = (tmp_path / "ref" / "summary.json").read_text()
    assert '"cp_imbalance": null' in ref


def test_a_failing_rank_raises_on_every_rank(tmp_path, jsonl_corpus):
    cfg = _cfg(tmp_path, "fail", jsonl_corpus, dist_timeout=20.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 failed: injected failure on rank 1") as info:
        launch(fail_on_rank, 4, torch.device("cpu"), cfg, 1, 2,
               layout=Layout(2, 2), timeout=20.0)
    assert time.monotonic() - t0 < 110  # bounded: no rank waits past the timeout
    errors = info.value.rank_errors
    assert sorted(errors) == [0, 1, 2, 3]
    for rank in (0, 2, 3):  # they raised on their own (a broken collective), not killed
        assert "exited with code" not in errors[rank][1], errors[rank]


def test_cp_rejects_bad_layouts(tmp_path, jsonl_corpus):
    with pytest.raises(ValueError, match="no context-parallel path"):
        train(_cfg(tmp_path, "x", jsonl_corpus, cp=2, attention="sdpa"))
    with pytest.raises(ValueError, match="divisible by cp"):
        train(_cfg(tmp_path, "x", jsonl_corpus, cp=3, seq_len=256))
    with pytest.raises(ValueError, match="seq_len=256, cp=2, balance=dual_chunk"):
        train(_cfg(tmp_path, "x", jsonl_corpus, cp=2, balance="dual_chunk", chunk_size=96))
    with pytest.raises(ValueError, match="batch_size .3. must be divisible by dp .2."):
        train(_cfg(tmp_path, "x", jsonl_corpus, cp=1, dp=2, batch_size=3))
