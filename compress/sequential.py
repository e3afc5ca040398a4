"""Sequential (layer-by-layer) calibration in bounded memory, shared by GPTQ, AWQ, SmoothQuant.

The calibration batch runs through the embeddings once; the inputs of decoder layer 0 are
captured (a hook that stops the forward), then for each layer i: the pass calibrates and
quantizes layer i on its captured inputs, and the *quantized* layer is run to produce the
inputs of layer i+1 (so later layers see, and compensate for, earlier layers' errors, as in
GPTQ). Only one layer's statistics and one set of hidden states ``[n, T, hidden]`` are alive
at a time. ``offload="cpu"`` keeps unprocessed layers on the CPU and moves each to
``state.device`` for its turn; ``offload="disk"`` also writes unprocessed layers' weights to a
temporary folder and frees them (meta tensors) until their turn, so host RAM holds only the
processed (quantized) layers plus one float layer.

Peak memory is measured, not estimated: on CUDA the allocator's peak; on CPU a background
thread samples the process RSS every 10 ms (``/proc/self/statm``, Linux). Only decoder stacks
that expose ``model.model.layers`` (Llama, Qwen2, Mistral, ... in transformers) are supported.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

OffloadMode = Literal["none", "cpu", "disk"]


class _StopForward(Exception):
    """Raised by the capture hook once layer 0's inputs are recorded."""


@dataclass
class LayerInputs:
    """Hidden states entering one decoder layer, one tensor ``[1, T, hidden]`` per sample, and
    the keyword arguments the model passes to every layer (rotary embeddings, mask)."""

    hidden: list[torch.Tensor]
    kwargs: list[dict[str, Any]] = field(default_factory=list)  # one per sample


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """``model.model.layers`` or a clear error for an unsupported architecture."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__} has no model.layers decoder stack; sequential calibration "
            "supports Llama-style causal LMs (LlamaForCausalLM, Qwen2ForCausalLM, ...)"
        )
    return layers


@torch.no_grad()
def capture_first_layer_inputs(
    model: nn.Module, batches: list[torch.Tensor], device: torch.device
) -> LayerInputs:
    """Run each batch ``[1, T]`` until decoder layer 0 and record what enters it."""
    layer0 = decoder_layers(model)[0]
    captured = LayerInputs(hidden=[])

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        if not torch.isfinite(hidden).all():
            raise ValueError("calibration activations contain NaN/Inf before decoder layer 0")
        captured.hidden.append(hidden.detach())
        keep = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "use_cache")}
        keep = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in keep.items()}
        captured.kwargs.append(keep)
        raise _StopForward

    handle = layer0.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for ids in batches:
            try:
                model(ids.to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
    return captured


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs, *, check: str = "") -> list[torch.Tensor]:
    """Outputs of ``layer`` for every captured sample; NaN/Inf is an error naming the layer."""
    outs = []
    for hidden, kwargs in zip(inputs.hidden, inputs.kwargs, strict=True):
        out = layer(hidden, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        if check and not torch.isfinite(out).all():
            raise ValueError(
                f"{check}: activations became NaN/Inf; lower the damping/alpha settings or check "
                "the model in float32"
            )
        outs.append(out.detach())
    return outs


class MemoryMonitor:
    """Peak memory during a ``with`` block: CUDA allocator peak, else sampled process RSS."""

    def __init__(self, device: torch.device, interval_s: float = 0.01) -> None:
        self.device, self.interval_s = device, interval_s
        self.peak_bytes = 0
        self.start_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def rss_bytes() -> int:
        try:
            with open("/proc/self/statm") as handle:
                return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return 0

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, self.rss_bytes())

    def __enter__(self) -> MemoryMonitor:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
        else:
            self.start_bytes = self.peak_bytes = self.rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, self.rss_bytes())
        if self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)

    def metrics(self) -> dict[str, Any]:
        kind = "cuda_allocated" if self.device.type == "cuda" else "process_rss_sampled"
        return {
            "peak_memory_kind": kind,
            "memory_at_start_bytes": self.start_bytes,
            "peak_memory_bytes": self.peak_bytes,
            "peak_memory_over_start_bytes": max(0, self.peak_bytes - self.start_bytes),
        }


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
) -> dict[str, Any]:
    """Call ``process_layer(i, layer, inputs)`` for each decoder layer in order, feeding each
    layer the outputs of the already-processed previous layers. Returns memory metrics.

    ``process_layer`` changes the layer in place (calibrate, quantize, swap modules); it may run
    ``run_layer(layer, inputs)`` as often as it needs. Decoder layers of Llama-style models hold
    no non-persistent buffers (rotary tables live on the model), so a layer written to disk is
    restored exactly by ``to_empty`` + ``load_state_dict``."""
    layers = decoder_layers(model)
    with MemoryMonitor(device) as monitor:
        disk = _DiskOffload(layers) if offload == "disk" else None
        try:
            if offload == "cpu":
                layers.to("cpu")
            inputs = capture_first_layer_inputs(model, batches, device)
            for index in tqdm(range(len(layers)), desc=desc, disable=not progress):
                layer = layers[index]
                if disk is not None:
                    disk.restore(layer, index, device)
                layer.to(device)
                process_layer(index, layer, inputs)
                inputs.hidden = run_layer(layer, inputs, check=f"decoder layer {index}")
                if offload != "none":
                    layer.to("cpu")
        finally:
            if disk is not None:
                disk.close()
    metrics = monitor.metrics()
    metrics["offload"] = offload
    metrics["calibration_tokens"] = int(sum(b.numel() for b in batches))
    return metrics
