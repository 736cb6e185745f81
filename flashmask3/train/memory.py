"""An estimate of the GPU memory a run needs per rank, from its configuration alone.

This is a model, not a measurement: it counts the tensors the harness keeps (FSDP2 shards of the
fp32 parameters, gradients and AdamW moments; the gathered blocks; the activations bf16 autocast
keeps, with or without activation checkpointing; the K/V a CP rank receives) and ignores the
CUDA context, NCCL buffers, kernel workspaces and allocator fragmentation (add ~2-4 GiB). The
one measured point it was checked against: ``bench-0.6b`` at 131,072 tokens on one H200 peaked
at 35.3 GiB (``benchmarks/results/train_h200.json``, no FSDP); the model says 38.2 GiB (8% high).

    python -m flashmask3.train.memory --preset bench-0.6b --seq-len 1048576 --batch-size 8 --dp 8 --cp 8
"""

from __future__ import annotations

import argparse
import sys

from .config import add_config_arguments, config_from_args
from .model import parameter_counts

GIB = 2 ** 30


def estimate_memory(cfg, dp: int = 1, cp: int = 1) -> dict[str, float]:
    """Bytes per rank (GiB) for ``cfg`` on a ``dp x cp`` mesh: a labelled estimate."""
    if cfg.batch_size % dp:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by dp ({dp})")
    world = dp * cp
    n = parameter_counts(cfg)["total"]
    d, hd, L = cfg.dim, cfg.head_dim, cfg.n_layers
    per_block = (n - 2 * cfg.vocab_size * d - d) / L
    tokens = cfg.batch_size // dp * cfg.seq_len // cp  # this rank's tokens
    hq, hk = cfg.n_heads, cfg.n_kv_heads
    if cfg.moe_experts:
        ffn_width = cfg.moe_top_k * (cfg.moe_ffn_dim or cfg.resolved_ffn_dim())
    else:
        ffn_width = cfg.resolved_ffn_dim()
    # one block's saved activations: q/k/v/out (bf16), fp32 RoPE copies of q/k, the norms'
    # outputs (fp32 in, bf16 out), the FFN's two projections and their product (bf16)
    block_act = tokens * (2 * hd * (2 * hq + 2 * hk) + 4 * hd * (hq + hk) + 6 * 2 * d
                          + 2 * 3 * ffn_width)
    residual = 4 * tokens * d  # the fp32 residual stream at each block boundary
    if cfg.activation_checkpointing:
        activations = L * residual + 1.5 * block_act  # + the recomputed block and its grads
    else:
        activations = L * (residual + block_act)
    # K/V a CP rank holds for one layer at a time: everything (allgather) or, as an upper
    # bound, the same for overlap (the mask-aware exchange moves only the needed chunks)
    kv = 0 if cp == 1 else 2 * 2 * cfg.batch_size // dp * cfg.seq_len * hk * hd
    logits = tokens * cfg.vocab_size * (2 + 4 + 4)
    out = {
        "parameters (fp32 shard)": 4 * n / world,
        "gradients (fp32 shard)": 4 * n / world,
        "AdamW moments (fp32 shards)": 8 * n / world,
        "gathered blocks (current + prefetch, and one block's gradients)":
            0 if world == 1 else 3 * 4 * per_block,
        "activations": activations,
        "CP K/V of one layer": kv,
        "logits and loss": logits,
    }
    out = {k: v / GIB for k, v in out.items()}
    out["total (estimate, without CUDA context / NCCL / fragmentation)"] = sum(out.values())
    return out


def format_estimate(cfg, dp: int, cp: int) -> str:
    rows = estimate_memory(cfg, dp, cp)
    width = max(len(k) for k in rows)
    head = (f"memory per GPU, estimated from the config (dp {dp} x cp {cp}, "
            f"{cfg.batch_size} x {cfg.seq_len} tokens per step, activation checkpointing "
            f"{'on' if cfg.activation_checkpointing else 'off'}):")
    return "\n".join([head] + [f"  {k:<{width}}  {v:8.2f} GiB" for k, v in rows.items()])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Estimate the GPU memory per rank of a run.")
    add_config_arguments(p)
    args = p.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except (ValueError, TypeError) as exc:
        print(f"flashmask3.train.memory: error: {exc}", file=sys.stderr)
        return 2
    print(format_estimate(cfg, cfg.dp or 1, cfg.cp or 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
