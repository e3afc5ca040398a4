"""Checkpoint writing in the compressed-tensors layout (atomic), and loading it back.

A checkpoint directory holds ``model.safetensors`` (QuantLinear buffers under the
compressed-tensors names, other tensors in the export dtype), ``config.json`` with a
``quantization_config`` (``quant_method: compressed-tensors``; ``pack-quantized`` for int4,
``int-quantized`` for int8; one config group per distinct scheme), the tokenizer files, the
resolved ``recipe.yaml`` and ``report.json``. Plain transformers loads it when the
``compressed-tensors`` package is installed; ``load_compressed`` loads it with our backends.

Writes go to a temporary sibling directory that is renamed into place at the end, so a crash or
a bad input never leaves a half-written checkpoint at the target path.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from compress.errors import ModelLoadError
from compress.modules import QuantLinear, WeightScheme

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TORCH_TO_NAME = {v: k for k, v in DTYPES.items()}


# ---- quantization_config ------------------------------------------------------------------
def _weights_args(scheme: WeightScheme) -> dict[str, Any]:
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


def quantization_config(model: nn.Module) -> dict[str, Any] | None:
    """compressed-tensors ``quantization_config`` describing the model's QuantLinear layers."""
    by_scheme: dict[tuple[WeightScheme, bool], list[str]] = defaultdict(list)
    plain_linears = []
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            # W8A8 layers (compress.smoothquant) also quantize their inputs: a separate group
            by_scheme[(module.scheme, hasattr(module, "input_activations"))].append(name)
        elif isinstance(module, nn.Linear):
            plain_linears.append(name)
    if not by_scheme:
        return None
    single = len(by_scheme) == 1
    groups = {}
    for index, ((scheme, w8a8), names) in enumerate(by_scheme.items()):
        groups[f"group_{index}"] = {
            # One scheme: target the class and list the rest under `ignore`; several schemes:
            # name each layer exactly (compressed-tensors matches exact module names).
            "targets": ["Linear"] if single else sorted(names),
            "weights": _weights_args(scheme),
            "input_activations": _w8a8_input_args() if w8a8 else None,
            "output_activations": None,
            "format": scheme.format,
        }
    formats = {scheme.format for scheme, _ in by_scheme}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(plain_linears),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def _w8a8_input_args() -> dict[str, Any]:
    from compress.smoothquant import INPUT_ACTIVATIONS

    return dict(INPUT_ACTIVATIONS)


def _scheme_from_args(args: dict[str, Any], scale_dtype: torch.dtype) -> WeightScheme:
    if args.get("type", "int") != "int" or args.get("num_bits") not in (4, 8):
        raise ModelLoadError(f"unsupported weight quantization {args}: compress loads int4/int8")
    group = args.get("group_size") if args.get("strategy") == "group" else None
    return WeightScheme(args["num_bits"], group, bool(args.get("symmetric", True)), scale_dtype)


def _matches(name: str, module: nn.Module, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target == type(module).__name__


# ---- writing ------------------------------------------------------------------------------
def _state_dict_for_export(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # tied to the input embedding; transformers re-ties it on load
        if tensor.is_floating_point() and not name.endswith(("weight_scale",)):
            tensor = tensor.to(dtype)
        ptr = tensor.data_ptr()
        tensor = tensor.detach().cpu().contiguous()
        if ptr in seen and tensor.numel():
            tensor = tensor.clone()
        seen.add(ptr)
        tensors[name] = tensor
    return tensors


def check_writable(out_dir: Path) -> None:
    """Fail before any work if the checkpoint cannot be written at ``out_dir``."""
    parent = out_dir.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot create output directory {parent}: {exc}") from exc
    if not os.access(parent, os.W_OK):
        raise ModelLoadError(f"output directory {parent} is not writable; choose another --out")
    if out_dir.exists() and not out_dir.is_dir():
        raise ModelLoadError(f"{out_dir} exists and is not a directory; choose another --out")


@contextlib.contextmanager
def atomic_directory(out_dir: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces ``out_dir`` in one rename.

    On any exception the temporary directory is removed and ``out_dir`` (new or previous) is
    left exactly as it was, so nothing half-written ever appears at the target path.
    """
    check_writable(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_provenance(
    directory: Path, tokenizer: Any, recipe_yaml: str | None, report: dict[str, Any] | None
) -> None:
    """Tokenizer files, the resolved recipe and report.json beside a checkpoint's weights."""
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    if recipe_yaml is not None:
        (directory / "recipe.yaml").write_text(recipe_yaml)
    if report is not None:
        (directory / "report.json").write_text(json.dumps(report, indent=2, default=str))


def export_checkpoint(
    model: nn.Module,
    tokenizer: Any,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    recipe_yaml: str | None = None,
    report: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint atomically to ``out_dir`` (replacing an existing one) and return it."""
    if any(type(m).__module__.startswith("bitsandbytes") for m in model.modules()):
        # bitsandbytes layers have their own format: transformers' save_pretrained writes it.
        from compress.bnb import export_bnb_checkpoint

        return export_bnb_checkpoint(
            model, tokenizer, out_dir, dtype=dtype, recipe_yaml=recipe_yaml, report=report
        )
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        save_file(
            _state_dict_for_export(model, DTYPES[dtype]),
            tmp / "model.safetensors",
            metadata={"format": "pt"},
        )
        config = model.config.to_dict()
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
        quant = quantization_config(model)
        if quant is not None:
            config["quantization_config"] = quant
        else:
            config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        write_provenance(tmp, tokenizer, recipe_yaml, report)
    return out_dir


# ---- loading ------------------------------------------------------------------------------
def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory; corrupt or partial files are a clear error."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(
                f"{file} is corrupt or partially written ({exc}); re-export the checkpoint"
            ) from exc
    return tensors


def load_compressed(
    path: str | Path, *, dtype: torch.dtype = torch.float32, backend: str = "auto"
) -> nn.Module:
    """Build the model from ``config.json``, swap in QuantLinear layers, load the tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    quant = raw.get("quantization_config") or {}
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # Built on CPU (not meta) so that non-persistent buffers such as rotary frequencies are
    # initialised by the model's own code; the float weights are then replaced by assignment.
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = read_tensors(path)
    ignore = quant.get("ignore", [])
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or any(_matches(name, module, t) for t in ignore):
            continue
        for group in quant.get("config_groups", {}).values():
            if any(_matches(name, module, t) for t in group["targets"]):
                scale = tensors.get(f"{name}.weight_scale")
                if scale is None:
                    raise ModelLoadError(f"{path}: {name}.weight_scale is missing")
                scheme = _scheme_from_args(group["weights"], scale.dtype)
                cls = QuantLinear
                if (group.get("input_activations") or {}).get("strategy") == "token":
                    from compress.smoothquant import W8A8Linear as cls  # dynamic int8 inputs
                quant_linear = cls(
                    module.in_features,
                    module.out_features,
                    scheme,
                    bias=module.bias is not None,
                    dtype=dtype,
                    backend=backend,
                )
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, quant_linear)
                break
    tensors = {k: (v.to(dtype) if v.is_floating_point() and not k.endswith("weight_scale") else v)
               for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: checkpoint does not match its config: missing {missing[:10]}, "
            f"unexpected {unexpected[:10]}; re-export it"
        )
    return model
