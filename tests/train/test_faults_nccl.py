"""The fault suite over NCCL: the trainer under torchrun on 2 GPUs (tp=2, CUDA graphs) and on 4 GPUs
(tp=2 x dp=2, zero1 with its collectives in the graphs), with one rank made to fail. Every faulted
job must end with the loss of an uninterrupted run (tpflash's kernels are deterministic: no atomics).

- a rank SIGKILLed during a step while async saves run, and one killed while a save is being
  written: `--max-restarts=1` resumes from the newest complete checkpoint (never a partial one);
- SIGTERM (a preemption): every rank saves the same step and exits 0; the next job resumes it;
- a corrupt newest checkpoint: the job falls back to the one before;
- a stalled rank (SIGSTOP): one line names it within dist.timeout, and the restart finishes the job.

The same faults on CPU ranks over gloo: test_elastic.py, test_hang.py, test_checkpoint_fallback.py, and
here the preemption hook's own CPU twin.
"""
import os
import shutil

import pytest
import torch

from tests.train.common import tiny_config, write_corpus
from tests.train.elastic import last_loss_by_step, launch, torchrun
from tests.train.tiny_model import TinyConfig, TinyLM
from tpflash.train.loop import Trainer

STEPS = 8
# a small GPT that runs tpflash's CUDA kernels and graphs; checkpoints every 2 steps, all kept
GPU_GPT = ["--model.n_layer=2", "--model.n_head=4", "--model.n_embd=128", "--model.block_size=64",
           "--data.seq_len=64", "--data.eval_fraction=0.1", "--train.batch_size=8", "--train.lr=1e-3",
           "--train.warmup_steps=2", "--train.eval_batches=1", "--log.interval=1", "--log.progress=lines",
           "--seed=3", "--checkpoint.interval=2", "--checkpoint.keep=0"]
LAYOUTS = {"2gpu": (2, ["--tp=2"]), "4gpu": (4, ["--tp=2", "--fsdp=zero1"])}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def job(request, tmp_path_factory):
    """(the reference run's log dir, run(name, *trainer args, steps=, **launch kwargs) -> (proc, its log
    dir), the reference run's losses by step)."""
    nproc, layout = LAYOUTS[request.param]
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    root = tmp_path_factory.mktemp(f"faults_{request.param}")
    corpus = write_corpus(str(root))
    gpus = ",".join(map(str, range(nproc)))

    def run(name, *extra, steps=STEPS, check=True, timeout=150, **kwargs):
        args = [f"--data.path={corpus}", f"--checkpoint.dir={root}/{name}/ckpt", f"--log.dir={root}/{name}",
                f"--train.steps={steps}", *GPU_GPT, *layout, *extra]
        proc = (torchrun if check else launch)(nproc, args, gpus=gpus, timeout=timeout, **kwargs)
        return proc, f"{root}/{name}"

    _, ref_dir = run("reference", timeout=240)  # the first launch also compiles the kernels
    return ref_dir, run, last_loss_by_step(ref_dir)


def _latest(log_dir):
    return open(os.path.join(log_dir, "ckpt", "latest")).read().strip()


@pytest.mark.gpu
def test_a_rank_killed_during_a_step_under_async_saves_resumes_to_the_uninterrupted_loss(job):
    _, run, reference = job
    proc, logs = run("kill_step", "--checkpoint.async_save=true", max_restarts=1, fault="kill_at_step:5")
    assert "kill_at_step:5: SIGKILL" in proc.stdout and "resumed from" in proc.stdout, proc.stdout[-3000:]
    got = last_loss_by_step(logs)
    assert set(got) == set(range(1, STEPS + 1))
    assert got[STEPS] == pytest.approx(reference[STEPS], rel=1e-6, abs=1e-6)
    assert _latest(logs).endswith(f"step_{STEPS}")


@pytest.mark.gpu
def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_latest_and_resumes_from_it(job):
    _, run, reference = job
    proc, logs = run("kill_save", max_restarts=1, fault="kill_in_save:6")
    assert "kill_in_save:6: SIGKILL" in proc.stdout, proc.stdout[-3000:]
    assert "at step 4" in proc.stdout.split("kill_in_save:6")[1], "the restart resumes step 4, not the partial 6"
    got = last_loss_by_step(logs)
    assert got[STEPS] == pytest.approx(reference[STEPS], rel=1e-6, abs=1e-6)
    assert _latest(logs).endswith(f"step_{STEPS}")


@pytest.mark.gpu
def test_sigterm_saves_one_step_on_every_rank_exits_0_and_the_next_job_resumes_it_exactly(job):
    _, run, reference = job
    proc, logs = run("term", fault="term_at_step:5")  # torchrun() checks the exit status: 0
    assert "SIGTERM: saving step 6 and exiting" in proc.stdout, proc.stdout[-3000:]
    assert _latest(logs).endswith("step_6")
    proc, _ = run("term")
    assert "at step 6" in proc.stdout
    got = last_loss_by_step(logs)
    assert [got[s] for s in (7, 8)] == pytest.approx([reference[s] for s in (7, 8)], rel=1e-6, abs=1e-6)


@pytest.mark.gpu
def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(job):
    ref_dir, run, reference = job
    target = os.path.join(os.path.dirname(ref_dir), "corrupt", "ckpt")
    shutil.copytree(os.path.join(ref_dir, "ckpt"), target)
    step8 = os.path.join(target, "step_8")
    shard = next(os.path.join(step8, n) for n in sorted(os.listdir(step8)) if n.endswith(".distcp"))
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    proc, logs = run("corrupt")
    assert "skipping step_8" in proc.stdout + proc.stderr and "at step 6" in proc.stdout, proc.stdout[-3000:]
    got = last_loss_by_step(logs)
    assert [got[s] for s in (7, 8)] == pytest.approx([reference[s] for s in (7, 8)], rel=1e-6, abs=1e-6)


@pytest.mark.gpu
def test_a_stalled_rank_is_named_in_one_line_and_the_restart_finishes_the_job(job):
    _, run, reference = job
    proc, logs = run("stall", "--dist.timeout=20", max_restarts=1, fault="stall_at_step:3")
    out = proc.stdout + proc.stderr
    assert out.count("error: timed out: rank ") == 1, out[-3000:]
    got = last_loss_by_step(logs)
    assert got[STEPS] == pytest.approx(reference[STEPS], rel=1e-6, abs=1e-6)


def term_body(cfg):
    """Run with TPFLASH_FAULT=term_at_step:3 (the last rank signals itself); (steps run, newest checkpoint)."""
    os.environ["TPFLASH_FAULT"] = "term_at_step:3"
    try:
        trainer = Trainer(cfg, TinyConfig, TinyLM)
        trainer.run()
    finally:
        del os.environ["TPFLASH_FAULT"]
    return trainer.step, open(os.path.join(cfg.checkpoint.dir, "latest")).read().strip()


@pytest.mark.cpu_ranks
def test_term_at_step_on_cpu_ranks_saves_the_next_step_on_every_rank_and_stops(ranks, tmp_path):
    cfg = tiny_config(write_corpus(str(tmp_path)), tp=2, train={"steps": 8}, checkpoint={"dir": str(tmp_path / "ck")})
    for step, latest in ranks(2).run(term_body, cfg):
        assert step == 4 and latest.endswith("step_4"), (step, latest)
