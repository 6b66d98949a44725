"""The peers of benchmarks/bench_e2e.py: a plain-PyTorch GPT-2 and Llama written the way users write them,
and the same models under PyTorch's native DTensor tensor parallelism (torchtitan's plans)."""
from __future__ import annotations

import contextlib
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

_RENAMES = [(r"^tok_embeddings\.", "tok."), (r"^pos_embeddings\.", "pos."), (r"^final_norm\.", "norm."),
            (r"\.attn_norm\.", ".ln1."), (r"\.mlp_norm\.", ".ln2."), (r"\.attn\.([qkvo])_proj\.", r".attn.\1."),
            (r"\.mlp\.(up|gate|down)_proj\.", r".mlp.\1.")]
_GPT2_MLP = [(r"\.mlp\.up\.", ".fc."), (r"\.mlp\.down\.", ".proj.")]


def plain_key(key: str, llama: bool) -> str:
    """The plain peer's name for a tpflash state-dict key."""
    for pattern, repl in _RENAMES + ([] if llama else _GPT2_MLP):
        key = re.sub(pattern, repl, key)
    return key


def load_tpflash_weights(plain: nn.Module, tp_model: nn.Module, llama: bool) -> None:
    """Copy tpflash's full weights into the plain model (the bench's rows start from their own inits;
    this makes them comparable); every plain parameter must be written."""
    import tpflash
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


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):  # [b, s, d]
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # heads = local heads under TP
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, vocab: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.tok.weight
        for name, p in self.named_parameters():  # GPT-2's init (a sane starting loss of ~ln V)
            nn.init.normal_(p, std=0.02) if p.dim() == 2 else None
        self.step_context = contextlib.nullcontext  # loss_parallel (forward and backward) under DTensor TP

    def head_loss(self, x, targets):
        logits = self.lm_head(self.norm(x))  # [b, s, V] (DTensor sharded on V under TP)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head_loss(x, targets)


class LlamaAttention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.q, self.o = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.k, self.v = (nn.Linear(d, kv_heads * self.head_dim, bias=False) for _ in range(2))

    def forward(self, x, cos, sin):  # x [b, s, d], cos/sin [s, head_dim]
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin  # Hugging Face's RoPE
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaMLP(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.ln1, self.attn = nn.RMSNorm(d, eps=1e-5), LlamaAttention(d, heads, kv_heads)
        self.ln2, self.mlp = nn.RMSNorm(d, eps=1e-5), LlamaMLP(d, ffn)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.ln1(x), cos, sin)
        return x + self.mlp(self.ln2(x))


class PlainLlama(PlainGPT):
    """Llama (RMSNorm, RoPE, SwiGLU, GQA through SDPA's enable_gqa, untied head, no biases)."""

    def __init__(self, d: int, layers: int, heads: int, vocab: int, seq: int, kv_heads: int, ffn: int):
        nn.Module.__init__(self)
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LlamaBlock(d, heads, kv_heads, ffn) for _ in range(layers))
        self.norm, self.lm_head = nn.RMSNorm(d, eps=1e-5), nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():
            nn.init.normal_(p, std=0.02) if p.dim() == 2 else None
        head_dim = d // heads
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq).repeat(1, 2)  # [s, head_dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.step_context = contextlib.nullcontext
        self.copy_embedding = False  # set under DTensor TP (dtensor_tp says why)

    def forward(self, idx, targets):
        x = self.tok(idx)
        x = x.clone() if self.copy_embedding else x
        cos, sin = self.cos[:idx.shape[1]], self.sin[:idx.shape[1]]
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head_loss(x, targets)


def compile_blocks(model: nn.Module) -> None:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block)


def dtensor_tp(model: PlainGPT, mesh) -> PlainGPT:
    """Megatron-style TP + SP with PyTorch's own API (torchtitan's plans for GPT-2 and Llama blocks)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)
    llama = isinstance(model, PlainLlama)
    root = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    if not llama:
        root["pos"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    parallelize_module(model, mesh, root)
    if not llama:
        model.lm_head.weight = model.tok.weight  # re-tie: both are Shard(0) over the vocabulary
    rest = (None, None) if llama else ()  # a Llama block's attention also takes cos and sin
    gather = PrepareModuleInput(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))
    plan = {"ln1": SequenceParallel(), "attn": gather, "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(output_layouts=Shard(1)), "ln2": SequenceParallel()}
    if llama:  # one gather for gate and up
        plan.update({"mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
                     "mlp.down": RowwiseParallel(output_layouts=Shard(1))})
    else:
        plan.update({"fc": ColwiseParallel(input_layouts=Shard(1)), "proj": RowwiseParallel(output_layouts=Shard(1))})
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
    if llama:  # a compiled block fed to_local's output as it is gets a plain-tensor gradient in DTensor's
        model.copy_embedding = True  # Redistribute backward (AttributeError _local_tensor; torch 2.13, CPU)
    model.step_context = loss_parallel
    return model


def shard_over_dp(model: PlainGPT, ps) -> PlainGPT:
    """FSDP2 over the dp mesh, each block then the root, as torchtitan composes it with TP (after
    parallelize_module on the tp mesh of the same 2-D mesh); bf16 params, fp32 reduction on CUDA."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    cuda = ps.device.type == "cuda"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else None,
                                  reduce_dtype=torch.float32 if cuda else None)
    for block in model.blocks:
        fully_shard(block, mesh=ps.dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=ps.dp_mesh, mp_policy=policy)
    return model
