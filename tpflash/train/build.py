"""Turning a TrainConfig into the pieces of a run: batch plan, model config, optimizer, autocast.

Everything here that can reject a config does so before any process group exists, so a bad
value raises a ValueError on every rank instead of hanging a collective.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..parallel import LocalShardAdamW
from .config import TrainConfig, TrainSection
from .gradients import local_tensor


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's `batch_size` global sequences are split: over dp ranks, then into
    `grad_accum` micro-batches of `micro` sequences each."""

    batch_size: int
    micro: int
    grad_accum: int
    dp: int

    @property
    def per_rank(self) -> int:
        return self.micro * self.grad_accum


def plan_batches(cfg: TrainSection, dp: int) -> BatchPlan:
    """Resolve micro_batch_size/grad_accum for `dp` ranks; ValueError naming the numbers if they do not fit."""
    b = cfg.batch_size
    if b < 1 or b % dp != 0:
        raise ValueError(f"train.batch_size={b} must be a positive multiple of dp={dp}")
    per_rank = b // dp
    micro = cfg.micro_batch_size or (per_rank // cfg.grad_accum if cfg.grad_accum else per_rank)
    if micro < 1 or per_rank % micro != 0:
        raise ValueError(f"train.micro_batch_size={micro} does not divide the per-rank batch "
                         f"batch_size/dp = {b}/{dp} = {per_rank}")
    accum = per_rank // micro
    if cfg.grad_accum and cfg.grad_accum != accum:
        raise ValueError(f"train.grad_accum={cfg.grad_accum} but batch_size={b} / (dp={dp} * "
                         f"micro_batch_size={micro}) = {accum}; set one of them to 0 to derive it")
    return BatchPlan(batch_size=b, micro=micro, grad_accum=accum, dp=dp)


def resolve_model_config(fields: Dict[str, Any], vocab_size: Optional[int], config_cls) -> Any:
    """The model config: `config_cls.preset(preset)`, or the config of the Hugging Face model in
    `init_from`, or the defaults, with the given fields replaced.

    vocab_size: the tokenizer's vocabulary, used unless the config names one explicitly or comes
    from `init_from` (whose vocabulary must then hold the tokenizer's).
    """
    fields = dict(fields)
    preset, init_from = fields.pop("preset", None), fields.pop("init_from", None)
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown model config keys {unknown}; valid: {sorted(known)}")
    if init_from:
        base = hf_model_config(init_from, preset, config_cls)
        if vocab_size is not None and vocab_size > base.vocab_size:
            raise ValueError(f"the tokenizer has {vocab_size} ids but model.init_from={init_from!r} has a "
                             f"vocabulary of {base.vocab_size}: use the tokenizer the model was trained with")
        return dataclasses.replace(base, **fields)
    if vocab_size is not None and "vocab_size" not in fields:
        fields["vocab_size"] = vocab_size
    base = config_cls.preset(preset) if preset else None
    return dataclasses.replace(base, **fields) if base is not None else config_cls(**fields)


def hf_model_config(hf_dir: str, preset: Optional[str], config_cls) -> Any:
    """The GPTConfig of the Hugging Face model saved in `hf_dir` (its config.json, read as JSON)."""
    from ..models import GPTConfig
    if preset:
        raise ValueError(f"model.preset={preset!r} and model.init_from={hf_dir!r} both choose the model: give one "
                         "(--model.preset= clears a config file's preset)")
    if config_cls is not GPTConfig:
        raise ValueError(f"model.init_from needs tpflash's GPT, not {config_cls.__name__}")
    from ..models.pretrained import CONFIG_FILE, read_hf_config
    if not os.path.isfile(os.path.join(hf_dir, CONFIG_FILE)):
        raise ValueError(f"model.init_from={hf_dir!r} is not a local Hugging Face model directory (it has no "
                         f"{CONFIG_FILE})")
    try:
        return read_hf_config(hf_dir)  # config.json alone: transformers is not imported
    except (OSError, ValueError, KeyError) as e:  # unreadable, or a model type or field tpflash cannot hold
        raise ValueError(f"model.init_from={hf_dir!r}: {type(e).__name__}: {e}") from None


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> Optional[torch.dtype]:
    """The autocast compute dtype: bf16 on CUDA under dtype=auto/bf16, none (fp32) on CPU or dtype=fp32."""
    if cfg.dtype == "fp32" or (cfg.dtype == "auto" and device.type != "cuda"):
        return None
    if cfg.dtype == "bf16" and device.type != "cuda":
        raise ValueError("dtype=bf16 needs CUDA: CPU runs train in fp32 (dtype=auto or fp32)")
    return torch.bfloat16


def autocast(device: torch.device, dtype: Optional[torch.dtype]):
    """torch.autocast for `dtype`, or a no-op context for fp32."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_optimizer(model: nn.Module, cfg: TrainSection, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (dim >= 2) only; fused kernels on CUDA (train.fused_adam).
    DTensor parameters (fsdp=on, zero3) are updated on their local shards (parallel.LocalShardAdamW: torch's
    AdamW without DTensor's dispatch per step)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    fused = cfg.fused_adam == "on" or (cfg.fused_adam == "auto" and device.type == "cuda")
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"fused": True} if fused else {}
    return LocalShardAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)


def optimizer_settings(optimizer: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    """Each param group's settings but its parameters and lr (which the schedule sets every step)."""
    return [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in optimizer.param_groups]


def restore_optimizer_settings(optimizer: torch.optim.Optimizer, settings: List[Dict[str, Any]]) -> List[str]:
    """Put `settings` (from optimizer_settings) back into the param groups after a checkpoint load
    replaced them; returns "key: saved -> now" for each setting that differed."""
    changed = []
    for group, values in zip(optimizer.param_groups, settings):
        for key, value in values.items():
            line = f"{key}: {group.get(key)!r} -> {value!r}"
            if group.get(key) != value and line not in changed:
                changed.append(line)
        group.update(values)
    return changed


# fp32 weight, fp32 gradient and AdamW's two fp32 moments: what every dp rank holds without sharding
REPLICATED_BYTES_PER_PARAM = 16
# the trainer's fsdp values: how the dp (x cp) ranks hold the model
DP_MODES = ("auto", "off", "zero1", "zero3", "on")


def device_memory(device: torch.device) -> int:
    """Bytes of memory the run's tensors live in: the GPU's, or the host's RAM for CPU runs (0 where
    the platform does not say, which makes fsdp=auto shard at dp > 1)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return 0


def agreed_fsdp_inputs(model: nn.Module, ps) -> Tuple[int, int]:
    """(parameters a rank holds after tp, device memory in bytes) for fsdp_choice: the largest count
    and the smallest memory over all ranks (one all-reduce), so that every rank makes the same
    choice even on mixed machines. Collective at dp * cp > 1."""
    local = sum(local_tensor(p).numel() for p in model.parameters())
    memory = device_memory(ps.device)
    if ps.dp_cp_size == 1:
        return local, memory
    both = torch.tensor([local, -memory], dtype=torch.int64, device=ps.device)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
    return int(both[0]), -int(both[1])


def zero3_blocker(cfg: TrainConfig, model: nn.Module, device: torch.device) -> Optional[str]:
    """Why fsdp=auto does not hold this run's model with zero3, or None where it does: on CUDA at cp=1
    (any tp, bf16 or fp8), with the blocks CUDA-graphed (cuda_graphs not off, no packed documents, no
    dropout), for a model whose blocks zero3 can shard (one shape, plain parameters). That is where it
    was measured as fast as or faster than zero1 and DDP with less memory, and faster than FSDP2
    (docs/performance.md, "Sharded data parallelism (four H200s)"); at cp > 1 zero3 runs when asked for."""
    from ..layers.graphed_blocks import check_graphable
    from ..parallel.zero3_layout import block_parameters
    from .data import token_format
    if device.type != "cuda":
        return "CPU"
    if cfg.cp > 1:
        return f"cp={cfg.cp}"
    if cfg.cuda_graphs == "off" or token_format(cfg.data) == "jsonl":
        return "blocks not CUDA-graphed"
    blocks = list(getattr(model, "blocks", []))
    try:
        check_graphable(blocks)
        block_parameters(blocks)
    except ValueError as e:
        return str(e)
    return None


def fsdp_choice(setting: str, dp: int, local_params: int, memory: int,
                zero3_blocker: Optional[str] = "not considered") -> Tuple[str, str]:
    """(how the dp ranks hold the model: "off" | "zero1" | "zero3" | "on", why: "" when set explicitly).

    off: replicated, gradients all-reduced by DDP. zero1: parameters and gradients replicated,
    AdamW's state sharded over dp (tpflash.parallel.zero; 8 + 8/dp bytes per parameter). zero3: the
    blocks' weights, gradients and state sharded, gathered into two static slots so that the blocks
    stay CUDA-graphed (tpflash.parallel.zero3; 16/dp bytes per parameter). on: FSDP2, everything
    sharded. auto, at dp > 1: zero3 where `zero3_blocker` (build.zero3_blocker) is None; else zero1
    where its state takes at most half of `memory`, else FSDP. zero3 and zero1 keep the CUDA-graphed
    blocks that FSDP turns off; zero3 measured fastest (or as fast as zero1 and DDP) with the least
    memory of the four at tp=1 and at tp=2, zero1 as fast as DDP with less memory (docs/performance.md, "Sharded data parallelism"). Every
    rank must pass the same numbers (agreed_fsdp_inputs), so that all choose alike."""
    if setting != "auto":
        return setting, ""
    if dp == 1:
        return "off", " (auto: dp=1)"
    if zero3_blocker is None:
        return "zero3", " (auto: on CUDA: every block's state sharded, the blocks CUDA-graphed)"
    from ..parallel.zero import bytes_per_param
    state = bytes_per_param(dp) * local_params
    where = (f"weights and gradients + 1/{dp} of AdamW's state {state / 2**30:.2f} GiB per rank, "
             f"device {memory / 2**30:.0f} GiB")
    if 2 * state > memory:
        return "on", f" (auto: {where}: more than half, so FSDP shards the weights too)"
    return "zero1", f" (auto: {where})"


def check_context_parallel(cfg: TrainConfig, model_config, seq_len: int, packed: bool, model_cls) -> None:
    """At cp > 1, raise ValueError naming the value and the rule for what context parallelism cannot
    run; called before any process group exists, so every rank raises alike."""
    if cfg.cp == 1:
        return
    if packed:
        raise ValueError(f"cp={cfg.cp} needs unpacked rows: data.format=jsonl packs documents into rows, which "
                         "context parallelism does not split; fine-tune at cp=1")
    if "cp_comm" not in inspect.signature(model_cls).parameters:
        raise ValueError(f"cp={cfg.cp}: {model_cls.__name__} does not take cp_comm= (context parallelism needs "
                         "tpflash.models.GPT, or a model class built on ParallelAttention's cp_group)")
    if cfg.log.sample_tokens:
        raise ValueError(f"log.sample_tokens={cfg.log.sample_tokens} samples without context parallelism: set "
                         f"it to 0 at cp={cfg.cp}")
    if cfg.cuda_graphs == "on":  # use_cuda_graphs would refuse it too, but only after the groups and the model
        raise ValueError(_cp_graphs_rule(cfg.cp))
    from ..parallel.context_parallel import check_cp_batch
    check_cp_batch(seq_len, cfg.cp, cfg.tp, getattr(model_config, "sequence_parallel", False))


def _cp_graphs_rule(cp: int) -> str:
    return (f"cuda_graphs=on is not possible with cp={cp}: the ring's sends and receives run eagerly; use "
            "cuda_graphs=auto or off")


def context_parallel_kwargs(cfg: TrainConfig) -> dict:
    """The model constructor's context-parallel argument (the cp group itself comes from the default
    state that tpflash.parallel.init(cp=) made)."""
    return {"cp_comm": cfg.cp_comm} if cfg.cp > 1 else {}


# packed fine-tuning rows put their document boundaries elsewhere in every batch, which graphs
# captured once cannot follow
PACKED_GRAPHS_RULE = ("cuda_graphs=on is not possible with data.format=jsonl: packed documents change the attention's "
                      "document boundaries every batch, which captured graphs cannot replay; use cuda_graphs=auto or off")


def use_cuda_graphs(cfg: TrainConfig, model: nn.Module, device: torch.device, dp_size: int,
                    dp_mode: str = "off", graph_params=None) -> Tuple[bool, str]:
    """(capture the model's blocks as CUDA graphs?, why) for cuda_graphs=auto/on/off; call it after
    FSDP has been applied (its parameters are one of the things that stand in the way).
    `graph_params`: what the replays would differentiate instead of the blocks' parameters
    (fsdp=zero3: the gathered weights' leaves, tpflash.parallel.zero3.GraphSync.graph_params()).

    auto: on CUDA, when nothing stands in the way, at tp > 1, where issuing a step's kernels and
    collectives from Python takes longer than the GPUs take to run them (docs/performance.md,
    "End-to-end, two H200s"), and at tp=1 with dp=1, where the graphs measured as fast or faster than
    the eager step (+1-3% on gpt-1.3b and llama-1b, more where the host stalls; "CUDA graphs in the
    trainer"). At tp=1 with dp > 1 under DDP (dp_mode "off") it stays eager: DDP's all-reduces then
    run during the eager backward, whereas a graphed backward hands DDP every gradient at its end;
    zero1 and zero3 reduce inside the graphed backward (zero1 at one micro-batch per step, else after
    it), so they keep the graphs. on: wherever possible (CPU runs an eager stand-in), ValueError
    naming what stands in the way. Packed fine-tuning data (data.format=jsonl) always runs eager:
    auto is off, on a ValueError.
    """
    if cfg.cuda_graphs == "off":
        return False, "off"
    if cfg.cp > 1:
        if cfg.cuda_graphs == "on":
            raise ValueError(_cp_graphs_rule(cfg.cp))
        return False, f"auto: off (cp={cfg.cp})"
    from .data import token_format
    if token_format(cfg.data) == "jsonl":
        if cfg.cuda_graphs == "on":
            raise ValueError(PACKED_GRAPHS_RULE)
        return False, "auto: off (packed documents)"
    from ..layers.graphed_blocks import check_graphable
    blocker = None
    if not hasattr(model, "capture_cuda_graphs"):
        blocker = f"{type(model).__name__} has no capture_cuda_graphs"
    else:
        try:
            check_graphable(model.blocks, graph_params)
        except ValueError as e:
            blocker = str(e)
    if cfg.cuda_graphs == "on":
        if blocker:
            raise ValueError(f"cuda_graphs=on is not possible here: {blocker}")
        return True, "on" + (" (CPU: eager stand-in, no speed-up)" if device.type != "cuda" else "")
    if device.type != "cuda":
        return False, "auto: off (CPU)"
    if cfg.tp == 1 and dp_size > 1 and dp_mode == "off":
        return False, "auto: off (tp=1 at dp > 1: DDP overlaps its all-reduces with the eager backward)"
    if blocker:
        return False, f"auto: off ({blocker})"
    why = "tp > 1" if cfg.tp > 1 else "tp=1 at dp=1" if dp_size == 1 else f"tp=1, fsdp={dp_mode}"
    return True, f"auto: on (CUDA, {why})"
