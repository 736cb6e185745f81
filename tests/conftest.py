"""Test configuration: interpreter mode for Triton without a GPU, and the ``gpu`` marker."""

import os

import pytest
import torch

# The Triton backend runs under its interpreter (CPU tensors) when there is no GPU. This must
# be set before any @triton.jit function is defined, i.e. before the kernels are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_seed():
    torch.manual_seed(1234)
