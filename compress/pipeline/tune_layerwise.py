"""``compress tune``'s sensitivity measurement one decoder layer at a time, for a checkpoint
whose float32 copy (and every format's error) does not fit in memory: the same empirical
Fisher as ``compress.pipeline.tune.measure_sensitivity``, computed as backpropagation with
layer-sized checkpoints.

1. Forward: the calibration batches through each layer in turn (read from the checkpoint in
   float32, run, freed), each layer's inputs kept in files (``LayerInputs.keep``: paged by the
   kernel, not held in memory).
2. The loss: the model's own forward from the final norm on (norm, head, loss), the decoder
   stack replaced by the last layer's outputs; its gradient there.
3. Backward, last layer first: the layer read again, each batch's inputs recomputed through it
   with autograd and the incoming gradient pushed back through it; the hooks score each of its
   linears as the whole-model measurement does, the error ``W_q - W`` of each format rebuilt
   from its RTN codes per call (codes are 1 byte a weight or less, where the float32 errors of
   every format of a 7B layer are 4.8 GB). The gradient at the layer's input goes on.

Memory: one layer in float32 and its codes in every format, the embedding and head for the
loss, one gradient per calibration token (hidden wide), a batch's activations. Disk: every
layer's inputs (layers x tokens x hidden x 4 bytes). Each layer is read twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from compress.arch import decoder_layers
from compress.pipeline.tune_units import Unit, fisher_hooks, measured_linears, quantized_variants

log = logging.getLogger(__name__)


def measure_sensitivity_layerwise(
    stream, units: dict[str, Unit], formats: list, batches: list[torch.Tensor], *,
    spill_near: Path, progress: bool = False, resume: Path | None = None,
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, int]]]:
    """``measure_sensitivity``'s per-linear (scores, sizes) for the linears ``measured_linears``
    gives for ``units``, from ``stream`` (``compress.io.export.layerwise_model``: a read-only
    ``StreamedModel`` computing in float32). ``spill_near``: the folder the layers' inputs wait
    in (a temporary folder inside it, removed at the end). ``resume``: a file where the work
    done is saved after each layer's backward (the scores so far and the gradient where it
    stopped) and read back by a run cut short: it redoes the forward up to that layer, not the
    layers it had finished; removed when the measurement is complete."""
    from compress.quant.calibrated import capture_first_layer_inputs, run_layer

    model, cpu = stream.model, torch.device("cpu")
    layers = decoder_layers(model, "compress tune")
    spill_near.mkdir(parents=True, exist_ok=True)
    fingerprint = _fingerprint(units, formats, batches)
    saved = _read_progress(resume, fingerprint) if resume is not None else None
    scores: dict[str, dict[str, float]] = saved["scores"] if saved else {}
    sizes: dict[str, dict[str, int]] = saved["sizes"] if saved else {}
    # the layers the forward runs: all of them, or those before where a cut run stopped
    forward = saved["next"] if saved else len(layers)
    with tempfile.TemporaryDirectory(prefix=".compress-tune-", dir=spill_near) as folder:
        with stream.outside(cpu):
            inputs = capture_first_layer_inputs(model, batches, cpu, Path(folder))
        entering: list[list[torch.Tensor]] = []
        for index in range(forward):  # 1. forward
            stream.load_layer(index, cpu)
            entering.append(inputs.hidden)
            inputs.kwargs = inputs.per_layer[index]
            inputs.hidden = run_layer(layers[index], inputs, check=f"decoder layer {index}")
            stream.finish_layer(index)
            if progress:
                log.info("tune: forward through layer %d/%d", index + 1, len(layers))
        if saved:
            entering.append(inputs.hidden)  # the input of the layer it stopped at
            grads = saved["grads"]
            log.info("tune: resuming the sensitivity at layer %d of %d from %s", forward + 1,
                     len(layers), resume)  # fmt: skip
        else:
            grads = _loss_gradients(stream, layers, batches, inputs.hidden, progress)  # 2.
        for index in reversed(range(len(entering))):  # 3. backward
            layer = stream.load_layer(index, cpu)
            prefix = f"{stream.layer_prefix}{index}."
            here = {n: u for n, u in units.items() if n.startswith(prefix)}
            with measured_linears(model, here) as members:
                names = [n for group in members.values() for n in group]
                modules = {n: model.get_submodule(n) for n in names}
                quants = {}
                for name, linear in modules.items():
                    sizes[name], quants[name] = quantized_variants(linear, formats)
                    scores[name] = dict.fromkeys(sizes[name], 0.0)

                with fisher_hooks(modules, _rebuilt_error(modules, quants), scores):
                    grads = _backward_through(layer, entering[index], inputs.per_layer[index],
                                              grads)  # fmt: skip
            entering[index] = []  # its files are read for the last time
            stream.finish_layer(index)
            if resume is not None and index > 0:
                _save_progress(resume, fingerprint, index - 1, scores, sizes, grads)
            if progress:
                log.info("tune: sensitivity of layer %d/%d", index + 1, len(layers))
        del inputs, entering
    if resume is not None:
        resume.unlink(missing_ok=True)
    return scores, sizes


def _fingerprint(units: dict[str, Unit], formats: list, batches: list[torch.Tensor]) -> str:
    """What a saved measurement must have been made for: the units, formats and token ids."""
    digest = hashlib.sha256(json.dumps([list(units), [f.name for f in formats]]).encode())
    for ids in batches:
        digest.update(str(tuple(ids.shape)).encode())
        digest.update(ids.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def _save_progress(path: Path, fingerprint: str, next_layer: int, scores: dict, sizes: dict,
                   grads: list[torch.Tensor]) -> None:
    """The work done (scores and sizes of the layers finished, the gradient at the input of
    the last one) in one file, replaced atomically: a cut leaves the previous save whole."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"fingerprint": fingerprint, "next": str(next_layer),
            "tables": json.dumps({"scores": scores, "sizes": sizes})}  # fmt: skip
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # two runs: two files
    save_file({f"grad{i}": g.contiguous() for i, g in enumerate(grads)}, str(tmp), metadata=meta)
    os.replace(tmp, path)


def _read_progress(path: Path, fingerprint: str) -> dict | None:
    """A save of ``_save_progress`` made for ``fingerprint``, or None (none, another
    measurement's, or unreadable: measured from the start, saying so)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as handle:
            meta = handle.metadata() or {}
            if meta.get("fingerprint") != fingerprint:
                log.warning("tune: %s was saved for another measurement; starting over", path)
                return None
            grads = [handle.get_tensor(f"grad{i}") for i in range(len(handle.keys()))]
        tables = json.loads(meta["tables"])
        return {"next": int(meta["next"]), "grads": grads, "scores": tables["scores"],
                "sizes": tables["sizes"]}  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        log.warning("tune: ignoring the damaged saved measurement %s (%s); starting over", path,
                    exc)  # fmt: skip
        return None


def _rebuilt_error(modules: dict[str, nn.Linear], quants: dict[str, dict]):
    """``delta(name, fmt)``: ``W_q - W`` in float32 from the format's codes, per call."""

    def delta(name: str, fmt: str) -> torch.Tensor:
        weight = modules[name].weight.detach().float()
        return quants[name][fmt].dequantized_weight(torch.float32) - weight

    return delta


def _loss_gradients(stream, layers: nn.ModuleList, batches: list[torch.Tensor],
                    last: list[torch.Tensor], progress: bool) -> list[torch.Tensor]:
    """The next-token loss of each batch (the model's own forward from the final norm on, the
    decoder stack replaced by ``last``, its outputs) and its gradient at ``last``."""
    from compress.quant.calibrated import stack_returning

    model, grads = stream.model, []
    with stream.outside(torch.device("cpu"), head=True):
        for ids, hidden in zip(batches, last, strict=True):
            hidden = hidden.detach().clone().requires_grad_(True)
            with stack_returning(layers, hidden):
                loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            grads.append(hidden.grad)
            if progress:
                log.info("tune: sensitivity batch loss %.3f", loss.item())
    return grads


def _backward_through(layer: nn.Module, entering: list[torch.Tensor], kwargs: list[dict],
                      grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each batch's inputs through ``layer`` again with autograd, its output gradient pushed
    back (the hooks score its linears on the way); the gradients at its inputs."""
    for param in layer.parameters():
        param.requires_grad_(False)  # gradients w.r.t. activations only
    out_grads = []
    for hidden, extra, grad in zip(entering, kwargs, grads, strict=True):
        hidden = hidden.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            out = layer(hidden, **extra)
            out = out[0] if isinstance(out, tuple) else out
            torch.autograd.backward(out, grad)
        out_grads.append(hidden.grad)
    return out_grads


def layerwise_sensitivity_bytes(where, formats: list, batch_tokens: int,
                                total_tokens: int) -> int | None:
    """Estimated peak resident bytes of ``measure_sensitivity_layerwise`` on the checkpoint
    folder ``where`` (None where it cannot be read without loading), from its meta skeleton:
    the larger of its two phases, plus a gradient and an input per calibration token
    (``total_tokens``, hidden wide). A layer's: the largest decoder layer read in float32 beside
    its stored copy (the layer-by-layer evaluation's term, ``_layerwise_eval_bytes``: fused
    experts are stacked as they are read), its RTN codes in every integer format (a byte a
    weight at most), one float32 error of its largest linear and a batch's activations. The
    loss's: the modules outside the stack, read the same way, and a batch's logits three
    times. Measured against it (docs/results.md, "compress tune on 7B"):
    the 7B shape 2.53 and 3.67 GB, the 1.1B 1.64 GB, two Mixtral-8x7B layers 15.2 GB."""
    from compress.io.load import is_compressed_checkpoint
    from compress.io.stream import meta_skeleton
    from compress.pipeline.preflight import BASE_BYTES, FLOAT32
    from compress.pipeline.tune_units import tune_units

    if not isinstance(where, Path) or is_compressed_checkpoint(where):
        return None
    skeleton = meta_skeleton(where)
    layers = decoder_layers(skeleton, "compress tune")
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    integer = sum(1 for f in formats if not f.is_float)
    biggest = max((u.numel // max(u.expert_count * 3, 1) for u in tune_units(skeleton).values()),
                  default=0)  # one expert's projection of an experts module
    outside = sum(p.numel() for p in skeleton.parameters()) - sum(
        p.numel() for p in layers.parameters())
    cfg = skeleton.config
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    intermediate = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden)
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    layer = (int(1.5 * largest * (FLOAT32 + 2)) + largest * integer + 2 * biggest * FLOAT32
             + batch_tokens * (8 * hidden + 4 * intermediate) * FLOAT32)
    loss = int(1.5 * outside * (FLOAT32 + 2)) + 3 * batch_tokens * vocab * FLOAT32
    return BASE_BYTES + max(layer, loss) + 2 * total_tokens * hidden * FLOAT32


def use_layer_by_layer(where, whole_bytes: int | None, forced: bool | None) -> bool:
    """Whether tune measures layer by layer: as ``forced`` when given (True needs a plain
    checkpoint folder), else when the whole-model measurement's estimate ``whole_bytes`` is
    over the available memory and the source is such a folder."""
    from compress.core.errors import ConfigError
    from compress.io.load import is_compressed_checkpoint
    from compress.memory import available_memory_bytes

    readable = isinstance(where, Path) and not is_compressed_checkpoint(where)
    if forced is not None:
        if forced and not readable:
            raise ConfigError(f"tune: measuring layer by layer reads a checkpoint folder of float "
                              f"weights; {where} is not one (a compressed checkpoint or a hub "
                              "id): drop --layer-by-layer")  # fmt: skip
        return forced
    available = available_memory_bytes()
    return readable and None not in (whole_bytes, available) and whole_bytes > available
