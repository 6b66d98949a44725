"""GPU twins of the CPU tests of packed batches (tests/distributed/test_packed.py) and the streaming
load (tests/distributed/test_pretrained.py), at bf16 on CUDA where the Triton varlen attention and
rotary kernels run: a packed row's documents get the loss they get alone, and from_pretrained onto
the GPU holds exactly the tensors of the CPU load."""
import pytest
import torch

from tpflash.models import GPT, GPTConfig, from_pretrained, save_pretrained

pytestmark = pytest.mark.gpu
VOCAB, SEQ = 512, 256


def _llama():
    torch.manual_seed(0)
    cfg = GPTConfig.preset("llama-tiny", vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=8, n_kv_head=2,
                           n_embd=512, ffn_hidden=1024)
    return GPT(cfg, device="cuda", dtype=torch.bfloat16).eval()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_documents_get_their_own_loss_on_gpu():
    model = _llama()
    lengths = [40, 100, 116]  # one row of SEQ tokens
    idx = torch.randint(0, VOCAB, (1, SEQ), device="cuda")
    targets = torch.randint(0, VOCAB, (1, SEQ), device="cuda")
    cu = torch.tensor([0, 40, 140, 256], dtype=torch.int32, device="cuda")
    pos = torch.cat([torch.arange(n) for n in lengths]).view(1, SEQ).cuda()
    with torch.no_grad():
        packed = model(idx, targets, cu_seqlens=cu, position_ids=pos, max_seqlen=max(lengths), reduction="sum")
        alone = sum(model(idx[:, s:e], targets[:, s:e], reduction="sum") for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()))
    assert torch.allclose(packed.float(), alone.float(), rtol=2e-2), (packed.item(), alone.item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_from_pretrained_onto_the_gpu_equals_the_cpu_load(tmp_path):
    save_pretrained(_llama(), str(tmp_path))
    on_gpu = from_pretrained(str(tmp_path), device="cuda")
    on_cpu = from_pretrained(str(tmp_path))
    gpu_state, cpu_state = on_gpu.state_dict(), on_cpu.state_dict()
    assert gpu_state.keys() == cpu_state.keys()
    for key, value in cpu_state.items():
        assert gpu_state[key].device.type == "cuda" and torch.equal(gpu_state[key].cpu(), value), key
