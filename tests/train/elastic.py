"""Launching the real entry point under torchrun for the end-to-end tests (subprocesses, CPU ranks)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A one-layer GPT small enough that a torchrun launch is dominated by start-up.
TINY_GPT = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=16",
            "--data.seq_len=16", "--data.eval_fraction=0.1", "--train.batch_size=4", "--train.lr=1e-2",
            "--train.warmup_steps=2", "--train.eval_batches=1", "--log.interval=1", "--log.progress=lines",
            "--seed=3"]


def env(gpus: str = "", **extra: str) -> Dict[str, str]:
    """The workers' environment: CPU and gloo even on a GPU machine unless `gpus` names the GPUs
    ("0,1": NCCL on them). What is tested is the restart; CPU runs are bit-reproducible, and so are
    tpflash's GPU kernels (no atomics), so a resumed run's loss equals the uninterrupted run's."""
    out = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=gpus,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out.pop("TPFLASH_FAULT", None)
    out.update(extra)
    return out


def launch(nproc: int, args: List[str], max_restarts: int = 0, timeout: float = 240,
           fault: Optional[str] = None, gpus: str = "") -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=nproc -m tpflash.train args`, whatever its exit status
    (on CPU ranks, or on the GPUs `gpus` names)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.2", "-m", "tpflash.train", *args]
    extra = {"TPFLASH_FAULT": fault} if fault else {}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(gpus, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_tree(proc.pid, signal.SIGUSR1)  # each worker prints its threads' stacks (tpflash.train.cli)
        time.sleep(3)
        _signal_tree(proc.pid, signal.SIGKILL)  # torchrun and its workers (each in a session of its own)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} timed out after {timeout}s:\n{out[-4000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _signal_tree(pid: int, sig: signal.Signals) -> None:
    """Send `sig` to every descendant of `pid` (and, for SIGKILL, `pid`'s process group): torchrun starts
    each worker in a new session, so killing its group alone leaves workers holding the output pipes open."""
    children: Dict[int, List[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    todo, found = [pid], []
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    for p in found[1:] if sig != signal.SIGKILL else found:  # torchrun itself would die of SIGUSR1
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    if sig == signal.SIGKILL:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def torchrun(nproc: int, args: List[str], max_restarts: int = 0, timeout: float = 240,
             fault: Optional[str] = None, gpus: str = "") -> subprocess.CompletedProcess:
    """launch(), raising with the output when the job fails."""
    proc = launch(nproc, args, max_restarts, timeout, fault, gpus)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


def records(log_dir: str, kind: str = "train") -> List[dict]:
    """The metric records of `kind` in log_dir/metrics.jsonl, in the order written."""
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def last_loss_by_step(log_dir: str) -> Dict[int, float]:
    """{step: loss}; a step logged twice (by a run and by its restart) keeps the later value."""
    return {r["step"]: r["loss"] for r in records(log_dir)}
