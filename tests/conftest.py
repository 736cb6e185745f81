"""Test configuration: interpreter mode for Triton without a GPU, and the ``gpu`` marker."""

import os

import pytest
import torch

# The Triton backend runs under its interpreter (CPU tensors) when there is no GPU. This must
# be set before any @triton.jit function is defined, i.e. before the kernels are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


#: Environment variables that steer the library (backend, kernel options, interpreter). Tests
#: set them with monkeypatch; a test module or benchmark that changes them at import or leaves
#: them changed would silently switch every later test's code path (and spawned ranks inherit
#: them), so both are errors.
_STEERING = ("FLASHMASK3_", "TRITON_")

#: Set by torch's inductor itself the first time it compiles a Triton kernel (it points
#: Triton at torch's ptxas and its own cache); they steer nothing of ours.
_SET_BY_INDUCTOR = ("TRITON_PTXAS_PATH", "TRITON_CACHE_DIR")


def _steering_env() -> dict:
    return {k: v for k, v in os.environ.items()
            if k.startswith(_STEERING) and k not in _SET_BY_INDUCTOR}


_ENV_AT_START = _steering_env()


def pytest_collection_finish(session):
    changed = _diff(_ENV_AT_START, _steering_env())
    if changed:
        raise pytest.UsageError(f"importing the test modules changed the environment: {changed}")


def _diff(before: dict, after: dict) -> dict:
    return {k: (before.get(k), after.get(k)) for k in set(before) | set(after)
            if before.get(k) != after.get(k)}


@pytest.fixture(autouse=True)
def _fresh_prepared_calls():
    """Every test starts without prepared call signatures (the API's and the backends'):
    a test that mocks the hardware must not see another test's decisions."""
    from flashmask3 import api

    api.clear_prepared()
    yield


@pytest.fixture(autouse=True)
def _environment_is_restored():
    before = _steering_env()
    yield
    changed = _diff(before, _steering_env())
    assert not changed, f"the test left environment changes behind (before, after): {changed}"


#: Test modules whose parametrised CPU tests are slow (Triton interpreter, offline sm_90
#: compiles): ``make test`` runs each such test once, at its first parametrisation; the other
#: cases are marked ``slow`` and run by ``make test-all`` (CI). GPU tests are not affected.
SLOW_MATRIX_MODULES = ("test_tl_kernels.py", "test_gluon_bwd.py", "test_gluon_fwd.py",
                       "test_attention.py")


def _mark_slow_matrix(items) -> None:
    seen = set()
    for item in items:
        if item.fspath.basename not in SLOW_MATRIX_MODULES or "gpu" in item.keywords:
            continue
        if not hasattr(item, "callspec"):
            continue
        key = (item.fspath.basename, item.originalname)
        if key in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(key)


def pytest_collection_modifyitems(config, items):
    _mark_slow_matrix(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_seed():
    torch.manual_seed(1234)
