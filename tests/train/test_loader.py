"""The data side of the mesh, in one process: a DP group packs only its rows (the same rows a
single process packs), a rank keeps only its CP shard, the loader thread hands over the same
batches as the inline path, the layout comes from the launcher's environment, and the MoE
preset has the paper's active/total proportion."""

import pytest
import torch

from flashmask3.train.config import from_preset
from flashmask3.train.data import DocumentPacker, open_corpus
from flashmask3.train.loader import BatchLoader, prepare_batch, prepare_plan_for_rank, uses_plan_process
from flashmask3.train.model import Transformer, count_parameters, parameter_counts
from flashmask3.train.parallel import DistEnv, Layout, resolve_layout

CPU = torch.device("cpu")


def _packer(corpus, rows=None, mask="causal_document"):
    return DocumentPacker(open_corpus(corpus), 128, batch_size=4, seed=3, mask=mask, rows=rows)


@pytest.mark.parametrize("mask", ["causal_document", "document"])
def test_a_dp_group_packs_exactly_its_rows_of_the_global_batch(jsonl_corpus, mask):
    full, lo, hi = _packer(jsonl_corpus, mask=mask), \
        _packer(jsonl_corpus, range(0, 2), mask), _packer(jsonl_corpus, range(2, 4), mask)
    for _ in range(6):
        want, a, b = full.next_batch(), lo.next_batch(), hi.next_batch()
        assert torch.equal(torch.cat([a.tokens, b.tokens]), want.tokens)
        assert torch.equal(torch.cat([a.labels, b.labels]), want.labels)
        assert a.doc_lens + b.doc_lens == want.doc_lens
        assert torch.equal(torch.cat([a.mask.startend_row_indices, b.mask.startend_row_indices]),
                           want.mask.startend_row_indices)
    # the groups' states merge into the state of the whole batch
    merged = dict(lo.state_dict(), streams={**lo.state_dict()["streams"],
                                            **hi.state_dict()["streams"]})
    again = _packer(jsonl_corpus, mask=mask)
    again.load_state_dict(merged)
    assert torch.equal(again.next_batch().tokens, full.next_batch().tokens)
    with pytest.raises(ValueError, match="no position for rows"):
        _packer(jsonl_corpus).load_state_dict(lo.state_dict())
    with pytest.raises(ValueError, match="rows must be a non-empty range"):
        _packer(jsonl_corpus, range(3, 5))


def test_a_rank_keeps_its_cp_shard_and_the_plan_is_on_its_device(jsonl_corpus):
    cfg = from_preset("tiny", data=jsonl_corpus, seq_len=128, batch_size=4, balance="sparse")
    batch = _packer(jsonl_corpus, range(2, 4)).next_batch()
    env = DistEnv(3, 4, CPU, layout=Layout(2, 2))  # dp group 1, cp rank 1 (no process group)
    got = prepare_batch(batch, cfg, env)
    plan = got.plan
    assert plan.cp_size == 2 and plan.nodes == 1 and got.mask is None
    for name in ("tokens", "labels", "position_ids"):
        assert torch.equal(getattr(got, name), plan.shard(getattr(batch, name), 1, 1)), name
    assert got.tokens.shape == (2, 64) and got.num_tokens == 4 * 128
    assert float(got.label_count) == float((got.labels != -100).sum())
    # the runtime's per-rank program is built once and cached on the plan
    for comm in ("overlap", "allgather"):
        prepared = prepare_plan_for_rank(plan, 1, CPU, comm)
        assert prepare_plan_for_rank(plan, 1, CPU, comm) is prepared
    # a CP group over 2 nodes is planned hierarchically
    env = DistEnv(0, 4, CPU, layout=Layout(1, 4, nodes=2, cp_nodes=2))
    assert prepare_batch(batch, cfg.replace(batch_size=2), env).plan.nodes == 2


def test_the_loader_thread_hands_over_the_inline_batches(jsonl_corpus):
    cfg = from_preset("tiny", data=jsonl_corpus, seq_len=128, batch_size=4)
    env = DistEnv(0, 1, CPU)
    inline = BatchLoader(_packer(jsonl_corpus), cfg, env, prefetch=False)
    ahead = BatchLoader(_packer(jsonl_corpus), cfg, env, prefetch=True)
    try:
        for _ in range(4):
            a, b = inline.next(), ahead.next()
            assert torch.equal(a.tokens, b.tokens) and a.data_state == b.data_state
            assert torch.equal(a.mask.startend_row_indices, b.mask.startend_row_indices)
    finally:
        ahead.close()

    class Broken(DocumentPacker):
        def next_batch(self):
            raise ValueError("bad document")
    broken = BatchLoader(Broken(open_corpus(jsonl_corpus), 128), cfg.replace(batch_size=1), env)
    with pytest.raises(ValueError, match="bad document"):
        broken.next()
    broken.close()


def test_the_planning_process_gives_the_threads_plans_and_raises_its_errors(jsonl_corpus):
    """planner="process": the CP plans come from a worker process (spawn), equal to the thread's
    (fingerprint, shards, the rank's program); a plan() error in the worker is raised by next()."""
    cfg = from_preset("tiny", data=jsonl_corpus, seq_len=128, batch_size=4, balance="sparse")
    env = DistEnv(1, 2, CPU, layout=Layout(1, 2))  # cp rank 1 of 2 (no process group)
    thread = BatchLoader(_packer(jsonl_corpus), cfg.replace(planner="thread"), env)
    process = BatchLoader(_packer(jsonl_corpus), cfg.replace(planner="process"), env)
    assert thread._planner is None and process._planner is not None
    try:
        for _ in range(3):
            a, b = thread.next(), process.next()
            assert a.plan.fingerprint == b.plan.fingerprint
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.position_ids, b.position_ids)
            pa, pb = (prepare_plan_for_rank(x.plan, 1, CPU, "overlap") for x in (a, b))
            assert all(torch.equal(x, y) for x, y in zip(pa.stage_cols, pb.stage_cols) if x is not None)
    finally:
        thread.close()
        process.close()
    bad = BatchLoader(_packer(jsonl_corpus), cfg.replace(planner="process", chunk_size=48), env)
    try:
        with pytest.raises(ValueError, match="chunk"):
            bad.next()
    finally:
        bad.close()


def test_the_planning_worker_never_imports_the_main_script(tmp_path):
    """An unguarded script (no ``if __name__ == "__main__":``) that plans through the worker runs
    once (multiprocessing's spawn would re-import it in the worker); a dead worker is a
    RuntimeError, not a hang."""
    import os
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from flashmask3.masks import causal_document_mask\n"
        "from flashmask3.train.loader import ProcessPlanner\n"
        "m = causal_document_mask([300, 212, 512])\n"
        "p = ProcessPlanner()\n"
        "print('PLANNED', p.plan(m.startend_row_indices, True, 4).cp_size)\n"
        "p._proc.kill()\n"
        "p._proc.wait()\n"
        "try:\n"
        "    p.plan(m.startend_row_indices, True, 4)\n"
        "except RuntimeError as e:\n"
        "    print('DEAD', 'planning worker process died' in str(e))\n"
        "p.close()\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["PLANNED", "4", "DEAD", "True"]


def test_where_the_loader_plans():
    cfg = from_preset("tiny", data="unused", seq_len=128, batch_size=4)
    gpu = DistEnv(0, 2, torch.device("cuda", 0), layout=Layout(1, 2))
    cpu = DistEnv(0, 2, CPU, layout=Layout(1, 2))
    assert uses_plan_process(cfg, gpu) and not uses_plan_process(cfg, cpu)  # auto
    assert uses_plan_process(cfg.replace(planner="process"), cpu)
    assert not uses_plan_process(cfg.replace(planner="thread"), gpu)
    assert not uses_plan_process(cfg.replace(prefetch=False), gpu)  # planned in the step
    assert not uses_plan_process(cfg, DistEnv(0, 1, torch.device("cuda", 0)))  # no CP
    with pytest.raises(ValueError, match="planner must be one of"):
        cfg.replace(planner="pool").validate()


@pytest.mark.parametrize("cp, dp, nodes, want", [
    (16, 0, 0, Layout(1, 16, 2, 2)),   # one CP group over both nodes: hierarchical
    (0, 0, 0, Layout(1, 16, 2, 2)),
    (4, 0, 0, Layout(4, 4, 2, 1)),
    (0, 2, 0, Layout(2, 8, 2, 1)),
    (8, 2, 0, Layout(2, 8, 2, 1)),
    (16, 1, 4, Layout(1, 16, 4, 4)),
])
def test_layout_from_the_torchrun_environment(cp, dp, nodes, want):
    environ = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert resolve_layout(cp, dp, nodes, CPU, environ) == want


@pytest.mark.parametrize("cp, dp, nodes, message", [
    (3, 0, 0, "dp x cp must equal the 16 processes"),
    (4, 3, 0, "dp x cp must equal"),
    (12, 0, 0, "dp x cp must equal"),
    (0, 0, 3, "nodes=3 must divide"),
])
def test_bad_layouts_are_clear_errors(cp, dp, nodes, message):
    with pytest.raises(ValueError, match=message):
        resolve_layout(cp, dp, nodes, CPU, {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})


def test_layout_of_a_plain_cpu_run_and_straddling_groups():
    assert resolve_layout(0, 0, 0, CPU, {}) == Layout(1, 2, 1, 1)
    assert resolve_layout(2, 2, 0, CPU, {}) == Layout(2, 2, 1, 1)
    three_nodes = {"WORLD_SIZE": "24", "LOCAL_WORLD_SIZE": "8"}
    with pytest.raises(ValueError, match="straddles two nodes"):
        resolve_layout(6, 4, 0, CPU, three_nodes)
    with pytest.raises(ValueError, match="must span whole nodes"):
        resolve_layout(12, 2, 0, CPU, three_nodes)


def test_moe_small_has_the_papers_active_share():
    cfg = from_preset("moe-small")
    counts = parameter_counts(cfg)
    with torch.device("meta"):
        assert count_parameters(Transformer(cfg)) == counts["total"]
    assert counts["active"] / counts["total"] == pytest.approx(14 / 118, abs=0.005)
    dense = from_preset("tiny")
    assert parameter_counts(dense)["active"] == parameter_counts(dense)["total"]


def test_memory_estimate_adds_up_and_shards_with_the_mesh():
    from flashmask3.train.memory import estimate_memory
    cfg = from_preset("bench-0.6b", seq_len=131072, batch_size=8)
    one, many = estimate_memory(cfg, 1, 1), estimate_memory(cfg, 8, 8)
    n = parameter_counts(cfg)["total"]
    assert one["parameters (fp32 shard)"] == pytest.approx(4 * n / 2 ** 30)
    assert many["AdamW moments (fp32 shards)"] == pytest.approx(8 * n / 64 / 2 ** 30)
    total = [k for k in one if k.startswith("total")][0]
    assert one[total] == pytest.approx(sum(v for k, v in one.items() if k != total))
    assert many[total] < one[total]
    with pytest.raises(ValueError, match="divisible by dp"):
        estimate_memory(cfg.replace(batch_size=1), 8, 1)


def test_the_batch_mask_on_the_device_is_not_checked_again(jsonl_corpus, monkeypatch):
    """Without CP, the batch's mask (checked when it was packed) goes to the device without a
    second value check, which on a GPU would be a device sync per batch."""
    import flashmask3.masks.mask as mask_module

    real = mask_module.validate_startend_row_indices
    checks = []

    def recording(t, **kw):
        checks.append(kw.get("check_values", True))
        return real(t, **kw)

    cfg = from_preset("tiny", data=jsonl_corpus, seq_len=128, batch_size=4)
    batch = _packer(jsonl_corpus).next_batch()
    monkeypatch.setattr(mask_module, "validate_startend_row_indices", recording)
    got = prepare_batch(batch, cfg, DistEnv(0, 1, CPU, layout=Layout(1, 1)))
    assert torch.equal(got.mask.startend_row_indices, batch.mask.startend_row_indices)
    assert checks == [False]
