"""The one-launch sum of a context-parallel rank's returned gradients (kernels/returns.py), under
the interpreter without a GPU and compiled on one: random own and returned wire rows, random
chunk targets (some chunks get nothing, some many rows), against the float64 sum."""

from __future__ import annotations

import pytest
import torch

from flashmask3.distributed.program import returns_index
from flashmask3.distributed.runtime import from_wire
from flashmask3.kernels import returns


def _case(n_own, n_own_rows, n_ret, b=2, cs=8, hk=3, d=16, dtype=torch.bfloat16, seed=0,
          device="cpu"):
    """Own rows (a permutation-free subset of the chunks, as a stage gives them), returned rows
    with random targets, and the float64 dK/dV they sum to."""
    g = torch.Generator().manual_seed(seed)
    own = torch.randn(n_own_rows, 2, b, cs, hk, d, generator=g).to(dtype)
    own_t = torch.randperm(n_own, generator=g)[:n_own_rows]
    ret = torch.randn(n_ret, 2, b, cs, hk, d, generator=g).to(dtype)
    ret_t = torch.randint(0, n_own, (n_ret,), generator=g)
    acc = torch.zeros(n_own, 2, b, cs, hk, d, dtype=torch.float64)
    acc.index_add_(0, own_t, own.double())
    acc.index_add_(0, ret_t, ret.double())
    want = from_wire(acc, None)
    to = dict(device=device)
    return (own.to(**to), own_t.to(**to), ret.to(**to), ret_t.to(**to)), want


def _run(own, own_t, ret, ret_t, n_own, k_like):
    own_index = returns_index(own_t, n_own) if own is not None else None
    ret_index = returns_index(ret_t, n_own) if ret is not None else None
    chunk = (ret if ret is not None else own).shape[3]
    return returns.add_returns(own, own_index, ret, ret_index, n_own, chunk, k_like)


def _k_like(b, n_own, cs, hk, d, dtype, device="cpu"):
    return torch.empty(b, n_own * cs, hk, d, dtype=dtype, device=device)


def test_returns_index_lists_each_chunks_rows_in_order():
    starts, rows = returns_index(torch.tensor([2, 0, 2, 3, 0, 2]), 5)
    assert starts.tolist() == [0, 2, 2, 5, 6, 6] and rows.tolist() == [1, 4, 0, 2, 5, 3]
    assert starts.dtype == rows.dtype == torch.int32
    assert [x.tolist() for x in returns_index([2, 0, 2, 3, 0, 2], 5)] == [starts.tolist(), rows.tolist()]


def test_add_returns_refuses_an_index_on_another_device():
    k = _k_like(1, 4, 8, 2, 16, torch.float32)
    rows = torch.zeros(3, 2, 1, 8, 2, 16)
    idx = tuple(x.to("meta") for x in returns_index([0, 1, 1], 4))
    with pytest.raises(ValueError, match="returned_index must be on k's device"):
        returns.add_returns(None, None, rows, idx, 4, 8, k)


def test_returns_index_rejects_a_target_outside_the_own_chunks():
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 3\)"):
        returns_index([0, 3], 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_own", [True, False])
def test_add_returns_matches_the_float64_sum(dtype, with_own):
    n_own, b, cs, hk, d = 6, 2, 8, 3, 16
    (own, own_t, ret, ret_t), (want_k, want_v) = _case(n_own, 4 if with_own else 0, 23, b, cs, hk,
                                                       d, dtype, seed=int(with_own))
    if not with_own:
        own = None
    dk, dv = _run(own, own_t, ret, ret_t, n_own, _k_like(b, n_own, cs, hk, d, dtype))
    assert dk.dtype == dv.dtype == dtype and dk.shape == want_k.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in ((dk, want_k), (dv, want_v)):
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < tol, err
    untouched = set(range(n_own)) - set(ret_t.tolist()) - (set(own_t.tolist()) if with_own else set())
    for c in untouched:  # a chunk nothing adds into is zero (no stale memory)
        assert dk[:, c * cs:(c + 1) * cs].abs().max() == 0


def test_add_returns_without_returned_rows_is_the_own_rows():
    (own, own_t, _, _), _ = _case(5, 5, 1, b=1, cs=16, hk=2, d=32, dtype=torch.float32, seed=3)
    dk, dv = _run(own, own_t, None, None, 5, _k_like(1, 5, 16, 2, 32, torch.float32))
    want = torch.zeros(5, *own.shape[1:])
    want[own_t] = own
    wk, wv = from_wire(want, None)
    assert torch.equal(dk, wk) and torch.equal(dv, wv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sources", ["both", "own", "returned"])
def test_sum_wire_rows_matches_the_float64_sum(dtype, sources):
    """The relay form of the kernel: wire rows out (a relaying rank's gradient return), each the
    float64 sum of the rows that add into it within rounding, zeros where none does."""
    n_out, b, cs, hk, d = 7, 2, 8, 3, 16
    (own, own_t, ret, ret_t), _ = _case(n_out, 5, 19, b, cs, hk, d, dtype, seed=11)
    want = torch.zeros(n_out, 2, b, cs, hk, d, dtype=torch.float64)
    if sources == "returned":
        own = None
    else:
        want.index_add_(0, own_t, own.double())
    if sources == "own":
        ret = None
    else:
        want.index_add_(0, ret_t, ret.double())
    k = _k_like(b, 1, cs, hk, d, dtype)
    out = returns.sum_wire_rows(own, returns_index(own_t, n_out) if own is not None else None,
                                ret, returns_index(ret_t, n_out) if ret is not None else None, n_out, cs, k)
    assert out.dtype == dtype and out.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.double() - want).abs().max() / want.abs().max() < tol
    touched = (set(own_t.tolist()) if own is not None else set()) | (set(ret_t.tolist()) if ret is not None else set())
    for c in set(range(n_out)) - touched:
        assert out[c].abs().max() == 0


def test_add_returns_rejects_rows_of_another_layout():
    k = _k_like(1, 4, 8, 2, 16, torch.float32)
    bad = torch.zeros(3, 2, 1, 8, 2, 32)
    idx = returns_index(torch.zeros(3, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="chunks of 8 keys"):
        returns.add_returns(None, None, bad, idx, 4, 8, k)
    with pytest.raises(ValueError, match="wire rows"):
        returns.add_returns(torch.zeros(3, 2, 1, 8, 2, 16), idx, torch.zeros(3, 1, 1, 8, 2, 16),
                            idx, 4, 8, k)


@pytest.mark.gpu
@pytest.mark.parametrize("n_ret", [0, 552])
def test_add_returns_on_the_gpu_at_a_cp_128_shape(n_ret):
    """The compiled kernel at the heaviest cp-128 rank's shape (8 own chunks of 128 keys, 8 KV
    heads, D=128, bf16; 552 returned rows), against the float64 sum; bitwise the same on a
    second run (no atomics)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    (own, own_t, ret, ret_t), (want_k, want_v) = _case(8, 8, max(n_ret, 1), b=1, cs=128, hk=8,
                                                       d=128, seed=n_ret, device="cuda")
    if n_ret == 0:
        ret = None
        acc = torch.zeros(8, *own.shape[1:], dtype=torch.float64)
        acc.index_add_(0, own_t.cpu(), own.double().cpu())
        want_k, want_v = from_wire(acc, None)
    k = _k_like(1, 8, 128, 8, 128, torch.bfloat16, "cuda")
    dk, dv = _run(own, own_t, ret, ret_t, 8, k)
    for got, want in ((dk, want_k), (dv, want_v)):
        err = (got.double().cpu() - want).abs().max() / want.abs().max()
        assert err < 1e-2, err
    dk2, dv2 = _run(own, own_t, ret, ret_t, 8, k)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)


@pytest.mark.gpu
def test_sum_wire_rows_on_the_gpu_at_a_relay_shape():
    """The compiled relay form at a hierarchical cp-128 relay's shape (12 rows out of 128 keys,
    8 KV heads, D=128, bf16; 10 stage rows and 40 returned rows): the float64 sum, and bitwise
    the same on a second run."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    (own, own_t, ret, ret_t), _ = _case(12, 10, 40, b=1, cs=128, hk=8, d=128, seed=7, device="cuda")
    want = torch.zeros(12, *own.shape[1:], dtype=torch.float64)
    want.index_add_(0, own_t.cpu(), own.double().cpu())
    want.index_add_(0, ret_t.cpu(), ret.double().cpu())
    k = _k_like(1, 1, 128, 8, 128, torch.bfloat16, "cuda")
    idx = (returns_index(own_t, 12), returns_index(ret_t, 12))

    def run():
        return returns.sum_wire_rows(own, idx[0], ret, idx[1], 12, 128, k)

    out = run()
    assert (out.double().cpu() - want).abs().max() / want.abs().max() < 1e-2
    assert torch.equal(out, run())
