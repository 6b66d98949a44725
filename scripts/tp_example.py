"""A tensor-parallel MLP on N ranks, checked against the same MLP on one process.

    torchrun --nproc_per_node=2 scripts/tp_example.py          # CPU (gloo) or one GPU per rank (NCCL)
"""
import torch
import torch.nn as nn

import tpflash
from tpflash.layers import ColumnParallelLinear, RowParallelLinear
from tpflash.losses import vocab_parallel_cross_entropy


def main():
    ps = tpflash.parallel.init(tp=int(__import__("os").environ.get("WORLD_SIZE", "1")))
    torch.manual_seed(0)  # same seed on every rank: the shards are slices of one initialisation
    mlp = nn.Sequential(ColumnParallelLinear(64, 256), nn.GELU(), RowParallelLinear(256, 64)).to(ps.device)
    head = ColumnParallelLinear(64, 1000).to(ps.device)  # vocab-sharded logits
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(ps.device)
    reference_head = nn.Linear(64, 1000).to(ps.device)

    torch.manual_seed(1)
    x = torch.randn(32, 64, device=ps.device)
    target = torch.randint(0, 1000, (32,), device=ps.device)
    loss = vocab_parallel_cross_entropy(head(mlp(x)), target)
    loss.backward()
    ref_loss = nn.functional.cross_entropy(reference_head(reference(x)), target)
    ref_loss.backward()

    full = tpflash.parallel.full_state_dict(mlp)  # unsharded, keys/shapes of the plain nn.Sequential
    ps_grad = mlp[0].weight.grad  # [256/tp, 64]: this rank's rows of the first weight's gradient
    rows = slice(ps.tp_rank * ps_grad.shape[0], (ps.tp_rank + 1) * ps_grad.shape[0])
    grad_err = (ps_grad - reference[0].weight.grad[rows]).abs().max().item()
    if ps.rank == 0:
        print(f"{ps}: loss tp={ps.tp_size} {loss.item():.6f} vs single-process {ref_loss.item():.6f}; "
              f"max |grad diff| {grad_err:.2e}; full_state_dict['0.weight'] {tuple(full['0.weight'].shape)}")
    assert abs(loss.item() - ref_loss.item()) < 1e-4 and grad_err < 1e-4


if __name__ == "__main__":
    main()
    tpflash.parallel.shutdown()  # after main's layers are gone: frees the groups while the interpreter is whole
