"""The gloo test harness: a rank that dies before passing fails the test; one that dies in
teardown after every rank passed is a warning (tests/distributed/harness.py docstring)."""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_distributed
from tests.distributed.workers import abort_before_barrier, abort_in_teardown


def test_death_in_teardown_after_success_is_a_warning():
    with pytest.warns(UserWarning, match="died in teardown"):
        run_distributed(abort_in_teardown, 2, timeout_s=120, collective_timeout_s=30)


def test_death_before_the_checks_pass_is_an_error():
    with pytest.raises(Exception, match="SIGABRT|exit"):
        run_distributed(abort_before_barrier, 2, timeout_s=120, collective_timeout_s=20)
