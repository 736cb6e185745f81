"""flashmask3.graphs.capture: its errors without a GPU (the captures themselves are GPU tests:
tests/test_api.py, tests/distributed/test_cp_runtime.py)."""

from unittest import mock

import pytest
import torch

from flashmask3.graphs import capture


def test_capture_needs_cuda_and_a_warm_up():
    calls = []
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            capture(lambda: calls.append(1))
    with mock.patch.object(torch.cuda, "is_available", lambda: True):
        for bad in (0, -1, 1.5, None):
            with pytest.raises(ValueError, match="warmup must be a positive int"):
                capture(lambda: calls.append(1), warmup=bad)
    assert not calls  # nothing ran
