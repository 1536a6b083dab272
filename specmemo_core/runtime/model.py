"""Llama-family decoder forward in plain PyTorch (SmolLM2, Llama 2/3, Vicuna, Mistral, Qwen2).

Why our own forward and not transformers': speculative decoding needs one forward to
score a whole tree of candidate tokens, each at its own position and attending only to
the prefix and its own ancestors, with keys and values written into a static cache we
own. Positions and the attention mask are therefore *arguments* of ``forward``; the
weights are the ones transformers loaded (HF parameter names).

Shapes: T = new tokens in this forward, S = cache slots visible (cache.length + T),
D = hidden size, H = query heads, Hkv = key/value heads, hd = head dim, V = vocabulary.
Every shape may carry a leading batch axis B (``batch_cache.BatchKVCache``: B sequences,
each over its own rows of the cache, verified in one forward); written ``[..., T, D]``
where it may, ``[T, D]`` in the single-sequence comments.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from specmemo_core.runtime import chunked_attention, step_kernels, token_layer
from specmemo_core.runtime.kv_cache import KVCache, causal_mask, tree_mask  # noqa: F401  (masks: part of the forward's interface)
from specmemo_core.planning.memory import PICK_ROWS, ModelDimensions

if TYPE_CHECKING:
    from specmemo_core.runtime.split import Placement

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
CacheT = TypeVar("CacheT")


@dataclass(frozen=True, kw_only=True)
class ModelSpec(ModelDimensions):
    """The shape of a Llama-family model, read from a transformers config: its sizes
    (``ModelDimensions``, shared with the planner's ``ModelShape``) and behaviour flags."""

    model_type: str
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
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

    from specmemo_core.storage.fast_tokenizer import transformers_config

    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](transformers_config(config), torch.device("cpu"))
    return inv.float(), float(scale)


def rope_tables(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and *signed* sin [..., T, hd] of rotary embeddings at ``positions`` [..., T]: the sin's
    first half is negated, which folds rotate-half's minus sign into the table (one
    kernel fewer per ``apply_rope``, which runs twice in every layer of every step)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [..., T, hd/2]
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 whatever the activations' dtype (as HF's
    Llama does); ``F.rms_norm`` is one fused kernel on CUDA instead of eight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, hd]; cos, signed sin: [T, hd] from ``rope_tables`` (rotate-half
    convention, as HF checkpoints use): x·cos + (x₂, x₁)·(−sin, sin).

    The result is contiguous whatever x's strides (``cat`` makes ``rotated`` so, and the
    other two kernels write into it): ``Attention`` passes a transposed view of its
    projections, and its query regrouping is then a view, not a copy per layer."""
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return rotated.mul_(sin).addcmul_(x, cos)


def step_tables(rope: tuple[torch.Tensor, float], positions: torch.Tensor, mask: torch.Tensor, spec: ModelSpec,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rope_tables`` at ``positions`` (``rope``: the inverse frequencies and scale) and
    ``attention_bias`` of ``mask``: one kernel where ``step_kernels.takes_tables`` (a GPU step of
    one sequence), the torch ops elsewhere; the same numbers either way."""
    inv_freq, scale = rope
    if step_kernels.takes_tables(positions, mask, inv_freq):
        return step_kernels.step_tables(positions, mask, inv_freq=inv_freq, scale=scale,
                                        groups=spec.num_heads // spec.num_kv_heads, dtype=dtype)
    return (*rope_tables(inv_freq, scale, positions, dtype), attention_bias(mask, spec, dtype))


def attention_bias(mask: torch.Tensor, spec: ModelSpec, dtype: torch.dtype) -> torch.Tensor:
    """The [..., T, S] bool mask (True = may attend) as the additive bias [..., groups·T, S]
    that ``Attention`` takes: built once per forward, not converted again in every layer,
    and repeated for the ``groups`` query heads that share a key/value head (see ``Attention``)."""
    groups = spec.num_heads // spec.num_kv_heads
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.repeat(*(1,) * (mask.dim() - 2), groups, 1) if groups > 1 else bias


def _plain_weight(module: nn.Module) -> bool:
    """An ``nn.Linear`` holding an ordinary tensor (not packed for oneDNN, not quantized)."""
    return type(module) is nn.Linear and type(module.weight) in (torch.Tensor, nn.Parameter)


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linears over the same input, whose own
    parameters become views of it: one matmul instead of several, no extra memory, and
    the HF parameter names (and state dict) unchanged."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
    start = 0
    for m in linears:
        rows = m.out_features
        m.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return weight, bias


def _linear_add(residual: torch.Tensor, x: torch.Tensor, linear: nn.Module, fused: bool, *,
                into_residual: bool = False) -> torch.Tensor:
    """``residual + linear(x)``; with a plain bias-free weight as one GEMM with the add in it
    (which saves a kernel twice per layer). x: [..., T, in]. ``into_residual``: the sum is
    written over ``residual`` (one the caller made and reads no more), which also saves the
    copy of it into a new output that an out-of-place ``addmm`` makes first."""
    if fused and linear.bias is None:
        flat, rows = residual.reshape(-1, residual.shape[-1]), x.reshape(-1, x.shape[-1])
        if into_residual:
            return flat.addmm_(rows, linear.weight.t()).view(residual.shape)
        return torch.addmm(flat, rows, linear.weight.t()).view(residual.shape)
    return residual + linear(x)


class Attention(nn.Module):
    """Self-attention over a KV cache. Query heads that share a key/value head are
    stacked along the token axis ([Hkv, groups·T, hd]), so every SDPA backend sees plain
    multi-head attention over the cache as it is stored: no key/value copies per group,
    no fallback to the unfused kernel that grouped-query attention can force. Its three
    parts (``project``, ``attend``, ``output``) run from ``DecoderLayer``'s regions."""

    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.spec = spec
        self.layer = layer
        d, hd = spec.hidden_size, spec.head_dim
        self.q_proj = nn.Linear(d, spec.num_heads * hd, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(d, spec.num_kv_heads * hd, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(d, spec.num_kv_heads * hd, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * hd, d, bias=spec.o_bias)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse()

    def fuse(self) -> None:
        self.qkv = _fuse([self.q_proj, self.k_proj, self.v_proj])

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., T, D] (normed) → rotated queries [..., H, T, hd], rotated keys and values
        [..., Hkv, T, hd]; cos, sin [..., T, hd] (signed sin: ``rope_tables``)."""
        s = self.spec
        lead, t, hd, h, hkv = x.shape[:-2], x.shape[-2], s.head_dim, s.num_heads, s.num_kv_heads
        if self.qkv is not None:
            qkv = F.linear(x, *self.qkv)
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        qkv = qkv.view(*lead, t, h + 2 * hkv, hd)
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # [..., 1, T, hd]: shared by the heads
        qk = apply_rope(qkv[..., : h + hkv, :].transpose(-3, -2), cos, sin)  # [..., H + Hkv, T, hd]
        return qk[..., :h, :, :], qk[..., h:, :, :], qkv[..., h + hkv:, :].transpose(-3, -2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
               cache: KVCache, chunked: bool = True) -> torch.Tensor:
        """Store k, v in the cache and attend: [..., T, H·hd] before ``o_proj``. ``bias``
        [..., groups·T, S] additive (``attention_bias``); a leading batch axis B goes with a
        batched cache (its ``write`` takes and gives [B, Hkv, ·, hd]). ``chunked``: a step
        over a static cache on a GPU attends in chunks of slots (``chunked_attention``;
        else, and elsewhere, SDPA)."""
        s = self.spec
        lead, t, hd, h, hkv = q.shape[:-3], q.shape[-2], s.head_dim, s.num_heads, s.num_kv_heads
        keys, values = cache.write(self.layer, k, v)
        q = q.reshape(*lead, hkv, (h // hkv) * t, hd)  # heads kv·g + j stacked: [..., Hkv, g·T, hd]
        if chunked and chunked_attention.supports(q, keys, cache.live_length):
            return chunked_attention.attend(q, keys, values, bias, cache.live_length, new_tokens=t,
                                            groups=h // hkv)  # [T, H·hd]
        span = bias.shape[-1]  # a static cache may be attended over its first slots only
        keys, values = keys[..., :span, :], values[..., :span, :]  # [..., Hkv, S, hd]
        if lead:  # [B, Hkv, g·T, hd]; one bias per sequence, shared by its heads
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias.unsqueeze(-3))
        else:
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=bias)[0]  # [Hkv, gT, hd]
        return out.unflatten(-2, (h // hkv, t)).movedim(-2, -4).reshape(*lead, t, h * hd)  # [..., T, H·hd]

    def output(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual`` + ``o_proj(attended)`` [..., T, D]."""
        return _linear_add(residual, attended, self.o_proj, self.qkv is not None)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d, i = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(d, i, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(d, i, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(i, d, bias=spec.mlp_bias)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # set by fuse()

    def fuse(self) -> None:
        self.gate_up = _fuse([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor, residual: torch.Tensor, *, into_residual: bool = False) -> torch.Tensor:
        """``residual`` + MLP output (written over ``residual`` with ``into_residual``: ``_linear_add``)."""
        if self.gate_up is not None:
            gate, up = F.linear(x, *self.gate_up).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return _linear_add(residual, F.silu(gate) * up, self.down_proj, self.gate_up is not None,
                           into_residual=into_residual)


def project_layer(layer: "DecoderLayer", x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer up to its cache: norm, q/k/v projections and rotary (``Attention.project``)."""
    return layer.self_attn.project(layer.input_layernorm(x), cos, sin)


def finish_layer(layer: "DecoderLayer", attended: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A layer after its attention: o_proj and residual, norm, MLP and residual (added into
    the attention's sum, which this function made: no copy of it)."""
    x = layer.self_attn.output(attended, x)
    return layer.mlp(layer.post_attention_layernorm(x), x, into_residual=True)


@dataclass(frozen=True)
class LayerRegions:
    """How a decoder layer runs the parts around its cache write and attention: eagerly, or
    compiled (``compiled_regions``). Every layer has the same code over its own weights, so
    one compiled region serves them all."""

    project: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = project_layer
    finish: Callable[..., torch.Tensor] = finish_layer
    # a step over a static cache on a GPU attends in chunks of slots (``Attention.attend``)
    chunked_attention: bool = True
    # a decoding step there runs each layer through ``token_layer``'s fused kernels (a one-token
    # step's launched so) where they apply (None: as its regions)
    kernels: token_layer.Launch | None = token_layer.LAUNCH


EAGER_REGIONS = LayerRegions()


def compiled_regions(*, one_token: bool = False, mode: str | None = None) -> LayerRegions:
    """Both regions through ``torch.compile``: the norms, rotary, SiLU and residual adds fuse
    into a few kernels around the matmuls. The cache write and the attention stay eager: they
    read the cache object and span, which differ per layer. Shapes are compiled as they come
    (torch's automatic dynamic shapes): one token, then any number of them (tree steps and
    prompt chunks of every length) after the second size seen, so a new prompt length does
    not compile again.

    ``one_token``: a step of one token (plain decoding) runs its own region compiled
    for exactly that shape, the others the dynamic one. ``mode``: torch.compile's mode for
    the one-token region (e.g. ``max-autotune-no-cudagraphs``: inductor times its own matmul
    kernels against cuBLAS's)."""
    project, finish = torch.compile(project_layer), torch.compile(finish_layer)
    if not one_token:
        return LayerRegions(project, finish)
    project_1 = torch.compile(project_layer, dynamic=False, mode=mode)
    finish_1 = torch.compile(finish_layer, dynamic=False, mode=mode)

    def project_by_tokens(layer, x, cos, sin):
        return (project_1 if x.shape[-2] == 1 else project)(layer, x, cos, sin)

    def finish_by_tokens(layer, attended, x):
        return (finish_1 if x.shape[-2] == 1 else finish)(layer, attended, x)

    return LayerRegions(project_by_tokens, finish_by_tokens)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)
        self.regions = EAGER_REGIONS

    def forward(self, x, cos, sin, bias: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """``bias``: from ``attention_bias``, made once per forward by the caller."""
        launch = self.regions.kernels
        if launch is not None and self.regions.chunked_attention and token_layer.applies(self, x, cache):
            return token_layer.run(self, x, cos, sin, bias, cache, finish=self.regions.finish, launch=launch)
        q, k, v = self.regions.project(self, x, cos, sin)
        attended = self.self_attn.attend(q, k, v, bias, cache, self.regions.chunked_attention)
        return self.regions.finish(self, attended, x)

    def fuse(self) -> bool:
        """Fuse q/k/v and gate/up into single matmuls where the weights are plain (CUDA;
        on CPU the linears are packed for oneDNN instead). Returns whether it did."""
        linears = (self.self_attn.q_proj, self.self_attn.k_proj, self.self_attn.v_proj, self.self_attn.o_proj,
                   self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj)
        if not all(_plain_weight(m) for m in linears):
            return False
        self.self_attn.fuse()
        self.mlp.fuse()
        return True


class Backbone(nn.Module):
    """Named like transformers' ``model.*`` so HF state dicts load unchanged."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        # an uninitialised weight: the state dict replaces it, and Embedding's own normal_
        # init on the meta device imports torch._dynamo (~3 s of CPU at every start)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size,
                                         _weight=torch.empty(spec.vocab_size, spec.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LayerSource(Protocol):
    """Where a forward gets the decoder layers that are not resident on the device
    (``offload.LayerStreamer``): each one ready to run when it is yielded, in order."""

    def layers(self) -> Iterator[nn.Module]:
        ...


@dataclass(frozen=True)
class Segment:
    """Consecutive decoder layers that run on one device, with the rope frequencies there:
    the whole model for an unsplit one, one per device for a split one (``split.py``)."""

    device: torch.device
    layers: Iterable[nn.Module]
    inv_freq: torch.Tensor  # [hd/2] on ``device``


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
        # the layers after ``model.layers``, streamed from host memory (offload.py); None:
        # every layer is resident
        self.streamed: LayerSource | None = None
        # the decoder layers split over several devices (split.py); None: on one device
        self.placement: Placement | None = None

    @classmethod
    def from_state_dict(
        cls, config: Any, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "CausalLM":
        return cls.from_tensors(config, state_dict.items(), dtype=dtype, device=device)

    @classmethod
    def from_tensors(
        cls, config: Any, tensors: Iterable[tuple[str, torch.Tensor]], *, dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu", filled: Callable[[str, nn.Module], None] | None = None,
        ready: Mapping[str, torch.Tensor] | None = None,
    ) -> "CausalLM":
        """The model, its weights taken from ``(name, tensor)`` pairs one at a time, in any
        order (HF names; others are skipped): each is moved to ``device`` and ``dtype`` at
        once, so the caller's copy can go before the next is read. ``filled(name, module)``
        runs on each module as soon as its last weight has arrived (the engine quantizes a
        decoder ``nn.Linear`` there), so a streamed model never exists whole in float.
        ``ready``: weights already in their final form and place (quantized, from a cache):
        used as they are, before the stream, which should not hold them again."""
        spec = ModelSpec.from_config(config)
        with torch.device("meta"):
            model = cls(spec, (torch.empty(spec.head_dim // 2), 1.0))
        owners = {f"{prefix}.{leaf}" if prefix else leaf: (prefix, leaf)
                  for prefix, module in model.named_modules() for leaf, _ in module.named_parameters(recurse=False)}
        if spec.tie_word_embeddings:
            del owners["lm_head.weight"]  # the embedding itself, below
        waiting = {prefix: sum(1 for p, _ in owners.values() if p == prefix) for prefix, _ in owners.values()}
        for name, tensor in (ready or {}).items():
            prefix, leaf = owners.pop(name)
            setattr(model.get_submodule(prefix), leaf, nn.Parameter(tensor, requires_grad=False))
            waiting.pop(prefix, None)  # final already: ``filled`` is not run on it (its bias may follow)
        for name, tensor in tensors:
            if name not in owners:
                continue
            prefix, leaf = owners.pop(name)
            module = model.get_submodule(prefix)
            setattr(module, leaf, nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))
            del tensor  # the caller's float copy goes with the next pair
            if prefix in waiting:
                waiting[prefix] -= 1
                if waiting[prefix] == 0 and filled is not None:
                    filled(prefix, module)
        if owners:
            raise ValueError(f"weights are missing tensors: {sorted(owners)[:5]}")
        if spec.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        inv_freq, scale = rope_inverse_frequencies(config)
        model.inv_freq = inv_freq.to(device)
        model.rope_scale = scale
        return model.eval().requires_grad_(False)

    @property
    def device(self) -> torch.device:
        """Where the final norm, the LM head and a decoding step's tensors live: the home
        device of a split model (``split.py``), else the embedding's."""
        if self.placement is not None:
            return self.placement.home
        return self.model.embed_tokens.weight.device  # the LM head may be packed (cpu_linear)

    @property
    def one_device(self) -> bool:
        """Every layer on one device: unsplit, or split in segments that share one (a graph holds them)."""
        return self.placement is None or self.placement.split.one_device

    @property
    def capturable(self) -> bool:
        """Its steps can be captured as one CUDA graph: every layer resident, on one device."""
        return self.streamed is None and self.one_device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, capacity: int) -> KVCache:
        s = self.spec
        return self.layer_cache(lambda layers, device: KVCache(layers, s.num_kv_heads, s.head_dim, capacity,
                                                               self.dtype, device))

    def layer_cache(self, make: Callable[[int, torch.device], CacheT]) -> CacheT:
        """A KV cache of every decoder layer, made by ``make(layers, device)``: one on the
        model's device, or for a split model one per segment on its device, joined by a
        ``split_cache.SplitCache`` (which speaks the same API)."""
        if self.placement is None:
            return make(self.spec.num_layers, self.device)
        from specmemo_core.runtime.split_cache import SplitCache

        split = self.placement.split
        return SplitCache([make(n, d) for n, d in zip(split.layers, split.devices)])  # type: ignore[return-value]

    def draft_embedding(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The token embedding on the device where the draft heads run (``device``)."""
        if self.placement is None or self.placement.split.first == self.device:
            return self.model.embed_tokens
        from specmemo_core.runtime.split import BorderEmbedding

        return BorderEmbedding(self.model.embed_tokens, self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.inv_freq, self.rope_scale, positions, self.dtype)

    def tables(self, positions: torch.Tensor, mask: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, ...]:
        """cos, signed sin and the attention bias of a step of a layer shaped ``spec`` on this model's
        device (``step_tables``): the heads' context layer's."""
        return step_tables((self.inv_freq, self.rope_scale), positions, mask, spec, self.dtype)

    def forward(
        self,
        tokens: torch.Tensor,  # [..., T] token ids
        positions: torch.Tensor,  # [..., T] absolute positions
        mask: torch.Tensor,  # [..., T, cache.length + T] bool, True = may attend
        cache: KVCache,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Run ``T`` tokens, writing their KV at scratch slots ``cache.length + i``.

        Returns final-normed hidden states [..., T, D]. The cache's ``length`` is not moved:
        the caller commits what it accepts. With a leading batch axis B (a batched cache)
        row b holds sequence b's tokens, positions and mask over its own slots.
        ``last_only``: the caller reads only the last prompt token's row (a prefill chunk, no
        context layer); this forward gives every row anyway, llama.cpp's need not
        (``ggml_step.LlamaCppLM``).
        """
        cache.ensure_room(tokens.shape[-1])
        x = self.model.embed_tokens(tokens.to(self.model.embed_tokens.weight.device))  # [..., T, D]
        for segment in self.segments():  # one, unless split: then x crosses each border once
            x = x.to(segment.device)
            cos, sin, bias = step_tables((segment.inv_freq, self.rope_scale), positions.to(segment.device),
                                         mask.to(segment.device), self.spec, self.dtype)
            for layer in segment.layers:
                x = layer(x, cos, sin, bias, cache)
        return self.model.norm(x.to(self.device))  # [..., T, D]

    def segments(self) -> Iterator[Segment]:
        """Where the decoder layers run: one segment on the model's device (resident layers,
        then any streamed), or one per device of a split model (``split.Placement``)."""
        if self.placement is None:
            yield Segment(self.device, self.decoder_layers(), self.inv_freq)
        else:
            yield from self.placement.segments(self.model.layers)

    def decoder_layers(self) -> Iterable[nn.Module]:
        """Every decoder layer in order, ready to run: the resident ones (``model.layers``),
        then any streamed in from host memory (``streamed``)."""
        if self.streamed is None:
            return self.model.layers
        return itertools.chain(self.model.layers, self.streamed.layers())

    def fuse_projections(self) -> bool:
        """Fuse each layer's q/k/v and gate/up projections (``DecoderLayer.fuse``): on a
        GPU a step is bound by kernel launches, and this saves three of ~17 per layer.
        Call after the weights are on their device and in their final form (not for
        packed or quantized weights: then it does nothing and returns False)."""
        return all([layer.fuse() for layer in self.model.layers])

    def compile_layers(self) -> None:
        """Run the resident decoder layers through ``compiled_regions`` (CUDA: a step is bound by
        kernel launches and small kernels; each region compiles at the first runs of the first
        shapes it sees, so call it before capturing graphs)."""
        self.use_regions(compiled_regions())

    def use_regions(self, regions: LayerRegions) -> None:
        """Run every resident decoder layer's regions as ``regions`` (``EAGER_REGIONS``: eagerly)."""
        for layer in self.model.layers:
            layer.regions = regions

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [..., V]

    def greedy_picks(self, hidden: torch.Tensor, rows: int = PICK_ROWS) -> torch.Tensor:
        """``logits(hidden).argmax(-1)`` [T] without holding the [T, V] logits.

        Why: greedy verification needs one token per tree node, and the full logits were
        a tree step's largest buffer (64 nodes × 49,152 × 2 bytes = 6.3 MB for the default
        model in bf16). The LM head's rows are scored ``rows`` at a time, one matmul
        per block (the weight is still read once), each block keeping its best; ties go
        to the lowest token id, as argmax's do. A packed or quantized head (no plain rows
        to slice) and a bias are scored whole, as is a single row (a plain step: its [1, V] logits
        are small, and one matmul and argmax beat the blocks' several kernels). Where the
        step's glue kernels run (a GPU), ``step_kernels.greedy_picks`` does it in two kernels,
        for one row too (torch's argmax over one row of 49,152 took 14 µs on an H100, after
        its matmul's 22)."""
        head = self.lm_head
        one_row = hidden.numel() == hidden.shape[-1]
        if not _plain_weight(head) or head.bias is not None:
            return head(hidden).argmax(-1)
        if step_kernels.takes_picks(hidden, head.weight):  # on a GPU: two kernels, a plain step's too
            return step_kernels.greedy_picks(hidden, head.weight)
        if head.out_features <= rows or one_row:
            return head(hidden).argmax(-1)
        blocks = [F.linear(hidden, head.weight[lo:lo + rows]).max(-1) for lo in range(0, head.out_features, rows)]
        values = torch.stack([b.values for b in blocks])  # [B, T]
        best = values.argmax(0, keepdim=True)  # [1, T] the first block holding the maximum
        ids = torch.stack([b.indices for b in blocks]).gather(0, best)  # [1, T] within that block
        return (ids + best * rows)[0]
