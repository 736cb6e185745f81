"""flashmask_attention against the float64 dense reference, for every backend available here.

The torch path always runs; the Triton path runs on CUDA or, without a GPU, under
TRITON_INTERPRET=1 on a reduced set of shapes (the interpreter is slow).
"""

import math

import pytest
import torch

import flashmask3
import flashmask3.masks as M
from flashmask3.kernels import torch_path, triton_available
from tests.helpers import LAYOUTS, named_masks, random_columns
from tests.kernels.attention_checks import check_attention, make_qkv

BACKENDS = ["torch"] + (["triton"] if triton_available() else [])


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FLASHMASK3_BACKEND", request.param)
    # Small torch-path tiles so that short test sequences still span SKIP/PARTIAL/UNMASKED tiles.
    monkeypatch.setattr(torch_path, "BLOCK_M", 16)
    monkeypatch.setattr(torch_path, "BLOCK_N", 32)
    return request.param


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("name", list(named_masks(70)))
def test_every_mask_type(backend, name):
    mask = named_masks(70, batch_size=2, num_heads=1)[name].to(DEVICE)
    q, k, v = make_qkv(2, 70, 70, 4, 2, 16, torch.float32, DEVICE, seed=hash(name) % 1000)
    check_attention(q, k, v, mask)


@pytest.mark.parametrize("causal,c", LAYOUTS)
@pytest.mark.parametrize("hm", ["1", "hk", "hq"])
@pytest.mark.parametrize("sq,sk", [(45, 45), (37, 53), (53, 37)])
def test_random_columns_gqa_and_mask_heads(backend, causal, c, hm, sq, sk):
    hq, hk = 4, 2
    heads = {"1": 1, "hk": hk, "hq": hq}[hm]
    cols = random_columns(2, heads, sq, sk, causal, c, seed=sq * 7 + sk + c).to(DEVICE)
    q, k, v = make_qkv(2, sq, sk, hq, hk, 16, torch.float32, DEVICE, seed=sq + sk)
    check_attention(q, k, v, cols, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(33, 33), (20, 50), (50, 20)])
def test_no_mask(backend, causal, sq, sk):
    q, k, v = make_qkv(1, sq, sk, 2, 1, 32, torch.float32, DEVICE, seed=sq)
    check_attention(q, k, v, None, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["causal_document", "global_sliding_window", "prefix_document"])
def test_half_precision(backend, dtype, name):
    if backend == "triton" and dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("bf16 on the Triton backend needs a CUDA GPU (the CPU interpreter computes bf16 dots wrongly)")
    mask = named_masks(64)[name].to(DEVICE)
    q, k, v = make_qkv(1, 64, 64, 2, 2, 32, dtype, DEVICE, seed=7)
    check_attention(q, k, v, mask)


def test_fully_masked_rows_give_zeros_and_zero_grads(backend):
    # Rows 5..9 are masked for every key: causal C=2 with [LTS, LTE) = [5, 10) on all columns
    # plus the bottom-right diagonal.
    s = 24
    cols = torch.stack([torch.full((s,), 5), torch.full((s,), 10)], -1).view(1, 1, s, 2).int().to(DEVICE)
    q, k, v = make_qkv(1, s, s, 2, 2, 16, torch.float32, DEVICE, seed=3)
    out, lse = flashmask3.flashmask_attention(q, k, v, cols, causal=True, return_softmax_lse=True)
    assert torch.equal(out[0, 5:10], torch.zeros_like(out[0, 5:10]))
    assert bool(torch.isneginf(lse[0, :, 5:10]).all()) and bool(torch.isfinite(lse[0, :, :5]).all())
    (out.square().sum()).backward()
    assert torch.equal(q.grad[0, 5:10], torch.zeros_like(q.grad[0, 5:10]))
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    check_attention(*make_qkv(1, s, s, 2, 2, 16, torch.float32, DEVICE, seed=4), cols, causal=True)


def test_fully_masked_tiles_are_never_read(backend):
    """Poison K/V of the second document: rows of the first must stay finite and correct."""
    mask = M.document_mask([64, 64]).to(DEVICE)
    q, k, v = make_qkv(1, 128, 128, 2, 2, 16, torch.float32, DEVICE, seed=5)
    with torch.no_grad():
        k2, v2 = k.detach().clone(), v.detach().clone()
        k2[:, 64:] = float("nan")
        v2[:, 64:] = float("nan")
    out = flashmask3.flashmask_attention(q.detach(), k2, v2, mask)
    ref = flashmask3.flashmask_attention(q.detach()[:, :64], k.detach()[:, :64], v.detach()[:, :64],
                                         M.document_mask([64]).to(DEVICE))
    assert torch.isfinite(out[:, :64]).all()
    torch.testing.assert_close(out[:, :64], ref[:, :64], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window,causal", [(5, True), ((4, 2), False), ((-1, 3), False), (6, False)])
@pytest.mark.parametrize("sq,sk", [(30, 30), (20, 33)])
def test_window_size(backend, window, causal, sq, sk):
    q, k, v = make_qkv(1, sq, sk, 2, 1, 16, torch.float32, DEVICE, seed=11)
    out = flashmask3.flashmask_attention(q, k, v, causal=causal, window_size=window)
    left, right = (window, window) if isinstance(window, int) else window
    i = torch.arange(sq).view(-1, 1) + (sk - sq)
    j = torch.arange(sk).view(1, -1)
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if left != -1:
        allowed &= j >= i - left
    if causal:
        allowed &= j <= i
    elif right != -1:
        allowed &= j <= i + right
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, 2)) / 4.0
    p = s.masked_fill(~allowed.to(DEVICE), -math.inf).softmax(-1).nan_to_num(0.0)
    ref = torch.einsum("bhqk,bkhd->bqhd", p, v.double().repeat_interleave(2, 2))
    torch.testing.assert_close(out.double(), ref, rtol=2e-4, atol=2e-5)


def test_softmax_scale_and_head_dim(backend):
    mask = M.causal_document_mask([20, 12]).to(DEVICE)
    q, k, v = make_qkv(1, 32, 32, 2, 1, 64, torch.float32, DEVICE, seed=9)
    check_attention(q, k, v, mask, softmax_scale=0.3)
