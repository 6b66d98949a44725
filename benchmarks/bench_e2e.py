"""End-to-end GPT training throughput: tpflash vs plain PyTorch, DTensor TP and torchtitan/torchao/Liger, one table.

Run under torchrun (one process per GPU; tp = --tp, dp = world/tp; at dp > 1 --dp-mode replicate, the
default, wraps tpflash and plain in DDP (the trainer's fsdp=off), fsdp shards them with FSDP2, zero1
shards tpflash's AdamW state over dp (the trainer's fsdp=zero1, what fsdp=auto picks where it fits),
zero3 its blocks' weights too, gathered into static slots inside the graphs (the trainer's fsdp=zero3);
dtensor always uses FSDP2 over dp, as torchtitan composes it with TP; "impl@mode" gives one row its own):
    torchrun --nproc_per_node=2 benchmarks/bench_e2e.py --tp 2 --models gpt-1.3b,gpt-2.7b
    torchrun --nproc_per_node=4 benchmarks/bench_e2e.py --tp 1 --models llama-1b \
        --impls tpflash-graphs@zero1,tpflash@replicate,tpflash@fsdp,torchtitan
    python benchmarks/bench_e2e.py --tiny          # CPU/gloo smoke test: never report its timings
Every implementation trains the same model, GPT-2 style (learned positions, LayerNorm, GELU-tanh, tied
embeddings, biases) or with --models llama-1b Llama style (RoPE, RMSNorm, SwiGLU, GQA, untied head, no
biases), with bf16 autocast over fp32 weights and AdamW (fused on CUDA):
  tpflash[-nooverlap]   tpflash.models.GPT: SP under tp>1, Triton kernels, fused linear+CE loss,
                        collectives overlapped with the GEMMs through the copy engines, eagerly
                        (tpflash.parallel.overlap; over the group's collectives where the GPUs cannot
                        map each other's memory), or not
  tpflash-graphs[-serial|-overlap]  the same with its blocks replayed as CUDA graphs
                        (capture_cuda_graphs): overlap as the library defaults it there (copy-engine
                        overlap where the GPUs map each other's memory), forced off, or forced on
  tpflash-fp8-rowwise|-tensorwise|-delayed  tpflash-graphs with GPTConfig(fp8=...): fp8 projection GEMMs
  plain[-compile]       the model written the way users write it (nn.Linear, nn.LayerNorm/RMSNorm, SDPA
                        with enable_gqa, F.cross_entropy), tp=1
  dtensor[-compile]     the plain model under parallelize_module (Colwise/Rowwise/SequenceParallel,
                        loss_parallel), as torchtitan does it, tp>1
  torchtitan[-fp8], torchao-fp8[-tensorwise]-compile, liger[-compile]  the projects a user would pick
                        instead (benchmarks/e2e_external.py), Llama models: torchtitan as its trainer
                        lays it out at any tp x dp (its TP plan, FSDP2 over dp, whatever --dp-mode
                        says), the others on one GPU; a row whose package is missing
                        (scripts/gpu_wheels.sh), or that has no such model or layout, is a note
Compiled variants compile each block (and, for plain, the head + loss), as torchtitan does.
Each row is appended as JSON to --results; the table printed at the end covers every row there, so a
tp=2 run after a tp=1 run shows both and the TP scaling efficiency (tokens/s/GPU at tp=N over the
same implementation at tp=1; dtensor is compared with plain). MFU uses 6N + 12*L*d*seq FLOPs/token
against --peak-tflops (989, H100/H200 dense bf16). A row whose loss is not finite at any step is
an error row, never a speed; every row's note gives its loss at the first step (before any update:
equal for rows that start from the same weights) and after the timed steps, and fp8 rows the bf16
row's beside it. Step times are medians of steps timed between two
syncs (an isolated step); on CUDA the note also gives the mean ms per step with the host allowed one
step ahead, as tpflash's trainer runs (a host-bound step is faster there).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tpflash  # noqa: E402
from tpflash.kernels import gemm_workspace  # noqa: E402
from tpflash.models import GPT, GPTConfig  # noqa: E402
from tpflash.parallel import overlap, peer_collectives, peer_workspace  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_external import EXTERNAL, build as build_external, layout_note, skip_reason  # noqa: E402
from e2e_peers import PlainGPT, PlainLlama, compile_blocks, dtensor_tp, shard_over_dp  # noqa: E402
from e2e_table import table  # noqa: E402
from e2e_timing import describe, device_name, time_steps  # noqa: E402

# GPT-2 style unless family="llama" (RMSNorm, RoPE, SwiGLU of width ffn, kv_heads for GQA, untied head,
# no biases); vocab: the model's own unless --vocab is given
MODELS = {"gpt-1.3b": dict(d=2048, layers=24, heads=16), "gpt-2.7b": dict(d=2560, layers=32, heads=32),
          "gpt-6.7b": dict(d=4096, layers=32, heads=32), "tiny": dict(d=64, layers=2, heads=4),
          "llama-1b": dict(d=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000, family="llama"),
          "llama-3-8b": dict(d=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, family="llama"),
          "tiny-llama": dict(d=64, layers=2, heads=4, kv_heads=2, ffn=192, family="llama")}
FP8 = {"tpflash-fp8-rowwise": "rowwise", "tpflash-fp8-tensorwise": "tensorwise",
       "tpflash-fp8-delayed": "delayed"}  # graphed, like tpflash-graphs
IMPLS = ("tpflash", "tpflash-nooverlap", "tpflash-graphs", "tpflash-graphs-serial", "tpflash-graphs-overlap",
         *FP8, "plain", "plain-compile", "dtensor", "dtensor-compile", *EXTERNAL)
OVERLAPPED = ("tpflash", "tpflash-graphs-overlap")  # collectives overlapped with the GEMMs
OVERLAP_OFF = ("tpflash-nooverlap", "tpflash-graphs-serial")  # forced off; the others: the library default
DP_MODES = ("replicate", "fsdp", "zero1", "zero3")
# whose loss after the timed steps each row's note shows beside its own: fp8 against bf16
LOSS_REFERENCE = {**{impl: "tpflash-graphs" for impl in FP8}, "torchtitan-fp8": "torchtitan",
                  "torchao-fp8-compile": "plain-compile", "torchao-fp8-tensorwise-compile": "plain-compile"}
BASELINE = {"tpflash-nooverlap": "tpflash", "dtensor": "plain", "dtensor-compile": "plain-compile"}
SHUTDOWN_WAIT_S = 30.0  # after the table: how long destroying the process groups may take before the process exits anyway


# ---- building and measuring one configuration (the timing itself: e2e_timing.py) ----------------

def _prime_fp8_scaling(model, args, ps) -> None:
    """fp8 delayed scaling: the amax histories recorded over a batch before the capture (GPT.prime_fp8_scaling),
    as the trainer does, so that every step replays the graphs."""
    gen = torch.Generator().manual_seed(4321 + ps.dp_rank)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(ps.device)
    model.prime_fp8_scaling(idx[:, :-1], idx[:, 1:])


def build(impl: str, shape: dict, args, ps, fused_loss: bool = True):
    """(model, loss_fn(idx, targets), context for forward + backward) for one implementation."""
    d, layers, heads = shape["d"], shape["layers"], shape["heads"]
    llama = shape.get("family") == "llama"
    if impl in EXTERNAL:
        return build_external(impl, shape, args, ps)
    if impl.startswith("tpflash"):
        family = (dict(n_kv_head=shape["kv_heads"], ffn_hidden=shape["ffn"], mlp="swiglu", norm="rmsnorm",
                       position="rotary", tie_embeddings=False, bias=False) if llama else {})
        cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=layers, n_head=heads, n_embd=d,
                        sequence_parallel=ps.tp_size > 1, fused_loss=fused_loss, fp8=FP8.get(impl, "off"),
                        activation_checkpointing=_checkpointing(args), **family)
        # built on the meta device, laid out over dp, then given storage and the seed's values module by module,
        # as the trainer does: no GPU holds the whole model (GPT.init_on_device)
        model = GPT(cfg, process_group=ps.tp_group, device=torch.device("meta"))
        on = True if impl in OVERLAPPED else False if impl in OVERLAP_OFF else None
        overlap.set_overlap(model, on)  # None: the library's default (eager serial; a capture decides)
        if ps.dp_size > 1 and args.dp_mode == "fsdp":  # FSDP2 over dp, composed with tp (bf16 params, fp32 reduction)
            tpflash.parallel.apply_fsdp(model, ps)
        if ps.dp_size > 1 and args.dp_mode == "zero3":  # blocks sharded into static slots, the rest FSDP2 (bf16 gathers)
            model.zero3 = tpflash.parallel.shard_blocks(model, ps, compute_dtype=torch.bfloat16 if args.dtype == "bf16"
                                                        else None)
            tpflash.parallel.materialize_outside_blocks(model, ps.device)
        else:
            model.to_empty(device=ps.device)
        model.init_on_device(ps.device, seed=0)  # the values of GPT(cfg, device=...) after torch.manual_seed(0)
        if ps.dp_size > 1 and args.dp_mode == "zero1":  # AdamW state sharded over dp; before the capture, as the trainer
            model.zero1 = tpflash.parallel.ShardedOptimizerState(model, ps)
        if impl.startswith("tpflash-graphs") or impl in FP8:  # the replays overlap (or not) as captured
            # zero1: the graphs also carry the blocks' dp reduce-scatters and all-gathers, as the trainer's with
            # one micro-batch per step (--zero1-in-graphs off: reduced and gathered after them)
            sync = getattr(model, "zero1", None)
            sync = sync.sync_in_graphs(model.blocks) if sync is not None and args.zero1_in_graphs == "on" else None
            zero3 = getattr(model, "zero3", None)
            with torch.autocast(ps.device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                if impl == "tpflash-fp8-delayed" and zero3 is None and getattr(model, "zero1", None) is None:
                    _prime_fp8_scaling(model, args, ps)  # else the first warm-up step records them, eagerly
                if zero3 is not None:  # its gathers and reductions are captured too
                    zero3.capture_cuda_graphs(model, args.batch, args.seq)
                else:
                    model.capture_cuda_graphs(args.batch, args.seq, dp_sync=sync)
            if sync is not None:
                model.zero1.use_graph_sync(sync)
        forward = model
        if ps.dp_size > 1 and args.dp_mode == "replicate":  # after the capture, as the trainer does
            forward = tpflash.parallel.replicate_over_dp(model, ps)
        return model, forward, contextlib.nullcontext
    with torch.device(ps.device):
        model = (PlainLlama(d, layers, heads, args.vocab, args.seq, shape["kv_heads"], shape["ffn"]) if llama
                 else PlainGPT(d, layers, heads, args.vocab, args.seq))
    if impl.startswith("dtensor"):
        model = dtensor_tp(model, ps.tp_mesh)
    replicate = ps.dp_size > 1 and args.dp_mode == "replicate" and impl.startswith("plain")
    if ps.dp_size > 1 and not replicate:
        shard_over_dp(model, ps)
    if impl.endswith("compile"):
        compile_blocks(model)
        if impl.startswith("plain"):
            model.head_loss = torch.compile(model.head_loss)
    if replicate:  # what a plain-PyTorch user writes for a model that fits: DDP over dp
        ddp = nn.parallel.DistributedDataParallel(model, process_group=ps.dp_group, gradient_as_bucket_view=True)
        return model, ddp, model.step_context
    return model, model, model.step_context


def make_optimizer(model: nn.Module, device: torch.device, fused: bool = True, local_shards: bool = False):
    """AdamW, fused on CUDA (foreach when `fused` is False), the default on CPU; `local_shards`: the
    trainer's tpflash.parallel.LocalShardAdamW (DTensor parameters updated on their local shards), for
    tpflash's rows."""
    params = [p for p in model.parameters() if p.requires_grad]
    adamw = tpflash.parallel.LocalShardAdamW if local_shards else torch.optim.AdamW
    if device.type != "cuda":
        return adamw(params, lr=1e-4)
    return adamw(params, lr=1e-4, **({"fused": True} if fused else {"foreach": True}))


def _checkpointing(args):
    """GPTConfig.activation_checkpointing for --ac (False for "none"; the library's default "activation"
    where args has no --ac)."""
    ac = getattr(args, "ac", "activation")
    return False if ac == "none" else ac


def _recomputes(impl: str, args) -> bool:
    """Whether `impl`'s row recomputes activations under --ac: tpflash's rows for every mode but "none";
    torchtitan's for its own modes (selective, full); the other peers never."""
    ac = _checkpointing(args)
    return bool(ac) and (impl.startswith("tpflash") or (impl in EXTERNAL and ac in ("selective", "full")))


def _dp_name(impl: str, dp_mode: str) -> str:
    """How `impl` holds the model over dp under --dp-mode (dtensor always FSDP2; zero1 is tpflash's)."""
    if impl.startswith("dtensor"):
        return "FSDP2"
    if dp_mode in ("zero1", "zero3"):  # build() shards the plain peers with FSDP2 unless --dp-mode replicate
        return dp_mode if impl.startswith("tpflash") else "FSDP2"
    return {"replicate": "DDP", "fsdp": "FSDP2"}[dp_mode]


def run_config(model_name: str, impl: str, args, ps) -> dict:
    shape = MODELS[model_name]
    args = argparse.Namespace(**{**vars(args), "vocab": args.vocab or shape.get("vocab", 50304),
                                 "trace_label": f"{model_name}_{impl}"})  # --trace-dir's file per configuration
    row = dict(model=model_name, impl=impl, tp=ps.tp_size, dp=ps.dp_size, device=device_name(ps.device))
    if ps.dp_size > 1:
        row["note"] = "dp: " + _dp_name(impl, args.dp_mode)
        if row["note"] == "dp: zero1" and (impl.startswith("tpflash-graphs") or impl in FP8):
            row["note"] += " in graphs" if args.zero1_in_graphs == "on" else " after graphs"
    layout = layout_note(impl, ps, args) if impl in EXTERNAL else None
    if layout:  # the peer's own layout (torchtitan: FSDP2 over dp), whatever --dp-mode says
        row["note"] = layout
    if _recomputes(impl, args):
        row["note"] = "; ".join(filter(None, [row.get("note"), f"{args.ac} recomputation"]))
    skip = skip_reason(impl, shape, ps) if impl in EXTERNAL else None
    if skip:  # a row that says why, in the table too
        return {**row, "note": skip}
    model = opt = None
    try:
        measured = None
        try:
            measured = _measure(impl, shape, args, ps, fallback=False)
        except Exception as exc:  # one retry, said in the row: tpflash's unfused loss / foreach AdamW
            what = "fused loss" if impl.startswith("tpflash") else "fused AdamW"
            row["note"] = "; ".join(filter(None, [row.get("note"), f"{what} failed ({describe(exc)[:60]}); retried without"]))
        if measured is None:  # retried outside the except block, so the failed attempt's memory is free
            _cleanup(ps)
            measured = _measure(impl, shape, args, ps, fallback=True)
        model, opt, step_s, losses, extra = measured
        row.update(loss_start=losses["start"], loss=losses["last"])
        if not losses["finite"]:  # a failed row, never a speed
            raise FloatingPointError(f"loss not finite (start {losses['start']:.4g}, last {losses['last']:.4g})")
        if "note" in extra:
            row["note"] = "; ".join(filter(None, [row.get("note"), extra.pop("note")]))
        build_peak = extra.pop("_build_peak", None)
        row.update(extra)
        tok_gpu = args.batch * args.seq / ps.tp_size / step_s
        if impl.startswith("tpflash") and ps.tp_size > 1:  # whether the collectives overlapped the GEMMs
            graphed = getattr(model, "_graphed_blocks", None)
            overlapped = graphed.overlapped if graphed is not None else impl in OVERLAPPED
            row["note"] = "; ".join(filter(None, [row.get("note"), "overlap " + ("on" if overlapped else "off")]))
        if impl.startswith("tpflash") and ps.tp_size > 1 and peer_collectives.comm_backend() != "nccl":
            row["note"] = "; ".join(filter(None, [row.get("note"), f"comm {peer_collectives.comm_backend()}"]))
        row.update(step_ms=1e3 * step_s, tok_s_gpu=tok_gpu,
                   mfu=tok_gpu * flops_per_token(shape, args) / (args.peak_tflops * 1e12),
                   **_peak_gib(ps.device, build_peak, symmetric=impl.startswith("tpflash")))
    except Exception as exc:  # one failing configuration must not kill the table
        row["error"] = describe(exc)
    finally:
        release = getattr(model, "release_cuda_graphs", None)
        if release is not None:  # graphs that captured NCCL kernels would make the groups' destruction wait forever
            if ps.device.type == "cuda":
                torch.cuda.synchronize(ps.device)
            release()
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
    opt = make_optimizer(model, ps.device, fused=not (fallback and not tpflash_impl), local_shards=tpflash_impl)
    if getattr(model, "zero1", None) is not None:
        opt = Zero1Optimizer(model.zero1, opt)
    if getattr(model, "zero3", None) is not None:
        opt = Zero3Optimizer(model.zero3, opt)
    build_peak = None
    if ps.device.type == "cuda":  # the build's peak (warm-up passes and graph capture included) apart
        build_peak = torch.cuda.max_memory_allocated(ps.device)
        torch.cuda.reset_peak_memory_stats(ps.device)
    step_s, losses, extra = time_steps(loss_fn, step_context, opt, args, ps)
    extra["_build_peak"] = build_peak
    return model, opt, step_s, losses, extra


class Zero1Optimizer:
    """The step and zero_grad the timing loop calls, for a model under ShardedOptimizerState: the
    gradients reduce-scattered over dp, AdamW on this rank's parameters, the updated ones all-gathered
    (what the trainer does at fsdp=zero1, without its grad-norm clip, as every row here)."""

    def __init__(self, zero, optimizer):
        self.zero, self.optimizer = zero, optimizer

    def step(self):
        self.zero.reduce_gradients()
        self.zero.step(self.optimizer.step)

    def zero_grad(self, set_to_none: bool = True):
        self.zero.zero_grad()  # the gradients stay views of the flat buffer


class Zero3Optimizer:
    """The step and zero_grad the timing loop calls under fsdp=zero3: AdamW on the sharded masters, then
    the blocks' gradient buffers zeroed and handed back to them (ShardedBlocks.new_step)."""

    def __init__(self, zero3, optimizer):
        self.zero3, self.optimizer = zero3, optimizer

    def step(self):
        self.zero3.wait_for_gradients()
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=True)
        self.zero3.new_step()


def _cleanup(ps) -> None:
    gc.collect()
    torch._dynamo.reset()
    if ps.device.type == "cuda":
        torch.cuda.empty_cache()


def flops_per_token(shape: dict, args) -> float:
    """6 * matmul parameters (blocks + output head) + 12 * L * d * seq for attention (PaLM)."""
    d, layers = shape["d"], shape["layers"]
    kv = shape.get("kv_heads", shape["heads"]) * d // shape["heads"]  # k and v widths
    mlp = 3 * d * shape["ffn"] if shape.get("family") == "llama" else 8 * d * d
    return 6.0 * (layers * (2 * d * d + 2 * d * kv + mlp) + args.vocab * d) + 12.0 * layers * d * args.seq


def _peak_gib(device, build_peak: Optional[int], symmetric: bool = False) -> Dict[str, float]:
    """The row's peak memory, the largest over the ranks: what tensors held over the whole row
    (`peak_gib`) and during the timed steps alone (`steps_peak_gib`; the rest is the build: warm-up
    passes, graph capture), both with, for tpflash's rows (`symmetric`), the symmetric memory of its
    copy-engine collectives (`symmetric_gib`: workspaces and kept gathered inputs, which the caching
    allocator does not see; the workspaces outlive a row, so a peer's row leaves them out), and what
    the caching allocator reserved (`reserved_gib`: CUDA graphs' pools whole, also the parts their
    replays use that no live tensor holds between them)."""
    if device.type != "cuda":
        return {"peak_gib": float("nan")}
    steps = torch.cuda.max_memory_allocated(device)
    symmetric = peer_workspace.symmetric_bytes(device) if symmetric else 0
    peak = torch.tensor([max(steps, build_peak or 0) + symmetric, steps + symmetric,
                         torch.cuda.max_memory_reserved(device), symmetric], dtype=torch.float64, device=device) / 2 ** 30
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"peak_gib": peak[0].item(), "steps_peak_gib": peak[1].item(), "reserved_gib": peak[2].item(),
            "symmetric_gib": peak[3].item()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: world size)")
    p.add_argument("--models", default="gpt-1.3b,gpt-2.7b", help=f"comma list of {sorted(MODELS)}")
    p.add_argument("--impls", default=None, help=f"comma list of {IMPLS} (default: tpflash-graphs, the trainer's "
                   "choice, then at tp=1 the fp8 rows, tpflash, plain, plain-compile and the external peers; at tp>1 "
                   "tpflash, tpflash-nooverlap, dtensor*, torchtitan)")
    p.add_argument("--dp-mode", choices=DP_MODES, default="replicate",
                   help="at dp > 1: DDP (tpflash and plain), FSDP2 over dp, or zero1 (tpflash: AdamW's state sharded "
                   "over dp, the trainer's fsdp=zero1; plain: FSDP2, as under fsdp); dtensor: FSDP2 either way. One "
                   "row's own: --impls tpflash-graphs@zero1,tpflash@fsdp")
    p.add_argument("--zero1-in-graphs", choices=("on", "off"), default="on",
                   help="--dp-mode zero1, graphed rows: the blocks' reduce-scatters and all-gathers inside the graphs, "
                   "overlapped with the blocks (on, the trainer's choice at one micro-batch per step) or after them")
    p.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="sequences per step per dp rank")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=None, help="default: the model's (50304 for the GPTs)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--ac", choices=("none", "activation", "selective", "full"), default="activation",
                   help="activation checkpointing of every row that has it: tpflash's (activation, its default: the "
                   "MLP activation's output remade in the backward; selective keeps the GEMMs' outputs) and "
                   "torchtitan's (selective: its per-op policy; it has no activation-only mode and runs none for it)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--memory-limit-gib", type=float, default=None, metavar="GIB",
                   help="cap PyTorch's caching allocator at GIB per GPU (set_per_process_memory_fraction), e.g. 76 "
                   "on a larger GPU to check that the rows fit an 80 GB one (CUDA context and NCCL buffers come on top)")
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
    p.add_argument("--trace-dir", default="", help="with --profile: write each rank's chrome trace here "
                   "(trace_MODEL_IMPL_tpN_rankR.json)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="after timing, run one step under cProfile on rank 0 and print its N costliest "
                        "Python functions (host time: where a host-bound step goes)")
    p.add_argument("--gemm-workspace", choices=gemm_workspace.CHOICES, default="auto",
                   help="cuBLAS's workspace for the whole launch (tpflash.kernels.gemm_workspace): auto = the trainer's "
                   "choice (none at tp > 1) where every row is tpflash's, else cuBLAS's default, as the peers' users run")
    p.add_argument("--table-only", action="store_true", help="print the table of --results and exit (no run)")
    args = p.parse_args(argv)
    if args.tiny:  # --models tiny-llama for the Llama family
        args.models = args.models if args.models.startswith("tiny") else "tiny"
        args.vocab, args.seq, args.batch = 512, 64, 2
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    return args


def _impl_and_dp_mode(spec: str, default_mode: str) -> tuple:
    """"tpflash-graphs@zero1" -> ("tpflash-graphs", "zero1"); without "@": --dp-mode's."""
    impl, _, mode = spec.partition("@")
    if impl not in IMPLS:
        raise ValueError(f"{impl!r} is not an implementation {IMPLS}")
    if mode and mode not in DP_MODES:
        raise ValueError(f"{spec!r}: the dp mode after '@' must be one of {DP_MODES}")
    return impl, mode or default_mode


def print_table(args) -> None:
    with open(args.results) as f:
        text = table([json.loads(line) for line in f if line.strip()], IMPLS, BASELINE, LOSS_REFERENCE)
    print(text, flush=True)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text + "\n")


def _cap_memory(device: torch.device, limit_gib: float) -> None:
    """Let the caching allocator reserve at most limit_gib on this GPU: a row that needs more fails with
    an out-of-memory error, as on a GPU of that size."""
    if device.type != "cuda":
        raise ValueError(f"--memory-limit-gib {limit_gib:g}: a memory cap needs CUDA devices")
    total_gib = torch.cuda.get_device_properties(device).total_memory / 2 ** 30
    if not 0 < limit_gib <= total_gib:
        raise ValueError(f"--memory-limit-gib {limit_gib:g}: must be above 0 and at most this GPU's {total_gib:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(limit_gib / total_gib, device)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.table_only:
        return print_table(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ps = tpflash.parallel.init(tp=args.tp or world)
    args.dtype = args.dtype or ("bf16" if ps.device.type == "cuda" else "fp32")
    if args.memory_limit_gib is not None:
        _cap_memory(ps.device, args.memory_limit_gib)
    # first the trainer's default (graphed blocks, at tp=1 where dp=1), then the eager step and the peers
    rest = ([*FP8, "tpflash", "plain", "plain-compile", *EXTERNAL] if ps.tp_size == 1
            else ["tpflash", "tpflash-nooverlap", "dtensor", "dtensor-compile", "torchtitan"])
    default = ",".join(["tpflash-graphs", *rest])
    impls = [_impl_and_dp_mode(spec, args.dp_mode) for spec in (args.impls or default).split(",")]
    only_tpflash = all(impl.startswith("tpflash") for impl, _ in impls)
    setting = "default" if args.gemm_workspace == "auto" and not only_tpflash else args.gemm_workspace
    workspace = gemm_workspace.apply(setting, ps.tp_size, on_cuda=ps.device.type == "cuda")  # before any GEMM
    for name in args.models.split(","):
        if name not in MODELS:
            raise ValueError(f"{name!r} is not a model {sorted(MODELS)}")
    rows = []
    for model_name in args.models.split(","):
        for impl, dp_mode in impls:
            if ps.rank == 0:
                print(f"[bench_e2e] {model_name} {impl} tp={ps.tp_size} dp={ps.dp_size} ({dp_mode})", flush=True)
            rows.append(run_config(model_name, impl, argparse.Namespace(**{**vars(args), "dp_mode": dp_mode}), ps))
            if args.memory_limit_gib is not None:
                rows[-1]["note"] = "; ".join(filter(None, [rows[-1].get("note"),
                                                           f"allocator capped at {args.memory_limit_gib:g} GiB"]))
            if workspace not in (None, "default"):
                rows[-1]["note"] = "; ".join(filter(None, [rows[-1].get("note"), f"cuBLAS workspace {workspace}"]))
            if ps.rank == 0:
                print(f"[bench_e2e]   {json.dumps(rows[-1])}", flush=True)
                with open(args.results, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    if ps.rank == 0:
        print_table(args)
    dist.barrier()
    tpflash.parallel.shutdown(exit_after_s=SHUTDOWN_WAIT_S)  # the table is out: a stuck destruction must not hold the job


if __name__ == "__main__":
    main()
