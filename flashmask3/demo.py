"""A short tour of the mask layer and the attention path: ``python -m flashmask3.demo``.

Builds a few mask types, prints how much of each the tile classification lets the kernels
skip, and times masked attention forward+backward against dense-mask SDPA on the same inputs.
Runs on the CPU (torch path) or a GPU (Triton path when available).
"""

from __future__ import annotations

import argparse
import time

import torch

import flashmask3
import flashmask3.masks as M
from flashmask3.kernels import resolve_backend

#: What the tour says about the path it runs on.
PATH_NOTES = {
    "torch": ("The torch path (this CPU run) is for experiments, tests and CI without a GPU: the same "
              "masks and numerics as the GPU kernels, O(S) mask memory; on a 2-core CPU 1.3-2.5x "
              "faster than dense SDPA with a boolean mask at 2K tokens and 1.5-5.8x at 8K "
              "(forward and backward), about even at 1K (docs/cpu.md has the table). Training "
              "at scale runs on the Triton path (Hopper GPUs)."),
    "triton": "The Triton path: the Hopper kernels (docs/kernels.md).",
}


def tile_breakdown(mask: M.FlashMask, block: int = 128) -> dict[str, float]:
    """Share of SKIP / PARTIAL / UNMASKED tiles at ``block`` x ``block`` granularity."""
    cls = M.classify_tiles(mask.startend_row_indices, mask.causal, mask.seqlen_q, mask.seqlen_k,
                           block, block)
    n = cls.numel()
    return {name: float((cls == code).sum()) / n
            for name, code in (("skip", M.SKIP), ("partial", M.PARTIAL), ("unmasked", M.UNMASKED))}


def _time(fn, repeats: int, device: torch.device) -> float:
    """Median wall time of ``fn`` in milliseconds (synchronising on CUDA)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def demo_masks(seqlen: int) -> dict[str, M.FlashMask]:
    docs = M.random_document_lengths(seqlen, seqlen // 8, seed=0)
    return {
        "causal": M.causal_mask(seqlen),
        "causal_document": M.causal_document_mask(docs),
        "sliding_window": M.sliding_window_mask(seqlen, seqlen // 8),
        "prefix_document": M.prefix_document_mask(docs, [n // 3 for n in docs]),
        "global_sliding_window": M.global_sliding_window_mask(seqlen, 16, seqlen // 16),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlen", type=int, default=None, help="default: 2048 on CPU, 16384 on GPU")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    s = args.seqlen or (16384 if device.type == "cuda" else 2048)
    h, d = args.heads, args.head_dim
    print(f"flashmask3 {flashmask3.__version__} | device {device} | backend "
          f"{resolve_backend(device)} | S={s} H={h} D={d} {dtype}")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(1, s, h, d, generator=g).to(device, dtype)
    backend = resolve_backend(device)
    # GFLOP/s on the CPU (a TFLOP/s column would read 0.000 there), TFLOP/s on a GPU
    unit, scale = ("TFLOP/s", 1e12) if device.type == "cuda" else ("GFLOP/s", 1e9)
    print(PATH_NOTES.get(backend, ""))
    header = (f"{'mask':<22}{'density':>8}{'skip':>7}{'partial':>8}{'unmask':>7}{'ours ms':>9}"
              f"{'dense ms':>9}{'speedup':>8}{unit:>9}")
    print(header)
    print("-" * len(header))
    for name, mask in demo_masks(s).items():
        mask = mask.to(device)
        tiles = tile_breakdown(mask)

        def ours():
            out = flashmask3.flashmask_attention(q, k, v, mask)
            torch.autograd.grad(out, (q, k, v), dout)

        dense = mask.to_dense()  # O(S²): the baseline this library exists to avoid

        def baseline():
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=dense)
            torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2))

        t_ours = _time(ours, args.repeats, device)
        t_dense = _time(baseline, args.repeats, device)
        rate = mask.flops(h, d, "fwd_bwd") / (t_ours * 1e-3) / scale
        print(f"{name:<22}{mask.density():>8.3f}{tiles['skip']:>7.0%}{tiles['partial']:>8.0%}"
              f"{tiles['unmasked']:>7.0%}{t_ours:>9.1f}{t_dense:>9.1f}{t_dense / t_ours:>7.2f}x"
              f"{rate:>9.1f}")
    print("skip/partial/unmask: share of 128x128 tiles the kernels skip, mask element-wise, or run "
          f"without any mask work. ms: forward+backward, median; speedup: dense / ours; {unit}: "
          "effective (unmasked pairs only).")


if __name__ == "__main__":
    main()
