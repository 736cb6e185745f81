"""The exchange's helpers (flashmask3/distributed/comm.py): per-peer row counts of a round and its
outgoing rows as one buffer. The exchange itself runs in the multi-process gloo tests
(test_cp_attention.py, test_cp_runtime.py, test_cp_backward_calls.py)."""

from __future__ import annotations

import pytest
import torch

from flashmask3.distributed.comm import message_splits, outgoing_rows
from flashmask3.distributed.program import Message


class _Round:
    def __init__(self, sends, recvs):
        self.sends, self.recvs, self.exchange_cache = sends, recvs, {}


def _msgs(*spec):
    """Messages ``(peer, rows)`` laid out back to back."""
    out, row = [], 0
    for peer, rows in spec:
        out.append(Message(peer, row, row + rows, tuple(range(rows))))
        row += rows
    return tuple(out)


def test_message_splits_give_rows_per_peer_in_both_directions_and_are_kept():
    rnd = _Round(_msgs((1, 2), (3, 1)), _msgs((0, 4), (2, 3)))
    assert message_splits(rnd, False, 4) == ([0, 2, 0, 1], [4, 0, 3, 0])
    assert message_splits(rnd, True, 4) == ([4, 0, 3, 0], [0, 2, 0, 1])
    rnd.sends = ()  # kept: the round is not read again
    assert message_splits(rnd, False, 4) == ([0, 2, 0, 1], [4, 0, 3, 0])


def test_message_splits_refuse_messages_out_of_peer_order():
    with pytest.raises(ValueError, match="increasing peer order"):
        message_splits(_Round(_msgs((2, 1), (1, 1)), ()), False, 4)


def test_outgoing_rows_are_a_view_of_the_messages_rows():
    msgs = _msgs((1, 2), (2, 1))
    buf = torch.randn(5, 3)
    rows = outgoing_rows(buf, msgs)
    assert rows.data_ptr() == buf.data_ptr() and torch.equal(rows, buf[:3])
    assert outgoing_rows(None, msgs) is None and outgoing_rows(buf, ()) is None


def _self_exchange(backend: str, device: str, store: str, queue) -> None:
    """On a one-rank group: a forward round from a slice of a packed payload and a reverse
    round from a buffer, each one message to itself; puts the max error (or the exception text)
    on ``queue``."""
    import torch.distributed as dist

    from flashmask3.distributed.comm import DistExchange

    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
        ex = DistExchange(dist.group.WORLD)
        g = torch.Generator().manual_seed(0)
        own = torch.randn(5, 2, 1, 8, 2, 16, generator=g).to(device=device, dtype=torch.bfloat16)
        packed = torch.randn(3, 2, 1, 8, 2, 16, generator=g).to(device=device, dtype=torch.bfloat16)
        msg = _msgs((0, 2))
        rnd = _Round(msg, msg)
        recv = torch.empty_like(own[:2])
        ex.start(rnd, False, packed[1:3], recv).wait()
        err = (recv.float() - packed[1:3].float()).abs().max().item()
        back = torch.empty_like(recv)
        ex.start(rnd, True, own[2:4], back).wait()
        err = max(err, (back.float() - own[2:4].float()).abs().max().item())
        dist.destroy_process_group()
        queue.put(err)
    except Exception as e:  # reported to the parent, which fails the test with it
        queue.put(f"{type(e).__name__}: {e}")


@pytest.mark.parametrize("backend,device", [("gloo", "cpu"), pytest.param("nccl", "cuda", marks=pytest.mark.gpu)])
def test_dist_exchange_delivers_a_round_on_a_one_rank_group(backend, device, tmp_path):
    """The exchange's collective with real process groups (the multi-rank gloo suites cover
    peers; this one runs NCCL on the one GPU there is): rows sent to itself arrive exactly."""
    from tests.distributed.harness import run_one_rank

    got = run_one_rank(_self_exchange, backend, device, str(tmp_path / "store"), 120, "the one-rank exchange")
    assert got == 0.0, got
