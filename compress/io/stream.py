"""Streaming checkpoints: read one module's tensors at a time from safetensors shards, and write
finished tensors into Hugging Face-style shards as they come (``compress.io`` imports no pass).

* Tensors come from ``compress.io.checkpoint.CheckpointReader`` (one at a time, checked against
  what the model expects); ``verify_checkpoint`` checks a folder against its config before a
  load, reading headers and scales only.
* ``meta_skeleton`` builds a model from its config with every parameter on the meta device
  (no memory), buffers computed by the model's own code (rotary tables).
* ``materialize`` / ``release`` fill one submodule from the reader (cast to the compute dtype)
  and send it back to meta.
* ``ShardWriter`` appends tensors to ``model-0000k-of-0000n.safetensors`` files of at most
  ``max_shard_size`` bytes each: a tensor's bytes go to disk when it is added (never a whole
  shard in memory), the header is put in front when a shard closes, and the index
  ``model.safetensors.index.json`` is written last. A checkpoint of one shard is a plain
  ``model.safetensors``, as ``save_pretrained`` writes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import struct
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from compress.arch import output_weight_key, routing_problem
from compress.core.device import compute_in
from compress.core.errors import ModelLoadError
from compress.io.checkpoint import (
    _DTYPE_NAMES,
    INDEX_FILE,
    CheckpointReader,
    _config_errors,
    read_config_json,
)
from compress.io.wrapped import mark, open_checkpoint, text_config_of, wrapped_text
from compress.memory import return_freed_memory

log = logging.getLogger(__name__)

# transformers 4's save_pretrained default; a 7B bf16 checkpoint is 3 shards
DEFAULT_MAX_SHARD_SIZE = "5GB"

# tensors that must be finite for the weights to mean anything (quantized layers, fp8 KV scales)
_MUST_BE_FINITE = ("weight_scale", "weight_zero_point", "input_scale", "k_scale", "v_scale")
_SCALES = ("weight_scale", "input_scale", "k_scale", "v_scale")
# scales kept in their stored dtype, never cast to the compute or export dtype (weight scales,
# fp8 KV-cache scales)
SCALE_SUFFIXES = ("weight_scale", ".k_scale", ".v_scale")


def parse_size(size: int | str) -> int:
    """Bytes of ``5GB``, ``500MB``, ``2GiB`` or an int (decimal units as transformers reads
    them: GB = 10^9); ValueError names the accepted forms."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"a size must be positive, not {size}")
        return size
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not found:
        raise ValueError(f"{size!r} is not a size: write e.g. 5GB, 500MB or 2GiB")
    units = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "kib": 2**10, "mib": 2**20, "gib": 2**30}
    value = int(float(found.group(1)) * units[(found.group(2) or "B").lower()])
    if value <= 0:
        raise ValueError(f"a size must be positive, not {size!r}")
    return value




# ---- the model skeleton -------------------------------------------------------------------
@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside this block get their parameters on the meta device (no memory);
    buffers, such as rotary frequencies, are computed by the modules' own code as usual."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def no_weight_init() -> contextlib.AbstractContextManager:
    """transformers' context that skips random weight init (buffers such as rotary frequencies
    are still computed by the modules' own code); its home moved in transformers 5."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def causal_lm_config(path: str | os.PathLike[str]):
    """(the transformers config of the causal LM ``path`` holds, its ``Wrapped`` or None): the
    folder's config without its ``quantization_config``; a multimodal checkpoint's text model
    config (``compress.io.wrapped.text_config_of``). A config transformers cannot read is a
    one-line ModelLoadError."""
    from transformers import AutoConfig

    read_config_json(path)
    wrapped = wrapped_text(path)
    try:
        config = AutoConfig.from_pretrained(path)
    except _config_errors() as exc:
        reason = " ".join(str(exc).split())  # one line: validators' messages span several
        raise ModelLoadError(f"{path}/config.json cannot be read ({reason}); fix or replace it") \
            from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if wrapped is not None:  # a multimodal checkpoint: its text model
        config = text_config_of(config, wrapped)
    problem = _config_value_problem(config.to_dict())
    if problem:
        raise ModelLoadError(f"{path}/config.json: {problem}; fix it")
    _check_layer_count(path, config)
    return config, wrapped


def _check_layer_count(path: str | os.PathLike[str], config) -> None:
    """Refuse a layer count that the shards cannot hold (a layer stores at least one tensor)
    before a model of that many layers is built: ``num_hidden_layers: 1000000`` built the meta
    model for minutes, in gigabytes, before its names could be compared with the stored ones."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        return
    try:
        stored = len(CheckpointReader(path).names())
    except ModelLoadError:  # no weights, or broken ones: what reads them says so
        return
    if layers > stored:
        said = (f"num_hidden_layers: {layers}," if _declares(path, "num_hidden_layers") else
                f"no num_hidden_layers, so transformers takes its default, {layers},")
        raise ModelLoadError(
            f"{path}/config.json: {said} but the shards hold {stored} tensors in all (each "
            "layer stores some); set num_hidden_layers to the number of layers stored"
        )


def _declares(path: str | os.PathLike[str], key: str) -> bool:
    """Whether ``path``/config.json holds ``key`` at any depth (a wrapper's in text_config)."""
    def holds(tree) -> bool:
        return isinstance(tree, dict) and (key in tree or any(map(holds, tree.values())))

    try:
        return holds(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError):
        return True  # read before: what it says stands


# Values the modeling takes as they are and turns into NaN at the first forward: RoPE bases
# (any ``rope_theta``, top level or in a rope settings dict, flat or per layer type) and norm
# epsilons. Without this a zero base read as corrupt weights ("the logits hold NaN").
_EPS_KEY = re.compile(r"norm_(eps|epsilon)$")  # rms_norm_eps, layer_norm_epsilon, norm_eps...


def _config_value_problem(config: dict) -> str | None:
    """What in a config's RoPE bases, norm epsilons, sliding windows or expert clamp limits no
    model can compute with, or None."""
    def numbers(tree, key_wanted) -> Iterator[tuple[str, float]]:
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from ((f"{key}.{k}", v) for k, v in numbers(value, key_wanted))
            elif isinstance(key, str) and key_wanted(key) \
                    and isinstance(value, (int, float)) and not isinstance(value, bool):
                yield key, float(value)

    for key, value in numbers(config, lambda k: k == "rope_theta"):
        if not value > 0 or value == float("inf"):
            return f"{key} is {value}; a RoPE base must be a finite number above 0"
    for key, value in numbers(config, lambda k: k == "factor"):
        # a RoPE scaling factor divides the positions or frequencies: 0 made every logit NaN
        if key.startswith(("rope_parameters.", "rope_scaling.")) and not (
                0 < value < float("inf")):
            return f"{key} is {value}; a RoPE scaling factor must be a finite number above 0"
    for key, value in numbers(config, lambda k: bool(_EPS_KEY.search(k))):
        if not value >= 0 or value == float("inf"):
            return f"{key} is {value}; a norm epsilon must be a finite number of 0 or more"
    for key, value in numbers(config, lambda k: k == "sliding_window"):
        # a window of none is null (or off: Qwen2-MoE's 0 under use_sliding_window false);
        # one of 0 leaves a query no key to read
        level = config.get(key.rpartition(".")[0], {}) if "." in key else config
        if not value >= 1 and level.get("use_sliding_window", True) is not False:
            return f"{key} is {value}; a sliding window must hold at least 1 key (null: none)"
    for key, value in numbers(config, lambda k: k == "swiglu_limit"):  # GPT-OSS's clamp
        if not 0 < value < float("inf"):
            return f"{key} is {value}; a SwiGLU clamp limit must be a finite number above 0"
    return None


def meta_skeleton(path: str | os.PathLike[str]) -> nn.Module:
    """The causal LM that ``path``'s config.json describes, every parameter on the meta device
    (its ``quantization_config``, if any, dropped: the layers are plain ``nn.Linear``), in eval
    mode as ``from_pretrained`` returns a model (``from_config`` builds it training: dropout
    and Phi-3.5-MoE's router jitter were live in streamed calibration)."""
    from transformers import AutoModelForCausalLM

    config, wrapped = causal_lm_config(path)
    try:
        with no_weight_init(), parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config)
            if _unties_on_load(model, path):
                config.tie_word_embeddings = False
                model = AutoModelForCausalLM.from_config(config)
            return mark(model.eval(), wrapped)
    except (*_config_errors(), RuntimeError) as exc:
        raise ModelLoadError(
            f"{path}/config.json does not describe a model transformers can build ({exc}); fix it"
        ) from exc


def _unties_on_load(model: nn.Module, path: str | os.PathLike[str]) -> bool:
    """Whether a whole load (``from_pretrained``) leaves this tied model's head untied, so a
    skeleton must too: transformers 5 keeps a stored head whose values differ from the
    embedding's (and warns); transformers 4 ties it to the embedding whatever is stored."""
    import transformers

    if not getattr(model.config, "tie_word_embeddings", False) or \
            int(transformers.__version__.split(".")[0]) < 5:
        return False
    head_key, embed = output_weight_key(model), model.get_input_embeddings()
    embed_key = next((f"{n}.weight" for n, m in model.named_modules() if m is embed), None)
    if head_key is None or embed_key is None:
        return False
    try:
        reader = open_checkpoint(path)
    except ModelLoadError:  # no weights, or broken ones: what reads them says so
        return False
    if head_key not in reader or embed_key not in reader:
        return False
    differs = not reader.same_values(head_key, embed_key)
    if differs:
        log.warning("%s: config.json ties the output head to the embedding, but the checkpoint "
                    "stores a head with other values; it is used untied, as transformers' "
                    "from_pretrained does (set tie_word_embeddings to false to silence this)",
                    path)
    return differs


def verify_checkpoint(path: str | os.PathLike[str]) -> None:
    """Check a checkpoint folder before loading it, reading only headers and scales: every
    shard opens (not corrupt or truncated), every tensor the config implies has that shape
    (quantized layers: their ``weight_shape``), and quantization scales and zero points are
    finite. Each problem is one ``ModelLoadError`` line naming the file, the tensor and the
    fix; an MoE config's routing too (``routing_problem``). Tensors under names the model tree
    does not have (per-expert MoE weights) are left to the loader (``MoeTreeReader`` checks
    them). A bitsandbytes 4-bit weight (beside its ``.absmax``) is stored packed, two
    codes per byte: its size is checked, not its shape."""
    path = Path(path)
    reader = open_checkpoint(path)  # a multimodal checkpoint's text model (compress.io.wrapped)
    skeleton = meta_skeleton(path)
    expected = expected_tensors(skeleton)
    read_config_json(path)
    problem = routing_problem(skeleton)
    if problem is not None:
        raise ModelLoadError(f"{path / 'config.json'}: {problem}; fix config.json")
    for name in reader.names():
        leaf = name.rpartition(".")[2]
        if name in expected and expected[name].is_floating_point() \
                and not reader.dtype(name).is_floating_point and not _stores_codes(reader, name):
            raise ModelLoadError(
                f"{reader.file_of(name)}: tensor {name} is stored as {reader.dtype(name)} but "
                "the model's parameter is floating point and nothing beside it scales integer "
                "codes; the checkpoint is corrupt or its config.json lost its "
                "quantization_config: re-download or re-export it"
            )
        if name in expected and f"{name}.absmax" in reader:
            want = -(-expected[name].numel() // 2)
            if reader.nbytes(name) != want:
                raise ModelLoadError(
                    f"{reader.file_of(name)}: bitsandbytes 4-bit tensor {name} holds "
                    f"{reader.nbytes(name)} bytes but config.json implies {want} (shape "
                    f"{list(expected[name].shape)}, two codes per byte); the config does not "
                    "match the weights, fix config.json or re-export the checkpoint"
                )
        elif name in expected:
            if reader.shape(name) != tuple(expected[name].shape):
                reader.read(name, shape=tuple(expected[name].shape))  # raises, naming it
        elif leaf == "weight_shape":
            module = name.rpartition(".")[0]
            linear = expected.get(module + ".weight")
            shape = tuple(reader.read(name).tolist())
            if linear is not None and shape != tuple(linear.shape):
                raise ModelLoadError(
                    f"{reader.file_of(name)}: tensor {name} says {list(shape)} but config.json "
                    f"implies {list(linear.shape)}; the config does not match the weights, fix "
                    "config.json or re-export the checkpoint"
                )
            packed = f"{module}.weight_packed"
            if linear is None and packed in reader and (
                    len(shape) != 2 or reader.shape(packed) != (shape[0], -(-shape[1] // 8))):
                # a module outside the tree (an MoE's per-expert layer): its packed codes' shape
                # is checked against config.json by the loader, so this against the codes
                raise ModelLoadError(
                    f"{reader.file_of(name)}: tensor {name} says {list(shape)} but {packed} is "
                    f"{list(reader.shape(packed))} (eight 4-bit codes per int32); the checkpoint "
                    "is corrupt, re-export it"
                )
        if leaf in _SCALES and not reader.dtype(name).is_floating_point:
            raise ModelLoadError(  # the kernels would multiply by truncated integer scales
                f"{reader.file_of(name)}: tensor {name} is stored as {reader.dtype(name)} but "
                "scales are floating point; the checkpoint is corrupt, re-export it"
            )
        if leaf in _MUST_BE_FINITE:
            reader.read(name)  # raises on NaN/Inf


def _stores_codes(reader: CheckpointReader, name: str) -> bool:
    """Whether integer tensor ``name`` is a quantized layer's codes: a scale beside it (int8
    W8A8 ``weight_scale``, bitsandbytes' ``SCB`` or 4-bit ``absmax``)."""
    module = name.rpartition(".")[0]
    return any(k in reader for k in (f"{module}.weight_scale", f"{module}.SCB",
                                     f"{name}.absmax"))


def is_bnb_state(name: str, tensors: set[str]) -> bool:
    """Whether ``name`` is a bitsandbytes weight's quantization state (a 4-bit one's
    ``weight.absmax``, ``weight.quant_state...``; an 8-bit one's ``SCB``, ``weight_format``),
    one of ``tensors`` being that weight."""
    module, _, leaf = name.rpartition(".")
    return (name.partition(".weight.")[0] + ".weight" in tensors
            or leaf in ("SCB", "weight_format") and f"{module}.weight" in tensors)


def expected_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """What ``module`` holds in a checkpoint: parameters and persistent buffers, by name."""
    return dict(module.state_dict(keep_vars=True))


def is_resident(module: nn.Module) -> bool:
    """True when no tensor of ``module`` is on the meta device."""
    return all(t.device.type != "meta" for t in expected_tensors(module).values())


def materialize(
    module: nn.Module,
    prefix: str,
    reader: CheckpointReader,
    dtype: torch.dtype | None,
    device: torch.device | str = "cpu",
    *,
    skip: tuple[str, ...] = (),
    narrow: bool = False,
) -> None:
    """Fill every meta tensor of ``module`` (checkpoint names ``prefix + name``) from
    ``reader``, each floating tensor cast to ``dtype`` (None: as stored) on ``device``.
    Tensors already resident are left alone, and so are those whose name starts with one of
    ``skip`` (submodules read later). ``narrow``: large tensors stored narrower than ``dtype``
    (``keeps_stored_dtype``) stay as stored and their modules compute in ``dtype``
    (``compute_narrow_in``): the same outputs, half the memory for a bf16 checkpoint."""
    tensors = {}
    # persistent buffers are built real (the skeleton puts only parameters on meta) but stored
    # as the weights are: a trained one (GLM-4-MoE's router score-correction bias) is read
    stored_buffers = {n for n, _ in module.named_buffers() if prefix + n in reader}
    for name, current in expected_tensors(module).items():
        if (current.device.type != "meta" and name not in stored_buffers) \
                or name.startswith(skip):
            continue
        tensor = reader.read(prefix + name, shape=tuple(current.shape), dtype=current.dtype)
        if dtype is not None and tensor.is_floating_point() and not name.endswith("weight_scale"):
            if not (narrow and keeps_stored_dtype(name, tensor.dtype, tensor.numel(), dtype,
                                                  quantized=False)):
                tensor = tensor.to(dtype)
        tensors[name] = tensor.to(device)
    if tensors:
        module.load_state_dict(tensors, strict=False, assign=True)
        for tensor in expected_tensors(module).values():  # parameters stay frozen
            if isinstance(tensor, nn.Parameter):
                tensor.requires_grad_(False)
    if narrow and dtype is not None:
        compute_narrow_in(module, dtype)


def compute_narrow_in(module: nn.Module, dtype: torch.dtype, *,
                      exclude: tuple[type, ...] = ()) -> None:
    """``compute_in(owner, dtype)`` for every submodule of ``module`` (but ``exclude``'s, the
    quantized layers whose scales keep their dtype) holding a floating parameter that is not
    in ``dtype``."""
    for owner in module.modules():
        if not isinstance(owner, exclude) and any(
                p is not None and p.is_floating_point() and p.dtype != dtype
                for p in owner._parameters.values()):
            compute_in(owner, dtype)


def widen_narrow(module: nn.Module, keep: Collection[nn.Module] = ()) -> None:
    """Cast, for good, the parameters that ``compute_in`` let stay narrow to their module's
    compute dtype, but in the modules of ``keep``: a layer read back from a scratch file for a
    pass that changes float weights in place gets the exact float state."""
    kept = {id(m) for m in keep}
    for owner in module.modules():
        dtype = getattr(owner, "_compute_dtype", None)
        if dtype is None or id(owner) in kept:
            continue
        for name, param in owner._parameters.items():
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                owner._parameters[name] = nn.Parameter(param.detach().to(dtype),
                                                       requires_grad=False)


# Dense tensors at least this large keep a narrower stored float dtype (widened per call);
# smaller ones (norms, biases) are cast once: they cost nothing and stay off the hooks.
KEEP_STORED_BYTES = 1 << 20


def keeps_stored_dtype(name: str, stored: torch.dtype, numel: int, dtype: torch.dtype, *,
                       quantized: bool) -> bool:
    """Whether ``load_compressed`` keeps tensor ``name`` as stored rather than casting it to
    the compute ``dtype``: integer tensors and scales (weight, KV cache) always; a quantized
    layer's other float tensors never; a dense float tensor when it is stored narrower than
    ``dtype`` and holds at least ``KEEP_STORED_BYTES`` (also the memory preflight's rule)."""
    if not stored.is_floating_point or name.endswith(SCALE_SUFFIXES) or stored == dtype:
        return True
    if quantized:
        return False
    size = torch.empty((), dtype=stored).element_size()
    wide = torch.empty((), dtype=dtype).element_size()
    return size < wide and numel * size >= KEEP_STORED_BYTES


def release(module: nn.Module) -> None:
    """Send every tensor of ``module`` that the checkpoint holds (parameters, persistent
    buffers) back to the meta device, freeing its memory. Non-persistent buffers (rotary
    tables, Gemma's embedding scale) stay: the model's code computed them and no checkpoint
    can give them back, so a module read a second time would be missing them.

    A Parameter subclass (bitsandbytes' ``Params4bit``, ``Int8Params``) moves by its own
    ``.to``, which takes its quantization state along (``nn.Module.to`` would rebuild it as a
    plain Parameter, and fails on ``Params4bit``); a double-quantized 4-bit state keeps its
    scalar offset on the CPU, as bitsandbytes' state_dict reads it with ``.item()``: the meta
    module still lists its tensors (the export's names, the sizes in the reports)."""
    kept = []  # (owner, name, buffer): out of the way of nn.Module.to (it keeps ties)
    offsets = []  # (quantization state, its offset on the CPU)
    for owner in module.modules():
        for name in owner._non_persistent_buffers_set & set(owner._buffers):
            kept.append((owner, name, owner._buffers.pop(name)))
        for name, param in owner._parameters.items():
            if param is None or type(param) is nn.Parameter:
                continue
            state = getattr(param, "quant_state", None)
            offset = getattr(state, "offset", None)
            if offset is not None and not offset.is_meta:
                offsets.append((state, offset))
            if not param.is_meta:
                owner._parameters[name] = param.to("meta")
    try:
        module.to("meta")
    finally:
        for owner, name, buffer in kept:
            owner._buffers[name] = buffer
        for state, offset in offsets:
            state.offset = offset


# ---- the writer ---------------------------------------------------------------------------
def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor (bf16 included: viewed as uint8)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


class ShardWriter:
    """Tensors appended to safetensors shards of at most ``max_shard_size`` bytes in
    ``directory`` (a tensor larger than that gets a shard of its own). ``finish`` names the
    shards ``model-0000k-of-0000n.safetensors`` (or ``model.safetensors`` when there is one)
    and writes the index; until then the folder holds only ``.part`` files."""

    def __init__(self, directory: Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                 metadata: dict[str, str] | None = None) -> None:
        self.directory = Path(directory)
        self.max_bytes = parse_size(max_shard_size)
        self.metadata = dict(metadata or {"format": "pt"})
        self._shards: list[dict[str, tuple[str, list[int], int, int]]] = []
        self._body = None
        self._offset = 0
        self.total_bytes = 0
        self._names: set[str] = set()

    def _body_path(self, index: int) -> Path:
        return self.directory / f".shard-{index:05d}.body.part"

    def _start_shard(self) -> None:
        if self._body is not None:
            self._body.close()
        self._shards.append({})
        self._body = open(self._body_path(len(self._shards) - 1), "wb")  # noqa: SIM115
        self._offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name} is written twice")
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no safetensors name")
        data = tensor_bytes(tensor.cpu())
        size = data.nbytes
        if self._body is None or (self._offset and self._offset + size > self.max_bytes):
            self._start_shard()
        assert self._body is not None
        self._body.write(data)
        self._shards[-1][name] = (_DTYPE_NAMES[tensor.dtype], list(tensor.shape),
                                  self._offset, self._offset + size)
        self._offset += size
        self.total_bytes += size
        self._names.add(name)

    def add_all(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self.add(name, tensor)

    def finish(self) -> list[Path]:
        """Write the shards' headers and the index; returns the shard files."""
        if self._body is not None:
            self._body.close()
            self._body = None
        if not self._shards:
            self._start_shard()
            self._body.close()  # type: ignore[union-attr]
            self._body = None
        count = len(self._shards)
        names = (["model.safetensors"] if count == 1 else
                 [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)])
        weight_map = {}
        for index, (entries, name) in enumerate(zip(self._shards, names, strict=True)):
            header: dict[str, object] = {"__metadata__": self.metadata}
            for tensor_name, (dtype, shape, begin, end) in entries.items():
                header[tensor_name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
                weight_map[tensor_name] = name
            encoded = json.dumps(header, separators=(",", ":")).encode()
            encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
            body = self._body_path(index)
            with open(self.directory / name, "wb") as out, open(body, "rb") as src:
                out.write(struct.pack("<Q", len(encoded)))
                out.write(encoded)
                shutil.copyfileobj(src, out, 64 << 20)
            body.unlink()
        if count > 1:
            index_doc = {"metadata": {"total_size": self.total_bytes},
                         "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / INDEX_FILE).write_text(json.dumps(index_doc, indent=2) + "\n")
        return [self.directory / n for n in names]

    def abort(self) -> None:
        """Close and delete the unfinished shard bodies."""
        if self._body is not None:
            self._body.close()
            self._body = None
        for index in range(len(self._shards)):
            self._body_path(index).unlink(missing_ok=True)


# ---- a model whose decoder layers live on disk until a pass reaches them ---------------------
class StreamedModel:
    """``model`` (a ``meta_skeleton``) whose tensors stay in the checkpoint until asked for.

    ``load_layer(i)`` fills decoder layer i: from the scratch file an earlier pass left for it
    (its exact state, quantized buffers included), else from the source checkpoint cast to the
    compute ``dtype``. ``finish_layer(i)`` hands the finished layer to ``sink`` when one is set
    (the export writer, during the recipe's last pass), else saves it to scratch for the next
    pass, and frees it. ``outside()`` keeps the modules outside the decoder stack (embedding,
    final norm) resident for the length of a ``with`` block, for the calibration capture; the
    output head stays on disk unless the embedding is tied to it.
    """

    def __init__(
        self,
        model: nn.Module,
        reader: CheckpointReader,
        dtype: torch.dtype,
        layers: nn.ModuleList,
        layer_prefix: str,
        scratch_dir: Path,
    ) -> None:
        self.model, self.reader, self.dtype = model, reader, dtype
        self.layers, self.layer_prefix = layers, layer_prefix
        self.scratch_dir = Path(scratch_dir)
        self._scratch: dict[int, Path] = {}
        self.sink = None  # callable(prefix, module) that exports a finished module
        self.loads = 0  # layers materialized so far (a progress and test figure)

    def _layer_file(self, index: int) -> Path:
        return self.scratch_dir / f"layer{index:05d}.safetensors"

    def load_layer(
        self, index: int, device: torch.device | str = "cpu", *, defer: Iterable[nn.Module] = (),
        narrow: bool = False, narrow_parts: Iterable[nn.Module] = (),
    ) -> nn.Module:
        """Fill decoder layer ``index``. ``defer``: submodules of it left on meta when read
        from the source checkpoint, for ``load_part`` to read one at a time (a scratch file
        is read whole: it holds an earlier pass's exact state). ``narrow``: read from the
        source, its large bf16 tensors stay bf16 and are widened per call (``materialize``),
        for a pass that only runs the layer and reads weights through ``.to(dtype)``;
        ``narrow_parts``: only these submodules so (fused experts that a pass runs and rounds
        but does not change)."""
        layer = self.layers[index]
        defer = list(defer)
        if index in self._scratch:
            from safetensors.torch import load_file

            state = load_file(self._scratch.pop(index), device=str(device))
            layer.load_state_dict(state, strict=True, assign=True)
            self._layer_file(index).unlink(missing_ok=True)
            if not narrow:  # what an earlier pass left narrow is widened as from the source,
                # but in the parts the caller reads narrow or only rounds (``defer``: RTN)
                widen_narrow(layer, keep=[m for part in (*defer, *narrow_parts)
                                          for m in part.modules()])
        else:
            parts = list(narrow_parts)
            deferred = {id(m) for m in (*defer, *parts)}
            skip = tuple(f"{n}." for n, m in layer.named_modules() if id(m) in deferred)
            materialize(layer, f"{self.layer_prefix}{index}.", self.reader, self.dtype, device,
                        skip=skip, narrow=narrow)
            for part in parts:
                self.load_part(index, part, device, narrow=True)
        self.loads += 1
        return layer

    def load_part(self, index: int, module: nn.Module, device: torch.device | str = "cpu", *,
                  narrow: bool = False) -> None:
        """Fill ``module``, a submodule of decoder layer ``index`` that ``load_layer`` deferred
        (nothing to do when it is resident); ``narrow`` as for ``load_layer``."""
        layer = self.layers[index]
        name = next(n for n, m in layer.named_modules() if m is module)
        materialize(module, f"{self.layer_prefix}{index}.{name}.", self.reader, self.dtype, device,
                    narrow=narrow)

    def finish_layer(self, index: int) -> None:
        layer = self.layers[index]
        if self.sink is not None:
            self.sink(f"{self.layer_prefix}{index}.", layer)
        else:
            from safetensors.torch import save_file

            self.scratch_dir.mkdir(parents=True, exist_ok=True)
            # narrow tensors (bf16 weights a pass left float, read as stored) are written as
            # held: the next pass reads them widened or narrow as it reads a checkpoint, the
            # same values either way (widening them here made a GPT-OSS-120B layer's float
            # experts a 12.7 GB float32 copy, and the scratch file twice the size)
            state = {k: v.detach().cpu().contiguous() for k, v in layer.state_dict().items()}
            save_file(state, self._layer_file(index))
            self._scratch[index] = self._layer_file(index)
        release(layer)
        return_freed_memory()

    def layer_index(self, module_name: str) -> int | None:
        """The decoder layer a module name lies in, or None outside the stack."""
        if not module_name.startswith(self.layer_prefix):
            return None
        return int(module_name[len(self.layer_prefix):].partition(".")[0])

    def each_linear(self, plan: list[tuple], narrow: Collection[str] = ()) -> Iterator[tuple]:
        """``plan``'s items ``(module name, linear, ...)`` in order, each one's linear resident
        while the caller has it: each decoder layer's targets between reading that layer and
        handing it back (``finish_layer``), then the targets outside the stack (read, kept
        resident). The caller swaps the linear for its quantized module; the float one is
        freed as the next is read, so the peak follows the largest linear, not the layer (a
        13B layer is 1.3 GB in float32). Used by the passes that quantize one linear alone.
        The modules named in ``narrow`` are read narrow (``load_layer``): fused experts, which
        RTN widens one expert's projection at a time."""
        by_layer: dict[int, list[tuple]] = {}
        outside = []
        for item in plan:
            index = self.layer_index(item[0])
            if index is None:
                outside.append(item)
            else:
                by_layer.setdefault(index, []).append(item)
        for index, items in by_layer.items():
            self.load_layer(index, defer=[item[1] for item in items])
            for item in items:
                self.load_part(index, item[1], narrow=item[0] in narrow)
                yield item
                item[1].to("meta")  # swapped out but still referenced by the plan: free it
            self.finish_layer(index)
        for item in outside:
            self.load_module(item[0])
            yield item

    def load_module(self, name: str, device: torch.device | str = "cpu") -> nn.Module:
        """Make the module ``name`` outside the decoder stack resident (it stays so; a pass
        that changes it keeps its result in memory). The output head tied to the embedding is
        the embedding's weight."""
        module = self.model.get_submodule(name)
        tied = bool(getattr(getattr(self.model, "config", None), "tie_word_embeddings", False))
        head = self.model.get_output_embeddings() if hasattr(
            self.model, "get_output_embeddings") else None
        if tied and module is head:
            embed = self.model.get_input_embeddings()
            embed_name = next(n for n, m in self.model.named_modules() if m is embed)
            materialize(embed, f"{embed_name}.", self.reader, self.dtype, device)
            self.model.tie_weights()
        materialize(module, f"{name}.", self.reader, self.dtype, device)
        return module

    def has_scratch(self, index: int) -> bool:
        return index in self._scratch

    def scratch_reader(self, index: int) -> CheckpointReader | None:
        """A reader of layer ``index``'s scratch file (names without the layer prefix)."""
        if index not in self._scratch:
            return None
        return _FileReader(self._scratch[index])

    def outside_modules(self) -> list[tuple[str, nn.Module]]:
        """Top-level modules of the model outside the decoder stack that hold tensors,
        as (name, module) (the output head included)."""
        stack = self.layer_prefix.rstrip(".")
        found = []
        for name, module in self.model.named_modules():
            if not name or name == stack or stack.startswith(name + "."):
                continue
            if name.startswith(stack + ".") or any(name.startswith(n + ".") for n, _ in found):
                continue
            if expected_tensors(module):
                found.append((name, module))
        return found

    @contextlib.contextmanager
    def outside(self, device: torch.device | str = "cpu", *, head: bool = False,
                narrow: bool = False) -> Iterator[None]:
        """The modules outside the decoder stack resident inside the block (the output head
        only with ``head`` or when tied to the embedding); those that were on disk before go
        back to meta after it. ``narrow``: their large bf16 tensors stay as stored, widened per
        call (``materialize``), for a block that changes none of them."""
        head_module = self.model.get_output_embeddings() if hasattr(
            self.model, "get_output_embeddings") else None
        tied = bool(getattr(getattr(self.model, "config", None), "tie_word_embeddings", False))
        loaded = []
        try:
            for name, module in self.outside_modules():
                if module is head_module and (tied or not head):
                    continue  # tied: it is the embedding's weight, tied again below
                if is_resident(module):
                    continue
                materialize(module, f"{name}.", self.reader, self.dtype, device, narrow=narrow)
                loaded.append(module)
            if tied and head_module is not None:
                self.model.tie_weights()
            yield
        finally:
            for module in loaded:
                release(module)
            if tied and loaded:  # the head still held the released embedding's tensor: re-tie
                self.model.tie_weights()

    def release_outside(self) -> None:
        """Send the modules outside the decoder stack that passes kept resident (a rotated
        embedding and head, a quantized head) back to meta, once the export has written them
        (``release`` keeps a tie: the skeleton's sizes stay what they were)."""
        for _, module in self.outside_modules():
            release(module)

    def close(self) -> None:
        shutil.rmtree(self.scratch_dir, ignore_errors=True)


class _FileReader(CheckpointReader):
    """A reader of one safetensors file."""

    def __init__(self, file: Path) -> None:  # one file, no folder
        self.path = Path(file)
        self._where, self._entries = {}, {}
        self._index(self.path)
