"""Context-parallel attention on the ranks' own devices: over NCCL with the Triton block kernels in bf16
where a GPU per rank is visible (the ring's sends and receives through NCCL, several Triton blocks per
chunk), over gloo in fp32 on CPU (tests/distributed/test_context_attention.py's body and checks)."""
import pytest
import torch

from tests.distributed.test_context_attention import cp_attention_body


@pytest.mark.parametrize("cp_comm", ["ring", "allgather"])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_on_the_ranks_devices_equals_whole_attention(ranks, cp, cp_comm):
    seq, head_dim = (512 * cp, 128) if torch.cuda.device_count() >= cp else (8 * cp, 16)
    ranks(cp).run(cp_attention_body, seq, 8, 2, True, cp_comm, head_dim, True)
