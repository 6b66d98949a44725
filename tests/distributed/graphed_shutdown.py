"""Run by test_shutdown.py under torchrun: capture a tp=2 GPT's CUDA graphs (NCCL inside them on GPUs,
the eager stand-in on CPU), train a step, release the graphs and destroy the groups; prints
"destroyed" once the groups are gone."""
import torch

import tpflash
from tpflash.models import GPT, GPTConfig


def main():
    tpflash.parallel.init(tp=2)
    rank = torch.distributed.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cfg = GPTConfig.preset("gpt2-tiny", vocab_size=64, block_size=8, n_layer=2, n_embd=32, n_head=4, ffn_hidden=64)
    torch.manual_seed(0)
    model = GPT(cfg, device=device)
    idx = torch.randint(0, 64, (2, 8), device=device)
    model.capture_cuda_graphs(2, 8)
    model(idx, idx).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    model.release_cuda_graphs()
    del model
    tpflash.parallel.shutdown()
    print(f"rank {rank}: destroyed", flush=True)


if __name__ == "__main__":
    main()
