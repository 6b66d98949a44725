"""A small Llama built by transformers, converted with from_hf, trains like the transformers model itself:
the same init, batches and AdamW, tpflash in bf16 (fp8 "off") and in each fp8 recipe, eager and with the
blocks replayed as CUDA graphs, against the transformers model's own loss curve. Every loss is finite,
the first loss is the transformers one (the same weights), each curve stays within its tolerance of
the transformers curve at every step and on average, and the loss falls clearly.

On a GPU (marked gpu): 30 steps of a 4-layer model (hidden 256, 8 heads over 2 kv heads, SwiGLU
1024, vocabulary 2048 of which the data uses 64, batch 8 x 128 tokens) under bf16 autocast with
fp32 master weights: small enough that the six runs and the reference take seconds, the rest being
Triton compiling its kernels on a cold cache. The CPU twin runs the same body at a tiny size in fp32
with the emulated fp8 GEMMs (and the graphs' eager stand-in) for 8 steps, so CI runs it; a third
test breaks the rowwise recipe three ways and checks that the curve leaves its band. Both run at tp=2
with sequence parallelism too (two GPUs over NCCL; two CPU ranks over gloo), in the same bands: each
rank's fp8 scales are those of the shards it multiplies, which moves a GEMM's result no more than the
casts themselves do.

Tolerances, relative to the transformers loss at the same step (first step, every step, mean):
- bf16 tpflash (1e-3, 0.5%, 0.2%). Both compute the same function in bf16 over fp32 weights and differ
  by the order of their roundings (fused kernels, flash attention). The GPU body run on CPU (bf16
  autocast, reference kernels; model seeds 0-3 with their data) stayed within 5e-5 at the first
  step, 0.1% at any step and 0.05% on average.
- fp8 (2e-3, 2.5%, 1%). e4m3 keeps 3 mantissa bits, so a cast moves an element by up to 2^-4 = 6.25%
  of itself; the roundings are unbiased, a projection's output moves a few percent
  (tests/test_fp8_linear.py bounds it by 8% rowwise), and the loss, an average over 1024 tokens,
  far less: the first step, before any update, was within 7e-4 of the transformers one. Training
  then follows a slightly different path: at most 1.3% at any step and 0.6% on average (worst of
  both recipes over those seeds; the fp8 casts and roundings on CPU are the GPU's, only the GEMM is
  emulated in fp32). The bands leave about 2x room for what the GPU adds (cuBLASLt's fp8 GEMMs,
  rowwise's bf16 weight gradient), and are still narrower than what a broken recipe does: frozen
  projections, a lost input gradient or 25% wrong scales leave them (the third test).
The learning rate (5e-4) keeps the 30-step curve free of the loss spikes a higher rate gives around
steps 7-10: a spike's timing is where two runs part most (at 1e-3, bf16 tpflash came 0.5% and fp8
8-13% from transformers there).
"""
import copy
import dataclasses
import functools
from typing import List, Optional

import pytest
import torch
import torch.nn.functional as F

RUNS = [(recipe, graphed) for recipe in ("off", "rowwise", "tensorwise", "delayed") for graphed in (False, True)]
RUN_IDS = [f"{recipe}-{'graphed' if graphed else 'eager'}" for recipe, graphed in RUNS]


@dataclasses.dataclass(frozen=True)
class Setup:
    device: str
    bf16: bool  # bf16 autocast over fp32 master weights, else fp32 throughout
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    used: int  # the data uses `used` of the vocabulary's ids: the first steps learn which
    batch: int
    seq: int
    steps: int
    lr: float
    falls_to: float  # the last loss below this fraction of the first
    # relative to the transformers loss: (first step, every step, mean over steps)
    tol_bf16: tuple
    tol_fp8: tuple


GPU = Setup(device="cuda", bf16=True, hidden=256, layers=4, heads=8, kv_heads=2, ffn=1024, vocab=2048, used=64,
            batch=8, seq=128, steps=30, lr=5e-4, falls_to=0.5,
            tol_bf16=(1e-3, 5e-3, 2e-3), tol_fp8=(2e-3, 2.5e-2, 1e-2))
# fp32: tpflash and transformers agree to fp32 rounding; fp8 as on the GPU
CPU = Setup(device="cpu", bf16=False, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256, used=16,
            batch=4, seq=32, steps=8, lr=2e-3, falls_to=0.8,
            tol_bf16=(1e-5, 1e-4, 1e-4), tol_fp8=(2e-3, 2.5e-2, 1e-2))


def _transformers():
    transformers = pytest.importorskip("transformers", reason="the reference curve comes from transformers")
    transformers.logging.set_verbosity_error()
    return transformers


@functools.lru_cache(maxsize=None)
def _initial_llama(s: Setup):
    """The transformers Llama, fp32 on CPU, from seed 0 (never trained: runs take copies)."""
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.ffn,
                                      num_hidden_layers=s.layers, num_attention_heads=s.heads,
                                      num_key_value_heads=s.kv_heads, max_position_embeddings=s.seq,
                                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def llama(s: Setup):
    """A fresh copy of the initial transformers Llama (fp32, CPU)."""
    return copy.deepcopy(_initial_llama(s))


@functools.lru_cache(maxsize=None)
def batches(s: Setup) -> List[torch.Tensor]:
    """One [batch, seq + 1] id tensor per step, the same for every run: a Markov chain over `used`
    random ids of the vocabulary, each id followed by its successor under a fixed random permutation
    nine times in ten and by a random used id otherwise (floor about 0.75 nats at used=64)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randperm(s.vocab, generator=gen)[:s.used]
    successor = torch.randperm(s.used, generator=gen)
    out = []
    for _ in range(s.steps):
        x = torch.empty(s.batch, s.seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, s.used, (s.batch,), generator=gen)
        jump = torch.rand(s.batch, s.seq + 1, generator=gen) < 0.1
        random_ids = torch.randint(0, s.used, (s.batch, s.seq + 1), generator=gen)
        for t in range(1, s.seq + 1):
            x[:, t] = torch.where(jump[:, t], random_ids[:, t], successor[x[:, t - 1]])
        out.append(ids[x])
    return out


def train(s: Setup, model, loss_fn, graphed: bool = False) -> List[float]:
    """AdamW over `steps` batches, each step's loss (the loss of the weights before that step's update)."""
    autocast = torch.autocast(s.device, dtype=torch.bfloat16, enabled=s.bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if graphed:  # after the move to the device, before the first step, under the training autocast
        with autocast:
            model.capture_cuda_graphs(s.batch, s.seq)
    losses = []
    for x in batches(s):
        x = x.to(s.device)
        with autocast:
            loss = loss_fn(model, x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # what the graphed blocks ask for (no copy out of graph memory)
        losses.append(loss.item())
    if graphed:  # every step replayed the captured graphs (delayed: after the eager one priming its amaxes)
        primes = getattr(model.config, "fp8", "off") == "delayed"
        assert model._graphed_blocks is not None and model._graphed_blocks.forward_generation == s.steps - primes
    return losses


@functools.lru_cache(maxsize=None)
def transformers_curve(s: Setup) -> List[float]:
    def loss(model, idx, targets):
        logits = model(idx).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return train(s, llama(s).to(s.device), loss)


def tpflash_curve(s: Setup, recipe: str, graphed: bool) -> List[float]:
    from tpflash.models import from_hf
    model = from_hf(llama(s), fp8=recipe).to(s.device)
    return train(s, model, lambda m, idx, targets: m(idx, targets), graphed)


def relative(curve: List[float], reference: List[float]) -> List[float]:
    return [abs(a - b) / b for a, b in zip(curve, reference)]


def check_follows_the_transformers_curve(s: Setup, recipe: str, graphed: bool,
                                         reference: Optional[List[float]] = None) -> None:
    reference = transformers_curve(s) if reference is None else reference
    assert_follows(s, recipe, tpflash_curve(s, recipe, graphed), reference)


def assert_follows(s: Setup, recipe: str, curve: List[float], reference: List[float]) -> None:
    first, every, mean = s.tol_bf16 if recipe == "off" else s.tol_fp8
    shown = f"\ntransformers {[round(v, 4) for v in reference]}\ntpflash      {[round(v, 4) for v in curve]}"
    assert len(curve) == len(reference) == s.steps
    assert all(torch.isfinite(torch.tensor(reference + curve))), "a non-finite loss" + shown
    assert reference[-1] < s.falls_to * reference[0], "the transformers model did not learn the data" + shown
    gaps = relative(curve, reference)
    assert gaps[0] < first, f"first loss {gaps[0]:.2e} from the transformers one (same weights)" + shown
    assert max(gaps) < every, f"step {gaps.index(max(gaps))} is {max(gaps):.2%} from transformers" + shown
    assert sum(gaps) / len(gaps) < mean, f"mean deviation {sum(gaps) / len(gaps):.2%}" + shown
    assert curve[-1] < s.falls_to * curve[0], "tpflash did not learn the data" + shown


@pytest.mark.gpu
@pytest.mark.parametrize("recipe, graphed", RUNS, ids=RUN_IDS)
def test_fp8_recipes_follow_the_transformers_bf16_curve_for_30_steps_on_gpu(recipe, graphed):
    if recipe != "off" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"fp8 GEMMs need compute capability 8.9+ ({torch.cuda.get_device_name()})")
    check_follows_the_transformers_curve(GPU, recipe, graphed)


@pytest.mark.parametrize("recipe, graphed", RUNS, ids=RUN_IDS)
def test_fp8_recipes_follow_the_transformers_fp32_curve_for_8_steps_on_cpu(recipe, graphed):
    """The GPU test's body at a tiny size in fp32: fp8 emulated, graphs replayed by their eager stand-in."""
    check_follows_the_transformers_curve(CPU, recipe, graphed)


def tp2_curves_body(s: Setup, recipe: str, graphed: bool):
    """(this rank's tpflash curve at tp=2 with sequence parallelism, the transformers curve)."""
    from tests.distributed.checks import init_tp
    from tpflash.models import from_hf
    ps = init_tp(2)
    model = from_hf(llama(s), process_group=ps.tp_group, sequence_parallel=True, fp8=recipe).to(s.device)
    return train(s, model, lambda m, idx, targets: m(idx, targets), graphed), transformers_curve(s)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe, graphed", RUNS, ids=RUN_IDS)
def test_fp8_recipes_at_tp2_follow_the_transformers_bf16_curve_for_30_steps_on_gpus(ranks, recipe, graphed):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if recipe != "off" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"fp8 GEMMs need compute capability 8.9+ ({torch.cuda.get_device_name()})")
    for curve, reference in ranks(2).run(tp2_curves_body, GPU, recipe, graphed):
        assert_follows(GPU, recipe, curve, reference)


@pytest.mark.cpu_ranks
@pytest.mark.parametrize("recipe, graphed", RUNS, ids=RUN_IDS)
def test_fp8_recipes_at_tp2_follow_the_transformers_fp32_curve_for_8_steps_on_cpu(ranks, recipe, graphed):
    """The tp=2 GPU test's body at the CPU twin's size, over gloo."""
    for curve, reference in ranks(2).run(tp2_curves_body, CPU, recipe, graphed):
        assert_follows(CPU, recipe, curve, reference)


def _without_weight_gradients(backward):
    def wrong(ctx, *grad_ys):
        grads = list(backward(ctx, *grad_ys))
        n = len(ctx.sizes)
        grads[5:5 + n] = [None if g is None else torch.zeros_like(g) for g in grads[5:5 + n]]
        return tuple(grads)
    return wrong


def _without_input_gradient(backward):
    def wrong(ctx, *grad_ys):
        dx, *rest = backward(ctx, *grad_ys)
        return (torch.zeros_like(dx), *rest)
    return wrong


def _scales_a_quarter_off(cast):
    def wrong(*args, **kwargs):
        x8, x8_col, scale = cast(*args, **kwargs)
        return x8, x8_col, scale * 1.25
    return wrong


@pytest.mark.parametrize("bug", ["weight gradients dropped", "input gradient dropped", "scales 25% off"])
def test_an_fp8_recipe_computing_something_else_leaves_the_band(bug, monkeypatch):
    """The check can fail: rowwise fp8 projections whose weights never learn, whose input gradient is
    lost (the layers below learn through the residual only), or whose dequantisation scales are 25%
    off, still bring the loss down, and leave the tolerance band (measured: 8.5%, 3.8% and 6.4% at the
    worst step, means 4.9%, 1.8% and 3.6%, against 0.17% and 0.06% for the real recipe)."""
    from tpflash.layers import fp8_linear
    reference = transformers_curve(CPU)
    if bug == "scales 25% off":
        monkeypatch.setattr(fp8_linear, "cast", _scales_a_quarter_off(fp8_linear.cast))
    else:
        wrap = _without_weight_gradients if bug.startswith("weight") else _without_input_gradient
        monkeypatch.setattr(fp8_linear._Fp8Linear, "backward", staticmethod(wrap(fp8_linear._Fp8Linear.backward)))
    with pytest.raises(AssertionError, match="from transformers|mean deviation|first loss"):
        check_follows_the_transformers_curve(CPU, "rowwise", False, reference)
