"""Checkpoints: exact resume after an interruption, and clear errors on bad files."""

import json

import pytest
import torch

from flashmask3.train.checkpoint import latest_checkpoint, load_checkpoint
from flashmask3.train.config import from_preset
from flashmask3.train.trainer import train
from tests.helpers import logged


def _cfg(tmp_path, name, corpus, **kw):
    settings = dict(data=corpus, out_dir=str(tmp_path / name), steps=6, checkpoint_every=3)
    return from_preset("tiny", **{**settings, **kw})


def test_resume_reproduces_the_uninterrupted_losses_exactly(tmp_path, jsonl_corpus):
    full = train(_cfg(tmp_path, "full", jsonl_corpus))
    losses = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert losses["final_step"] == 6
    ref = logged(tmp_path / "full")

    first = train(_cfg(tmp_path, "split", jsonl_corpus, stop_at=3))  # "interrupted" at step 3
    assert first["final_step"] == 3
    assert latest_checkpoint(tmp_path / "split").name == "step_00000003.pt"
    second = train(_cfg(tmp_path, "split", jsonl_corpus))
    assert second["final_step"] == 6 and second["steps_run"] == 3
    got = logged(tmp_path / "split")
    assert got == ref, "resumed run must repeat the uninterrupted losses bit for bit"
    assert full["loss_last"] == second["loss_last"]
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "step_00000006.pt")
    b = load_checkpoint(tmp_path / "split" / "checkpoints" / "step_00000006.pt")
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert a["data"] == b["data"]
    # a finished run is not trained again; --no-resume starts over from scratch
    assert train(_cfg(tmp_path, "split", jsonl_corpus))["final_step"] == 6
    again = train(_cfg(tmp_path, "split", jsonl_corpus, resume=False, steps=3))
    assert again["final_step"] == 3 and again["steps_run"] == 3
    assert latest_checkpoint(tmp_path / "split").name == "step_00000003.pt"


def test_corrupt_checkpoint_is_a_clear_error(tmp_path, jsonl_corpus):
    cfg = _cfg(tmp_path, "run", jsonl_corpus, steps=3)
    train(cfg)
    path = latest_checkpoint(cfg.out_dir)
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(ValueError, match="corrupt or not a torch checkpoint"):
        load_checkpoint(path)
    with pytest.raises(ValueError, match="step_00000003.pt.*corrupt"):
        train(cfg.replace(steps=6))  # resuming fails before any training
    path.write_bytes(b"garbage" * 100)
    with pytest.raises(ValueError, match="corrupt"):
        load_checkpoint(path)
    torch.save({"model": {}}, path)
    with pytest.raises(ValueError, match="not a flashmask3 training checkpoint"):
        load_checkpoint(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")


def test_checkpoint_of_another_model_shape_is_refused(tmp_path, jsonl_corpus):
    cfg = _cfg(tmp_path, "run", jsonl_corpus, steps=3)
    train(cfg)
    with pytest.raises(ValueError, match="different model.*dim"):
        train(cfg.replace(steps=6, dim=64))
    with pytest.raises(ValueError, match="different corpus, seed"):
        train(cfg.replace(steps=6, seed=1))
