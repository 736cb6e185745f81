"""What every committed benchmark result records about the machine it ran on."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

import torch


def _git_commit():
    """Short hash of the checkout's HEAD, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _command() -> str:
    """The exact command line, with the FLASHMASK3_* settings it ran under (autotune, backend,
    kernel choices) in front, as a shell would take them."""
    settings = [f"{k}={v}" for k, v in sorted(os.environ.items())
                if k.startswith("FLASHMASK3_") and k != "FLASHMASK3_COMMIT"]
    return " ".join(settings + [sys.executable] + sys.argv)


def run_environment(device: torch.device) -> dict:
    """Date, host, versions (python, torch, triton, CUDA), GPU name/count and the exact command."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__,
        "device": str(device), "command": _command(),
        "backend": os.environ.get("FLASHMASK3_BACKEND", "auto"),
        # the device machine gets the working tree without .git: the caller names the commit
        "commit": os.environ.get("FLASHMASK3_COMMIT") or _git_commit(),
    }
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_count"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
    return env
