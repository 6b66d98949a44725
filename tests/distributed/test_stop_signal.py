"""StopSignal: every rank stops at the same step after any rank gets SIGTERM, without making the
host wait for the step it has just issued (the vote is read one call later over several ranks)."""
import os
import signal

import torch
import torch.distributed as dist

from tpflash.train.faults import StopSignal


def _device() -> torch.device:
    """This rank's GPU where there is one (gloo moves CUDA tensors too, so the pinned-copy and event
    path runs on a one-GPU machine as well), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def vote_body(signalled_rank: int, signal_before_call: int, calls: int):
    stop = StopSignal(_device())
    try:
        answers = []
        for call in range(calls):
            if call == signal_before_call and dist.get_rank() == signalled_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            answers.append(stop.agreed())
        return answers
    finally:
        stop.restore()


def test_every_rank_agrees_one_call_after_any_rank_is_signalled(ranks):
    results = ranks(2).run(vote_body, 1, 2, 5)
    assert results == [[False, False, False, True, True]] * 2


def test_a_vote_with_no_signal_stays_false(ranks):
    assert ranks(2).run(vote_body, -1, 0, 3) == [[False, False, False]] * 2


def test_one_process_answers_at_once_from_its_own_flag():
    stop = StopSignal(torch.device("cpu"))
    try:
        assert stop.agreed() is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed() is True
    finally:
        stop.restore()
