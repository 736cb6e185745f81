"""Context-parallel attention on gloo ranks equals single-process attention (fwd and grads).

Each test spawns one process group and loops over many configurations inside it (spawning
costs seconds; a configuration costs milliseconds). Every mask type, every balance x comm,
flat and hierarchical routing (2 virtual nodes), cp_size 4 and the non-power-of-two 3,
several chunk sizes, a DeviceMesh as the group, the returned LSE's gradient, and error paths.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import RankError, run_distributed
from tests.distributed.workers import (check_configs, check_mesh_and_lse, compiled_model_suite, compiled_options_suite, cp4_suite, windowed_suite,
                                       fail_on_rank_one, mismatched_plans, stuck_rank,
                                       wrong_group_size)
from tests.helpers import named_masks

ALL_MASKS = sorted(named_masks(64))
BALANCES = ["contiguous", "dual_chunk", "sparse"]
COMMS = ["overlap", "allgather"]


def test_cp4_every_mask_balance_comm_and_hierarchy_and_2d_mesh():
    run_distributed(cp4_suite, 4, 128, ALL_MASKS, BALANCES, COMMS, [1, 2], [None], 1)


def test_cp4_chunk_sizes_and_cp3_non_power_of_two():
    run_distributed(check_configs, 4, 128, ["causal_document", "sliding_window", "qk_sparse"],
                    BALANCES, COMMS, [1, 2], [8, 16], 2)
    run_distributed(check_configs, 3, 96, ALL_MASKS, BALANCES, COMMS, [1, 3], [None, 4], 3)


def test_cp4_ptrr_placement_every_mask():
    """PyTorch's round-robin placement (tile-sized chunks scattered over the ranks) through the
    runtime, flat and hierarchical, both comm modes."""
    run_distributed(check_configs, 4, 128, ALL_MASKS, ["ptrr"], COMMS, [1, 2], [None, 16], 7)


def test_triton_kernel_under_the_interpreter():
    """The rank-local masks (non-causal C=2/C=4) through the Triton kernel, as on GPUs. (The
    fused backward needs Hopper, so under the interpreter every backward is the split one.)"""
    # The interpreter takes ~20 s per rank and layer: 170-260 s in all on the shared 2-core box.
    run_distributed(check_configs, 2, 64, ["causal_blockwise"], ["sparse"], COMMS, [1], [None], 5,
                    env={"FLASHMASK3_BACKEND": "triton", "TRITON_INTERPRET": "1",
                         "FLASHMASK3_KERNELS": "default"}, timeout_s=480)


def test_device_mesh_group_lse_gradient_and_single_rank():
    run_distributed(check_mesh_and_lse, 2, 64, 4)
    run_distributed(wrong_group_size, 2, 64)
    run_distributed(mismatched_plans, 2, 64)
    run_distributed(check_configs, 1, 64, ["causal_document", "qk_sparse"], BALANCES, COMMS, [1], [None], 6)


def test_rank_error_surfaces_without_hanging():
    with pytest.raises(Exception, match="deliberate failure on rank 1"):
        run_distributed(fail_on_rank_one, 3, timeout_s=120, collective_timeout_s=30)


def test_stuck_rank_times_out():
    with pytest.raises((RankError, TimeoutError)):
        run_distributed(stuck_rank, 2, timeout_s=40, collective_timeout_s=5)


def test_bad_softmax_scale_is_refused_before_any_process_group_is_touched():
    """Argument errors come first: no process group exists in this process."""
    import torch

    from flashmask3.distributed import cp_flashmask_attention, plan

    p = plan(named_masks(64)["causal"], None, 2, balance="contiguous")
    x = torch.randn(1, 32, 2, 8)
    for bad, err in ((float("nan"), ValueError), (-0.5, ValueError), ("0.1", TypeError)):
        with pytest.raises(err, match="softmax_scale"):
            cp_flashmask_attention(x, x, x, p, softmax_scale=bad)


def test_torch_compile_of_a_model_with_cp_attention():
    run_distributed(compiled_model_suite, 2, 128, 5)


def test_sliding_window_layers_over_one_plan():
    run_distributed(windowed_suite, 4, 128, 8, timeout_s=480)


def test_torch_compile_fullgraph_of_every_cp_option():
    run_distributed(compiled_options_suite, 2, 128, 6, timeout_s=480)


def test_a_kept_kv_handle_without_its_buffer_is_an_error():
    """The traced layer's kept K/V travel by handle; a handle whose buffer is gone raises rather
    than refetching on this rank only (the ranks' exchange rounds must match)."""
    import gc

    import torch

    from flashmask3.distributed import attention as A

    assert A._kept_of(torch.tensor(0)) is None
    buf = torch.randn(2, 1, 8, 1, 4)
    handle = A._kept_handle(buf)
    assert A._kept_of(handle) is buf
    name = int(handle)
    del handle, buf
    gc.collect()
    with pytest.raises(RuntimeError, match="keep_kv=False"):
        A._kept_of(torch.tensor(name))


def test_inductor_cuda_graphs_never_record_the_cp_layer():
    """The CP ops carry ``cudagraph_unsafe`` (where this torch has the tag): inductor's CUDA graphs
    (``mode="reduce-overhead"``) then skip a graph holding them, or run them between the
    captured parts, instead of replaying the recorded plan for a later batch's plan; inductor
    finds the op as the graph's first cudagraph-incompatible node."""
    import flashmask3.distributed.attention  # noqa: F401  (registers the ops)
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None:
        pytest.skip("this torch has no cudagraph_unsafe tag")
    ops = (torch.ops.flashmask3.cp_attention_forward.default, torch.ops.flashmask3.cp_attention_backward.default)
    for op in ops:
        assert tag in op.tags, op
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(ops[0], (x,)))
    node = get_first_incompatible_cudagraph_node(torch.fx.GraphModule(torch.nn.Module(), g))
    assert node is not None and node.target is ops[0]
