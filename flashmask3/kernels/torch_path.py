"""Pure-PyTorch FlashMask attention: forward and backward on any device (the CPU path).

What it is for: running and testing masked attention where no Hopper GPU is (a laptop, CI, a
CPU experiment, the Hugging Face integration on CPU), and checking the Triton kernels. It is
built to be worth running: on a 2-core CPU it is at least as fast as dense
``scaled_dot_product_attention`` with a boolean mask, and faster on sparse masks, while its
mask memory stays O(S) (docs/cpu.md has the measured table).

How, on the CPU: queries are cut into blocks of ``2 * BLOCK_M`` rows. The tile classification
(:func:`flashmask3.masks.blocks.classify_tiles`, key tiles of :data:`BLOCK_N` columns) gives
each query block its *live keys*: the runs of key tiles that are not SKIP for some (batch, mask
head). One query block is then one call of torch's fused CPU attention kernel (which returns
the log-sum-exp) on exactly those keys, with an additive mask only over the PARTIAL tiles (a
block whose only PARTIAL keys are its causal diagonal square instead calls the kernel with
``is_causal`` on the square and without a mask before it, merged by LSE); the backward is that
kernel's backward per block with the given log-sum-exp. Elsewhere (CUDA), and
for a backward that receives a gradient of the log-sum-exp, each block of :data:`BLOCK_M` rows
is explicit products: ``Q_blk · K_liveᵀ`` (all query heads of a KV head stacked as rows, so GQA
shares the keys), the element mask on the PARTIAL tiles, an exact row softmax and ``P V_live``;
its backward recomputes ``P = exp(S - lse)`` and does the four products of the gradient.
Nothing of size ``[Sq, Sk]`` is ever built: the largest temporary is rows x live keys.

Tiles are shared by all batch rows and heads of one call, so a tile is skipped only when it is
SKIP for every (batch, mask head) and computed without a mask only when UNMASKED for all of
them. Accumulation is float32 (float64 for float64 inputs). Fully masked rows give zero output,
``-inf`` log-sum-exp and zero gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..masks.blocks import SKIP, UNMASKED, classify_tiles
from ..masks.mask import element_mask, masked_row_intervals

#: Query rows per block (one dense step each). Measured on the 2-core CPU (docs/cpu.md).
BLOCK_M = 128
#: Width of the key tiles the classification runs on: the granularity of skipping and masking.
BLOCK_N = 64


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class _QueryBlock:
    """One block of query rows ``[r0, r1)``: its live key runs and where masking is needed.

    ``key_runs``: ``(c0, c1)`` key ranges, ascending, that are not SKIP; ``mask_runs``:
    ``(offset, c0, c1)`` PARTIAL key ranges with ``offset`` their position among the live keys.
    """

    r0: int
    r1: int
    key_runs: tuple
    mask_runs: tuple
    #: some live tile is UNMASKED for every (batch, head): no row of the block is fully masked
    has_unmasked: bool = False
    #: the only PARTIAL keys are the block's diagonal square ``[r0, r1)`` and, inside it, the
    #: mask is exactly the causal triangle (set by :func:`_mark_causal_squares`)
    causal_square: bool = False

    @property
    def num_keys(self) -> int:
        return sum(c1 - c0 for c0, c1 in self.key_runs)


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs ``[i0, i1)`` of True in a 1-D boolean array."""
    padded = np.concatenate(([False], flags, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


class _Plan:
    """The query blocks of one call and the element mask of a (rows, key range) piece, in the
    head layout of this module (``[B, Hk, rows, G, keys]``)."""

    def __init__(self, startend, causal, sq, sk, hq, hk, device, block_m=None):
        self.startend, self.causal, self.sq, self.sk = startend, causal, sq, sk
        self.hq, self.hk, self.device = hq, hk, device
        self.block_m = BLOCK_M if block_m is None else block_m
        cls = classify_tiles(startend, causal, sq, sk, self.block_m, BLOCK_N).flatten(0, 1)
        live = (cls != SKIP).any(0).cpu().numpy()
        partial = live & ~(cls == UNMASKED).all(0).cpu().numpy()
        self.blocks = [self._block(qi, live[qi], partial[qi]) for qi in range(live.shape[0])]

    def _block(self, qi: int, live: np.ndarray, partial: np.ndarray) -> _QueryBlock:
        """Query block ``qi``: its live key runs and, among them, the PARTIAL runs."""
        r0, r1 = qi * self.block_m, min((qi + 1) * self.block_m, self.sq)

        def cols(t0, t1):
            return t0 * BLOCK_N, min(t1 * BLOCK_N, self.sk)

        key_runs = tuple(cols(t0, t1) for t0, t1 in _runs(live))
        # position of each live tile among the live keys (tiles are BLOCK_N wide but the last)
        offset_of_tile, offset = {}, 0
        for t0, t1 in _runs(live):
            for t in range(t0, t1):
                offset_of_tile[t] = offset + (t - t0) * BLOCK_N
            offset += cols(t0, t1)[1] - cols(t0, t1)[0]
        mask_runs = []
        for t0, t1 in _runs(partial):
            c0, c1 = cols(t0, t1)
            mask_runs.append((offset_of_tile[t0], c0, c1))
        return _QueryBlock(r0, r1, key_runs, tuple(mask_runs), bool((live & ~partial).any()))

    def allowed_heads(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Boolean allowed mask ``[B or 1, 1 or mask heads, rows, cols]`` of one piece."""
        rows = torch.arange(r0, r1, device=self.device)
        cols = torch.arange(c0, c1, device=self.device)
        if self.startend is None:
            return element_mask(torch.full((1, 1, c1 - c0, 1), self.sq, device=self.device),
                                True, rows, cols, self.sq, self.sk)
        return element_mask(self.startend[:, :, c0:c1], self.causal, rows, cols, self.sq, self.sk)

    def allowed(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Boolean allowed mask broadcastable to ``[B, Hk, rows, G, cols]``."""
        m = self.allowed_heads(r0, r1, c0, c1)
        b, hm = m.shape[:2]
        if hm == 1 or hm == self.hk:
            return m.view(b, hm, r1 - r0, 1, c1 - c0)
        # Any other divisor of Hq: repeat to query heads, then group by KV head.
        m = m.repeat_interleave(self.hq // hm, dim=1)
        return m.view(b, self.hk, self.hq // self.hk, r1 - r0, c1 - c0).transpose(2, 3)


def _query_layout(x: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, S, Hq, D]`` -> contiguous ``[B, Hk, S, G, D]``: the G query heads of a KV head
    next to each other, so a block of rows is one contiguous ``[B, Hk, rows * G, D]`` matrix."""
    b, s, h, d = x.shape
    return x.view(b, s, num_kv_heads, h // num_kv_heads, d).permute(0, 2, 1, 3, 4).to(dtype).contiguous()


def _key_layout(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, S, Hk, D]`` -> contiguous ``[B, Hk, S, D]``."""
    return x.permute(0, 2, 1, 3).to(dtype).contiguous()


def _from_query_layout(x: torch.Tensor) -> torch.Tensor:
    """``[B, Hk, S, G, D]`` -> ``[B, S, Hk * G, D]``."""
    b, hk, s, g, d = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(b, s, hk * g, d)


def _live(x: torch.Tensor, key_runs) -> torch.Tensor:
    """The live keys of ``x [B, Hk, S, D]``: a view for one run, a copy for several."""
    if len(key_runs) == 1:
        c0, c1 = key_runs[0]
        return x[:, :, c0:c1]
    return torch.cat([x[:, :, c0:c1] for c0, c1 in key_runs], dim=2)


def _add_live(acc: torch.Tensor, grad: torch.Tensor, key_runs) -> None:
    """Scatter-add a gradient over the live keys back into ``acc [B, Hk, S, D]``."""
    offset = 0
    for c0, c1 in key_runs:
        acc[:, :, c0:c1] += grad[:, :, offset:offset + c1 - c0]
        offset += c1 - c0


_POOL: Optional[ThreadPoolExecutor] = None


def _pool(n: int) -> ThreadPoolExecutor:
    """The module's worker threads (created once, re-created if the thread count changes)."""
    global _POOL
    if _POOL is None or _POOL._max_workers != n:
        if _POOL is not None:
            _POOL.shutdown(wait=True)
        _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="flashmask3-cpu")
    return _POOL


@contextlib.contextmanager
def _block_workers(device: torch.device):
    """The worker threads the query blocks of one call run on, or None to run them in order.

    On the CPU, with more than one torch thread, the call's ops run single-threaded (torch's
    intra-op threads are set to 1 for the duration and restored after) and the query blocks are
    spread over that many worker threads. Why: a query block is a handful of medium-sized ops,
    and on a busy machine every intra-op parallel region waits for its second thread to be
    scheduled (~20 ms per op measured at load 12 on 2 cores, docs/cpu.md), while independent
    workers never wait for each other. Elsewhere (CUDA, one thread) there is no pool.
    """
    n = torch.get_num_threads() if device.type == "cpu" else 1
    if n <= 1:
        yield None
        return
    torch.set_num_threads(1)
    try:
        yield (_pool(n), n)
    finally:
        torch.set_num_threads(n)


def _summed_key_grads(slots, dk_shape, dv_shape, acc, device):
    """(dK, dV) summed over the workers' accumulation slots, in the workers' layout; zeros of
    ``dk_shape`` / ``dv_shape`` when no worker had a live block (every row fully masked)."""
    slots = [slot for slot in slots if slot]
    if not slots:
        return (torch.zeros(dk_shape, dtype=acc, device=device),
                torch.zeros(dv_shape, dtype=acc, device=device))
    return sum(slot["dk"] for slot in slots), sum(slot["dv"] for slot in slots)


def _for_each_block(work, blocks, workers) -> list:
    """Run ``work(block, slot)`` on every block with live keys; returns the ``slot`` dicts.

    Worker ``i`` of ``workers`` (from :func:`_block_workers`) runs a fixed share of the blocks
    (:func:`_balanced_shares`) in order with its own ``slot`` (a dict for private accumulators),
    so the results do not depend on thread timing."""
    blocks = [blk for blk in blocks if blk.key_runs]
    if workers is None or len(blocks) <= 1:
        slot: dict = {}
        for blk in blocks:
            work(blk, slot)
        return [slot]
    pool, n = workers
    shares = _balanced_shares(blocks, n)
    slots = [{} for _ in shares]

    def run_share(i):
        with torch.no_grad():  # grad mode is per thread: the caller's (an autograd.Function) is off
            for blk in shares[i]:
                work(blk, slots[i])

    for f in [pool.submit(run_share, i) for i in range(n)]:
        f.result()
    return slots


def _balanced_shares(blocks, n: int) -> list[list]:
    """Split the blocks into ``n`` shares of about equal work (rows x live keys), each in row
    order: largest block first to the least loaded share. Deterministic. Why not round robin: a
    causal mask's blocks grow with the row, so blocks ``0, 2`` vs ``1, 3`` of a 4-block causal
    problem is 4 : 6 units of work, and the call waits for the larger share."""
    loads, shares = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(blocks)), key=lambda i: -(blocks[i].r1 - blocks[i].r0) * blocks[i].num_keys):
        w = loads.index(min(loads))
        shares[w].append(i)
        loads[w] += (blocks[i].r1 - blocks[i].r0) * blocks[i].num_keys
    return [[blocks[i] for i in sorted(share)] for share in shares]


def _masked_scores(plan: _Plan, blk: _QueryBlock, q_rows, k_live, shape5):
    """``Q_blk K_liveᵀ`` (q already scaled) as ``[B, Hk, rows, G, L]``, -inf where masked."""
    s = torch.matmul(q_rows, k_live.transpose(-1, -2)).view(shape5)
    for offset, c0, c1 in blk.mask_runs:
        s[..., offset:offset + c1 - c0].masked_fill_(~plan.allowed(blk.r0, blk.r1, c0, c1), -math.inf)
    return s


def forward(q, k, v, startend_row_indices: Optional[torch.Tensor], causal: bool,
            softmax_scale: float, row_span: Optional[float] = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention forward. Returns ``out [B, Sq, Hq, D]`` and ``lse [B, Hq, Sq]`` in the
    accumulation dtype (fp32; float64 for float64 inputs, so that context parallelism's LSE merge
    keeps float64 accuracy; the public function returns it as fp32).
    ``row_span`` (the mask's mean row span, a tile hint for the Triton backend) is unused."""
    with _block_workers(q.device) as workers:
        if _uses_fused(q):
            return _forward_fused(q, k, v, startend_row_indices, causal, softmax_scale, workers)
        return _forward(q, k, v, startend_row_indices, causal, softmax_scale, workers)


def _forward(q, k, v, startend_row_indices, causal, softmax_scale, workers):
    b, sq, hq, _ = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hk
    acc = _acc_dtype(q.dtype)
    plan = _Plan(startend_row_indices, causal, sq, sk, hq, hk, q.device)
    qh = _query_layout(q, hk, acc) * softmax_scale  # a new tensor: never scale q in place
    kh, vh = _key_layout(k, acc), _key_layout(v, acc)
    out = torch.zeros(b, hk, sq, g, dv, dtype=acc, device=q.device)
    lse = torch.full((b, hk, sq, g), -math.inf, dtype=acc, device=q.device)

    def block_forward(blk: _QueryBlock, _slot: dict) -> None:
        rows, n = blk.r1 - blk.r0, blk.num_keys
        q_rows = qh[:, :, blk.r0:blk.r1].view(b, hk, rows * g, -1)
        s = _masked_scores(plan, blk, q_rows, _live(kh, blk.key_runs), (b, hk, rows, g, n))
        p = torch.softmax(s, dim=-1)
        # the largest probability of a row is exp(max - lse): lse = max score - log(max p)
        p_max, arg = p.max(dim=-1)
        empty = torch.isnan(p_max)  # a row whose keys are all masked: softmax gives NaN
        if bool(empty.any()):
            p.masked_fill_(empty.unsqueeze(-1), 0.0)
        lse_blk = (s.gather(-1, arg.unsqueeze(-1)).squeeze(-1) - torch.log(p_max))
        lse_blk = lse_blk.masked_fill_(empty, -math.inf)
        o = torch.matmul(p.view(b, hk, rows * g, n), _live(vh, blk.key_runs))
        out[:, :, blk.r0:blk.r1] = o.view(b, hk, rows, g, dv)
        lse[:, :, blk.r0:blk.r1] = lse_blk

    # blocks without live keys are fully masked: their zeros and -inf stay
    _for_each_block(block_forward, plan.blocks, workers)
    return (_from_query_layout(out).to(q.dtype),
            lse.permute(0, 1, 3, 2).reshape(b, hq, sq))


def backward(dout, dlse, q, k, v, out, lse, startend_row_indices: Optional[torch.Tensor],
             causal: bool, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the forward with respect to q, k, v (``dlse`` may be ``None``).

    The probabilities are ``exp(s - lse)`` with the given ``lse``, which need not be this
    call's own: context parallelism passes the log-sum-exp merged over all key chunks."""
    with _block_workers(q.device) as workers:
        # autograd hands a zero dlse when the log-sum-exp output was not used
        if _uses_fused(q) and (dlse is None or not bool(dlse.any())):
            return _backward_fused(dout, q, k, v, out, lse, startend_row_indices, causal,
                                   softmax_scale, workers)
        return _backward(dout, dlse, q, k, v, out, lse, startend_row_indices, causal,
                         softmax_scale, workers)


def _backward(dout, dlse, q, k, v, out, lse, startend_row_indices, causal, softmax_scale, workers):
    b, sq, hq, d = q.shape
    sk, hk, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hk
    acc = _acc_dtype(q.dtype)
    plan = _Plan(startend_row_indices, causal, sq, sk, hq, hk, q.device)
    qh = _query_layout(q, hk, acc) * softmax_scale  # a new tensor: never scale q in place
    kh, vh = _key_layout(k, acc), _key_layout(v, acc)
    doh = _query_layout(dout, hk, acc)
    delta = (doh * _query_layout(out, hk, acc)).sum(-1)  # [B, Hk, Sq, G]
    if dlse is not None:
        delta = delta - dlse.to(acc).view(b, hk, g, sq).transpose(2, 3)
    lse_h = lse.to(acc).view(b, hk, g, sq).transpose(2, 3)
    # fully masked rows: lse = -inf; use +inf so that every p = exp(s - lse) is exactly 0
    lse_h = lse_h.masked_fill(torch.isinf(lse_h), math.inf).contiguous()
    dq = torch.zeros(b, hk, sq, g, d, dtype=acc, device=q.device)

    def block_backward(blk: _QueryBlock, slot: dict) -> None:
        if not slot:  # this worker's own dK / dV accumulators
            slot["dk"] = torch.zeros(b, hk, sk, d, dtype=acc, device=q.device)
            slot["dv"] = torch.zeros(b, hk, sk, dv_dim, dtype=acc, device=q.device)
        rows, n = blk.r1 - blk.r0, blk.num_keys
        q_rows = qh[:, :, blk.r0:blk.r1].view(b, hk, rows * g, d)
        do_rows = doh[:, :, blk.r0:blk.r1].view(b, hk, rows * g, dv_dim)
        k_live, v_live = _live(kh, blk.key_runs), _live(vh, blk.key_runs)
        s = _masked_scores(plan, blk, q_rows, k_live, (b, hk, rows, g, n))
        p = s.sub_(lse_h[:, :, blk.r0:blk.r1].unsqueeze(-1)).exp_().view(b, hk, rows * g, n)
        _add_live(slot["dv"], torch.matmul(p.transpose(-1, -2), do_rows), blk.key_runs)
        dp = torch.matmul(do_rows, v_live.transpose(-1, -2)).view(b, hk, rows, g, n)
        ds = dp.sub_(delta[:, :, blk.r0:blk.r1].unsqueeze(-1)).view(b, hk, rows * g, n).mul_(p)
        dq[:, :, blk.r0:blk.r1] = torch.matmul(ds, k_live).mul_(softmax_scale).view(b, hk, rows, g, d)
        # ds is dS / softmax_scale and q_rows is softmax_scale * Q: their product is dK
        _add_live(slot["dk"], torch.matmul(ds.transpose(-1, -2), q_rows), blk.key_runs)

    dk, dv = _summed_key_grads(_for_each_block(block_backward, plan.blocks, workers),
                               (b, hk, sk, d), (b, hk, sk, dv_dim), acc, q.device)
    return (
        _from_query_layout(dq).to(q.dtype),
        dk.permute(0, 2, 1, 3).to(k.dtype),
        dv.permute(0, 2, 1, 3).to(v.dtype),
    )


# --------------------------------------------------------------------------------------------
# The CPU path proper: torch's fused CPU attention kernel on each query block's live keys.

def _fused_kernels():
    """torch's fused CPU attention (forward returns the log-sum-exp; the backward takes it), or
    None where this torch does not have it."""
    ops = torch.ops.aten
    if not hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu"):
        return None
    return (ops._scaled_dot_product_flash_attention_for_cpu,
            ops._scaled_dot_product_flash_attention_for_cpu_backward)


_FUSED = _fused_kernels()


def _uses_fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and _FUSED is not None


def fused_block_rows() -> int:
    """Query rows per block on the fused CPU path: ``2 * BLOCK_M`` (256). Measured at 1K tokens
    on the 2-core CPU (docs/cpu.md): 64 / 128 / 256 / 512 / 1024 rows gave a causal forward of
    94 / 53 / 45 / 46 / 57 ms; fewer, larger blocks pay less per-call overhead, but below two
    blocks per worker the two workers are unbalanced and larger blocks read more masked keys."""
    return 2 * BLOCK_M


def _bias(plan: _Plan, blk: _QueryBlock, num_heads: int, dtype: torch.dtype):
    """Additive mask (0 where allowed, -inf where masked) ``[B | 1, Hq | 1, rows, L]`` over the
    block's ``L`` live keys, or None when none of its live tiles is PARTIAL. Only the PARTIAL
    runs are evaluated element-wise; the UNMASKED ones stay 0."""
    if not blk.mask_runs:
        return None
    pieces = [(off, c1 - c0, plan.allowed_heads(blk.r0, blk.r1, c0, c1))
              for off, c0, c1 in blk.mask_runs]
    bm, hm = pieces[0][2].shape[:2]
    if sum(width for _, width, _ in pieces) == blk.num_keys:  # every live key is PARTIAL
        allowed = pieces[0][2] if len(pieces) == 1 else torch.cat([a for *_, a in pieces], -1)
        bias = torch.where(allowed, torch.zeros((), dtype=dtype),
                           torch.full((), -math.inf, dtype=dtype))
    else:
        bias = torch.zeros(bm, hm, blk.r1 - blk.r0, blk.num_keys, dtype=dtype, device=plan.device)
        for off, width, allowed in pieces:
            bias[..., off:off + width].masked_fill_(allowed.logical_not_(), -math.inf)
    if hm not in (1, num_heads):  # mask heads that group query heads: one row per query head
        bias = bias.repeat_interleave(num_heads // hm, dim=1)
    return bias


def _empty_rows(bias, blk: _QueryBlock):
    """``[B | 1, Hq | 1, rows]`` True where a row of the block has no allowed key, or None when
    no row can be empty (an UNMASKED live tile, or no mask at all)."""
    if bias is None or blk.has_unmasked:
        return None
    empty = bias.amax(-1) == -math.inf  # one pass over the mask (isinf + all took two)
    return empty if bool(empty.any()) else None


def _heads_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, S, H, D]`` -> a ``[B, H, S, D]`` view in the accumulation dtype (no copy for fp32)."""
    return x.to(dtype).transpose(1, 2)


def _causal_square_columns(plan: _Plan) -> torch.Tensor:
    """``[Sk]`` bool: True where key column ``c`` is masked for no row of ``[c, r1)`` beyond the
    causal diagonal (``r1``: the end of the query block holding row ``c``) in every (batch, mask
    head). A block whose diagonal square has only such columns is exactly a causal triangle."""
    if plan.startend is None:
        return torch.ones(plan.sk, dtype=torch.bool)
    cols = torch.arange(plan.sk)
    block_end = ((cols // plan.block_m + 1) * plan.block_m).clamp_max(plan.sq)
    ok = torch.ones(plan.startend.shape[:3], dtype=torch.bool)
    for start, end in masked_row_intervals(plan.startend.to(torch.int64).cpu(), plan.causal, plan.sq):
        ok &= (start >= block_end) | (end <= cols) | (start >= end)
    return ok.flatten(0, 1).all(0)


def _mark_causal_squares(plan: _Plan) -> None:
    """Set ``causal_square`` on the blocks of a causal, square (Sq == Sk) plan whose only PARTIAL
    keys are their diagonal square and whose square is the plain causal triangle: those are
    computed with the kernel's own ``is_causal`` on the square and without a mask on the keys
    before it, so no additive mask is built and the square's upper half is not computed."""
    if not plan.causal or plan.sq != plan.sk:
        return
    ok = None
    for i, blk in enumerate(plan.blocks):
        if blk.mask_runs != ((blk.num_keys - (blk.r1 - blk.r0), blk.r0, blk.r1),):
            continue
        if ok is None:
            ok = _causal_square_columns(plan)
        if bool(ok[blk.r0:blk.r1].all()):
            plan.blocks[i] = dataclasses.replace(blk, causal_square=True)


def _keys_before_square(blk: _QueryBlock) -> tuple:
    """The live key runs of a causal-square block left of its diagonal square (all UNMASKED)."""
    return tuple((c0, min(c1, blk.r0)) for c0, c1 in blk.key_runs if c0 < blk.r0)


def _square_forward(fwd, q_blk, kt, vt, blk: _QueryBlock, scale: float):
    """Forward of a causal-square block: ``is_causal`` on the square, no mask on the keys
    before it, the two merged by their log-sum-exps."""
    o, l = fwd(q_blk, kt[:, :, blk.r0:blk.r1], vt[:, :, blk.r0:blk.r1], 0.0, True, scale=scale)
    before = _keys_before_square(blk)
    if not before:
        return o, l
    o1, l1 = fwd(q_blk, _live(kt, before), _live(vt, before), 0.0, False, scale=scale)
    lse = torch.logaddexp(l, l1)
    o = o * (l - lse).exp_().unsqueeze(-1) + o1 * (l1 - lse).exp_().unsqueeze(-1)
    return o, lse


def _forward_fused(q, k, v, startend, causal, softmax_scale, workers):
    b, sq, hq, _ = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    acc = _acc_dtype(q.dtype)
    plan = _Plan(startend, causal, sq, sk, hq, hk, q.device, fused_block_rows())
    qt, kt, vt = (_heads_first(x, acc) for x in (q, k, v))
    out = torch.zeros(b, sq, hq, dv, dtype=acc, device=q.device)
    out_t = out.transpose(1, 2)
    lse = torch.full((b, hq, sq), -math.inf, dtype=acc, device=q.device)
    fwd = _FUSED[0]

    _mark_causal_squares(plan)

    def block_forward(blk: _QueryBlock, _slot: dict) -> None:
        if blk.causal_square:
            out_t[:, :, blk.r0:blk.r1], lse[:, :, blk.r0:blk.r1] = _square_forward(
                fwd, qt[:, :, blk.r0:blk.r1], kt, vt, blk, softmax_scale)
            return
        bias = _bias(plan, blk, hq, acc)
        o, l = fwd(qt[:, :, blk.r0:blk.r1], _live(kt, blk.key_runs), _live(vt, blk.key_runs),
                   0.0, False, attn_mask=bias, scale=softmax_scale)
        empty = _empty_rows(bias, blk)
        if empty is not None:  # fully masked rows: zeros and -inf, whatever the kernel gives
            l = l.masked_fill(empty, -math.inf)
            o = o.masked_fill(empty.unsqueeze(-1), 0.0)
        out_t[:, :, blk.r0:blk.r1] = o
        lse[:, :, blk.r0:blk.r1] = l

    _for_each_block(block_forward, plan.blocks, workers)
    return out.to(q.dtype), lse


def _backward_fused(dout, q, k, v, out, lse, startend, causal, softmax_scale, workers):
    b, sq, hq, d = q.shape
    sk, hk, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    acc = _acc_dtype(q.dtype)
    plan = _Plan(startend, causal, sq, sk, hq, hk, q.device, fused_block_rows())
    qt, kt, vt, dot, ot = (_heads_first(x, acc) for x in (q, k, v, dout, out))
    # fully masked rows: lse = -inf; +inf makes every p = exp(s - lse) exactly 0
    lse_t = lse.to(acc)
    lse_t = lse_t.masked_fill(torch.isinf(lse_t), math.inf)
    dq = torch.zeros(b, sq, hq, d, dtype=acc, device=q.device)
    dq_t = dq.transpose(1, 2)
    bwd = _FUSED[1]
    _mark_causal_squares(plan)

    def block_backward(blk: _QueryBlock, slot: dict) -> None:
        if not slot:  # this worker's own dK / dV accumulators
            slot["dk"] = torch.zeros(b, hk, sk, d, dtype=acc, device=q.device)
            slot["dv"] = torch.zeros(b, hk, sk, dv_dim, dtype=acc, device=q.device)
        rows = slice(blk.r0, blk.r1)
        if blk.causal_square:  # the square with is_causal, the keys before it without a mask
            gq, gk, gv = bwd(dot[:, :, rows], qt[:, :, rows], kt[:, :, rows], vt[:, :, rows],
                             ot[:, :, rows], lse_t[:, :, rows], 0.0, True, scale=softmax_scale)
            slot["dk"][:, :, rows] += gk
            slot["dv"][:, :, rows] += gv
            before = _keys_before_square(blk)
            if before:
                gq1, gk, gv = bwd(dot[:, :, rows], qt[:, :, rows], _live(kt, before),
                                  _live(vt, before), ot[:, :, rows], lse_t[:, :, rows], 0.0,
                                  False, scale=softmax_scale)
                gq = gq + gq1
                _add_live(slot["dk"], gk, before)
                _add_live(slot["dv"], gv, before)
            dq_t[:, :, rows] = gq
            return
        gq, gk, gv = bwd(dot[:, :, rows], qt[:, :, rows], _live(kt, blk.key_runs),
                         _live(vt, blk.key_runs), ot[:, :, rows], lse_t[:, :, rows], 0.0, False,
                         attn_mask=_bias(plan, blk, hq, acc), scale=softmax_scale)
        dq_t[:, :, rows] = gq
        _add_live(slot["dk"], gk, blk.key_runs)
        _add_live(slot["dv"], gv, blk.key_runs)

    dk, dv = _summed_key_grads(_for_each_block(block_backward, plan.blocks, workers),
                               (b, hk, sk, d), (b, hk, sk, dv_dim), acc, q.device)
    return dq.to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


# --------------------------------------------------------------------------------------------
# Staged backward (context parallelism; kernels/staged.py). Each stage is one whole
# :func:`backward` call and the stages' dQs are summed in fp32 (float64 for float64 inputs): on
# this path the pre-pass is part of each block's work, so there is no per-call work to share.

from .staged import WholeCallStages as _WholeCallStages  # noqa: E402

_STAGES = _WholeCallStages(backward)
backward_prepare = _STAGES.backward_prepare
backward_stage = _STAGES.backward_stage
backward_finish = _STAGES.backward_finish
