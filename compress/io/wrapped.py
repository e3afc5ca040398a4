"""Checkpoints that store more than the causal LM compress works on (``compress.io`` imports no
pass): multimodal checkpoints whose text model is compressed (Gemma 3 4B and up, Mistral 3, LLaVA,
Qwen2-VL, Qwen2.5-VL, Qwen3-VL), and text checkpoints with multi-token-prediction modules
beside the causal LM (GLM-4.5/4.6, DeepSeek-V3, ERNIE-4.5-MoE: ``compress.arch.mtp_tensors``),
which are carried through as stored, as a multimodal checkpoint's vision tower is.

Such a folder's config.json names a model_type no ``compress.arch`` entry has, and a
``text_config`` whose model_type one has; its shards hold that text causal LM under a prefix
(``compress.arch.WRAPPED_TEXT_LAYOUTS``) beside a vision tower and a projector. Every pass, the
evaluation and the runtime work on the text model alone:

* ``meta_skeleton`` builds it from ``text_config`` (``text_config_of``; the output head is tied
  as the wrapper's own ``tie_word_embeddings`` says; a text model type that computes as another
  family on text, ``compress.arch.WRAPPED_TEXT_FAMILIES``, is built as that family) and marks it
  with its ``Wrapped``;
* ``open_checkpoint`` reads the shards with the text tensors under the text model's names and
  the others left out, and ``text_quantization_config`` reads an export's names the same way;
* the export (``compress.io.export``) writes the text tensors back under their stored names
  (``Wrapped.stored``), copies every other tensor as stored (``Wrapped.passthrough``), writes
  the wrapper's config.json with its stored ``text_config`` where a pass changed it (pruning),
  a ``quantization_config`` that names the wrapper's modules and leaves the
  vision parts out (``ignore_patterns``), and copies the processor files, so transformers and
  vLLM load the result as the multimodal model it was.

A text checkpoint with MTP modules is a ``Wrapped`` whose names are the stored ones
(``multimodal`` false): its config.json is the model's own, its MTP tensors are the passthrough
(their layers renumbered after the last decoder layer when a pass drops layers) and the
``quantization_config`` leaves them float.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from compress.arch import (
    ARCHS,
    WRAPPED_TEXT_FAMILIES,
    WRAPPED_TEXT_LAYOUTS,
    WRAPPER_MODEL_PREFIX,
    WRAPPER_TREE,
    mtp_tensors,
)
from compress.core.errors import ModelLoadError
from compress.io.checkpoint import (
    INDEX_FILE,
    CheckpointReader,
    _config_errors,
    quant_method,
    read_config_json,
)

# the files a multimodal model's processor is built from, and its generation config, copied
# beside an export as they are
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json",
                   "chat_template.jinja", "video_preprocessor_config.json",
                   "generation_config.json")
_MARK = "_compress_wrapped"  # the attribute a text model built from a wrapper carries
# quantization formats our shard readers read (``quant_method``): none (float), ours, and
# block-scaled fp8 and MXFP4 sources (dequantized as read: ``CheckpointReader``)
READ_METHODS = (None, "compressed-tensors", "fp8", "mxfp4")


@dataclass(frozen=True)
class Wrapped:
    """A checkpoint folder's causal LM, where it stores more (a multimodal checkpoint's text
    model; a text model beside MTP modules): where it is stored and what is not it."""

    source: Path
    config: dict[str, Any]  # the folder's config.json (a multimodal model's: the wrapper's)
    renames: tuple[tuple[str, str], ...]  # (text model prefix, stored prefix)
    passthrough: tuple[str, ...]  # stored tensor names outside the text model
    family: str  # the text model's model_type as compress builds it
    multimodal: bool = True  # else a text checkpoint with MTP modules: names as stored

    def stored(self, name: str) -> str:
        """The stored name of the text model's tensor or module ``name``."""
        return _swap_prefix(name, self.renames)

    def text_name(self, stored: str) -> str | None:
        """The text model's name of stored tensor or module ``stored`` (None: not the text
        model's)."""
        return _swap_prefix(stored, tuple((s, t) for t, s in self.renames), None)

    def exported(self, name: str, num_layers: int) -> str:
        """The name passthrough tensor ``name`` is exported under, for a causal LM of
        ``num_layers`` decoder layers now: an MTP layer stays right after the last decoder layer
        (where transformers and vLLM look for it) when a pass dropped layers."""
        if self.multimodal:
            return name
        prefix = ARCHS[self.family].layer_prefix
        index, dot, rest = name.removeprefix(prefix).partition(".")
        if not name.startswith(prefix) or not index.isdigit() or not dot:
            return name
        moved = int(index) - self.config["num_hidden_layers"] + num_layers
        return f"{prefix}{moved}.{rest}"


def passthrough_roots(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The top modules of passthrough tensor ``names``, without the wrapper's own prefix
    (``vision_tower``, ``multi_modal_projector``; an MTP decoder layer ``layers.46``, an MTP
    module ``mtp_block.0``)."""
    roots = set()
    for name in names:
        parts = name.removeprefix(WRAPPER_MODEL_PREFIX).split(".")
        roots.add(".".join(parts[:2] if len(parts) > 2 and parts[1].isdigit() else parts[:1]))
    return tuple(sorted(roots))


def _swap_prefix(name: str, pairs: tuple[tuple[str, str], ...], default: Any = ...) -> Any:
    """``name`` with the first matching ``old`` prefix of ``pairs`` replaced by its ``new``; a
    module named by a prefix itself (``lm_head``) too. No match: ``default`` (``...``: name)."""
    for old, new in pairs:
        if name.startswith(old):
            return new + name[len(old):]
        if name + "." == old:
            return new[:-1]
    return name if default is ... else default


def wrapped_text(path: str | os.PathLike[str],
                 reader: CheckpointReader | None = None) -> Wrapped | None:
    """The ``Wrapped`` text model of the checkpoint folder ``path``, or None when its model_type
    is a text family, or it has neither a ``text_config`` nor a ``vision_config``. The text
    model's type is its ``text_config``'s, or, for a config that keeps the text settings at its
    top level (Qwen2-VL's and Qwen2.5-VL's as released), the one transformers parses. A
    multimodal config whose text model no entry supports, or shards holding no text model under
    a known layout, is a ModelLoadError naming it."""
    path = Path(path)
    config = read_config_json(path)
    text, kind = config.get("text_config"), config.get("model_type")
    if kind in ARCHS:
        return _with_mtp(path, config, reader)
    if not (isinstance(text, dict) or isinstance(config.get("vision_config"), dict)):
        return None
    text_type = text.get("model_type") if isinstance(text, dict) else None
    if text_type is None:
        text_type = _parsed_text_type(path)
    family = WRAPPED_TEXT_FAMILIES.get(text_type, text_type)
    if family not in ARCHS:
        raise ModelLoadError(
            f"{path}/config.json: a multimodal model ({kind!r}) whose text model "
            f"({text_type!r}) is not a supported family; supported text models: "
            f"{', '.join(ARCHS)}"
        )
    method = quant_method(config)
    if method not in READ_METHODS:
        raise ModelLoadError(
            f"{path}: a multimodal model ({kind!r}) quantized with {method!r}; compress reads "
            "multimodal checkpoints in float, compressed-tensors, block-scaled fp8 or MXFP4: "
            "start from the float model"
        )
    names = (reader or CheckpointReader(path)).names()
    own_names = text_type in WRAPPED_TEXT_FAMILIES  # Qwen2/2.5-VL: the text model's own names
    for layout in WRAPPED_TEXT_LAYOUTS[:None if own_names else 2]:
        model_prefix = layout[0][1]
        if any(n.startswith(model_prefix) for n in names):
            stored = tuple(s for _, s in layout)
            return Wrapped(path, config, layout,
                           tuple(n for n in names if not n.startswith(stored)), family)
    raise ModelLoadError(
        f"{path}: config.json describes a multimodal model ({kind!r}) but no tensor is stored "
        f"under {' or '.join(repr(lay[0][1]) for lay in WRAPPED_TEXT_LAYOUTS[:2])}, where its "
        "text model is expected; the shards belong to another model or are stored under names "
        "compress does not know: re-download or re-export it"
    )


def _with_mtp(path: Path, config: dict[str, Any],
              reader: CheckpointReader | None) -> Wrapped | None:
    """A text checkpoint of a supported family whose shards hold MTP modules beside the causal
    LM, in a format our readers read (``READ_METHODS``; another tool's is left to transformers,
    which ignores them), as a ``Wrapped``; None for any other."""
    if quant_method(config) not in READ_METHODS:
        return None
    if reader is None:
        if not (path / INDEX_FILE).is_file() and not any(path.glob("*.safetensors")):
            return None  # a folder being written, its config first: no tensor to look at yet
        reader = CheckpointReader(path)
    mtp = mtp_tensors(config, reader.names())
    if not mtp:
        return None
    return Wrapped(path, config, (("", ""),), mtp, config["model_type"], multimodal=False)


def _parsed_text_type(path: Path) -> str | None:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path).get_text_config().model_type
    except _config_errors() as exc:
        reason = " ".join(str(exc).split())
        raise ModelLoadError(f"{path}/config.json cannot be read ({reason}); fix or replace it") \
            from exc


def open_checkpoint(path: str | os.PathLike[str]) -> CheckpointReader:
    """The shards of ``path``: a multimodal checkpoint's text tensors under the text model's
    names and nothing else (``Wrapped``), any other checkpoint's tensors as stored."""
    reader = CheckpointReader(path)
    wrapped = wrapped_text(path, reader)
    if wrapped is None:
        return reader
    outside = set(wrapped.passthrough)
    return reader.selected({wrapped.text_name(n): n for n in reader.names() if n not in outside})


_MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def text_config_of(config: Any, wrapped: Wrapped) -> Any:
    """The text model's config of a transformers multimodal config: its ``text_config``, with
    the head tied as the wrapper ties it (the wrapper's ``tie_word_embeddings`` decides,
    whatever the nested one says); for a text model type of ``WRAPPED_TEXT_FAMILIES``, the
    same settings as that family's config, its M-RoPE sections dropped (on text they rotate as
    1-D RoPE)."""
    from transformers import AutoConfig

    text = config.get_text_config()
    tied = getattr(config, "tie_word_embeddings", None)
    tied = bool(getattr(text, "tie_word_embeddings", False) if tied is None else tied)
    if text.model_type != wrapped.family:
        settings = {k: v for k, v in text.to_dict().items()
                    if k not in ("model_type", "architectures", "transformers_version")}
        for key in ("rope_parameters", "rope_scaling"):
            rope = settings.get(key)
            if isinstance(rope, dict) and any(k in rope for k in _MROPE_KEYS):
                rope = {k: v for k, v in rope.items() if k not in (*_MROPE_KEYS, "type")}
                settings[key] = {**rope, "rope_type": "default"}
        text = AutoConfig.for_model(wrapped.family, **settings)
    text.tie_word_embeddings = tied
    text.architectures = None  # the wrapper's; the text model's class comes from model_type
    return text


def mark(model: nn.Module, wrapped: Wrapped | None) -> nn.Module:
    if wrapped is not None:
        setattr(model, _MARK, wrapped)
    return model


def wrapped_of(model: nn.Module) -> Wrapped | None:
    """The ``Wrapped`` a text model was built from (``mark``), None for any other model."""
    return getattr(model, _MARK, None)


def wrapper_names(wrapped: Wrapped, name: str) -> list[str]:
    """The names a quantization_config lists for the text model's module ``name``: as stored
    (vLLM's names) and, in a multimodal model, as transformers 5's module tree of the wrapper
    has it."""
    if not wrapped.multimodal:
        return [name]
    return sorted({wrapped.stored(name), _swap_prefix(name, WRAPPER_TREE)})


def ignore_patterns(names) -> list[str]:
    """``ignore`` entries that leave the modules of passthrough tensor ``names`` (as exported)
    float, under transformers' names (``model.vision_tower...``) and vLLM's
    (``vision_tower...``)."""
    prefix = re.escape(WRAPPER_MODEL_PREFIX)
    # the module itself too: a passthrough Linear at a root (ERNIE's mtp_linear_proj.0)
    return [f"re:^({prefix})?{re.escape(root)}(\\.|$)" for root in passthrough_roots(list(names))]


def exported_passthrough(model: nn.Module) -> dict[str, str]:
    """Each tensor of ``model``'s checkpoint outside its causal LM (``Wrapped.passthrough``;
    none for a model that is not ``Wrapped``): stored name -> the name the export writes."""
    wrapped = wrapped_of(model)
    if wrapped is None:
        return {}
    layers = model.config.num_hidden_layers
    return {name: wrapped.exported(name, layers) for name in wrapped.passthrough}


def text_quantization_config(wrapped: Wrapped | None, quant: dict[str, Any]) -> dict[str, Any]:
    """``quant`` with the exact module names of its targets and ignore list under the text
    model's names (a name the wrapper's tree or the shards use); patterns and class names stay
    as they are. Names outside the text model are dropped."""
    if wrapped is None or not quant:
        return quant

    def to_text(patterns: list[str]) -> list[str]:
        out = []
        for pattern in patterns:
            if pattern.startswith("re:") or "." not in pattern and pattern[:1].isupper():
                out.append(pattern)
                continue
            name = wrapped.text_name(pattern)
            if name is None:
                name = _swap_prefix(pattern, tuple((s, t) for t, s in WRAPPER_TREE), None)
            if name is not None:
                out.append(name)
        return list(dict.fromkeys(out))

    quant = dict(quant)
    quant["ignore"] = to_text(quant.get("ignore") or [])
    quant["config_groups"] = {
        key: {**group, "targets": to_text(group.get("targets") or [])}
        for key, group in (quant.get("config_groups") or {}).items()
    }
    return quant


_NOT_SETTINGS = ("architectures", "quantization_config", "model_type", "dtype", "torch_dtype",
                 "transformers_version", "_name_or_path")


def wrapper_config(wrapped: Wrapped, text: dict[str, Any],
                   built: dict[str, Any]) -> dict[str, Any]:
    """The wrapper's config.json around ``text`` (the text model's config now): its stored
    ``text_config`` with every setting that differs from ``built`` (the text config as loaded)
    set to the text model's (a pruned width or depth), and the head tied as the text model's
    is. The rest stays as stored: the text model type and the fields the wrapper's own modeling
    reads (M-RoPE sections) are the source's."""
    config = {k: v for k, v in wrapped.config.items() if k != "quantization_config"}
    changed = {k: v for k, v in text.items() if k not in _NOT_SETTINGS and built.get(k, ...) != v}
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = {**config["text_config"], **changed}
    else:  # the text settings at the top level (Qwen2.5-VL as released)
        config.update(changed)
    if "tie_word_embeddings" in text:
        config["tie_word_embeddings"] = text["tie_word_embeddings"]
    return config


def add_passthrough(model: nn.Module, writer) -> None:
    """The tensors of ``model``'s checkpoint outside its causal LM (vision tower, projector, MTP
    modules: every pass leaves them alone) into ``writer`` (a ShardWriter), as stored (an MTP
    layer renumbered after the last decoder layer); nothing for a model that is not
    ``Wrapped``."""
    wrapped = wrapped_of(model)
    if wrapped is not None:
        reader = CheckpointReader(wrapped.source)
        for stored, name in exported_passthrough(model).items():
            writer.add(name, reader.read(stored))


def copy_processor_files(wrapped: Wrapped, directory: Path) -> None:
    """The source's processor files (image preprocessing, chat template) and generation config
    beside an export."""
    for name in PROCESSOR_FILES:
        if (wrapped.source / name).is_file():
            shutil.copyfile(wrapped.source / name, directory / name)
