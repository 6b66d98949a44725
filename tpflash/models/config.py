"""GPTConfig: one dataclass for the GPT-2 and Llama families, with named presets."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

from ..layers.attention import check_heads
from ..layers.block import CHECKPOINTING
from ..layers.fp8_linear import check_fp8_recipe
from ..layers.mlp import MLPS
from ..layers.norm import NORMS
from ..layers.rotary import check_rope_scaling

_LLAMA = dict(mlp="swiglu", norm="rmsnorm", position="rotary", tie_embeddings=False, bias=False)
PRESETS: Dict[str, Dict[str, Any]] = {
    # GPT-2 family (learned positions, LayerNorm, GELU, tied embeddings); vocab 50257 padded to 50304
    "gpt2-tiny": dict(vocab_size=50304, block_size=256, n_layer=4, n_head=4, n_embd=128),
    "gpt2-small": dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(vocab_size=50304, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    "gpt-1.3b": dict(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048),
    "gpt-2.7b": dict(vocab_size=50304, block_size=2048, n_layer=32, n_head=32, n_embd=2560),
    "gpt-6.7b": dict(vocab_size=50304, block_size=2048, n_layer=32, n_head=32, n_embd=4096),
    # Llama family (rotary, RMSNorm, SwiGLU, GQA, untied head, no biases)
    "llama-tiny": dict(vocab_size=32000, block_size=512, n_layer=4, n_head=8, n_kv_head=4, n_embd=256,
                       norm_eps=1e-5, **_LLAMA),
    "llama-1b": dict(vocab_size=32000, block_size=2048, n_layer=22, n_head=32, n_kv_head=4, n_embd=2048,
                     ffn_hidden=5632, norm_eps=1e-5, **_LLAMA),
    "llama-7b": dict(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096, norm_eps=1e-5, **_LLAMA),
    "llama-3-8b": dict(vocab_size=128256, block_size=8192, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                       ffn_hidden=14336, norm_eps=1e-5, rope_theta=500000.0, **_LLAMA),
    # the larger shapes a node trains with sharding and recomputation (Llama 2 13B, Code Llama 34B, Llama 3 70B)
    "llama-2-13b": dict(vocab_size=32000, block_size=4096, n_layer=40, n_head=40, n_embd=5120, ffn_hidden=13824,
                        norm_eps=1e-5, **_LLAMA),
    "codellama-34b": dict(vocab_size=32000, block_size=16384, n_layer=48, n_head=64, n_kv_head=8, n_embd=8192,
                          ffn_hidden=22016, norm_eps=1e-5, rope_theta=1000000.0, **_LLAMA),
    "llama-3-70b": dict(vocab_size=128256, block_size=8192, n_layer=80, n_head=64, n_kv_head=8, n_embd=8192,
                        ffn_hidden=28672, norm_eps=1e-5, rope_theta=500000.0, **_LLAMA),
}


@dataclass
class GPTConfig:
    """A decoder-only transformer. GPT-2: the defaults. Llama: mlp="swiglu", norm="rmsnorm",
    position="rotary", tie_embeddings=False, bias=False (see `preset("llama-7b")`).

    n_kv_head None means n_head (no GQA). ffn_hidden None means 4*n_embd, or for SwiGLU
    8/3*n_embd rounded up to a multiple of 256 (Llama's rule). mlp "gelu" is the tanh
    approximation GPT-2 uses. dropout applies to the embeddings and both residual branches (not
    to attention probabilities). activation_checkpointing: "activation" (the default: the MLP
    activation's output remade in the backward by one elementwise pass, not kept; ~20% less activation
    memory for under 1% of the step, docs/performance.md, "Activation memory"), False (everything kept),
    True/"full" (whole blocks), "mlp" (the MLPs only) or "selective" (the GEMM outputs kept, the rest
    of each block recomputed). fused_loss: the loss through tpflash.losses.fused_linear_cross_entropy
    (token-chunked; the full logits never exist), else logits + vocab_parallel_cross_entropy.
    init_std: std of the normal init (residual output projections get init_std/sqrt(2*n_layer)).
    seed: seeds the model's dropout RNG tracker (tpflash.parallel.random).
    fp8: "off", "rowwise", "tensorwise" or "delayed": the attention and MLP projections' GEMMs in fp8
    (tpflash.layers.fp8_linear; the embedding and the head stay in the compute dtype). Checkpoints
    hold no fp8 state (delayed scaling's amax histories start again on resume): a checkpoint resumes
    with fp8 changed.

    Llama-family variants (tpflash.models.hf_config maps Hugging Face configs onto these):
    head_dim: per-head width, None meaning n_embd // n_head (`head_size` is the resolved value);
    n_head * head_dim may differ from n_embd (Qwen3). qkv_bias: biases on q/k/v, None meaning `bias`
    (Qwen2: qkv_bias=True, bias=False). qk_norm: per-head RMSNorm on q and k before rotary (Qwen3).
    rope_scaling: None (plain RoPE) or a dict {"rope_type": "linear"|"dynamic"|"llama3"|"yarn"|
    "longrope", ...its parameters in transformers' names} (tpflash.layers.rotary); block_size is then
    max_position_embeddings, and "dynamic" accepts longer sequences (rescaling its frequencies).
    sliding_window: Mistral's attention window; forwards over longer sequences (documents) raise.
    """

    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_kv_head: Optional[int] = None
    ffn_hidden: Optional[int] = None
    mlp: str = "gelu"
    norm: str = "layernorm"
    position: str = "learned"
    tie_embeddings: bool = True
    bias: bool = True
    dropout: float = 0.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sequence_parallel: bool = False
    activation_checkpointing: Union[bool, str] = "activation"
    fused_loss: bool = True
    init_std: float = 0.02
    seed: int = 0
    head_dim: Optional[int] = None
    qkv_bias: Optional[bool] = None
    qk_norm: bool = False
    rope_scaling: Optional[Dict[str, Any]] = None
    sliding_window: Optional[int] = None
    fp8: str = "off"

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.head_dim is None and self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head} (or set head_dim)")
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"head_dim={self.head_dim} must be >= 1")
        # One spelling per model, so that configs compare equal however they were written.
        if self.head_dim is not None and self.head_dim * self.n_head == self.n_embd:
            self.head_dim = None
        if self.qkv_bias == self.bias:
            self.qkv_bias = None
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 (or None)")
        check_heads(self.n_head, self.kv_heads, 1)
        if self.mlp not in MLPS:
            raise ValueError(f"mlp={self.mlp!r} must be one of {MLPS}")
        if self.norm not in NORMS:
            raise ValueError(f"norm={self.norm!r} must be one of {NORMS}")
        if self.position not in ("learned", "rotary"):
            raise ValueError(f"position={self.position!r} must be 'learned' or 'rotary'")
        if self.position == "rotary" and self.head_size % 2:
            raise ValueError(f"head_dim={self.head_size} must be even for rotary positions")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") == "default":
            self.rope_scaling = None  # plain RoPE has one spelling
        if self.rope_scaling is not None:
            if self.position != "rotary":
                raise ValueError(f"rope_scaling={self.rope_scaling} needs position='rotary'")
            check_rope_scaling(self.rope_scaling, self.head_size)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.fp8 is False:  # YAML 1.1 reads a bare `off` (config files, --model.fp8=off) as false
            self.fp8 = "off"
        check_fp8_recipe(self.fp8)
        self.checkpoint_mode  # validates activation_checkpointing

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head (GQA/MQA), else n_head."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_size(self) -> int:
        """The per-head width: head_dim, else n_embd // n_head."""
        return self.n_embd // self.n_head if self.head_dim is None else self.head_dim

    @property
    def ffn_dim(self) -> int:
        """The MLP's hidden width: ffn_hidden, else 4 * n_embd (gelu) or 8/3 * n_embd rounded up to 256 (swiglu)."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.mlp == "swiglu":
            return 256 * math.ceil(8 * self.n_embd / 3 / 256)
        return 4 * self.n_embd

    @property
    def checkpoint_mode(self) -> Optional[str]:
        """activation_checkpointing as a block's `checkpoint` argument (None, "activation", "full", "mlp" or
        "selective")."""
        mode = {False: None, True: "full"}.get(self.activation_checkpointing, self.activation_checkpointing)
        if mode not in CHECKPOINTING:
            raise ValueError(f"activation_checkpointing={self.activation_checkpointing!r} must be False, True, "
                             "'activation', 'full', 'mlp' or 'selective'")
        return mode

    def check_tp(self, tp: int) -> None:
        """Raise ValueError naming the numbers unless this model can be split over tp ranks."""
        check_heads(self.n_head, self.kv_heads, tp)
        if self.ffn_dim % tp:
            raise ValueError(f"ffn_hidden={self.ffn_dim} is not divisible by tp={tp}")

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """A named configuration (PRESETS), with fields replaced by `overrides`."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets are {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a plain dict (saved with checkpoints; GPTConfig(**d) rebuilds it)."""
        return dataclasses.asdict(self)
