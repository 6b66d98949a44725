"""tpflash.parallel.shutdown at the end of a job: a model's released CUDA graphs let the NCCL groups be
destroyed (a live graph holding NCCL kernels makes that wait forever), and a destruction that hangs
anyway ends the process after `exit_after_s` instead of holding the job."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}


def _torchrun_graphed_shutdown(gpus: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "tests", "distributed", "graphed_shutdown.py")]
    env = {**CLEAN_ENV, "CUDA_VISIBLE_DEVICES": gpus, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.gpu
def test_released_cuda_graphs_with_nccl_inside_let_the_groups_be_destroyed():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    done = _torchrun_graphed_shutdown("0,1")
    assert done.returncode == 0 and done.stdout.count("destroyed") == 2, done.stdout[-2000:] + done.stderr[-3000:]


def test_released_graphs_let_the_groups_be_destroyed_on_cpu_ranks():
    done = _torchrun_graphed_shutdown("")
    assert done.returncode == 0 and done.stdout.count("destroyed") == 2, done.stdout[-2000:] + done.stderr[-3000:]


def _hung_shutdown(arguments: str) -> subprocess.CompletedProcess:
    """A process whose group destruction never returns, calling parallel.shutdown(<arguments>)."""
    script = ("import time, torch.distributed as dist; from tpflash import parallel; parallel.init(tp=1); "
              f"dist.destroy_process_group = lambda: time.sleep(600); parallel.shutdown({arguments})")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**CLEAN_ENV, "CUDA_VISIBLE_DEVICES": ""})


def test_a_destruction_that_hangs_ends_the_process_with_the_given_status_after_the_wait():
    done = _hung_shutdown("exit_after_s=1, exit_status=3")
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout.count("destroying the process groups did not finish within 1 s") == 1, done.stdout


def test_a_hung_destruction_prints_the_last_words_before_it_exits():
    done = _hung_shutdown("exit_after_s=1, exit_status=1, last_words='error: data.path=x does not exist'")
    assert done.returncode == 1 and done.stderr.count("error: data.path=x does not exist") == 1, done.stderr[-2000:]


def test_the_cli_hands_a_failed_runs_error_to_shutdown_as_its_last_words():
    from tpflash.train import cli
    try:
        try:
            raise ValueError("train.lr=-1 must be > 0")
        finally:
            words = cli._last_words(finished=False)
    except ValueError:
        pass
    assert words == "error: train.lr=-1 must be > 0"
    assert cli._last_words(finished=True) is None


@pytest.mark.parametrize("wait", [0, -5])
def test_a_wait_that_is_not_positive_is_refused_naming_it(wait):
    import tpflash
    with pytest.raises(ValueError, match=rf"exit_after_s={wait} must be a number of seconds > 0"):
        tpflash.parallel.shutdown(exit_after_s=wait)
