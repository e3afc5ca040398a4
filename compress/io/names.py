"""How checkpoints name a model's tensors where the module tree names them otherwise
(``compress.io`` imports no pass): the renames transformers applies on load and reverses on
save (``transformers_renamings``: GPT-NeoX's ``embed_out``; ``under_model_names`` reads a
checkpoint under the tree's names), and a mixture-of-experts block's name and its per-expert
Linears (transformers 5 holds the experts fused in 3-D parameters; checkpoints, vLLM and the hub
store one ``[out, in]`` weight per expert and projection). ``checkpoint_renamer`` maps tree
names to checkpoint names for the exports; ``MoeTreeReader`` reads a checkpoint of per-expert
weights under the tree's names, fusing each layer's experts as it is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from compress.arch import ARCHS, Arch, expert_shape, model_type, sparse_layers
from compress.core.errors import ModelLoadError
from compress.io.checkpoint import CheckpointReader
from compress.io.stream import expected_tensors
from compress.io.wrapped import open_checkpoint, wrapped_of
from compress.quant.linear import QuantExperts


def _conversion_transforms(model: nn.Module, *, add_legacy: bool, reverse: bool) -> list:
    """transformers' own ``conversion_mapping`` for this model (each transform reversed, as
    ``save_pretrained`` applies them, with ``reverse``); none on transformers 4, whose modules
    keep the stored names, or where transformers cannot build it."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4
        return []
    try:
        transforms = get_model_conversion_mapping(model, add_legacy=add_legacy)
        return [t.reverse_transform() for t in transforms] if reverse else list(transforms)
    except Exception:  # noqa: BLE001  (transformers' internals: none is the safe side)
        return []


def transformers_renamings(model: nn.Module, *, to_checkpoint: bool) -> list[tuple[str, str]]:
    """(pattern, replacement) pairs of the tensor renames transformers applies to this model's
    checkpoints: on load (``to_checkpoint=False``: GPT-NeoX's ``embed_out`` -> ``lm_head`` in
    transformers 5, legacy LayerNorm ``gamma``/``beta``), or reversed as ``save_pretrained``
    writes them (``to_checkpoint=True``, legacy ones left out). Renames only, from transformers'
    own ``conversion_mapping``."""
    transforms = _conversion_transforms(model, add_legacy=not to_checkpoint, reverse=to_checkpoint)
    if not transforms:
        return []
    from transformers.conversion_mapping import WeightRenaming

    return [(source, target) for t in transforms if isinstance(t, WeightRenaming)
            for source, target in zip(t.source_patterns, t.target_patterns, strict=False)]


def under_model_names(skeleton: nn.Module, reader: CheckpointReader) -> CheckpointReader:
    """``reader`` with the tensors transformers renames on load (``transformers_renamings``)
    read under the module tree's names. A stored name is renamed only into a module the model
    has (its quantized tensors too: ``lm_head.weight_scale``) and onto a name the checkpoint
    does not hold."""
    aliases = model_name_aliases(skeleton, reader.names())
    return reader.renamed(aliases) if aliases else reader


def model_name_aliases(model: nn.Module, stored: Iterable[str]) -> dict[str, str]:
    """{module-tree name: stored name} for the ``stored`` tensor names that transformers
    renames on load (``under_model_names``)."""
    renamings = transformers_renamings(model, to_checkpoint=False)
    if not renamings:
        return {}
    stored = set(stored)
    names = set(expected_tensors(model))
    modules = {name for name, _ in model.named_modules()}
    aliases = {}
    for name in stored - names:
        for source, target in renamings:
            new = re.sub(source, target, name)
            if new != name and new.rpartition(".")[0] in modules and new not in stored:
                aliases[new] = name
    return aliases


def moe_arch(model: nn.Module) -> Arch | None:
    arch = ARCHS.get(model_type(model))
    return arch if arch is not None and arch.moe is not None else None


def checkpoint_renamer(model: nn.Module):
    """``name -> checkpoint name`` (a tensor's or a module's): the names ``save_pretrained``
    writes (``transformers_renamings``: GPT-NeoX's head is ``embed_out`` in its checkpoints,
    which transformers 4 and vLLM read; ERNIE-4.5-MoE's router bias sits beside the router),
    and for an MoE model first its block's name as checkpoints (vLLM, the hub) spell it
    (Mixtral: ``block_sparse_moe``; transformers 5 renames it back on load)."""
    renamings = transformers_renamings(model, to_checkpoint=True)

    def rename_saved(name: str) -> str:
        for source, target in renamings:  # on name + ".": patterns end in a dot
            name = re.sub(source, target, name + ".")[:-1]
        return name

    saved = rename_saved if renamings else (lambda name: name)
    arch = moe_arch(model)
    if arch is None or arch.moe is None:
        return saved
    if arch.moe.block == arch.moe.checkpoint_block:
        return saved
    old, new = f".{arch.moe.block}.", f".{arch.moe.checkpoint_block}."

    def rename(name: str) -> str:
        if not name.startswith(arch.layer_prefix):
            return saved(name)
        head, sep, rest = name[len(arch.layer_prefix):].partition(".")
        # Mixtral's own rename (.mlp. -> .block_sparse_moe.) is the block's: applied once
        return saved(f"{arch.layer_prefix}{head}{sep}" + ("." + rest).replace(old, new, 1)[1:])

    return rename


def stored_renamer(model: nn.Module):
    """``name -> stored name`` for writing ``model``'s checkpoint: ``checkpoint_renamer``'s
    names, under a multimodal wrapper's text prefix when the model is one's text model
    (``compress.io.wrapped``; its readers present the text model's names, so reading uses
    ``checkpoint_renamer`` alone)."""
    rename, wrapped = checkpoint_renamer(model), wrapped_of(model)
    return rename if wrapped is None else (lambda name: wrapped.stored(rename(name)))


def moe_float_linears(model: nn.Module) -> list[str]:
    """Module names (transformers 5 tree) of the Linears a vLLM-style checkpoint of an MoE model
    holds in float: every router, and each expert's projections when the experts module is
    not quantized (``<experts>.<e>.<gate|up|down>``)."""
    arch = moe_arch(model)
    if arch is None or arch.moe is None:
        return []
    names = []
    for index in sparse_layers(model, arch):
        prefix = f"{arch.layer_prefix}{index}."
        names.append(prefix + arch.moe.router_weights)
        experts = model.get_submodule(prefix + arch.moe.fused)
        if not isinstance(experts, QuantExperts):
            count = expert_shape(experts, arch.moe)[0]
            names += [f"{prefix}{arch.moe.fused}.{e}.{p}"
                      for e in range(count) for p in arch.moe.checkpoint_projections]
            if arch.moe.fused_layout != "rows":
                # vLLM's GPT-OSS renames a name ending in its down projection's to its fused
                # parameter's before matching `ignore`, so that entry never matches and vLLM
                # refuses the layer's mixed schemes (measured: vLLM 0.32): a pattern ending
                # otherwise names the same experts
                fused = re.escape(f"{prefix}{arch.moe.fused}.")
                names.append(f"re:^{fused}\\d+\\.{re.escape(arch.moe.checkpoint_projections[2])}$")
    return names


def checkpoints_store_experts_fused(model: nn.Module) -> bool:
    """Whether this MoE family's checkpoints store each layer's experts fused (GraniteMoE's
    input_linear/output_linear): transformers' own conversion only renames them and builds no
    fused experts from per-expert weights, so plain transformers cannot read per-expert ones
    (vLLM and compress read both). False on transformers 4 and for families it merges."""
    arch = moe_arch(model)
    if arch is None or arch.moe is None:
        return False
    if arch.moe.fused_layout != "rows":  # GPT-OSS: stored as the module holds them
        return True
    transforms = _conversion_transforms(model, add_legacy=True, reverse=False)
    if not transforms:  # transformers 4 (per-expert modules) or no mapping: the usual layout
        return False
    from transformers.conversion_mapping import WeightConverter

    return not any(isinstance(t, WeightConverter)
                   and any(p.endswith(arch.moe.gate_up) for p in t.target_patterns)
                   for t in transforms)


def split_float_experts(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Replace float fused expert tensors in ``tensors`` by one ``[out, in]`` weight per expert
    and projection, the layout checkpoints (and vLLM) read; kept fused where the family's
    checkpoints store them so (``checkpoints_store_experts_fused``)."""
    arch = moe_arch(model)
    if arch is None or arch.moe is None or checkpoints_store_experts_fused(model):
        return
    gate, up, down = arch.moe.checkpoint_projections
    for index in range(len(model.get_submodule(arch.layers))):
        prefix = f"{arch.layer_prefix}{index}.{arch.moe.fused}"
        fused_gate_up = tensors.pop(f"{prefix}.{arch.moe.gate_up}", None)
        if fused_gate_up is not None:  # each on its own: a streamed export may hold one
            inter = fused_gate_up.shape[1] // 2
            for e in range(fused_gate_up.shape[0]):
                tensors[f"{prefix}.{e}.{gate}.weight"] = fused_gate_up[e, :inter].contiguous()
                tensors[f"{prefix}.{e}.{up}.weight"] = fused_gate_up[e, inter:].contiguous()
        fused_down = tensors.pop(f"{prefix}.{arch.moe.down}", None)
        if fused_down is not None:
            for e in range(fused_down.shape[0]):
                tensors[f"{prefix}.{e}.{down}.weight"] = fused_down[e].contiguous()


def tree_name(key: str, names: dict[str, str], rename) -> str:
    """Checkpoint key -> module tree key (per-expert keys keep their tail)."""
    if key in names:
        return names[key]
    head, _, tail = key.rpartition(".")
    inverse = {v: k for k, v in ((m, rename(m)) for m in names.values())}
    for n in (head, head.rpartition(".")[0], head.rpartition(".")[0].rpartition(".")[0]):
        if n in inverse:
            return inverse[n] + key[len(n):]
    return key


def tree_reader(model: nn.Module, path) -> CheckpointReader:
    """The checkpoint at ``path`` read under ``model``'s tensor names: the text model's of a
    multimodal checkpoint (``open_checkpoint``), transformers' renames (``under_model_names``)
    and an MoE model's per-expert weights fused as each layer is read (``MoeTreeReader``)."""
    reader = under_model_names(model, open_checkpoint(path))
    return MoeTreeReader(model, reader) if moe_arch(model) is not None else reader


class MoeTreeReader:
    """A checkpoint of per-expert weights (``<block>.experts.<e>.<gate|up|down>.weight``) read
    under the module tree's names, for a streamed job over an MoE model: each sparse layer's
    fused ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` are stacked from the experts' weights
    when read (transformers 5's own fusion on load), every other tensor is read under its
    checkpoint name (``checkpoint_renamer``). Checkpoints that store the experts fused already
    are read as they are. Stored tensors no tree name maps onto keep their names, so a
    comparison of ``names()`` with the model's finds them."""

    def __init__(self, model: nn.Module, reader: CheckpointReader) -> None:
        arch = moe_arch(model)
        if arch is None:
            raise ValueError(f"model_type {model_type(model)!r} has no mixture-of-expert entry")
        moe, rename = arch.moe, checkpoint_renamer(model)
        self.path, self._reader = reader.path, reader
        self._fused: dict[str, list[list[str]]] = {}  # tree name -> per expert, its parts
        self._part_shapes: dict[str, list[tuple[int, ...]]] = {}  # tree name -> each part's
        gate, up, down = moe.checkpoint_projections
        blocks = []  # the checkpoint names of the experts modules read per expert
        layers = sparse_layers(model, arch)
        # a checkpoint that stores experts fused (GraniteMoE's input_linear) stores every
        # layer's so: one without them is missing that tensor, not per-expert weights
        fused = [i for i in layers if f"{arch.layer_prefix}{i}.{moe.fused}.{moe.gate_up}" in reader]
        for index in layers:
            prefix = f"{arch.layer_prefix}{index}.{moe.fused}"
            if index in fused:  # stored fused: read as stored, its shapes checked here
                self._check_fused(model, prefix, moe, rename)
                continue
            if isinstance(model.get_submodule(prefix), QuantExperts):
                continue  # quantized: read per expert under its own names
            if fused:
                raise ModelLoadError(
                    f"{self.path}: tensor {rename(f'{prefix}.{moe.gate_up}')} is missing: layer "
                    f"{fused[0]} stores its expert weights fused, layer {index} does not; the "
                    "download or export is incomplete: fetch or write it again")
            if moe.fused_layout != "rows":
                raise ModelLoadError(
                    f"{self.path}: tensor {rename(f'{prefix}.{moe.gate_up}')} is missing: "
                    f"{model_type(model)} checkpoints store each layer's float expert weights "
                    "fused, as transformers holds them, and compress reads no other layout; "
                    "the download or export is incomplete: fetch or write it again")
            experts = model.get_submodule(prefix)
            count, rows, hidden = getattr(experts, moe.gate_up).shape
            stored = rename(prefix)
            blocks.append(stored)
            self._fused[f"{prefix}.{moe.gate_up}"] = [
                [f"{stored}.{e}.{gate}.weight", f"{stored}.{e}.{up}.weight"] for e in range(count)]
            self._part_shapes[f"{prefix}.{moe.gate_up}"] = [(rows // 2, hidden)] * 2
            self._fused[f"{prefix}.{moe.down}"] = [[f"{stored}.{e}.{down}.weight"]
                                                   for e in range(count)]  # fmt: skip
            self._part_shapes[f"{prefix}.{moe.down}"] = [
                tuple(getattr(experts, moe.down).shape[1:])]
        self._check_parts(blocks)
        self._plain = {name: rename(name) for name in expected_tensors(model)
                       if name not in self._fused and rename(name) in reader}  # fmt: skip
        used = set(self._plain.values()) | {n for parts in self._fused.values()
                                            for expert in parts for n in expert}  # fmt: skip
        self._plain.update({n: n for n in reader.names() if n not in used})

    def _check_fused(self, model: nn.Module, prefix: str, moe, rename) -> None:
        """Refuse, naming it as stored, a fused experts tensor whose shape is not the one
        config.json implies (read from the header)."""
        experts = model.get_submodule(prefix)
        for attr in (moe.gate_up, moe.down):
            want = tuple(getattr(experts, attr).shape)
            got = tuple(self._reader.shape(f"{prefix}.{attr}"))
            if got != want:
                raise ModelLoadError(
                    f"{self.path}: tensor {rename(f'{prefix}.{attr}')} has shape {list(got)} "
                    f"but config.json implies {list(want)}; the config does not match the "
                    "weights, fix config.json or re-export the checkpoint")

    def _check_parts(self, blocks: list[str]) -> None:
        """Refuse, naming the tensor, a checkpoint whose per-expert weights do not make the
        experts config.json implies: one missing (or an expert count the config does not
        have), one left over (a count beyond it), a shape or an integer dtype that does not fit.
        Read from the headers only; transformers would stop on these with its own traceback,
        or cast an integer weight to garbage."""
        where, reader = self.path, self._reader
        for name, experts in self._fused.items():
            for parts in experts:
                for part, want in zip(parts, self._part_shapes[name], strict=True):
                    if part not in reader:
                        raise ModelLoadError(
                            f"{where}: tensor {part} is missing: config.json implies "
                            f"{len(experts)} per-expert weights of each projection in "
                            f"{name.rpartition('.')[0]}; the download or export is incomplete or "
                            "config.json belongs to another model: fetch or write it again")
                    if tuple(reader.shape(part)) != want:
                        raise ModelLoadError(
                            f"{reader.file_of(part)}: tensor {part} has shape "
                            f"{list(reader.shape(part))} but config.json implies {list(want)}; "
                            "the config does not match the weights, fix config.json or "
                            "re-export the checkpoint")
                    if not reader.dtype(part).is_floating_point:
                        raise ModelLoadError(
                            f"{reader.file_of(part)}: tensor {part} is stored as "
                            f"{reader.dtype(part)} but the model's weight is floating point and "
                            "nothing beside it scales integer codes; the checkpoint is corrupt "
                            "or its config.json lost its quantization_config: re-download or "
                            "re-export it")
        used = {n for experts in self._fused.values() for parts in experts for n in parts}
        left = sorted(n for n in reader.names() if n not in used
                      and any(n.startswith(f"{block}.") for block in blocks))  # fmt: skip
        if left:
            count = len(next(iter(self._fused.values())))
            raise ModelLoadError(
                f"{where}: tensors {left[:6]} are per-expert weights beyond the {count} of "
                "each projection that config.json implies; the config belongs to another model: "
                "fix config.json or re-export the checkpoint")

    def names(self) -> list[str]:
        fused = [name for name, parts in self._fused.items()
                 if all(n in self._reader for expert in parts for n in expert)]  # fmt: skip
        return list(self._plain) + fused

    def __contains__(self, name: str) -> bool:
        return name in self._plain or name in self.names()

    def _first(self, name: str) -> str:
        return self._plain[name] if name in self._plain else self._fused[name][0][0]

    def file_of(self, name: str):
        return self._reader.file_of(self._first(name))

    def dtype(self, name: str) -> torch.dtype:
        return self._reader.dtype(self._first(name))

    def nbytes(self, name: str) -> int:
        if name in self._plain:
            return self._reader.nbytes(self._plain[name])
        return sum(self._reader.nbytes(n) for expert in self._fused[name] for n in expert)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._plain:
            return self._reader.shape(self._plain[name])
        parts = self._part_shapes[name]
        return (len(self._fused[name]), sum(p[0] for p in parts), *parts[0][1:])

    def read(self, name: str, *, shape: tuple[int, ...] | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self._fused:
            return self._reader.read(self._plain.get(name, name), shape=shape, dtype=dtype)
        experts, parts = self._fused[name], self._part_shapes[name]
        stacked = (len(experts), sum(p[0] for p in parts), *parts[0][1:])
        if shape is not None and tuple(stacked) != tuple(shape):
            raise ModelLoadError(
                f"{self.path}: the per-expert weights {experts[0][0]}... stack to "
                f"{list(stacked)} but config.json implies {list(shape)} for {name}; fix "
                "config.json or re-export the checkpoint"
            )
        # each part copied into its rows as it is read: stacking whole copies (torch.cat, then
        # torch.stack) held the fused tensor twice (Mixtral-8x7B's gate_up: 7.5 GB in float32)
        fused = None
        for index, expert in enumerate(experts):
            row = 0
            for part in expert:
                tensor = self._reader.read(part, dtype=dtype)
                if fused is None:
                    fused = torch.empty(stacked, dtype=tensor.dtype)
                fused[index, row:row + tensor.shape[0]] = tensor
                row += tensor.shape[0]
        return fused
