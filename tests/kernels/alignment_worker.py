"""Run in a subprocess by test_alignment.py: every int8/int4 tensor of a quantized tiny Llama
moved to each 8-byte offset mod 64 in turn, then forward (1, 4, 64 rows) and runtime generation.

A native kernel that cannot take the operands kills this process (SIGSEGV), which the parent
test reports as a failure instead of dying with it. Prints one JSON line on success."""

from __future__ import annotations

import json
import sys

import torch

from compress.quant.linear import QuantLinear, set_backend, w8a8_from_linear
from compress.quant.rtn import Int4RtnConfig, Int8RtnConfig, quantize_linears
from compress.runtime.engine import Runtime
from compress.testing import make_tiny_llama

PACKED = ("weight", "weight_packed", "weight_scale", "weight_zero_point")
PROMPT = [1, 5, 9, 33, 70, 100, 7]


def at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A contiguous copy of ``t`` whose data starts ``offset`` bytes past a 64-byte boundary."""
    nbytes = t.numel() * t.element_size()
    buffer = torch.empty(nbytes + 128, dtype=torch.uint8)
    start = -buffer.data_ptr() % 64 + offset
    out = buffer[start : start + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 64 == offset
    return out


def build(scheme: str) -> torch.nn.Module:
    model = make_tiny_llama(initializer_range=0.3)
    if scheme == "int8":
        quantize_linears(model, Int8RtnConfig(), 8, "test")
    elif scheme == "int4":
        quantize_linears(model, Int4RtnConfig(group_size=32), 4, "test")
    else:  # W8A8: int8 weights x dynamic int8 activations
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear) and "layers." in name:
                parent, _, child = name.rpartition(".")
                w8a8 = w8a8_from_linear(module, torch.float32, backend="auto")
                setattr(model.get_submodule(parent), child, w8a8)
    return model


def move_all(model: torch.nn.Module, offset: int) -> int:
    moved = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            for name in PACKED:
                t = getattr(module, name, None)
                if isinstance(t, torch.Tensor) and t.numel():
                    setattr(module, name, at_offset(t, offset))
                    moved += 1
            module._prepared.clear()
    return moved


def check(scheme: str, offset: int) -> dict:
    torch.manual_seed(0)
    model = build(scheme)
    ids = {m: torch.randint(3, 300, (1, m)) for m in (1, 4, 64)}
    with torch.no_grad():
        aligned_out = {m: model(x).logits for m, x in ids.items()}
        tokens = Runtime(model, max_seq_len=32, compile=False,
                         keep_model_weights=True).generate([PROMPT], 8)  # model runs on
        moved = move_all(model, offset)
        moved_out = {m: model(x).logits for m, x in ids.items()}
        moved_tokens = Runtime(model, max_seq_len=32, compile=False,
                               keep_model_weights=True).generate([PROMPT], 8)  # model runs on
        set_backend(model, "reference")  # dequantize, plain fp32 matmul: the definition
        reference = {m: model(x).logits for m, x in ids.items()}
    errors = {
        m: float((moved_out[m] - reference[m]).norm() / reference[m].norm()) for m in ids
    }
    same = all(torch.equal(moved_out[m], aligned_out[m]) for m in ids)
    return {
        "offset": offset, "moved": moved, "same_as_aligned": same,
        "relative_error": errors, "tokens_equal": moved_tokens == tokens,
    }


if __name__ == "__main__":
    for offset in range(0, 64, 8):  # one line per offset, flushed before the next may crash
        print(json.dumps(check(sys.argv[1], offset)), flush=True)
