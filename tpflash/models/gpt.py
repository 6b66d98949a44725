"""GPT / Llama decoder over tensor parallelism (and sequence parallelism), built from tpflash.layers.

Layout through the model: ids [batch, seq] -> embeddings [seq, batch, hidden] (sequence-first;
[seq/tp, batch, hidden] under SP) -> blocks -> final norm -> vocab-sharded logits
[batch, seq, V'/tp] (V' = vocab padded to a multiple of tp, rank r holding columns
[r*V'/tp, (r+1)*V'/tp)) or the mean cross-entropy, computed without gathering the vocabulary.
"""
from __future__ import annotations

import contextlib
import math
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.nn as nn

from .. import losses
from ..layers import ParallelNorm, ParallelTransformerBlock, VocabParallelEmbedding
from ..layers.fp8_history import AmaxHistory
from ..layers.linear import column_parallel_linears
from ..parallel import comm, context_parallel
from ..parallel.context_attention import CP_COMMS
from ..parallel.random import RNGTracker
from ..parallel.sharding import iter_sharded
from ..parallel.state import (NO_GROUP, get_default_state, group_rank, group_size, resolve_cp_group, resolve_tp_group,
                              sublayer_group)
from ..parallel.zigzag import zigzag_shard
from .config import GPTConfig
from .generate import generate
from .packing import packing_kwargs


def _normal(std: float):
    return lambda t: nn.init.normal_(t, mean=0.0, std=std)


class GPT(nn.Module):
    """Decoder-only transformer (GPT-2 or Llama family, per `config`) over the tp group.

    forward(idx) -> logits [batch, seq, V'/tp] (vocab-sharded; padding columns -inf), the same on
    every tp rank; forward(idx, targets) -> scalar mean loss (ignore_index=-100), or with
    reduction="sum" the sum of the counted tokens' losses. Packed documents: see `forward`.
    idx/targets: [batch, seq] int64, replicated over tp; seq <= block_size, and under sequence
    parallelism seq % tp == 0. Process group: `process_group`, else the default tp group, else none.
    Context parallelism (`cp_group`, else the default state's cp group when its cp > 1; NO_GROUP for
    none): idx/targets are the whole sequences, replicated over cp as over tp; each cp rank runs the
    model on its seq/cp tokens (zigzag layout, tpflash.parallel.zigzag; seq % (2*cp) == 0), attention
    over the whole sequence (`cp_comm` "ring" or "allgather", tpflash.parallel.context_attention).
    The loss is the whole batch's on every cp rank; its backward leaves on each rank cp times its
    tokens' share of the gradient, so that averaging over the dp x cp ranks (FSDP, DDP) is exact
    (tpflash.parallel.context_parallel). Logits are this cp rank's tokens', [batch, seq/cp, V'/tp].
    Parameters (keys of full_state_dict, equal to the tp=1 model's): tok_embeddings.weight,
    pos_embeddings.weight (learned positions), blocks.{i}.(attn_norm|attn|mlp_norm|mlp).*,
    final_norm.*, lm_head.weight (untied only).
    """

    block_class = ParallelTransformerBlock

    def __init__(self, config: GPTConfig, process_group=None, device=None, dtype=None, *, cp_group=None,
                 cp_comm: str = "ring"):
        super().__init__()
        if cp_comm not in CP_COMMS:
            raise ValueError(f"cp_comm={cp_comm!r} must be one of {CP_COMMS}")
        self.config = config
        self.process_group = resolve_tp_group(process_group)
        self.cp_group = resolve_cp_group(cp_group)
        tp, rank = group_size(self.process_group), group_rank(self.process_group)
        config.check_tp(tp)  # before anything could communicate
        self.sequence_parallel = config.sequence_parallel
        self.overlap: Optional[bool] = None  # the head's GEMM under SP, as a ColumnParallelLinear's flag
        state = get_default_state()
        dp_rank = state.dp_rank if state is not None and state.tp_group is self.process_group else 0
        if self.cp_group is not None:  # cp ranks hold different tokens: their dropout masks must differ too
            dp_rank = dp_rank * self.cp + self.cp_group.rank()
        self.rng_tracker = RNGTracker(config.seed, tp_rank=rank, dp_rank=dp_rank)
        self.cp_comm, self.build_dtype = cp_comm, dtype
        made = dict(self._fresh_modules(device, dtype))  # registered in this order (state dict, FSDP units)
        self.tok_embeddings, self.pos_embeddings = made["tok_embeddings"], made["pos_embeddings"]
        self.blocks = nn.ModuleList(made[f"blocks.{i}"] for i in range(config.n_layer))
        self.final_norm, self.lm_head = made["final_norm"], made["lm_head"]
        self._graphed_blocks = None  # capture_cuda_graphs()
        self.fp8_history: Optional[AmaxHistory] = None  # fp8="delayed": made on the device at first use

    def _fresh_modules(self, device, dtype) -> Iterator[Tuple[str, Optional[nn.Module]]]:
        """(name, module) for every module of the model, newly built and initialised, in the order their
        initialisation draws random numbers: __init__ keeps them all; init_on_device builds them again one
        at a time. Each holds this tp rank's part (the layers draw the whole tensor and keep their shard)."""
        config, layer_group = self.config, sublayer_group(self.process_group)
        init, out_init = _normal(config.init_std), _normal(config.init_std / math.sqrt(2 * config.n_layer))
        kw = dict(device=device, dtype=dtype)
        yield "tok_embeddings", VocabParallelEmbedding(config.vocab_size, config.n_embd, process_group=layer_group,
                                                       sequence_parallel=self.sequence_parallel, init_method=init, **kw)
        pos_embeddings = None
        if config.position == "learned":
            pos_embeddings = nn.Embedding(config.block_size, config.n_embd, **kw)
            init(pos_embeddings.weight)
        yield "pos_embeddings", pos_embeddings
        for i in range(config.n_layer):
            yield f"blocks.{i}", ParallelTransformerBlock(
                config.n_embd, config.n_head, config.kv_heads, config.ffn_dim, mlp=config.mlp, norm=config.norm,
                position=config.position, bias=config.bias, norm_eps=config.norm_eps, rope_theta=config.rope_theta,
                dropout=config.dropout, sequence_parallel=self.sequence_parallel, process_group=layer_group,
                checkpoint=config.checkpoint_mode, rng_tracker=self.rng_tracker, init_method=init,
                out_init_method=out_init, head_dim=config.head_size, qkv_bias=config.qkv_bias, qk_norm=config.qk_norm,
                rope_scaling=config.rope_scaling, max_positions=config.block_size,
                cp_group=sublayer_group(self.cp_group), cp_comm=self.cp_comm, fp8=config.fp8, **kw)
        yield "final_norm", ParallelNorm(config.n_embd, config.norm, config.norm_eps,
                                         bias=config.bias and config.norm == "layernorm",
                                         sequence_parallel=self.sequence_parallel, process_group=layer_group,
                                         autocast_output=True, **kw)
        lm_head = None
        if not config.tie_embeddings:  # same layout as the embedding table: rows = vocab, sharded
            lm_head = VocabParallelEmbedding(config.vocab_size, config.n_embd, process_group=layer_group,
                                             init_method=init, **kw)
        yield "lm_head", lm_head

    def init_on_device(self, device, seed: int) -> None:
        """Give this model, built on the meta device and given storage since (to_empty; sharded or not: FSDP2,
        fsdp=zero3), the values `torch.manual_seed(seed); GPT(config, device=device)` gives it, module by
        module: each is built whole (this tp rank's part) on `device`, this rank's shard of it copied in
        (tpflash.parallel.sharding.copy_values), and freed, so that no rank ever holds the whole model.
        No communication; every rank of a dp group gets its own rows of the same values."""
        from ..parallel.sharding import copy_values
        torch.manual_seed(seed)
        for name, fresh in self._fresh_modules(device, self.build_dtype):
            if fresh is not None:
                copy_values(self.get_submodule(name), fresh)

    # ---- shapes -------------------------------------------------------------------------------
    @property
    def tp(self) -> int:
        """The size of the model's tp group (1 without one)."""
        return group_size(self.process_group)

    @property
    def cp(self) -> int:
        """The size of the model's cp group (1 without one)."""
        return group_size(self.cp_group)

    @property
    def head_weight(self) -> torch.Tensor:
        """This rank's rows of the output projection, [V'/tp, hidden]."""
        return (self.tok_embeddings if self.lm_head is None else self.lm_head).weight

    def _check_input(self, idx: torch.Tensor, targets: Optional[torch.Tensor]) -> None:
        if idx.dim() != 2:
            raise ValueError(f"idx has shape {tuple(idx.shape)}; expected [batch, seq]")
        seq = idx.shape[1]
        scaling = self.config.rope_scaling or {}
        if seq > self.config.block_size and scaling.get("rope_type") != "dynamic":  # dynamic NTK extrapolates
            raise ValueError(f"sequence length {seq} exceeds block_size={self.config.block_size}")
        if self.sequence_parallel and seq % self.tp:
            raise ValueError(f"sequence length {seq} is not divisible by tp={self.tp} (sequence parallelism)")
        if self.cp_group is not None:
            context_parallel.check_cp_batch(seq, self.cp, self.tp, self.sequence_parallel)
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} != idx shape {tuple(idx.shape)}")

    # ---- forward ------------------------------------------------------------------------------
    def embed(self, idx: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids [batch, seq] -> [seq, batch, hidden] (under SP this rank's [seq/tp, batch, hidden]).
        position_ids [batch, seq]: the learned positions' rows (default 0..seq-1 in every row)."""
        x = self.tok_embeddings(idx.t())
        if self.pos_embeddings is not None:
            seq = idx.shape[1]
            pos, rows = self.pos_embeddings.weight, slice(0, seq)
            if self.sequence_parallel:  # this rank's positions; the table's gradient summed over tp
                pos = comm.copy_to_tp_region(pos, self.process_group)
                local = seq // self.tp
                rows = slice(group_rank(self.process_group) * local, (group_rank(self.process_group) + 1) * local)
            if position_ids is None:
                x = x + pos[rows, None, :]
            else:
                x = x + pos[position_ids[:, rows].t()]  # [seq(/tp), batch, hidden]
        return self.rng_tracker.dropout(x, self.config.dropout, sharded=self.sequence_parallel, training=self.training)

    def hidden_states(self, idx: torch.Tensor, *, position_ids: Optional[torch.Tensor] = None,
                      cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None) -> torch.Tensor:
        """The final-norm output, [seq, batch, hidden] ([seq/tp, batch, hidden] under SP; under cp, this cp
        rank's seq/cp tokens). Packed documents as in `forward`."""
        return self._hidden_states(*self._local_inputs(idx, position_ids, cu_seqlens, max_seqlen))

    def _local_inputs(self, idx, position_ids, cu_seqlens, max_seqlen):
        """(the ids this rank runs, the blocks' keyword arguments): the packed-document arguments checked
        and completed ({} for an unpacked batch); under cp, this cp rank's tokens and their global positions."""
        packing = packing_kwargs(idx, position_ids, cu_seqlens, max_seqlen)
        if self.cp_group is None:
            return idx, packing
        if cu_seqlens is not None:
            raise ValueError(f"packed documents (cu_seqlens) are not supported under context parallelism "
                             f"(cp={self.cp}): train on unpacked rows, or at cp=1")
        seq = idx.shape[1]
        idx, _, positions = context_parallel.shard_batch(idx, None, packing.get("position_ids"), self.cp_group)
        return idx, dict(position_ids=positions, max_seqlen=seq)  # max_seqlen: the rotary tables' length

    def _amax_history(self) -> Optional[AmaxHistory]:
        """Under fp8="delayed", the blocks' amax histories (tpflash.layers.fp8_history), made on the
        blocks' device the first time they are needed; None for other recipes."""
        if self.fp8_history is None and self.config.fp8 == "delayed":
            layers = [layer for block in self.blocks for layer in block.fp8_gemm_layers()]
            self.fp8_history = AmaxHistory(layers, self.head_weight.device, self.process_group)
        return self.fp8_history

    def prime_fp8_scaling(self, idx: torch.Tensor, targets: torch.Tensor, **forward_kw) -> None:
        """fp8="delayed": one training forward and backward of (idx, targets) that records every fp8
        tensor's amax into the histories and leaves the rest as it was (the gradients it makes are
        dropped), so that the first training step already scales by them and CUDA graphs captured
        after this replay from that step on. Call it under the training autocast, before
        capture_cuda_graphs, on every tp rank; not under sharded data parallelism, whose gradient hooks
        it would run (the first step then records the amaxes, eagerly). No-op for other recipes."""
        if self._amax_history() is None:
            return
        kept = [p.grad for p in self.parameters()]
        self.zero_grad(set_to_none=True)  # else the backward adds into the kept tensors
        loss = self(idx, targets, **forward_kw)
        with torch.autocast(idx.device.type, enabled=False):  # as a training step's backward runs
            loss.backward()
        for p, grad in zip(self.parameters(), kept):
            p.grad = grad

    def _hidden_states(self, idx: torch.Tensor, block_kw: Dict) -> torch.Tensor:
        x, residual = self.embed(idx, block_kw.get("position_ids")), None
        history = self._amax_history()
        if history is not None and torch.is_grad_enabled() and self.training:
            history.advance()  # once per training forward: the steps' amaxes move on
        graphs_fit = history is None or history.primed  # the graphs replay delayed casts only
        if not block_kw and graphs_fit and self._graphed_blocks is not None and self._graphed_blocks.matches(x):
            x, residual = self._graphed_blocks(x)  # captured for unpacked batches only
        else:
            if self._graphed_blocks is not None:
                self._graphed_blocks.before_eager_run()
            for block in self.blocks:
                x, residual = block(x, residual, **block_kw)
        return self.final_norm(x, residual=residual)[0]

    def capture_cuda_graphs(self, batch_size: int, seq_len: int, dp_sync=None, accumulate_grads: bool = False) -> None:
        """Capture the blocks' forward and backward as CUDA graphs (tpflash.layers.graphed_blocks).

        Later training forwards of [batch_size, seq_len] ids with grad mode on, under the autocast
        state of this call (e.g. inside the same `torch.autocast("cuda", dtype=torch.bfloat16)`),
        replay them instead of launching every kernel and collective from Python; other calls
        (eval, no_grad, other shapes) run eagerly. Every tp rank must call it, after loading
        weights. Needs dropout=0 and no FSDP; activation checkpointing is captured too (the backward
        graph recomputes what the forward graph did not keep). The blocks' overlap flags are captured
        as they are (`tpflash.parallel.overlap.set_overlap`); left at None, the capture decides
        (by default: the copy-engine overlap where the GPUs map each other's memory, docs/overlap.md). Run one backward per forward. On CPU the replay is an eager stand-in (tests). Call again to recapture; `release_cuda_graphs()` frees them.
        `dp_sync`: a tpflash.parallel.zero_graphs.GraphSync for these blocks (fsdp=zero1), whose
        gradient reduce-scatters and weight all-gathers the graphs then overlap with the blocks, or
        a tpflash.parallel.zero3.GraphSync (fsdp=zero3, ShardedBlocks.graph_sync()).
        `accumulate_grads`: gradients accumulate over several micro-batches per optimizer step; the
        blocks' weight-gradient GEMMs then add into fp32 buffers that are the weights' .grad, and the
        weights are cast once per update (GraphedBlocks). Not with DDP, whose hooks must see each gradient.
        """
        from ..layers.graphed_blocks import GraphedBlocks, check_graphable
        if self.cp_group is not None:
            raise ValueError(f"CUDA graphs are not captured under context parallelism (cp={self.cp}): "
                             "its ring sends and receives run eagerly")
        graph_params = getattr(dp_sync, "graph_params", None)
        check_graphable(self.blocks, graph_params() if graph_params is not None else None)  # before any collective
        idx = torch.zeros(batch_size, seq_len, dtype=torch.long, device=self.head_weight.device)
        self._check_input(idx, None)
        self.release_cuda_graphs()
        with torch.no_grad():
            sample = self.embed(idx)  # [seq(/tp), batch, hidden]
        history = self._amax_history()
        with contextlib.nullcontext() if history is None else history.capture():
            self._graphed_blocks = GraphedBlocks(self.blocks, sample, dp_sync=dp_sync, accumulate_grads=accumulate_grads)

    def release_cuda_graphs(self) -> None:
        """Destroy the captured graphs (and their memory pool); forwards run eagerly again. Call it
        before destroying the process groups (tpflash.parallel.shutdown): a live graph holding NCCL
        kernels makes that wait forever."""
        if self._graphed_blocks is not None:
            self._graphed_blocks.release()
        self._graphed_blocks = None

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """[seq(/tp), batch, hidden] -> [seq, batch, V'/tp] (padding columns left as computed)."""
        return column_parallel_linears(h, [self.head_weight], [None], self.process_group, self.sequence_parallel,
                                       self.overlap)[0]

    def _mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        local = logits.shape[-1]
        real = self.config.vocab_size - group_rank(self.process_group) * local
        if real >= local:
            return logits
        pad = torch.arange(local, device=logits.device) >= real
        return logits.masked_fill(pad, float("-inf"))

    def _loss(self, h: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        target = targets.t()  # [seq, batch], the logits' token order
        # The losses read process_group=None as "the default tp group"; a tp=1 model means none.
        group = NO_GROUP if self.process_group is None else self.process_group
        if self.config.fused_loss:  # gathers h itself and never holds all the logits
            return losses.fused_linear_cross_entropy(h, self.head_weight, target, group, reduction=reduction,
                                                     vocab_size=self.config.vocab_size,
                                                     sequence_parallel=self.sequence_parallel)
        return losses.vocab_parallel_cross_entropy(self._logits(h), target, group, reduction=reduction,
                                                   vocab_size=self.config.vocab_size)

    def _check_window(self, seq: int, packing: Dict) -> None:
        window, longest = self.config.sliding_window, packing.get("max_seqlen") or seq
        if window is not None and longest > window:
            raise ValueError(f"sequence (document) length {longest} exceeds sliding_window={window}: tpflash "
                             "attends over whole documents, so only sequences up to the window are exact")

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                position_ids: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                max_seqlen: Optional[int] = None, reduction: str = "mean") -> torch.Tensor:
        """Logits [batch, seq, V'/tp], or with targets the loss: reduction "mean" over the tokens whose
        target is not -100, or "sum" of their losses (a trainer divides by its global token count).

        Packed documents (tpflash.models.packing): cu_seqlens int32 [n_docs + 1], offsets of the
        documents in the batch-major flattening of idx (every row boundary included); attention then
        stays inside each document (causal within it). position_ids int64 [batch, seq]: positions
        restarting at 0 per document (rotary angles or learned-position rows); derived from
        cu_seqlens on its device when omitted. max_seqlen: the longest document, a python int
        (computed with one device sync when omitted; pass it). Replicated over tp like idx.
        Checked before any collective. Captured CUDA graphs are not used for packed batches.
        """
        self._check_input(idx, targets)
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction={reduction!r} must be 'mean' or 'sum'")
        local_idx, block_kw = self._local_inputs(idx, position_ids, cu_seqlens, max_seqlen)
        self._check_window(idx.shape[1], block_kw)
        h = self._hidden_states(local_idx, block_kw)
        if targets is not None and self.cp_group is not None:  # this rank's tokens' losses, combined over cp
            targets = zigzag_shard(targets, 1, self.cp_group.rank(), self.cp)
            counted = None if reduction == "sum" else (targets != -100).sum()
            return context_parallel.combine_loss(self._loss(h, targets, "sum"), counted, self.cp_group)
        if targets is not None:
            return self._loss(h, targets, reduction)
        return self._mask_padding(self._logits(h)).transpose(0, 1)  # [batch, seq, V'/tp]

    generate = generate

    # ---- accounting ---------------------------------------------------------------------------
    def _full_numels(self) -> Dict[str, int]:
        """{parameter name: element count of the unsharded tensor} (no communication)."""
        specs = {key: spec for key, spec, _ in iter_sharded(self)}
        out = {}
        for name, p in self.named_parameters():
            spec = specs.get(name)
            out[name] = p.numel() if spec is None else p.numel() // p.shape[spec.dim] * spec.full_size
        return out

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters of the unsharded model (the same on every rank and at every tp). non_embedding
        leaves out the token and position embedding tables (an untied output head still counts)."""
        numels = self._full_numels()
        if non_embedding:
            numels = {k: v for k, v in numels.items() if not k.startswith(("tok_embeddings.", "pos_embeddings."))}
        return sum(numels.values())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), for MFU: 6 * (matmul parameters, the output
        head included) + 12 * n_layer * n_head * head_dim * seq_len for attention scores and values (PaLM's
        convention, which does not halve for causal masking)."""
        c = self.config
        block_params = self.num_params(non_embedding=True) - (0 if self.lm_head is None else c.vocab_size * c.n_embd)
        matmul_params = block_params + c.vocab_size * c.n_embd
        return 6.0 * matmul_params + 12.0 * c.n_layer * c.n_head * c.head_size * seq_len
