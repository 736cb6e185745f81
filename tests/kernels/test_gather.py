"""The one-launch moves between wire rows and the key layout (kernels/gather.py), under the
interpreter without a GPU and compiled on one: the gather of a stage's keys (random wire rows, a
random, repeating row index, written into a slice of a key buffer whose other keys must stay as
they were) and the pack of K/V into wire rows (in order and reordered), against the torch paths
of ``distributed.runtime.gather_stage_keys`` / ``pack_wire_rows``."""

from __future__ import annotations

import pytest
import torch

from flashmask3.distributed.runtime import gather_stage_keys
from flashmask3.kernels import gather


def _case(n_src=7, n_rows=5, keys=9, b=2, cs=8, hk=3, d=16, dtype=torch.bfloat16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(n_src, 2, b, cs, hk, d, generator=g).to(dtype).to(device)
    rows = torch.randint(0, n_src, (n_rows,), generator=g).to(device)
    dst = torch.randn(2, b, keys * cs, hk, d, generator=g).to(dtype).to(device)
    return src, rows, dst


def _interpreted():
    if not gather.usable(torch.empty(1)):
        pytest.skip("the gather kernel needs CUDA or TRITON_INTERPRET=1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("pos", [0, 3])
def test_gather_keys_matches_the_torch_path(dtype, pos):
    _interpreted()
    src, rows, dst = _case(dtype=dtype, seed=pos)
    want = dst.clone()
    gather_stage_keys(src, rows, want, pos)  # no backend: the torch ops
    got = dst.clone()
    gather.gather_keys(src, rows.to(torch.int32), got, pos)
    assert torch.equal(got, want)
    cs = src.shape[3]
    for i, r in enumerate(rows.tolist()):  # and what the layout means, chunk by chunk
        keys = slice((pos + i) * cs, (pos + i + 1) * cs)
        assert torch.equal(got[0, :, keys], src[r, 0]) and torch.equal(got[1, :, keys], src[r, 1])
    untouched = torch.ones(dst.shape[2], dtype=torch.bool)
    untouched[pos * cs:(pos + len(rows)) * cs] = False
    assert torch.equal(got[:, :, untouched], dst[:, :, untouched])


def test_bound_gathers_follow_every_value_they_fix():
    """The gather's and the pack's launches are bound once per configuration
    (launcher.cached_bound): calls of one shape in a row at another position, with another
    index dtype, with and without rows each get their own launch (a key missing any of them
    would replay the previous call's)."""
    _interpreted()
    from flashmask3.distributed.runtime import pack_wire_rows

    src, rows, dst = _case(seed=7)
    for pos, index_dtype in ((0, torch.int64), (2, torch.int64), (2, torch.int32), (0, torch.int64)):
        want = dst.clone()
        gather_stage_keys(src, rows, want, pos)
        got = dst.clone()
        gather.gather_keys(src, rows.to(index_dtype), got, pos)
        assert torch.equal(got, want), (pos, index_dtype)
    b, cs, hk, d = src.shape[2:]
    k, v = (torch.randn(b, 4 * cs, hk, d) for _ in range(2))
    for chunks in (torch.tensor([3, 1, 0, 2]), None, torch.tensor([0, 1, 2, 3]), torch.tensor([2, 2, 1, 0])):
        want = pack_wire_rows(k, v, chunks, cs)
        got = torch.empty_like(want)
        gather.pack_wire(k, v, chunks, got)
        assert torch.equal(got, want), chunks


def test_gather_keys_rejects_other_layouts():
    src, rows, dst = _case()
    with pytest.raises(ValueError, match="src"):
        gather.gather_keys(src[:, :1], rows, dst, 0)
    with pytest.raises(ValueError, match="dst"):
        gather.gather_keys(src, rows, dst[:, :1], 0)
    with pytest.raises(ValueError, match="dst"):
        gather.gather_keys(src, rows, dst.float(), 0)
    with pytest.raises(ValueError, match="rows"):
        gather.gather_keys(src, rows.float(), dst, 0)
    with pytest.raises(ValueError, match="do not fit"):
        gather.gather_keys(src, rows, dst, 5)


@pytest.mark.gpu
def test_pack_wire_on_the_gpu_at_a_cp_128_shape():
    """The compiled pack at a cp-128 stage's dK/dV shape (100 chunks of 128 keys, 8 KV heads,
    D=128, bf16), reordered, and a batch of two in order; each twice with new tensors (the
    second call takes the bound launch's fast path)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from flashmask3.distributed.runtime import pack_wire_rows

    g = torch.Generator(device="cuda").manual_seed(3)
    for b, n, rows in ((1, 100, torch.randperm(100, device="cuda")), (2, 17, None)) * 2:
        k, v = (torch.randn(b, n * 128, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        rows = None if rows is None else rows[torch.randperm(n, device="cuda")]
        want = pack_wire_rows(k, v, rows, 128)
        got = torch.empty_like(want)
        gather.pack_wire(k, v, rows, got)
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_gather_keys_on_the_gpu_at_a_cp_128_shape():
    """The compiled kernel at a cp-128 stage's shape (100 chunks of 128 keys, 8 KV heads,
    D=128, bf16) and a batch of two, into the middle of a key buffer; each twice with new
    tensors (the second call takes the bound launch's fast path)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for seed, (b, n) in enumerate(((1, 100), (2, 17)) * 2):
        src, rows, dst = _case(n_src=300, n_rows=n, keys=130, b=b, cs=128, hk=8, d=128, device="cuda", seed=seed)
        want = dst.clone()
        gather_stage_keys(src, rows, want, 20)
        got = dst.clone()
        gather.gather_keys(src, rows, got, 20)
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("with_rows", [True, False])
def test_pack_wire_matches_the_torch_path(dtype, with_rows):
    """Wire row j = key chunk rows[j] of K and V (every chunk in order without rows), against
    ``to_wire`` + ``index_select``; a batch of two."""
    _interpreted()
    from flashmask3.distributed.runtime import pack_wire_rows, to_wire

    g = torch.Generator().manual_seed(int(with_rows))
    b, n, cs, hk, d = 2, 6, 8, 3, 16
    k, v = (torch.randn(b, n * cs, hk, d, generator=g).to(dtype) for _ in range(2))
    rows = torch.tensor([4, 0, 5, 5, 2]) if with_rows else None
    want = pack_wire_rows(k, v, rows, cs)  # no backend: the torch ops
    ref = to_wire(k, v, cs) if rows is None else to_wire(k, v, cs)[rows]
    assert torch.equal(want, ref)
    got = torch.full_like(want, float("nan"))
    gather.pack_wire(k, v, rows, got)
    assert torch.equal(got, want)


def test_pack_wire_rejects_other_layouts():
    k = torch.zeros(1, 16, 2, 16)
    out = torch.zeros(2, 2, 1, 8, 2, 16)
    with pytest.raises(ValueError, match="k and v"):
        gather.pack_wire(k, torch.zeros(1, 8, 2, 16), None, out)
    with pytest.raises(ValueError, match="out"):
        gather.pack_wire(k, k, None, out[:, :1])
    with pytest.raises(ValueError, match="all 16 keys"):
        gather.pack_wire(k, k, None, out[:1])
    with pytest.raises(ValueError, match="rows"):
        gather.pack_wire(k, k, torch.tensor([0, 1, 1]), out)
