"""from_hf on the Llama family's Hugging Face variants gives transformers' logits to 1e-4 (fp32) at tp in
{1, 2, 4}, with and without sequence parallelism, and to_hf(from_hf(m)) gives m's weights back:
Llama 3.2 style (tied, llama3 rope), Qwen2 (q/k/v biases), Qwen3 (q/k norm, head_dim 16 != 32/4),
Mistral (sliding window longer than the sequence), and a yarn-scaled Llama at tp 2."""
import pytest
import torch

from tests.distributed.checks import init_tp
from tpflash.models import from_hf, to_hf
from tpflash.parallel import comm

pytestmark = pytest.mark.cpu_ranks  # fp32 CPU references: gloo even where GPUs are visible

VOCAB, SEQ = 101, 16
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8)


def family_hf(name):
    """A random tiny transformers model of the named variant, the same on every rank (built after one seed)."""
    import transformers as t
    t.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "llama3_tied":
        return t.LlamaForCausalLM(t.LlamaConfig(**_COMMON, tie_word_embeddings=True, rope_theta=500.0,
                                                rope_scaling=dict(LLAMA3_ROPE))).eval()
    if name == "llama_yarn":
        return t.LlamaForCausalLM(t.LlamaConfig(**_COMMON, rope_scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=8))).eval()
    if name == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**_COMMON, tie_word_embeddings=True)).eval()
    if name == "qwen3":
        return t.Qwen3ForCausalLM(t.Qwen3Config(**_COMMON, head_dim=16)).eval()
    if name == "mistral":
        return t.MistralForCausalLM(t.MistralConfig(**_COMMON, sliding_window=SEQ)).eval()
    raise ValueError(name)


def family_body(tp, name, sequence_parallel):
    """(max |logits - HF logits|, whether to_hf returned the original weights exactly)."""
    ps = init_tp(tp) if tp > 1 else None
    hf = family_hf(name)
    model = from_hf(hf, sequence_parallel=sequence_parallel).eval()
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        full = comm.all_gather(model(idx), -1, ps.tp_group if ps else None)[..., :VOCAB]
        gap = (full - hf(idx).logits).abs().max().item()
    back, original = to_hf(model).state_dict(), hf.state_dict()
    same = back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    return gap, same


def _check(results):
    for gap, same in results:
        assert gap < 1e-4, f"max |logits - HF logits| = {gap:.3g}"
        assert same, "to_hf(from_hf(m)) changed the weights"


FAMILIES = ["llama3_tied", "qwen2", "qwen3", "mistral"]


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_hf_logits_single_process(name, sequence_parallel):
    _check([family_body(1, name, sequence_parallel)])


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_hf_logits_under_tp(ranks, name, tp, sequence_parallel):
    _check(ranks(tp).run(family_body, tp, name, sequence_parallel))


def test_yarn_llama_matches_hf_logits_under_tp(ranks):
    _check(ranks(2).run(family_body, 2, "llama_yarn", True))
