"""Context parallelism in the harness: cp_size 2 reproduces the single-rank losses for every
balance/comm choice (and with MoE), and resumes exactly, on 2 gloo CPU ranks."""

import itertools

import pytest
import torch

from flashmask3.train.config import from_preset
from flashmask3.train.parallel import launch
from flashmask3.train.trainer import train
from tests.train.cp_worker import run_configs

COMBOS = list(itertools.product(["sparse", "dual_chunk", "contiguous"], ["overlap", "allgather"]))


def _losses(out_dir):
    lines = (out_dir / "losses.csv").read_text().splitlines()[1:]
    return [float(line.split(",")[1]) for line in lines]


def _cfg(tmp_path, name, corpus, **kw):
    settings = dict(data=corpus, out_dir=str(tmp_path / name), steps=4, checkpoint_every=0,
                    seq_len=256, time_attention=False)
    return from_preset("tiny", **{**settings, **kw})


def test_cp2_matches_cp1_for_every_balance_and_comm(tmp_path, jsonl_corpus):
    ref_dense = _cfg(tmp_path, "ref", jsonl_corpus)
    ref_moe = _cfg(tmp_path, "ref_moe", jsonl_corpus, moe_experts=4, moe_top_k=2)
    train(ref_dense)
    train(ref_moe)
    configs = [_cfg(tmp_path, f"cp2_{b}_{c}", jsonl_corpus, cp=2, balance=b, comm=c)
               for b, c in COMBOS]
    configs.append(_cfg(tmp_path, "cp2_moe", jsonl_corpus, cp=2, moe_experts=4, moe_top_k=2))
    # interrupted after step 2, then resumed: the same losses as the uninterrupted CP run
    resumable = dict(cp=2, checkpoint_every=2, balance="sparse", comm="overlap")
    configs.append(_cfg(tmp_path, "cp2_resume", jsonl_corpus, stop_at=2, **resumable))
    configs.append(_cfg(tmp_path, "cp2_resume", jsonl_corpus, **resumable))
    summaries = launch(run_configs, 2, torch.device("cpu"), configs)
    assert len(summaries) == len(configs) and all(s["world_size"] == 2 for s in summaries)
    want = _losses(tmp_path / "ref")
    assert want[-1] < want[0]
    for b, c in COMBOS:
        got = _losses(tmp_path / f"cp2_{b}_{c}")
        assert got == pytest.approx(want, rel=2e-5, abs=2e-5), (b, c)
    assert _losses(tmp_path / "cp2_moe") == pytest.approx(_losses(tmp_path / "ref_moe"),
                                                          rel=2e-5, abs=2e-5)
    assert summaries[-2]["final_step"] == 2 and summaries[-1]["steps_run"] == 2
    assert _losses(tmp_path / "cp2_resume") == _losses(tmp_path / "cp2_sparse_overlap")


def test_cp_rejects_backends_without_a_cp_path(tmp_path, jsonl_corpus):
    with pytest.raises(ValueError, match="no context-parallel path"):
        train(_cfg(tmp_path, "x", jsonl_corpus, cp=2, attention="sdpa"))
    with pytest.raises(ValueError, match="divisible by cp"):
        train(_cfg(tmp_path, "x", jsonl_corpus, cp=3, seq_len=256))
    with pytest.raises(ValueError, match="seq_len=256, cp=2, balance=dual_chunk"):
        train(_cfg(tmp_path, "x", jsonl_corpus, cp=2, balance="dual_chunk", chunk_size=96))
