"""The multi-node launch path on one machine: two torchrun "nodes" (one CPU worker each) meet through
c10d rendezvous on localhost, as scripts/slurm_train.sbatch starts them, train dp=2 with a checkpoint,
and a one-node run resumes that checkpoint and continues the curve of an uninterrupted run."""
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.train.common import write_corpus
from tests.train.elastic import ROOT, TINY_GPT, env, last_loss_by_step, torchrun

TIMEOUT_S = 120  # the whole two-node launch; it takes about 10 s on an idle 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_nodes(args):
    """`torchrun --nnodes=2 --nproc_per_node=1 --node_rank=R --rdzv-backend=c10d` twice, as two processes."""
    port = _free_port()
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               f"--node_rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
               "--rdzv-id=tpflash-test", "--max-restarts=1", "--monitor-interval=0.2",
               "-m", "tpflash.train", *args]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)  # the session each Popen started: torchrun and its worker
        raise AssertionError("two-node launch timed out:\n" + "\n".join(p.communicate()[0][-3000:] for p in procs))
    for node, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}:\n{out[-4000:]}"
    return outputs


def test_two_nodes_train_and_one_node_resumes_the_curve(tmp_path):
    corpus = write_corpus(str(tmp_path))
    common = [f"--data.path={corpus}", *TINY_GPT, "--log.tensorboard=off", "--train.decay_steps=6"]
    run = [f"--checkpoint.dir={tmp_path}/run/ckpt", f"--log.dir={tmp_path}/run", "--checkpoint.interval=2"]

    node0, _ = _two_nodes([*common, *run, "--train.steps=4"])
    assert "layout: tp=1 dp=2 (world 2, cpu)" in node0, node0
    assert open(f"{tmp_path}/run/ckpt/latest").read().strip().endswith("step_4")

    with ThreadPoolExecutor(max_workers=1) as pool:  # the uninterrupted reference runs beside the resume
        reference = pool.submit(torchrun, 1, [*common, f"--log.dir={tmp_path}/ref", "--train.steps=6"],
                                timeout=TIMEOUT_S)
        resumed = torchrun(1, [*common, *run, "--train.steps=6"], timeout=TIMEOUT_S)
        reference.result()
    assert f"resumed from {tmp_path}/run/ckpt at step 4 saved at tp=1 dp=2" in resumed.stdout, resumed.stdout

    got, ref = last_loss_by_step(f"{tmp_path}/run"), last_loss_by_step(f"{tmp_path}/ref")
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):  # dp=2 then dp=1 against dp=1 throughout: the same samples, the same curve
        assert got[step] == pytest.approx(ref[step], rel=1e-4), (step, got, ref)


SBATCH = os.path.join(ROOT, "scripts", "slurm_train.sbatch")


def _sbatch(tmp_path, *args):
    """Run the Slurm script with stand-ins for srun (prints its command) and scontrol (two hosts)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/sh\necho "srun $*"\n')
    (fake / "scontrol").write_text('#!/bin/sh\nprintf "gpu-a17\\ngpu-a18\\n"\n')
    for tool in ("srun", "scontrol"):
        (fake / tool).chmod(0o755)
    path = os.pathsep.join([str(fake), os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    slurm = dict(PATH=path, SLURM_JOB_NODELIST="gpu-a[17-18]", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="42",
                 SLURM_SUBMIT_DIR=ROOT, VIRTUAL_ENV=os.environ.get("VIRTUAL_ENV", sys.prefix))
    return subprocess.run(["bash", SBATCH, *args], env=env(**slurm), capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def sbatch_runs(tmp_path_factory):
    """{name: future of _sbatch's result}: the script's runs, started side by side (each is mostly one
    Python process's start-up on one core)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {"saves": pool.submit(_sbatch, tmp_path_factory.mktemp("slurm"), "--config", "demo",
                                    "--checkpoint.dir=runs/x/ckpt"),
               "saves nothing": pool.submit(_sbatch, tmp_path_factory.mktemp("slurm"), "--config", "demo",
                                            "--checkpoint.dir=")}


def test_the_slurm_script_starts_one_c10d_torchrun_per_node(sbatch_runs):
    proc = sbatch_runs["saves"].result()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=0 python -m torch.distributed.run "
                                  "--nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d "
                                  "--rdzv-endpoint=gpu-a17:29500 --rdzv-id=42 --max-restarts=3 "
                                  "--shutdown-timeout=100 -m tpflash.train --config demo "
                                  "--checkpoint.dir=runs/x/ckpt"), proc.stdout
    assert "checkpoints in runs/x/ckpt" in proc.stderr
    assert "#SBATCH --signal=TERM@120" in open(SBATCH).read()  # SIGTERM well before the limit: time to save


def test_the_slurm_script_refuses_a_run_that_saves_nothing(sbatch_runs):
    proc = sbatch_runs["saves nothing"].result()
    assert proc.returncode == 2 and "error: no checkpoint.dir" in proc.stderr, proc.stdout + proc.stderr
    assert "srun" not in proc.stdout
