"""The memory preflight of a job: before any work, estimate its peak resident memory from the
checkpoint's shapes and refuse, with the need, what is available and the way out, a job that
would be killed for memory half-way through.

The estimate is deliberately simple, per phase, and its parts are returned for the report. Its
constants come from ``scripts/bench_memory.py`` (W4 RTN, 2026-12-02, docs/results.md section 6):
the layer-at-a-time terms from runs before RTN read one linear at a time (1.21 GB streamed on
the 1.1B shape, estimate 1.20; 2.47 GB on the 7B shape, 2.62), the whole-model term from 7.10 GB
loaded whole on the 1.1B shape (7.13), the linear-at-a-time terms below from the later runs.

* a base for the interpreter, torch, transformers, the tokenizer and the reader (~0.75 GB);
* RTN as the first streamed pass: the largest linear, read one at a time (constants below);
* other streamed passes (``compress.io.stream``): one decoder layer in float32 beside the stored
  16-bit tensor being cast, the quantizer's temporaries for the largest linear (3.5 float32
  copies: the codes, the dequantized weight and its error), the modules outside the stack
  during the calibration capture (the embedding as stored, no head), the calibration hidden states
  entering and leaving the layer (float32) and, for GPTQ, one Hessian per linear of the layer
  (float32 ``[in, in]``); GPTQ keeps the whole layer as stored, and AWQ and AutoRound its fused
  experts, each widening one weight matrix (an expert's projection) at a time;
* a streamed ``rotate.hadamard``: one layer in float32 and the largest linear's rotation
  temporaries (5 float32 copies: a float64 copy, its float64 product, the float32 result), then
  the final norm, embedding and head (untied) read and rotated in float32 with one chunk's
  temporaries; the float64 rotation matrix throughout. Those modules then stay resident for
  the passes after it (``compress.quant.rotate``), counted in each;
* ``quantize.bnb`` as the first streamed pass: the largest linear, read one at a time (constants
  below); its export is then scored loaded whole (transformers rebuilds its layers), as stored
  (``_bnb_export_bytes``), while the baseline is scored layer by layer;
* a model loaded whole (passes that need it, and every evaluation): 1.45 times its parameters
  in float32 (transformers casts from the stored dtype), plus the same again for a
  distillation teacher, plus a window's logits for evaluation; a mixture-of-experts model
  2.4 times (transformers fuses the experts' per-expert weights as it loads: 17.8 GB for the
  Qwen3-30B-A3B shape's first 2 layers, 1.87e9 parameters, 2026-12-05; its 4 layers, 3.11e9,
  were killed for memory at 24.6 GB before this factor).

Set ``COMPRESS_SKIP_MEMORY_CHECK=1`` to run anyway (the estimate can be wrong for a family
whose layers differ from their shapes' sum).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from compress.core.errors import RecipeError
from compress.core.registry import PASSES, pass_name_of
from compress.memory import available_memory_bytes

BASE_BYTES = 750 * 10**6  # python, torch, transformers, a tokenizer, the reader
LOAD_FACTOR = 1.45  # a model loaded whole, per float32 byte (measured, see above)
MOE_LOAD_FACTOR = 2.4  # the same for a mixture-of-experts model (measured 2.28, see above)
TEMPORARIES = 3.5  # float32 copies of the largest linear while it is quantized
FLOAT32 = 4
# RTN as the first pass reads the checkpoint one linear at a time (``compress.quant.rtn``): its
# peak follows the largest linear. Fitted to bench_memory's W4 RTN runs at 2026-12-02 (AMD EPYC,
# docs/results.md section 6): 1.76 GB on the 7B shape (largest linear 45.1 M), 2.08 GB on 13B
# (70.8 M): 12.5 bytes per parameter of that linear (its stored and float32 copies, the codes
# and the row-block temporaries) on top of 1.2 GB; the 0.45 GB above the base is resident growth
# the fit does not explain (the 1.1B shape took 0.97 GB, 0.37 GB under this line), so 10% more.
LINEAR_AT_A_TIME = ("quantize.int4_rtn", "quantize.int8_rtn")
LINEAR_BASE_BYTES = 450 * 10**6
LINEAR_BYTES_PER_PARAM = 12.5
LINEAR_SLACK = 1.1
# A layer's fused experts (MoE) under RTN as the first streamed pass: read as stored (bf16, the
# per-expert weights stacked in place, ``compress.io.names.MoeTreeReader``), then rounded one
# expert's projection at a time beside the codes and scales kept: 2 bytes per expert weight
# stored and 0.53 of 4-bit codes and scales (1.03 at 8 bits), and a little slack, on the base
# and one projection's temporaries. Measured (VmHWM, bf16 synthetic, first 2 layers, 2026-12-06,
# Intel Xeon, docs/results.md section 6): 5.15 GB for Mixtral-8x7B's shape (1.41e9 expert
# weights a layer; estimate 5.23), 2.12 GB for Qwen3-30B-A3B's (6.04e8; 2.44), 8.95 GB for
# GPT-OSS-120B's (3.19e9, g64; 9.20). (Read in float32 before: 8.42 and 4.87 GB for the first.)
EXPERT_RTN_BYTES = {4: 2.6, 8: 3.1}
ROTATION = "rotate.hadamard"
# quantize.bnb as the first streamed pass reads one linear at a time too: its peak is the float32
# weight, its dequantized copy, their difference and its square (the error the report gives) and
# the codes, 16.5 bytes per parameter of the largest linear, 10% more (LINEAR_SLACK), on the
# base and 0.1 GB of growth. Measured 2026-12-03 (bf16 synthetic Llamas, VmHWM, 2 shared cores):
# NF4 0.95 GB on the 1.1B shape (estimate 1.06), 1.44 GB in the 7B shape's first layers (1.67;
# int8 1.37); SmolLM2 NF4 0.81 GB after its baseline's evaluation (0.87).
BNB = "quantize.bnb"
BNB_BASE_BYTES = 100 * 10**6
BNB_BYTES_PER_PARAM = 16.5
# quantize.gptq keeps a streamed layer as stored (bf16) and widens one linear at a time for its
# forward; the peak is the end of the calibration forward, when the layer's Hessians (one per
# input) sit beside it: the stored layer, one float32 copy of its largest linear, the hidden
# states in and out, the Hessians (GPTQ's own state for one linear, after it, is smaller).
# Measured 2026-12-03 (VmHWM, first 2 layers, docs/results.md section 6): see _gptq_bytes.
GPTQ = "quantize.gptq"
# passes that read a streamed layer's fused experts as stored (bf16) beside the rest in float32
# (``run_calibrated(narrow="routed")``: they run and round the experts, change none in place);
# beyond the stored experts, this many bytes per expert weight: the RTN codes and scales built
# beside them (0.53) and 0.3 more the fit needs (measured AWQ W4, 2026-12-06, Intel Xeon,
# docs/results.md section 6: 10.35 GB on GPT-OSS-120B's first 2 layers, 5.54 GB on
# Mixtral-8x7B's first layer; estimates 10.61 and 6.39)
EXPERTS_AS_STORED = ("quantize.awq", "quantize.autoround")
EXPERTS_AS_STORED_BYTES = 0.9
ROTATION_TEMPORARIES = 5  # float32 copies of what is rotated at once (float64 copy + product)


class InsufficientMemoryError(RecipeError):
    """The job would not fit in the memory available."""


def _shapes(where, skeleton) -> tuple[int, int, dict[str, int]] | None:
    """(parameters in the decoder stack's largest layer, parameters outside the stack,
    {"hidden", "vocab", "intermediate"}), from the meta skeleton, or None."""
    if skeleton is None:
        return None
    from torch import nn

    from compress.arch import arch_for, decoder_layers, expert_shape, sparse_layers

    arch = arch_for(skeleton, "the memory preflight")
    layers = decoder_layers(skeleton, "the memory preflight")
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    in_stack = sum(p.numel() for p in layers.parameters())
    total = sum(p.numel() for p in skeleton.parameters())
    cfg = skeleton.config
    linears = [m.weight.numel() for m in layers[0].modules() if isinstance(m, nn.Linear)]
    projections = list(linears)  # one weight matrix each, an expert's projection included
    fused = []
    if arch.moe is not None:  # fused experts are read and quantized as one item (RTN, GPTQ)
        for i in sparse_layers(skeleton, arch):
            experts = layers[i].get_submodule(arch.moe.fused)
            fused.append(sum(p.numel() for p in experts.parameters()))
            count, hidden, inter = expert_shape(experts, arch.moe)
            projections.append(hidden * inter)
    head = skeleton.get_output_embeddings() if hasattr(skeleton, "get_output_embeddings") else None
    embed = skeleton.get_input_embeddings() if hasattr(skeleton, "get_input_embeddings") else None
    untied = head is not None and embed is not None and head.weight is not embed.weight
    dims = {"hidden": int(getattr(cfg, "hidden_size", 0) or 0),
            # the capture reads the modules outside the stack but an untied head, as stored
            "capture": (total - in_stack - (head.weight.numel() if untied else 0))
            * next(skeleton.parameters()).element_size(),
            "vocab": int(getattr(cfg, "vocab_size", 0) or 0),
            "largest_linear": max(linears + fused, default=0),
            "largest_projection": max(projections, default=0),
            "fused_experts": max(fused, default=0),
            "layer_prefix": arch.layer_prefix}
    return largest, total - in_stack, dims


def _is_moe(where, skeleton) -> bool:
    """Whether the model is a mixture of experts (its skeleton's family, else its config.json's
    model_type)."""
    from compress.arch import ARCHS, model_type

    kind = model_type(skeleton) if skeleton is not None else None
    if kind is None and isinstance(where, Path):
        try:
            kind = json.loads((where / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            return False
    arch = ARCHS.get(kind)
    return arch is not None and arch.moe is not None


def _parameter_count(where) -> int | None:
    """Parameters of a checkpoint folder from its safetensors headers (no tensor is read)."""
    if not isinstance(where, Path):
        return None
    from compress.io.wrapped import open_checkpoint

    reader = open_checkpoint(where)  # a multimodal checkpoint's text model
    count = 0
    for name in reader.names():
        numel = 1
        for dim in reader.shape(name):
            numel *= dim
        count += numel
    return count


def estimate(recipe, where, *, streamed: bool, skeleton=None,
             spill: bool = False) -> dict[str, Any]:
    """The estimated peak resident bytes of each phase of ``recipe`` on the checkpoint at
    ``where``, and the largest (``peak_bytes``). ``spill``: the calibration's hidden states
    wait in files (``calibration.activations: disk``), so only one sample's are counted."""
    phases: dict[str, int] = {}
    cal = recipe.calibration
    tokens = cal.num_samples * cal.seq_len if cal is not None else 0
    held = cal.seq_len if spill and cal is not None else tokens  # in memory between layers
    params = _parameter_count(where)
    shapes = _shapes(where, skeleton)
    if streamed and shapes is not None:
        largest, outside, dims = shapes
        # float32 copy beside the stored (16-bit) one, and the quantizer's temporaries
        # the quantizers' temporaries follow one weight matrix: fused experts are rounded one
        # expert's projection at a time (``compress.quant.experts``)
        layer = largest * (FLOAT32 + 2) + int(TEMPORARIES * dims["largest_projection"] * FLOAT32)
        hidden = 2 * held * dims["hidden"] * FLOAT32
        resident = 0  # modules outside the stack an earlier pass keeps in memory (rotated)
        for index, cfg in enumerate(recipe.passes):
            name = pass_name_of(cfg)
            need = layer + hidden
            if index == 0 and name in LINEAR_AT_A_TIME:  # reads the source one linear at a time
                need = _rtn_first_bytes(dims, bits=4 if name == LINEAR_AT_A_TIME[0] else 8)
            if index == 0 and name == BNB:  # the same, with bitsandbytes' temporaries
                need = BNB_BASE_BYTES + int(LINEAR_SLACK * BNB_BYTES_PER_PARAM
                                            * dims["largest_linear"])
            if index == 0 and name in EXPERTS_AS_STORED:  # no float32 copy of the experts
                need -= dims["fused_experts"] * FLOAT32
                need += int(EXPERTS_AS_STORED_BYTES * dims["fused_experts"])
            if name == GPTQ:
                need = _gptq_bytes(skeleton, largest, dims, hidden, first=index == 0,
                                   seq_len=cal.seq_len, held=held)
            if PASSES[name].needs_calibration:
                need += _sample_forward_bytes(skeleton, dims, cal.seq_len)
            if PASSES[name].needs_calibration and not resident:
                need = max(need, dims["capture"] + hidden)  # the capture's embedding
            kept = resident
            if name == ROTATION:
                need, kept = _rotation_bytes(skeleton, largest, outside, dims)
            phases[f"pass {index} {name}"] = BASE_BYTES + resident + need
            resident = kept
    elif params is not None:
        load = MOE_LOAD_FACTOR if _is_moe(where, skeleton) else LOAD_FACTOR
        whole = int(params * FLOAT32 * load)
        teacher = any(PASSES[pass_name_of(c)].needs_teacher for c in recipe.passes)
        hidden = 0
        if shapes is not None:
            hidden = 2 * held * shapes[2]["hidden"] * FLOAT32
        phases["passes (model loaded whole)"] = BASE_BYTES + whole * (2 if teacher else 1) + hidden
    if streamed and shapes is not None and layerwise_eval(recipe) and (
            recipe.eval.perplexity is not None):
        phases["eval (layer by layer)"] = BASE_BYTES + _layerwise_eval_bytes(recipe, shapes)
        if not layerwise_export_eval(recipe):
            window = recipe.eval.perplexity.context_length * shapes[2]["vocab"] * FLOAT32 * 3
            phases["eval of the export (loaded whole)"] = (
                BASE_BYTES + _bnb_export_bytes(recipe, skeleton) + window)
    elif params is not None and (recipe.eval.perplexity is not None
                                 or recipe.eval.tasks is not None
                                 or recipe.eval.latency is not None):
        window = 0
        if shapes is not None and recipe.eval.perplexity is not None:
            window = recipe.eval.perplexity.context_length * shapes[2]["vocab"] * FLOAT32 * 3
        load = MOE_LOAD_FACTOR if _is_moe(where, skeleton) else LOAD_FACTOR
        phases["eval (model loaded whole)"] = (BASE_BYTES + int(params * FLOAT32 * load)
                                               + window)
    peak = max(phases.values()) if phases else None
    return {"phases_bytes": phases, "peak_bytes": peak, "model_parameters": params}


def _sample_forward_bytes(skeleton, dims: dict[str, int], seq_len: int) -> int:
    """One calibration sample through a decoder layer, in float32: the attention scores of
    every head (``[heads, T, T]``, which the CPU's scaled-dot-product attention builds for
    long samples) and six ``[T, I]``-sized activations (gate, up, the activation, the product,
    its Hessian's input, the output). Negligible at 512 tokens; at 2048 on the 1.1B shape
    0.82 GB, which the estimate missed (3.42 GB for 4.13 measured on a bf16 checkpoint, GPTQ
    at 64 x 2048, docs/results.md section 6; 4.02 GB with it)."""
    cfg = skeleton.config
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    inter = max(int(getattr(cfg, key, 0) or 0)
                for key in ("intermediate_size", "moe_intermediate_size", "hidden_size"))
    return (heads * seq_len * seq_len + 6 * seq_len * inter) * FLOAT32


def _rtn_first_bytes(dims: dict[str, int], *, bits: int) -> int:
    """RTN as the first streamed pass (see ``LINEAR_AT_A_TIME``): the largest linear read alone,
    or a layer's fused experts (``EXPERT_RTN_BYTES``) with one projection's error
    temporaries."""
    dense = LINEAR_SLACK * (LINEAR_BASE_BYTES + LINEAR_BYTES_PER_PARAM * max(
        dims["largest_linear"] - dims["fused_experts"], 0))
    if dims["fused_experts"]:
        dense = max(dense, LINEAR_SLACK * LINEAR_BYTES_PER_PARAM * dims["largest_projection"]
                    + EXPERT_RTN_BYTES[bits] * dims["fused_experts"])
    return int(dense)


def layerwise_eval(recipe) -> bool:
    """Whether a streamed job scores layer by layer (host memory: one layer, not the model):
    only perplexity and KL are asked for (tasks and latency need the model whole). On a GPU
    each layer runs there in turn (``compress.eval.quality._score_windows_layerwise``)."""
    return recipe.eval.tasks is None and recipe.eval.latency is None


def layerwise_export_eval(recipe) -> bool:
    """Whether a streamed job scores its export layer by layer too: ``layerwise_eval``, but
    not a bitsandbytes export (transformers' loader rebuilds its layers; it is loaded whole,
    4-bit or 8-bit as stored, ``_bnb_export_bytes``)."""
    return layerwise_eval(recipe) and not any(pass_name_of(c) == BNB for c in recipe.passes)


def _bnb_export_bytes(recipe, skeleton) -> int:
    """Bytes of a bitsandbytes export loaded whole: each targeted ``nn.Linear`` as stored
    (4-bit: half a byte per weight and a float32 absmax per block of 64, or a uint8 one with
    double quantization; int8: a byte per weight and a float32 scale per row), every other
    parameter in float32 (the export keeps the model's dtype). transformers holds them as
    stored, with no float32 copy: the 1.1B shape's NF4 export (1.07 GB) took 1.67 GB loaded
    with a 512-token forward, estimate 2.02 GB with the base and the logits (2026-12-03)."""
    from torch import nn

    from compress.core.matcher import target_modules

    cfg = next(c for c in recipe.passes if pass_name_of(c) == BNB)
    total = sum(p.numel() for p in skeleton.parameters()) * FLOAT32
    for _, module in target_modules(skeleton, cfg):
        if type(module) is not nn.Linear:
            continue
        n = module.weight.numel()
        if cfg.format == "int8":
            stored = n + module.out_features * FLOAT32
        else:
            stored = n // 2 + -(-n // 64) * (1 if cfg.double_quant else FLOAT32)
        total += stored - n * FLOAT32
    return total


def _layerwise_eval_bytes(recipe, shapes) -> int:
    """Layer-by-layer scoring (``compress.eval.quality``): one decoder layer in float32 beside
    its stored copy (and a quantized layer's dequantized copy), or the modules outside the
    stack in float32 with a forward batch's logits (three float32 copies), plus the hidden
    states of the windows (capped by the scorer's own ``LAYERWISE_HIDDEN_BYTES``)."""
    from compress.eval.quality import LAYERWISE_HIDDEN_BYTES, WINDOWS_PER_FORWARD

    largest, outside, dims = shapes
    ppl = recipe.eval.perplexity
    windows = ppl.limit if ppl.limit is not None else 1 << 20
    hidden = min(LAYERWISE_HIDDEN_BYTES,
                 2 * windows * ppl.context_length * dims["hidden"] * FLOAT32)
    logits = 3 * WINDOWS_PER_FORWARD * ppl.context_length * dims["vocab"] * FLOAT32
    # a quantized layer is read as codes and scored through a dequantized float32 copy: the
    # 13B shape's export took 0.84 GB more than its bf16 baseline (3.06 vs 2.22 GB, W4 RTN,
    # docs/results.md section 6), 2.6 bytes per parameter of a layer: 1.5x the float layer
    return max(int(1.5 * largest * (FLOAT32 + 2)), outside * FLOAT32 + logits) + hidden


def _rotation_bytes(skeleton, largest: int, outside: int,
                    dims: dict[str, int]) -> tuple[int, int]:
    """A streamed ``rotate.hadamard``: (its peak above what was resident, the float32 bytes of
    the modules outside the stack it leaves resident). The layers come first, then the final
    norm, embedding and head (a tied head gets its own copy: the final norm's weight is rarely
    exactly 1), each read beside its stored 16-bit copy and rotated a chunk of rows at a time."""
    from compress.quant.rotate import CHUNK_ROWS

    hidden, vocab = dims["hidden"], dims["vocab"]
    head, embed = skeleton.get_output_embeddings(), skeleton.get_input_embeddings()
    # a meta skeleton's tied head is a tensor of its own already; a resident tie is one tensor
    untied = outside + (head.weight.numel() if head.weight is embed.weight else 0)
    kept = untied * FLOAT32
    layer = (largest * (FLOAT32 + 2)
             + ROTATION_TEMPORARIES * dims["largest_linear"] * FLOAT32)
    ends = (kept + 2 * vocab * hidden
            + ROTATION_TEMPORARIES * min(vocab, CHUNK_ROWS) * hidden * FLOAT32)
    matrix = hidden * hidden * 8  # float64 [H, H]
    return matrix + max(layer, ends), kept


def _gptq_bytes(skeleton, largest: int, dims: dict[str, int], hidden: int, *,
                first: bool, seq_len: int, held: int) -> int:
    """GPTQ's streamed layer (see ``GPTQ``): read from the checkpoint in its own dtype when it
    is the first pass, else from an earlier pass's float32 scratch file, one weight matrix (a
    dense linear or one expert's projection: ``viewed_experts``) widened at a time; with an MoE
    layer's experts, ``_expert_gptq_bytes``."""
    stored = next(skeleton.parameters()).element_size() if first else FLOAT32
    widened = dims["largest_projection"] * FLOAT32 if stored < FLOAT32 else 0
    return (largest * stored + widened + hidden + _hessian_bytes(skeleton)
            + _expert_gptq_bytes(skeleton, dims, seq_len, held))


# GPTQ of an MoE layer (``compress.quant.gptq.gptq_experts``) builds the layer's quantized
# experts while its float ones are resident (as stored: ``viewed_experts`` runs them one
# expert's projection at a time): this many bytes per expert weight, the 4-bit codes and their
# scales (0.53) and slack. Measured W4 GPTQ, 16 x 512 tokens (VmHWM, first 2 layers,
# 2026-12-06, Intel Xeon, docs/results.md section 6): GPT-OSS-120B 9.51 GB (estimate 9.69),
# GPT-OSS-20B 3.14 (3.48), Mixtral-8x7B 5.26 (6.43), Qwen3-30B-A3B 2.42 (2.81).
EXPERT_CODES_BYTES = 0.6


def _expert_gptq_bytes(skeleton, dims: dict[str, int], seq_len: int, held: int) -> int:
    """An MoE layer's GPTQ beyond the dense terms: its quantized experts being built
    (``EXPERT_CODES_BYTES``), the ``held`` calibration tokens entering them in float32
    ``[T, H]`` (kept as the hidden states are: in files with ``activations: disk``), and, one
    expert and one sample at a time (its Hessians are summed sample by sample), that sample's
    routed tokens and down's inputs and their temporaries ``[T_e, H + 4 I]``, ``T_e`` taken as
    twice the even share (``2 k / E`` of the sample's tokens; random routers are uneven)."""
    if not dims["fused_experts"]:
        return 0
    from compress.arch import ARCHS, decoder_layers, expert_shape, model_type, sparse_layers

    arch = ARCHS[model_type(skeleton)]
    layer = decoder_layers(skeleton, "the memory preflight")[sparse_layers(skeleton, arch)[0]]
    router = layer.get_submodule(arch.moe.router)
    share = min(1.0, 2 * router.top_k / router.num_experts)
    inter = expert_shape(layer.get_submodule(arch.moe.fused), arch.moe)[2]
    routed = int(share * seq_len * (dims["hidden"] + 4 * inter) * FLOAT32)
    return (int(EXPERT_CODES_BYTES * dims["fused_experts"])
            + held * dims["hidden"] * FLOAT32 + routed)


def _hessian_bytes(skeleton) -> int:
    """GPTQ's Hessians for one decoder layer, all alive while the layer's inputs are collected:
    one float32 [in, in] per input, the linears that read one input (q/k/v, gate/up: the
    consumers of one of the family's scale mappings) sharing it (``HessianHooks``); an MoE
    layer's experts then one at a time (gate/up's [H, H] beside down's [I, I])."""
    from torch import nn

    from compress.arch import ARCHS, decoder_layers, expert_shape, model_type, sparse_layers

    arch = ARCHS.get(model_type(skeleton))
    groups = [m.consumers for m in arch.awq_mappings] if arch is not None else []
    layer = decoder_layers(skeleton, "the memory preflight")[0]
    inputs: dict[tuple[str, ...], int] = {}
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear):
            group = next((g for g in groups if name in g), (name,))
            inputs[group] = module.in_features ** 2 * FLOAT32
    experts = 0
    if arch is not None and arch.moe is not None and sparse_layers(skeleton, arch):
        fused = decoder_layers(skeleton, "the memory preflight")[
            sparse_layers(skeleton, arch)[0]].get_submodule(arch.moe.fused)
        _, hidden, inter = expert_shape(fused, arch.moe)
        experts = (hidden * hidden + inter * inter) * FLOAT32
    return sum(inputs.values()) + experts


def check_memory(recipe, where, *, streamed: bool, skeleton=None) -> dict[str, Any]:
    """``estimate`` of the job, or a ``RecipeError`` before any work when its peak exceeds
    the memory available (the message names the phase, the need, what is there and the way
    out). Returns the estimate with ``available_bytes`` for the report."""
    wanted = recipe.calibration.activations if recipe.calibration is not None else "memory"
    result = estimate(recipe, where, streamed=streamed, skeleton=skeleton,
                      spill=wanted == "disk")
    available = available_memory_bytes()
    if wanted == "auto" and not _fits(result["peak_bytes"], available):
        spilled = estimate(recipe, where, streamed=streamed, skeleton=skeleton, spill=True)
        if _fits(spilled["peak_bytes"], available):  # the hidden states go to files
            result, wanted = spilled, "disk"
    result["activations"] = "disk" if wanted == "disk" else "memory"
    result["available_bytes"] = available
    peak = result["peak_bytes"]
    if _fits(peak, available):
        return result
    phase = max(result["phases_bytes"], key=result["phases_bytes"].get)
    ways = []
    if phase == "eval of the export (loaded whole)":
        ways.append("leave evaluation out (`--set eval.baseline=false --set "
                    "eval.perplexity=null`): a bitsandbytes export is scored loaded whole")
    elif "eval" in phase:
        ways.append("leave tasks and latency out of eval (perplexity and KL alone are scored "
                    "layer by layer on the CPU), or leave evaluation out (`--set "
                    "eval.baseline=false --set eval.perplexity=null`) and score the export "
                    "with `compress eval --layer-by-layer`")
    if "whole" in phase and "eval" not in phase:
        ways.append("use layer-wise passes only (quantize.int4_rtn/int8_rtn/gptq/awq/"
                    "smoothquant/autoround and rotate.hadamard stream one decoder layer at a "
                    "time)")
    if recipe.calibration is not None and "pass" in phase:
        if wanted == "memory" and _fits(estimate(recipe, where, streamed=streamed,
                                                 skeleton=skeleton, spill=True)["peak_bytes"],
                                        available):
            ways.append("set calibration.activations to disk or auto (the hidden states between "
                        "decoder layers then wait in files beside the output; same result)")
        least = dataclasses.replace(recipe, calibration=recipe.calibration.model_copy(
            update={"num_samples": 1}))
        floor = min(estimate(least, where, streamed=streamed, skeleton=skeleton,
                             spill=spill)["peak_bytes"] for spill in (False, True))
        if _fits(floor, available):
            ways.append("lower calibration.num_samples or seq_len")
        else:  # the layer's own weights and their working copies fill it, not the samples
            ways.append(f"fewer calibration samples do not help: with one it still needs "
                        f"about {floor / 2**30:.1f} GiB (one decoder layer's "
                        "weights and the pass's work on them); a machine with more memory does, "
                        "or a pass without calibration (quantize.int4_rtn needs less)")
    _refuse(phase, peak, available, ways)


def whole_load_bytes(where, dtype=None) -> int | None:
    """Peak resident bytes of loading the checkpoint at ``where`` whole (``compress.load``), from
    its headers: a plain checkpoint's floating tensors as float32 (``dtype``: in that dtype); a
    compressed one's as ``load_compressed`` keeps them (``keeps_stored_dtype``: codes, scales
    and large dense bf16 tensors as stored, the rest as float32; a tensor beside a
    ``weight_scale`` belongs to a quantized layer). None for a hub id or a folder without
    safetensors."""
    if not isinstance(where, Path):
        return None
    import torch

    from compress.core.errors import ModelLoadError
    from compress.io.load import is_compressed_checkpoint
    from compress.io.stream import keeps_stored_dtype
    from compress.io.wrapped import open_checkpoint

    try:
        reader = open_checkpoint(where)  # a multimodal checkpoint's text model
    except ModelLoadError:
        return None
    compressed = is_compressed_checkpoint(where)
    names = set(reader.names())
    total = 0
    for name in names:
        numel = 1
        for dim in reader.shape(name):
            numel *= dim
        stored = reader.dtype(name)
        quantized = f"{name.rpartition('.')[0]}.weight_scale" in names
        kept = (keeps_stored_dtype(name, stored, numel, torch.float32, quantized=quantized)
                if compressed else not stored.is_floating_point or name.endswith("weight_scale"))
        wide = FLOAT32 if dtype is None or compressed else torch.finfo(dtype).bits // 8
        total += reader.nbytes(name) if kept else numel * wide
    # transformers fuses a plain MoE checkpoint's experts as it loads; load_compressed reads a
    # compressed one module by module, as a dense one
    moe = not compressed and _is_moe(where, None)
    return BASE_BYTES + int(total * (MOE_LOAD_FACTOR if moe else LOAD_FACTOR))


def check_whole_loads(phase: str, models: list[str], way_out: str, *, dtype=None,
                      extra: int = 0) -> None:
    """``check_phase`` for loading ``models`` (names, folders) whole, all at once (``dtype``:
    a plain checkpoint's, ``whole_load_bytes``), before the first loads: their peaks summed, the
    process's base counted once, plus ``extra`` bytes (serve's KV cache); a model whose size
    cannot be read (a hub id) adds nothing."""
    from compress.io.load import resolve_model_path

    needs = [n for n in (whole_load_bytes(resolve_model_path(m), dtype) for m in models)
             if n is not None]  # fmt: skip
    if needs:
        check_phase(phase, sum(needs) - BASE_BYTES * (len(needs) - 1) + extra, way_out)


def check_phase(phase: str, need: int | None, way_out: str) -> None:
    """The same refusal for work outside a job (``compress tune``'s sensitivity measurement):
    ``need`` bytes at the peak of ``phase`` (None: unknown, not checked)."""
    available = available_memory_bytes()
    if not _fits(need, available):
        _refuse(phase, need, available, [way_out])


def _fits(need: int | None, available: int | None) -> bool:
    return (need is None or available is None or need <= available
            or os.environ.get("COMPRESS_SKIP_MEMORY_CHECK") == "1")


def _refuse(phase: str, need: int, available: int, ways: list[str]):
    gib = 2**30
    ways = [*ways, "free memory or use a machine with more (COMPRESS_SKIP_MEMORY_CHECK=1 runs "
            "anyway)"]
    raise InsufficientMemoryError(
        f"this job needs about {need / gib:.1f} GiB in its phase '{phase}' but "
        f"{available / gib:.1f} GiB of memory is available; nothing was written. Way out: "
        + "; or ".join(ways)
    )
