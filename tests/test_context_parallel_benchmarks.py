"""The context-parallel benchmarks on CPU at tiny sizes: ring_chunks.py and context_attention.py run and
print their tables, and ring_chunks.py's per-rank compute (the ring's block calls without communication)
gives the ring's result."""
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from ring_chunks import rank_backward, rank_forward  # noqa: E402

from tpflash.kernels import flash_attention  # noqa: E402
from tpflash.parallel.zigzag import zigzag_shard  # noqa: E402


SEQS = ["256", "512"]


def _run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def smoke_runs():
    """{benchmark: future of its CPU smoke run}, both started at once: the one-process ring_chunks.py run,
    mostly start-up on one core, fits beside the two-rank context_attention.py run."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {"ring_chunks": pool.submit(_run, "benchmarks/ring_chunks.py", "--device", "cpu", "--seqs", *SEQS,
                                          "--heads-q", "4", "--heads-kv", "2", "--head-dim", "16", "--reps", "1"),
               "context_attention": pool.submit(_run, "-m", "torch.distributed.run", "--standalone",
                                                "--nproc_per_node=2", "benchmarks/context_attention.py", "--device",
                                                "cpu", "--seqs", "64", "--heads-q", "4", "--heads-kv", "2",
                                                "--head-dim", "8", "--reps", "1", "--warmup", "0")}


def test_the_cpu_smoke_run_prints_a_row_per_seq_with_efficiencies(smoke_runs):
    done = smoke_runs["ring_chunks"].result()
    assert done.returncode == 0, done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert "fwd efficiency" in header and "fwd+bwd efficiency" in header
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert [r[0] for r in rows] == SEQS
    for row in rows:
        assert len(row) == len(header)
        assert float(row[header.index("fwd+bwd efficiency")]) > 0
        assert row[header.index("peak GiB whole")] == "n/a"


def test_each_ranks_block_calls_give_its_share_of_whole_attention_and_dq():
    cp, seq, scale = 4, 64, 1 / math.sqrt(8)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq, 4, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, seq, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    grad = torch.randn(q.shape, generator=gen)
    out = flash_attention(q, k, v, causal=True, softmax_scale=scale)
    out.backward(grad)
    kv = torch.stack([k, v]).detach()
    for rank in range(cp):
        def kv_of(src):
            return zigzag_shard(kv, 2, src, cp)
        q_rank, grad_rank = zigzag_shard(q.detach(), 1, rank, cp), zigzag_shard(grad, 1, rank, cp)
        out_rank, lse = rank_forward(q_rank, kv_of, rank, cp, scale)
        torch.testing.assert_close(out_rank, zigzag_shard(out.detach(), 1, rank, cp), atol=1e-5, rtol=1e-5)
        dq, _ = rank_backward(q_rank, kv_of, rank, cp, scale, out_rank, lse, grad_rank)
        torch.testing.assert_close(dq, zigzag_shard(q.grad, 1, rank, cp), atol=1e-5, rtol=1e-5)


def test_the_two_rank_context_attention_benchmark_runs_over_gloo_and_prints_its_table(smoke_runs):
    done = smoke_runs["context_attention"].result()
    assert done.returncode == 0, done.stderr[-2000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| 64 |")]
    assert len(table) == 1
    cells = [c.strip() for c in table[0].strip("|").split("|")]
    assert float(cells[3]) > 0 and float(cells[5]) > 0  # ring and allgather speedups
