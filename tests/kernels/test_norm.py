"""Triton LayerNorm / RMSNorm (+ fused residual) vs a float64 reference, forward and backward."""
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import DEVICE, ZeroFills, assert_rel, float64_twin, needs_interpreter, run_with_grads
from tpflash.kernels import layer_norm, rms_norm, use_backend
from tpflash.kernels.sum_parts import sum_parts
from tpflash.kernels.norm_kernels import _norm_backward


def _inputs(shape, dtype, residual, bias, device="cpu"):
    torch.manual_seed(0)
    n = shape[-1]
    x = torch.randn(shape, device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(n, device=device)).to(dtype)
    b = (0.1 * torch.randn(n, device=device)).to(dtype) if bias else None
    r = torch.randn(shape, device=device, dtype=dtype) if residual else None
    return x, w, b, r


def _check(rms, residual, shape=(3, 5, 40), dtype=torch.float32, device="cpu"):
    x, w, b, r = _inputs(shape, dtype, residual, bias=not rms, device=device)
    if rms:
        fn = lambda x, w, b, r: rms_norm(x, w, residual=r)  # noqa: E731
    else:
        fn = lambda x, w, b, r: layer_norm(x, w, b, residual=r)  # noqa: E731
    torch.manual_seed(1)
    grads_out = [torch.randn_like(x)] + ([torch.randn_like(x)] if residual else [])
    outs, grads = run_with_grads(fn, [x, w, b, r], grads_out)
    ref_outs, ref_grads = float64_twin(fn, [x, w, b, r], grads_out)
    for i, (o, ro) in enumerate(zip(outs, ref_outs)):
        assert_rel(o, ro, dtype, ["y", "new_residual"][i])
    names = [n for n, t in zip(["dx", "dweight", "dbias", "dresidual"], [x, w, b, r]) if t is not None]
    for name, g, rg in zip(names, grads, ref_grads):
        assert_rel(g, rg, dtype, name, scale=2.0 if name in ("dweight", "dbias") else 1.0)


@needs_interpreter
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_norm_matches_reference(rms, residual):
    _check(rms, residual)


def test_norm_references_match_torch():
    x, w, b, _ = _inputs((4, 32), torch.float64, residual=False, bias=True)
    assert_rel(layer_norm(x, w, b), F.layer_norm(x, (32,), w, b), torch.float64, "layer_norm")
    assert_rel(rms_norm(x, w), x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w, torch.float64, "rms")


def test_norm_rejects_a_weight_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"weight shape \(8,\) must be \[16\]"):
        layer_norm(torch.randn(2, 16), torch.ones(8))


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("n", [1024, 4096, 5120])
def test_norm_matches_reference_on_gpu(rms, residual, n):
    _check(rms, residual, (4, 512, n), torch.bfloat16, DEVICE)


def _backward_inputs(rows, n, rms, has_dres, dtype=torch.float32, device="cpu"):
    """(h, weight, bias, dy, dres, mean, rstd) as the forward would save them, and the reference grads."""
    torch.manual_seed(2)
    h, w, b, dres = _inputs((rows, n), dtype, has_dres, bias=not rms, device=device)
    dy = torch.randn_like(h)
    hf = h.float()
    mean = torch.zeros(rows, device=device) if rms else hf.mean(-1)
    rstd = torch.rsqrt((hf - mean[:, None]).square().mean(-1) + 1e-5)
    fn = (lambda x, w, b: rms_norm(x, w, eps=1e-5)) if rms else (lambda x, w, b: layer_norm(x, w, b, eps=1e-5))
    _, ref = float64_twin(fn, [h, w, b], [dy])
    if has_dres:
        ref = (ref[0] + dres.double(),) + tuple(ref[1:])
    return (h, w, b, dy, dres, mean, rstd), ref


@needs_interpreter
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("has_dres", [False, True], ids=["plain", "dresidual"])
def test_norm_backward_gives_the_same_bits_for_every_tile_height(rms, has_dres):
    # 37 rows: groups of 10, 10, 10 and 7 rows, so tiles of 2 or 4 rows end part-empty
    (h, w, b, dy, dres, mean, rstd), ref = _backward_inputs(37, 300, rms, has_dres)
    runs = [_norm_backward(h, w, b, dy, dres, mean, rstd, rms, h.dtype, {"ROWS": r, "STAGES": s})
            for r, s in [(1, 1), (2, 2), (4, 1)]]
    for run in runs:
        for name, g, rg in zip(["dx", "dweight", "dbias"], run, ref):
            assert_rel(g, rg, torch.float32, name, scale=2.0)
        assert all(torch.equal(g, g0) for g, g0 in zip(run, runs[0]) if g is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n", [1024, 4096, 5120])
def test_norm_backward_repeats_its_bits_on_gpu(rms, n):
    # tp ranks that normalise the same replicated activations must get the same gradient bits
    (h, w, b, dy, dres, mean, rstd), ref = _backward_inputs(2000, n, rms, True, torch.bfloat16, DEVICE)
    runs = [_norm_backward(h, w, b, dy, dres, mean, rstd, rms, h.dtype) for _ in range(2)]
    for name, g, rg in zip(["dx", "dweight", "dbias"], runs[0], ref):
        assert_rel(g, rg, torch.bfloat16, name, scale=2.0)
    assert all(torch.equal(g, g0) for g, g0 in zip(runs[1], runs[0]) if g is not None)


def _out_dtype_check(rms, device):
    """out_dtype=bf16 on an fp32 input (the blocks' autocast_output): y is the fp32 result rounded
    once, the gradients (dy in bf16) equal those of the norm followed by a cast."""
    x, w, b, r = _inputs((6, 5, 48), torch.float32, True, bias=not rms, device=device)
    fn = rms_norm if rms else (lambda x, w, residual=None, out_dtype=None: layer_norm(x, w, b, residual=residual,
                                                                                       out_dtype=out_dtype))
    xs = [t.clone().requires_grad_() for t in (x, r)]
    ys = [t.clone().requires_grad_() for t in (x, r)]
    y, res = fn(xs[0], w, residual=xs[1], out_dtype=torch.bfloat16)
    y_ref, res_ref = fn(ys[0], w, residual=ys[1])
    assert y.dtype == torch.bfloat16 and res.dtype == torch.float32
    assert_rel(y, y_ref.to(torch.bfloat16), torch.bfloat16, "y")
    torch.manual_seed(3)
    dy = torch.randn(y.shape, device=device).to(torch.bfloat16)
    (y.float() * dy.float()).sum().backward()
    (y_ref.to(torch.bfloat16).float() * dy.float()).sum().backward()
    for name, g, g_ref in [("dx", xs[0].grad, ys[0].grad), ("dresidual", xs[1].grad, ys[1].grad)]:
        assert g.dtype == torch.float32, name
        assert_rel(g, g_ref, torch.float32, name)


@needs_interpreter
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_writes_y_in_out_dtype(rms):
    _out_dtype_check(rms, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_writes_y_in_out_dtype_on_gpu(rms):
    _out_dtype_check(rms, DEVICE)


def _as_the_kernel_rounds(g, dtype):
    """g cast to dtype as a Triton store rounds it: to nearest even (as torch) in a compiled kernel;
    Triton's CPU interpreter truncates fp32 -> bf16 (its cast passes no rounding mode)."""
    if g.is_cuda or dtype != torch.bfloat16:
        return g.to(dtype)
    return (g.view(torch.int32) & -65536).view(torch.float32).to(dtype)


def _low_dx_check(rms, shape, device):
    """A bf16 x (the branch output) and an fp32 residual: x's gradient comes out in bf16, the residual
    gradient rounded once."""
    x, w, b, r = _inputs(shape, torch.float32, True, bias=not rms, device=device)
    x = x.to(torch.bfloat16).requires_grad_()
    r.requires_grad_()
    with use_backend("triton"):
        y, res = rms_norm(x, w, residual=r) if rms else layer_norm(x, w, b, residual=r)
    torch.manual_seed(4)
    torch.autograd.backward([y, res], [torch.randn_like(y), torch.randn_like(res)])
    assert x.grad.dtype == torch.bfloat16 and r.grad.dtype == torch.float32
    assert torch.equal(x.grad, _as_the_kernel_rounds(r.grad, torch.bfloat16))


@needs_interpreter
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_writes_a_bf16_x_gradient_as_the_rounded_residual_gradient(rms):
    _low_dx_check(rms, (3, 5, 40), "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_writes_a_bf16_x_gradient_as_the_rounded_residual_gradient_on_gpu(rms):
    _low_dx_check(rms, (4, 512, 4096), DEVICE)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_the_fused_add_normalises_the_residual_it_returns(backend, rms):
    """norm(x, residual) is norm of the new residual as stored (bf16 here), bit for bit: what its backward
    differentiates, what a recomputation from the residual stream gives, and, where the residual is
    rounded as PyTorch rounds, what the unfused `norm(x + residual)` in bf16 computes."""
    x, w, b, r = _inputs((4, 3, 64), torch.bfloat16, residual=True, bias=not rms)
    def norm(x, r=None):
        return rms_norm(x, w, residual=r) if rms else layer_norm(x, w, b, residual=r)

    with use_backend(backend):
        y, new_residual = norm(x, r)
        assert torch.equal(y, norm(new_residual))
    if backend == "reference":  # (Triton's CPU interpreter rounds fp32 to bf16 its own way)
        assert torch.equal(new_residual, x + r)


def _parts_case(rms, n_parts, device, seed):
    """(shape, x's bf16 parts, an fp32 residual, norm(x, residual, **kw)) with random weights."""
    torch.manual_seed(seed)
    shape = (6, 5, 48)
    parts = [torch.randn(shape, device=device).to(torch.bfloat16) for _ in range(n_parts)]
    r = torch.randn(shape, device=device)
    w = (1 + 0.1 * torch.randn(48, device=device))
    b = None if rms else 0.1 * torch.randn(48, device=device)

    def norm(x, residual, **kw):
        return rms_norm(x, w, residual=residual, **kw) if rms else layer_norm(x, w, b, residual=residual, **kw)
    return shape, parts, r, norm


def _parts_check(rms, n_parts, device):
    """x given as parts (bf16, as a reduce-scatter leaves them) with an fp32 residual: y and the new
    residual are those of the parts' fp32 sum rounded once to bf16 (kernels.sum_parts), and only the
    first part gets a gradient, x's."""
    shape, parts, r, fn = _parts_case(rms, n_parts, device, seed=4)
    xs = [parts[0].clone().requires_grad_()] + parts[1:]
    rs = r.clone().requires_grad_()
    y, res = fn(xs, rs)
    summed = sum_parts(parts, torch.bfloat16)
    x_ref, r_ref = summed.requires_grad_(), r.clone().requires_grad_()
    y_ref, res_ref = fn(x_ref, r_ref)
    assert y.dtype == torch.bfloat16 and res.dtype == torch.float32
    assert_rel(res, res_ref, torch.float32, "new_residual")
    assert_rel(y, y_ref.to(torch.bfloat16), torch.bfloat16, "y")
    dy = torch.randn(shape, device=device)
    (y.float() * dy).sum().backward()
    (y_ref.to(torch.bfloat16).float() * dy).sum().backward()
    assert xs[0].grad.dtype == torch.bfloat16
    assert_rel(xs[0].grad, x_ref.grad.to(torch.bfloat16), torch.bfloat16, "dx")
    assert_rel(rs.grad, r_ref.grad, torch.float32, "dresidual")


@needs_interpreter
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n_parts", [2, 4])
def test_norm_adds_the_parts_of_x(rms, n_parts):
    _parts_check(rms, n_parts, "cpu")


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_adds_the_parts_of_x_on_the_reference(rms):
    with use_backend("reference"):
        _parts_check(rms, 3, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n_parts", [2, 4])
def test_norm_adds_the_parts_of_x_on_gpu(rms, n_parts):
    _parts_check(rms, n_parts, DEVICE)


def test_norm_parts_of_another_shape_are_refused():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="part 1 is"):
        layer_norm([x, torch.randn(4, 9)], torch.ones(8), residual=x)


def _out_check(rms, n_parts, device, backend):
    """With `out`, y's values land in out (the Triton kernels return y as a view of it; the reference
    path fills it beside y) and everything else is as without it: y, the new residual, the gradients."""
    shape, parts, r, norm = _parts_case(rms, n_parts, device, seed=5)
    fn = partial(norm, out_dtype=torch.bfloat16)
    runs = []
    for out in (None, torch.full(shape, float("nan"), device=device, dtype=torch.bfloat16)):
        xs = [parts[0].clone().requires_grad_()] + parts[1:]
        rs = r.clone().requires_grad_()
        with use_backend(backend):
            y, res = fn(xs if n_parts > 1 else xs[0], rs, out=out)
            (y.float() * torch.linspace(-1, 1, y.numel(), device=device).view(shape)).sum().backward()
        runs.append((y.detach(), res.detach(), xs[0].grad, rs.grad, out))
    (y, res, dx, dr, _), (y_out, res_out, dx_out, dr_out, out) = runs
    assert torch.equal(out, y)
    assert (y_out.data_ptr() == out.data_ptr()) == (backend == "triton"), "y is a view of out on Triton only"
    for name, a, e in [("y", y_out, y), ("new residual", res_out, res), ("dx", dx_out, dx), ("dresidual", dr_out, dr)]:
        assert torch.equal(a, e), f"{name} differs with out"


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n_parts", [1, 2])
def test_norm_writes_y_into_out(backend, rms, n_parts):
    _out_check(rms, n_parts, "cpu", backend)


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n_parts", [1, 2])
def test_norm_writes_y_into_out_on_gpu(rms, n_parts):
    _out_check(rms, n_parts, DEVICE, "triton")


def test_norm_refuses_an_out_of_another_dtype():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"y needs a contiguous \(4, 8\) torch.float32"):
        layer_norm(x, torch.ones(8), out=torch.empty(4, 8, dtype=torch.bfloat16))



def _ports_check(rms, n_ports, device, backend):
    """With grad_ports, y comes with ports whose gradients are added to y's: the gradients of x, the
    residual, the weight and the bias are those of y's gradient given as y's and the ports' fp32 sum
    rounded once to bf16 (kernels.sum_parts' bits), and a port left without a gradient adds nothing."""
    torch.manual_seed(6)
    shape = (6, 5, 48)
    x0, r0 = torch.randn(shape, device=device).to(torch.bfloat16), torch.randn(shape, device=device)
    w0, b0 = 1 + 0.1 * torch.randn(48, device=device), 0.1 * torch.randn(48, device=device)
    dys = [torch.randn(shape, device=device).to(torch.bfloat16) for _ in range(1 + n_ports)]

    def grads(ports, given):
        x, r, w, b = (t.clone().requires_grad_() for t in (x0, r0, w0, b0))
        with use_backend(backend):
            if rms:
                y, res = rms_norm(x, w, residual=r, out_dtype=torch.bfloat16, grad_ports=ports)
            else:
                y, res = layer_norm(x, w, b, residual=r, out_dtype=torch.bfloat16, grad_ports=ports)
            y, *port_outs = y if ports else (y,)  # (y, *ports) with ports
            assert len(port_outs) == ports and all(p.shape == y.shape and p.dtype == y.dtype for p in port_outs)
            torch.autograd.backward([y, *port_outs[:len(given) - 1]], given)
        return x.grad, r.grad, w.grad, (None if rms else b.grad)

    names = ("dx", "dresidual", "dweight", "dbias")
    with_ports, with_sum = grads(n_ports, dys), grads(0, [sum_parts(dys, torch.bfloat16)])
    # Triton's CPU interpreter rounds fp32 to bf16 toward zero, torch to nearest: bits there, a bf16 error here
    exact = backend == "reference" or device != "cpu"
    for name, a, e in zip(names, with_ports, with_sum):
        if a is None and e is None:
            continue
        if exact:
            assert torch.equal(a, e), f"{name} with {n_ports} ports differs from the sum's"
        else:
            assert_rel(a, e, torch.bfloat16, f"{name} with {n_ports} ports")
    for name, a, e in zip(names, grads(n_ports, dys[:1]), grads(0, dys[:1])):
        assert (a is None and e is None) or torch.equal(a, e), f"{name} differs where the ports get no gradient"


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n_ports", [1, 3])
def test_norm_adds_its_ports_gradients_to_ys(backend, rms, n_ports):
    _ports_check(rms, n_ports, "cpu", backend)


@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n_ports", [1, 3])
def test_norm_adds_its_ports_gradients_to_ys_on_gpu(rms, n_ports):
    _ports_check(rms, n_ports, DEVICE, "triton")


def test_norm_refuses_more_ports_than_its_kernel_adds():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"grad_ports=4 must be in \[0, 3\]"):
        layer_norm(x, torch.ones(8), residual=x, grad_ports=4)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_interpreter)])
def test_norm_makes_no_zeros_for_an_unused_residual_or_port(backend):
    """A model's final norm returns a new residual nobody reads, and a port may get no gradient: the
    backward makes no [rows, n] zeros for them (a memset and a read each, every step on a GPU)."""
    x, w, _, r = _inputs((6, 5, 48), torch.float32, residual=True, bias=False)
    x.requires_grad_()
    with use_backend(backend):
        (y, port), _ = rms_norm(x, w, residual=r, grad_ports=1)
    fills = ZeroFills()
    with fills, use_backend(backend):
        y.sum().backward()
    assert x.grad is not None
    assert (6, 5, 48) not in fills.shapes and (30, 48) not in fills.shapes, f"zeros made: {fills.shapes}"


def _grad_into_check(device, backend, x_dtype, with_residual=True):
    """With x_grad_into, the backward writes x's gradient into the tensor it gives, and that tensor is x's
    gradient; every gradient has the bits it has without (a residual of x's dtype or fp32); without a
    residual it is never asked."""
    torch.manual_seed(7)
    shape = (6, 5, 48)
    x0, r0 = torch.randn(shape, device=device).to(x_dtype), torch.randn(shape, device=device)
    w0 = 1 + 0.1 * torch.randn(48, device=device)
    dy = torch.randn(shape, device=device).to(torch.bfloat16)
    places, seen = [], []  # the tensors given; the data_ptr of the gradient x's producer gets

    def into(shape, dtype, dev):
        places.append(torch.full(shape, float("nan"), dtype=dtype, device=dev))
        return places[-1]

    class Producer(torch.autograd.Function):  # what a row layer's backward sees of x's gradient
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            seen.append(grad.data_ptr())
            return grad

    def grads(x_grad_into):
        x_leaf, r, w = (t.clone().requires_grad_() for t in (x0, r0.to(x_dtype) if x_dtype != torch.bfloat16 else r0,
                                                              w0))
        with use_backend(backend):
            y = rms_norm(Producer.apply(x_leaf), w, residual=r if with_residual else None, out_dtype=torch.bfloat16,
                         x_grad_into=x_grad_into)
        (y[0] if with_residual else y).backward(dy)
        return x_leaf.grad, (r.grad if with_residual else None), w.grad

    placed, plain = grads(into), grads(None)
    if not with_residual:
        assert not places, "x_grad_into asked without a residual"
        return
    assert len(places) == 1 and seen[0] == places[0].data_ptr(), "x's gradient is not the given tensor"
    for name, a, e in zip(("dx", "dresidual", "dweight"), placed, plain):
        assert torch.equal(a, e), f"{name} differs when x's gradient is written where x_grad_into says"


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16-x-fp32-residual", "fp32"])
def test_norm_writes_xs_gradient_where_x_grad_into_says(backend, x_dtype):
    _grad_into_check("cpu", backend, x_dtype)


def test_norm_asks_no_place_for_xs_gradient_without_a_residual():
    _grad_into_check("cpu", "reference", torch.float32, with_residual=False)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16-x-fp32-residual", "fp32"])
def test_norm_writes_xs_gradient_where_x_grad_into_says_on_gpu(x_dtype):
    _grad_into_check(DEVICE, "triton", x_dtype)
