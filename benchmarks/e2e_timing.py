"""Timing one configuration's training step for benchmarks/bench_e2e.py: the median of steps timed
between two syncs (an isolated step), the mean with the host one step ahead (as tpflash's trainer
runs), the SM clock and power over both, and optionally a profile and a cProfile of one step."""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import time

import torch
from e2e_profile import profile_exposed_comm
from e2e_telemetry import GpuTelemetry


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:120] if text else ''}"


def time_steps(loss_fn, step_context, opt, args, ps):
    """(median seconds per optimizer step after warm-up, the losses: {"start": the first step's, before
    any update, "last": the last timed step's, "finite": whether every step's was}, extra)."""
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
        losses.append(float(_full(one_step())))  # not timed: the sync costs nothing here
    # the clock and power over the timed steps: a GPU at its power cap runs its GEMMs slower (e2e_telemetry)
    telemetry = GpuTelemetry(ps.device.index if ps.device.type == "cuda" else -1)
    with telemetry if ps.device.type == "cuda" and not args.no_telemetry else contextlib.nullcontext():
        for _ in range(args.steps):
            sync(ps.device)
            t0 = time.perf_counter()
            loss = one_step()
            t_host = time.perf_counter()  # the host has issued the whole step (no sync on the way)
            sync(ps.device)
            times.append(time.perf_counter() - t0)
            host.append(t_host - t0)
            losses.append(float(_full(loss)))
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
            extra["note"] = f"profile failed: {describe(exc)[:60]}"
    if args.cprofile:
        python_profile(one_step, ps, args.cprofile)
    summary = {"start": losses[0], "last": losses[-1], "finite": all(math.isfinite(v) for v in losses)}
    return statistics.median(times), summary, extra


def _full(loss: torch.Tensor) -> torch.Tensor:
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def one_step_ahead_s(one_step, steps: int, device) -> float:
    """Mean seconds per step over `steps` steps where the host may issue a step while the GPU still runs
    the one before (it waits only for the step before that), as tpflash's trainer runs them over
    several processes (one process may run further ahead): a host-bound eager forward then overlaps
    the previous step's backward and optimizer. time_steps's synced median is what one isolated
    step costs."""
    sync(device)
    t0, previous = time.perf_counter(), None
    for _ in range(steps):
        one_step()
        done = torch.cuda.Event()
        done.record()
        if previous is not None:
            previous.synchronize()
        previous = done
    sync(device)
    return (time.perf_counter() - t0) / steps


def _trace_path(args, ps) -> str:
    if not args.trace_dir:
        return ""
    os.makedirs(args.trace_dir, exist_ok=True)
    label = getattr(args, "trace_label", "")  # model and impl: configurations of one launch do not overwrite each other
    return os.path.join(args.trace_dir, f"trace_{label + '_' if label else ''}tp{ps.tp_size}_rank{ps.rank}.json")


def python_profile(run_step, ps, top: int) -> None:
    """One step under cProfile (every rank runs the step; rank 0 prints), synchronised at the end so
    that host time spent waiting on the device shows up where it happens."""
    import cProfile
    import pstats
    prof = cProfile.Profile() if ps.rank == 0 else None
    sync(ps.device)
    if prof is not None:
        prof.enable()
    run_step()
    sync(ps.device)
    if prof is not None:
        prof.disable()
        for key in ("tottime", "cumulative"):
            print(f"[cprofile] one step, by {key}:", flush=True)
            pstats.Stats(prof).sort_stats(key).print_stats(top)
