"""One forward + backward per head dim on the GPU against the float64 dense reference, after
the state of the two version guards (Gluon, raw launch): the first check of a Triton newer than
the GPU machine's (benchmarks/gpu/newer-triton.sh prints ``flashmask3 env``, with the kernels
of a typical call, before it). Exits non-zero on any error above the test tolerance."""

import torch
import triton

from flashmask3.masks import causal_document_mask, document_mask
from flashmask3.kernels import dispatch, launcher
from tests.kernels.attention_checks import check_attention, make_qkv


def reference_errors(device, dims=(64, 128), bidirectional: bool = False) -> dict:
    """``{"D=64": errors, ...}``: one forward + backward per head dim (causal documents, GQA
    4:2, bf16) against the float64 reference, and with ``bidirectional`` the same documents
    without the causal part (``"D=64 bidirectional"``: the non-causal kernels); raises above
    the tests' tolerance. (Also the pre-check of every arm of ``benchmarks/gluon_bwd_ab.py``.)"""
    out = {}
    kinds = [("", causal_document_mask)] + ([(" bidirectional", document_mask)] if bidirectional else [])
    for d in dims:
        q, k, v = make_qkv(2, 2048, 2048, 4, 2, d, torch.bfloat16, device=device, seed=d)
        for label, build in kinds:
            mask = build([[700, 900, 448], [2048]], device=device)
            out[f"D={d}{label}"] = check_attention(q, k, v, mask)
    return out


def main() -> None:
    print(f"triton {triton.__version__}: Gluon checked here {dispatch.GLUON_CHECKED_HERE}, "
          f"Gluon usable {dispatch.gluon_usable()}, raw launch {launcher.RAW_LAUNCH_HERE}")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: a dry run of this script)
    for name, errs in reference_errors(device).items():
        print(f"{name} causal documents, GQA 4:2: relative errors {errs}")
    print("smoke passed")


if __name__ == "__main__":
    main()
