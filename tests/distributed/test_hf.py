"""from_hf/to_hf: a tpflash GPT converted from a tiny random GPT2LMHeadModel / LlamaForCausalLM gives
the Hugging Face logits to 1e-4 (fp32) at tp in {1, 2, 4}, and to_hf(from_hf(m)) gives m's weights back."""
import pytest
import torch

from tests.distributed.checks import init_tp
from tpflash.models import from_hf, to_hf
from tpflash.parallel import comm

pytestmark = pytest.mark.cpu_ranks  # fp32 CPU references: gloo even where GPUs are visible

VOCAB, SEQ = 101, 8


def tiny_hf(family, tied=False):
    """A random tiny HF model, the same on every rank (built after the same seed, no download)."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                         bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(config).eval()


def hf_body(tp, family, sequence_parallel=False, tied=False):
    """Max |logits - HF logits| and whether to_hf returned the original weights exactly."""
    ps = init_tp(tp) if tp > 1 else None
    hf = tiny_hf(family, tied)
    model = from_hf(hf, sequence_parallel=sequence_parallel).eval()
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        logits = model(idx)
        full = comm.all_gather(logits, -1, ps.tp_group if ps else None)[..., :VOCAB]
        gap = (full - hf(idx).logits).abs().max().item()
    back = to_hf(model).state_dict()
    original = hf.state_dict()
    same = back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    return gap, same


def _check(results):
    for gap, same in results:
        assert gap < 1e-4, f"max |logits - HF logits| = {gap:.3g}"
        assert same, "to_hf(from_hf(m)) changed the weights"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_from_hf_matches_hf_logits_single_process(family):
    _check([hf_body(1, family)])


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_from_hf_matches_hf_logits_under_tp(ranks, tp, family):
    _check(ranks(tp).run(hf_body, tp, family, tp == 4))


def test_tied_llama_round_trips(ranks):
    _check(ranks(2).run(hf_body, 2, "llama", False, True))


def test_unsupported_hf_config_raises():
    import transformers
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=4,
                                     scale_attn_by_inverse_layer_idx=True, bos_token_id=0, eos_token_id=0)
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx=False"):
        from_hf(transformers.GPT2LMHeadModel(config))
