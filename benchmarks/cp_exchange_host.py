"""Host time to issue one exchange round: one ``P2POp`` per message (``batch_isend_irecv``, the
exchange before session 32) against ``DistExchange``'s one ``all_to_all_single`` per round.

Two gloo processes on this machine's CPU (no GPU needed): both issue a round of ``n`` messages
(half sends, half receives, equal bytes either way) to each other; rank 0 times the issue call
(``time.perf_counter`` around it, before ``wait``), median over ``--reps``. The per-layer
columns are ESTIMATES: the measured cost per message (or per call) times what a rank of a real
plan issues per layer (128K-token corpus document mask, forward rounds and gradient returns),
flat and hierarchical. torch's Python layer per ``isend``/``irecv`` is the same for NCCL up to
the backend call; NCCL's enqueue behind it is not measured here (no two GPUs).

    python benchmarks/cp_exchange_host.py --out benchmarks/results/cp_exchange_host
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import run_environment  # noqa: E402

ROW = (2, 1, 128, 8, 16)  # one wire row's trailing shape (K/V, batch, chunk, kv heads, head dim): 64 KB fp32


def _p2p_round(peer: int, n: int, send: torch.Tensor, recv: torch.Tensor):
    """The exchange before session 32: one P2POp per message, one batch."""
    half = n // 2
    ops = [dist.P2POp(dist.isend, send[i:i + 1], peer, tag=0) for i in range(half)]
    ops += [dist.P2POp(dist.irecv, recv[i:i + 1], peer, tag=0) for i in range(half)]
    return dist.batch_isend_irecv(ops)


def _worker(rank: int, world: int, port: int, counts: list, reps: int, queue) -> None:
    from flashmask3.distributed.comm import DistExchange
    from flashmask3.distributed.program import Message

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    peer = 1 - rank
    ex = DistExchange(dist.group.WORLD)
    out = {}
    for n in counts:
        half = n // 2
        send, recv = torch.full((half, *ROW), float(rank + 1)), torch.empty(half, *ROW)
        msg = (Message(peer, 0, half, tuple(range(half))),)
        rnd = SimpleNamespace(sends=msg, recvs=msg, exchange_cache={})

        def p2p():
            return _p2p_round(peer, n, send, recv)

        def collective():
            return [ex.start(rnd, False, send, recv)]

        for name, issue in (("p2p", p2p), ("all_to_all", collective)):
            times = []
            for i in range(reps + 3):
                dist.barrier()
                t0 = time.perf_counter()
                works = issue()
                dt = time.perf_counter() - t0
                for w in works:
                    w.wait()
                if i >= 3:
                    times.append(dt)
            out[(name, n)] = statistics.median(times)
            if not bool((recv == peer + 1).all()):
                raise RuntimeError(f"{name}: the peer's rows did not arrive")
            recv.zero_()
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def nccl_one_rank(reps: int, port: int) -> float:
    """Median host µs to issue ``DistExchange.start`` (one ``all_to_all_single``) on a one-rank
    NCCL group, a round of one 16-row message to itself (the only NCCL group one GPU allows)."""
    from flashmask3.distributed.comm import DistExchange
    from flashmask3.distributed.program import Message

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        ex = DistExchange(dist.group.WORLD)
        send = torch.randn(16, *ROW, device="cuda")
        recv = torch.empty_like(send)
        msg = (Message(0, 0, 16, tuple(range(16))),)
        rnd = SimpleNamespace(sends=msg, recvs=msg, exchange_cache={})
        times = []
        for i in range(reps + 5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            batch = ex.start(rnd, False, send, recv)
            dt = time.perf_counter() - t0
            batch.wait()
            if i >= 5:
                times.append(dt)
        torch.cuda.synchronize()
        if not torch.equal(recv, send):
            raise RuntimeError("NCCL: the round's rows did not arrive")
        return statistics.median(times) * 1e6
    finally:
        dist.destroy_process_group()


def corpus_plans(cps, seqlen: int = 131072) -> list[tuple]:
    """``(cp, nodes, plan)`` of a 128K-token corpus document mask (sparse balance) for each cp,
    flat and hierarchical (8 GPUs a node): the plans both tables of this benchmark read."""
    import flashmask3.masks as M
    from benchmarks.scale_model import experiment as X
    from flashmask3.distributed import plan

    lens = next(iter(X.make_datasets(seqlen, targets=[0.78], sequences=1).values()))["sequences"][0]
    mask = M.causal_document_mask(list(lens))
    return [(cp, nodes, plan(mask, None, cp, balance="sparse", nodes=nodes))
            for cp in cps for nodes in sorted({1, max(1, cp // 8)})]


def _one_view(parts) -> bool:
    """Session 32's test for a round sent as a view: its parts ``(packed, start, stop)`` lie
    back to back in one of the two buffers."""
    (p, _, b), *rest = parts
    for q, c, d in rest:
        if q != p or c != b:
            return False
        b = d
    return True


def _session32_send_side(prog, k, v, backend):
    """The forward's send side as session 32 built it, rebuilt from ``prog`` for the A/B: all
    own wire rows, a pack of the messages that were not one run of own chunks, then one gather
    per direct round whose messages were not back to back in one of the two (the collective's
    buffer). Returns a function that does it once."""
    from flashmask3.distributed.runtime import pack_wire_rows

    pos = {c: i for i, c in enumerate(prog.own_chunks)}
    pack, gathers = [], []
    for r in prog.rounds:
        if r.relay or not r.n_send:
            continue
        parts = []
        for m in r.sends:
            rows = [pos[c] for c in m.chunks]
            if rows == list(range(rows[0], rows[0] + len(rows))):
                parts.append((False, rows[0], rows[-1] + 1))
            else:
                parts.append((True, len(pack), len(pack) + len(rows)))
                pack += rows
        if not _one_view(parts):
            gathers.append(torch.tensor([pos[c] for m in r.sends for c in m.chunks], device=k.device))
    pack = torch.tensor(pack, device=k.device) if pack else None

    def run():
        own = pack_wire_rows(k, v, None, prog.chunk_size, backend)
        if pack is not None:
            own.index_select(0, pack)
        for rows in gathers:
            own.index_select(0, rows)
    return run


def send_side(plans, kv_heads: int = 8, head_dim: int = 128) -> list[dict]:
    """GPU ms (``triton.testing.do_bench``, median) of the send side of a real exchange's forward
    for the rank that sends the most rows, bf16, each of ``plans`` (:func:`corpus_plans`): now
    (one pack of every packed round's rows from K/V, the rounds sent as views of it) against
    session 32's (:func:`_session32_send_side`), alternating in one process on the same
    inputs."""
    import triton

    from flashmask3.distributed import EmulatedExchange, prepare_rank
    from flashmask3.distributed.runtime import _Rounds
    from flashmask3.kernels import get_backend

    backend = get_backend("triton")
    out = []
    for cp, nodes, p in plans:
        sent = [0] * cp
        for rnd in p.rounds:
            if not rnd.relay:
                for t in rnd.transfers:
                    sent[t.src] += len(t.chunks)
        rank = max(range(cp), key=sent.__getitem__)
        prog = prepare_rank(p, rank, "cuda", "overlap")
        k, v = (torch.randn(1, p.local_seqlen, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))

        silent = EmulatedExchange(k.new_empty(0), cp, rank, copy=False)  # issues nothing

        def now():  # the runtime's own forward send side, nothing else on the device
            _Rounds(prog, silent, k, v, backend)

        before = _session32_send_side(prog, k, v, backend)
        times = {"now_ms": [], "session32_ms": []}
        for _ in range(3):
            times["now_ms"].append(triton.testing.do_bench(now, warmup=25, rep=100))
            times["session32_ms"].append(triton.testing.do_bench(before, warmup=25, rep=100))
        rows = sum(r.n_send for r in prog.rounds if r.source is None)
        row_bytes = 2 * p.chunk_size * kv_heads * head_dim * 2
        out.append({"cp": cp, "nodes": nodes, "rank": rank, "rows": rows, "mbytes": rows * row_bytes / 1e6,
                    **{key: statistics.median(t) for key, t in times.items()}})
    return out


def per_layer_counts(plans) -> list[dict]:
    """Messages (sends + receives) and rounds a rank issues per layer (forward rounds plus the
    gradient returns), median and max over ranks, for each of ``plans`` (:func:`corpus_plans`)."""
    rows = []
    for cp, nodes, p in plans:
        per = [0] * cp
        for rnd in p.rounds:
            for t in rnd.transfers:
                per[t.src] += 1
                per[t.dst] += 1
        rows.append({"cp": cp, "nodes": nodes, "rounds": len(p.rounds),
                     "messages_median": 2 * int(statistics.median(per)), "messages_max": 2 * max(per)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", type=int, nargs="+", default=[16, 64, 256], help="messages per round")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cps", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--port", type=int, default=29541)
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    ap.add_argument("--nccl", action="store_true", help="also time the issue on a one-rank NCCL group (a GPU)")
    ap.add_argument("--gather", action="store_true",
                    help="also time the send side of a real exchange's forward on the GPU, now vs session 32 "
                         "(bf16, 8 KV heads, D=128)")
    args = ap.parse_args(argv)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(2, args.port, args.counts, args.reps, queue), nprocs=2)
    got = queue.get()
    measured = [{"messages": n, "p2p_us": got[("p2p", n)] * 1e6, "p2p_us_per_message": got[("p2p", n)] * 1e6 / n,
                 "all_to_all_us": got[("all_to_all", n)] * 1e6} for n in args.counts]
    per_msg = statistics.median(m["p2p_us_per_message"] for m in measured)
    per_call = statistics.median(m["all_to_all_us"] for m in measured)
    plans = corpus_plans(args.cps)
    layers = per_layer_counts(plans)
    for row in layers:
        row["p2p_ms_estimate"] = row["messages_max"] * per_msg / 1e3
        row["all_to_all_ms_estimate"] = 2 * row["rounds"] * per_call / 1e3
    nccl_us = nccl_one_rank(args.reps, args.port + 1) if args.nccl else None
    sides = send_side(plans) if args.gather else None
    env = run_environment(torch.device("cuda" if args.nccl or args.gather else "cpu"))
    md = ["# Host time to issue the CP exchange: one P2POp per message vs one all-to-all per round", "",
          f"- **date**: `{env['date']}`; **torch** `{env['torch']}`; **platform** `{env['platform']}`; "
          f"{os.cpu_count()} CPUs; gloo, two processes", f"- **command**: `{env['command']}`", "",
          "Measured: the host time of the issue call (before `wait`), median of "
          f"{args.reps}, for one round of n messages (half sends, half receives, 64 KB each).", "",
          "| messages per round | P2POps + batch_isend_irecv µs | per message µs | all_to_all_single µs |",
          "|---|---|---|---|"]
    md += [f"| {m['messages']} | {m['p2p_us']:.0f} | {m['p2p_us_per_message']:.1f} | {m['all_to_all_us']:.0f} |"
           for m in measured]
    if nccl_us is not None:
        md += ["", f"NCCL ({env.get('gpu')}, a one-rank group: the only one a single GPU allows; torch "
               f"refuses a P2POp to itself): `DistExchange.start` of a round of one message issues in "
               f"{nccl_us:.0f} µs (median of {args.reps})."]
    if sides:
        md += ["", "Send side on the GPU (measured, `triton.testing.do_bench` median of 3 alternating runs): a "
               "collective needs a round's outgoing rows in one buffer in peer order (a chunk sent to k peers is "
               "there k times). Now: one pack of every such round's rows straight from K/V, each round sent as a "
               "view of it. Session 32: all own wire rows, a pack of the messages that were not one run of own "
               "chunks, then one gather per round (rebuilt from the same program). The rank that sends the most "
               "rows, 128K tokens, bf16, 8 KV heads, D=128:", "",
               "| cp | nodes | rank | rows sent (direct rounds) | MB | now ms per forward | session 32 ms |",
               "|---|---|---|---|---|---|---|"]
        md += [f"| {g['cp']} | {g['nodes']} | {g['rank']} | {g['rows']} | {g['mbytes']:.0f} | {g['now_ms']:.3f} | "
               f"{g['session32_ms']:.3f} |" for g in sides]
    md += ["", f"ESTIMATES per layer (forward rounds + gradient returns) for a rank of a real plan (128K-token "
           f"corpus document mask, sparse balance): messages x {per_msg:.1f} µs against 2 x rounds x "
           f"{per_call:.0f} µs (the medians above).", "",
           "| cp | nodes | rounds | messages per layer (median / max rank) | P2P issue ms (max rank, est.) | "
           "all-to-all issue ms (est.) |", "|---|---|---|---|---|---|"]
    md += [f"| {r['cp']} | {r['nodes']} | {r['rounds']} | {r['messages_median']} / {r['messages_max']} | "
           f"{r['p2p_ms_estimate']:.2f} | {r['all_to_all_ms_estimate']:.2f} |" for r in layers]
    text = "\n".join(md) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump({"env": env, "measured": measured, "per_layer_estimates": layers,
                       "per_message_us": per_msg, "per_call_us": per_call,
                       "nccl_one_rank_all_to_all_us": nccl_us, "send_side": sides}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
