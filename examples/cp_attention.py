"""Context-parallel masked attention, end to end. Launch with torchrun, e.g. on one machine:

    torchrun --standalone --nproc_per_node 2 examples/cp_attention.py   # gloo on CPU, NCCL on GPUs

Every rank builds the same global mask and plan, keeps its shard of q/k/v *and* of the
per-token tensors (positions, labels), runs attention over the whole sequence, and rank 0
gathers the output back into sequence order and checks it against one-device attention.
"""

import os

import torch
import torch.distributed as dist

import flashmask3
from flashmask3 import masks
from flashmask3.distributed import cp_flashmask_attention, plan


def main(seqlen: int = 512, heads: int = 4, head_dim: int = 64) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32

    # The same global batch on every rank (in training: the data loader's packed batch).
    torch.manual_seed(0)
    mask = masks.causal_document_mask([[100, 250, 162]])            # 3 documents, 512 tokens
    q, k, v = (torch.randn(1, seqlen, heads, head_dim, dtype=dtype) for _ in range(3))
    positions = torch.cat([torch.arange(n) for n in (100, 250, 162)]).view(1, -1)  # per document
    labels = torch.randint(0, 1000, (1, seqlen))

    # One plan for the global mask, identical on every rank: who owns which tokens.
    p = plan(mask, cp_size=world, balance="sparse")
    q_loc, k_loc, v_loc = (p.shard(t, rank, dim=1).to(device) for t in (q, k, v))
    pos_loc, labels_loc = (p.shard(t, rank, dim=1).to(device) for t in (positions, labels))
    # (a model would apply RoPE with pos_loc before attention and its loss on labels_loc)

    out_loc = cp_flashmask_attention(q_loc, k_loc, v_loc, p, comm="overlap")  # [1, S/P, H, D]

    # Back to sequence order: gather every rank's shard, then unshard.
    shards = [torch.empty_like(out_loc) for _ in range(world)]
    dist.all_gather(shards, out_loc.contiguous())
    out = p.unshard([s.cpu() for s in shards], dim=1)
    if rank == 0:
        ref = flashmask3.flashmask_attention(q.to(device), k.to(device), v.to(device),
                                             mask.to(device)).cpu()
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        print(f"cp_size={world}: output {tuple(out.shape)}, shards of {p.local_seqlen} tokens, "
              f"positions {tuple(pos_loc.shape)}, max relative difference to one device {err:.2e}")
        assert err < (2e-2 if cuda else 1e-4), err
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
