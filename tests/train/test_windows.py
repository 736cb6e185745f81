"""Sliding-window layers in the harness (``--sliding-window``, ``--full-every``): which layers
slide, their FLOPs, the same losses under context parallelism (the window layers run the plan's
windowed plan on the same placement) as on one process, and different losses from full layers."""

import pytest
import torch

from flashmask3 import masks as M
from flashmask3.train.config import from_preset
from flashmask3.train.model import model_flops_per_step
from flashmask3.train.trainer import train
from tests.helpers import logged

TOL = dict(rel=2e-5, abs=2e-5)


def test_window_layers_and_their_flops(jsonl_corpus):
    cfg = from_preset("tiny", data=jsonl_corpus, n_layers=6, sliding_window=16, full_every=3)
    assert cfg.windowed_layers() == [True, True, False, True, True, False]
    assert from_preset("tiny", data=jsonl_corpus, sliding_window=16).windowed_layers() == [True, True]
    assert from_preset("tiny", data=jsonl_corpus).windowed_layers() == [False, False]
    mask = M.causal_document_mask([100, 28])
    full, window = (m.flops(cfg.n_heads, cfg.head_dim, "fwd_bwd") for m in (mask, M.with_window(mask, 16)))
    assert window < full
    base = model_flops_per_step(cfg.replace(sliding_window=0, full_every=0), 128, 0.0)
    assert model_flops_per_step(cfg, 128, full, window) == pytest.approx(base + 2 * full + 4 * window)
    with pytest.raises(ValueError, match="window_flops_per_layer"):
        model_flops_per_step(cfg, 128, full)
    with pytest.raises(ValueError, match="causal_document"):
        from_preset("tiny", data=jsonl_corpus, sliding_window=16, mask="document")
    with pytest.raises(ValueError, match="full_every"):
        from_preset("tiny", data=jsonl_corpus, full_every=2)


def test_window_layers_train_the_same_under_context_parallelism(tmp_path, jsonl_corpus):
    settings = dict(data=jsonl_corpus, steps=3, checkpoint_every=0, seq_len=256, batch_size=2,
                    n_layers=2, time_attention=False, dist_timeout=120.0)
    windows = dict(sliding_window=12, full_every=2)
    runs = {"full": {}, "one": windows, "cp2": dict(cp=2, **windows),
            "cp2_allgather": dict(cp=2, comm="allgather", **windows)}
    for name, extra in runs.items():
        train(from_preset("tiny", out_dir=str(tmp_path / name), **settings, **extra))
    want = logged(tmp_path / "one")
    assert len(want) == 3
    for name in ("cp2", "cp2_allgather"):
        assert logged(tmp_path / name) == pytest.approx(want, **TOL), name
    assert logged(tmp_path / "full") != pytest.approx(want, rel=1e-4)  # the window changes the model
