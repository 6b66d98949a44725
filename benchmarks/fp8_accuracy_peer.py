"""The peer run of benchmarks/fp8_accuracy.sh: the plain-PyTorch Llama with bf16 GEMMs or torchao's float8.

    python benchmarks/fp8_accuracy_peer.py --mode {bf16,torchao-tensorwise,torchao-rowwise} --out DIR \
        [--config benchmarks/fp8_accuracy.yaml] [--compile | --no-compile] [--key=value trainer overrides ...]

Why: whether a gap between tpflash's fp8 and bf16 runs in benchmarks/fp8_accuracy.sh is tpflash's or
fp8 training's own shows when the recipe a user would pick instead, torchao's float8 training (convert_to_float8_training on nn.Linear layers), trains the same model from
the same initial weights on the same batches with the same optimizer and schedule. This script is that
run: the trainer's config (tpflash.train.config, the same overrides as `python -m tpflash.train`), its
data, sample order, AdamW, warmup-cosine schedule, global-norm clipping, evaluation and metrics.jsonl
records, with benchmarks/e2e_peers.PlainLlama as the model, loaded with the weights the trainer's
seeded init gives. One process, one device (CUDA if available, else CPU; torchao's modes need CUDA).

--mode bf16 trains PlainLlama as it is (bf16 autocast on CUDA, fp32 on CPU, as the trainer's
dtype=auto); torchao-tensorwise and torchao-rowwise first convert its projections with
Float8LinearConfig.from_recipe_name (the output head stays in bf16, as in benchmarks/e2e_external.py).
--compile (the default on CUDA) compiles each block and the head + loss, as e2e_external's torchao rows
do: torchao relies on torch.compile to fuse its scaling and casts. Before training, the tpflash model
and PlainLlama are checked to give the same fp32 loss on the first batch. DIR/metrics.jsonl has the
trainer's records ("train" every log.interval steps, "eval", "summary"), so that
benchmarks/fp8_accuracy_plot.py reads it beside the tpflash runs; each log line is also printed.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from tpflash.models import GPT, GPTConfig  # noqa: E402
from tpflash.train import build  # noqa: E402
from tpflash.train.config import check_values, parse_args as parse_config  # noqa: E402
from tpflash.train.gradients import clipped_step, global_grad_norm  # noqa: E402
from tpflash.train.metrics import MetricsWriter, Throughput, memory_gb, peak_flops, run_summary  # noqa: E402
from tpflash.train.run_data import load_run_data  # noqa: E402
from tpflash.train.sampler import GlobalSampler  # noqa: E402
from tpflash.train.schedule import WarmupCosine  # noqa: E402
from e2e_external import fp8_module_filter  # noqa: E402
from e2e_peers import PlainLlama, compile_blocks, load_tpflash_weights  # noqa: E402

MODES = ("bf16", "torchao-tensorwise", "torchao-rowwise")
# PlainLlama's fixed choices: a config the peer cannot express is refused rather than trained differently
PLAIN_LLAMA = dict(mlp="swiglu", norm="rmsnorm", position="rotary", tie_embeddings=False, bias=False,
                   qkv_bias=None, qk_norm=False, head_dim=None, rope_scaling=None, sliding_window=None,
                   dropout=0.0, norm_eps=1e-5, rope_theta=10000.0)
SAME_LOSS_RTOL = 1e-3  # the start-up check: tpflash's and the peer's fp32 loss on the first batch


def parse_args(argv=None):
    """(the script's own arguments, the trainer's TrainConfig from --config and the other arguments)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--mode", required=True, choices=MODES)
    p.add_argument("--out", required=True, help="the run's directory: metrics.jsonl goes here")
    p.add_argument("--config", default=os.path.join(ROOT, "benchmarks", "fp8_accuracy.yaml"))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile each block and the head + loss (default: on CUDA)")
    args, overrides = p.parse_known_args(argv)
    cfg = parse_config(["--config", args.config, *overrides])  # exactly as `python -m tpflash.train` reads them
    check_values(cfg)
    cfg.log.dir = args.out  # the metrics' directory, as the trainer's --log.dir
    return args, cfg


def check_supported(cfg, data) -> None:
    """ValueError for a run the peer would not train as the trainer does: one device, token windows, and a
    model PlainLlama builds (Llama's choices, its norm eps and RoPE base)."""
    if cfg.tp != 1 or cfg.cp != 1 or cfg.dp not in (-1, 1):
        raise ValueError(f"the peer runs on one device: tp=1, cp=1, dp=1 (got tp={cfg.tp}, cp={cfg.cp}, dp={cfg.dp})")
    if data.packed:
        raise ValueError("the peer trains on token windows, not packed fine-tuning rows (data.format=jsonl)")
    if data.model_config.fp8 != "off":
        raise ValueError(f"model.fp8={data.model_config.fp8}: the peer's GEMM precision is --mode")
    got = dataclasses.asdict(data.model_config)
    wrong = {k: got[k] for k, v in PLAIN_LLAMA.items() if got[k] != v}
    if wrong:
        raise ValueError(f"PlainLlama cannot express model config {wrong}: it has "
                         f"{ {k: PLAIN_LLAMA[k] for k in wrong} }")


def build_models(cfg, model_config, device):
    """(PlainLlama holding the trainer's initial weights, the tpflash model they came from). The tpflash model
    is built as the trainer builds it at tp=1: on the meta device, given storage (to_empty), then
    GPT.init_on_device with the run's seed (the values of torch.manual_seed(seed); GPT(config) on `device`)."""
    reference = GPT(model_config, process_group=None, device=torch.device("meta"))
    reference.to_empty(device=device)
    reference.init_on_device(device, cfg.seed)
    c = model_config
    with torch.device(device):
        plain = PlainLlama(c.n_embd, c.n_layer, c.n_head, c.vocab_size, c.block_size, c.kv_heads, c.ffn_dim)
    load_tpflash_weights(plain, reference, llama=True)  # every parameter overwritten: its own init is gone
    return plain, reference


@torch.no_grad()
def check_same_loss(plain, reference, x, y) -> None:
    """Raise if the two models' fp32 losses on (x, y) differ by more than SAME_LOSS_RTOL: the peer must
    compute the tpflash model's function, or the comparison of their runs means nothing."""
    ours, theirs = reference(x, y).item(), plain(x, y).item()
    print(f"same-model check (fp32, first batch): tpflash loss {ours:.6f}, PlainLlama loss {theirs:.6f}", flush=True)
    if abs(ours - theirs) > SAME_LOSS_RTOL * abs(ours):
        raise RuntimeError(f"PlainLlama's loss {theirs} differs from the tpflash model's {ours} on the same "
                           f"weights and batch by more than {SAME_LOSS_RTOL:g} relative")


def convert(model, mode: str, compile_model: bool) -> None:
    """torchao's float8 training on the projections (torchao modes), then torch.compile (with --compile)."""
    if mode.startswith("torchao-"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        recipe = mode[len("torchao-"):]
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=fp8_module_filter)
    if compile_model:
        compile_blocks(model)
        model.head_loss = torch.compile(model.head_loss)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # through pinned memory, as the trainer: the host queues the next step while the GPU runs this one
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def first_batch(cfg, data, device):
    """The first training step's first micro-batch (what the trainer's sampler gives first)."""
    plan = build.plan_batches(cfg.train, 1)
    indices = GlobalSampler(len(data.train), cfg.seed).rank_slice(plan.batch_size, 0, 1)
    return tuple(to_device(t, device) for t in data.train.batch(indices[:plan.micro]))


class PeerRun:
    """The trainer's steps and evaluation (tpflash.train.loop.Trainer at tp=1, dp=1) on the peer model."""

    def __init__(self, cfg, data, model, device):
        self.cfg, self.model, self.device = cfg, model, device
        self.train_data, self.eval_data, self.seq_len = data.train, data.eval, data.seq_len
        self.plan = build.plan_batches(cfg.train, 1)
        self.amp_dtype = build.autocast_dtype(cfg, device)
        self.optimizer = build.make_optimizer(model, cfg.train, device)  # decay on matrices only; fused on CUDA
        t = cfg.train
        decay = t.decay_steps or max(0, t.steps - t.warmup_steps)  # as the trainer: 0 means the rest of the run
        self.schedule = WarmupCosine(self.optimizer, t.lr, t.min_lr, t.warmup_steps, decay)
        self.sampler = GlobalSampler(len(self.train_data), cfg.seed)
        self.step = 0
        # the first step whose gradient norm was not finite (-1: none), kept on the device as the trainer
        # keeps it, so that no step waits for the GPU; read at log steps, which sync anyway
        self.first_nonfinite = torch.full((), -1, dtype=torch.int64, device=device)

    def _batch(self, data, indices):
        return tuple(to_device(t, self.device) for t in data.batch(indices))

    def train_step(self) -> dict:
        """One optimizer step: {"loss": mean of the micro-batches' mean losses (tensor), "grad_norm": before
        clipping (tensor), "lr": the lr this step used}."""
        plan = self.plan
        self.model.train()
        indices = self.sampler.rank_slice(plan.batch_size, 0, 1)
        loss_sum = torch.zeros((), device=self.device)
        for i in range(plan.grad_accum):
            x, y = self._batch(self.train_data, indices[i * plan.micro:(i + 1) * plan.micro])
            with build.autocast(self.device, self.amp_dtype):
                loss = self.model(x, y)
            (loss / plan.grad_accum).backward()
            loss_sum += loss.detach().float()
        self.sampler.advance(plan.batch_size)
        norm = global_grad_norm(self.model, None, None, False, sharded_ids=set())  # nothing is tp-sharded
        lr = self.schedule.lr
        clipped_step(self.optimizer, self.model.parameters(), norm, self.cfg.train.clip)  # the trainer's clip
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        self.step += 1
        first_bad = (self.first_nonfinite < 0) & ~torch.isfinite(norm)
        self.first_nonfinite = torch.where(first_bad, self.step, self.first_nonfinite)
        return {"loss": loss_sum / plan.grad_accum, "grad_norm": norm, "lr": lr}

    def is_every(self, interval: int) -> bool:
        """Whether a periodic event (evaluation) falls after this step: not after the last one, which has its own."""
        return interval > 0 and self.step % interval == 0 and self.step < self.cfg.train.steps

    @torch.no_grad()
    def evaluate(self):
        """Mean loss over train.eval_batches batches of the held-out split, in order (Trainer.evaluate)."""
        if self.eval_data is None or len(self.eval_data) == 0 or self.cfg.train.eval_batches < 1:
            return None
        plan, n = self.plan, len(self.eval_data)
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for k in range(self.cfg.train.eval_batches):
            indices = [(k * plan.batch_size + j) % n for j in range(plan.per_rank)]
            for i in range(plan.grad_accum):
                x, y = self._batch(self.eval_data, indices[i * plan.micro:(i + 1) * plan.micro])
                with build.autocast(self.device, self.amp_dtype):
                    total += self.model(x, y).float()
        self.model.train()
        return (total / (self.cfg.train.eval_batches * plan.grad_accum)).item()


def check_finite(run: PeerRun) -> None:
    """FloatingPointError once a step's gradient norm was not finite, as the trainer stops there."""
    first = int(run.first_nonfinite.item())
    if first >= 0:
        raise FloatingPointError(f"the gradient norm was not finite at step {first} "
                                 f"(now step {run.step}): training diverged")


def train(run: PeerRun, out: MetricsWriter, meter: Throughput) -> dict:
    """Train to train.steps, logging and evaluating at the steps the trainer does (Trainer.run)."""
    cfg, last, losses = run.cfg, {}, []
    while run.step < cfg.train.steps:
        result = run.train_step()
        meter.add(run.plan.batch_size * run.seq_len)
        losses.append(result["loss"])
        if run.step % cfg.log.interval == 0 or run.step == cfg.train.steps:
            check_finite(run)
            last = {"loss": torch.stack(losses).mean().item(), "lr": result["lr"],
                    "grad_norm": result["grad_norm"].item(), "epoch": run.sampler.epoch,
                    **meter.read(), **memory_gb(run.device)}
            losses = []
            out.log(run.step, last)
        if run.is_every(cfg.train.eval_interval):
            with meter.paused(run.device):  # tokens/s is the training's own
                out.log(run.step, {"eval_loss": run.evaluate()}, kind="eval")
    with meter.paused(run.device):
        eval_loss = run.evaluate()
        if eval_loss is not None:
            last["eval_loss"] = eval_loss
            out.log(run.step, {"eval_loss": eval_loss}, kind="eval")
    return last


def main(argv=None) -> None:
    args, cfg = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    compile_model = device.type == "cuda" if args.compile is None else args.compile
    data = load_run_data(cfg, GPTConfig)  # the trainer's tokenizer, model config and train/eval split
    check_supported(cfg, data)
    model, reference = build_models(cfg, data.model_config, device)
    check_same_loss(model, reference, *first_batch(cfg, data, device))
    flops = reference.flops_per_token(data.seq_len)
    del reference  # its weights are the peer's now
    convert(model, args.mode, compile_model)
    run = PeerRun(cfg, data, model, device)  # the optimizer over the converted model's parameters
    metrics = os.path.join(args.out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)  # one run per directory (the writer appends, for the trainer's resumes)
    out = MetricsWriter(cfg.log, cfg.train.steps, 0, enabled=True)
    try:
        out.note(f"layout: peer PlainLlama --mode {args.mode} on one {device.type} device, compute dtype "
                 f"{run.amp_dtype or torch.float32}, compile {'on' if compile_model else 'off'}")
        out.note(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, seq {run.seq_len}; "
                 f"batch {run.plan.batch_size} = accum {run.plan.grad_accum} x micro {run.plan.micro}; "
                 f"{len(data.train)} train / {len(data.eval) if data.eval else 0} eval sequences")
        meter = Throughput(flops, peak_flops(cfg.log, device), 1)
        last = train(run, out, meter)
        out.summary(run.step, *run_summary(cfg, meter, 0, run.step, -1, last, device))
    finally:
        out.close()


if __name__ == "__main__":
    main()
