"""The compressed-tensors ``quantization_config`` of an export, and the codes as it stores them.

Formats (``stored_format``): ``pack-quantized`` for int4 (eight codes an int32) and symmetric
weight-only int8 (four codes an int32, ``compress.kernels.reference.pack_int8``), as
llm-compressor writes W4A16 and W8A16; ``int-quantized`` (int8 ``weight``) for W8A8 layers,
which quantize their inputs too, and asymmetric int8. Weight-only int8 was written
``int-quantized`` before: plain transformers (5.25) decompresses per-expert MoE weights only
when packed (an int8 expert's pair ended its load in "Ckpt contains: 0"). In memory the int8
layers hold ``weight`` int8 ``[N, K]`` either way: ``pack_int8_codes`` packs at export,
``compress.io.checkpoint.CheckpointReader`` unpacks at load (older exports read as they are).

One config group per (scheme, activation quantization); one group targets the class
``Linear``, several name their layers. An MoE model's quantized experts are named by ``re:``
patterns holding ``experts``: plain transformers takes the first such group as the scheme of
every expert (``get_experts_scheme``), the digit-generalized pattern (``layers\\.\\d+``) when it
selects no layer of another group and no float one, else one anchored pattern per layer.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from compress.arch import model_type
from compress.core.errors import ModelLoadError
from compress.io.names import checkpoint_renamer, checkpoints_store_experts_fused, moe_float_linears
from compress.io.wrapped import exported_passthrough, ignore_patterns, wrapped_of, wrapper_names
from compress.kernels.reference import pack_int8
from compress.quant.kv_scales import KV_CACHE_SCHEME, has_kv_scales
from compress.quant.linear import INPUT_ACTIVATIONS, QuantExperts, QuantLinear, WeightScheme

log = logging.getLogger(__name__)


def weights_args(scheme: WeightScheme) -> dict[str, Any]:
    return {
        "num_bits": scheme.n_bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "group_size": scheme.group_size,
        "strategy": "channel" if scheme.group_size is None else "group",
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def scheme_from_args(args: dict[str, Any], scale_dtype: torch.dtype) -> WeightScheme:
    """The ``WeightScheme`` of a config group's ``weights``, or a ModelLoadError naming what
    compress does not load."""
    if args.get("type", "int") != "int" or args.get("num_bits") not in (4, 8):
        raise ModelLoadError(f"unsupported weight quantization {args}: compress loads int4/int8")
    if args.get("strategy", "channel") not in ("channel", "group"):  # was blamed on a shape
        raise ModelLoadError(f"unsupported weight quantization {args}: strategy "
                             f"{args.get('strategy')!r}; compress loads 'channel' and 'group'")
    group = args.get("group_size") if args.get("strategy") == "group" else None
    if group is not None and (type(group) is not int or group <= 0):  # bool is an int
        raise ModelLoadError(f"unsupported weight quantization {args}: group_size must be a "
                             "positive integer (or strategy channel); fix config.json")
    if not isinstance(args.get("symmetric", True), bool):  # bool("false") would be True
        raise ModelLoadError(f"unsupported weight quantization {args}: symmetric must be true "
                             "or false; fix config.json")
    return WeightScheme(args["num_bits"], group, args.get("symmetric", True), scale_dtype)


def stored_format(scheme: WeightScheme, w8a8: bool) -> str:
    """The compressed-tensors format a layer of ``scheme`` is written in (module docstring).
    Asymmetric int8 stays ``int-quantized``: compressed-tensors 0.20 builds a packed layer's
    zero point unpacked, so plain transformers refuses the packed one it stores (as for
    asymmetric int4: tests/quant/test_foundation_quantize_export.py)."""
    packs = scheme.n_bits == 4 or (scheme.symmetric and not w8a8)
    return "pack-quantized" if packs else "int-quantized"


def pack_int8_codes(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """In ``tensors`` (module-tree names, in place): the ``weight`` of each int8 layer
    ``stored_format`` packs as ``weight_packed`` and ``weight_shape``."""
    for name in [n for n, t in tensors.items() if t.dtype == torch.int8]:
        module, _, leaf = name.rpartition(".")
        layer = model.get_submodule(module) if leaf == "weight" else None
        if not isinstance(layer, QuantLinear) or layer.scheme.n_bits != 8 or stored_format(
                layer.scheme, hasattr(layer, "input_activations")) != "pack-quantized":
            continue
        codes = tensors.pop(name)
        tensors[f"{module}.weight_packed"] = pack_int8(codes)
        tensors[f"{module}.weight_shape"] = torch.tensor(codes.shape, dtype=torch.int64)


def _generalized(name: str) -> str:
    """An anchored ``re:`` pattern of ``name`` with each number in it (a layer's, an
    expert's index) standing for any."""
    return "re:^" + r"\.".join(r"\d+" if p.isdigit() else re.escape(p)
                               for p in name.split(".")) + "$"


def _expert_targets(experts: list[str], others: list[str]) -> list[str]:
    """``re:`` targets selecting exactly ``experts`` among ``experts + others`` (names)."""
    patterns = sorted({_generalized(n) for n in experts})
    compiled = [re.compile(p[3:]) for p in patterns]
    if any(c.match(n) for n in others for c in compiled):
        return ["re:^" + re.escape(n) + "$" for n in sorted(experts)]
    return patterns


def quantization_config(model: nn.Module) -> dict[str, Any] | None:
    """compressed-tensors ``quantization_config`` describing the model's quantized layers."""
    by_scheme: dict[tuple[WeightScheme, bool], list[str]] = defaultdict(list)
    rename, wrapped = checkpoint_renamer(model), wrapped_of(model)

    def names(name: str) -> list[str]:
        # a dense family's module renamed in its checkpoints (GPT-NeoX's embed_out) is listed
        # under both names: transformers 5 matches its own tree's (lm_head), vLLM the other;
        # an MoE model's renamed block too (vLLM's MiniMax-M2 names it mlp, stored
        # block_sparse_moe; Phi-3.5-MoE's router is a Linear named router, stored gate:
        # renamings match weight names); a wrapper's text module under the wrapper's two
        own = sorted({name, rename(name + ".weight").removesuffix(".weight")})
        return own if wrapped is None else sorted({w for n in own
                                                  for w in wrapper_names(wrapped, n)})

    plain_linears = [w for n in moe_float_linears(model) for w in names(n)]  # routers, experts
    in_experts = {f"{n}.{c}" for n, m in model.named_modules() if isinstance(m, QuantExperts)
                  for c, q in m.named_modules() if isinstance(q, QuantLinear)}
    expert_names: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            # W8A8 layers also quantize their inputs: a separate group
            by_scheme[(module.scheme, hasattr(module, "input_activations"))] += names(name)
            if name in in_experts:
                expert_names.update(names(name))
        elif isinstance(module, nn.Linear):
            plain_linears += names(name)
    _warn_unread_experts(model, by_scheme, expert_names)
    kv_scheme = dict(KV_CACHE_SCHEME) if has_kv_scales(model) else None
    if not by_scheme and kv_scheme is None:
        return None
    single = len(by_scheme) == 1
    groups = {}
    # the experts' groups first: transformers takes the first as every expert's scheme
    ordered = sorted(by_scheme.items(), key=lambda item: not expert_names & set(item[1]))
    for index, ((scheme, w8a8), members) in enumerate(ordered):
        experts = [n for n in members if n in expert_names]
        others = [n for m in by_scheme.values() for n in m if n not in experts]
        groups[f"group_{index}"] = {
            # One scheme: target the class and list the rest under `ignore`; several schemes:
            # name each layer (compressed-tensors matches exact module names), the experts
            # by patterns
            "targets": ["Linear"] if single else (
                sorted(set(members) - expert_names)
                + (_expert_targets(experts, others + plain_linears) if experts else [])),
            "weights": weights_args(scheme),
            "input_activations": dict(INPUT_ACTIVATIONS) if w8a8 else None,
            "output_activations": None,
            "format": stored_format(scheme, w8a8),
        }
    # no quantized weight (an fp8 KV cache alone): compressed-tensors' "dense"
    formats = {group["format"] for group in groups.values()} or {"dense"}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(set(plain_linears)) + ignore_patterns(
            exported_passthrough(model).values()),
        # fp8 KV-cache scales (quantize.kv_cache_fp8): self_attn.k_scale / v_scale per layer
        "kv_cache_scheme": kv_scheme,
        "global_compression_ratio": None,
    }


def _warn_unread_experts(model: nn.Module, by_scheme: dict, expert_names: set[str]) -> None:
    """Say which quantized experts plain transformers (5.25) cannot read: a family it reads
    only fused, or experts under more than one scheme (it takes one for every expert)."""
    if not expert_names:
        return
    if checkpoints_store_experts_fused(model):
        log.warning("%s checkpoints store the expert weights fused and transformers reads "
                    "them only so: the quantized expert weights are written per expert, which "
                    "compress.load reads and plain transformers does not (it would initialize "
                    "them anew); which vLLM reads: docs/results.md", model_type(model))
        return
    schemes = [key[0] for key, members in by_scheme.items() if expert_names & set(members)]
    if len(schemes) > 1:
        log.warning("%s: the quantized expert weights use %d schemes (%s); plain transformers "
                    "(5.25) reads every expert with one scheme, so it cannot load this export; "
                    "compress.load does. Give every expert one scheme for it",
                    model_type(model), len(schemes), ", ".join(s.describe() for s in schemes))
    elif not schemes[0].symmetric:  # its per-expert decompression takes no zero points
        log.warning("%s: the quantized expert weights are asymmetric (%s); plain transformers "
                    "(5.25) decompresses them without zero points (\"Asymmetric quant requires "
                    "zero-point values\"), so it cannot load this export; compress.load does. "
                    "Quantize the expert weights symmetric for it", model_type(model),
                    schemes[0].describe())
