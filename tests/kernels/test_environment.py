"""``flashmask3 env`` (flashmask3/kernels/environment.py): the report of what runs a call here."""

import json

import pytest
import torch

import flashmask3
from flashmask3.kernels import dispatch, environment, launcher
from flashmask3.train.cli import main


@pytest.fixture
def hopper(monkeypatch):
    """The dispatch as on a Hopper GPU (compute capability 9.0, compiled kernels), no GPU."""
    monkeypatch.setattr(dispatch, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    dispatch.decide.cache_clear()
    yield
    dispatch.decide.cache_clear()


@pytest.mark.parametrize("version, ok", [("2.11.0", True), ("2.15.0+cu130", True), ("2.13.0+cpu", True),
                                         ("2.10.1", False), ("2.16.0", False), ("3.0.0", False)])
def test_torch_releases_in_the_supported_range(version, ok):
    assert environment.torch_supported(version) is ok


def test_cpu_report_names_the_versions_backend_and_torch_path(monkeypatch):
    for name in environment.PATH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    rep = environment.report(torch.device("cpu"))
    assert rep["flashmask3"] == flashmask3.__version__
    assert rep["torch"].startswith(torch.__version__)
    assert rep["device"] == "cpu" and rep["backend for a bf16 call"] == "torch"
    assert rep["environment"] == "none set"
    if "kernels (bf16, D=128, causal docs)" in rep:  # Triton installed
        assert rep["kernels (bf16, D=128, causal docs)"].startswith("the torch path")


def test_the_report_follows_the_version_guards_and_the_hardware(hopper, monkeypatch):
    """On a Hopper a checked Triton's typical call runs Gluon kernels; with either guard off
    the report says so, and the call runs tl kernels only."""
    cuda = torch.device("cuda", 0)
    if not dispatch.gluon_usable():
        monkeypatch.setattr(dispatch, "gluon_usable", lambda: True)
    fields = environment._triton_fields(cuda)
    assert "gluon" in fields["kernels (bf16, D=128, causal docs)"]
    assert "is checked" in fields["gluon kernels"]
    monkeypatch.setattr(dispatch, "GLUON_FORCED", True)  # FLASHMASK3_GLUON_UNCHECKED=1, unchecked Triton
    forced = environment._triton_fields(cuda)["gluon kernels"]
    assert forced.startswith(f"on by {dispatch.UNCHECKED_VAR}=1") and "not checked" in forced
    monkeypatch.setattr(dispatch, "GLUON_FORCED", False)
    monkeypatch.setattr(dispatch, "GLUON_CHECKED_HERE", False)
    monkeypatch.setattr(dispatch, "gluon_usable", lambda: False)
    monkeypatch.setattr(launcher, "RAW_LAUNCH_HERE", False)
    dispatch.decide.cache_clear()
    fields = environment._triton_fields(cuda)
    kernels = fields["kernels (bf16, D=128, causal docs)"]
    assert "gluon" not in kernels and kernels.count(": tl ") == 3, kernels
    assert fields["gluon kernels"].startswith("off") and fields["raw C launch"].startswith("off")


def test_interpreter_and_path_variables_are_reported(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLASHMASK3_KERNELS", "split")
    dispatch.decide.cache_clear()
    try:
        rep = environment.report(torch.device("cpu"))
    finally:
        dispatch.decide.cache_clear()
    assert "TRITON_INTERPRET=1" in rep["environment"] and "FLASHMASK3_KERNELS=split" in rep["environment"]
    assert rep["kernels (bf16, D=128, causal docs)"].startswith("fwd: tl")


def test_cli_env_prints_the_report_as_lines_and_json(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["env", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep == environment.report()
    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(rep) and lines[0].startswith("flashmask3:")


@pytest.mark.gpu
def test_gpu_report_names_the_device_and_its_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rep = environment.report()
    props = torch.cuda.get_device_properties(0)
    assert props.name in rep["device"] and rep["backend for a bf16 call"] == "triton"
    kernels = rep["kernels (bf16, D=128, causal docs)"]
    assert kernels.startswith("fwd: ") and ("gluon" in kernels) == (props.major == 9 and dispatch.gluon_usable())


def test_python_dash_m_flashmask3_runs_the_command():
    """``python -m flashmask3 env --json`` (a checkout without the console script)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in environment.PATH_VARIABLES}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "flashmask3", "env", "--json"], capture_output=True,
                          text=True, env=env, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr
    rep = json.loads(done.stdout)
    assert rep["flashmask3"] == flashmask3.__version__ and rep["torch"].startswith(torch.__version__)
