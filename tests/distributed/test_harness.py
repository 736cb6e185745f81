"""The gloo test harness (tests/distributed/harness.py docstring): a rank that dies in teardown
after every rank passed is a warning; a native crash before that is retried once and fails if
it repeats. Python errors are never retried (test_cp_attention.py checks they surface)."""

from __future__ import annotations

import pytest

from tests.distributed.harness import NativeCrash, RankError, run_distributed
from tests.distributed.workers import abort_before_barrier, abort_in_teardown, abort_on_first_attempt


def test_death_in_teardown_after_success_is_a_warning():
    with pytest.warns(UserWarning, match="died in teardown"):
        run_distributed(abort_in_teardown, 2, timeout_s=120, collective_timeout_s=30)


def test_a_native_crash_that_repeats_is_an_error():
    """Raised as the crash itself, or as the peers' Python error with the crash as its cause."""
    with pytest.warns(UserWarning, match="retrying once"), \
            pytest.raises((NativeCrash, RankError)) as info:
        run_distributed(abort_before_barrier, 2, timeout_s=120, collective_timeout_s=20)
    crash = info.value if isinstance(info.value, NativeCrash) else info.value.__cause__
    assert isinstance(crash, NativeCrash) and "SIGABRT" in str(crash)


def test_a_native_crash_is_retried_once(tmp_path):
    with pytest.warns(UserWarning, match="retrying once"):
        run_distributed(abort_on_first_attempt, 2, str(tmp_path / "crashed"), timeout_s=120,
                        collective_timeout_s=20)
    assert (tmp_path / "crashed").exists()
