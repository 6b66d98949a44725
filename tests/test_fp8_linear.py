"""fp8 linear layers in one process: each GEMM equals the GEMM of its operands fake-quantised (cast to
fp8 and back, scaled along the GEMM's contraction dimension) by an independent reference, forward and
backward, for both recipes; and the result stays near the full-precision one."""
import pytest
import torch

from tests.kernels.helpers import needs_interpreter
from tpflash.kernels.fp8 import E4M3, E5M2, quantize, scaled_mm
from tpflash.layers.fp8_linear import fp8_linears
from tpflash.models import GPT, GPTConfig

MAX = {E4M3: 448.0, E5M2: 57344.0}


def fake_quant(t, fmt, dim):
    """t cast to fp8 and back with current scaling: amax over `dim` (None: the tensor) mapped to fmt's max.
    The scaling runs in fp32 as the layers' does, so that ties round alike."""
    t = t.float()
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = MAX[fmt] / amax.clamp_min(1e-12)
    return ((t * scale).clamp(-MAX[fmt], MAX[fmt]).to(fmt).float() / scale).double()


def assert_rel(got, expected, tol=1e-5):
    err = ((got.double() - expected).norm() / expected.norm()).item()
    assert err < tol, err


def reference_grads(x, w, dy, recipe):
    """(y, dx, dw) of y = x w^T from fake-quantised operands: x [M, K], w [N, K], dy [M, N]."""
    if recipe == "tensorwise":
        xq, wq, dyq = fake_quant(x, E4M3, None), fake_quant(w, E4M3, None), fake_quant(dy, E5M2, None)
        return xq @ wq.t(), dyq @ wq, dyq.t() @ xq
    y = fake_quant(x, E4M3, 1) @ fake_quant(w, E4M3, 1).t()  # along K
    dx = fake_quant(dy, E4M3, 1) @ fake_quant(w, E4M3, 0)  # along N
    dw = fake_quant(dy, E4M3, 0).t() @ fake_quant(x, E4M3, 0)  # along M
    return y, dx, dw


def operands(m=24, k=32, n=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[3] *= 1e5  # an outlier token: one tensor scale pushes the other rows into e4m3's subnormals
    w = torch.randn(n, k, generator=gen) * 0.1
    dy = torch.randn(m, n, generator=gen) * 1e-3
    return x, w, dy


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_linear_equals_the_gemms_of_fake_quantised_operands(recipe):
    x, w, dy = operands()
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, = fp8_linears(xl, [wl], [None], recipe)
    y.backward(dy)
    y_ref, dx_ref, dw_ref = reference_grads(x, w, dy, recipe)
    assert_rel(y, y_ref)
    assert_rel(xl.grad, dx_ref)
    assert_rel(wl.grad, dw_ref)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_linear_stays_near_full_precision(recipe):
    x, w, dy = operands()
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, = fp8_linears(xl, [wl], [None], recipe)
    y.backward(dy)
    limit = 0.08 if recipe == "rowwise" else 0.2  # e4m3 has 3 mantissa bits; one tensor scale loses more
    for got, exact in ((y, x @ w.t()), (xl.grad, dy @ w), (wl.grad, dy.t() @ x)):
        assert ((got - exact).norm() / exact.norm()).item() < limit


def test_rowwise_scales_keep_ordinary_tokens_precise_beside_an_outlier():
    x, _, _ = operands()  # row 3 is 1e5 times the others
    ordinary = [i for i in range(x.shape[0]) if i != 3]
    errors = {}
    for recipe, dim in (("rowwise", -1), ("tensorwise", None)):
        x8, scale = quantize(x, E4M3, dim)
        errors[recipe] = (((x8.float() * scale) - x)[ordinary].norm() / x[ordinary].norm()).item()
    assert errors["rowwise"] < 0.05 < errors["tensorwise"], errors


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_stacked_weights_with_biases_are_one_gemm_over_the_stacked_weight(recipe):
    x, w, dy = operands(n=48)
    ws = [t.clone().requires_grad_() for t in w.split([16, 24, 8])]
    bs = [torch.randn(t.shape[0]).requires_grad_() for t in ws]
    xl = x.clone().requires_grad_()
    ys = fp8_linears(xl, ws, bs, recipe)
    assert [tuple(y.shape) for y in ys] == [(24, 16), (24, 24), (24, 8)]
    torch.cat(ys, dim=1).backward(dy)
    y_ref, dx_ref, dw_ref = reference_grads(x, w, dy, recipe)
    assert_rel(torch.cat(ys, 1), y_ref + torch.cat(bs).detach().double())
    assert_rel(xl.grad, dx_ref)
    assert_rel(torch.cat([t.grad for t in ws]), dw_ref)
    torch.testing.assert_close(torch.cat([b.grad for b in bs]), dy.sum(0), rtol=1e-5, atol=1e-7)


def _with_fp8_copies(weights, values):
    """The weights carrying the stacked e4m3 cast of `values` (one scale, adjacent rows), as fsdp=zero3
    hands its gathered weights to the layers."""
    from tpflash.kernels.fp8 import Fp8Weight, cast_stacked
    stacked = cast_stacked([v.detach() for v in values], E4M3)
    for w, row in zip(weights, stacked.row.split([v.shape[0] for v in values])):
        w.fp8_weight = Fp8Weight(row, stacked.scale)
    return weights


def test_tensorwise_gemms_multiply_the_fp8_copies_their_weights_carry_instead_of_casting_them():
    x, w, dy = operands(n=48)
    parts = [16, 24, 8]
    results = []
    for given in (False, True):  # 2w cast by the layer; w carrying the cast of 2w
        ws = [t.clone().requires_grad_() for t in (w if given else 2 * w).split(parts)]
        ws = _with_fp8_copies(ws, (2 * w).split(parts)) if given else ws
        xl = x.clone().requires_grad_()
        y = torch.cat(fp8_linears(xl, ws, [None] * 3, "tensorwise"), dim=1)
        y.backward(dy)
        results.append([y, xl.grad, torch.cat([t.grad for t in ws])])
    for ours, cast_here in zip(*results):
        assert torch.equal(ours, cast_here)


def test_a_gemm_whose_weights_carry_fp8_copies_only_in_part_is_refused():
    x, w, _ = operands(n=48)
    ws = [t.clone() for t in w.split([16, 32])]
    _with_fp8_copies(ws[:1], ws[:1])
    with pytest.raises(RuntimeError, match="must all carry their fp8 copies with one scale"):
        fp8_linears(x, ws, [None, None], "tensorwise")


def test_under_autocast_the_output_is_bf16_and_weight_gradients_fp32():
    x, w, dy = operands()
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, = fp8_linears(xl, [wl], [None], "rowwise")
    assert y.dtype == torch.bfloat16
    y.backward(dy.bfloat16())
    assert wl.grad.dtype == torch.float32 and xl.grad.dtype == torch.float32


def test_quantize_maps_each_rows_amax_to_the_formats_largest_value():
    x = torch.tensor([[1.0, -4.0, 2.0], [0.0, 0.0, 0.0], [1e-3, 5e-4, -2e-3]])
    x8, scale = quantize(x, E4M3, -1)
    assert x8.dtype == E4M3 and scale.shape == (3, 1)
    assert x8.float().abs().amax(dim=1).tolist() == [448.0, 0.0, 448.0]
    assert torch.isfinite(scale).all()
    torch.testing.assert_close(x8.float() * scale, x, rtol=0.07, atol=0)


def test_scaled_mm_off_cuda_is_the_gemm_of_dequantised_operands():
    a8, sa = quantize(torch.randn(8, 16), E4M3, -1)
    b8, sb = quantize(torch.randn(4, 16), E4M3, -1)
    got = scaled_mm(a8, sa, b8.t(), sb.t(), torch.float32)
    torch.testing.assert_close(got, (a8.float() * sa) @ (b8.float() * sb).t())


def _hopper_scaled_mm(calls):
    """A CPU stand-in for torch._scaled_mm on an H100/H200 that refuses what cuBLASLt's fp8 GEMM does not
    take (where CPU's _scaled_mm takes any layout): mat1 row-major, mat2 column-major, dims divisible
    by 16, not two e5m2 operands, fp32 scales of one element each (tensorwise) or [M, 1] and [1, N]
    contiguous with bf16 output (rowwise). Records (scaling, mat1 dtype, mat2 dtype, out_dtype, shapes)
    per call and returns the GEMM of the dequantised operands."""
    def scaled_mm_on_hopper(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                            use_fast_accum=False):
        (m, k), (k_b, n) = a.shape, b.shape
        assert a.dtype in MAX and b.dtype in MAX and not a.dtype == b.dtype == E5M2, (a.dtype, b.dtype)
        assert k == k_b and k % 16 == 0 and n % 16 == 0, (a.shape, b.shape)
        assert a.stride(1) == 1 and a.stride(0) >= k, f"mat1 {tuple(a.shape)} is not row-major: {a.stride()}"
        assert b.stride(0) == 1 and b.stride(1) >= k, f"mat2 {tuple(b.shape)} is not column-major: {b.stride()}"
        assert scale_a.dtype == scale_b.dtype == torch.float32
        if scale_a.numel() == 1 and scale_b.numel() == 1:
            scaling = "tensorwise"
            assert out_dtype in (torch.bfloat16, torch.float16, torch.float32)
        else:
            scaling = "rowwise"
            assert scale_a.shape == (m, 1) and scale_a.is_contiguous(), (scale_a.shape, scale_a.stride())
            assert scale_b.shape == (1, n) and scale_b.is_contiguous(), (scale_b.shape, scale_b.stride())
            assert out_dtype == torch.bfloat16
        calls.append((scaling, a.dtype, b.dtype, out_dtype, tuple(a.shape), tuple(b.shape), use_fast_accum))
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)
    return scaled_mm_on_hopper


def _take_cuda_branch(monkeypatch):
    """scaled_mm's CUDA branch on CPU: every 16-divisible GEMM goes to `_hopper_scaled_mm`; returns its calls."""
    from tpflash.kernels import fp8
    calls = []
    monkeypatch.setattr(fp8, "_cuda_shapes_ok",
                        lambda a, b: a.shape[0] % 16 == 0 and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0)
    monkeypatch.setattr(torch, "_scaled_mm", _hopper_scaled_mm(calls))
    return calls


def test_scaled_mm_gives_torch_scaled_mm_the_layouts_and_scales_cublaslt_takes(monkeypatch):
    hopper_gemm = _take_cuda_branch(monkeypatch)
    a, b = torch.randn(32, 48), torch.randn(48, 16)
    a8, sa = quantize(a, E4M3, None)
    b8, sb = quantize(b, E5M2, None)
    expected = (a8.float() * sa) @ (b8.float() * sb)
    # a column-major first operand, a row-major second one and 1-element scales of shape (1,): fixed up
    got = scaled_mm(a8.t().contiguous().t(), sa.reshape(1), b8, sb.reshape(1, 1), torch.float32)
    torch.testing.assert_close(got, expected)
    ar8, sar = quantize(a, E4M3, -1)  # rowwise: [M, 1]; b's scale per column [1, N], given as the .t() of [N, 1]
    br8, sbr = quantize(b.t().contiguous(), E4M3, -1)
    got = scaled_mm(ar8, sar, br8.t(), sbr.t(), torch.float32)
    torch.testing.assert_close(got, ((ar8.float() * sar) @ (br8.float() * sbr).t()).bfloat16().float())
    assert [c[0] for c in hopper_gemm] == ["tensorwise", "rowwise"]


def test_two_e5m2_operands_are_refused_on_every_device():
    a8, sa = quantize(torch.randn(16, 16), E5M2, None)
    with pytest.raises(ValueError, match="cannot multiply two float8_e5m2 operands"):
        scaled_mm(a8, sa, a8.t(), sa, torch.float32)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_the_fp8_linear_gemms_on_cuda_take_the_formats_and_scales_of_the_recipe(recipe, monkeypatch):
    """The three GEMMs of a layer through scaled_mm's CUDA branch (a strict stand-in for _scaled_mm):
    tensorwise multiplies e4m3 x and W forward and the e5m2 gradient by them backward (dX in the
    compute dtype, dW in fp32), rowwise e4m3 everywhere in bf16; fast accumulation in the forward
    GEMM only; the results equal the emulated GEMMs'."""
    x, w, dy = operands(m=48, k=32, n=64)
    results, hopper_gemm = [], []
    for on_cuda_branch in (False, True):
        if on_cuda_branch:
            hopper_gemm = _take_cuda_branch(monkeypatch)
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, = fp8_linears(xl, [wl], [None], recipe)
        y.backward(dy.bfloat16())
        results.append((y.float(), xl.grad, wl.grad))
    bf16 = torch.bfloat16
    if recipe == "tensorwise":  # the last field: fast accumulation, in the forward GEMM only
        expected = [("tensorwise", E4M3, E4M3, bf16, (48, 32), (32, 64), True),  # y = x W^T
                    ("tensorwise", E5M2, E4M3, bf16, (48, 64), (64, 32), False),  # dX = dY W
                    ("tensorwise", E5M2, E4M3, torch.float32, (64, 48), (48, 32), False)]  # dW = dY^T x
    else:
        expected = [("rowwise", E4M3, E4M3, bf16, (48, 32), (32, 64), True),
                    ("rowwise", E4M3, E4M3, bf16, (48, 64), (64, 32), False),
                    ("rowwise", E4M3, E4M3, bf16, (64, 48), (48, 32), False)]
    assert hopper_gemm == expected
    for emulated, on_cuda in zip(*results):
        assert_rel(on_cuda, emulated.double(), 1e-2)  # rowwise dW: rounded to bf16 on the CUDA branch


def test_unknown_recipe_is_one_clear_error():
    with pytest.raises(ValueError, match=r"fp8='fp4' must be one of \('off', 'rowwise', 'tensorwise', 'delayed'\)"):
        GPTConfig.preset("llama-tiny", fp8="fp4")


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "delayed"])
def test_a_gpt_with_fp8_projections_trains_close_to_full_precision(recipe):
    def curve(fp8):
        torch.manual_seed(0)
        config = GPTConfig.preset("llama-tiny", vocab_size=64, block_size=32, n_layer=2, n_embd=64, n_head=4,
                                  n_kv_head=2, ffn_hidden=128, fp8=fp8)
        model = GPT(config)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(1)
        pattern = torch.randint(0, 64, (8,), generator=gen)
        losses = []
        for _ in range(30):
            idx = pattern.repeat(4, 4)[:, torch.randint(0, 8, (1,), generator=gen).item():][:, :24]
            loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses
    exact, fp8 = curve("off"), curve(recipe)
    assert fp8[-1] < 0.5 * fp8[0]  # it learned the repeating pattern
    assert abs(fp8[-1] - exact[-1]) < 0.1 * exact[0]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_linear_on_cuda_equals_the_gemms_of_fake_quantised_operands(recipe):
    """torch._scaled_mm's GEMMs (bf16 activations, fp32 weights under autocast) against the reference."""
    x, w, dy = (t.cuda() for t in operands(m=256, k=512, n=384))
    xl, wl = x.bfloat16().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, = fp8_linears(xl, [wl], [None], recipe)
    y.backward(dy.bfloat16())
    y_ref, dx_ref, dw_ref = reference_grads(x.bfloat16().float().cpu(), w.cpu(), dy.bfloat16().float().cpu(), recipe)
    assert_rel(y.float().cpu(), y_ref, 1e-2)
    assert_rel(xl.grad.float().cpu(), dx_ref, 1e-2)
    assert_rel(wl.grad.cpu(), dw_ref, 1e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "delayed"])
def test_a_graphed_fp8_gpt_trains_like_the_eager_one(device, recipe):
    """The blocks captured as CUDA graphs (on CPU the replay's eager stand-in) with fp8 GEMMs: the casts
    and _scaled_mm run inside the capture, and the replays give the eager model's losses. Shapes are
    multiples of 16, so on CUDA every projection takes torch._scaled_mm."""
    def curve(graphed):
        torch.manual_seed(0)
        config = GPTConfig.preset("llama-tiny", vocab_size=128, block_size=32, n_layer=2, n_embd=64, n_head=4,
                                  n_kv_head=2, ffn_hidden=128, fp8=recipe)
        model = GPT(config, device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
        if graphed:
            with autocast:
                model.capture_cuda_graphs(4, 32)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(6):
            idx = torch.randint(0, 128, (4, 33), generator=gen).to(device)
            with autocast:
                loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert (model._graphed_blocks is not None) == graphed
        return losses
    eager, graphed = curve(False), curve(True)
    assert all(torch.isfinite(torch.tensor(graphed)))
    assert max(abs(a - b) for a, b in zip(eager, graphed)) < 1e-3 * eager[0], (eager, graphed)


def _pretend_gpu(monkeypatch, capability, name):
    from tpflash.kernels import fp8
    fp8._capability.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return fp8


def test_fp8_on_a_gpu_without_fp8_matrix_units_is_one_clear_error(monkeypatch):
    fp8 = _pretend_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"fp8='rowwise' needs a GPU with fp8 matrix units \(compute capability "
                                         r"8.9 or newer.*cuda:0 \(NVIDIA A100-SXM4-80GB\) is 8.0: train with fp8='off'"):
        fp8.check_fp8_device("rowwise", "cuda")
    fp8.check_fp8_device("off", "cuda")  # bf16 GEMMs run anywhere
    fp8._capability.cache_clear()


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_fp8_is_accepted_on_ada_hopper_and_newer_and_on_cpu(monkeypatch, capability):
    fp8 = _pretend_gpu(monkeypatch, capability, "a GPU")
    fp8.check_fp8_device("tensorwise", torch.device("cuda", 0))
    fp8.check_fp8_device("rowwise", "cpu")  # the emulated GEMM
    fp8._capability.cache_clear()


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_interpreter), "reference"])
def test_a_tensorwise_swiglu_mlp_takes_swiglus_amaxes_with_the_bits_of_computing_them(backend, checkpointed):
    """ParallelMLP hands its tensorwise GEMMs the amaxes swiglu takes as it writes h and [d_up | d_gate]
    (docs/fp8.md): the output and every gradient equal those of the same GEMMs taking the amaxes
    themselves, also when the MLP is recomputed in the backward (activation checkpointing)."""
    from torch.utils.checkpoint import checkpoint
    from tpflash.kernels import swiglu, use_backend
    from tpflash.layers.mlp import ParallelMLP
    torch.manual_seed(0)
    mlp = ParallelMLP(16, 24, mlp="swiglu", bias=False, fp8="tensorwise")  # small: Triton's interpreter is slow
    x, dy = torch.randn(4, 2, 16), torch.randn(4, 2, 16).bfloat16()

    def composed(x):
        up, gate = fp8_linears(x, [mlp.up_proj.weight, mlp.gate_proj.weight], [None, None], "tensorwise")
        return fp8_linears(swiglu(up, gate), [mlp.down_proj.weight], [None], "tensorwise")[0]

    results = []
    for fn in (mlp, composed):
        xl = x.clone().requires_grad_()
        mlp.zero_grad()
        with use_backend(backend):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = checkpoint(fn, xl, use_reentrant=False) if checkpointed else fn(xl)
            y.backward(dy)
        results.append([y, xl.grad] + [p.grad for p in mlp.parameters()])
    for mine, reference in zip(*results):
        assert torch.equal(mine, reference)
