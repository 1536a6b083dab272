"""The model at its planned precision, built from an opened model file a tensor at a time.

``storage.sources.open_model`` reads the header; here each weight is read, converted and
placed as it arrives (``CausalLM.from_tensors``): bf16/fp16/fp32 by a cast, int8/int4 by
quantizing each decoder weight on arrival (``quantize.quantize_on_arrival``), so the
peak is the planned weights plus about one float tensor, not a float model. Quantized
decoder weights are kept beside the file's cache (``storage.quantized_cache``) and read
from there on later starts, skipping their de-quantization and quantization.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from specmemo_core.runtime.model import CausalLM
from specmemo_core.storage import quantized_cache

Progress = Callable[[str, float], None]


def _cache_key(precision: str, group_size: int, device: torch.device, dtype: torch.dtype) -> str:
    """Names what the cached weights were made for: int4 weights are quantized from the
    model's dtype, so fp32- and bf16-model ones differ; a CPU int4 weight's scales are bf16
    (``quantize.py``), which the key says, so one cached with fp32 scales is never read back."""
    import torchao

    scales = "-scales-bf16" if precision == "int4" and device.type == "cpu" else ""
    return (f"{precision}-g{group_size}-{device.type}-{str(dtype).removeprefix('torch.')}{scales}"
            f"-torch{torch.__version__}-torchao{torchao.__version__}")


def build_model(opened: Any, *, precision: str | None, dtype: torch.dtype, device: torch.device,
                progress: Progress | None = None) -> CausalLM:
    """``opened``: a ``storage.sources.OpenedModel`` (or a ``LoadedModel``: weights in memory,
    no cache). ``precision`` int8/int4 quantizes the decoder weights (``quantize.py``);
    anything else keeps ``dtype``."""
    if precision not in ("int8", "int4"):
        return CausalLM.from_tensors(opened.config, opened.tensors(progress), dtype=dtype, device=device)
    from specmemo_core.runtime.quantize import QuantSpec, quantize_on_arrival, quantized_weights, use_int4_cpu_kernel

    spec = QuantSpec(precision)
    model_dtype, filled = quantize_on_arrival(spec, dtype=dtype, device=device)  # before reading: see its config
    key = _cache_key(precision, spec.group_size, device, model_dtype)
    ready = quantized_cache.read(opened.cache, key, device) if opened.cache is not None else None
    if ready is not None and set(ready) != _decoder_linear_names(opened):
        ready = None  # not this model's layers: quantized again, and saved again below
    if progress is not None:
        progress(f"loading {precision} weights from the cache" if ready else f"loading and quantizing to {precision}",
                 0.0)
    lm = CausalLM.from_tensors(opened.config, opened.tensors(progress, skip=ready or ()), dtype=model_dtype,
                               device=device, filled=filled, ready=ready)
    if ready is None and opened.cache is not None:
        quantized_cache.write(opened.cache, key, quantized_weights(lm))
    use_int4_cpu_kernel(lm)
    return lm


def _decoder_linear_names(opened: Any) -> set[str]:
    return {n for n in opened.shapes if n.startswith("model.layers.") and n.endswith("_proj.weight")}
