"""The training loop: build a run from a TrainConfig, resume it, train, evaluate, checkpoint.

One `Trainer` per process (torchrun starts dp*tp of them). Every rank builds the same model
from the same seed (tp layers take their slice of one initialisation), reads its dp slice of
each global batch (tpflash.train.sampler), and steps its own shards of the optimizer state.
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

from .. import parallel
from ..checkpoint import directory
from ..kernels import gemm_workspace
from ..kernels.fp8 import check_fp8_device
from . import build, packing, watchdog
from .fingerprint import job_fingerprint
from .config import TrainConfig, check_values
from .run_checkpoints import RunCheckpoints
from .run_data import load_run_data
from .data import make_tokenizer
from .faults import Fault, StopSignal
from .gradients import clipped_step, global_grad_norm, tp_sharded_param_ids
from .metrics import MetricsWriter, Throughput, check_logging, finish, memory_gb, peak_flops, start_warnings
from .sampler import GlobalSampler
from .schedule import WarmupCosine
from .trace import StepTracer


class Trainer:
    """A training run. `config_cls`/`model_cls` default to tpflash.models.GPTConfig/GPT (tests pass
    stand-ins with the same interface: model(idx, targets) -> loss, process_group=, device=)."""

    def __init__(self, cfg: TrainConfig, config_cls=None, model_cls=None):
        self.cfg = cfg
        check_values(cfg)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dp = parallel.check_layout(world, cfg.tp, cfg.dp, cfg.cp)
        self.gemm_workspace = gemm_workspace.apply(cfg.gemm_workspace, cfg.tp)  # before the process's first GEMM (CUDA)
        self.plan = build.plan_batches(cfg.train, dp)
        check_logging(cfg.log)
        if config_cls is None or model_cls is None:
            from ..models import GPT, GPTConfig
            config_cls, model_cls = config_cls or GPTConfig, model_cls or GPT
        data = load_run_data(cfg, config_cls)  # before any process group: bad data or config raise on every rank
        self.packed, self._tokenizer, self.model_config, self.seq_len = (data.packed, data.tokenizer,
                                                                         data.model_config, data.seq_len)
        self.train_data, self.eval_data, self.entropy, self.data_notes = data.train, data.eval, data.entropy, data.notes
        build.check_context_parallel(cfg, self.model_config, self.seq_len, self.packed, model_cls)
        fingerprint = job_fingerprint(cfg, self.model_config, self.train_data.tokens,
                                      self.eval_data.tokens if self.eval_data else None)
        self.trace_prefix = watchdog.flight_recorder_setup(cfg.log.dir, torch.cuda.is_available())  # before NCCL exists
        self.ps = parallel.init(tp=cfg.tp, dp=dp, agree=fingerprint, cp=cfg.cp,  # every rank runs this same job, or all raise
                                timeout_s=watchdog.group_timeout(cfg.dist.long, cfg.dist.timeout))
        self.checkpoints = RunCheckpoints(cfg)  # one job per checkpoint.dir: every rank raises if it is taken
        self.device = self.ps.device
        self.is_main = dist.get_rank() == 0
        self.amp_dtype = build.autocast_dtype(cfg, self.device)
        check_fp8_device(getattr(self.model_config, "fp8", "off"), self.device)  # every rank alike, before the model
        self._build_model(model_cls, dp)
        self.optimizer = build.make_optimizer(self.model, cfg.train, self.device)
        t = cfg.train
        decay = t.decay_steps or max(0, t.steps - t.warmup_steps)
        self.schedule = WarmupCosine(self.optimizer, t.lr, t.min_lr, t.warmup_steps, decay)
        self.sampler = GlobalSampler(len(self.train_data), cfg.seed)
        self.step = 0
        self.fault = Fault(dist.get_rank(), dist.get_world_size())
        # a rank that waits too long for the others fails the job naming who did not arrive (watching in run())
        self.watch = watchdog.HangWatch(cfg.dist.timeout, cfg.dist.long, watchdog.trainer_groups(self.ps),
                                        self.trace_prefix, on_exit=[self.checkpoints.release])
        # the first step whose gradient norm was not finite (-1: none): kept on the device, so that no
        # step waits for the GPU; read where the loop syncs anyway (log steps) and before every save
        self._first_nonfinite = torch.full((), -1, dtype=torch.int64, device=self.device)
        self.changed_settings = []  # the optimizer settings the config changed against the checkpoint
        self.resumed_from = self._resume()
        # after loading: the graphs replay on the parameter tensors they were captured with
        graph_params = self.zero3.graph_sync().graph_params() if self.zero3 is not None else None
        self.cuda_graphs, self.cuda_graphs_why = build.use_cuda_graphs(cfg, self.model, self.device, self.ps.dp_size,
                                                                       self.dp_mode, graph_params)
        if self.cuda_graphs:
            self._capture_cuda_graphs()
        # replicated over dp (x cp): the training forward goes through DDP, whose backward all-reduces the
        # gradients bucket by bucket as they become ready (None under FSDP or zero1, or at dp=1)
        replicated = self.dp_mode == "off" and self.ps.dp_cp_size > 1
        self.ddp = parallel.replicate_over_dp(self.model, self.ps) if replicated else None
        self._train_forward = self.model if self.ddp is None else self.ddp

    def _capture_cuda_graphs(self) -> None:
        """Capture the blocks at the micro-batch shape; under zero1 with one micro-batch per step the
        graphs also carry the dp reduce-scatters and all-gathers of the blocks' weights, overlapped
        with the blocks (tpflash.parallel.zero_graphs; with accumulation they stay after the backward);
        under zero3 they always do (tpflash.parallel.zero3)."""
        if self.zero3 is not None:  # its gathers and reductions are always in the graphs
            with build.autocast(self.device, self.amp_dtype):
                self.zero3.capture_cuda_graphs(self.model, self.plan.micro, self.seq_len)
            return
        sync = None
        if self.zero is not None and self.plan.grad_accum == 1 and self.ps.dp_cp_size > 1:
            sync = self.zero.sync_in_graphs(self.model.blocks)
        with build.autocast(self.device, self.amp_dtype):
            if self.zero is None and getattr(self.model_config, "fp8", "off") == "delayed":  # the first batch's
                # amaxes recorded, so that the first step replays the graphs too (GPT.prime_fp8_scaling)
                indices = self.sampler.rank_slice(self.plan.batch_size, self.ps.dp_rank, self.ps.dp_size)
                x, y, kwargs = self._micro_batch(self.train_data, indices[:self.plan.micro])
                self.model.prime_fp8_scaling(x, y, **kwargs)
            # accumulating micro-batches, the weight-gradient GEMMs add into the gradients; not under DDP
            # (set up after this), whose hooks must see each gradient, nor zero1, whose gradients are views
            # of its own flat buffers
            replicated = self.dp_mode == "off" and self.ps.dp_cp_size > 1
            accumulate = self.plan.grad_accum > 1 and not replicated and self.zero is None
            self.model.capture_cuda_graphs(self.plan.micro, self.seq_len, accumulate_grads=accumulate,
                                           **({"dp_sync": sync} if sync else {}))
        if sync is not None:
            self.zero.use_graph_sync(sync)

    def _fp8_saturations(self) -> Dict[str, int]:
        """Under fp8="delayed": this rank's casts clamped since the last log, by operand
        (fp8_saturated_x/w/dy; tpflash.layers.fp8_history); else nothing."""
        history = getattr(self.model, "fp8_history", None)
        return {} if history is None else {f"fp8_saturated_{k}": n for k, n in history.saturations().items()}

    def _parameters_ready(self) -> None:
        """Before reading the parameters outside a training step (evaluation, samples, checkpoints): under
        zero1 in graphs the blocks' weights may still be gathering on a side stream."""
        if self.zero is not None:
            self.zero.wait_for_parameters()

    def _build_model(self, model_cls, dp: int) -> None:
        """The model on this rank's device: built on the meta device, sharded over dp if the layout says
        so (FSDP2, zero3), and only then given storage and its values: each rank's slices of the Hugging
        Face weights with init_from (tpflash.models.pretrained), else the seeded init module by module
        (GPT.init_on_device: the values a whole-model build from the seed gives, on every layout). No
        rank ever holds the whole model. A model class without init_on_device is built whole, seeded."""
        self.init_from = self.cfg.model.get("init_from") or None
        on_meta = bool(self.init_from) or hasattr(model_cls, "init_on_device")
        if on_meta:
            self.model = model_cls(self.model_config, process_group=None, device=torch.device("meta"),
                                   **build.context_parallel_kwargs(self.cfg))
        else:
            torch.manual_seed(self.cfg.seed)  # identical on every rank: tp shards are slices of one init
            self.model = model_cls(self.model_config, process_group=None, device=self.device,
                                   **build.context_parallel_kwargs(self.cfg))
        if self.init_from:
            from ..models import pretrained
            hf_files = pretrained.HFFiles(self.init_from)
            pretrained.check_files(self.model, hf_files)  # before the first collective: every rank raises alike
        self.sharded_ids = tp_sharded_param_ids(self.model)  # before FSDP swaps parameters
        # the dp x cp ranks hold the same parameters: FSDP (or zero1) shards over them all
        local_params, memory = build.agreed_fsdp_inputs(self.model, self.ps)
        self.dp_mode, self.dp_mode_why = build.fsdp_choice(
            self.cfg.fsdp, dp * self.cfg.cp, local_params, memory,
            zero3_blocker=build.zero3_blocker(self.cfg, self.model, self.device))
        if self.dp_mode == "on":
            parallel.apply_fsdp(self.model, self.ps)
            self.sharded_ids = tp_sharded_param_ids(self.model)
        # zero3: every parameter becomes a DTensor shard (the blocks' gathered into static slots); on the
        # meta device too, so that init_from fills the shards and no rank holds the whole model
        self.zero3 = None
        if self.dp_mode == "zero3":
            self.zero3 = parallel.shard_blocks(self.model, self.ps, compute_dtype=self.amp_dtype)
            self.sharded_ids = tp_sharded_param_ids(self.model)
        if on_meta:
            if self.zero3 is not None:  # the blocks' masters have their storage already
                parallel.materialize_outside_blocks(self.model, self.device)
            else:
                self.model.to_empty(device=self.device)
            self.sharded_ids = tp_sharded_param_ids(self.model)  # to_empty may have swapped the parameters
            if self.init_from and not self.checkpoints.resume_point():  # a resumed run has trained past these
                self.checkpoints.load_hf(self.model, self.init_from, hf_files)  # weights; load fills all
            elif not self.init_from:  # the seeded values (a resume overwrites them; the draws keep the RNG's state)
                self.model.init_on_device(self.device, self.cfg.seed)
        # zero1: the parameters move into flat buffers (same Parameter objects) before the optimizer,
        # the checkpoint load (in place) and the graph capture (which keeps their addresses)
        self.zero = parallel.ShardedOptimizerState(self.model, self.ps) if self.dp_mode == "zero1" else None

    # ---------------------------------------------------------------- checkpoints
    def _resume(self) -> Optional[Dict]:
        path = self.checkpoints.resume_point()
        if path is None:
            return None
        configured = build.optimizer_settings(self.optimizer)  # the config's; the checkpoint gives moments and step
        owned = self.zero.owned_names if self.zero is not None else None  # zero1: only this rank's state
        info = self.checkpoints.load(path, self.model, self.optimizer, optimizer_state_of=owned,
                                     scheduler=self.schedule, data=self.sampler)
        self.changed_settings = build.restore_optimizer_settings(self.optimizer, configured)
        self.step = int(info["step"])
        if self.schedule.step_count != self.step:
            raise ValueError(f"checkpoint step {self.step} disagrees with its scheduler step {self.schedule.step_count}")
        return info

    def check_finite(self) -> None:
        """Raise FloatingPointError if any step so far had a non-finite gradient norm (the norm is
        global, so every rank raises at the same call and none waits in a collective)."""
        first = int(self._first_nonfinite.item())
        if first < 0:
            return
        saved = self.checkpoints.saved_step
        last = (f"the newest checkpoint is step {saved}" if saved >= 0
                else "no checkpoint was written")
        raise FloatingPointError(
            f"the gradient norm was not finite at step {first} (now step {self.step}): training diverged or its "
            f"input was bad; nothing after it is saved, and {last}. Resume from there with a lower train.lr, "
            f"a smaller train.clip or more train.warmup_steps")

    def save(self, final: bool = True) -> None:
        """Write a checkpoint of the current step (collective: every rank calls it). With
        checkpoint.async_save a non-final save returns once its tensors are staged in host memory.
        A state reached through a non-finite gradient is never saved (check_finite raises)."""
        if not self.cfg.checkpoint.dir or self.checkpoints.saved_step == self.step:
            return
        self.watch.enter("save")
        self.check_finite()
        self._parameters_ready()
        self.checkpoints.save(self.step, self.model, self.optimizer, final, self.fault, scheduler=self.schedule,
                              data=self.sampler, saved_tp=self.ps.tp_size, saved_dp=self.ps.dp_size)

    def export_hf(self) -> Optional[str]:
        """Write the model as a Hugging Face directory to checkpoint.export_hf (collective; tokenizer files
        from init_from when set). Returns the directory, or None when export_hf is not set."""
        if not self.cfg.checkpoint.export_hf:
            return None
        self.watch.enter("export")
        self.check_finite()
        self._parameters_ready()
        return self.checkpoints.export_hf(self.step, self.model, self.init_from)

    # ---------------------------------------------------------------- steps
    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        # through pinned memory: a copy from pageable memory may wait for the GPU's queue to drain,
        # and the host is meant to issue this step while the GPU still runs the last (StopSignal)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _micro_batch(self, data, indices):
        """(inputs [micro, seq], targets [micro, seq], further forward kwargs) of samples `indices`, on
        the device; packed rows add their documents' positions and offsets and ask for summed losses."""
        if not self.packed:
            x, y = data.batch(indices)
            return self._to_device(x), self._to_device(y), {}
        b = data.batch(indices)
        return self._to_device(b.inputs), self._to_device(b.targets), packing.forward_kwargs(b, self._to_device)

    def _loss_divisor(self, data, global_indices):
        """What each micro-batch's loss is divided by before its backward. Token windows: grad_accum
        (the step's loss is the mean of its micro-batches' mean losses). Packed rows, whose losses are
        summed: the loss-carrying tokens of the whole global batch (every dp rank's, every micro-batch's:
        counted from the data, which every rank holds, so no collective), divided by dp because DDP and
        FSDP average the gradients over dp where their sum is wanted. global_indices() gives the batch."""
        if not self.packed:
            return self.plan.grad_accum
        return data.loss_tokens(global_indices()) / self.ps.dp_size

    def train_step(self) -> Dict[str, torch.Tensor]:
        """One optimizer step over the next global batch: {"loss": this rank's loss (tensor: the mean
        of its micro-batches' means; packed rows: its summed loss over the global batch's loss tokens,
        times dp, so that the mean over dp is the global mean), "grad_norm": the global norm before
        clipping (tensor), "lr": the lr this step used}."""
        plan, ps = self.plan, self.ps
        self.watch.begin_step(self.step + 1)
        self.model.train()
        indices = self.sampler.rank_slice(plan.batch_size, ps.dp_rank, ps.dp_size)  # [per_rank]
        divisor = self._loss_divisor(self.train_data, lambda: self.sampler.indices(self.sampler.consumed,
                                                                                   plan.batch_size))
        loss_sum = torch.zeros((), device=self.device)
        for i in range(plan.grad_accum):
            x, y, kwargs = self._micro_batch(self.train_data, indices[i * plan.micro:(i + 1) * plan.micro])
            self.watch.enter("forward")
            with self._gradient_sync(i == plan.grad_accum - 1):
                with build.autocast(self.device, self.amp_dtype):
                    loss = self._train_forward(x, y, **kwargs)
                self.watch.enter("backward")
                (loss / divisor).backward()
            loss_sum += loss.detach().float()
        self.sampler.advance(plan.batch_size)
        if self.zero3 is not None:  # its reductions run on a side stream
            self.zero3.wait_for_gradients()
        if self.zero is not None:  # each rank's own parameters' gradients, averaged over dp
            self.watch.enter("gradients")
            self.zero.reduce_gradients()
        self.watch.enter("norm")
        params = self.model.parameters() if self.zero is None else self.zero.owned_params
        norm = global_grad_norm(self.model, ps.tp_group, ps.dp_cp_group, self.dp_mode != "off", self.sharded_ids,
                                params=params)
        first_bad = (self._first_nonfinite < 0) & ~torch.isfinite(norm)
        self._first_nonfinite = torch.where(first_bad, self.step + 1, self._first_nonfinite)
        lr = self.schedule.lr
        self.watch.enter("optimizer")
        if self.zero is None:
            clipped_step(self.optimizer, self.model.parameters(), norm, self.cfg.train.clip)
            self.optimizer.zero_grad(set_to_none=True)
            if self.zero3 is not None:  # the blocks' gradients are its buffers again, zeroed
                self.zero3.new_step()
        else:  # the step on the owned parameters, then every rank's updated ones gathered in place
            self.zero.step(lambda: clipped_step(self.optimizer, params, norm, self.cfg.train.clip))
            self.zero.zero_grad()
        self.schedule.step()
        self.step += 1
        return {"loss": loss_sum / divisor, "grad_norm": norm, "lr": lr}

    def _gradient_sync(self, last_micro_batch: bool):
        """The context of one micro-batch's forward and backward: gradients are reduced over dp only in
        the last one's backward (FSDP: reduce-scatter; replicated: DDP's all-reduce)."""
        if self.dp_mode in ("on", "zero3") and hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2's units
            self.model.set_requires_gradient_sync(last_micro_batch)
        if self.ddp is not None and not last_micro_batch:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def _dp_mean(self, value: torch.Tensor) -> float:
        value = value.detach().float().clone()
        if self.ps.dp_size > 1:
            dist.all_reduce(value, group=self.ps.dp_group)
            value /= self.ps.dp_size
        return value.item()

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        """Mean loss over `train.eval_batches` global batches of the held-out split (in order)."""
        if self.eval_data is None or len(self.eval_data) == 0 or self.cfg.train.eval_batches < 1:
            return None
        plan, ps = self.plan, self.ps
        self._parameters_ready()
        self.model.eval()
        total = torch.zeros((), device=self.device)
        n = len(self.eval_data)
        for k in range(self.cfg.train.eval_batches):
            self.watch.enter("eval")
            start = k * plan.batch_size + ps.dp_rank * plan.per_rank
            indices = [(start + j) % n for j in range(plan.per_rank)]
            for i in range(plan.grad_accum):
                x, y, kwargs = self._micro_batch(self.eval_data, indices[i * plan.micro:(i + 1) * plan.micro])
                with build.autocast(self.device, self.amp_dtype):
                    total += self.model(x, y, **kwargs).float()
        self.model.train()
        if self.packed:  # every rank's positions, k * batch_size + j, as above: summed losses over their count
            every = np.arange(self.cfg.train.eval_batches * plan.batch_size) % n
            return self._dp_mean(total / self._loss_divisor(self.eval_data, lambda: every))
        return self._dp_mean(total / (self.cfg.train.eval_batches * plan.grad_accum))

    # ---------------------------------------------------------------- the run
    def describe(self, out: MetricsWriter) -> None:
        ps, plan = self.ps, self.plan
        params = self.model.num_params() if hasattr(self.model, "num_params") else \
            sum(p.numel() for p in self.model.parameters())
        cp = f" cp={ps.cp_size} ({self.cfg.cp_comm})" if ps.cp_size > 1 else ""
        fp8 = getattr(self.model_config, "fp8", "off")
        out.note(f"layout: tp={ps.tp_size}{cp} dp={ps.dp_size} (world {ps.world_size}, {self.device.type}), "
                 f"fsdp={self.dp_mode}{self.dp_mode_why}, compute dtype {self.amp_dtype or torch.float32}"
                 f"{'' if fp8 == 'off' else f' (fp8 {fp8} GEMMs)'}, cuda graphs {self.cuda_graphs_why}"
                 f"{'' if self.gemm_workspace is None else f', cuBLAS workspace {self.gemm_workspace}'}"
                 f"{', with the dp collectives of zero1' if self.zero is not None and self.zero.graph_sync else ''}"
                 f"{', with the dp collectives of zero3' if self.zero3 is not None and self.cuda_graphs else ''}")
        out.note(f"model: {params / 1e6:.2f}M parameters, seq {self.seq_len}; batch {plan.batch_size} = dp {plan.dp}"
                 f" x accum {plan.grad_accum} x micro {plan.micro}; {len(self.train_data)} train / "
                 f"{len(self.eval_data) if self.eval_data else 0} eval sequences")
        for note in self.data_notes:
            out.note(note)
        counted = "loss-carrying training tokens" if self.packed else "training tokens"
        out.note(f"unigram entropy of the {counted}: {self.entropy:.3f} nats/token "
                 "(a model that ignores context cannot do better)")
        if self.init_from and self.resumed_from is None:
            out.note(f"weights at step 0 from the Hugging Face model in {self.init_from}")
        if self.resumed_from is not None:
            info = self.resumed_from
            saved = f" saved at tp={info.get('saved_tp', '?')} dp={info.get('saved_dp', '?')}" if info else ""
            out.note(f"resumed from {self.cfg.checkpoint.dir} at step {self.step}{saved}; continuing at "
                     f"tp={ps.tp_size} dp={ps.dp_size}")
            if self.changed_settings:
                out.note(f"optimizer settings from this config, not the checkpoint: {'; '.join(self.changed_settings)}")

    def close(self, wait_for_device: bool = True) -> None:
        """The end of a run, before the process groups are destroyed: wait for the device's queued work
        (zero1's parameter gathers run on a side stream; not after an error, when a kernel may wait on a
        peer that never comes) and destroy the CUDA graphs, whose captured NCCL kernels hold the groups'
        communicators. After a clean end, also wait for pruned checkpoints' deletions."""
        if wait_for_device:
            directory.wait_for_deletions()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        release = getattr(self.model, "release_cuda_graphs", None)
        if release is not None:
            release()

    def _log_io(self, out: MetricsWriter) -> None:
        """Log the load, save and export records gathered so far (rank 0), background writes that
        have committed since included."""
        for step, record in self.checkpoints.take_records():
            out.log(step, record, kind="checkpoint")

    def _is_every(self, interval: int) -> bool:
        return interval > 0 and self.step % interval == 0 and self.step < self.cfg.train.steps

    def run(self) -> Dict[str, float]:
        """Train to `train.steps`, logging, evaluating and checkpointing; returns the last metrics."""
        cfg = self.cfg
        out = MetricsWriter(cfg.log, cfg.train.steps, self.step, enabled=self.is_main)
        self.describe(out)
        self._log_io(out)  # the resume's load
        for text in start_warnings(cfg):
            out.warn(text)
        first_step = self.step  # of this run (a resumed run starts past 0)
        flops = self.model.flops_per_token(self.seq_len) if hasattr(self.model, "flops_per_token") else 0.0
        meter = Throughput(flops, peak_flops(cfg.log, self.device), self.ps.world_size)
        stop = StopSignal(self.device)
        tracer = StepTracer(cfg.log.trace, cfg.log.dir, dist.get_rank(), self.device, note=out.note)
        last: Dict[str, float] = {}
        losses = []  # this rank's step losses since the last log line (tensors: no host sync per step)
        self.watch.start()
        try:
            while self.step < cfg.train.steps:
                self.fault.before_step(self.step + 1)
                with tracer.step(self.step + 1):
                    result = self.train_step()
                meter.add(self.plan.batch_size * self.seq_len)
                losses.append(result["loss"])
                self.fault.after_step(self.step)
                if self.step == first_step + 1:  # the optimizer has its state now: page-lock async buffers meanwhile
                    self.checkpoints.reserve_staging(self.model, self.optimizer)
                if self.step % cfg.log.interval == 0 or self.step == cfg.train.steps:
                    self.watch.enter("log")
                    self.check_finite()
                    last = {"loss": self._dp_mean(torch.stack(losses).mean()), "lr": result["lr"],
                            "grad_norm": result["grad_norm"].item(), "epoch": self.sampler.epoch,
                            **meter.read(), **memory_gb(self.device), **self._fp8_saturations()}
                    losses = []
                    out.log(self.step, last)
                    self._log_io(out)  # an async save that has finished writing since
                tracer.after_step(self.step)
                if self._is_every(cfg.train.eval_interval):
                    with meter.paused(self.device):  # tokens/s is the training's: eval and saves left out
                        out.log(self.step, {"eval_loss": self.evaluate()}, kind="eval")
                out.advance(self.step, {"loss": last.get("loss", float("nan"))})
                self.watch.enter("vote")
                if stop.agreed():
                    out.note(f"SIGTERM: saving step {self.step} and exiting")
                    with meter.paused(self.device):
                        self.save()
                    self._log_io(out)
                    finish(out, cfg, meter, first_step, self.step, self.checkpoints.saved_step, last, self.device)
                    return last
                if self._is_every(cfg.checkpoint.interval):
                    with meter.paused(self.device):
                        self.save(final=False)
                    self._log_io(out)
            with meter.paused(self.device):  # the summary's training time and rate leave these out too
                eval_loss = self.evaluate()
                if eval_loss is not None:
                    last["eval_loss"] = eval_loss
                    out.log(self.step, {"eval_loss": eval_loss}, kind="eval")
                self.save()
                self.export_hf()
            self._log_io(out)
            finish(out, cfg, meter, first_step, self.step, self.checkpoints.saved_step, last, self.device)
            return last
        finally:
            self.watch.close()
            tracer.close()
            stop.restore()
            out.close()
            self.checkpoints.release()

    @property
    def tokenizer(self):
        """The data's tokenizer (for token files: data.tokenizer, loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = make_tokenizer(self.cfg.data.tokenizer)
        return self._tokenizer

    def sample(self, prompt: str, max_new_tokens: int, temperature: float = 0.8, top_k: int = 40) -> str:
        """Generate from `prompt` (collective over tp; same seed on every rank, so every rank agrees)."""
        ids = np.asarray(self.tokenizer.encode(prompt), dtype=np.int64)
        idx = torch.from_numpy(ids).unsqueeze(0).to(self.device)  # [1, prompt]
        torch.manual_seed(self.cfg.seed)
        self._parameters_ready()
        self.model.eval()
        with torch.no_grad(), build.autocast(self.device, self.amp_dtype):
            out = self.model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)
        return self.tokenizer.decode(out[0].tolist())
