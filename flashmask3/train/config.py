"""Training configuration: one flat dataclass, named presets and the command-line mapping.

Every knob of the harness lives in :class:`TrainConfig`, so a run is fully described by one
JSON object (saved next to the checkpoints and checked on resume). Presets are partial
overrides of the defaults; command-line flags override the preset. The attention kernel
(``attention``) and the distributed layer (``cp``, ``balance``, ``comm``, ``backward_calls``) are plain fields,
so swapping either is a flag change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field, fields
from typing import Any, Optional

MASK_KINDS = ("causal_document", "document", "shared_question", "prefix_document")
ATTENTION_BACKENDS = ("flashmask3", "flex", "sdpa")
ATTENTION_BACKWARD_CHOICES = ("auto", "split", "fused")
BALANCE_CHOICES = ("sparse", "dual_chunk", "ptrr", "contiguous")
COMM_CHOICES = ("overlap", "allgather")
#: flashmask3.distributed.BACKWARD_CALL_MODES (kept here so the config imports no torch code)
BACKWARD_CALLS_CHOICES = ("stage", "one", "one+local", "auto")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
AUTOGRAD_THREAD_CHOICES = ("calling", "device")
DTYPE_CHOICES = ("auto", "float32", "bfloat16")

# Fields that define the model's parameters: a checkpoint can only be resumed with equal values.
MODEL_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                "moe_experts", "moe_top_k", "moe_ffn_dim")


@dataclass
class TrainConfig:
    """All settings of a training run (data, model, parallelism, optimiser, bookkeeping)."""

    # -- data ---------------------------------------------------------------------------------
    data: str = field(default="default", metadata={
        "help": "'default' (stdlib sources + /usr/share/doc), a directory of text files, a text "
                "file, or a JSONL file with one document per line"})
    text_key: str = field(default="text", metadata={"help": "JSONL field holding the text"})
    seq_len: int = field(default=1024, metadata={"help": "tokens per packed sequence"})
    batch_size: int = field(default=1, metadata={
        "help": "packed sequences per step, in the whole (global) batch: split over --dp"})
    mask: str = field(default="causal_document", metadata={
        "help": "attention mask of the packed documents", "choices": MASK_KINDS})
    prefix_frac: float = field(default=0.5, metadata={
        "help": "prefix_document: fraction of each document that is a bidirectional prefix"})
    num_answers: int = field(default=2, metadata={
        "help": "shared_question: answers per document (the first half is the question)"})
    max_doc_len: int = field(default=0, metadata={
        "help": "cut longer documents into pieces of at most this many tokens (0: no limit)"})
    seed: int = field(default=0, metadata={"help": "seed for init and document order"})

    # -- model --------------------------------------------------------------------------------
    vocab_size: int = field(default=256, metadata={"help": "byte-level tokens: 256"})
    dim: int = field(default=256, metadata={"help": "model width"})
    n_layers: int = field(default=4, metadata={"help": "decoder blocks"})
    n_heads: int = field(default=4, metadata={"help": "query heads"})
    n_kv_heads: int = field(default=2, metadata={"help": "key/value heads (GQA)"})
    ffn_dim: int = field(default=0, metadata={"help": "SwiGLU hidden width (0: ~8/3 dim)"})
    moe_experts: int = field(default=0, metadata={"help": "experts per MoE FFN (0: dense FFN)"})
    moe_top_k: int = field(default=2, metadata={"help": "experts per token"})
    moe_ffn_dim: int = field(default=0, metadata={"help": "expert hidden width (0: ffn_dim)"})
    moe_aux_coef: float = field(default=0.01, metadata={"help": "load-balancing loss weight"})
    rope_theta: float = field(default=10000.0, metadata={"help": "RoPE base"})
    sliding_window: int = field(default=0, metadata={
        "help": "sliding-window layers: each query keeps only the keys [i - w, i] of the packed "
                "mask (0: every layer attends over the whole mask; causal_document masks)"})
    full_every: int = field(default=0, metadata={
        "help": "with --sliding-window: every k-th layer (k, 2k, ...) keeps full attention, the "
                "others slide (0: every layer slides; 6: Gemma 3's 5 local to 1 global)"})
    activation_checkpointing: bool = field(default=False, metadata={
        "help": "recompute each block in backward (long context)"})
    compile: bool = field(default=False, metadata={
        "help": "torch.compile each decoder block (one graph per dense block, CP attention "
                "included; MoE blocks break at their data-dependent routing); the attention "
                "timer is off with it (its marks cannot sit inside a compiled graph)"})

    cuda_graph: bool = field(default=False, metadata={
        "help": "capture the whole step (forward, backward, clipping, AdamW) in one CUDA graph on "
                "the first batch and replay it with each new batch and mask copied in: the host's "
                "launch work becomes one launch (small models, short sequences). One GPU, no "
                "CP/DP, flashmask3 attention, dense FFN, no compile; the attention timer is off "
                "with it"})

    # -- attention / parallelism --------------------------------------------------------------
    attention: str = field(default="flashmask3", metadata={
        "help": "attention backend", "choices": ATTENTION_BACKENDS})
    attention_backward: str = field(default="auto", metadata={
        "help": "flashmask3 Triton backward: split (deterministic), fused (dQ by atomics), "
                "auto (library default / FLASHMASK3_KERNELS: fused at head dims 64, 128 on Hopper, "
                "else split); a resumed GPU run repeats the loss sequence bit for bit with split",
        "choices": ATTENTION_BACKWARD_CHOICES})
    cp: int = field(default=1, metadata={
        "help": "context-parallel ranks per data-parallel group (0: all ranks, i.e. all GPUs "
                "or 2 CPU ranks without a GPU or the torchrun world divided by --dp)"})
    dp: int = field(default=0, metadata={
        "help": "data-parallel groups (0: the world size divided by --cp); world = dp x cp"})
    nodes: int = field(default=0, metadata={
        "help": "nodes of the run (0: WORLD_SIZE / LOCAL_WORLD_SIZE under torchrun, else 1); "
                "a CP group spanning several nodes is planned with hierarchical routing"})
    prefetch: bool = field(default=True, metadata={
        "help": "pack, mask, plan and copy the next batch to the device in a background "
                "thread while the current step runs (--no-prefetch: inside the step)"})
    planner: str = field(default="auto", metadata={
        "help": "where the loader plans the next batch's CP placement: thread (the loader's "
                "thread, sharing the GIL with the step), process (a worker process), auto "
                "(process on a GPU with CP, thread on the CPU)",
        "choices": ("auto", "thread", "process")})
    dist_timeout: float = field(default=600.0, metadata={
        "help": "seconds a collective may wait before it raises (a failed rank cannot hang "
                "the others longer than this)"})
    balance: str = field(default="sparse", metadata={
        "help": "CP token ownership (dual_chunk = baseline, ptrr = torch's round-robin)", "choices": BALANCE_CHOICES})
    comm: str = field(default="overlap", metadata={
        "help": "CP K/V exchange (allgather = baseline)", "choices": COMM_CHOICES})
    backward_calls: str = field(default="auto", metadata={
        "help": "overlapped CP backward: one attention call per stage, one per layer, or one "
                "over the remote keys then the own keys (auto: a rule on the plan's shape, "
                "docs/cp-runtime.md)",
        "choices": BACKWARD_CALLS_CHOICES})
    keep_kv: bool = field(default=True, metadata={
        "help": "overlapped CP: the backward reuses the K/V the forward received instead of "
                "fetching them again (--no-keep-kv: refetch, less activation memory)"})
    chunk_size: int = field(default=0, metadata={"help": "CP chunk size (0: the plan's default)"})
    autograd_thread: str = field(default="calling", metadata={
        "help": "where autograd runs the backward: the thread that calls it (calling; torchtitan's "
                "setting too) or torch's default per-device thread (device), whose hand-offs cost "
                "host time a host-bound step pays (docs/host-path.md)",
        "choices": AUTOGRAD_THREAD_CHOICES})
    device: str = field(default="auto", metadata={"help": "device", "choices": DEVICE_CHOICES})
    dtype: str = field(default="auto", metadata={
        "help": "autocast dtype (auto: bf16 on GPU, fp32 on CPU)", "choices": DTYPE_CHOICES})

    # -- optimiser ----------------------------------------------------------------------------
    steps: int = field(default=300, metadata={"help": "optimiser steps"})
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final lr / peak lr (cosine)"})
    warmup_steps: int = field(default=20, metadata={"help": "linear warm-up steps"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    grad_clip: float = field(default=1.0, metadata={"help": "max global grad norm (0: off)"})

    # -- bookkeeping --------------------------------------------------------------------------
    out_dir: str = field(default="runs/flashmask3", metadata={
        "help": "checkpoints, loss curve, summary"})
    checkpoint_every: int = field(default=100, metadata={
        "help": "steps between checkpoints (0: off)"})
    resume: bool = field(default=True, metadata={"help": "resume from out_dir's latest checkpoint"})
    stop_at: int = field(default=0, metadata={
        "help": "stop after this step keeping the --steps schedule (simulates an interruption)"})
    log_every: int = field(default=10, metadata={"help": "steps between log lines"})
    warmup_exclude: int = field(default=3, metadata={
        "help": "first steps left out of the throughput summary"})
    time_attention: bool = field(default=True, metadata={
        "help": "time attention forward+backward to report its share of step time"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar (on a terminal only)"})
    plot: bool = field(default=True, metadata={"help": "write loss.png"})

    def __post_init__(self):
        self.validate()

    # ---------------------------------------------------------------------------------------
    def validate(self) -> "TrainConfig":
        """Raise ValueError/TypeError naming the first bad field."""
        for f in fields(self):
            value = getattr(self, f.name)
            want = _field_type(f)
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                setattr(self, f.name, value)
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise TypeError(f"{f.name} must be {want.__name__}, got {type(value).__name__}")
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ValueError(f"{f.name} must be one of {list(choices)}, got {value!r}")
        positive = ("seq_len", "batch_size", "vocab_size", "dim", "n_layers", "n_heads",
                    "n_kv_heads", "steps", "log_every", "num_answers")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        non_negative = ("max_doc_len", "ffn_dim", "moe_experts", "moe_ffn_dim", "cp", "dp", "nodes",
                        "chunk_size", "sliding_window", "full_every",
                        "warmup_steps", "checkpoint_every", "stop_at", "warmup_exclude",
                        "grad_clip", "weight_decay", "moe_aux_coef", "min_lr_ratio")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads "
                             f"({self.n_kv_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim dim/n_heads = {self.dim // self.n_heads} must be even "
                             "(RoPE)")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"moe_top_k must be in [1, moe_experts={self.moe_experts}], "
                             f"got {self.moe_top_k}")
        if not 0.0 <= self.prefix_frac <= 1.0:
            raise ValueError(f"prefix_frac must be in [0, 1], got {self.prefix_frac}")
        if not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout must be > 0, got {self.dist_timeout}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1/beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.sliding_window and self.mask != "causal_document":
            raise ValueError(f"sliding_window needs mask='causal_document' (a causal mask of one "
                             f"column per key), got mask={self.mask!r}")
        if self.full_every and not self.sliding_window:
            raise ValueError("full_every chooses the full layers among sliding-window ones: it needs "
                             "sliding_window > 0")
        if self.vocab_size < 256:
            raise ValueError(f"vocab_size must be >= 256 for byte tokens, got {self.vocab_size}")
        return self

    def windowed_layers(self) -> list[bool]:
        """Per layer, whether it is a sliding-window layer (``sliding_window``, ``full_every``)."""
        return [bool(self.sliding_window) and not (self.full_every and (i + 1) % self.full_every == 0)
                for i in range(self.n_layers)]

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def resolved_ffn_dim(self) -> int:
        """SwiGLU width: given, or ~8/3·dim rounded up to a multiple of 64."""
        if self.ffn_dim:
            return self.ffn_dim
        return ((8 * self.dim // 3) + 63) // 64 * 64

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def replace(self, **overrides) -> "TrainConfig":
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **overrides)


def _field_type(f: dataclasses.Field) -> type:
    return {"str": str, "int": int, "float": float, "bool": bool}[
        f.type if isinstance(f.type, str) else f.type.__name__]


# -- presets ----------------------------------------------------------------------------------

PRESETS: dict[str, dict[str, Any]] = {
    # The README demo: ~0.85M params, 2 CPU ranks, ~1-2.5 minutes on 2 cores, loss 5.5 -> ~2.5.
    # Long files are cut into 256-byte documents so every sequence packs several of them.
    "demo": dict(seq_len=2048, batch_size=1, max_doc_len=256, dim=128, n_layers=4, n_heads=4,
                 n_kv_heads=2, ffn_dim=384, steps=300, lr=3e-3, warmup_steps=15, cp=0,
                 checkpoint_every=100, log_every=25, resume=False, out_dir="runs/demo"),
    # Unit tests: seconds on one core.
    "tiny": dict(seq_len=128, batch_size=2, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                 ffn_dim=64, steps=6, lr=3e-3, warmup_steps=2, checkpoint_every=0, log_every=1,
                 warmup_exclude=1, progress=False, plot=False, out_dir="runs/tiny"),
    # A small MoE variant of the demo.
    "demo-moe": dict(seq_len=1024, batch_size=1, max_doc_len=256, dim=128, n_layers=4,
                     n_heads=4, n_kv_heads=2,
                     ffn_dim=192, moe_experts=4, moe_top_k=2, steps=300, lr=3e-3,
                     warmup_steps=15, cp=0, checkpoint_every=100, log_every=25,
                     out_dir="runs/demo-moe"),
    # MoE at the paper's proportions (14B active of 118B parameters: 0.119), small: 15.9M
    # parameters, 1.89M active (0.119, embeddings and norms counted in both; test_model checks
    # it): 32 fine-grained experts of width 152, top-2 routed.
    "moe-small": dict(seq_len=1024, batch_size=2, max_doc_len=256, dim=256, n_layers=4,
                      n_heads=4, n_kv_heads=2, moe_experts=32, moe_top_k=2, moe_ffn_dim=152,
                      steps=300, lr=3e-3, warmup_steps=15, checkpoint_every=100, log_every=25,
                      out_dir="runs/moe-small"),
    # ~0.6B parameters for one H200 (benchmarks/train.py uses the same shape).
    "bench-0.6b": dict(seq_len=32768, batch_size=1, dim=1536, n_layers=24, n_heads=12,
                       n_kv_heads=4, ffn_dim=4096, activation_checkpointing=True, steps=20,
                       lr=3e-4, warmup_steps=5, device="cuda", out_dir="runs/bench"),
}


def from_preset(name: Optional[str] = None, **overrides) -> TrainConfig:
    """Defaults, then the named preset, then ``overrides``."""
    values: dict[str, Any] = {}
    if name is not None:
        if name not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
        values.update(PRESETS[name])
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown config field(s): {unknown}")
    values.update(overrides)
    return TrainConfig(**values)


# -- command line -------------------------------------------------------------------------------

def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per TrainConfig field (default None = keep the preset's value)."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="start from a named preset")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = _field_type(f)
        help_text = f"{f.metadata.get('help', '')} (default: {f.default!r})"
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=None,
                                choices=f.metadata.get("choices"), help=help_text)


def config_from_args(args: argparse.Namespace, default_preset: Optional[str] = None) -> TrainConfig:
    """Build the config from parsed arguments: preset, then every flag that was given."""
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig)
                 if getattr(args, f.name, None) is not None}
    preset = getattr(args, "preset", None) or default_preset
    return from_preset(preset, **overrides)
