"""The rank pool's driver: a rank that never reports is named with how its process stands, and a
dead one is not waited for until the timeout."""
import os
import signal
import time

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.cpu_ranks


def _rank_1_exits(code):
    if dist.get_rank() == 1:
        os._exit(code)
    return "done"


def _rank_1_sleeps(seconds):
    if dist.get_rank() == 1:
        time.sleep(seconds)
    return "done"


def _rank_1_is_killed():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return "done"


def test_a_rank_whose_process_exits_is_reported_with_its_exit_code_before_the_timeout(ranks):
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1 did not finish: its process exited with code 3"):
        ranks(2).run(_rank_1_exits, 3, timeout=600.0)
    assert time.monotonic() - start < 120, "the driver waited for the timeout, not for the dead rank"


def test_a_rank_killed_by_a_signal_is_reported_with_the_signal(ranks):
    with pytest.raises(AssertionError, match=r"rank 1 did not finish: its process was killed by SIGKILL"):
        ranks(2).run(_rank_1_is_killed, timeout=600.0)


def test_a_rank_past_the_timeout_is_reported_as_still_running(ranks):
    with pytest.raises(AssertionError, match=r"rank 1 did not finish: its process still runs"):
        ranks(2).run(_rank_1_sleeps, 30.0, timeout=2.0)
