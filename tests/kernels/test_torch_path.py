"""Properties of the blockwise torch path beyond numerics: memory and tile usage."""

import pytest
import torch

import flashmask3.masks as M
from flashmask3.kernels import torch_path
from tests.helpers import named_masks
from tests.kernels.attention_checks import make_qkv
from tests.reference import reference_attention, rel_err


def test_keys_visited_follow_the_classification(monkeypatch):
    """The fused kernel calls of each query block cover exactly its live keys (key tiles that
    are not SKIP for some batch row / head), none of the skipped ones: one call per block, or
    two for a causal-square block with keys before its square."""
    monkeypatch.setattr(torch_path, "BLOCK_M", 8)  # fused blocks of 2 * 8 = 16 rows
    monkeypatch.setattr(torch_path, "BLOCK_N", 16)
    mask = M.causal_document_mask([16, 48, 32, 32])
    q, k, v = make_qkv(1, 128, 128, 2, 2, 8, torch.float32)
    seen = []
    real_fwd, real_bwd = torch_path._FUSED

    def counting_fwd(q_blk, k_live, *args, **kwargs):
        seen.append(k_live.shape[2])
        return real_fwd(q_blk, k_live, *args, **kwargs)

    monkeypatch.setattr(torch_path, "_FUSED", (counting_fwd, real_bwd))
    torch_path.forward(q.detach(), k.detach(), v.detach(), mask.startend_row_indices, True, 0.3)
    cls = M.classify_tiles(mask.startend_row_indices, True, 128, 128, 16, 16)
    live = cls != M.SKIP
    assert int(live.sum()) < cls.numel() // 2  # the mask is sparse: most tiles are skipped
    plan = torch_path._Plan(mask.startend_row_indices, True, 128, 128, 2, 2, q.device, 16)
    torch_path._mark_causal_squares(plan)
    split = sum(1 for blk in plan.blocks if blk.causal_square and blk.key_runs[0][0] < blk.r0)
    assert split > 0
    assert len(seen) == int(live.flatten(0, 2).any(-1).sum()) + split
    assert sum(seen) == 16 * int(live.sum())


def test_causal_squares_are_found_exactly(monkeypatch):
    """A block is a causal square only when its diagonal square is the plain causal triangle:
    every block of a causal mask; the blocks of a causal document mask whose square no
    document boundary crosses and whose keys before the square are all unmasked (a PARTIAL
    tile before the square disqualifies it); none of a non-causal or sliding-window mask."""
    monkeypatch.setattr(torch_path, "BLOCK_N", 16)

    def squares(mask):
        plan = torch_path._Plan(mask.startend_row_indices, mask.causal, 128, 128, 1, 1,
                                torch.device("cpu"), 16)
        torch_path._mark_causal_squares(plan)
        return [blk.causal_square for blk in plan.blocks]

    assert all(squares(M.causal_mask(128)))
    # documents [0, 16), [16, 56), [56, 64), [64, 128): the square [48, 64) holds a boundary
    assert squares(M.causal_document_mask([16, 40, 8, 64])) == [True] * 3 + [False] + [True] * 4
    # [0, 16), [16, 64), [64, 72), [72, 128): the square [64, 80) holds a boundary, and the
    # blocks after it see the PARTIAL key tile [64, 80)
    assert squares(M.causal_document_mask([16, 48, 8, 56])) == [True] * 4 + [False] * 4
    assert not any(squares(M.document_mask([16, 48, 8, 56])))
    assert not any(squares(M.sliding_window_mask(128, 8)))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.float64, 1e-10)])
@pytest.mark.parametrize("name", list(named_masks(90)))
def test_fused_blocks_match_the_float64_reference(monkeypatch, name, dtype, tol):
    """The fused CPU path over several query blocks (16 rows) and key tiles (8 columns), GQA:
    out, lse and the gradients through out alone (the fused backward: dlse is None) against the
    float64 dense reference; fully masked rows give zeros and -inf."""
    monkeypatch.setattr(torch_path, "BLOCK_M", 8)
    monkeypatch.setattr(torch_path, "BLOCK_N", 8)
    cols = named_masks(90)[name]
    cols = cols.startend_row_indices, cols.causal
    q, k, v = make_qkv(1, 90, 90, 4, 2, 16, dtype, seed=hash(name) % 1000)
    out, lse = torch_path.forward(q.detach(), k.detach(), v.detach(), *cols, 0.3)
    ref_out, ref_lse = reference_attention(q, k, v, *cols, 0.3)
    assert rel_err(out, ref_out) <= tol and rel_err(lse, ref_lse) <= tol
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    empty = torch.isinf(ref_lse).transpose(1, 2)  # [B, S, H]
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    dout = torch.randn_like(out)
    grads = torch_path.backward(dout, None, q.detach(), k.detach(), v.detach(), out, lse, *cols, 0.3)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout.double())
    for g, rg in zip(grads, ref_grads):
        assert not torch.isnan(g).any()
        assert rel_err(g, rg) <= tol


def test_fully_masked_rows_give_zero_gradients_on_the_fused_path(monkeypatch):
    """Rows no key may attend (a key range mask leaving the first rows empty): zero output,
    -inf lse, and no gradient flows from them."""
    monkeypatch.setattr(torch_path, "BLOCK_M", 8)
    monkeypatch.setattr(torch_path, "BLOCK_N", 8)
    s = 48
    cols = torch.zeros(1, 1, s, 2, dtype=torch.int32)  # non-causal [LTS, UTE): rows 0..19 masked
    cols[..., 0] = s
    cols[..., 1] = 20
    q, k, v = make_qkv(1, s, s, 2, 2, 8, torch.float32, seed=4)
    out, lse = torch_path.forward(q.detach(), k.detach(), v.detach(), cols, False, 0.35)
    assert torch.isinf(lse[:, :, :20]).all() and torch.isfinite(lse[:, :, 20:]).all()
    assert torch.equal(out[:, :20], torch.zeros_like(out[:, :20]))
    dq, dk, dv = torch_path.backward(torch.randn_like(out), None, q.detach(), k.detach(),
                                     v.detach(), out, lse, cols, False, 0.35)
    assert torch.equal(dq[:, :20], torch.zeros_like(dq[:, :20]))
    ref_out, _ = reference_attention(q, k, v, cols, False, 0.35)
    assert rel_err(out, ref_out) <= 2e-4
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_worker_threads_leave_torch_threads_as_they_were():
    """The CPU path spreads query blocks over worker threads and restores torch's setting."""
    before = torch.get_num_threads()
    q, k, v = make_qkv(1, 300, 300, 2, 1, 16, torch.float32)
    out = torch_path.forward(q.detach(), k.detach(), v.detach(), None, True, 0.25)[0]
    assert torch.get_num_threads() == before
    assert torch.isfinite(out).all()


@pytest.mark.gpu
def test_torch_path_memory_is_linear_in_seqlen():
    """At S=16K a dense score matrix would need 1 GiB per head; the torch path stays O(S·block)."""
    s, h, d = 16384, 2, 64
    q, k, v = (t.detach() for t in make_qkv(1, s, s, h, h, d, torch.bfloat16, "cuda"))
    mask = M.causal_document_mask(M.random_document_lengths(s, 2048)).to("cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = torch_path.forward(q, k, v, mask.startend_row_indices, True, d ** -0.5)
    torch_path.backward(torch.randn_like(out), None, q, k, v, out, lse, mask.startend_row_indices, True, d ** -0.5)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 128 * 2 ** 20, f"torch path used {extra / 2**20:.0f} MiB beyond its inputs"


def test_backward_takes_a_merged_lse_like_context_parallelism():
    """Two key chunks, forward on each, outputs merged by their log-sum-exp; the backward of
    each chunk with the merged out/lse must sum to the gradient of attention over all keys."""
    mask = M.causal_document_mask([40, 30, 26])
    q, k, v = (t.detach() for t in make_qkv(1, 96, 96, 4, 2, 16, torch.float32, seed=3))
    cols = mask.startend_row_indices
    dout = torch.randn_like(q)
    out, lse = torch_path.forward(q, k, v, cols, True, 0.25)
    full = torch_path.backward(dout, None, q, k, v, out, lse, cols, True, 0.25)
    # chunk the keys: columns keep their rows; the causal diagonal offset is Sk - Sq, so use a
    # non-causal 4-column equivalent of the same mask to cut it freely
    dense = mask.to_dense()[0, 0]
    parts = []
    for c0, c1 in ((0, 50), (50, 96)):
        allowed = dense[:, c0:c1]
        # masked rows of each key column as two intervals [LTS, LTE) ∪ [UTS, UTE) (contiguous
        # visible run per column under a causal document mask)
        vis = allowed.t()  # [keys, rows]
        first = torch.where(vis.any(1), vis.float().argmax(1), 96)
        last = torch.where(vis.any(1), 96 - vis.flip(1).float().argmax(1), 96)
        col4 = torch.stack([last, torch.full_like(last, 96), torch.zeros_like(first), first], -1)
        col4 = col4.to(torch.int32).view(1, 1, c1 - c0, 4)
        o, l = torch_path.forward(q, k[:, c0:c1], v[:, c0:c1], col4, False, 0.25)
        parts.append((c0, c1, col4, o, l))
    merged_lse = torch.logaddexp(parts[0][4], parts[1][4])
    merged = sum(o * torch.exp(l - merged_lse).transpose(1, 2).unsqueeze(-1) for *_, o, l in parts)
    torch.testing.assert_close(merged, out, rtol=1e-5, atol=1e-6)
    dq = torch.zeros_like(q)
    for c0, c1, col4, _, _ in parts:
        gq, gk, gv = torch_path.backward(dout, None, q, k[:, c0:c1], v[:, c0:c1], merged, merged_lse,
                                         col4, False, 0.25)
        dq += gq
        torch.testing.assert_close(gk, full[1][:, c0:c1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gv, full[2][:, c0:c1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dq, full[0], rtol=1e-4, atol=1e-5)
