"""fp8 casts (tpflash.kernels.fp8.cast): the Triton kernels equal `quantize` bit for bit (x8 bytes and
fp32 scales) for each scaling (per row, per column, per tensor, a given amax) and layout (row- and
column-major), on every fp8 value, every tie between two of them and their neighbours, subnormals,
zeros, negatives and the clamp, in e4m3 and e5m2 from bf16 and fp32; the CPU path is quantize itself;
the fp8 layers give the same bits on either path."""
import os
import subprocess
import sys

import pytest
import torch

from tests.kernels.helpers import DEVICE, compiled_for_h100, h100_program, needs_interpreter
from tpflash.kernels import use_backend
from tpflash.kernels.fp8 import E4M3, E5M2, FP8_MAX, cast, cast_stacked, column_major, quantize, tensor_amax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FORMATS = pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
SOURCES = pytest.mark.parametrize("src", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# (dim, row-major, column-major): as the fp8 layers call cast
SCALINGS = {"rowwise": (-1, True, False), "column": (0, False, True), "tensorwise": (None, True, True)}


def _bits(t):
    return t.view(torch.uint8)


def grid_and_ties(fp8, src, cols=24):
    """[rows, cols] in src: every finite fp8 value, every midpoint between neighbours (a tie: rounds to
    the even one, across a binade at 15.5 * 2^e, to zero below the smallest subnormal) and the src
    values on either side of each midpoint, both signs, divided by the quant of amax 7: 7 leads every
    row and column, and quantize's quant, (1 / 7) * FP8_MAX, is a power of two (64 e4m3, 8192 e5m2),
    so x * quant lands on these points exactly."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = values[torch.isfinite(values) & (values >= 0)].unique()  # sorted
    mids = ((grid[1:] + grid[:-1]) / 2).to(src)
    up, down = torch.full_like(mids, float("inf")), torch.zeros_like(mids)
    points = torch.cat([grid.to(src), mids, torch.nextafter(mids, up), torch.nextafter(mids, down)]).float()
    quant = torch.tensor(7.0).reciprocal() * FP8_MAX[fp8]
    assert quant.log2() == quant.log2().round()
    points = torch.cat([points, -points]) / quant
    body = torch.cat([points, torch.zeros(-len(points) % (cols - 1))]).view(-1, cols - 1)
    x = torch.cat([torch.full((body.shape[0], 1), 7.0), body], dim=1)
    x = torch.cat([torch.full((1, cols), 7.0), x])
    return x.to(src)


def every_magnitude(src, rows=21, cols=45, device="cpu"):
    """Random rows from 1e-30 to 1e30 (under amax 1e-12 the floor scales them), an outlier in the middle
    row (most of it lands in fp8's subnormals or at zero), the last row zeros."""
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(rows, cols, generator=gen, device=device) * torch.logspace(-30, 30, rows, device=device)[:, None]
    x[rows // 2, 3] *= 1e6
    x[-1] = 0
    return x.to(src)


def assert_cast_equals_quantize(x, fp8, scaling, amax=None, backend="triton"):
    dim, row, col = SCALINGS[scaling]
    with use_backend(backend):
        got = cast(x, fp8, dim, amax, row=row, col=col)
    x8, scale = quantize(x, fp8, dim, amax)
    assert got.scale.shape == scale.shape and torch.equal(got.scale, scale)
    for layout, out in (("row", got.row), ("col", got.col)):
        if out is None:
            continue
        assert out.dtype == fp8 and out.shape == x8.shape
        if layout == "col":
            assert out.t().is_contiguous()  # [K, M] contiguous: scaled_mm takes it without a copy
        differ = (_bits(out) != _bits(x8)).nonzero()
        assert len(differ) == 0, f"{layout}: {len(differ)} bytes differ, first at {differ[0].tolist()}: " \
            f"x {x[tuple(differ[0])].item()!r} -> {out[tuple(differ[0])].float().item()} " \
            f"(quantize {x8[tuple(differ[0])].float().item()})"
    return got


@needs_interpreter
@pytest.mark.parametrize("scaling", list(SCALINGS))
@SOURCES
@FORMATS
def test_cast_equals_quantize_on_every_fp8_value_and_tie(scaling, src, fp8):
    assert_cast_equals_quantize(grid_and_ties(fp8, src), fp8, scaling)


@needs_interpreter
@pytest.mark.parametrize("scaling", list(SCALINGS))
@SOURCES
@FORMATS
def test_cast_equals_quantize_on_rows_of_every_magnitude(scaling, src, fp8):
    assert_cast_equals_quantize(every_magnitude(src), fp8, scaling)


@needs_interpreter
@FORMATS
def test_a_given_amax_below_the_values_clamps_them_to_the_formats_largest(fp8):
    x = grid_and_ties(fp8, torch.float32)
    got = assert_cast_equals_quantize(x, fp8, "tensorwise", amax=torch.tensor(3.5))  # quant twice amax 7's
    assert got.row.float().abs().max() == FP8_MAX[fp8] and (x.abs() * 2 > 7).any()


@needs_interpreter
def test_rowwise_cast_takes_strided_rows_and_leading_dims():
    base = every_magnitude(torch.bfloat16, rows=30, cols=60)
    assert_cast_equals_quantize(base[:, 7:52], E4M3, "rowwise")  # row stride 60
    got = assert_cast_equals_quantize(base.view(2, 15, 60), E4M3, "rowwise")
    assert got.row.shape == (2, 15, 60) and got.scale.shape == (2, 15, 1)


@needs_interpreter
def test_a_nan_makes_its_slices_scale_and_values_nan_as_in_quantize():
    x = every_magnitude(torch.float32, rows=6, cols=10)
    x[2, 4] = float("nan")
    with use_backend("triton"):
        got = cast(x, E5M2, -1)  # e5m2: the interpreter writes e4m3's NaN as 384; CUDA is checked on the GPU
    x8, scale = quantize(x, E5M2, -1)
    assert scale[2].isnan() and torch.equal(got.scale.isnan(), scale.isnan())
    assert torch.equal(got.scale.nan_to_num(), scale.nan_to_num())
    assert got.row[2].float().isnan().all() and torch.equal(_bits(got.row[3:]), _bits(x8[3:]))


@needs_interpreter
@pytest.mark.parametrize("scaling", list(SCALINGS))
@FORMATS
def test_an_all_zero_tensor_casts_to_zeros_with_a_finite_scale(scaling, fp8):
    """amax 0 takes the floor (torchao's EPS, 1e-12): zeros and a finite, non-zero scale, no NaN."""
    got = assert_cast_equals_quantize(torch.zeros(6, 40, dtype=torch.bfloat16), fp8, scaling)
    torch.testing.assert_close(got.scale, torch.full_like(got.scale, 1e-12 / FP8_MAX[fp8]))
    assert all(_bits(out).eq(0).all() for out in (got.row, got.col) if out is not None)


@needs_interpreter
def test_tensor_amax_reduces_the_partial_maxima_to_amax_of_x():
    x = every_magnitude(torch.bfloat16, rows=70, cols=45)  # several row splits and column blocks
    with use_backend("triton"):
        got = tensor_amax(x)
    assert got.shape == () and got.dtype == torch.float32 and got == x.float().abs().max()


def assert_stacked_cast_equals_casting_the_stack(tensors, fp8, backend="triton"):
    with use_backend(backend):
        got = cast_stacked(tensors, fp8, col=True)
    x8, scale = quantize(torch.cat(tensors), fp8, None)
    assert torch.equal(got.scale, scale)
    assert got.row.is_contiguous() and got.col.t().is_contiguous()
    for layout, out in (("row", got.row), ("col", got.col)):
        assert out.dtype == fp8 and out.shape == x8.shape
        assert torch.equal(_bits(out), _bits(x8)), f"{layout}: {(_bits(out) != _bits(x8)).sum().item()} bytes differ"


@needs_interpreter
@FORMATS
def test_a_stacked_cast_equals_casting_the_stack(fp8):
    """q/k/v-like weights cast into one fp8 buffer with one scale: the bytes of casting their fp32 stack,
    whichever of them holds the amax."""
    x = every_magnitude(torch.float32, rows=21, cols=16)
    assert_stacked_cast_equals_casting_the_stack([x[:12], x[12:15], x[15:]], fp8)  # the amax in the first
    assert_stacked_cast_equals_casting_the_stack([x[15:], x[:5], x[5:15]], fp8)  # in the last
    assert_stacked_cast_equals_casting_the_stack([x[:7]], fp8)


def test_on_cpu_a_stacked_cast_is_quantize_of_the_stack():
    x = every_magnitude(torch.float32, rows=8, cols=16)
    assert_stacked_cast_equals_casting_the_stack([x[:3], x[3:]], E4M3, backend="auto")


def test_a_stacked_cast_of_tensors_of_other_widths_is_one_clear_error():
    with pytest.raises(ValueError, match=r"cast_stacked: the tensors must be 2-D with one width, \[n_i, K\]; "
                                         r"got \[\(3, 16\), \(2, 8\)\]"):
        cast_stacked([torch.ones(3, 16), torch.ones(2, 8)], E4M3)


def test_on_cpu_cast_is_quantize_in_the_layouts_asked_for():
    x = every_magnitude(torch.float32, rows=8, cols=16)
    got = assert_cast_equals_quantize(x, E4M3, "tensorwise", backend="auto")
    assert got.row.is_contiguous()


def test_a_column_major_cast_needs_a_matrix():
    with pytest.raises(ValueError, match=r"a column-major x8 needs a 2-D x, not \(2, 3, 4\)"):
        cast(torch.ones(2, 3, 4), E4M3, None, col=True)


def assert_column_major_copies_the_bytes(x8):
    got = column_major(x8)
    assert got.shape == x8.shape and got.stride() == (1, x8.shape[0])
    assert torch.equal(_bits(got), _bits(x8))


@needs_interpreter
@FORMATS
def test_column_major_copies_every_byte_into_the_transposed_storage(fp8):
    # every byte value, in shapes that leave ragged tiles on both axes
    x8 = torch.arange(13 * 21, dtype=torch.int64).remainder(256).to(torch.uint8).view(fp8).view(13, 21)
    with use_backend("triton"):
        assert_column_major_copies_the_bytes(x8)


def test_on_cpu_column_major_is_torchs_copy():
    assert_column_major_copies_the_bytes(torch.randn(5, 7).to(E4M3))


def test_column_major_of_a_non_contiguous_matrix_is_one_clear_error():
    with pytest.raises(ValueError, match=r"column_major: x8 must be a contiguous 2-D tensor, got \(7, 5\)"):
        column_major(torch.randn(5, 7).to(E4M3).t())


def linears_on(backend, recipe, x, w, dy, pieces, device_type):
    """(y, dx, [dW_i]) of fp8_linears over w split by rows into `pieces` weights (stacked GEMMs)."""
    from tpflash.layers.fp8_linear import fp8_linears
    xl = x.clone().requires_grad_()
    ws = [p.clone().requires_grad_() for p in w.chunk(pieces)]
    with use_backend(backend), torch.autocast(device_type, dtype=torch.bfloat16):
        ys = fp8_linears(xl, ws, [None] * pieces, recipe)
    with use_backend(backend):
        torch.cat(ys, dim=-1).backward(dy)
    return [torch.cat(ys, dim=-1), xl.grad] + [p.grad for p in ws]


@needs_interpreter
@pytest.mark.parametrize("pieces", [1, 3], ids=["one-weight", "stacked"])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_linears_on_the_triton_casts_give_the_reference_bits(recipe, pieces):
    from tests.test_fp8_linear import operands
    x, w, dy = operands(m=12, k=20, n=18)
    ref, got = (linears_on(backend, recipe, x, w, dy.bfloat16(), pieces, "cpu") for backend in ("reference", "triton"))
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def test_the_benchmark_cpu_smoke_run_prints_a_row_per_cast_and_impl():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "benchmarks/fp8_cast.py", "--device", "cpu", "--shapes", "8x16",
                           "--no-compile", "--reps", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| 8x16 |")]
    assert len(table) == 8  # 4 casts x (tpflash, eager quantize)
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    assert all(float(c[3]) > 0 and float(c[4]) > 0 for c in cells)  # ms, GB/s


_COMPILE_FOR_H100 = h100_program("fp8_cast", """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tpflash.kernels.fp8_cast_kernel import AMAX_COLUMNS, AMAX_TENSOR, CAST_TILE, FORMATS, _amax_kernel, _cast_kernel, _transpose_kernel
import torch
amax_sig = {"X": "*bf16", "PARTIALS": "*fp32", "rows": "i32", "cols": "i32", "stride_row": "i64",
            "rows_per_split": "i32", "PER_COLUMN": "constexpr", "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"}
cast_sig = {"X": "*bf16", "OUT_ROW": "*fp8e4nv", "OUT_COL": "*fp8e4nv", "SCALE": "*fp32", "AMAX": "*fp32",
            "RECORD": "*i32", "rows": "i32", "cols": "i32", "stride_row": "i64", "stride_col": "i64", "amax_count": "i32"}
cast_sig.update({k: "constexpr" for k in ("SCALE_BY", "PAST_AMAX", "WITH_RECORD", "WRITE_ROW", "WRITE_COL", "FP8_MAX", "MANTISSA", "MIN_EXP",
                                          "BLOCK_R", "BLOCK_C", "BLOCK_A")})
target, n = GPUTarget("cuda", 90, 32), 0
for per_column, cfg in ((True, AMAX_COLUMNS), (False, AMAX_TENSOR)):
    src = ASTSource(_amax_kernel, amax_sig, constexprs=dict(PER_COLUMN=per_column, BLOCK_R=cfg["BLOCK_R"],
                                                             BLOCK_C=cfg["BLOCK_C"]))
    n += bool(triton.compile(src, target=target, options={"num_warps": cfg["WARPS"]}).asm["cubin"])
fp8_max, mantissa, min_exp = FORMATS[torch.float8_e4m3fn]
tile = (CAST_TILE["BLOCK_R"], CAST_TILE["BLOCK_C"])
for scale_by, past, row, col, (block_r, block_c) in ((0, False, True, False, (1, 2048)), (1, False, False, True, tile),
                                                     (2, False, True, True, tile), (2, True, True, True, tile)):
    src = ASTSource(_cast_kernel, cast_sig, constexprs=dict(SCALE_BY=scale_by, PAST_AMAX=past, WITH_RECORD=past,
        WRITE_ROW=row, WRITE_COL=col,
        FP8_MAX=fp8_max, MANTISSA=mantissa, MIN_EXP=min_exp, BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_A=1024))
    n += bool(triton.compile(src, target=target, options={"num_warps": 4}).asm["cubin"])
src = ASTSource(_transpose_kernel, {"X": "*u8", "OUT": "*u8", "rows": "i32", "cols": "i32", "stride_row": "i32",
                                    "stride_out": "i32",
                                    "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"},
                constexprs=dict(BLOCK_R=CAST_TILE["BLOCK_R"], BLOCK_C=CAST_TILE["BLOCK_C"]))
n += bool(triton.compile(src, target=target, options={"num_warps": CAST_TILE["WARPS"]}).asm["cubin"])
print("compiled", n)
""")


def test_fp8_cast_kernels_compile_for_an_h100():
    # the interpreter lets through what Triton's compiler rejects (bias_activation's test says more)
    assert "compiled 7" in compiled_for_h100(_COMPILE_FOR_H100)


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", list(SCALINGS))
@FORMATS
def test_cast_equals_quantize_on_gpu(scaling, fp8):
    x = every_magnitude(torch.bfloat16, rows=8192, cols=2048, device=DEVICE)
    assert_cast_equals_quantize(x, fp8, scaling)
    assert_cast_equals_quantize(every_magnitude(torch.float32, rows=8191, cols=1375, device=DEVICE), fp8, scaling)
    # fp32 with every dim and stride divisible by 16 (a weight): a Triton specialisation of its own
    assert_cast_equals_quantize(every_magnitude(torch.float32, rows=768, cols=1024, device=DEVICE), fp8, scaling)
    assert_cast_equals_quantize(every_magnitude(torch.float32, rows=128, cols=64, device=DEVICE), fp8, scaling)
    assert_cast_equals_quantize(grid_and_ties(fp8, torch.float32).to(DEVICE), fp8, scaling)
    assert_cast_equals_quantize(grid_and_ties(fp8, torch.bfloat16).to(DEVICE), fp8, scaling)


@pytest.mark.gpu
@FORMATS
def test_a_given_amax_clamps_as_quantize_does_on_gpu(fp8):
    x = every_magnitude(torch.bfloat16, rows=4096, cols=1024, device=DEVICE)
    assert_cast_equals_quantize(x, fp8, "tensorwise", amax=x.float().abs().max() / 3)


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", list(SCALINGS))
@FORMATS
def test_nan_and_inf_come_out_as_in_quantize_on_gpu(scaling, fp8):
    x = every_magnitude(torch.bfloat16, rows=256, cols=512, device=DEVICE)
    x[3, 7], x[100, 300] = float("nan"), float("inf")
    dim, row, col = SCALINGS[scaling]
    got = cast(x, fp8, dim, row=row, col=col)
    x8, scale = quantize(x, fp8, dim)
    assert torch.equal(got.scale.isnan(), scale.isnan())
    assert torch.equal(got.scale.nan_to_num(), scale.nan_to_num())
    out = got.row if row else got.col
    assert torch.equal(out.float().isnan(), x8.float().isnan())
    assert torch.equal(out.float().nan_to_num(), x8.float().nan_to_num())


@pytest.mark.gpu
def test_column_major_copies_every_byte_on_gpu():
    x8 = torch.randint(0, 256, (11264, 2048), dtype=torch.uint8, device=DEVICE).view(E4M3)  # llama-1b's up/gate
    assert_column_major_copies_the_bytes(x8)
    assert_column_major_copies_the_bytes(x8[:1375, :1000].contiguous())


@pytest.mark.gpu
@FORMATS
def test_a_stacked_cast_equals_casting_the_stack_on_gpu(fp8):
    x = every_magnitude(torch.float32, rows=2560, cols=2048, device=DEVICE)  # llama-1b's q/k/v weights
    assert_stacked_cast_equals_casting_the_stack([x[:2048], x[2048:2304], x[2304:]], fp8)
    assert_stacked_cast_equals_casting_the_stack([x[2304:], x[:2304]], fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("pieces", [1, 3], ids=["one-weight", "stacked"])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_linears_on_the_triton_casts_give_the_reference_bits_on_gpu(recipe, pieces, monkeypatch):
    """Reference casts against the Triton casts, forward and backward (which autograd runs on its own
    thread on CUDA: the environment variable and use_backend both reach it)."""
    from tests.test_fp8_linear import operands
    x, w, dy = (t.to(DEVICE) for t in operands(m=512, k=1024, n=768))
    results = []
    for backend in ("reference", "triton"):
        monkeypatch.setenv("TPFLASH_KERNELS", backend)
        results.append(linears_on(backend, recipe, x.bfloat16(), w, dy.bfloat16(), pieces, "cuda"))
    for name, ref, got in zip(["y", "dx"] + [f"dw{i}" for i in range(pieces)], *results):
        assert torch.isfinite(ref).all(), f"{name}: the reference casts give non-finite values"
        assert torch.equal(ref, got), f"{name}: {(ref != got).sum().item()} of {ref.numel()} differ"
