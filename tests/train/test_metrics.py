"""Throughput: tokens/s over the training's own time, evaluation and checkpoints left out."""
import torch

from tpflash.train import metrics


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_throughput_leaves_paused_time_out_of_the_rate(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    meter = metrics.Throughput(flops_per_token=6.0, peak=100.0, world=2)
    meter.add(1000)
    clock.now += 1.0  # training
    with meter.paused(torch.device("cpu")):
        clock.now += 5.0  # an evaluation
    clock.now += 1.0  # training
    meter.add(1000)
    out = meter.read()
    assert out["tokens_per_s"] == 1000.0  # 2000 tokens over 2 s of training, not over 7 s
    assert out["tokens_per_s_per_gpu"] == 500.0  # the job's rate over its 2 devices
    assert out["mfu"] == 1000.0 * 6.0 / (100.0 * 2)


def test_throughput_read_starts_a_new_interval(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    meter = metrics.Throughput(flops_per_token=0.0, peak=0.0, world=1)
    with meter.paused():
        clock.now += 3.0
    meter.add(10)
    clock.now += 1.0
    assert meter.read() == {"tokens_per_s": 10.0, "tokens_per_s_per_gpu": 10.0}
    meter.add(40)
    clock.now += 2.0
    assert meter.read() == {"tokens_per_s": 20.0, "tokens_per_s_per_gpu": 20.0}  # the pause belonged to the last interval only
