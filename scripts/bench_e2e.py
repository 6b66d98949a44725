"""End-to-end GPT training throughput: tpflash vs plain PyTorch vs PyTorch-native DTensor TP, one table.

Run under torchrun (one process per GPU; tp = --tp, dp = world/tp, FSDP2 over dp when dp > 1):
    torchrun --nproc_per_node=2 scripts/bench_e2e.py --tp 2 --models gpt-1.3b,gpt-2.7b
    python scripts/bench_e2e.py --tiny          # CPU/gloo smoke test: never report its timings
Every implementation trains the same GPT-2-style model (learned positions, LayerNorm, GELU-tanh,
tied embeddings, biases) with bf16 autocast over fp32 weights and AdamW (fused on CUDA):
  tpflash[-nooverlap]   tpflash.models.GPT: SP under tp>1, Triton kernels, fused linear+CE loss,
                        collectives pipelined with the GEMMs (or TPFLASH overlap off)
  tpflash-graphs[-serial|-overlap]  the same with its blocks replayed as CUDA graphs
                        (capture_cuda_graphs): overlap as the library defaults it there (copy-engine
                        overlap where the GPUs map each other's memory), forced off, or forced on
  plain[-compile]       a GPT written the way users write it (nn.Linear, SDPA, F.cross_entropy), tp=1
  dtensor[-compile]     the plain GPT under parallelize_module (Colwise/Rowwise/SequenceParallel,
                        loss_parallel), as torchtitan does it, tp>1
Compiled variants compile each block (and, for plain, the head + loss), as torchtitan does.
Each row is appended as JSON to --results; the table printed at the end covers every row there, so a
tp=2 run after a tp=1 run shows both and the TP scaling efficiency (tokens/s/GPU at tp=N over the
same implementation at tp=1; dtensor is compared with plain). MFU uses 6N + 12*L*d*seq FLOPs/token
against --peak-tflops (989, H100/H200 dense bf16). Step times are medians of steps timed between two
syncs (an isolated step); on CUDA the note also gives the mean ms per step with the host allowed one
step ahead, as tpflash's trainer runs (a host-bound step is faster there).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tpflash  # noqa: E402
from tpflash.models import GPT, GPTConfig  # noqa: E402
from tpflash.parallel import overlap, peer_collectives, pieces_overlap  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_peers import PlainGPT, compile_blocks, dtensor_tp, shard_over_dp  # noqa: E402
from e2e_profile import profile_exposed_comm  # noqa: E402
from e2e_telemetry import GpuTelemetry  # noqa: E402

MODELS = {"gpt-1.3b": dict(d=2048, layers=24, heads=16), "gpt-2.7b": dict(d=2560, layers=32, heads=32),
          "gpt-6.7b": dict(d=4096, layers=32, heads=32), "tiny": dict(d=64, layers=2, heads=4)}
IMPLS = ("tpflash", "tpflash-nooverlap", "tpflash-graphs", "tpflash-graphs-serial", "tpflash-graphs-overlap",
         "plain", "plain-compile", "dtensor", "dtensor-compile")
OVERLAPPED = ("tpflash", "tpflash-graphs-overlap")  # collectives pipelined with the GEMMs
OVERLAP_OFF = ("tpflash-nooverlap", "tpflash-graphs-serial")  # forced off; the others: the library default
BASELINE = {"tpflash-nooverlap": "tpflash", "dtensor": "plain", "dtensor-compile": "plain-compile"}


# ---- building and timing one configuration ---------------------------------------------------------

def build(impl: str, shape: dict, args, ps, fused_loss: bool = True):
    """(model, loss_fn(idx, targets), context for forward + backward) for one implementation."""
    d, layers, heads = shape["d"], shape["layers"], shape["heads"]
    if impl.startswith("tpflash"):
        cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=layers, n_head=heads, n_embd=d,
                        sequence_parallel=ps.tp_size > 1, fused_loss=fused_loss)
        model = GPT(cfg, process_group=ps.tp_group, device=ps.device)
        if ps.dp_size > 1:  # FSDP2 over dp, composed with tp (bf16 params, fp32 reduction on CUDA)
            tpflash.parallel.apply_fsdp(model, ps)
        on = True if impl in OVERLAPPED else False if impl in OVERLAP_OFF else None
        if impl.startswith("tpflash-graphs"):  # the replays pipeline (or not) as the capture did
            with _overlap_setting(on), torch.autocast(ps.device.type, dtype=torch.bfloat16,
                                                          enabled=args.dtype == "bf16"):
                model.capture_cuda_graphs(args.batch, args.seq)
        return model, lambda idx, tgt: _with_overlap(on, model, idx, tgt), contextlib.nullcontext
    with torch.device(ps.device):
        model = PlainGPT(d, layers, heads, args.vocab, args.seq)
    if impl.startswith("dtensor"):
        model = dtensor_tp(model, ps.tp_mesh)
    if ps.dp_size > 1:
        shard_over_dp(model, ps)
    if impl.endswith("compile"):
        compile_blocks(model)
        if impl.startswith("plain"):
            model.head_loss = torch.compile(model.head_loss)
    return model, model, model.step_context


def _overlap_setting(on: Optional[bool]):
    return contextlib.nullcontext() if on is None else overlap.overlap_comm(on)


def _with_overlap(on: Optional[bool], model, idx, targets):
    with _overlap_setting(on):
        return model(idx, targets)


def make_optimizer(model: nn.Module, device: torch.device, fused: bool = True):
    """AdamW, fused on CUDA (foreach when `fused` is False), the default on CPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    if device.type != "cuda":
        return torch.optim.AdamW(params, lr=1e-4)
    return torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if fused else {"foreach": True}))


def time_steps(loss_fn, step_context, opt, args, ps):
    """Median seconds per optimizer step after warm-up, and the first timed step's loss."""
    gen = torch.Generator().manual_seed(1234 + ps.dp_rank)  # same batch on all tp ranks of a dp rank
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(ps.device)
    inputs, targets = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    amp = (torch.autocast(ps.device.type, dtype=torch.bfloat16) if args.dtype == "bf16"
           else contextlib.nullcontext())
    def one_step():
        with step_context():
            with amp:
                loss = loss_fn(inputs, targets)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    times, host, losses = [], [], []
    for _ in range(args.warmup):
        one_step()
    # the clock and power over the timed steps: a GPU at its power cap runs its GEMMs slower (e2e_telemetry)
    telemetry = GpuTelemetry(ps.device.index if ps.device.type == "cuda" else -1)
    with telemetry if ps.device.type == "cuda" and not args.no_telemetry else contextlib.nullcontext():
        for _ in range(args.steps):
            _sync(ps.device)
            t0 = time.perf_counter()
            loss = one_step()
            t_host = time.perf_counter()  # the host has issued the whole step (no sync on the way)
            _sync(ps.device)
            times.append(time.perf_counter() - t0)
            host.append(t_host - t0)
            losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    # host_ms close to step_ms: the step is bound by Python/launch overhead (or syncs), not by the GPU
    extra = {"host_ms": 1e3 * statistics.median(host), **telemetry.summary()}
    if ps.device.type == "cuda":
        ahead = GpuTelemetry(ps.device.index)
        with ahead if not args.no_telemetry else contextlib.nullcontext():
            extra["ahead_ms"] = 1e3 * one_step_ahead_s(one_step, args.steps, ps.device)
        extra.update({f"ahead_{key}": value for key, value in ahead.summary().items()})
    if args.profile and ps.device.type == "cuda":  # after timing: the profiler's overhead stays out of it
        try:
            extra.update(profile_exposed_comm(one_step, trace=_trace_path(args, ps), top=args.profile_top,
                                              ops=args.profile_ops))
        except Exception as exc:  # a profiler problem must not lose the timed row
            extra["note"] = f"profile failed: {_describe(exc)[:60]}"
    if args.cprofile:
        python_profile(one_step, ps, args.cprofile)
    return statistics.median(times), losses[0], extra


def one_step_ahead_s(one_step, steps: int, device) -> float:
    """Mean seconds per step over `steps` steps where the host may issue a step while the GPU still runs
    the one before (it waits only for the step before that), as tpflash's trainer runs them: a
    host-bound eager forward then overlaps the previous step's backward and optimizer. The synced
    step time above is what one isolated step costs."""
    _sync(device)
    t0, previous = time.perf_counter(), None
    for _ in range(steps):
        one_step()
        done = torch.cuda.Event()
        done.record()
        if previous is not None:
            previous.synchronize()
        previous = done
    _sync(device)
    return (time.perf_counter() - t0) / steps


def _trace_path(args, ps) -> str:
    if not args.trace_dir:
        return ""
    os.makedirs(args.trace_dir, exist_ok=True)
    return os.path.join(args.trace_dir, f"trace_tp{ps.tp_size}_rank{ps.rank}.json")


def python_profile(run_step, ps, top: int) -> None:
    """One step under cProfile (every rank runs the step; rank 0 prints), synchronised at the end so
    that host time spent waiting on the device shows up where it happens."""
    import cProfile
    import pstats
    prof = cProfile.Profile() if ps.rank == 0 else None
    _sync(ps.device)
    if prof is not None:
        prof.enable()
    run_step()
    _sync(ps.device)
    if prof is not None:
        prof.disable()
        for key in ("tottime", "cumulative"):
            print(f"[cprofile] one step, by {key}:", flush=True)
            pstats.Stats(prof).sort_stats(key).print_stats(top)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_config(model_name: str, impl: str, args, ps) -> dict:
    shape = MODELS[model_name]
    row = dict(model=model_name, impl=impl, tp=ps.tp_size, dp=ps.dp_size, device=_device_name(ps.device))
    model = opt = None
    try:
        measured = None
        try:
            measured = _measure(impl, shape, args, ps, fallback=False)
        except Exception as exc:  # one retry, said in the row: tpflash's unfused loss / foreach AdamW
            what = "fused loss" if impl.startswith("tpflash") else "fused AdamW"
            row["note"] = f"{what} failed ({_describe(exc)[:60]}); retried without"
        if measured is None:  # retried outside the except block, so the failed attempt's memory is free
            _cleanup(ps)
            measured = _measure(impl, shape, args, ps, fallback=True)
        model, opt, step_s, loss, extra = measured
        if "note" in extra:
            row["note"] = "; ".join(filter(None, [row.get("note"), extra.pop("note")]))
        row.update(extra)
        tok_gpu = args.batch * args.seq / ps.tp_size / step_s
        if impl in OVERLAPPED and ps.tp_size > 1:  # which overlap ran (TPFLASH_OVERLAP_BACKEND / _PIECES)
            backend = overlap.overlap_backend()
            how = (f"overlap {backend}" if backend != "pieces"
                   else f"overlap k={pieces_overlap.num_pieces(args.seq // ps.tp_size)}")
            if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"):
                how += f", CUDA_DEVICE_MAX_CONNECTIONS={os.environ['CUDA_DEVICE_MAX_CONNECTIONS']}"
            row["note"] = "; ".join(filter(None, [row.get("note"), how]))
        if impl.startswith("tpflash") and ps.tp_size > 1 and peer_collectives.comm_backend() != "nccl":
            row["note"] = "; ".join(filter(None, [row.get("note"), f"comm {peer_collectives.comm_backend()}"]))
        row.update(step_ms=1e3 * step_s, tok_s_gpu=tok_gpu, loss=loss,
                   mfu=tok_gpu * flops_per_token(shape, args) / (args.peak_tflops * 1e12),
                   peak_gib=_peak_gib(ps.device))
    except Exception as exc:  # one failing configuration must not kill the table
        row["error"] = _describe(exc)
    finally:
        del model, opt
        _cleanup(ps)
    return row


def _measure(impl, shape, args, ps, fallback: bool):
    """Build, warm up and time one configuration; `fallback`: tpflash without its fused loss, the
    others with foreach instead of fused AdamW."""
    torch.manual_seed(0)
    if ps.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ps.device)
    tpflash_impl = impl.startswith("tpflash")
    model, loss_fn, step_context = build(impl, shape, args, ps, fused_loss=not (fallback and tpflash_impl))
    opt = make_optimizer(model, ps.device, fused=not (fallback and not tpflash_impl))
    step_s, loss, extra = time_steps(loss_fn, step_context, opt, args, ps)
    return model, opt, step_s, loss, extra


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:120] if text else ''}"


def _cleanup(ps) -> None:
    gc.collect()
    torch._dynamo.reset()
    if ps.device.type == "cuda":
        torch.cuda.empty_cache()


def flops_per_token(shape: dict, args) -> float:
    """6 * matmul parameters (blocks + output head) + 12 * L * d * seq for attention (PaLM)."""
    d, layers = shape["d"], shape["layers"]
    return 6.0 * (12 * layers * d * d + args.vocab * d) + 12.0 * layers * d * args.seq


def _peak_gib(device) -> float:
    if device.type != "cuda":
        return float("nan")
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2 ** 30], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def collectives_alone(model_name: str, args, ps) -> dict:
    """Time the SP all-gather and reduce-scatter of one [seq/tp, batch, d] bf16 activation with nothing
    else running: the communication a step would expose if none of it were overlapped (per layer, 4 of
    each: forward gather+scatter for attention and MLP, and their duals in backward)."""
    shape = MODELS[model_name]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    x = torch.randn(args.seq // ps.tp_size, args.batch, shape["d"], device=ps.device, dtype=dtype)
    ag_ms = _median_ms(lambda: tpflash.parallel.comm.all_gather(x, 0, ps.tp_group), ps)
    full = torch.randn(args.seq, args.batch, shape["d"], device=ps.device, dtype=dtype)
    rs_ms = _median_ms(lambda: tpflash.parallel.comm.reduce_scatter(full, 0, ps.tp_group), ps)
    per_step = 4 * shape["layers"] * (ag_ms + rs_ms) + ag_ms + rs_ms  # + the head's gather
    gemm, plain, piped = _row_layer_ms(shape, args, ps, dtype)
    return dict(model=model_name, impl="collectives-alone", tp=ps.tp_size, dp=ps.dp_size,
                device=_device_name(ps.device), step_ms=per_step,
                note=f"all-gather {ag_ms:.3f} ms, reduce-scatter {rs_ms:.3f} ms per activation; "
                     f"step_ms = {4 * shape['layers'] + 1} x (both), nothing overlapped. MLP down-proj "
                     f"fwd+bwd: GEMMs alone {gemm:.3f} ms, + reduce-scatter {plain:.3f}, pipelined {piped:.3f}")


def _row_layer_ms(shape, args, ps, dtype):
    """fwd+bwd of the MLP's row-parallel GEMM [s, b, 4d/tp] x [d, 4d/tp]: without collectives, with
    reduce-scatter / all-gather after it (overlap off), and pipelined (tpflash.parallel.overlap)."""
    d, tp, group = shape["d"], ps.tp_size, ps.tp_group
    h = torch.randn(args.seq, args.batch, 4 * d // tp, device=ps.device, dtype=dtype, requires_grad=True)
    w = torch.randn(d, 4 * d // tp, device=ps.device, dtype=dtype, requires_grad=True)
    g_full = torch.randn(args.seq, args.batch, d, device=ps.device, dtype=dtype)
    g_local = g_full[: args.seq // tp]
    comm = tpflash.parallel.comm
    gemm = _median_ms(lambda: F.linear(h, w).backward(g_full), ps)
    plain = _median_ms(lambda: comm.reduce_scatter_along_seq(F.linear(h, w), group).backward(g_local), ps)
    piped = _median_ms(lambda: overlap.linear_reduce_scatter(h, w, group).backward(g_local), ps)
    return gemm, plain, piped


def _median_ms(fn, ps, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        _sync(ps.device)
        t0 = time.perf_counter()
        fn()
        _sync(ps.device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


# ---- the table -------------------------------------------------------------------------------------

def table(rows: list) -> str:
    """Markdown table of every row, with TP scaling efficiency against the tp=1 row of the baseline impl."""
    tp1 = {(r["model"], r["impl"]): r["tok_s_gpu"] for r in rows if r["tp"] == 1 and "tok_s_gpu" in r}
    order = {name: i for i, name in enumerate(IMPLS + ("collectives-alone",))}
    rows = sorted(rows, key=lambda r: (r["model"], r["tp"], order.get(r["impl"], 99)))
    lines = ["| model | impl | tp x dp | tokens/s/GPU | MFU | step ms | peak GiB | TP eff. | note |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            cells = ["", "", "", "", "", "error: " + r["error"]]
        elif "tok_s_gpu" not in r:
            cells = ["", "", f"{r['step_ms']:.1f}", "", "", r.get("note", "")]
        else:
            base = tp1.get((r["model"], BASELINE.get(r["impl"], r["impl"]) if r["tp"] > 1 else r["impl"]))
            eff = f"{r['tok_s_gpu'] / base:.2f}" if base else ""
            notes = [f"loss {r['loss']:.3f}", r.get("note")]
            if "host_ms" in r:
                notes.append(f"host {r['host_ms']:.0f} ms")
            if "ahead_ms" in r:
                clock = f" at {r['ahead_sm_mhz']:.0f} MHz" if "ahead_sm_mhz" in r else ""
                notes.append(f"{r['ahead_ms']:.1f} ms/step one step ahead{clock}")
            if "sm_mhz" in r:
                notes.append(f"SM {r['sm_mhz']:.0f} MHz, {r['power_w']:.0f} W")
            if "exposed_comm_ms" in r:
                notes.append(f"comm {r['comm_ms']:.1f} ms/step, exposed {r['exposed_comm_ms']:.1f}")
            cells = [f"{r['tok_s_gpu']:,.0f}", f"{r['mfu']:.3f}", f"{r['step_ms']:.1f}",
                     f"{r['peak_gib']:.1f}", eff, "; ".join(filter(None, notes))]
        lines.append("| " + " | ".join([r["model"], r["impl"], f"{r['tp']}x{r['dp']}"] + cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: world size)")
    p.add_argument("--models", default="gpt-1.3b,gpt-2.7b", help=f"comma list of {sorted(MODELS)}")
    p.add_argument("--impls", default=None, help=f"comma list of {IMPLS} (default: tp=1: tpflash, plain, "
                                                 "plain-compile; tp>1: tpflash, tpflash-nooverlap, dtensor*)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="sequences per step per dp rank")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--no-comm-probe", action="store_true", help="skip timing the collectives alone")
    p.add_argument("--no-telemetry", action="store_true", help="do not sample the SM clock and power (nvidia-smi)")
    p.add_argument("--results", default="bench_e2e.jsonl", help="JSON lines, appended; the table covers all")
    p.add_argument("--table", default=None, help="also write the markdown table here")
    p.add_argument("--tiny", action="store_true", help="tiny model, a few steps: a CPU/gloo smoke test")
    p.add_argument("--profile", action="store_true", help="after timing, profile 2 steps (CUDA) and report the "
                                                          "communication time and the part no kernel hides")
    p.add_argument("--profile-top", type=int, default=12, metavar="N", help="with --profile: list the N kernels "
                   "that take the most GPU time")
    p.add_argument("--profile-ops", type=int, default=0, metavar="N", help="with --profile: list the N ops whose "
                   "kernels take the most GPU time, with their input shapes (eager impls)")
    p.add_argument("--trace-dir", default="", help="with --profile: write each rank's chrome trace here")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="after timing, run one step under cProfile on rank 0 and print its N costliest "
                        "Python functions (host time: where a host-bound step goes)")
    p.add_argument("--table-only", action="store_true", help="print the table of --results and exit (no run)")
    args = p.parse_args(argv)
    if args.tiny:
        args.models, args.vocab, args.seq, args.batch = "tiny", 512, 64, 2
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    return args


def print_table(args) -> None:
    with open(args.results) as f:
        text = table([json.loads(line) for line in f if line.strip()])
    print(text, flush=True)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.table_only:
        return print_table(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ps = tpflash.parallel.init(tp=args.tp or world)
    args.dtype = args.dtype or ("bf16" if ps.device.type == "cuda" else "fp32")
    default = "tpflash,plain,plain-compile" if ps.tp_size == 1 else "tpflash,tpflash-nooverlap,dtensor,dtensor-compile"
    impls = (args.impls or default).split(",")
    for name in impls + args.models.split(","):
        if name not in IMPLS and name not in MODELS:
            raise ValueError(f"{name!r} is neither an implementation {IMPLS} nor a model {sorted(MODELS)}")
    rows = []
    for model_name in args.models.split(","):
        todo = [None] if ps.tp_size > 1 and not args.no_comm_probe else []
        for impl in todo + impls:
            if ps.rank == 0:
                print(f"[bench_e2e] {model_name} {impl or 'collectives-alone'} tp={ps.tp_size}", flush=True)
            rows.append(run_config(model_name, impl, args, ps) if impl else collectives_alone(model_name, args, ps))
            if ps.rank == 0:
                print(f"[bench_e2e]   {json.dumps(rows[-1])}", flush=True)
                with open(args.results, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    if ps.rank == 0:
        print_table(args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
