"""``quantize.bnb``: bitsandbytes NF4 / FP4 / LLM.int8 weight quantization, and its export.

The comparison point most users already have: transformers' ``BitsAndBytesConfig``. Each
targeted ``nn.Linear`` becomes a bitsandbytes module, built the way transformers builds them
when loading with a ``BitsAndBytesConfig``:

- ``nf4`` / ``fp4`` -> ``bnb.nn.Linear4bit``: blockwise absmax over 64 consecutive weights of the
  flattened weight, codes on the NormalFloat4 grid (QLoRA, Dettmers et al. 2023) or a 4-bit float
  grid; optional double quantization of the absmax values.
- ``int8`` -> ``bnb.nn.Linear8bitLt`` (LLM.int8, Dettmers et al. 2022): int8 weights with one
  absmax scale per output row; activation columns holding a value above ``threshold`` take a
  16-bit path (outlier decomposition); ``threshold: 0`` turns that off.

The model keeps a transformers ``hf_quantizer`` and ``config.quantization_config``, so
``compress.io.export.export_checkpoint`` writes bitsandbytes' own serialization with
``save_pretrained`` and ``AutoModelForCausalLM.from_pretrained(dir)`` loads it back.

Streamed (``state.stream``, a meta skeleton): each decoder layer's targets are read one linear
at a time, converted and handed with the finished layer to the export, which writes the
tensors ``save_pretrained`` writes for the model in memory (``compress.io.export``); the result
is the in-memory run's, bit for bit. A bnb layer cannot go through a scratch file to a later
pass, so quantize.bnb is a recipe's last pass and its only quantize.* pass (a float rewrite such
as rotate.hadamard may come before it; ``compress.recipe.check_order``).

Not done here: mixing bnb layers with our QuantLinear layers in one model (one checkpoint format
per model), and our kernels (bnb modules run bitsandbytes' own kernels; on CPU they work,
slowly). bitsandbytes is optional: this module never imports it at import time, and a config
asking for it without the package fails at validation with the install command.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

import torch
from pydantic import model_validator
from torch import nn

from compress.core.errors import RecipeError
from compress.core.matcher import set_submodule, target_modules
from compress.core.registry import (
    DTYPES,
    CompressionState,
    PassConfig,
    PassReport,
    raise_or_report_skips,
    register_pass,
)
from compress.quant.coverage import report_coverage
from compress.quant.experts import refuse_targeted_experts
from compress.quant.linear import (
    QuantLinear,
    is_bnb_module,
    linear_weight_bytes,
    portable_cpu_layout,
)

INSTALL = "pip install 'compress[bitsandbytes]'  (or: pip install bitsandbytes)"
_FOUR_BIT_ONLY = ("double_quant", "compute_dtype")


def bitsandbytes_available() -> bool:
    """True when the package is installed; does not import it."""
    return importlib.util.find_spec("bitsandbytes") is not None


def import_bitsandbytes() -> Any:
    """The ``bitsandbytes`` module, or an ImportError naming the install command."""
    if not bitsandbytes_available():
        raise ImportError(f"bitsandbytes is not installed. Install it: {INSTALL}")
    import bitsandbytes

    return bitsandbytes


class BnbConfig(PassConfig):
    """bitsandbytes quantization of the targeted Linear layers.

    format: nf4 | fp4 (4-bit, absmax per block of 64 weights) | int8 (LLM.int8).
    threshold: int8 only; activation magnitude above which a column runs in 16 bit (0 = off).
    double_quant: 4-bit only; quantize the absmax values too (~0.4 bit/weight less).
    compute_dtype: 4-bit only; dtype of the dequantized matmul (float32 is fastest on CPUs
    without bf16 instructions).
    """

    format: Literal["nf4", "fp4", "int8"] = "nf4"
    threshold: float = 6.0  # >= 0; int8 only
    double_quant: bool = False
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @model_validator(mode="after")
    def _check(self) -> BnbConfig:
        if not bitsandbytes_available():
            raise ValueError(
                f"quantize.bnb needs the bitsandbytes package, which is not installed. "
                f"Install it: {INSTALL}"
            )
        if self.threshold < 0:
            raise ValueError(f"threshold={self.threshold} must be >= 0 (0 disables outliers)")
        if self.format == "int8":
            wrong = [f for f in _FOUR_BIT_ONLY if f in self.model_fields_set]
            if wrong:
                raise ValueError(f"{', '.join(wrong)} apply to format nf4/fp4 only, not int8")
        elif "threshold" in self.model_fields_set:
            raise ValueError(f"threshold applies to format int8 only, not {self.format}")
        return self


def hf_quantization_config(cfg: BnbConfig, skip_modules: list[str]) -> Any:
    """The transformers ``BitsAndBytesConfig`` describing what ``cfg`` produced.

    skip_modules: exact names of the Linear layers left unquantized (lm_head included), so that
    ``from_pretrained`` builds the same module types when it loads the checkpoint.
    """
    from transformers import BitsAndBytesConfig

    if cfg.format == "int8":
        return BitsAndBytesConfig(
            load_in_8bit=True, llm_int8_threshold=cfg.threshold, llm_int8_skip_modules=skip_modules
        )
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.format,
        bnb_4bit_use_double_quant=cfg.double_quant,
        bnb_4bit_compute_dtype=DTYPES[cfg.compute_dtype],
        llm_int8_skip_modules=skip_modules,
    )


def _to_bnb(linear: nn.Linear, cfg: BnbConfig, bnb: Any) -> nn.Module:
    """A bitsandbytes module holding ``linear``'s weights; quantized by moving it to the weight's
    device (bitsandbytes quantizes in ``.to()``, as transformers' loader relies on)."""
    device = linear.weight.device
    # No copy: bitsandbytes quantizes from the weight (Int8Params from an fp16 cast of it) and
    # replaces the parameter's data; the float weight is never written to.
    w = linear.weight.detach()
    bias = linear.bias is not None
    if cfg.format == "int8":
        module = bnb.nn.Linear8bitLt(
            linear.in_features, linear.out_features, bias, has_fp16_weights=False,
            threshold=cfg.threshold, device="meta",
        )
        module.weight = bnb.nn.Int8Params(w.cpu(), requires_grad=False, has_fp16_weights=False)
    else:
        module = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias,
            compute_dtype=DTYPES[cfg.compute_dtype], compress_statistics=cfg.double_quant,
            quant_type=cfg.format, device="meta",
        )
        module.weight = bnb.nn.Params4bit(
            w.cpu(), requires_grad=False, compress_statistics=cfg.double_quant,
            quant_type=cfg.format, module=module,
        )
        portable_cpu_layout(module)
    if bias:
        module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    # New modules start in training mode; Linear8bitLt takes another code path when training.
    return module.to(device).train(linear.training)


def _convert(linear: nn.Linear, cfg: BnbConfig, bnb: Any) -> tuple[nn.Module, float, float]:
    """(the bitsandbytes module of ``linear``, sum (dequantized - w)^2, sum w^2); the float32
    temporaries die on return (a streamed pass holds one linear at a time)."""
    quant = _to_bnb(linear, cfg, bnb)
    w = linear.weight.detach().float()
    num = float((dequantized_weight(quant).to(w.device) - w).pow(2).sum())
    return quant, num, float(w.pow(2).sum())


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """fp32 ``[N, K]`` weight that a bitsandbytes Linear4bit / Linear8bitLt module stores."""
    import bitsandbytes as bnb

    if isinstance(module, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
    # LLM.int8 weights: w ≈ int8 * SCB / 127 per output row.
    return module.weight.data.float() * module.weight.SCB.float()[:, None] / 127.0


def has_bnb_modules(model: nn.Module) -> bool:
    return any(is_bnb_module(m) for m in model.modules())


@register_pass("quantize.bnb", BnbConfig, layerwise=True)
def bnb_quantize(model: nn.Module, cfg: BnbConfig, state: CompressionState) -> PassReport:
    bnb = import_bitsandbytes()
    name = "quantize.bnb"
    report = PassReport(name)
    stream = state.stream
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise RecipeError(
            f"{name}: the model already holds QuantLinear layers from another quantize.* pass; "
            "one checkpoint format per model: use quantize.bnb alone or drop it"
        )
    if stream is not None and stream.sink is None:
        raise RecipeError(
            f"{name} must be the recipe's last pass when the model is streamed: a bitsandbytes "
            "layer cannot be handed to a later pass through a scratch file; move it last"
        )
    refuse_targeted_experts(
        model, cfg, name, "bitsandbytes quantizes nn.Linear layers only, not 3-D expert weights"
    )
    if stream is not None:
        # The export keeps every float tensor in the compute dtype, as save_pretrained does in
        # memory: the skeleton's (meta) tensors take it too, so the report counts them as written.
        model.to(stream.dtype)
    plan = []
    for layer_name, module in target_modules(model, cfg):
        if type(module) is nn.Linear:
            plan.append((layer_name, module))
        elif isinstance(module, nn.Linear) or is_bnb_module(module):
            report.skipped[layer_name] = f"{type(module).__name__} is not a plain nn.Linear"
    raise_or_report_skips(cfg, report, name)  # before any work: strict fails with nothing changed
    # the linears left in float, from the module tree before any is read (a streamed skeleton)
    planned = {layer_name for layer_name, _ in plan}
    skip = sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear)
                  and not is_bnb_module(m) and n not in planned)
    bytes_before = bytes_after = 0
    err_num = err_den = 0.0
    for layer_name, linear in plan if stream is None else stream.each_linear(plan):
        quant, num, den = _convert(linear, cfg, bnb)
        err_num, err_den = err_num + num, err_den + den
        bytes_before += linear.weight.numel() * linear.weight.element_size()
        bytes_after += linear_weight_bytes(quant)
        set_submodule(model, layer_name, quant)
        report.changed.append(layer_name)
    _attach_hf_quantizer(model, hf_quantization_config(cfg, skip))
    report.metrics.update(
        layers=len(plan),
        format=cfg.format,
        weight_bytes_before=bytes_before,
        weight_bytes_after=bytes_after,
        relative_weight_error=(err_num / err_den) ** 0.5 if err_den else 0.0,
    )
    report_coverage(model, cfg, report)
    return report


def _attach_hf_quantizer(model: nn.Module, quant_config: Any) -> None:
    """Give the model what transformers' loader would have: ``config.quantization_config`` and a
    pre-quantized ``hf_quantizer`` (``save_pretrained`` asks it how to serialize)."""
    config = getattr(model, "config", None)
    if config is None:
        return  # a bare nn.Module: usable, but only transformers models can be exported
    from transformers.quantizers import AutoHfQuantizer

    config.quantization_config = quant_config
    model.hf_quantizer = AutoHfQuantizer.from_config(quant_config, pre_quantized=True)
    flag = "is_loaded_in_8bit" if quant_config.load_in_8bit else "is_loaded_in_4bit"
    setattr(model, flag, True)
