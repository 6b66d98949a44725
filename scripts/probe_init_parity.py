"""Do tpflash and the plain-PyTorch peer of scripts/bench_e2e.py train alike from the same weights?

bench_e2e reports each row's loss after its warm-up steps, and the rows start from their own inits
(tpflash scales the residual projections' init by 1/sqrt(2 n_layer), the plain peer does not), so
their losses differ. This trains, on the bench's fixed batch with its optimizer: tpflash from its
init, the plain model loaded with tpflash's weights, and the plain model from its own init, and
prints the three loss curves. The first two agreeing means the bench's loss gap is the init.
    torchrun --nproc_per_node=1 scripts/probe_init_parity.py --models llama-1b,gpt-1.3b [--steps 6]
    torchrun --nproc_per_node=1 scripts/probe_init_parity.py --tiny      (CPU smoke test)
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import MODELS, build, make_optimizer  # noqa: E402

import tpflash  # noqa: E402

_RENAMES = [(r"^tok_embeddings\.", "tok."), (r"^pos_embeddings\.", "pos."), (r"^final_norm\.", "norm."),
            (r"\.attn_norm\.", ".ln1."), (r"\.mlp_norm\.", ".ln2."), (r"\.attn\.([qkvo])_proj\.", r".attn.\1."),
            (r"\.mlp\.(up|gate|down)_proj\.", r".mlp.\1.")]
_GPT2_MLP = [(r"\.mlp\.up\.", ".fc."), (r"\.mlp\.down\.", ".proj.")]


def plain_key(key: str, llama: bool) -> str:
    """The plain peer's (scripts/e2e_peers.py) name for a tpflash state-dict key."""
    for pattern, repl in _RENAMES + ([] if llama else _GPT2_MLP):
        key = re.sub(pattern, repl, key)
    return key


def load_tpflash_weights(plain: torch.nn.Module, tp_model: torch.nn.Module, llama: bool) -> None:
    """Copy tpflash's full weights into the plain model; every plain parameter must be written."""
    params = dict(plain.named_parameters())
    written = set()
    with torch.no_grad():
        for key, value in tpflash.parallel.full_state_dict(tp_model).items():
            name = plain_key(key, llama)
            params[name].copy_(value)
            written.add(name)
    if not llama:
        written.add("lm_head.weight")  # tied to tok.weight
    missing = set(params) - written
    if missing:
        raise RuntimeError(f"plain parameters not loaded from tpflash: {sorted(missing)}")


def losses(model, loss_fn, args, device, steps):
    opt = make_optimizer(model, device)
    gen = torch.Generator().manual_seed(1234)  # bench_e2e's batch
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
    out = []
    for _ in range(steps):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_fn(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="llama-1b")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tiny", action="store_true")
    cli = p.parse_args()
    ps = tpflash.parallel.init(tp=1)
    models = "tiny,tiny-llama" if cli.tiny else cli.models
    for name in models.split(","):
        shape = MODELS[name]
        llama = shape.get("family") == "llama"
        args = argparse.Namespace(vocab=512 if cli.tiny else shape.get("vocab", 50304), seq=64 if cli.tiny else 2048,
                                  batch=2 if cli.tiny else 4, dp_mode="replicate", dtype="bf16")
        torch.manual_seed(0)
        tp_model, tp_loss, _ = build("tpflash", shape, args, ps)
        torch.manual_seed(0)
        plain, _, _ = build("plain", shape, args, ps)
        plain_own = {k: v.detach().clone() for k, v in plain.state_dict().items()}
        load_tpflash_weights(plain, tp_model, llama)
        curves = {"tpflash": losses(tp_model, tp_loss, args, ps.device, cli.steps),
                  "plain, tpflash's weights": losses(plain, plain, args, ps.device, cli.steps)}
        plain.load_state_dict(plain_own)
        curves["plain, own init"] = losses(plain, plain, args, ps.device, cli.steps)
        print(f"{name}: loss at steps 1-{cli.steps}, same batch every step (as bench_e2e)")
        for label, curve in curves.items():
            print(f"  {label:26s} " + " ".join(f"{x:.3f}" for x in curve), flush=True)
        del tp_model, plain
        torch.cuda.empty_cache() if ps.device.type == "cuda" else None


if __name__ == "__main__":
    main()
