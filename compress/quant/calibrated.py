"""Sequential (layer-by-layer) calibration in bounded memory, shared by GPTQ, AWQ, SmoothQuant.

The calibration batch runs through the embeddings once, with every decoder layer standing in as
the identity: the inputs of decoder layer 0 are captured, and the keyword arguments (mask,
rotary tables) the model gives each layer, which differ between layer types in hybrid models
(Gemma2/3 sliding and global layers). Then for each layer i: the pass calibrates and
quantizes layer i on its captured inputs, and the *quantized* layer is run to produce the
inputs of layer i+1 (so later layers see, and compensate for, earlier layers' errors, as in
GPTQ). Only one layer's statistics and one set of hidden states ``[n, T, hidden]`` are alive
at a time. ``offload="cpu"`` keeps unprocessed layers on the CPU and moves each to
``state.device`` for its turn; ``offload="disk"`` also writes unprocessed layers' weights to a
temporary folder and frees them (meta tensors) until their turn, so host RAM holds only the
processed (quantized) layers plus one float layer.

On a GPU (``state.device``): the capture runs there with the modules outside the decoder stack
that its forward touches (embedding, rotary tables, final norm; not the output head) copied to
the device for its length only; each layer goes to the device for its turn, is calibrated and
quantized there (Hessians, scale searches and sign-SGD follow the layer's tensors) and comes
back to where it was (the CPU), or to the streamed export. The hidden states between layers
stay on the device. On the CPU nothing moves: the numbers are the CPU path's, bit for bit.

Peak memory is measured, not estimated (``compress.memory.MemoryMonitor``). Only decoder stacks
that ``compress.arch.decoder_layers`` finds are supported.

Also the scaffolding the calibrated passes share, so that no pass imports another: which layers
a pass plans to quantize (``plan_layers``), running it over the calibration data
(``run_calibrated``), the common report metrics (``finish_quant_report``) and folding a
per-channel scale into the producer of an input (``migrate_scales``, AWQ and SmoothQuant).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from compress.arch import Arch, NormForm, arch_for, decoder_layers
from compress.core.device import model_device, move_tensor, on_device
from compress.core.errors import DataError, NumericsError, OutputError
from compress.core.matcher import target_modules
from compress.core.registry import CompressionState, PassReport
from compress.memory import MemoryMonitor, file_backed_copy, return_freed_memory
from compress.quant.experts import float_experts_in, override_names, viewed_experts
from compress.quant.linear import QuantLinear, WeightScheme, bits_per_weight
from compress.quant.scheme import WeightQuantConfig, scheme_for_layer, warn_unused_overrides

log = logging.getLogger(__name__)

OffloadMode = Literal["none", "cpu", "disk"]


class _StopForward(Exception):
    """Raised by the capture hook once layer 0's inputs are recorded."""


@dataclass
class LayerInputs:
    """Hidden states entering one decoder layer, one tensor ``[1, T, hidden]`` per sample, and
    the keyword arguments the model passes to that layer (rotary embeddings, mask), one dict per
    sample. ``per_layer[i]`` holds layer i's keyword arguments: hybrid models give each layer
    type its own mask and rotary tables (Gemma2/3 sliding and global layers, Qwen2's sliding
    layers), so layer i must not be run with layer 0's."""

    hidden: list[torch.Tensor]
    kwargs: list[dict[str, Any]] = field(default_factory=list)  # one per sample
    per_layer: list[list[dict[str, Any]]] = field(default_factory=list)  # [layer][sample]
    # a folder: the hidden states wait in files there, paged by the kernel (``keep``)
    spill: Path | None = None

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the calibration keeps it between layers: itself, or with ``spill`` a
        file-backed copy of the same bits (``compress.memory.file_backed_copy``), so that every
        sample's hidden states need not fit in memory at once (a 70B layer's, 128 x 2048
        tokens in float32: 8.6 GB in and 8.6 GB out). CPU tensors only."""
        if self.spill is None or tensor.device.type != "cpu":
            return tensor
        # the samples' outputs this replaces were freed on the heap, where glibc keeps them
        # resident until trimmed: without this the heap grew by 0.3 GB a layer of the 1.1B
        # shape at 64 x 2048 tokens (2.26 GB anonymous for 1.91 estimated)
        return_freed_memory()
        try:
            return file_backed_copy(tensor, self.spill)
        except OSError as exc:  # a full disk (ENOSPC), a quota: the job stops, saying so
            raise OutputError(
                f"cannot keep the calibration's hidden states in {self.spill.parent} "
                f"({exc.strerror or exc}; each sample takes "
                f"{tensor.numel() * tensor.element_size() / 2**20:.0f} MiB): free disk there, "
                "or set calibration.activations: memory, or lower calibration.num_samples"
            ) from exc


def _all_finite(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x).all())


def _layer_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    keep = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "cache", "use_cache")}
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in keep.items()}


@torch.no_grad()
def capture_first_layer_inputs(
    model: nn.Module, batches: list[torch.Tensor], device: torch.device,
    spill: Path | None = None,
) -> LayerInputs:
    """Run each batch ``[1, T]`` through the model with every decoder layer replaced by the
    identity and record what enters layer 0 and the keyword arguments of every layer; the
    forward stops at the final norm. The layers' weights are not touched (they may be on the
    meta device, ``offload="disk"``)."""
    layers = decoder_layers(model, "sequential calibration")
    try:
        final_norm = model.get_submodule(arch_for(model, "sequential calibration").final_norm)
    except AttributeError:  # a variant without one (OPT-350m's norms follow the blocks): the head
        final_norm = model.get_output_embeddings()
    captured = LayerInputs(hidden=[], per_layer=[[] for _ in layers], spill=spill)

    def identity_for(index: int):
        def identity(*args: Any, **kwargs: Any) -> torch.Tensor:
            hidden = args[0] if args else kwargs.pop("hidden_states")
            if index == 0:
                if not _all_finite(hidden):
                    raise NumericsError(
                        "activations are NaN/Inf before decoder layer 0 (the embedding's "
                        "output); check the model's weights and config.json in float32"
                    )
                captured.hidden.append(captured.keep(hidden.detach()))
            captured.per_layer[index].append(_layer_kwargs(kwargs))
            return hidden

        return identity

    def stop(module: nn.Module, args: tuple) -> None:
        raise _StopForward

    handle = final_norm.register_forward_pre_hook(stop)
    try:
        for index, layer in enumerate(layers):
            layer.forward = identity_for(index)  # instance attribute: shadows the class method
        for ids in batches:
            try:
                model(move_tensor(ids, device, None), use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
        for layer in layers:
            layer.__dict__.pop("forward", None)
    if any(len(k) != len(batches) for k in captured.per_layer):
        raise ValueError(
            "sequential calibration: the model did not call every decoder layer once per batch"
        )
    captured.kwargs = captured.per_layer[0]
    return captured


@contextlib.contextmanager
def stack_returning(layers: nn.ModuleList, hidden: torch.Tensor) -> Iterator[None]:
    """Within: the decoder stack's forward replaced, its first layer returning ``hidden`` and the
    others passing it on, so that the model's own forward runs from the final norm on (norm,
    head, logit scaling, loss) on the last layer's output (the embedding lookup aside,
    nothing of the stack runs)."""

    def first(*args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden

    def passthrough(*args: Any, **kwargs: Any) -> torch.Tensor:
        return args[0] if args else kwargs["hidden_states"]

    try:
        for index, layer in enumerate(layers):
            layer.forward = first if index == 0 else passthrough  # shadows the class method
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs, *, check: str = "",
              keep: bool = True) -> list[torch.Tensor]:
    """Outputs of ``layer`` for every captured sample; NaN/Inf is an error naming the layer.
    ``keep=False``: a forward for its hooks only, each output dropped at once (a list of them
    is as large as the layer's inputs: 168 MB at 13B for 16 x 512 tokens)."""
    outs = []
    for hidden, kwargs in zip(inputs.hidden, inputs.kwargs, strict=True):
        out = layer(hidden, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if check and not _all_finite(out):  # NumericsError: the CLI reports it in one line
            raise NumericsError(
                f"{check}: activations became NaN/Inf; lower the damping/alpha settings or check "
                "the model in float32"
            )
        if keep:
            outs.append(inputs.keep(out.detach()))
    return outs


class _DiskOffload:
    """Unprocessed layers' tensors in a temp folder, the modules left on the meta device."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="compress-offload-")
        for index, layer in enumerate(layers):
            if index == 0:
                continue  # processed first: no point writing it out
            state = {k: v.detach().cpu().contiguous() for k, v in layer.state_dict().items()}
            save_file(state, self._path(index))
            layer.to("meta")

    def _path(self, index: int) -> str:
        return str(Path(self._dir.name) / f"layer{index}.safetensors")

    def restore(self, layer: nn.Module, index: int, device: torch.device) -> None:
        if index == 0:
            return
        layer.to_empty(device=device)
        layer.load_state_dict(load_file(self._path(index), device=str(device)), strict=False)
        os.remove(self._path(index))

    def close(self) -> None:
        self._dir.cleanup()


LayerFn = Callable[[int, nn.Module, LayerInputs], None]
# what of a streamed layer stays as stored (``run_sequential``): nothing, all, its experts
Narrow = Literal[False, True, "routed"]


def _send(layer: nn.Module, device: torch.device) -> None:
    """Move ``layer`` to ``device`` (``nn.Module.to``, through ``compress.core.device``'s one
    tensor move); a layer that changes device drops its quantized modules' cached kernel
    layouts, which belong to the old one. Nothing happens when it is there already."""
    if all(t.device == device for t in (*layer.parameters(), *layer.buffers())):
        return
    layer._apply(lambda t: move_tensor(t, device, None))
    for module in layer.modules():
        if isinstance(getattr(module, "_prepared", None), dict):
            module._prepared.clear()


@contextlib.contextmanager
def _capture_on(
    model: nn.Module, layers: nn.ModuleList, device: torch.device, stream: Any
) -> Iterator[None]:
    """The modules outside the decoder stack on ``device`` for the capture: a streamed model's
    are read from the checkpoint straight to the device; resident ones (rotary tables, modules an
    earlier pass kept) are copied there and put back after. The output head is left where it is
    (the capture stops before it). A streamed embedding stays in its stored bf16 and casts
    the rows it looks up: exact, and 0.65 GB less than a float32 table at 13B."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = [layers] + ([head] if head is not None else [])
    with contextlib.ExitStack() as stack:
        if stream is not None:
            stack.enter_context(stream.outside(device, narrow=True))
        stack.enter_context(on_device(model, device, skip=skip))
        yield


@torch.no_grad()
def run_sequential(
    model: nn.Module,
    batches: list[torch.Tensor],
    process_layer: LayerFn,
    *,
    device: torch.device,
    offload: OffloadMode = "none",
    progress: bool = True,
    desc: str = "layers",
    stream: Any = None,
    narrow: Narrow = False,
    spill_near: Path | None = None,
) -> dict[str, Any]:
    """Call ``process_layer(i, layer, inputs)`` for each decoder layer in order, feeding each
    layer the outputs of the already-processed previous layers. Returns memory metrics.
    ``spill_near``: a folder beside which the hidden states between layers wait in files
    (``LayerInputs.keep``; a temporary folder, removed at the end), not in memory.

    ``process_layer`` changes the layer in place (calibrate, quantize, swap modules); it may run
    ``run_layer(layer, inputs)`` as often as it needs. Decoder layers of the supported models hold
    no non-persistent buffers (rotary tables live on the model), so a layer written to disk is
    restored exactly by ``to_empty`` + ``load_state_dict``.

    ``stream`` (a ``compress.io.stream.StreamedModel``): the model is a meta skeleton whose
    layers are read from the checkpoint when their turn comes and handed back (to the export
    or a scratch file) after it; ``offload`` is then moot. The capture materializes the
    modules outside the decoder stack (embedding) for its length only. ``narrow`` (``Narrow``):
    a streamed layer's large bf16 tensors stay bf16, widened per call
    (``StreamedModel.load_layer``): all of them for a ``process_layer`` that changes no float
    weight in place (True: GPTQ), its fused experts only for one that changes none of theirs
    ("routed": AWQ and AutoRound, which round experts by RTN). Either way a layer's float
    fused experts run one expert at a time (``viewed_experts``: a GPT-OSS-120B layer's widened
    whole were 12.7 GB), in the streamed and the in-memory run alike (the same bits), and
    ``process_layer`` finds the view where the experts were (it replaces it, or the fused
    module comes back after the layer)."""
    layers = decoder_layers(model, "sequential calibration")
    prefix = arch_for(model, "sequential calibration").layer_prefix
    with MemoryMonitor(device) as monitor, _spill_folder(spill_near) as spill:
        disk = _DiskOffload(layers) if offload == "disk" and stream is None else None
        try:
            if offload == "cpu" and stream is None:
                layers.to("cpu")
            with _capture_on(model, layers, device, stream):
                inputs = capture_first_layer_inputs(model, batches, device, spill)
            for index in tqdm(range(len(layers)), desc=desc, disable=not progress):
                layer = layers[index]
                # where the layer goes back to: the CPU unless it lived on the device all along
                home = torch.device("cpu")
                experts = float_experts_in(model, f"{prefix}{index}.") if narrow else []
                if stream is not None:
                    parts = [model.get_submodule(n) for n in experts] if narrow == "routed" else []
                    stream.load_layer(index, device, narrow=narrow is True, narrow_parts=parts)
                elif disk is not None:
                    disk.restore(layer, index, device)
                elif offload == "none":
                    home = model_device(layer)
                _send(layer, device)
                inputs.kwargs = inputs.per_layer[index]
                with viewed_experts(model, experts):
                    process_layer(index, layer, inputs)
                    inputs.hidden = run_layer(layer, inputs, check=f"decoder layer {index}")
                _send(layer, home)  # the export and scratch files take CPU tensors
                if stream is not None:
                    stream.finish_layer(index)
        finally:
            if disk is not None:
                disk.close()
    metrics = monitor.metrics()
    metrics["offload"] = "stream" if stream is not None else offload
    metrics["calibration_tokens"] = int(sum(b.numel() for b in batches))
    metrics["activations"] = "disk" if spill_near is not None else "memory"
    return metrics


@contextlib.contextmanager
def _spill_folder(near: Path | None) -> Iterator[Path | None]:
    """A hidden temporary folder in ``near`` for the spilled hidden states (None: none)."""
    if near is None:
        yield None
        return
    Path(near).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".compress-activations-", dir=near) as folder:
        yield Path(folder)


# ---- shared by the calibrated passes (GPTQ, AWQ, SmoothQuant) -----------------------------
def plan_layers(
    model: nn.Module, cfg: WeightQuantConfig, n_bits: int, report: PassReport
) -> dict[str, WeightScheme]:
    """Targeted Linear layers inside the decoder stack -> scheme; others are reported skips."""
    prefix = arch_for(model, report.name).layer_prefix
    plan: dict[str, WeightScheme] = {}
    targeted = [(n, m) for n, m in target_modules(model, cfg) if isinstance(m, nn.Linear)]
    warn_unused_overrides(cfg, [n for n, _ in targeted] + override_names(model, cfg), report.name)
    for name, module in targeted:
        if not name.startswith(prefix):
            report.skipped[name] = "outside the decoder layers (sequential calibration only)"
            continue
        scheme = scheme_for_layer(module, cfg, n_bits, name)
        if isinstance(scheme, str):
            report.skipped[name] = scheme
        else:
            plan[name] = scheme
    return plan


def run_calibrated(
    model: nn.Module,
    state: CompressionState,
    process: LayerFn,
    pass_name: str,
    *,
    offload: OffloadMode,
    narrow: Narrow = False,
) -> dict[str, object]:
    """``run_sequential`` of ``process`` over the calibration batches (``[B, T]`` each), on the
    state's device and progress setting; returns its memory metrics. DataError without data."""
    if state.calibration_batches is None:
        raise DataError(f"{pass_name} needs calibration data: add a `calibration:` section")
    batches = [b.reshape(1, -1) if b.dim() == 1 else b for b in state.calibration_batches()]
    if not batches:
        raise DataError(f"{pass_name}: the calibration data is empty; raise num_samples")
    return run_sequential(
        model,
        batches,
        process,
        device=state.device,
        offload=offload,
        progress=state.progress,
        desc=f"{pass_name}: decoder layers, calibrated on {len(batches)} sequences",
        stream=state.stream,
        narrow=narrow,
        spill_near=state.activations_near,
    )


def finish_quant_report(
    model: nn.Module, report: PassReport, backend: str, memory: dict[str, object]
) -> None:
    """Switch the new QuantLinear layers to the configured backend (they ran on the reference
    path during calibration, so later layers saw exact dequantized weights) and fill metrics."""
    schemes: dict[str, int] = {}
    for name in report.changed:
        module = model.get_submodule(name)
        assert isinstance(module, QuantLinear)
        module.backend = backend
        module._prepared.clear()
        schemes[module.scheme.describe()] = schemes.get(module.scheme.describe(), 0) + 1
    report.peak_memory_bytes = int(memory["peak_memory_bytes"])  # type: ignore[arg-type]
    report.metrics.update(memory)
    weight_bytes = sum(model.get_submodule(n).weight_bytes() for n in report.changed)
    report.metrics.update(
        layers=len(report.changed),
        schemes=schemes,
        weight_bytes_after=weight_bytes,
        bits_per_weight=bits_per_weight(model, report.changed),
    )


def warn_unscaled(report: PassReport, notes: dict[str, Any], arch: Arch) -> None:
    """Collect the groups a scale pass (AWQ, SmoothQuant) quantized without folding a scale (the
    string entries of ``notes``: group -> reason) into ``report.metrics["unscaled"]`` and log a
    WARNING per reason: never a silent gap (OLMo2's q/k/v and gate/up have no producer)."""
    unscaled = {k: v for k, v in notes.items() if isinstance(v, str)}
    report.metrics["unscaled"] = unscaled
    by_reason: dict[str, list[str]] = {}
    for group, reason in unscaled.items():
        by_reason.setdefault(reason, []).append(group)
    for reason, groups in by_reason.items():
        log.warning(
            "%s: %d groups of linears (model_type %r) unscaled: %s; groups: %s%s",
            report.name,
            len(groups),
            arch.model_type,
            reason,
            " | ".join(groups[:3]),
            f" | ... ({len(groups)} in all)" if len(groups) > 3 else "",
        )


@torch.no_grad()
def migrate_scales(
    prev: nn.Module,
    lins: list[nn.Module],
    s_prev: torch.Tensor,
    s: torch.Tensor,
    *,
    norm_form: NormForm = "w",
    rows: slice | None = None,
) -> None:
    """Divide the outputs of ``prev`` by ``s_prev`` (rows of a Linear, or the weight of an
    RMSNorm-style norm) and multiply the consumers' input columns by ``s [K]``, the same scale as
    the consumers see it (AWQ repeats it per head under GQA): the float model is unchanged.

    ``norm_form`` is the norm's (``compress.arch.Arch.norm_form``): for ``"1+w"`` (Gemma,
    ``y = (1 + w) * normalize(x)``) the effective weight ``1 + w`` is what is divided, so the
    new weight is ``(1 + w) / s - 1`` (dividing ``w`` alone would leave the 1 unscaled).
    ``rows``: for a fused Linear producer, the rows that feed the consumers (Phi-3's v rows of
    ``[q; k; v]``, up half of ``[gate; up]``, ``compress.arch.producer_rows``); the other rows
    feed other operations and stay as they are."""
    if isinstance(prev, nn.Linear):
        part = slice(None) if rows is None else rows
        if s_prev.shape[0] != prev.weight[part].shape[0]:
            raise ValueError(f"scale of {s_prev.shape[0]} for {prev.weight[part].shape[0]} rows")
        prev.weight[part].div_(s_prev.unsqueeze(1).to(prev.weight.dtype))  # rows = its outputs
        if prev.bias is not None:
            prev.bias[part].div_(s_prev.to(prev.bias.dtype))
    elif rows is not None or prev.weight.dim() != 1:
        raise ValueError(
            f"{type(prev).__name__} cannot absorb a scale: a producer is an nn.Linear (rows "
            "divided) or a norm with a 1-D weight (rows=None)"
        )
    elif norm_form == "1+w":
        prev.weight.copy_((prev.weight.float() + 1) / s_prev - 1)
    else:  # RMSNorm-style: y = w * normalize(x)
        prev.weight.div_(s_prev.to(prev.weight.dtype))
    if not isinstance(prev, nn.Linear) and getattr(prev, "bias", None) is not None:
        prev.bias.div_(s_prev.to(prev.bias.dtype))  # LayerNorm: y = w * n(x) + b
    for lin in lins:
        lin.weight.mul_(s.to(lin.weight.dtype))
