"""The plain-PyTorch peers that benchmarks/bench_e2e.py times tpflash against compute the same model:
loaded with tpflash's weights, they train alike (on CPU). The external peers (torchtitan, torchao,
Liger: benchmarks/e2e_external.py) are rows with a note where their package is missing, and run in the
--tiny smoke run where it is installed (CI has none of them)."""
import argparse
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_e2e import IMPLS, MODELS, build, make_optimizer, parse_args, run_config  # noqa: E402
from e2e_external import EXTERNAL, PACKAGES, layout_note, stub_datasets, skip_reason  # noqa: E402
from e2e_peers import load_tpflash_weights, plain_key  # noqa: E402
from e2e_table import table  # noqa: E402

ONE_PROCESS = SimpleNamespace(tp_size=1, dp_size=1, device=torch.device("cpu"), tp_group=None, tp_mesh=None)


def losses(model, loss_fn, args, device, steps):
    """The losses of `steps` AdamW steps on one fixed batch (as bench_e2e times it)."""
    opt = make_optimizer(model, device)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1234))
    out = []
    for _ in range(steps):
        loss = loss_fn(idx[:, :-1].to(device), idx[:, 1:].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


@pytest.mark.parametrize("model", ["tiny", "tiny-llama"])
def test_the_plain_peer_with_tpflash_weights_computes_tpflash_loss_and_gradients(model):
    shape = MODELS[model]
    llama = shape.get("family") == "llama"
    args = argparse.Namespace(vocab=512, seq=32, batch=2, dp_mode="replicate", dtype="fp32")
    torch.manual_seed(0)
    tp_model, tp_loss, _ = build("tpflash", shape, args, ONE_PROCESS)
    plain, _, _ = build("plain", shape, args, ONE_PROCESS)
    load_tpflash_weights(plain, tp_model, llama)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    ours, theirs = tp_loss(idx[:, :-1], idx[:, 1:]), plain(idx[:, :-1], idx[:, 1:])
    ours.backward()
    theirs.backward()
    assert abs(ours.item() - theirs.item()) < 1e-5
    plain_params = dict(plain.named_parameters())
    for name, p in tp_model.named_parameters():  # the gradients see what the loss at init hardly does
        g, ref = p.grad, plain_params[plain_key(name, llama)].grad
        # + an absolute floor: k's bias gets no gradient (a shift of every score by q . b_k), only noise
        assert (g - ref).norm() <= 1e-4 * ref.norm() + 1e-8, name


def test_the_plain_peer_with_tpflash_weights_trains_like_tpflash():
    shape = MODELS["tiny-llama"]
    args = argparse.Namespace(vocab=512, seq=32, batch=2, dp_mode="replicate", dtype="fp32")
    torch.manual_seed(0)
    tp_model, tp_loss, _ = build("tpflash", shape, args, ONE_PROCESS)
    plain, _, _ = build("plain", shape, args, ONE_PROCESS)
    load_tpflash_weights(plain, tp_model, llama=True)
    ours, theirs = (losses(m, fn, args, ONE_PROCESS.device, 3) for m, fn in ((tp_model, tp_loss), (plain, plain)))
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-5, (ours, theirs)


def test_tpflash_keys_map_onto_the_plain_peers_names():
    assert plain_key("blocks.3.attn.k_proj.weight", llama=True) == "blocks.3.attn.k.weight"
    assert plain_key("blocks.0.mlp.gate_proj.weight", llama=True) == "blocks.0.mlp.gate.weight"
    assert plain_key("blocks.0.mlp.up_proj.bias", llama=False) == "blocks.0.fc.bias"
    assert plain_key("final_norm.weight", llama=False) == "norm.weight"


# ---- the external peers (benchmarks/e2e_external.py): torchtitan, torchao, Liger ----------------------

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_e2e.py")
SOLO = SimpleNamespace(**vars(ONE_PROCESS), dp_rank=0, rank=0)


def hide(monkeypatch, package):
    """Make `package` (and whatever of it is imported already) fail to import, as where it is absent."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")] + [package]:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("impl", EXTERNAL)
def test_a_missing_peer_package_is_a_row_with_a_note(monkeypatch, impl):
    hide(monkeypatch, PACKAGES[impl][0])
    row = run_config("tiny-llama", impl, parse_args(["--tiny", "--models", "tiny-llama"]), SOLO)
    assert row["note"] == f"{PACKAGES[impl][0]} not installed (see scripts/gpu_wheels.sh)"
    assert "error" not in row and "tok_s_gpu" not in row
    assert f"| {impl} | 1x1 |  |" in table([row], IMPLS, {})


def layout(tp: int, dp: int) -> SimpleNamespace:
    return SimpleNamespace(**{**vars(SOLO), "tp_size": tp, "dp_size": dp})


def test_the_peers_run_llama_models_torchtitan_at_any_layout_the_others_on_one_gpu():
    shape = MODELS["tiny-llama"]  # 4 heads, 2 kv heads
    for impl in EXTERNAL:
        assert skip_reason(impl, MODELS["tiny"], SOLO).startswith("Llama models only")
        for tp, dp in ((2, 1), (1, 2), (2, 2)):
            reason = skip_reason(impl, shape, layout(tp, dp)) or ""
            if impl.startswith("torchtitan"):  # run, or a note on its package (CI has none)
                assert not reason.startswith(("run on one GPU", "tp=")), (impl, tp, dp, reason)
            else:
                assert reason.startswith("run on one GPU"), (impl, tp, dp, reason)
    for tp in (3, 4):  # 3 divides neither head count, 4 not the 2 kv heads
        assert skip_reason("torchtitan", shape, layout(tp, 1)).startswith(f"tp={tp} must divide the heads")


def test_a_torchtitan_row_says_its_layout():
    bf16 = argparse.Namespace(dtype="bf16")
    assert layout_note("torchtitan", layout(1, 1), bf16) is None
    assert layout_note("torchtitan", layout(2, 2), bf16) == "torchtitan FSDP2 dp_shard=2 x TP 2"
    assert layout_note("torchtitan-fp8", layout(1, 4), bf16) == "torchtitan FSDP2 dp_shard=4"
    assert layout_note("torchtitan", layout(2, 1), argparse.Namespace(dtype="fp32")) == "torchtitan TP 2"
    assert layout_note("torchtitan", layout(2, 1), bf16).startswith("torchtitan TP 2 (fp32: ")  # its trainer's
    assert layout_note("liger", layout(1, 2), bf16) is None


def test_the_torchtitan_loss_reports_the_local_mean_with_torchtitans_gradients():
    """Over dp ranks torchtitan divides the local loss sum by the global token count (FSDP then sums
    the gradients); the row reports this rank's mean loss, as the other rows do."""
    from e2e_external import _local_mean_of_global_loss
    for dp in (1, 2, 4):
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        loss = _local_mean_of_global_loss((x * x).sum(), 6, dp)
        loss.backward()
        assert loss.item() == pytest.approx(14 / 6)
        assert torch.allclose(x.grad, 2 * x.detach() / (6 * dp))


def test_torchtitan_builds_llama_1b_with_its_swiglu_width():
    stub_datasets()  # what e2e_external does before importing torchtitan
    pytest.importorskip("torchtitan.models.llama3")
    from e2e_external import torchtitan_args
    from torchtitan.models.llama3 import Transformer
    with torch.device("meta"):
        model = Transformer(torchtitan_args(MODELS["llama-1b"], argparse.Namespace(vocab=32000, seq=2048)))
    assert model.layers["0"].feed_forward.w1.out_features == 5632
    assert model.model_args.multiple_of == 256 and model.model_args.ffn_dim_multiplier is None
    assert model.layers["0"].attention.wk.out_features == 4 * 64 and len(model.layers) == 22


def smoke(tmp_path, impls):
    """The rows of `python benchmarks/bench_e2e.py --tiny --models tiny-llama --impls IMPLS`."""
    results = tmp_path / "rows.jsonl"
    run = subprocess.run([sys.executable, SCRIPT, "--tiny", "--models", "tiny-llama", "--impls", impls,
                          "--results", str(results)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return {row["impl"]: row for row in map(json.loads, results.read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.parametrize("package, impls", [
    (None, "plain,tpflash-graphs,tpflash-fp8-rowwise,tpflash-fp8-tensorwise,tpflash-fp8-delayed,liger,liger-compile"),
    ("torchao.float8", "plain,torchao-fp8-compile,torchao-fp8-tensorwise-compile"),
    ("torchtitan", "torchtitan,torchtitan-fp8")])
def test_the_tiny_smoke_run_times_the_fp8_rows_and_the_peers(tmp_path, package, impls):
    if package == "torchtitan":
        stub_datasets()
    if package:
        pytest.importorskip(package)
    rows = smoke(tmp_path, impls)
    for impl in impls.split(","):
        row = rows[impl]
        assert "error" not in row, row
        if impl.startswith("liger") or impl == "torchtitan-fp8":  # on CPU: Triton kernels, SM 8.9+ fp8 GEMMs
            assert "tok_s_gpu" not in row and (row["note"].startswith("needs CUDA") or "not installed" in row["note"])
            continue
        assert row["tok_s_gpu"] > 0 and math.isfinite(row["loss"]), row
        if impl.startswith(("torchao", "tpflash-fp8")):  # same init and data as the bf16 row: close losses
            reference = rows["plain" if impl.startswith("torchao") else "tpflash-graphs"]["loss"]
            assert abs(row["loss"] - reference) < 0.02, (row, reference)


def test_torchtitan_fp8_converts_its_projections_but_not_the_output(monkeypatch):
    """torchtitan refuses fp8 without an SM 8.9+ GPU; told it has one, its converter, compile and a
    training step run on CPU (torch's CPU _scaled_mm)."""
    stub_datasets()
    pytest.importorskip("torchtitan.models.llama3")
    pytest.importorskip("torchao.float8")
    import torchtitan.components.quantization.float8 as float8
    from e2e_external import build as build_external
    monkeypatch.setattr(float8, "has_cuda_capability", lambda *args: True)
    args = argparse.Namespace(vocab=512, seq=32, batch=2, dtype="fp32")
    torch.manual_seed(0)
    model, loss_fn, _ = build_external("torchtitan-fp8", MODELS["tiny-llama"], args, ONE_PROCESS)
    block = model.layers["0"]._orig_mod  # compiled per block, as torchtitan's apply_compile does
    assert type(block.attention.wq).__name__ == "Float8Linear" and type(model.output) is torch.nn.Linear
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    loss = loss_fn(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert math.isfinite(loss.item()) and block.feed_forward.w2.weight.grad is not None


def liger_against_plain(device: str) -> tuple:
    """(plain's loss, liger's loss, the worst relative gradient difference) from one seed and batch."""
    run_on = SimpleNamespace(**{**vars(ONE_PROCESS), "device": torch.device(device)})
    args = argparse.Namespace(vocab=512, seq=64, batch=2)
    models = []
    for impl in ("plain", "liger"):
        torch.manual_seed(0)  # the same init: liger is the plain Llama with Liger's kernels
        models.append(build(impl, MODELS["tiny-llama"], args, run_on)[0])
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    idx = idx.to(device)
    losses = [m(idx[:, :-1], idx[:, 1:]) for m in models]
    for loss in losses:
        loss.backward()
    worst = max(((p.grad - q.grad).norm() / p.grad.norm()).item()
                for p, q in zip(models[0].parameters(), models[1].parameters()))
    return losses[0].item(), losses[1].item(), worst


def print_liger_against_plain_in_the_interpreter() -> None:
    """liger_against_plain on CPU under TRITON_INTERPRET=1: Liger's RoPE and fused linear cross-entropy
    kernels run in Triton's interpreter; its RMSNorm and SiLU-mul kernels do not run there (liger 0.8.5,
    Triton 3.9), so references stand in for them: this checks how the peer wires Liger's pieces in."""
    import torch.nn.functional as F
    import liger_kernel.ops
    import liger_kernel.transformers.rms_norm as rms_norm

    def rms(x, weight, eps, *modes):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    liger_kernel.ops.LigerSiLUMulFunction = SimpleNamespace(apply=lambda a, b: F.silu(a) * b)
    rms_norm.LigerRMSNormFunction = SimpleNamespace(apply=rms)
    print(json.dumps(liger_against_plain("cpu")))


@pytest.mark.slow
def test_the_liger_peer_wires_in_ligers_kernels_like_the_plain_peer_on_cpu():
    pytest.importorskip("liger_kernel.transformers")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import tests.test_bench_peers as t; t.print_liger_against_plain_in_the_interpreter()"
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    plain, liger, worst = json.loads(run.stdout.strip().splitlines()[-1])
    assert abs(plain - liger) < 1e-5 and worst < 1e-5, (plain, liger, worst)


@pytest.mark.gpu
def test_the_liger_peer_computes_the_plain_peers_loss_and_gradients():
    """On CUDA with every Liger kernel (fp32)."""
    pytest.importorskip("liger_kernel.transformers")
    plain, liger, worst = liger_against_plain("cuda")
    assert abs(plain - liger) < 1e-4 and worst < 1e-3, (plain, liger, worst)


def test_a_row_whose_loss_is_not_finite_is_a_failed_row_never_a_speed(monkeypatch):
    import bench_e2e
    real = bench_e2e.time_steps

    def nan_loss(*args, **kwargs):
        step_s, losses, extra = real(*args, **kwargs)
        return step_s, {**losses, "last": float("nan"), "finite": False}, extra

    monkeypatch.setattr(bench_e2e, "time_steps", nan_loss)
    row = run_config("tiny", "tpflash", parse_args(["--tiny"]), SOLO)
    assert "tok_s_gpu" not in row and "step_ms" not in row
    assert row["error"].startswith("FloatingPointError: loss not finite"), row["error"]
    assert "error: FloatingPointError: loss not finite" in table([row], IMPLS, {})


def test_a_graphed_row_releases_its_cuda_graphs_before_the_next_row(monkeypatch):
    """Graphs that captured NCCL kernels make destroying the process groups wait forever: each row frees
    its own, failed or not."""
    from tpflash.models import GPT
    released = []
    real = GPT.release_cuda_graphs
    monkeypatch.setattr(GPT, "release_cuda_graphs", lambda self: (released.append(self._graphed_blocks), real(self)))
    row = run_config("tiny", "tpflash-graphs", parse_args(["--tiny"]), SOLO)
    assert "tok_s_gpu" in row, row
    assert len([graphs for graphs in released if graphs is not None]) == 1  # (capture releases none first)


def test_the_table_gives_each_rows_first_and_last_loss_and_the_bf16_rows_beside_fp8():
    common = dict(model="llama-1b", tp=1, dp=1, tok_s_gpu=1.0, mfu=0.5, step_ms=1.0, peak_gib=1.0)
    rows = [dict(common, impl="tpflash-graphs", loss_start=10.4, loss=9.25),
            dict(common, impl="tpflash-fp8-tensorwise", loss_start=10.4, loss=9.43)]
    text = table(rows, IMPLS, {}, {"tpflash-fp8-tensorwise": "tpflash-graphs"})
    assert "| loss 10.400 -> 9.250 |" in text
    assert "loss 10.400 -> 9.430 (tpflash-graphs: 9.250)" in text


def test_a_memory_cap_needs_cuda_and_a_size_within_the_gpu():
    from bench_e2e import _cap_memory
    with pytest.raises(ValueError, match="--memory-limit-gib 76: a memory cap needs CUDA devices"):
        _cap_memory(torch.device("cpu"), 76)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="must be above 0 and at most"):
            _cap_memory(torch.device("cuda"), 1e6)


# ---- the fp8 accuracy peer (benchmarks/fp8_accuracy_peer.py): the trainer's run on the plain Llama -------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a tiny model of benchmarks/fp8_accuracy.yaml's family; a short warmup and a high lr, so that six steps
# move the weights enough for a wrong optimizer, schedule or clip to show in the losses
TINY_ACCURACY_RUN = ["--config", os.path.join(ROOT, "benchmarks", "fp8_accuracy.yaml"), "--model.n_layer=2",
                     "--model.n_embd=64", "--model.n_head=4", "--model.n_kv_head=2", "--model.ffn_hidden=128",
                     "--model.block_size=32", "--train.batch_size=2", "--train.steps=6", "--train.warmup_steps=2",
                     "--train.lr=3e-3", "--train.eval_interval=3", "--train.eval_batches=1",
                     "--data.max_bytes=200000", "--log.interval=1"]


def _run(argv, cwd):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CUDA_VISIBLE_DEVICES": ""}  # the comparison is fp32 on CPU
    run = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run.stdout


@pytest.fixture(scope="module")
def accuracy_runs(tmp_path_factory):
    """The runs directory of benchmarks/fp8_accuracy.sh with the tiny run by the trainer (off) and by the
    peer (bf16): fp32 on CPU, so that the two should agree to rounding."""
    runs = tmp_path_factory.mktemp("fp8_accuracy")
    _run(["-m", "tpflash.train", *TINY_ACCURACY_RUN, "--model.fp8=off", f"--log.dir={runs / 'off'}"], ROOT)
    peer = _run([os.path.join(ROOT, "benchmarks", "fp8_accuracy_peer.py"), "--mode", "bf16", "--out",
                 str(runs / "bf16"), *TINY_ACCURACY_RUN], str(runs))
    return runs, peer


def test_the_accuracy_peer_trains_like_the_tpflash_trainer_from_its_init_on_its_data(accuracy_runs):
    import fp8_accuracy_plot
    runs, _ = accuracy_runs
    records = fp8_accuracy_plot.read_runs(str(runs))
    trainer, peer = records["off"], records["bf16"]
    for kind, key in (("train", "loss"), ("eval", "eval_loss")):
        ours, theirs = ([(r["step"], r[key]) for r in run[kind]] for run in (trainer, peer))
        assert [s for s, _ in ours] == [s for s, _ in theirs], (kind, ours, theirs)
        assert all(abs(a - b) <= 1e-4 * abs(a) for (_, a), (_, b) in zip(ours, theirs)), (kind, ours, theirs)
    assert [r["step"] for r in peer["train"]] == [1, 2, 3, 4, 5, 6] and [r["step"] for r in peer["eval"]] == [3, 6]
    assert [r["lr"] for r in peer["train"]] == [r["lr"] for r in trainer["train"]]
    assert trainer["train"][-1]["loss"] < trainer["train"][0]["loss"] - 0.1  # it trained: the check means something


def test_the_accuracy_peer_checks_it_computes_the_tpflash_models_loss_before_training(accuracy_runs):
    _, stdout = accuracy_runs
    line = next(line for line in stdout.splitlines() if line.startswith("same-model check"))
    ours, theirs = (float(part.split()[-1]) for part in line.split(":")[1].split(","))
    assert abs(ours - theirs) <= 1e-4 * ours, line


def test_the_fp8_accuracy_table_compares_the_peers_bf16_run_with_tpflashs(accuracy_runs):
    import fp8_accuracy_plot
    runs, _ = accuracy_runs
    text = fp8_accuracy_plot.table(fp8_accuracy_plot.read_runs(str(runs)), tail=2)
    row = next(line for line in text.splitlines() if line.startswith("| bf16 |"))
    assert "| 6 |" in row and "| none |" in row and ("+0.00%" in row or "-0.00%" in row), text
