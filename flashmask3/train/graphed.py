"""The whole training step in one CUDA graph (``--cuda-graph``): forward, backward, clipping
and AdamW captured once, then replayed with each new batch copied into the captured inputs.

A step of a small model on short sequences is host-bound: hundreds of kernel launches, each a
few microseconds of Python and dispatch, for a few milliseconds of GPU work. A replay is one
launch, so the step runs at its GPU time. What makes it possible for attention with a new
document mask every step: flashmask3's kernels read the mask's columns on the device, and while
a graph is being captured the mask's plans (block summaries, live ranges) are computed by kernels
inside the graph instead of being cached (docs/host-path.md, "CUDA graphs"), so a replay plans
the columns copied in for this batch.

Scope: one GPU, no context or data parallelism (no collectives in the graph), flashmask3
attention on its Triton kernels (its torch path plans on the host), dense FFN (MoE routing has
data-dependent shapes), no ``torch.compile``. Activation checkpointing works (the recomputed
blocks are captured with the backward). :func:`check_graphable` says which of these a
configuration breaks.

Warming up before the capture runs real steps on the first batch; the model's weights and the
optimiser's state are put back afterwards (in place: the graph keeps their addresses), so the
run trains on exactly the batches and learning rates an eager run does. The copy they are put
back from lives only during the capture (the weights and AdamW's two moments once more).
"""

from __future__ import annotations

from typing import Optional

import torch

from flashmask3.graphs import capture
from flashmask3.masks import FlashMask

from .config import TrainConfig
from .loader import DeviceBatch

#: eager steps on the first batch before the capture (kernels compiled, the optimiser's state
#: and the allocator's pools made); their effect on the weights is undone
WARMUP_STEPS = 2


def check_graphable(cfg: TrainConfig, world_size: int, device: torch.device) -> Optional[str]:
    """Why ``cfg`` cannot run with ``cuda_graph`` on ``world_size`` ranks of ``device``, or None."""
    if device.type != "cuda":
        return f"it needs a CUDA device, got {device.type}"
    if world_size != 1:
        return (f"it runs on one GPU without context or data parallelism (no collectives inside the "
                f"graph), got {world_size} ranks")
    if cfg.attention != "flashmask3":
        return (f"it needs attention='flashmask3' (its kernels read the mask on the device; the "
                f"{cfg.attention!r} path builds a mask on the host per batch), got {cfg.attention!r}")
    if cfg.moe_experts:
        return "MoE routing has data-dependent shapes (no capture): use a dense FFN (moe_experts=0)"
    if cfg.compile:
        return "use either compile or cuda_graph, not both"
    return _backend_reason(cfg, device)


def _backend_reason(cfg: TrainConfig, device: torch.device) -> Optional[str]:
    """Why flashmask3 would not run its Triton kernels for this model's attention calls, or
    None: its torch path (other head dims, no Triton) plans on the host, which a capture forbids."""
    from flashmask3.kernels import choose_backend

    dtype = torch.float32 if cfg.dtype == "float32" else torch.bfloat16
    q = torch.empty((1, 1, cfg.n_heads, cfg.head_dim), dtype=dtype, device=device)
    if choose_backend(q) == "triton":
        return None
    return (f"flashmask3 runs its torch path for these inputs (head dim {cfg.head_dim}, {dtype}, "
            f"{device.type}), which plans on the host; the captured step needs its Triton kernels")


def snapshot_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Copies of the weights and of the optimiser's per-parameter state, to undo warm-up steps."""
    return {"params": [p.detach().clone() for p in model.parameters()],
            "state": {p: {k: v.clone() if isinstance(v, torch.Tensor) else v
                          for k, v in optimizer.state[p].items()}
                      for p in model.parameters() if p in optimizer.state}}


@torch.no_grad()
def restore_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Put the weights and the optimiser state of :func:`snapshot_state` back **in place** (a
    captured graph keeps the tensors' addresses). State made after the snapshot (a fresh
    optimiser's first step) is zeroed: AdamW's fresh state is a zero step count and zero moments."""
    for p, old in zip(model.parameters(), saved["params"]):
        p.copy_(old)
    for p in model.parameters():
        state = optimizer.state.get(p)
        if not state:
            continue
        old = saved["state"].get(p)
        for k, v in state.items():
            if not isinstance(v, torch.Tensor):
                continue
            if old is not None and k in old:
                v.copy_(old[k])
            else:
                v.zero_()


class GraphedStep:
    """``step(batch, lr) -> metrics`` like :func:`trainer.train_step`, run as a CUDA graph.

    The first call (and a call whose batch has another mask layout: column count, heads)
    captures ``run(model, optimizer, batch, lr)`` on static copies of the batch's tensors;
    every call copies its batch and learning rate in, replays, and reads the metrics (the
    step's one host synchronisation, as in the eager loop)."""

    def __init__(self, model, optimizer, run):
        self.model, self.optimizer, self.run = model, optimizer, run
        self.graph = None
        #: warm-up and capture stream, one for every capture (autograd keeps the stream a
        #: parameter's gradient node was made on; a capture on another stream would fail)
        self.side: Optional[torch.cuda.Stream] = None
        self.static: Optional[DeviceBatch] = None
        self.outputs: Optional[dict] = None
        self.lr: Optional[torch.Tensor] = None

    def __call__(self, batch: DeviceBatch, lr: float) -> dict:
        if self.graph is None or _layout(batch) != _layout(self.static):
            self._capture(batch)
        self._load(batch, lr)
        self.graph.replay()
        return {k: float(v) for k, v in self.outputs.items()}

    def _capture(self, batch: DeviceBatch) -> None:
        device = batch.tokens.device
        self.static = _static_copy(batch)
        if self.lr is None:
            self.lr = torch.zeros((), dtype=torch.float32, device=device)
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr  # one device tensor the replays read
        self.graph = self.outputs = None
        saved = snapshot_state(self.model, self.optimizer)
        self.lr.fill_(0.0)  # warm-up steps change no weight (and are undone anyway)
        self.side = self.side or torch.cuda.Stream(device)
        # thread_local: the loader's thread copies the next batch to the GPU meanwhile
        self.graph, self.outputs = capture(self.run, self.model, self.optimizer, self.static, self.lr,
                                           warmup=WARMUP_STEPS, stream=self.side,
                                           capture_error_mode="thread_local")
        restore_state(self.model, self.optimizer, saved)

    def _load(self, batch: DeviceBatch, lr: float) -> None:
        s = self.static
        for dst, src in ((s.tokens, batch.tokens), (s.labels, batch.labels),
                         (s.position_ids, batch.position_ids), (s.label_count, batch.label_count),
                         (s.mask.startend_row_indices, batch.mask.startend_row_indices)):
            dst.copy_(src, non_blocking=True)
        self.lr.fill_(lr)


def _layout(batch: Optional[DeviceBatch]) -> Optional[tuple]:
    """What a captured graph is specialised on: the shapes of the batch's tensors and mask."""
    if batch is None:
        return None
    m = batch.mask
    return (tuple(batch.tokens.shape), tuple(m.startend_row_indices.shape), m.causal, m.seqlen_q,
            batch.num_tokens)


def _static_copy(batch: DeviceBatch) -> DeviceBatch:
    """A batch whose tensors the graph captures: copies of ``batch``'s (same values, so the
    warm-up and the capture see a real batch), its mask a FlashMask over the copied columns
    with the same tile hint (the kernels' tiles are fixed at the capture)."""
    m = batch.mask
    if not isinstance(m, FlashMask):
        raise TypeError(f"cuda_graph needs the batch's mask as a FlashMask, got {type(m).__name__}")
    mask = FlashMask(m.startend_row_indices.clone(), m.causal, m.seqlen_q, m.mean_row_span,
                     _validated=True)
    return DeviceBatch(tokens=batch.tokens.clone(), labels=batch.labels.clone(),
                       position_ids=batch.position_ids.clone(), label_count=batch.label_count.clone(),
                       num_tokens=batch.num_tokens, mask=mask, plan=None, host=batch.host,
                       data_state=batch.data_state)
