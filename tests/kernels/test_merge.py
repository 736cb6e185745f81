"""The one-launch merge of partial attentions (kernels/merge.py), under the interpreter without
a GPU: attentions over key slices of one random problem, merged, against the float64 answer
over all keys; rows masked in every slice give out 0 and lse -inf, rows masked in some
slices are weighted as the others."""

from __future__ import annotations

import math

import pytest
import torch

from flashmask3.distributed.runtime import merge_stages as torch_merge
from flashmask3.kernels import merge


def _partials(n_parts, b=2, s=37, h=3, d=16, seed=0):
    """(outs, lses) of ``n_parts`` attentions over disjoint key slices in float64, and the
    attention over every key: rows 0-2 masked everywhere, rows 3-5 in the first slice."""
    g = torch.Generator().manual_seed(seed)
    n = 6 * n_parts
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, h, d, generator=g, dtype=torch.float64)
    allowed = torch.rand(b, h, s, n, generator=g) < 0.6
    allowed[:, :, :3] = False
    allowed[:, :, 3:6, :6] = False
    scores = (torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)).masked_fill(~allowed, -math.inf)

    def attend(cols):
        sc = scores[..., cols]
        lse = torch.logsumexp(sc, -1)
        p = torch.exp(sc - torch.where(torch.isinf(lse), 0, lse).unsqueeze(-1))
        return torch.einsum("bhqk,bkhd->bqhd", p, v[:, cols]), lse

    parts = [attend(slice(6 * i, 6 * i + 6)) for i in range(n_parts)]
    return [o for o, _ in parts], [l for _, l in parts], attend(slice(0, n))


def _check(out, lse, want_out, want_lse, tol):
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert out[:, :3].abs().max() == 0 and torch.isfinite(out).all()
    err = (out.double() - want_out).abs().max() / want_out.abs().max()
    assert err < tol, err
    fin = torch.isfinite(want_lse)
    assert (lse[fin].double() - want_lse[fin]).abs().max() < 1e-5


@pytest.mark.parametrize("n_parts", [1, 2, 3, 8, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_matches_the_attention_over_every_key(n_parts, dtype):
    outs, lses, (want_out, want_lse) = _partials(n_parts, seed=n_parts)
    outs = [o.to(dtype) for o in outs]
    lses = [l.float() for l in lses]
    out, lse = merge.merge_stages(outs, lses, dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _check(out, lse, want_out, want_lse, tol)


@pytest.mark.parametrize("d", [64, 256])
def test_merge_head_dims_and_agreement_with_the_torch_merge(d):
    outs, lses, (want_out, want_lse) = _partials(3, b=1, s=70, h=2, d=d, seed=d)
    out, lse = merge.merge_stages([o.float() for o in outs], [l.float() for l in lses],
                                  torch.float32)
    _check(out, lse, want_out, want_lse, 1e-5)
    ref_out, ref_lse = torch_merge([o.float() for o in outs], [l.float() for l in lses],
                                   torch.float32)
    assert (out - ref_out).abs().max() < 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - ref_lse[fin]).abs().max() < 1e-5


def test_merge_rejects_mismatched_parts():
    o = torch.zeros(1, 8, 2, 16)
    l = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="every out"):
        merge.merge_stages([o, torch.zeros(1, 8, 2, 32)], [l, l], torch.float32)
    with pytest.raises(ValueError, match="lse"):
        merge.merge_stages([o, o], [l, torch.zeros(1, 8, 2)], torch.float32)
    with pytest.raises(ValueError, match="one length"):
        merge.merge_stages([o, o], [l], torch.float32)
    with pytest.raises(ValueError, match="head dims"):
        merge.merge_stages([torch.zeros(1, 8, 2, 24)], [l], torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("n_parts", [2, 5, 8])
def test_merge_on_the_gpu_at_a_training_shape(n_parts):
    """The compiled kernel (not the interpreter) at a CP stage's shape: bf16, D=128, 16 heads,
    2048 rows, against the float64 torch merge of the same partials; twice with new tensors
    (the second call takes the bound launch's fast path)."""
    for seed in (n_parts, n_parts + 100):
        _gpu_merge_case(n_parts, seed)


def _gpu_merge_case(n_parts: int, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (1, 2048, 16, 128)
    outs = [torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16) for _ in range(n_parts)]
    lses = [torch.randn(1, 16, 2048, generator=g, device="cuda") * 3 for _ in range(n_parts)]
    lses[0][:, :, :64] = -math.inf  # rows masked in one stage
    for l in lses:
        l[:, :, 64:80] = -math.inf  # rows masked in every stage
    out, lse = merge.merge_stages(outs, lses, torch.bfloat16)
    ref_out, ref_lse = torch_merge([o.double() for o in outs], [l.double() for l in lses],
                                   torch.float64)
    assert out[:, 64:80].abs().max() == 0 and torch.isinf(lse[:, :, 64:80]).all()
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin].double() - ref_lse[fin]).abs().max() < 1e-4
    assert (out.double() - ref_out).abs().max() < 2e-2


def test_bound_merges_follow_the_part_count_and_dtypes():
    """The merge's launch is bound once per configuration (launcher.cached_bound): calls of one
    shape in a row with another part count, another output dtype or another part dtype each
    get their own launch (a key missing any of them would replay the previous call's)."""
    for n_parts, dtype, part_dtype in ((2, torch.float32, torch.float32), (3, torch.float32, torch.float32),
                                       (2, torch.bfloat16, torch.float32), (2, torch.float32, torch.bfloat16),
                                       (2, torch.float32, torch.float32)):
        outs, lses, (want_out, want_lse) = _partials(n_parts, seed=10 + n_parts)
        out, lse = merge.merge_stages([o.to(part_dtype) for o in outs], [l.float() for l in lses], dtype)
        assert out.dtype == dtype
        _check(out, lse, want_out, want_lse, 1e-5 if dtype == part_dtype == torch.float32 else 2e-2)
