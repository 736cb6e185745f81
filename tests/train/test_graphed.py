"""``--cuda-graph`` (the whole step captured in one CUDA graph, replayed per batch): what it
refuses and why, the undo of its warm-up steps, and on a GPU the same losses as the eager loop
with a new document mask every step."""

import json

import pytest
import torch

from flashmask3.train.config import from_preset
from flashmask3.train.graphed import check_graphable, restore_state, snapshot_state
from flashmask3.train.trainer import build_optimizer, train
from tests.helpers import logged

CUDA = torch.device("cuda")
#: the tiny preset with a head dim the Triton kernels run (64; the preset's 8 takes the torch path)
GPU_MODEL = dict(dim=256, n_heads=4, n_kv_heads=2)


@pytest.mark.parametrize("overrides,world,device,reason", [
    ({}, 1, torch.device("cpu"), "it needs a CUDA device, got cpu"),
    ({}, 2, CUDA, "got 2 ranks"),
    (dict(attention="flex"), 1, CUDA, "needs attention='flashmask3'"),
    (dict(moe_experts=4), 1, CUDA, "MoE routing"),
    (dict(compile=True), 1, CUDA, "either compile or cuda_graph"),
])
def test_check_graphable_names_what_the_configuration_breaks(overrides, world, device, reason, monkeypatch):
    from flashmask3.train import graphed as G

    monkeypatch.setattr(G, "_backend_reason", lambda cfg, device: None)  # the kernels' check: below
    cfg = from_preset("tiny", cuda_graph=True, **overrides)
    assert reason in check_graphable(cfg, world, device)
    assert check_graphable(from_preset("tiny", cuda_graph=True), 1, CUDA) is None


def test_a_step_on_flashmasks_torch_path_is_not_graphable():
    """Where flashmask3 would run its torch path (here: CPU tensors), which plans on the host."""
    from flashmask3.train import graphed as G

    reason = G._backend_reason(from_preset("tiny"), torch.device("cpu"))
    assert "runs its torch path for these inputs (head dim 8" in reason


def test_train_refuses_cuda_graph_without_a_gpu_before_starting(tmp_path, jsonl_corpus):
    cfg = from_preset("tiny", data=jsonl_corpus, out_dir=str(tmp_path / "run"), cuda_graph=True,
                      device="cpu")
    with pytest.raises(ValueError, match="cuda_graph cannot run: it needs a CUDA device"):
        train(cfg)
    assert not (tmp_path / "run" / "summary.json").exists()


def _model_and_optimizer():
    cfg = from_preset("tiny")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    return model, build_optimizer(model, cfg)


def _step(model, optimizer):
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(5, 8)).square().mean().backward()
    optimizer.step()


@pytest.mark.parametrize("steps_before", [0, 2])
def test_warm_up_steps_are_undone_in_place(steps_before):
    """Weights and AdamW state after restore_state equal the snapshot's (a fresh optimiser's new
    state is zeroed: the same as never stepping), and every tensor is the same object at the
    same address (a captured graph keeps them)."""
    model, opt = _model_and_optimizer()
    for _ in range(steps_before):
        _step(model, opt)
    saved = snapshot_state(model, opt)
    want_params = [p.detach().clone() for p in model.parameters()]
    want_state = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()
                  if p in opt.state}
    for _ in range(3):
        _step(model, opt)
    ptrs = [p.data_ptr() for p in model.parameters()]
    state_ptrs = {p: {k: v.data_ptr() for k, v in opt.state[p].items()} for p in model.parameters()}
    assert not all(torch.equal(p, w) for p, w in zip(model.parameters(), want_params))
    restore_state(model, opt, saved)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    for p, w in zip(model.parameters(), want_params):
        assert torch.equal(p, w)
        state = opt.state[p]
        assert {k: v.data_ptr() for k, v in state.items()} == state_ptrs[p]
        for k, v in state.items():
            expected = want_state[p][k] if steps_before else torch.zeros_like(v)
            assert torch.equal(v, expected), k


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [{}, dict(sliding_window=64, full_every=2),
                                   dict(activation_checkpointing=True)])
def test_gpu_captured_steps_train_like_eager(tmp_path, jsonl_corpus, extra):
    """The same run eager and with --cuda-graph: the same losses and gradient norms step by step
    (every batch has its own document mask, copied into the captured columns; with sliding-window
    layers their windowed mask is derived from it inside the graph; with activation checkpointing
    the recomputed blocks run inside the captured backward), split backward (deterministic
    kernels)."""
    settings = dict(data=jsonl_corpus, steps=8, checkpoint_every=0, seq_len=512, batch_size=2,
                    attention_backward="split", warmup_steps=3, **GPU_MODEL, **extra)
    for name, graphed in (("eager", False), ("graphed", True)):
        train(from_preset("tiny", out_dir=str(tmp_path / name), cuda_graph=graphed, **settings))
    eager, graphed = (list(zip(*(logged(tmp_path / name, c) for c in ("loss", "lr", "grad_norm"))))
                      for name in ("eager", "graphed"))
    assert len(graphed) == 8 and len({round(row[0], 6) for row in eager}) == 8
    for e, g in zip(eager, graphed):
        assert g == pytest.approx(e, rel=2e-3, abs=1e-4)
    summary = json.loads((tmp_path / "graphed" / "summary.json").read_text())
    assert summary["attention_share"] is None


@pytest.mark.gpu
def test_gpu_a_replay_without_the_new_mask_would_be_caught(tmp_path, jsonl_corpus, monkeypatch):
    """The check above can fail: replays that keep the first batch's mask (its columns not
    copied in) give other losses than eager."""
    from flashmask3.train import graphed as G

    def load_all_but_the_mask(self, batch, lr):
        s = self.static
        for dst, src in ((s.tokens, batch.tokens), (s.labels, batch.labels),
                         (s.position_ids, batch.position_ids), (s.label_count, batch.label_count)):
            dst.copy_(src)
        self.lr.fill_(lr)

    settings = dict(data=jsonl_corpus, steps=6, checkpoint_every=0, seq_len=512, batch_size=2,
                    attention_backward="split", warmup_steps=3, **GPU_MODEL)
    train(from_preset("tiny", out_dir=str(tmp_path / "eager"), **settings))
    monkeypatch.setattr(G.GraphedStep, "_load", load_all_but_the_mask)
    train(from_preset("tiny", out_dir=str(tmp_path / "stale"), cuda_graph=True, **settings))
    eager, stale = logged(tmp_path / "eager"), logged(tmp_path / "stale")
    assert stale[0] == pytest.approx(eager[0], rel=2e-3)  # the captured batch itself
    assert any(abs(s / e - 1) > 2e-3 for s, e in zip(stale[1:], eager[1:]))


@pytest.mark.gpu
def test_gpu_a_captured_run_resumes_from_its_checkpoint(tmp_path, jsonl_corpus):
    """--cuda-graph with a checkpoint at step 3, stopped there and resumed (a new capture on the
    restored weights and optimiser state): the losses of an uninterrupted eager run."""
    settings = dict(data=jsonl_corpus, steps=6, seq_len=512, batch_size=2, attention_backward="split",
                    warmup_steps=2, **GPU_MODEL)
    train(from_preset("tiny", out_dir=str(tmp_path / "eager"), checkpoint_every=0, **settings))
    run = dict(out_dir=str(tmp_path / "graphed"), cuda_graph=True, checkpoint_every=3, **settings)
    train(from_preset("tiny", stop_at=3, **run))
    train(from_preset("tiny", **run))  # resumes at step 4
    eager, graphed = logged(tmp_path / "eager"), logged(tmp_path / "graphed")
    assert len(graphed) == 6 and graphed == pytest.approx(eager, rel=2e-3)
