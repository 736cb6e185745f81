"""Model, parallel layout and the step time of one training step (a prediction).

Per micro-batch and pipeline stage, every layer costs, on the slowest context-parallel rank:
attention (the event timeline of :mod:`.timeline`, forward + backward, + a recomputed forward
with ``recompute``), the non-attention matmuls of its ``S / cp`` tokens (QKV/out projections,
dense MLP or routed + shared experts, router) at the achieved matmul throughput, a
non-matmul share on top, and with expert parallelism the token all-to-all (dispatch + combine,
forward and backward, exposed; over NVLink while the EP group is inside a node). The pipeline
runs 1F1B: ``(m + pp - 1)`` slots of one stage's forward+backward for ``m`` micro-batches per
data-parallel replica. Data parallelism adds the gradient reduce-scatter + all-gather of the
stage's parameters, of which ``1 - dp_overlap`` is exposed. Embedding and LM head are left out
(they sit on the first/last pipeline stage and do not depend on the attention method).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .calibrate import matmul_tflops
from .params import Cluster
from .timeline import AttnShape, LayerResult, ring_collective_time


@dataclass(frozen=True)
class ModelConfig:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int = 0               # dense MLP width (SwiGLU: 3 matrices)
    experts: int = 0           # routed experts (0: dense)
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    vocab: int = 100_000

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def attention_params(self) -> int:
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    def mlp_params(self) -> int:
        if not self.moe:
            return 3 * self.hidden * self.ffn
        return (self.experts + self.shared_experts) * 3 * self.hidden * self.expert_ffn \
            + self.hidden * self.experts

    def active_mlp_params(self) -> int:
        if not self.moe:
            return self.mlp_params()
        return (self.top_k + self.shared_experts) * 3 * self.hidden * self.expert_ffn \
            + self.hidden * self.experts

    def total_params(self) -> int:
        return self.layers * (self.attention_params() + self.mlp_params()) + 2 * self.vocab * self.hidden

    def active_params(self) -> int:
        return self.layers * (self.attention_params() + self.active_mlp_params()) + 2 * self.vocab * self.hidden

    def shape(self) -> AttnShape:
        return AttnShape(self.heads, self.kv_heads, self.head_dim)

    def describe(self) -> str:
        kind = (f"MoE {self.experts} experts top-{self.top_k} (+{self.shared_experts} shared), expert "
                f"FFN {self.expert_ffn}" if self.moe else f"dense, FFN {self.ffn}")
        return (f"{self.name}: {self.layers} layers, hidden {self.hidden}, {self.heads} query / "
                f"{self.kv_heads} KV heads x D={self.head_dim}, {kind}; "
                f"{self.total_params() / 1e9:.1f}B total / {self.active_params() / 1e9:.1f}B active")


#: A 118B-A14B-like MoE (every number assumed; see docs/scale-model.md).
MOE_118B = ModelConfig("118B-A14B-like MoE", layers=48, hidden=4096, heads=32, kv_heads=4,
                       head_dim=128, experts=96, top_k=8, expert_ffn=2048, shared_experts=1,
                       vocab=100_000)
#: A 7B-class dense model (Mistral-7B-like dims).
DENSE_7B = ModelConfig("7B-class dense", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                       ffn=14336, vocab=32_000)


@dataclass(frozen=True)
class Layout:
    """Parallel layout: cp x pp x dp GPUs; experts sharded ``ep`` ways inside the cp x dp ranks."""

    cp: int
    pp: int = 1
    dp: int = 1
    ep: int = 1
    micro_batches: int = 1     # per data-parallel replica and step
    recompute: bool = False

    @property
    def gpus(self) -> int:
        return self.cp * self.pp * self.dp


@dataclass
class StepBreakdown:
    step_s: float
    tokens_per_s: float
    attention_s: float          # per layer, slowest rank, fwd+bwd(+recompute)
    attention_compute_s: float  # of it, kernels at full speed on that rank
    attention_exposed_comm_s: float
    attention_host_floor: bool
    nonattn_s: float            # per layer fwd+bwd(+recompute) matmuls + non-matmul
    ep_alltoall_s: float        # per layer
    dp_exposed_s: float         # per step
    bubble_share: float
    imbalance: float

    def as_dict(self) -> dict:
        return asdict(self)


def nonattention_seconds(model: ModelConfig, layout: Layout, tokens: int, cluster: Cluster) -> float:
    """Forward + backward (+ recompute) of one layer's non-attention part for ``tokens`` tokens."""
    flops_fwd = 2 * tokens * (model.attention_params() + model.active_mlp_params())
    tflops, _ = matmul_tflops(cluster, _shape_key(model, tokens))
    passes = 3 + (1 if layout.recompute else 0)
    return passes * flops_fwd / (tflops * 1e12) * (1 + cluster.nonmatmul_share.value)


def _shape_key(model: ModelConfig, tokens: int) -> str:
    f = model.expert_ffn if model.moe else model.ffn
    return f"{tokens}x{model.hidden}x{f}"


def ep_alltoall_seconds(model: ModelConfig, layout: Layout, tokens: int, cluster: Cluster) -> float:
    """Dispatch + combine, forward and backward (+ recompute's forward) of one layer."""
    if not model.moe or layout.ep <= 1:
        return 0.0
    inside = layout.ep <= cluster.gpus_per_node
    nbytes = tokens * model.top_k * model.hidden * 2 * (layout.ep - 1) / layout.ep
    per = nbytes / cluster.p2p_bw(inside) + (layout.ep - 1) * cluster.latency(inside)
    return per * (4 + (2 if layout.recompute else 0))


def dp_exposed_seconds(model: ModelConfig, layout: Layout, cluster: Cluster) -> float:
    """Exposed part of the gradient reduce-scatter + parameter all-gather of one stage (bf16)."""
    if layout.dp <= 1:
        return 0.0
    layers = model.layers / layout.pp
    dense = layers * model.attention_params() * 2
    expert = layers * model.mlp_params() * 2 / max(1, layout.ep)
    # ranks of one DP group sit in different nodes (cp x pp inside), so the ring crosses IB
    per_rank = (dense + expert) / layout.dp
    t = 2 * ring_collective_time(cluster, layout.dp, int(per_rank), gpus_per_node=1)
    return t * (1 - cluster.dp_overlap.value)


def step_time(model: ModelConfig, layout: Layout, seqlen: int, layers: list[LayerResult],
              cluster: Cluster, imbalance: float = 1.0) -> StepBreakdown:
    """Step time from the attention layer results of each micro-batch's sequence (one
    :class:`LayerResult` per distinct sequence; they are averaged over the micro-batches)."""
    tokens = seqlen // layout.cp
    att = [lr.time for lr in layers]
    att_s = sum(att) / len(att)
    slow = [lr.slowest for lr in layers]
    comp = sum(lr.fwd.ranks[s].compute * (2 if lr.recompute else 1) + lr.bwd.ranks[s].compute
               for lr, s in zip(layers, slow)) / len(layers)
    host_bound = any(lr.host[s] >= lr.rank_time(s) - 1e-12 for lr, s in zip(layers, slow))
    non = nonattention_seconds(model, layout, tokens, cluster)
    a2a = ep_alltoall_seconds(model, layout, tokens, cluster)
    per_layer = att_s + non + a2a
    stage = per_layer * model.layers / layout.pp
    slots = layout.micro_batches + layout.pp - 1
    dp = dp_exposed_seconds(model, layout, cluster)
    step = slots * stage + dp
    global_tokens = seqlen * layout.micro_batches * layout.dp
    return StepBreakdown(step, global_tokens / step, att_s, comp, max(0.0, att_s - comp), host_bound,
                         non, a2a, dp, (layout.pp - 1) / slots, imbalance)


__all__ = ["ModelConfig", "Layout", "StepBreakdown", "MOE_118B", "DENSE_7B", "step_time",
           "nonattention_seconds", "ep_alltoall_seconds", "dp_exposed_seconds"]
