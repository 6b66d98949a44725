"""The projects a user would pick instead of tpflash, as rows of benchmarks/bench_e2e.py (Llama models):
torchtitan's own Llama 3 (bf16, and fp8 through its float8 converter) at any tp x dp its trainer
builds (FSDP2 over dp, its TP plan over tp), torchao's float8 training on the plain Llama peer and
Liger's kernels on the plain Llama peer, both on one GPU. `build` returns what bench_e2e.build
returns; `skip_reason` says why a row is not run (a GPT-2 model, a layout the peer does not run, a
package missing), so that a missing peer is a row with a note, never a crash; `layout_note` says how
a torchtitan row spreads over the GPUs. Versions checked: torchtitan 0.2.2, torchao 0.18.0,
liger-kernel 0.8.5 (scripts/gpu_wheels.sh)."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from types import MethodType
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from e2e_peers import PlainLlama, compile_blocks

# impl -> the packages it imports, in the order they are checked
PACKAGES = {"torchtitan": ("torchtitan",), "torchtitan-fp8": ("torchtitan", "torchao"),
            "torchao-fp8-compile": ("torchao",), "torchao-fp8-tensorwise-compile": ("torchao",),
            "liger": ("liger_kernel",), "liger-compile": ("liger_kernel",)}
EXTERNAL = tuple(PACKAGES)
_ENTRY = {"torchtitan": "torchtitan.models.llama3", "torchao": "torchao.float8",
          "liger_kernel": "liger_kernel.transformers"}  # what the builders import from each package


def skip_reason(impl: str, shape: dict, ps) -> Optional[str]:
    """Why `impl` cannot run this model here (the row's note), or None."""
    if shape.get("family") != "llama":
        return "Llama models only (torchtitan has no GPT-2; torchao and Liger run on the plain Llama peer)"
    layout = _layout_problem(impl, shape, ps)
    if layout:
        return layout
    for package in PACKAGES[impl]:
        problem = _import_problem(package)
        if problem:
            return problem
    if ps.device.type != "cuda":
        if impl.startswith("liger"):
            return "needs CUDA (Liger's kernels are Triton kernels)"
        if impl == "torchtitan-fp8":
            return "needs CUDA SM 8.9+ (torchtitan's float8 converter refuses other devices)"
    return None


def _layout_problem(impl: str, shape: dict, ps) -> Optional[str]:
    """Why `impl` cannot run at this rank layout, or None. torchtitan shards heads over tp as its TP
    plan does (column-parallel q, k and v), so tp must divide both head counts; torchao and Liger
    rows are the plain Llama on one GPU."""
    if not impl.startswith("torchtitan"):
        return "run on one GPU only (tp=1, dp=1)" if ps.tp_size > 1 or ps.dp_size > 1 else None
    if shape["heads"] % ps.tp_size or shape["kv_heads"] % ps.tp_size:
        return f"tp={ps.tp_size} must divide the heads ({shape['heads']}) and kv heads ({shape['kv_heads']})"
    return None


def layout_note(impl: str, ps, args) -> Optional[str]:
    """How a torchtitan row spreads over the GPUs (e.g. "torchtitan FSDP2 dp_shard=2 x TP 2"), None
    on one GPU or for the other peers. Under TP without FSDP its trainer trains in fp32
    (maybe_enable_amp: mixed precision comes from FSDP there), which a bf16 run's note says."""
    if not impl.startswith("torchtitan") or ps.tp_size * ps.dp_size == 1:
        return None
    parts = ([f"FSDP2 dp_shard={ps.dp_size}"] if ps.dp_size > 1 else []) + (
        [f"TP {ps.tp_size}"] if ps.tp_size > 1 else [])
    note = "torchtitan " + " x ".join(parts)
    if ps.dp_size == 1 and args.dtype == "bf16":
        note += " (fp32: torchtitan has mixed precision under TP only with FSDP)"
    return note


def _import_problem(package: str) -> Optional[str]:
    """The row's note where `package` (what the builders use of it) cannot be imported, or None."""
    try:
        if package == "torchtitan":
            stub_datasets()
        importlib.import_module(_ENTRY[package])
    except Exception as exc:  # a missing package, or one built for another torch
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == package:
            return f"{package} not installed (see scripts/gpu_wheels.sh)"
        text = (str(exc).strip().splitlines() or [""])[0][:100]
        return f"{package} not importable ({type(exc).__name__}: {text}; see scripts/gpu_wheels.sh)"
    return None


def stub_datasets() -> None:
    """torchtitan imports Hugging Face `datasets` when it is imported, for its data loaders alone
    (Dataset, load_dataset, split_dataset_by_node); the benchmark feeds its own tokens, so where
    `datasets` is not installed a stub stands in for it rather than carrying datasets and its
    dependencies to an offline GPU host."""
    if "datasets" in sys.modules or importlib.util.find_spec("datasets") is not None:
        return

    def unavailable(*args, **kwargs):
        raise RuntimeError("the `datasets` stub of benchmarks/e2e_external.py loads no data")
    stub, distributed = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
    stub.Dataset, stub.load_dataset, stub.distributed = type("Dataset", (), {}), unavailable, distributed
    distributed.split_dataset_by_node = unavailable
    sys.modules.update({"datasets": stub, "datasets.distributed": distributed})


def build(impl: str, shape: dict, args, ps):
    """(model, loss_fn(idx, targets), context for forward + backward), as bench_e2e.build."""
    if impl.startswith("torchtitan"):
        return _torchtitan(impl, shape, args, ps)
    if impl.startswith("torchao"):
        return _torchao_fp8(impl, shape, args, ps)
    if impl.startswith("liger"):
        return _liger(impl, shape, args, ps)
    raise ValueError(f"{impl!r} is not an external peer {EXTERNAL}")


# ---- torchtitan --------------------------------------------------------------------------------

def _torchtitan(impl: str, shape: dict, args, ps):
    """torchtitan's Llama 3 as its Trainer builds one (train.py) at this rank layout: ParallelDims
    with dp_shard = dp and tp = tp, the model on the meta device, its model converters (float8),
    parallelize_llama (TP with loss_parallel where tp > 1, per-block torch.compile, fullgraph,
    activation checkpointing as bench_e2e's --ac says (none by default), FSDP2 over dp_shard where
    dp > 1), to_empty, init_weights. The loss and precision are its train step's (`_torchtitan_loss`);
    the step context is its train context, loss_parallel under TP, around forward and backward as there."""
    stub_datasets()
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import get_train_context
    from torchtitan.models.llama3 import Transformer, parallelize_llama
    from torchtitan.protocols.model_converter import build_model_converters
    job = _torchtitan_job(impl, args)
    dims = ParallelDims(dp_replicate=1, dp_shard=ps.dp_size, cp=1, tp=ps.tp_size, pp=1, ep=1, etp=1,
                        world_size=ps.dp_size * ps.tp_size)
    _mesh_on(ps.device)
    with torch.device("meta"):
        model = Transformer(torchtitan_args(shape, args))
    hidden = model.layers["0"].feed_forward.w1.out_features
    assert hidden == shape["ffn"], f"torchtitan's SwiGLU is {hidden} wide, not {shape['ffn']}"
    build_model_converters(job, dims).convert(model)
    model = parallelize_llama(model, dims, job)
    if dims.fsdp_enabled and ps.device.type == "cpu":
        _sum_without_premul(model)
    model.to_empty(device=ps.device)
    with torch.no_grad():
        model.init_weights(buffer_device=ps.device)
    model.train()
    loss_parallel = dims.tp_enabled and not job.parallelism.disable_loss_parallel
    return model, _torchtitan_loss(model, job, dims, ps), get_train_context(loss_parallel)


def _torchtitan_job(impl: str, args):
    """torchtitan's JobConfig for this row: its defaults but what the benchmark sets for every row."""
    from torchtitan.config import JobConfig
    job = JobConfig()
    job.training.seq_len = args.seq
    job.compile.enable = True  # components: "model" (each block) and "loss", its default
    ac = getattr(args, "ac", "none")  # as every other row (bench_e2e --ac); torchtitan has no "activation"-only mode
    job.activation_checkpoint.mode = "none" if ac == "activation" else ac
    job.activation_checkpoint.selective_ac_option = "op"  # selective: its per-op policy (keeps matmul outputs)
    # FSDP's parameter dtype: its default bf16, fp32 where the benchmark runs fp32 (CPU); gradients are
    # reduced in fp32 (mixed_precision_reduce, its default)
    job.training.mixed_precision_param = "bfloat16" if args.dtype == "bf16" else "float32"
    if impl == "torchtitan-fp8":  # tensorwise: its default recipe (docs/float8.md: stable; rowwise alpha)
        job.model.converters = ["quantize.linear.float8"]
        job.quantize.linear.float8.filter_fqns = ["output"]  # as its llama3 train configs
    return job


def _mesh_on(device: torch.device) -> None:
    """torchtitan builds its device meshes on the device type it found when imported, "cuda" where it
    found no accelerator; the meshes go on the benchmark's device (CPU meshes on a gloo run)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    parallel_dims.device_type = device.type


def _sum_without_premul(model: nn.Module) -> None:
    """FSDP2 reduce-scatters with PREMUL_SUM(1) at torchtitan's gradient divide factor of 1, which gloo
    lacks; on a CPU (gloo) run its FSDP modules sum with a plain SUM instead, the same reduction."""
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def _torchtitan_loss(model: nn.Module, job, dims, ps):
    """loss_fn(idx, targets) as torchtitan's train step computes it: its compiled sum-reduced
    cross-entropy divided by the global token count (parallelize_llama sets FSDP's gradient divide
    factor to 1, so the gradients summed over dp are the global mean's). Its maybe_enable_amp
    autocasts to bf16 on one GPU only, which the benchmark's own autocast is; with FSDP, FSDP's
    parameter dtype is the precision, and under TP without FSDP it trains in fp32, so there the
    benchmark's autocast is switched off."""
    from torchtitan.components.loss import build_cross_entropy_loss
    loss_sum = build_cross_entropy_loss(job)
    own_precision = dims.fsdp_enabled or dims.tp_enabled

    def loss_fn(idx, targets):
        with torch.autocast(ps.device.type, enabled=False) if own_precision else contextlib.nullcontext():
            return _local_mean_of_global_loss(loss_sum(model(idx), targets), targets.numel(), ps.dp_size)
    return loss_fn


def _local_mean_of_global_loss(loss_sum: torch.Tensor, tokens: int, dp: int) -> torch.Tensor:
    """torchtitan's loss, loss_sum / (tokens * dp) over dp ranks of `tokens` tokens each, for the
    backward, with the value of this rank's mean loss (what the other rows report): the two differ by
    a constant factor, so the detached difference leaves the gradients as torchtitan's."""
    scaled = loss_sum / (tokens * dp)
    return scaled + (loss_sum / tokens - scaled).detach() if dp > 1 else scaled


def torchtitan_args(shape: dict, args):
    """TransformerModelArgs of the benchmark's Llama. torchtitan sizes SwiGLU from d: int(8d/3), times
    ffn_dim_multiplier if given, rounded up to multiple_of; llama-1b's 5632 is its default
    multiple_of=256 (int(8 * 2048 / 3) = 5461 -> 5632). A width that rounding cannot give gets a
    multiplier that lands on it exactly (multiple_of=1)."""
    from torchtitan.models.llama3 import TransformerModelArgs
    d, ffn = shape["d"], shape["ffn"]
    base = int(2 * 4 * d / 3)
    sizing = (dict(multiple_of=256) if 256 * -(-base // 256) == ffn
              else dict(multiple_of=1, ffn_dim_multiplier=(ffn + 0.5) / base))
    return TransformerModelArgs(dim=d, n_layers=shape["layers"], n_heads=shape["heads"],
                                n_kv_heads=shape["kv_heads"], vocab_size=args.vocab, norm_eps=1e-5,
                                rope_theta=10000, max_seq_len=args.seq, **sizing)


# ---- torchao float8 on the plain Llama ---------------------------------------------------------

def _plain_llama(shape: dict, args, ps) -> PlainLlama:
    with torch.device(ps.device):
        return PlainLlama(shape["d"], shape["layers"], shape["heads"], args.vocab, args.seq,
                          shape["kv_heads"], shape["ffn"])


def fp8_module_filter(module: nn.Module, fqn: str) -> bool:
    """torchao's README filter: every nn.Linear with both dims multiples of 16 (fp8 GEMMs need them),
    but the output head (torchtitan's configs skip it too)."""
    return (isinstance(module, nn.Linear) and fqn != "lm_head"
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def _torchao_fp8(impl: str, shape: dict, args, ps):
    """The plain Llama with torchao's convert_to_float8_training (dynamic scaling; the rowwise or
    tensorwise recipe), then compiled like plain-compile (each block, and the head + loss): torchao
    relies on torch.compile to fuse its scaling and casts."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    model = _plain_llama(shape, args, ps)
    recipe = "tensorwise" if "tensorwise" in impl else "rowwise"
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=fp8_module_filter)
    compile_blocks(model)
    model.head_loss = torch.compile(model.head_loss)
    return model, model, model.step_context


# ---- Liger kernels on the plain Llama ----------------------------------------------------------

def _liger(impl: str, shape: dict, args, ps):
    """The plain Llama with the pieces liger's apply_liger_kernel_to_llama swaps into a Hugging Face
    Llama (its defaults): LigerRMSNorm for every RMSNorm, liger_rotary_pos_emb for RoPE, the SwiGLU
    MLP through LigerSiLUMulFunction, and LigerFusedLinearCrossEntropyLoss for the head + loss (no
    logits kept). `liger-compile` also compiles each block."""
    from liger_kernel.ops import LigerSiLUMulFunction
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    model = _plain_llama(shape, args, ps)

    def liger_norm(old: nn.RMSNorm) -> nn.Module:
        new = LigerRMSNorm(old.weight.numel(), eps=old.eps).to(ps.device)
        new.weight = old.weight
        return new

    def attention(self, x, cos, sin):  # LlamaAttention.forward with Liger's RoPE kernel
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = liger_rotary_pos_emb(q, k, cos[None].to(q.dtype), sin[None].to(q.dtype))  # HF casts cos/sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))

    def mlp(self, x):
        return self.down(LigerSiLUMulFunction.apply(self.gate(x), self.up(x)))

    def head_loss(self, x, targets):
        return self.fused_ce(self.lm_head.weight, self.norm(x).flatten(0, 1), targets.flatten())

    for block in model.blocks:
        block.ln1, block.ln2 = liger_norm(block.ln1), liger_norm(block.ln2)
        block.attn.forward = MethodType(attention, block.attn)
        block.mlp.forward = MethodType(mlp, block.mlp)
    model.norm, model.fused_ce = liger_norm(model.norm), LigerFusedLinearCrossEntropyLoss()
    model.head_loss = MethodType(head_loss, model)
    if impl == "liger-compile":
        compile_blocks(model)
    return model, model, model.step_context
