"""GGUF files of our own fp32 Llama weights, for bench_e2e.py's llama.cpp rows.

``write_llama_gguf`` writes a transformers Llama as an F32 (or F16) GGUF: llama arch metadata
from the config, the tokenizer fields copied from a donor GGUF (SmolLM2's; the model's vocab
must be the donor's), and the tensors under llama.cpp's names. llama.cpp's rope (NORM type)
rotates adjacent pairs (2i, 2i+1) of each head while transformers rotates halves (i, i + D/2),
so the q and k rows are permuted per head (``permute_rope_rows``), as llama.cpp's own
convert_hf_to_gguf.py does. ``quantize_gguf`` then runs llama.cpp's quantizer
(``llama_model_quantize``, default params) in the llama-cpp-python venv, so the Q4_0 / Q4_K_M /
Q4_1 / Q8_0 files are exactly what llama.cpp itself would make; it picks other types for some
tensors on its own (e.g. the output matrix is Q6_K in a Q4_1 file, some attn_v/ffn_down are
Q6_K in a Q4_K_M one), ``tensor_types`` lists them.

Files land in ``cache_dir() / "gguf"`` and are written to a ``.part`` name first, then renamed:
a run cut short leaves no half file under the final name. Only plain Llama (no rope scaling,
no biases, SiLU) is written; anything else is refused by name.
"""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

from compress.arch import arch_for, decoder_layers, output_weight_key
from compress.io.load import cache_dir

# Runs in the llama-cpp-python venv: argv = src, dst, ftype name, threads. Any LLAMA_FTYPE_MOSTLY_*
# suffix works (Q4_0, Q4_K_M, Q4_1, Q8_0, ...): an unknown one fails there, with its name.
QUANTIZE = r"""
import ctypes, sys, llama_cpp
src, dst, ftype, threads = sys.argv[1:5]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
params.nthread = int(threads)
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))
"""
FILE_TYPES = {"f32": 0, "f16": 1}  # general.file_type of the float files (llama_ftype values)


def gguf_dir() -> Path:
    return cache_dir() / "gguf"


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q or k weight [n_heads * D, K] from transformers' rotate-half row order to llama.cpp's
    interleaved one: in each head, row 2i <- row i and row 2i+1 <- row D/2 + i, so the pair
    llama.cpp rotates together is the pair transformers rotates together. For k, n_heads is
    the number of kv heads."""
    rows, k = w.shape
    d = rows // n_heads
    # [H, 2, D/2, K] (half, index in half) -> [H, D/2, 2, K] (pair, member of the pair)
    return w.reshape(n_heads, 2, d // 2, k).transpose(1, 2).reshape(rows, k)


def donor_tokenizer_fields(donor: Path) -> list[tuple]:
    """Every ``tokenizer.ggml.*`` field of ``donor`` as (key, value, type, array item type)."""
    from gguf import GGUFReader, GGUFValueType

    fields = []
    for key, field in GGUFReader(donor).fields.items():
        if key.startswith("tokenizer.ggml."):
            array = field.types[0] == GGUFValueType.ARRAY
            item_type = field.types[-1] if array else None
            fields.append((key, field.contents(), field.types[0], item_type))
    return fields


def _check_plain_llama(config) -> None:
    rope = getattr(config, "rope_parameters", None) or {}
    problems = []
    if config.model_type != "llama":
        problems.append(f"model_type {config.model_type!r} (only 'llama')")
    if rope.get("rope_type") != "default":
        problems.append(f"rope_type {rope.get('rope_type')!r} (only 'default': no rope scaling)")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("biases on the attention or MLP linears")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act {config.hidden_act!r} (only 'silu')")
    if problems:
        raise ValueError(
            f"write_llama_gguf writes plain Llama only; this model has: {'; '.join(problems)}"
        )


def _metadata(writer, config, name: str, dtype: str) -> None:
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(FILE_TYPES[dtype])


def llama_gguf_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, fp32 tensor in torch's [out, in] order) for every tensor llama.cpp loads.
    ``output.weight`` is left out when the head is tied to the embedding (llama.cpp then uses
    token_embd.weight for both)."""
    arch = arch_for(model, "gguf export")
    config = model.config
    get = model.get_submodule
    out = [("token_embd.weight", get(arch.embed).weight)]
    for i, layer in enumerate(decoder_layers(model, "gguf export")):
        weight = {n: layer.get_submodule(getattr(arch, n)).weight for n in "qkvo"}
        weight |= {n: layer.get_submodule(getattr(arch, n)).weight for n in ("gate", "up", "down")}
        out += [
            (f"blk.{i}.attn_norm.weight", layer.get_submodule(arch.attn_norm).weight),
            (f"blk.{i}.attn_q.weight", permute_rope_rows(weight["q"], config.num_attention_heads)),
            (f"blk.{i}.attn_k.weight", permute_rope_rows(weight["k"], config.num_key_value_heads)),
            (f"blk.{i}.attn_v.weight", weight["v"]),
            (f"blk.{i}.attn_output.weight", weight["o"]),
            (f"blk.{i}.ffn_norm.weight", layer.get_submodule(arch.mlp_norm).weight),
            (f"blk.{i}.ffn_gate.weight", weight["gate"]),
            (f"blk.{i}.ffn_up.weight", weight["up"]),
            (f"blk.{i}.ffn_down.weight", weight["down"]),
        ]
    out.append(("output_norm.weight", get(arch.final_norm).weight))
    head = output_weight_key(model)
    head_weight = model.get_parameter(head) if head else None
    if head_weight is not None and head_weight.data_ptr() != out[0][1].data_ptr():
        out.append(("output.weight", head_weight))
    return [(n, t.detach().float()) for n, t in out]


@contextmanager
def _atomic(path: Path):
    """Yields a ``.part`` path to write; renamed to ``path`` only when the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    try:
        yield part
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


@torch.no_grad()
def write_llama_gguf(
    model: torch.nn.Module, path: Path, donor: Path, *, name: str, dtype: str = "f32"
) -> Path:
    """Write ``model`` (a transformers Llama) to ``path`` as a GGUF with ``donor``'s tokenizer.
    dtype "f32" or "f16" for the 2-D tensors; norms stay F32 (llama.cpp wants them so).
    Tensors stream to the file one at a time (a 1.1B model is not copied whole)."""
    from gguf import GGUFWriter

    config = model.config
    _check_plain_llama(config)
    fields = donor_tokenizer_fields(donor)
    vocab = len(next(v for k, v, *_ in fields if k == "tokenizer.ggml.tokens"))
    if vocab != config.vocab_size:
        raise ValueError(
            f"{donor.name} has {vocab} tokens but the model's vocab_size is {config.vocab_size}; "
            f"build the model with vocab_size={vocab} to use this tokenizer"
        )
    tensors = llama_gguf_tensors(model)
    with _atomic(Path(path)) as part:
        writer = GGUFWriter(part, "llama")
        _metadata(writer, config, name, dtype)
        for key, value, vtype, item_type in fields:
            writer.add_key_value(key, value, vtype, item_type)
        arrays = [(n, t.half() if dtype == "f16" and t.dim() == 2 else t) for n, t in tensors]
        for n, t in arrays:
            writer.add_tensor_info(n, t.shape, t.numpy().dtype, t.numel() * t.element_size())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, t in arrays:
            writer.write_tensor_data(t.contiguous().numpy())
        writer.close()
    return Path(path)


def quantize_gguf(src: Path, dst: Path, ftype: str, python: Path, threads: int = 2) -> Path:
    """llama.cpp's ``llama_model_quantize`` (default params; ``ftype`` a LLAMA_FTYPE_MOSTLY_*
    suffix such as "Q4_0", "Q4_K_M", "Q4_1" or "Q8_0") of ``src`` into ``dst``, run by
    ``python`` (the venv with llama_cpp) under nice."""
    with _atomic(Path(dst)) as part:
        command = ["nice", "-n", "19", str(python), "-c", QUANTIZE, str(src), str(part), ftype]
        done = subprocess.run(command + [str(threads)], capture_output=True, text=True)
        if done.returncode != 0 or not part.is_file():
            raise RuntimeError(
                f"llama_model_quantize {src} -> {ftype} failed (code {done.returncode}): "
                f"{done.stderr[-2000:]}"
            )
    return Path(dst)


def cached_llama_ggufs(
    model: torch.nn.Module,
    name: str,
    ftypes: tuple[str, ...],
    *,
    donor: Path,
    python: Path,
    threads: int = 2,
    dtype: str = "f32",
) -> dict[str, Path]:
    """{ftype: path of ``<name>-<ftype>.gguf``} in ``gguf_dir()``, made once: the float GGUF
    (``dtype``) is written, quantized to every missing ftype, then deleted. ``name`` must
    identify the weights (the cache is keyed by it alone)."""
    paths = {f: gguf_dir() / f"{name}-{f.lower()}.gguf" for f in ftypes}
    missing = [f for f, p in paths.items() if not p.is_file()]
    if missing:
        float_path = gguf_dir() / f"{name}-{dtype}.gguf"
        source = write_llama_gguf(model, float_path, donor, name=name, dtype=dtype)
        try:
            for f in missing:
                quantize_gguf(source, paths[f], f, python, threads)
        finally:
            source.unlink()
    return paths


def tensor_bytes(path: Path, *, decode: bool = False) -> int:
    """Bytes of the tensor data in a GGUF (the file less its header, metadata and padding).
    decode=True leaves out token_embd.weight when the file has its own output.weight: a decode
    step then reads one embedding row, as ``Runtime.decode_bytes`` counts it."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    if decode and "output.weight" in tensors:
        del tensors["token_embd.weight"]
    return sum(tensors.values())


def tensor_types(path: Path) -> str:
    """The GGUF's tensor types with counts, most common first: "Q4_1 x154, F32 x45, Q6_K x1"."""
    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(path).tensors)
    return ", ".join(f"{kind} x{n}" for kind, n in counts.most_common())
