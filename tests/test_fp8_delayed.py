"""fp8 delayed scaling (fp8="delayed"): each cast is scaled by the amaxes its tensor had in earlier
steps (tpflash.layers.fp8_history) and records its own amax as it reads the tensor. The casts equal
quantize with that amax bit for bit (Triton's CPU interpreter and the reference), a layer's GEMMs equal
those of operands fake-quantised with the histories' amaxes, the first training forward casts with
current scaling, graphs replay the eager steps' bits, and a GPT trains like the tensorwise one."""
import pytest
import torch
import torch.nn as nn

from tests.kernels.helpers import needs_interpreter
from tests.test_fp8_linear import MAX, assert_rel
from tpflash.kernels import dispatch
from tpflash.kernels import swiglu
from tpflash.kernels.fp8 import E4M3, E5M2, Fp8Handoff, cast_delayed, cast_stacked, past_amax, quantize
from tpflash.layers.fp8_history import HEADROOM, HISTORY_LENGTH, AmaxHistory
from tpflash.layers.fp8_linear import Fp8Amaxes, fp8_linears
from tpflash.models import GPT, GPTConfig

BACKENDS = pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_interpreter)])
HISTORIES = {"some steps": [0.0, 0.5, 7.0, 2.0], "none yet": [0.0] * 4, "only this step's": [9.0, 0.0, 0.0, 0.0]}


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


@BACKENDS
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("history", list(HISTORIES))
def test_a_delayed_cast_equals_quantize_with_the_past_amax_and_records_the_amax(backend, fmt, dtype, history):
    x = (torch.randn(13, 21, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    before = torch.tensor(HISTORIES[history])
    after = before.clone()
    with dispatch.use_backend(backend):
        got = cast_delayed(x, fmt, after, row=True, col=True)
    past = before[1:].max()
    want8, want_scale = quantize(x, fmt, None, past if past > 0 else torch.tensor(MAX[fmt]))  # zeros: scale 1
    assert torch.equal(as_bytes(got.row), as_bytes(want8)) and torch.equal(as_bytes(got.col), as_bytes(want8))
    assert torch.equal(got.scale, want_scale)
    assert after[0] == max(before[0], x.float().abs().max()) and torch.equal(after[1:], before[1:])


@BACKENDS
def test_an_amax_that_grew_past_the_history_saturates(backend):
    x = torch.tensor([[1.0, -3.0, 100.0, -1000.0]])
    history = torch.tensor([0.0, 448.0])  # a scale of 1
    with dispatch.use_backend(backend):
        got = cast_delayed(x, E4M3, history)
    assert (got.row.float() * got.scale).tolist() == [[1.0, -3.0, 96.0, -448.0]]
    assert history[0] == 1000.0


@BACKENDS
def test_a_nan_is_recorded_as_the_amax(backend):
    x = torch.randn(8, 8)
    x[3, 3] = float("nan")
    history = torch.zeros(3)
    with dispatch.use_backend(backend):
        cast_delayed(x, E4M3, history)
    assert history[0].isnan()


@BACKENDS
@pytest.mark.parametrize("delayed", [False, True])
def test_stacked_weights_record_the_amax_of_the_stack_and_scale_by_the_history(backend, delayed):
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(8, 16, generator=gen), torch.randn(4, 16, generator=gen) * 5]
    history = torch.tensor([0.0, 3.0, 1.0])
    with dispatch.use_backend(backend):
        got = cast_stacked(ws, E4M3, col=True, history=history, delayed=delayed)
    stack = torch.cat(ws)
    want8, want_scale = quantize(stack, E4M3, None, torch.tensor(3.0) if delayed else None)
    assert torch.equal(as_bytes(got.row), as_bytes(want8)) and torch.equal(as_bytes(got.col), as_bytes(want8))
    assert torch.equal(got.scale, want_scale) and history[0] == stack.abs().max()


def test_past_amax_is_the_maximum_of_the_previous_entries_and_the_format_max_when_they_are_zero():
    assert past_amax(torch.tensor([5.0, 1.0, 2.0]), E4M3) == 2.0
    assert past_amax(torch.tensor([5.0, 0.0, 0.0]), E5M2) == MAX[E5M2]


def test_advance_moves_this_steps_amaxes_into_the_history_and_drops_non_finite_ones():
    layer = nn.Module()
    history = AmaxHistory([layer], "cpu")
    gemm = layer.fp8_history
    history.advance()
    gemm.x[0], gemm.w[0], gemm.dy[0] = 2.0, float("nan"), float("inf")
    history.advance()
    assert gemm.x[:3].tolist() == [0.0, 2.0 * HEADROOM, 0.0] and gemm.w[:2].tolist() == [0.0, 0.0]
    assert gemm.dy[:2].tolist() == [0.0, 0.0]
    for step in range(HISTORY_LENGTH):  # the oldest entry drops out after HISTORY_LENGTH - 1 more steps
        gemm.x[0] = 1.0
        history.advance()
    assert gemm.x.tolist() == [0.0] + [HEADROOM] * (HISTORY_LENGTH - 1)


def test_saturations_count_the_delayed_steps_whose_amax_outgrew_the_history_by_operand():
    layer = nn.Module()
    history = AmaxHistory([layer], "cpu")
    gemm = layer.fp8_history
    history.advance()
    gemm.x[0], gemm.w[0], gemm.dy[0] = 4.0, 1.0, 2.0  # the first forward scales by its own amaxes: no count
    history.advance()
    gemm.x[0], gemm.w[0], gemm.dy[0] = 9.0 * HEADROOM, 1.0, 2.0  # x outgrew 4 x HEADROOM (clamped), w and dy not
    history.advance()
    gemm.x[0], gemm.dy[0] = 5.0, 3.0 * HEADROOM
    history.advance()
    assert history.saturations() == {"x": 1, "w": 0, "dy": 1}
    assert history.saturations() == {"x": 0, "w": 0, "dy": 0}  # counted again from the read on


def test_headroom_scales_the_recorded_amaxes_so_that_growth_within_it_does_not_saturate():
    assert HEADROOM == 2.0
    layer = nn.Module()
    history = AmaxHistory([layer], "cpu")
    gemm = layer.fp8_history
    history.advance()
    gemm.x[0] = 3.0
    history.advance()
    assert gemm.x[1] == 6.0 and past_amax(gemm.x, E4M3) == 6.0
    gemm.x[0] = 5.0  # grew, but within the headroom
    history.advance()
    assert history.saturations()["x"] == 0


def test_the_first_training_forward_casts_with_current_scaling_and_later_ones_with_the_history():
    layer = nn.Module()
    history = AmaxHistory([layer], "cpu")
    gen = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(16, 32, generator=gen), torch.randn(48, 32, generator=gen) * 0.1, torch.randn(16, 48, generator=gen)
    # the priming forward: tensorwise's bits
    history.advance()
    assert not layer.fp8_history.delayed
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, = fp8_linears(xl, [wl], [None], "delayed", amaxes=Fp8Amaxes(history=layer.fp8_history))
    y.backward(dy)
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_t, = fp8_linears(xt, [wt], [None], "tensorwise")
    y_t.backward(dy)
    assert torch.equal(y, y_t) and torch.equal(xl.grad, xt.grad) and torch.equal(wl.grad, wt.grad)
    # the next one: scaled by the amaxes recorded times HEADROOM, here 2/3 of the new operands' (they saturate)
    history.advance()
    assert layer.fp8_history.delayed
    x2, w2, dy2 = 3 * x, 3 * w, 3 * dy
    xl, wl = x2.clone().requires_grad_(), w2.clone().requires_grad_()
    y, = fp8_linears(xl, [wl], [None], "delayed", amaxes=Fp8Amaxes(history=layer.fp8_history))
    y.backward(dy2)

    def fake_quant(t, fmt, amax):
        scale = MAX[fmt] / amax
        return ((t.float() * scale).clamp(-MAX[fmt], MAX[fmt]).to(fmt).float() / scale).double()
    xq, wq, dyq = (fake_quant(t2, fmt, t.abs().max() * HEADROOM) for t2, fmt, t in ((x2, E4M3, x), (w2, E4M3, w),
                                                                                   (dy2, E5M2, dy)))
    assert_rel(y, xq @ wq.t())
    assert_rel(xl.grad, dyq @ wq)
    assert_rel(wl.grad, dyq.t() @ xq)
    assert layer.fp8_history.x[0] == x2.abs().max() and layer.fp8_history.dy[0] == dy2.abs().max()


def test_a_delayed_layer_without_histories_is_one_clear_error():
    with pytest.raises(ValueError, match="fp8='delayed' needs the GEMM's amax histories"):
        fp8_linears(torch.randn(4, 8), [torch.randn(8, 8)], [None], "delayed")


def swiglu_operands(rows=24, n=40, device="cpu"):
    """A leaf y [rows, 2n] in bf16 (the stacked up/gate GEMM's output), its halves, and an upstream dh."""
    gen = torch.Generator().manual_seed(0)
    y = (2 * torch.randn(rows, 2 * n, generator=gen)).bfloat16().to(device).requires_grad_()
    dh = torch.randn(rows, n, generator=gen).bfloat16().to(device)
    return y, y[:, :n], y[:, n:], dh


def unfused_gradient(up, gate, dh):
    """[d_up | d_gate] as swiglu's backward writes them (not summed into a leaf's .grad, where -0.0 + 0.0
    would turn negative zeros positive)."""
    d_up, d_gate = torch.autograd.grad(swiglu(up, gate), (up, gate), dh)
    return torch.cat([d_up, d_gate], dim=1)


@BACKENDS
def test_swiglu_hands_the_gemm_its_gradient_cast_with_the_history_instead_of_returning_it(backend):
    history, want_history = torch.tensor([0.0, 0.5, 2.0]), torch.tensor([0.0, 0.5, 2.0])
    with dispatch.use_backend(backend):
        y, up, gate, dh = swiglu_operands()
        want = cast_delayed(unfused_gradient(up, gate, dh), E5M2, want_history, row=True, col=True)
        y, up, gate, dh = swiglu_operands()
        handoff = Fp8Handoff(history, E5M2)
        swiglu(up, gate, grad_fp8=handoff).backward(dh)
    assert y.grad is None  # no compute-dtype gradient
    got = handoff.take()
    assert torch.equal(as_bytes(got.row), as_bytes(want.row)) and torch.equal(as_bytes(got.col), as_bytes(want.col))
    assert got.col.stride() == (1, got.col.shape[0]) and torch.equal(got.scale, want.scale)
    assert torch.equal(history, want_history)  # the gradient's amax recorded


def test_swiglu_refuses_a_gradient_handoff_for_inputs_that_are_not_one_buffer():
    up, gate = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="grad_fp8 needs up and gate as the two halves"):
        swiglu(up, gate, grad_fp8=Fp8Handoff(torch.zeros(3), E5M2))


def test_a_delayed_gpt_trains_alike_with_and_without_swiglu_writing_fp8(monkeypatch):
    """From the second step on (the first casts with current scaling) swiglu hands the down GEMM h and
    the up/gate GEMM its gradient in fp8, and training is bit for bit what the separate casts give
    (the Triton kernels' bits: the swiglu tests above)."""
    import tpflash.layers.mlp as mlp
    taken = []

    class Counted(Fp8Handoff):
        def take(self):
            taken.append(self.dtype)
            return super().take()

    def curve():
        torch.manual_seed(0)
        return train(GPT(tiny_config("delayed")), 4, autocast=True)
    monkeypatch.setattr(mlp, "Fp8Handoff", Counted)
    fused = curve()
    assert taken == [E4M3, E4M3, E5M2, E5M2] * 3  # steps 2-4: each block's h forward, gradient backward
    monkeypatch.setattr(mlp.ParallelMLP, "_fp8_handoffs", lambda self: (None, None))
    assert curve() == fused


@BACKENDS
def test_swiglu_hands_the_gemm_its_output_cast_with_the_history(backend):
    history, want_history = torch.tensor([0.0, 0.5, 2.0]), torch.tensor([0.0, 0.5, 2.0])
    with dispatch.use_backend(backend):
        y, up, gate, dh = swiglu_operands()
        h = swiglu(up, gate)
        want = cast_delayed(h, E4M3, want_history, row=True, col=True)
        handoff = Fp8Handoff(history, E4M3)
        carrier = swiglu(up, gate, out_fp8=handoff)
        carrier.backward(dh)  # the carrier takes h's gradient back to up and gate
        want_grad = unfused_gradient(*swiglu_operands()[1:])
    got = handoff.take()
    assert torch.equal(as_bytes(got.row), as_bytes(want.row)) and torch.equal(as_bytes(got.col), as_bytes(want.col))
    assert torch.equal(got.scale, want.scale) and torch.equal(history, want_history)
    assert carrier.shape == h.shape and carrier.dtype == h.dtype
    assert torch.equal(y.grad, want_grad)


def tiny_config(fp8):
    return GPTConfig.preset("llama-tiny", vocab_size=64, block_size=32, n_layer=2, n_embd=64, n_head=4,
                            n_kv_head=2, ffn_hidden=128, fp8=fp8)


def train(model, steps, autocast=False, graphs=False):
    return train_on(model, "cpu", steps, graphs, autocast)


def train_on(model, device, steps, graphs, autocast=True, prime=False):
    """AdamW steps on a repeating pattern (under bf16 autocast), each step's loss; graphs: captured first
    (after prime_fp8_scaling over the first batch with `prime`)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    pattern = torch.randint(0, 64, (8,), generator=gen)
    idx = pattern.repeat(4, 4)[:, :17].to(device)
    context = torch.autocast(device, dtype=torch.bfloat16, enabled=autocast)
    with context:
        if prime:
            model.prime_fp8_scaling(idx[:, :-1], idx[:, 1:])
        if graphs:
            model.capture_cuda_graphs(4, 16)
    losses = []
    for _ in range(steps):
        with context:
            loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_gpt_with_delayed_fp8_starts_as_tensorwise_and_trains_like_it():
    torch.manual_seed(0)
    delayed = train(GPT(tiny_config("delayed")), 30)
    torch.manual_seed(0)
    tensorwise = train(GPT(tiny_config("tensorwise")), 30)
    assert delayed[0] == tensorwise[0]  # the first step casts with current scaling
    assert delayed[1] != tensorwise[1]  # the second with the history
    assert delayed[-1] < 0.5 * delayed[0]
    assert abs(delayed[-1] - tensorwise[-1]) < 0.05 * tensorwise[0]


def test_graphed_delayed_steps_replay_the_eager_steps_bits_from_the_second_step():
    """The graphs capture the delayed casts; the first step (current scaling) runs eagerly, and the
    capture's passes over a sample input leave the histories untouched."""
    torch.manual_seed(0)
    eager_model = GPT(tiny_config("delayed"))
    eager = train(eager_model, 4, autocast=True)
    torch.manual_seed(0)
    graphed_model = GPT(tiny_config("delayed"))
    graphed = train(graphed_model, 4, autocast=True, graphs=True)
    assert graphed == eager
    assert graphed_model._graphed_blocks.forward_generation == 3
    assert torch.equal(graphed_model.fp8_history.table, eager_model.fp8_history.table)


def test_graphs_captured_after_priming_replay_every_step_and_train_as_without_priming():
    """The priming pass records the first batch's amaxes with the weights the first step has: its scales
    are those current scaling gives, so the curve is the unprimed one, bit for bit."""
    torch.manual_seed(0)
    eager = train(GPT(tiny_config("delayed")), 4, autocast=True)
    torch.manual_seed(0)
    model = GPT(tiny_config("delayed"))
    primed = train_on(model, "cpu", 4, graphs=True, prime=True)
    assert primed == eager
    assert model._graphed_blocks.forward_generation == 4
    assert all(p.grad is None for p in model.parameters())  # none left by the priming pass (zero_grad: None)


def test_priming_keeps_the_gradients_there_were():
    torch.manual_seed(0)
    model = GPT(tiny_config("delayed"))
    idx = torch.randint(0, 64, (2, 9))
    model(idx[:, :-1], idx[:, 1:]).backward()
    before = [p.grad.clone() for p in model.parameters()]
    model.prime_fp8_scaling(idx[:, :-1], idx[:, 1:])
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))
    assert model.fp8_history.table[:, 0].gt(0).all()  # the priming pass recorded every amax


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_delayed_cast_equals_quantize_and_records_the_amax_on_gpu(fmt, dtype):
    """Every program's atomic maximum lands: the recorded amax is the tensor's, at real sizes."""
    from tests.kernels.test_fp8_cast import every_magnitude
    for rows, cols in ((8192, 2048), (8191, 1375), (768, 1024)):
        x = every_magnitude(dtype, rows=rows, cols=cols, device="cuda")
        x = (x.float() / x.float().abs().max() * 4).to(dtype)  # amax 4: beyond the history's 3, some saturate
        history = torch.tensor([0.25, 3.0, 0.5], device="cuda")
        got = cast_delayed(x, fmt, history, row=True, col=True)
        want8, want_scale = quantize(x, fmt, None, torch.tensor(3.0, device="cuda"))
        assert torch.equal(as_bytes(got.row), as_bytes(want8)) and torch.equal(as_bytes(got.col), as_bytes(want8))
        assert torch.equal(got.scale, want_scale)
        assert history[0] == max(0.25, x.float().abs().max().item())


@pytest.mark.gpu
def test_a_graphed_delayed_gpt_replays_the_eager_steps_on_gpu():
    torch.manual_seed(0)
    eager_model = GPT(tiny_config("delayed"), device="cuda")
    torch.manual_seed(0)
    graphed_model = GPT(tiny_config("delayed"), device="cuda")
    for model, graphs in ((eager_model, False), (graphed_model, True)):
        model.losses = train_on(model, "cuda", 6, graphs)
    assert all(torch.isfinite(torch.tensor(graphed_model.losses)))
    assert graphed_model.losses == eager_model.losses
    assert graphed_model._graphed_blocks.forward_generation == 5


@pytest.mark.parametrize("device,rows,n", [pytest.param("cpu", 40, 24, marks=needs_interpreter),
                                            pytest.param("cuda", 8192, 2816, marks=pytest.mark.gpu),
                                            pytest.param("cuda", 1000, 72, marks=pytest.mark.gpu)])
def test_swiglu_hands_over_h_and_its_gradient_cast_as_the_separate_casts_do(device, rows, n):
    """The Triton kernels (on CPU, the interpreter) at once each way, against triton_swiglu's tensors cast."""
    histories = [torch.tensor([0.0, 3.0, 1.0], device=device) for _ in range(4)]
    y, up, gate, dh = swiglu_operands(rows, n, device)
    with dispatch.use_backend("triton"):
        want_h = cast_delayed(swiglu(up, gate), E4M3, histories[0], row=True, col=True)
        want_grad = cast_delayed(unfused_gradient(up, gate, dh), E5M2, histories[1], row=True, col=True)
        h_fp8, grad_fp8 = Fp8Handoff(histories[2], E4M3), Fp8Handoff(histories[3], E5M2)
        swiglu(up, gate, grad_fp8=grad_fp8, out_fp8=h_fp8).backward(dh)
    for got, want in ((h_fp8.take(), want_h), (grad_fp8.take(), want_grad)):
        assert torch.equal(as_bytes(got.row), as_bytes(want.row))
        assert torch.equal(as_bytes(got.col), as_bytes(want.col)) and torch.equal(got.scale, want.scale)
    assert torch.equal(histories[0], histories[2]) and torch.equal(histories[1], histories[3])
