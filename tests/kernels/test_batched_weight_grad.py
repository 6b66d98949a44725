"""tpflash.kernels.batched_weight_grad: same-shape weight gradients in fp32, as one cuBLAS batched GEMM on the
GPU (operands in separate buffers, in any address order, under graph capture), each on its own elsewhere."""
import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_rel
from tpflash.kernels.batched_weight_grad import batched, weight_grads_fp32
from tpflash.kernels.batched_weight_grad_kernel import write_pointers
from tpflash.kernels.weight_grad import weight_grad_fp32

ROWS, OUT, IN = 96, 40, 24


def _operands(device, n=2, seed=0):
    torch.manual_seed(seed)
    grads = [torch.randn(ROWS, OUT, device=device).to(torch.bfloat16) for _ in range(n)]
    xs = [torch.randn(ROWS, IN, device=device).to(torch.bfloat16) for _ in range(n)]
    return grads, xs


def _each_equals_its_own_weight_grad(device):
    """Added into `into` and written into `out`, each result is that gradient's weight_grad_fp32."""
    grads, xs = _operands(device)
    start = [torch.randn(OUT, IN, device=device) for _ in grads]
    into = [s.clone() for s in start]
    weight_grads_fp32(grads, xs, into=into)
    out = [torch.full((OUT, IN), float("nan"), device=device) for _ in grads]
    weight_grads_fp32(grads, xs, out=out)
    for i, (g, x) in enumerate(zip(grads, xs)):
        assert_rel(into[i], weight_grad_fp32(g, x, into=start[i].clone()), torch.float32, f"added, gradient {i}")
        assert_rel(out[i], weight_grad_fp32(g, x), torch.float32, f"written, gradient {i}")


def test_each_gradient_equals_its_own_weight_grad():
    _each_equals_its_own_weight_grad("cpu")
    assert not batched(*_operands("cpu")), "no batched GEMM on CPU"


@pytest.mark.gpu
def test_each_gradient_equals_its_own_weight_grad_through_the_batched_gemm_on_gpu():
    assert batched(*_operands(DEVICE)), "cublasGemmBatchedEx was not found or not chosen"
    _each_equals_its_own_weight_grad(DEVICE)


@pytest.mark.gpu
def test_the_batched_gemm_takes_operands_in_any_address_order_and_strided_rows():
    torch.manual_seed(1)
    later = torch.randn(ROWS, OUT + 8, device=DEVICE).to(torch.bfloat16)
    earlier_xs = [torch.randn(ROWS, IN, device=DEVICE).to(torch.bfloat16) for _ in range(2)]
    wide = torch.randn(ROWS, OUT + 8, device=DEVICE).to(torch.bfloat16)
    grads = [wide[:, 8:8 + OUT], later[:, :OUT]]  # rows OUT + 8 apart; the grads' addresses descend, the xs' ascend
    assert batched(grads, earlier_xs)
    assert not batched([wide[:, 4:4 + OUT], later[:, :OUT]], earlier_xs), "a pointer off a 16-byte boundary"
    assert not batched([wide[:, :OUT], grads[1].contiguous()], earlier_xs), "operands of different row strides"
    for pair in (grads, [wide[:, 4:4 + OUT], later[:, :OUT]]):  # batched, and each on its own
        out = [torch.empty(OUT, IN, device=DEVICE) for _ in pair]
        weight_grads_fp32(pair, earlier_xs, out=out)
        for i in range(2):
            assert_rel(out[i], pair[i].float().t() @ earlier_xs[i].float(), torch.float32, f"gradient {i}")


@pytest.mark.gpu
def test_the_batched_gemm_replays_in_a_cuda_graph():
    grads, xs = _operands(DEVICE)
    into = [torch.zeros(OUT, IN, device=DEVICE) for _ in grads]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the Triton kernel compiled, cuBLAS loaded
        weight_grads_fp32(grads, xs, into=into)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weight_grads_fp32(grads, xs, into=into)
    for t in into:
        t.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    for i in range(2):
        assert_rel(into[i], 2 * (grads[i].float().t() @ xs[i].float()), torch.float32, f"gradient {i}, two replays")


def test_the_pointer_kernel_writes_each_rows_addresses():
    tensors = [[torch.empty(4) for _ in range(3)] for _ in range(3)]
    pointers = write_pointers(tensors, torch.device("cpu"))
    assert pointers.tolist() == [[t.data_ptr() for t in row] for row in tensors]


def test_bad_arguments_are_refused_in_one_line():
    grads, xs = _operands("cpu")
    results = [torch.zeros(OUT, IN) for _ in grads]
    with pytest.raises(ValueError, match="not both or neither"):
        weight_grads_fp32(grads, xs, into=results, out=results)
    with pytest.raises(ValueError, match="2 grad_ys, 1 xs"):
        weight_grads_fp32(grads, xs[:1], into=results)
    with pytest.raises(ValueError, match="three rows of 2 to 4"):
        write_pointers([grads[:1], xs[:1], results[:1]], torch.device("cpu"))
