"""Llama-family decoder forward in plain PyTorch (SmolLM2, Llama 2/3, Vicuna, Mistral, Qwen2).

Why our own forward and not transformers': speculative decoding needs one forward to
score a whole tree of candidate tokens, each at its own position and attending only to
the prefix and its own ancestors, with keys and values written into a static cache we
own. Positions and the attention mask are therefore *arguments* of ``forward``; the
weights are the ones transformers loaded (HF parameter names).

Shapes: T = new tokens in this forward, S = cache slots visible (cache.length + T),
D = hidden size, H = query heads, Hkv = key/value heads, hd = head dim, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import KVCache, causal_mask, tree_mask  # noqa: F401  (masks: part of the forward's interface)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family model, read from a transformers config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {self.model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @classmethod
    def from_config(cls, config: Any) -> "ModelSpec":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        is_qwen2 = config.model_type == "qwen2"
        return cls(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
        )


def rope_inverse_frequencies(config: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale for the config's RoPE variant.

    The plain variant is one line; scaled variants (Llama 3, linear, YaRN, …) come from
    transformers' own table so they stay right as it evolves.
    """
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        return inv.float(), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv.float(), float(scale)


def rope_tables(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, hd] of rotary embeddings at ``positions`` [T]."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, hd]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, T, hd]; cos, sin: [T, hd] (rotate-half convention, as HF checkpoints use)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.spec = spec
        self.layer = layer
        d, hd = spec.hidden_size, spec.head_dim
        self.q_proj = nn.Linear(d, spec.num_heads * hd, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(d, spec.num_kv_heads * hd, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(d, spec.num_kv_heads * hd, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * hd, d, bias=spec.o_bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, D]
        cos: torch.Tensor,  # [T, hd]
        sin: torch.Tensor,  # [T, hd]
        mask: torch.Tensor,  # [T, S] bool
        cache: KVCache,
    ) -> torch.Tensor:
        t, hd = x.shape[0], self.spec.head_dim
        q = self.q_proj(x).view(t, self.spec.num_heads, hd).transpose(0, 1)  # [H, T, hd]
        k = self.k_proj(x).view(t, self.spec.num_kv_heads, hd).transpose(0, 1)  # [Hkv, T, hd]
        v = self.v_proj(x).view(t, self.spec.num_kv_heads, hd).transpose(0, 1)  # [Hkv, T, hd]
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        keys, values = cache.write(self.layer, k, v)  # [Hkv, S, hd]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, enable_gqa=True
        )  # [1, H, T, hd]
        return self.o_proj(out[0].transpose(0, 1).reshape(t, -1))  # [T, D]


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d, i = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(d, i, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(d, i, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(i, d, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin, mask, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Named like transformers' ``model.*`` so HF state dicts load unchanged."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns final-normed hidden states; ``logits``
    applies the LM head only where the caller needs it (draft heads reuse the hidden)."""

    def __init__(self, spec: ModelSpec, rope: tuple[torch.Tensor, float]) -> None:
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        inv_freq, scale = rope
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_scale = scale

    @classmethod
    def from_state_dict(
        cls, config: Any, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "CausalLM":
        spec = ModelSpec.from_config(config)
        with torch.device("meta"):
            model = cls(spec, (torch.empty(spec.head_dim // 2), 1.0))
        weights = dict(state_dict)
        if "lm_head.weight" not in weights and spec.tie_word_embeddings:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        missing = set(model.state_dict()) - set(weights)
        if missing:
            raise ValueError(f"weights are missing tensors: {sorted(missing)[:5]}")
        model.load_state_dict(
            {k: w.to(device=device, dtype=dtype) for k, w in weights.items() if k in model.state_dict()},
            assign=True, strict=True,
        )
        if spec.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        inv_freq, scale = rope_inverse_frequencies(config)
        model.inv_freq = inv_freq.to(device)
        model.rope_scale = scale
        return model.eval().requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device  # the LM head may be packed (cpu_linear)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, capacity: int) -> KVCache:
        s = self.spec
        return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, capacity, self.dtype, self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.inv_freq, self.rope_scale, positions, self.dtype)

    def forward(
        self,
        tokens: torch.Tensor,  # [T] token ids
        positions: torch.Tensor,  # [T] absolute positions
        mask: torch.Tensor,  # [T, cache.length + T] bool, True = may attend
        cache: KVCache,
    ) -> torch.Tensor:
        """Run ``T`` tokens, writing their KV at scratch slots ``cache.length + i``.

        Returns final-normed hidden states [T, D]. The cache's ``length`` is not moved:
        the caller commits what it accepts.
        """
        cache.ensure_room(tokens.shape[0])
        cos, sin = self.rope(positions)
        x = self.model.embed_tokens(tokens)  # [T, D]
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, cache)
        return self.model.norm(x)  # [T, D]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [..., V]
