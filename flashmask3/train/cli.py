"""Command line: ``flashmask3 {demo,train,data,env}``.

* ``flashmask3 demo`` — the README demo: a ~0.85M-parameter byte-level model for 300 steps on the
  default corpus (stdlib sources + /usr/share/doc), context parallel over 2 gloo CPU ranks (all
  visible GPUs with NCCL where there are GPUs). Any training flag can be added to override it.
* ``flashmask3 train [--preset NAME] [--flags]`` — any run; ``--attention`` swaps the kernel,
  ``--dp/--cp/--nodes`` shape the mesh, ``--balance/--comm`` the CP layer. Also works under
  ``torchrun`` (one node or several: see flashmask3/train/README.md).
* ``flashmask3 data`` — inspect the packed data: documents, pieces per sequence, mask sparsity.
* ``flashmask3 env`` — what runs an attention call here: versions, device, backend, the
  version guards, a typical call's kernels (``--json`` for a bug report).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .config import add_config_arguments, config_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashmask3", description="Long-context training with FlashMask attention masks.")
    sub = parser.add_subparsers(dest="command", required=True)
    note = ("Flag defaults shown are TrainConfig's; a --preset (demo: 'demo') overrides them "
            "and explicit flags override the preset.")
    demo = sub.add_parser("demo", help="the README demo (CP over 2 CPU ranks or all GPUs)",
                          description="Train the 'demo' preset: ~0.85M params, 300 steps, "
                                      "packed default-corpus documents, context parallel. "
                                      + note)
    add_config_arguments(demo)
    train = sub.add_parser("train", help="train with any configuration", description=note)
    add_config_arguments(train)
    data = sub.add_parser("data", help="show packed batches and mask sparsity")
    add_config_arguments(data)
    data.add_argument("--batches", type=int, default=20, help="batches to inspect")
    env = sub.add_parser("env", help="what runs an attention call here (versions, device, kernels)")
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "env":
        return print_environment(args.json)
    try:
        cfg = config_from_args(args, default_preset="demo" if args.command == "demo" else None)
        if args.command == "data":
            return inspect_data(cfg, args.batches)
        from .trainer import train
        train(cfg)
    except (ValueError, TypeError) as exc:
        print(f"flashmask3: error: {exc}", file=sys.stderr)
        return 2
    return 0


def print_environment(as_json: bool) -> int:
    """``flashmask3 env``: :func:`flashmask3.kernels.environment.report`, as lines or JSON."""
    from ..kernels.environment import format_report, report

    rep = report()
    if as_json:
        import json
        print(json.dumps(rep, indent=1))
    else:
        print(format_report(rep))
    return 0


def inspect_data(cfg, batches: int) -> int:
    """Print corpus size, document pieces per sequence and the mask sparsity of a few batches."""
    from .data import make_packer, mask_sparsity
    if batches <= 0:
        raise ValueError(f"batches must be > 0, got {batches}")
    packer = make_packer(cfg)
    pieces, sparsity, vs_causal = [], [], []
    for _ in range(batches):
        batch = packer.next_batch()
        pieces += [len(d) for d in batch.doc_lens]
        stats = mask_sparsity(batch.mask)
        sparsity.append(stats["sparsity"])
        vs_causal.append(stats["skipped_vs_causal"])
    print(f"corpus {cfg.data!r}: {len(packer.corpus)} documents")
    print(f"{batches} batches of {cfg.batch_size} x {cfg.seq_len} tokens, mask {cfg.mask}")
    print(f"document pieces per sequence: mean {sum(pieces) / len(pieces):.1f}, "
          f"max {max(pieces)}")
    print(f"mask sparsity: {100 * sum(sparsity) / len(sparsity):.1f}% of pairs skipped "
          f"({100 * sum(vs_causal) / len(vs_causal):.1f}% fewer than plain causal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
