"""Checkpoint writing in the compressed-tensors layout (atomic), and loading it back.

A checkpoint directory holds ``model.safetensors`` (QuantLinear buffers under the
compressed-tensors names, other tensors in the export dtype), ``config.json`` with a
``quantization_config`` (``compress.io.quant_config``: ``pack-quantized`` for weight-only int4
and int8, ``int-quantized`` for W8A8; one config group per distinct scheme), the tokenizer
files, the resolved ``recipe.yaml`` and ``report.json``. Plain transformers loads it when the
``compressed-tensors`` package is installed; ``load_compressed`` loads it with our backends.

A model holding bitsandbytes layers is written in bitsandbytes' own format instead
(transformers' ``save_pretrained``). This module imports no pass. Writes go to a temporary
sibling directory renamed into place at the end: a crash or a bad input never leaves a
half-written checkpoint at the target path.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.arch import expert_shape, fused_experts, output_weight_key, sparse_layers
from compress.core.errors import ModelLoadError, RecipeError
from compress.core.matcher import matches
from compress.core.registry import DTYPES
from compress.io.checkpoint import check_stored, config_group_for, stored_dtype_name
from compress.io.names import (
    MoeTreeReader,
    checkpoint_renamer,
    model_name_aliases,
    moe_arch,
    split_float_experts,
    stored_renamer,
    tree_name,
    tree_reader,
    under_model_names,
)
from compress.io.quant_config import pack_int8_codes, quantization_config, scheme_from_args
from compress.io.stream import (
    SCALE_SUFFIXES,
    causal_lm_config,
    compute_narrow_in,
    keeps_stored_dtype,
    no_weight_init,
)
from compress.io.wrapped import (
    add_passthrough,
    copy_processor_files,
    mark,
    open_checkpoint,
    text_quantization_config,
    wrapped_of,
    wrapped_text,
    wrapper_config,
)
from compress.output_dir import atomic_directory
from compress.quant.kv_scales import add_kv_scale_buffers
from compress.quant.linear import (
    QuantExperts,
    QuantLinear,
    W8A8Linear,
    WeightScheme,
    is_bnb_module,
)

log = logging.getLogger(__name__)


def resolve_export_dtype(dtype: str, source: str | os.PathLike[str] | None = None) -> str:
    """The dtype name dense tensors are written in. ``auto``: the dtype the source checkpoint
    (a folder with config.json) is stored in when it is 16-bit, else ``bfloat16`` (a float32
    embedding would outweigh int4 layers; measured on SmolLM2 W4 in docs/results.md)."""
    if dtype != "auto":
        return dtype
    stored = stored_dtype_name(source) if source is not None else None
    return stored if stored in ("bfloat16", "float16") else "bfloat16"


# ---- writing ------------------------------------------------------------------------------
def _state_dict_for_export(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = _plain_state_dict(model, dtype)
    split_float_experts(model, tensors)
    pack_int8_codes(model, tensors)
    rename = stored_renamer(model)
    return {rename(name): tensor for name, tensor in tensors.items()}


def _plain_state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    head_key = _tied_head_key(model)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if name == head_key:
            continue  # tied to the input embedding; transformers re-ties it on load
        ptr = tensor.data_ptr()
        tensor = export_tensor(name, tensor, dtype)
        if ptr in seen and tensor.numel():
            tensor = tensor.clone()
        seen.add(ptr)
        tensors[name] = tensor
    return tensors


def _tied_head_key(model: nn.Module) -> str | None:
    """The output head's state-dict key when it is tied to the embedding (never written). A
    bitsandbytes head holds its own quantized weight: ``save_pretrained`` writes it."""
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    head = model.get_output_embeddings() if tied and hasattr(
        model, "get_output_embeddings") else None
    if head is not None and is_bnb_module(head):
        return None
    return output_weight_key(model) if tied else None


def export_tensor(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as the checkpoint stores it: floating tensors in the export ``dtype`` except
    quantization scales (they keep their own: weight scales, fp32 KV-cache scales), contiguous,
    on the CPU."""
    if tensor.is_floating_point() and not name.endswith(SCALE_SUFFIXES):
        tensor = tensor.to(dtype)
    return tensor.detach().cpu().contiguous()


class StreamedExport:
    """The export of a ``compress.io.stream.StreamedModel`` into shards as its layers finish:
    call it with ``(prefix, module)`` for each finished module (the stream's ``sink``), then
    ``finish`` writes every tensor not written yet (from memory, the stream's scratch or the
    source checkpoint), the shard index and ``config.json``. Names are those checkpoints use
    (``compress.io.names``: float MoE experts one weight per expert, renamed blocks), as
    ``export_checkpoint`` writes them. A model holding bitsandbytes
    layers gets the tensors and config ``save_pretrained`` writes in memory (its state_dict's
    names, layouts and dtypes; ``dtype`` must then be its compute dtype, as that export keeps
    it) and bitsandbytes' own ``quantization_config``."""

    def __init__(self, model: nn.Module, directory: Path, dtype: str,
                 max_shard_size: int | str) -> None:
        from compress.io.stream import ShardWriter

        self.model, self.directory, self.dtype_name = model, Path(directory), dtype
        self.dtype = DTYPES[dtype]
        self.writer = ShardWriter(self.directory, max_shard_size)
        self.written: set[str] = set()  # module-tree names
        self.rename = stored_renamer(model)  # -> the names checkpoints of it use

    @property
    def head_key(self) -> str | None:
        """The tied head's key, never written; read when used, as a pass may untie the head
        (``rotate.hadamard``: the export then stores it, as ``export_checkpoint`` does)."""
        return _tied_head_key(self.model)

    def _add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write ``tensors`` (tree names), fused float experts split per expert as checkpoints
        store them, each under its checkpoint name."""
        tensors = {n: t for n, t in tensors.items() if n != self.head_key and n not in self.written}
        self.written.update(tensors)
        split_float_experts(self.model, tensors)
        pack_int8_codes(self.model, tensors)
        for name, tensor in tensors.items():
            self.writer.add(self.rename(name), export_tensor(name, tensor, self.dtype))

    def __call__(self, prefix: str, module: nn.Module) -> None:
        self._add(module.state_dict(prefix=prefix))

    def finish(self, stream) -> list[Path]:
        """Write the rest and close the shards; returns them."""
        layer_prefix = stream.layer_prefix
        for name, tensor in self.model.state_dict().items():
            if name == self.head_key or name in self.written:
                continue
            if tensor.device.type == "meta":
                index, _, rest = name[len(layer_prefix):].partition(".")
                scratch = (stream.scratch_reader(int(index))
                           if name.startswith(layer_prefix) else None)
                tensor = scratch.read(rest) if scratch is not None else stream.reader.read(
                    name, shape=tuple(tensor.shape))
            self._add({name: tensor})
        add_passthrough(self.model, self.writer)
        files = self.writer.finish()
        if any(is_bnb_module(m) for m in self.model.modules()):
            _write_bnb_config(self.model, self.directory, self.dtype_name)
        else:
            write_config(self.model, self.directory, self.dtype_name)
        return files


# ---- config files that every supported transformers reads (pyproject: transformers>=4.56) --
# Keys that describe the exporting machine (a cache path, how it was loaded), not the model.
_LOCAL_KEYS = ("_name_or_path", "name_or_path", "is_local", "local_files_only")


def portable_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a ``config.to_dict()``) with the fields transformers 4.x reads as well.

    transformers 5 keeps RoPE settings only in ``rope_parameters``; 4.x reads ``rope_theta`` and
    ``rope_scaling`` and silently falls back to theta 10000 without them, so both are written
    (5.x prefers ``rope_parameters``, and takes a non-null ``rope_scaling`` as the same dict).
    Per-layer-type (nested) ``rope_parameters`` are left as they are. Local paths are dropped.
    """
    config = {k: v for k, v in config.items() if k not in _LOCAL_KEYS}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
        if "partial_rotary_factor" in rope:
            config["partial_rotary_factor"] = rope["partial_rotary_factor"]
        default = rope.get("rope_type", rope.get("type", "default")) == "default"
        config["rope_scaling"] = None if default else dict(rope)
    return config


def rewrite_json(path: Path, fix: Any) -> None:
    """Apply ``fix`` (dict -> dict) to the JSON file at ``path`` when it exists."""
    if path.is_file():
        path.write_text(json.dumps(fix(json.loads(path.read_text())), indent=2, sort_keys=True))


def _portable_tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 names its tokenizers-backed class TokenizersBackend, which 4.x does not
    # know; PreTrainedTokenizerFast is the same tokenizer.json loader in both (an alias in 5).
    config = {k: v for k, v in config.items() if k not in _LOCAL_KEYS}
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    return config


def write_provenance(
    directory: Path, tokenizer: Any, recipe_yaml: str | None, report: dict[str, Any] | None
) -> None:
    """Tokenizer files, the resolved recipe and report.json beside a checkpoint's weights."""
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
        rewrite_json(directory / "tokenizer_config.json", _portable_tokenizer_config)
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
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write the checkpoint atomically to ``out_dir`` and return it. An existing ``out_dir`` is
    replaced only when it is empty or an earlier compress output, or with ``overwrite``.

    A model holding bitsandbytes layers is written with transformers' ``save_pretrained`` (bnb's
    own format, ``quantization_config.quant_method: bitsandbytes``);
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it back. Its non-quantized tensors
    keep the model's dtype (``dtype`` is not applied: casting would change the bnb modules'
    compute path)."""
    bnb = any(is_bnb_module(m) for m in model.modules())
    if bnb:
        _check_bnb_exportable(model, dtype)
    out_dir = Path(out_dir)
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        if bnb:
            model.save_pretrained(tmp, safe_serialization=True)
            rewrite_json(tmp / "config.json", portable_config)  # RoPE fields transformers 4.x reads
        else:
            _write_compressed_tensors(model, tmp, dtype, max_shard_size)
        write_provenance(tmp, tokenizer, recipe_yaml, report)
    return out_dir


def _write_compressed_tensors(
    model: nn.Module, directory: Path, dtype: str, max_shard_size: int | str
) -> None:
    """The weight shards (``compress.io.stream.ShardWriter``), ``config.json`` (with
    ``quantization_config``) and the generation config of ``model`` into ``directory``."""
    from compress.io.stream import ShardWriter

    writer = ShardWriter(directory, max_shard_size)
    writer.add_all(_state_dict_for_export(model, DTYPES[dtype]).items())
    add_passthrough(model, writer)
    writer.finish()
    write_config(model, directory, dtype)


def write_config(model: nn.Module, directory: Path, dtype: str) -> None:
    """``config.json`` (with the ``quantization_config`` of the model's quantized layers) and
    the generation config."""
    config = portable_config(model.config.to_dict())
    wrapped = wrapped_of(model)
    wrapped = wrapped if wrapped is not None and wrapped.multimodal else None
    if wrapped is not None:  # the multimodal wrapper's config around the text model's
        built = portable_config(causal_lm_config(wrapped.source)[0].to_dict())  # as loaded
        config = portable_config(wrapper_config(wrapped, config, built))
    if not config.get("architectures"):  # as save_pretrained writes it (vLLM needs it)
        config["architectures"] = [type(model).__name__]
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    quant = quantization_config(model)
    if quant is not None:
        config["quantization_config"] = quant
    else:
        config.pop("quantization_config", None)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if wrapped is not None:  # the processor files and the wrapper's generation config
        copy_processor_files(wrapped, directory)
    if getattr(model, "generation_config", None) is not None and \
            not (directory / "generation_config.json").is_file():
        model.generation_config.save_pretrained(directory)


def _write_bnb_config(model: nn.Module, directory: Path, dtype: str) -> None:
    """``config.json`` and the generation config of a (streamed) model holding bitsandbytes
    layers, as ``export_checkpoint`` writes them through ``save_pretrained``: its dtype and
    architecture set on the config, the config's own JSON (``quantization_config`` from the
    ``BitsAndBytesConfig``), then made portable."""
    model.config.dtype = dtype
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    rewrite_json(directory / "config.json", portable_config)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)


def _check_bnb_exportable(model: nn.Module, dtype: str) -> None:
    if getattr(model, "hf_quantizer", None) is None or not hasattr(model, "save_pretrained"):
        raise RecipeError(
            "this model holds bitsandbytes layers without a transformers quantization config; "
            "quantize it with the quantize.bnb pass (or load it with from_pretrained) to export it"
        )
    model_dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    if DTYPES.get(dtype, model_dtype) != model_dtype:
        log.warning("bitsandbytes export keeps non-quantized tensors in %s (asked: %s)",
                    model_dtype, dtype)


# ---- loading ------------------------------------------------------------------------------
def read_tensors(path: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (every shard), floating ones but scales cast to
    ``dtype`` as each is read (never a second copy of the whole model). A corrupt, truncated or
    missing shard, or a NaN/Inf scale, is a ``ModelLoadError`` naming the file and tensor
    (``compress.io.stream.CheckpointReader``)."""
    reader = open_checkpoint(path)  # a multimodal checkpoint's text model
    tensors: dict[str, torch.Tensor] = {}
    for name in reader.names():
        tensor = reader.read(name)
        if dtype is not None and tensor.is_floating_point() and not name.endswith(SCALE_SUFFIXES):
            tensor = tensor.to(dtype)
        tensors[name] = tensor
    return tensors


def check_shapes(path: Path, tensors: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Each tensor's shape against the model built from ``config.json``: a mismatch is one
    ``ModelLoadError`` line naming the tensor and the fix."""
    expected = model.state_dict(keep_vars=True)
    for name, tensor in tensors.items():
        want = expected.get(name)
        if want is not None and tuple(want.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"{path}: tensor {name} has shape {list(tensor.shape)} but config.json implies "
                f"{list(want.shape)}; the config does not match the weights, fix config.json or "
                "re-export the checkpoint"
            )


def _load_moe_experts(
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    quant: dict[str, Any],
    dtype: torch.dtype,
    backend: str,
) -> dict[str, torch.Tensor]:
    """For an MoE model: ``tensors`` renamed from checkpoint to module names, each quantized
    experts module swapped for an empty ``QuantExperts`` of the checkpoint's schemes, and
    per-expert float weights fused back into transformers 5's 3-D parameters."""
    arch = moe_arch(model)
    if arch is None or arch.moe is None:
        return tensors
    moe, rename = arch.moe, checkpoint_renamer(model)
    _swap_quantized_experts(model, quant, lambda n: tensors[n].dtype if n in tensors else None,
                            dtype, backend)
    names = {rename(n): n for n in model.state_dict()}
    names.update({rename(n): n for n, _ in model.named_modules()})
    tensors = {tree_name(k, names, rename): v for k, v in tensors.items()}
    gate, up, down = moe.checkpoint_projections
    for index in sparse_layers(model, arch):
        prefix = f"{arch.layer_prefix}{index}.{moe.fused}"
        fused = model.get_submodule(prefix)
        if isinstance(fused, QuantExperts):
            continue
        count = expert_shape(fused, moe)[0]
        if f"{prefix}.0.{gate}.weight" in tensors:
            per = [[tensors.pop(f"{prefix}.{e}.{p}.weight") for p in (gate, up, down)]
                   for e in range(count)]
            biases = None
            if moe.gate_up_bias and f"{prefix}.0.{gate}.bias" in tensors:
                biases = [[tensors.pop(f"{prefix}.{e}.{p}.bias") for p in (gate, up, down)]
                          for e in range(count)]
            tensors.update({f"{prefix}.{k}": v for k, v in fused_experts(moe, per, biases).items()})
    return tensors


def _expert_scheme(quant: dict[str, Any], name: str, scale_dtype: torch.dtype) -> WeightScheme:
    """The scheme of the config group targeting the per-expert Linear ``name``."""
    group = config_group_for(quant, name)
    if group is not None:
        return scheme_from_args(group["weights"], scale_dtype)
    raise ModelLoadError(f"{name} has quantized tensors but no config group targets it")


def _swap_quantized_experts(model: nn.Module, quant: dict[str, Any], stored_dtype,
                            dtype: torch.dtype, backend: str) -> None:
    """Replace each fused experts module the checkpoint stores quantized (its experts'
    ``weight_scale`` tensors) by an empty ``QuantExperts`` of its schemes, on the device of the
    module it replaces (meta for a skeleton). ``stored_dtype(name)``: the dtype the checkpoint
    stores tensor ``name`` (a checkpoint name) in, None when it is missing."""
    arch, rename = moe_arch(model), checkpoint_renamer(model)
    moe = arch.moe
    gate, _, down = moe.checkpoint_projections
    for index in sparse_layers(model, arch):
        prefix = f"{arch.layer_prefix}{index}.{moe.fused}"
        fused = model.get_submodule(prefix)
        count = expert_shape(fused, moe)[0]
        # the first expert stored with its scales: one without them is then named as missing
        first = next((f"{prefix}.{e}." for e in range(count)
                      if stored_dtype(rename(f"{prefix}.{e}.{gate}.weight_scale")) is not None
                      and stored_dtype(rename(f"{prefix}.{e}.{down}.weight_scale")) is not None),
                     None)  # fmt: skip
        if first is None:
            continue
        schemes = tuple(_expert_scheme(quant, rename(first + p),
                                       stored_dtype(rename(f"{first}{p}.weight_scale")))
                        for p in (gate, down))  # fmt: skip
        experts = QuantExperts.like(fused, moe, schemes, dtype, backend)
        parent, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent), child, experts)


def _dynamic_int8_tokens(acts: dict[str, Any]) -> bool:
    """Whether ``input_activations`` are what ``W8A8Linear`` computes: int8, one dynamic scale
    per token (``quant.linear.INPUT_ACTIVATIONS``)."""
    return (acts.get("strategy") == "token" and acts.get("dynamic", True) is True
            and acts.get("num_bits", 8) == 8 and acts.get("type", "int") == "int")


def swap_quantized_linears(
    model: nn.Module, quant: dict[str, Any], stored_dtype, path: Path, dtype: torch.dtype,
    backend: str,
) -> None:
    """Replace each ``nn.Linear`` that ``quant`` (a ``quantization_config``) quantizes by the
    empty QuantLinear / W8A8Linear its config group describes, built on the device of the
    linear's weight (meta for a skeleton). ``stored_dtype(name)``: the dtype the checkpoint
    stores tensor ``name`` in, None when it is missing (the scales' dtype is the scheme's)."""
    ignore = quant.get("ignore") or []  # the groups' form: io.stream.read_config_json
    for key, group in quant.get("config_groups", {}).items():
        acts = group.get("input_activations")
        if acts and not _dynamic_int8_tokens(acts):  # never silently: say what is not applied
            log.warning("%s: config group %s quantizes input activations as %s, which compress "
                        "does not apply: its layers compute on float activations (weights as "
                        "stored)", path, key, acts)
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or any(matches(name, module, t) for t in ignore):
            continue
        for group in quant.get("config_groups", {}).values():
            if any(matches(name, module, t) for t in group["targets"]):
                scale_dtype = stored_dtype(f"{name}.weight_scale")
                if scale_dtype is None:
                    raise ModelLoadError(f"{path}: {name}.weight_scale is missing")
                scheme = scheme_from_args(group["weights"], scale_dtype)
                cls = QuantLinear
                if _dynamic_int8_tokens(group.get("input_activations") or {}):
                    cls = W8A8Linear  # dynamic int8 inputs
                try:
                    with torch.device(module.weight.device):
                        quant_linear = cls(
                            module.in_features,
                            module.out_features,
                            scheme,
                            bias=module.bias is not None,
                            dtype=dtype,
                            backend=backend,
                        )
                except ValueError as exc:  # a scheme the layer's shape cannot take
                    raise ModelLoadError(
                        f"{path}/config.json: quantization_config does not fit layer {name} "
                        f"({exc}); fix it or re-export the checkpoint"
                    ) from exc
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, quant_linear)
                break


def compressed_skeleton(path: str | Path, *, dtype: torch.dtype = torch.float32,
                        backend: str = "auto") -> nn.Module:
    """``load_compressed``'s model with every tensor on the meta device (a
    ``compress.io.stream.meta_skeleton`` with the quantized layers swapped in, reading only the
    shards' headers), for reading one layer at a time; an MoE model's quantized experts as
    ``QuantExperts`` (read through ``compress.io.names.MoeTreeReader``)."""
    path = Path(path)
    return _skeleton(path, _quantization_config(path), dtype, backend, moe=True)


def _quantization_config(path: Path) -> dict[str, Any]:
    """``path``'s quantization_config, its module names under the text model's for a
    multimodal checkpoint (``compress.io.wrapped``)."""
    try:
        quant = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}/config.json cannot be read ({exc}); fix or replace it") \
            from exc
    return text_quantization_config(wrapped_text(path), quant) if quant else quant


def _skeleton(path: Path, quant: dict[str, Any], dtype: torch.dtype, backend: str, *,
              moe: bool = False) -> nn.Module | None:
    """The meta skeleton with the quantized layers swapped in; for an MoE model, None (it is
    loaded whole: its experts are renamed and regrouped) unless ``moe``: then its quantized
    experts are swapped in too, for reading one layer at a time."""
    from compress.io.stream import meta_skeleton

    model = meta_skeleton(path)
    if moe_arch(model) is not None and not moe:
        return None
    if quant.get("kv_cache_scheme"):
        add_kv_scale_buffers(model)  # read below like every other tensor
    raw = open_checkpoint(path)
    reader = under_model_names(model, raw)
    if moe_arch(model) is not None:
        _swap_quantized_experts(model, quant, lambda n: raw.dtype(n) if n in raw else None,
                                dtype, backend)
        reader = MoeTreeReader(model, reader)
    swap_quantized_linears(model, quant, lambda n: reader.dtype(n) if n in reader else None,
                           path, dtype, backend)
    return model


def matched_skeleton(path: str | Path, *, dtype: torch.dtype = torch.float32,
                     backend: str = "auto") -> tuple[nn.Module, Any]:
    """The meta skeleton (plain or compressed) and a reader under its names, once every tensor
    it holds is stored and nothing else is (a config.json with another layer count would be
    another model), from the headers alone: what ``load_model`` refuses, refused early."""
    from compress.io.stream import expected_tensors, is_bnb_state, meta_skeleton

    path = Path(path)
    quant = _quantization_config(path)
    skeleton = (compressed_skeleton(path, dtype=dtype, backend=backend)
                if quant.get("quant_method") == "compressed-tensors" else meta_skeleton(path))
    reader = tree_reader(skeleton, path)
    names, stored = set(expected_tensors(skeleton)), set(reader.names())
    missing = sorted(names - stored - {_tied_head_key(skeleton)})
    unexpected = sorted(n for n in stored - names if not is_bnb_state(n, names))
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: checkpoint does not match its config: missing {missing[:10]}, "
            f"unexpected {unexpected[:10]}; fix config.json or re-export the checkpoint"
        )
    # every shape and integer dtype as a load reads them (inspect showed a table for a
    # weight_packed of the wrong shape, a scale of another group size, int64 codes); a
    # bitsandbytes skeleton is float where its checkpoint holds codes: its loader checks them
    bnb = quant.get("quant_method") == "bitsandbytes"
    for name, tensor in expected_tensors(skeleton).items():
        if tensor.device.type == "meta" and name in stored and not bnb:
            check_stored(reader, name, tuple(tensor.shape), tensor.dtype)
    return skeleton, reader


def layerwise_model(path: str | Path, *, dtype: torch.dtype = torch.float32,
                    backend: str = "auto"):
    """A ``compress.io.stream.StreamedModel`` over the checkpoint at ``path`` (plain or
    compressed), for reading it one decoder layer at a time and nothing else: a finished layer
    is freed, never saved (layer-by-layer evaluation, ``compress.eval.quality``)."""
    from compress.arch import arch_for, decoder_layers
    from compress.io.stream import StreamedModel, verify_checkpoint

    verify_checkpoint(path)  # headers, shapes against config.json, scales, as a whole load does
    skeleton, reader = matched_skeleton(path, dtype=dtype, backend=backend)
    layers = decoder_layers(skeleton, "layer-by-layer reading")
    stream = StreamedModel(skeleton, reader, dtype, layers,
                           arch_for(skeleton, "layer-by-layer reading").layer_prefix,
                           scratch_dir=Path(path) / ".unused-scratch")
    stream.sink = lambda prefix, module: None  # read-only: finished layers are only freed
    return stream


def load_compressed(
    path: str | Path, *, dtype: torch.dtype = torch.float32, backend: str = "auto"
) -> nn.Module:
    """The model of a compressed checkpoint, computing in ``dtype``: built on the meta device
    from ``config.json``, QuantLinear layers swapped in, then each module's tensors read from
    the shards one module at a time. Quantized layers hold their codes and scales as stored
    (their other float tensors in ``dtype``); the large dense tensors stored narrower than
    ``dtype`` (a bf16 embedding or output head) stay so and are widened only while their
    module runs (``compress.core.device.compute_in``), so the model never holds float32
    copies of them. An MoE checkpoint's per-expert weights are read through
    ``compress.io.names.MoeTreeReader``: quantized experts as ``QuantExperts``, float ones
    stacked into the fused tensors one module at a time (``_load_whole`` fused them all at
    once: 5.58 GB against 3.04 for the 4-layer Qwen3-30B-A3B shape's W4 export)."""

    path = Path(path)
    quant = _quantization_config(path)
    model = _skeleton(path, quant, dtype, backend, moe=True)
    reader = tree_reader(model, path)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    head_key = output_weight_key(model)
    read: set[str] = set()
    missing: list[str] = []
    for owner_name, owner in model.named_modules():
        prefix = f"{owner_name}." if owner_name else ""
        own = [(n, t) for n, t in owner._parameters.items() if t is not None]
        own += [(n, t) for n, t in owner._buffers.items()
                if t is not None and n not in owner._non_persistent_buffers_set]
        tensors = {}
        for name, current in own:
            key = prefix + name
            # a persistent buffer is built real but read as stored (a trained router bias)
            if current.device.type != "meta" and (name not in owner._buffers or key not in reader):
                continue
            if key not in reader:
                if not (tied and key == head_key):  # tied: the embedding's weight, below
                    missing.append(key)
                continue
            tensor = reader.read(key, shape=tuple(current.shape), dtype=current.dtype)
            read.add(key)
            if not keeps_stored_dtype(key, tensor.dtype, tensor.numel(), dtype,
                                      quantized=isinstance(owner, (QuantLinear, QuantExperts))):
                tensor = tensor.to(dtype)
            tensors[name] = tensor
        if tensors:
            owner.load_state_dict(tensors, strict=False, assign=True)
    if tied:
        model.tie_weights()
    # after tying: a tied head holds the embedding's bf16 weight
    compute_narrow_in(model, dtype, exclude=(QuantLinear, QuantExperts))
    unexpected = [n for n in reader.names() if n not in read]
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: checkpoint does not match its config: missing {missing[:10]}, "
            f"unexpected {unexpected[:10]}; re-export it"
        )
    return model.eval()  # as from_pretrained returns it (a model built from a config trains)


def _load_whole(path: Path, quant: dict[str, Any], dtype: torch.dtype,
                    backend: str) -> nn.Module:
    """A compressed checkpoint read whole, every float tensor but the scales cast to ``dtype``
    (float32 copies of the dense parts): what an MoE checkpoint needs (its per-expert tensors
    are renamed and fused into transformers' 3-D expert parameters, all at hand), and the
    reference the module-by-module ``load_compressed`` is tested against."""
    from transformers import AutoModelForCausalLM

    config, wrapped = causal_lm_config(path)
    # Built on CPU (not meta) so that non-persistent buffers such as rotary frequencies are
    # initialised by the model's own code; the float weights are then replaced by assignment.
    with no_weight_init():  # every weight is assigned below (or the load fails): skip the
        model = mark(AutoModelForCausalLM.from_config(config, dtype=dtype), wrapped)  # 4 s init
    tensors = _load_moe_experts(model, read_tensors(path, dtype), quant, dtype, backend)
    for name, stored in model_name_aliases(model, tensors).items():  # GPT-NeoX's embed_out
        tensors[name] = tensors.pop(stored)
    if quant.get("kv_cache_scheme"):
        add_kv_scale_buffers(model)
    swap_quantized_linears(model, quant, lambda n: None if n not in tensors else tensors[n].dtype,
                           path, dtype, backend)
    check_shapes(path, tensors, model)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [m for m in missing if m != output_weight_key(model)]
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: checkpoint does not match its config: missing {missing[:10]}, "
            f"unexpected {unexpected[:10]}; re-export it"
        )
    return model.eval()
