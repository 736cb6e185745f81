"""What runs an attention call here, and why: ``flashmask3 env`` (for bug reports and for
checking an install against the supported matrix, docs/host-path.md "Supported versions").

:func:`report` collects the versions (Python, torch, Triton), the device, the backend a bf16
call would take, whether this Triton is one the Gluon kernels and the raw C launch were
checked on, the environment variables that change the path, and the kernels a typical call
(bf16, head dim 128, a causal document mask) runs on this device. :func:`format_report` prints
it as ``key: value`` lines. Nothing here launches a kernel or touches GPU memory.
"""

from __future__ import annotations

import os
import platform
from typing import Optional

import torch

from . import ENV_VAR, _IMPORT_ERROR, resolve_backend, triton_available

#: torch releases the library supports (README, docs/host-path.md).
SUPPORTED_TORCH = ((2, 11), (2, 15))

#: Environment variables that change which kernels run or how (docs/host-path.md).
PATH_VARIABLES = (ENV_VAR, "FLASHMASK3_KERNELS", "FLASHMASK3_FAST_LAUNCH",
                  "FLASHMASK3_CHECK_MASK_VALUES", "FLASHMASK3_GLUON_UNCHECKED", "TRITON_INTERPRET")


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``2.15.0+cu130``."""
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def torch_supported(version: str = torch.__version__) -> bool:
    """Whether ``version`` is a torch release in :data:`SUPPORTED_TORCH`."""
    low, high = SUPPORTED_TORCH
    return low <= _release(version) <= high


def _device(device: Optional[torch.device]) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _device_fields(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"device": str(device)}
    props = torch.cuda.get_device_properties(device)
    return {"device": f"{device} ({props.name}, sm_{props.major}{props.minor}, "
                      f"{props.multi_processor_count} SMs)"}


def _triton_fields(device: torch.device) -> dict:
    """The Triton side: version, the two version guards, and a typical call's kernels."""
    from . import dispatch, launcher

    triton_version = dispatch.triton.__version__
    interpreting = dispatch.interpreting()
    choice = dispatch.choose(device, torch.bfloat16, 128, True, 1) if (
        device.type == "cuda" or interpreting) else None
    return {
        "triton": triton_version,
        "gluon kernels": (f"on by {dispatch.UNCHECKED_VAR}=1 on Triton {triton_version}, a version they were "
                          f"not checked on ({', '.join(dispatch.GLUON_CHECKED_TRITON)})"
                          if dispatch.GLUON_FORCED and dispatch.gluon_usable()
                          else f"Triton {triton_version} is checked: they run on Hopper where the table picks them"
                          if dispatch.gluon_usable()
                          else f"off (checked on Triton {', '.join(dispatch.GLUON_CHECKED_TRITON)}; "
                               f"every pass takes its tl row, {dispatch.TL_PATH_COST})"),
        "raw C launch": (f"Triton {triton_version} is checked: warm launches call its C launcher"
                         if launcher.RAW_LAUNCH_HERE
                         else f"off (built for Triton {', '.join(launcher.RAW_LAUNCH_TRITON)}; "
                              "warm launches call compiled.run)"),
        "kernels (bf16, D=128, causal docs)": (
            "; ".join(dispatch.describe(choice).splitlines()) if choice is not None
            else "the torch path (no CUDA device; TRITON_INTERPRET=1 runs the kernels on the CPU)"),
    }


def report(device: Optional[torch.device] = None) -> dict:
    """Everything ``flashmask3 env`` prints, as an ordered dict of strings."""
    import flashmask3

    device = _device(device)
    cuda = torch.version.cuda
    out = {
        "flashmask3": flashmask3.__version__,
        "python": platform.python_version(),
        "torch": (f"{torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU build'}; "
                  f"{'supported' if torch_supported() else 'outside the supported 2.11-2.15'})"),
        **_device_fields(device),
    }
    try:
        backend = resolve_backend(device)
    except (ValueError, RuntimeError) as exc:
        backend = f"error: {exc}"
    out["backend for a bf16 call"] = backend
    if triton_available():
        out.update(_triton_fields(device))
    else:
        out["triton"] = f"unavailable ({_IMPORT_ERROR.get('triton', 'not installed')})"
    out["environment"] = ", ".join(f"{k}={os.environ[k]}" for k in PATH_VARIABLES if k in os.environ) or "none set"
    return out


def format_report(rep: dict) -> str:
    """``key: value`` lines, keys aligned."""
    width = max(len(k) for k in rep)
    return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in rep.items())
