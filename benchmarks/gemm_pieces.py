"""What a GEMM per rank's rows costs against one GEMM over all of them (one GPU).

The overlapped sequence-parallel layers (tpflash.parallel.overlap_gemms) multiply each rank's rows
in a GEMM of its own, so that the transfers of the others travel beside it. Where other work can
cover those transfers, one GEMM over every row is the faster choice; this measures by how much, for
the input-gradient GEMMs of the blocks of gpt-2.7b and llama-1b at tp=2 and tp=4 (8,192 tokens):

  column layer (q/k/v, up)   grad_x = grad_y [tokens, out/tp] @ W [out/tp, hidden]
  row layer (output, down)   grad_h = grad_y [tokens, hidden] @ W [hidden, in/tp]

Each form is captured in a CUDA graph of 20 calls; the two graphs are replayed alternately 7 times
and the medians printed, us per call. A second table times the weight-gradient GEMMs, which stay one
GEMM over every row but narrow with tp (grad_y^T x written in fp32, as tpflash.kernels.weight_grad
runs them), at tp = 1, 2 and 4, against 1/tp of tp=1's. A third times the fused loss's logits GEMM,
hidden [tokens, hidden] @ W^T [hidden, V/tp], as one GEMM and per rank's rows (which its input's
all-gather travels beside). Run it as the layers run at tp > 1, without a cuBLAS workspace:

    CUBLAS_WORKSPACE_CONFIG=:0:0 python benchmarks/gemm_pieces.py
"""
from __future__ import annotations

import statistics

import torch

TOKENS = 8192
HIDDEN = {"gpt-2.7b": 2560, "llama-1b": 2048}
WIDTHS = {"gpt-2.7b": {"qkv": 7680, "up": 10240, "output": 2560, "down": 10240},  # full out (column) / in (row)
          "llama-1b": {"qkv": 2560, "up": 11264, "output": 2048, "down": 5632}}  # bench_e2e.py's shapes
CALLS, ROUNDS = 20, 7


def graphed(fn) -> torch.cuda.CUDAGraph:
    """fn captured CALLS times in one CUDA graph, after a warm-up on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    return graph


def us_per_call(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / CALLS


def compare(k: int, n: int, tp: int) -> tuple:
    """(one GEMM, a GEMM per rank's rows) in us for [TOKENS, k] @ [k, n], bf16."""
    a = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(TOKENS, n, device="cuda", dtype=torch.bfloat16)
    rows = TOKENS // tp
    whole = graphed(lambda: torch.mm(a, w, out=out))
    pieces = graphed(lambda: [torch.mm(a[r * rows:(r + 1) * rows], w, out=out[r * rows:(r + 1) * rows])
                              for r in range(tp)])
    times = [(us_per_call(whole), us_per_call(pieces)) for _ in range(ROUNDS)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def weight_grad_graphs(widths: dict) -> dict:
    """tp -> (a graph of CALLS weight-gradient GEMMs grad_y^T x in fp32, its operands): grad_y [TOKENS,
    rows_out], x [TOKENS, cols_in], bf16, for widths: tp -> (rows_out, cols_in)."""
    graphs = {}
    for tp, (rows_out, cols_in) in widths.items():
        grad_y = torch.randn(TOKENS, rows_out, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(TOKENS, cols_in, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(rows_out, cols_in, device="cuda", dtype=torch.float32)
        graph = graphed(lambda g=grad_y, x=x, o=out: torch.mm(g.t(), x, out_dtype=torch.float32, out=o))
        graphs[tp] = (graph, (grad_y, x, out))  # the operands alive as long as the graph that uses them
    return graphs


def weight_grads() -> None:
    """The weight-gradient GEMMs at tp = 1, 2, 4, their graphs replayed in turn (a GPU at its power cap
    slows down under a long run of GEMMs: timing one width after another would favour the first)."""
    print("\n| model | layer | tp=1, us | tp=2, us (over 1/2 of tp=1) | tp=4, us (over 1/4 of tp=1) |")
    print("|---|---|---:|---:|---:|")
    for model, widths in WIDTHS.items():
        hidden = HIDDEN[model]
        for layer, width in widths.items():
            graphs = weight_grad_graphs({tp: (width // tp, hidden) if layer in ("qkv", "up") else (hidden, width // tp)
                                         for tp in (1, 2, 4)})
            rounds = [{tp: us_per_call(graph) for tp, (graph, _) in graphs.items()} for _ in range(ROUNDS)]
            times = {tp: statistics.median(r[tp] for r in rounds) for tp in graphs}
            cells = [f"{times[tp]:.1f} ({times[tp] * tp / times[1] - 1:+.0%})" for tp in (2, 4)]
            print(f"| {model} | {layer} | {times[1]:.1f} | {cells[0]} | {cells[1]} |", flush=True)


VOCAB = {"gpt-2.7b": 50304, "llama-1b": 32000}


def loss_logits() -> None:
    """The fused loss's logits GEMM, hidden [TOKENS, H] @ W^T [H, V/tp] (tpflash.losses.fused_linear_cross_entropy):
    one GEMM against a GEMM per rank's rows, as it runs under sequence parallelism."""
    print("\n| model | tp | logits GEMM | one GEMM, us | a GEMM per rank, us | difference |")
    print("|---|---:|---|---:|---:|---:|")
    for model, hidden in HIDDEN.items():
        for tp in (2, 4):
            local = -(-VOCAB[model] // tp)  # this rank's rows of the padded vocabulary (VocabParallelEmbedding's)
            one, per_rank = compare(hidden, local, tp)
            print(f"| {model} | {tp} | [{TOKENS} x {hidden}] @ [{hidden} x {local}] | {one:.1f} | {per_rank:.1f} | "
                  f"{per_rank - one:+.1f} |", flush=True)


def main() -> None:
    print("| model | layer | tp | GEMM | one GEMM, us | a GEMM per rank, us | difference |")
    print("|---|---|---:|---|---:|---:|---:|")
    for model, widths in WIDTHS.items():
        hidden = HIDDEN[model]
        for layer, width in widths.items():
            for tp in (2, 4):
                k, n = (width // tp, hidden) if layer in ("qkv", "up") else (hidden, width // tp)
                one, per_rank = compare(k, n, tp)
                print(f"| {model} | {layer} | {tp} | [{TOKENS} x {k}] @ [{k} x {n}] | {one:.1f} | {per_rank:.1f} | "
                      f"{per_rank - one:+.1f} |", flush=True)
    weight_grads()
    loss_logits()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("gemm_pieces.py times CUDA GEMMs: it needs a GPU")
    main()
