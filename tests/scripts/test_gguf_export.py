"""scripts/gguf_export.py: our Llama weights as a GGUF that llama.cpp reads as the same model.

The q/k row permutation is checked against rope itself (transformers' rotate-half rope on the
original rows and an interleaved, complex-pair rope written here on the permuted rows give the
same rotated vectors and the same q.k scores); the metadata and tensors round-trip through
gguf's own reader; a failed write leaves no file. The end-to-end check loads an F32 GGUF of a
tiny random Llama in llama.cpp (the llama-cpp-python venv that scripts/bench_e2e.py builds; the
test skips without it, it never builds it) and compares its logits with transformers' float64
ones, and quantizes it with llama.cpp's quantizer.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter

from compress.arch import LLAMA, decoder_layers
from compress.io.load import EMBEDDED, _gguf_location, cache_dir
from compress.testing import make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gguf_export", ROOT / "scripts" / "gguf_export.py")
gguf_export = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gguf_export)

VOCAB = 320  # compress.testing's tiny vocab


@pytest.fixture
def donor(tmp_path) -> Path:
    """A tokenizer-only GGUF with VOCAB tokens, fields of every kind the real donors have."""
    path = tmp_path / "donor.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges(["t 1", "t 2"])
    writer.add_bos_token_id(1)
    writer.add_add_bos_token(False)
    writer.add_string("general.note", "not a tokenizer field: must not be copied")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def _rope_cos_sin(t: int, d: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [D/2]
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv  # [T, D/2]
    return angles.cos(), angles.sin()


def _rope_rotate_half(x: torch.Tensor, cos, sin) -> torch.Tensor:
    """transformers' rope: x [T, H, D]; pairs (i, i + D/2)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # [T, D]
    # apply_rotary_pos_emb wants [B, H, T, D]; [T, H, D] -> [1, H, T, D]
    q = x.transpose(0, 1)[None]
    rotated, _ = apply_rotary_pos_emb(q, q, cos2[None], sin2[None])
    return rotated[0].transpose(0, 1)


def _rope_interleaved(x: torch.Tensor, cos, sin) -> torch.Tensor:
    """llama.cpp's NORM rope: x [T, H, D]; pairs (2i, 2i+1) as complex numbers."""
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())  # [T, H, D/2]
    turn = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[:, None]  # [T, 1, D/2]
    return torch.view_as_real(pairs * turn).reshape(x.shape)


def test_permuted_rows_under_interleaved_rope_equal_rotate_half_rope():
    torch.manual_seed(0)
    t, heads, d, k = 7, 3, 8, 5
    w = torch.randn(heads * d, k, dtype=torch.float64)
    x = torch.randn(t, k, dtype=torch.float64)
    cos, sin = _rope_cos_sin(t, d, 10000.0)
    hf = _rope_rotate_half((x @ w.T).view(t, heads, d), cos, sin)
    wp = gguf_export.permute_rope_rows(w, heads)
    cpp = _rope_interleaved((x @ wp.T).view(t, heads, d), cos, sin)
    # same vectors, rows reordered within each head as the permutation says
    # [T, H, D] -> [H * D, T]: permute_rope_rows permutes rows
    expected = gguf_export.permute_rope_rows(hf.reshape(t, -1).T, heads).T.reshape(t, heads, d)
    torch.testing.assert_close(cpp, expected)
    scores = torch.einsum("shd,thd->hst", hf, hf)
    torch.testing.assert_close(torch.einsum("shd,thd->hst", cpp, cpp), scores)
    # without the permutation the interleaved rope computes other scores
    wrong = _rope_interleaved((x @ w.T).view(t, heads, d), cos, sin)
    assert not torch.allclose(torch.einsum("shd,thd->hst", wrong, wrong), scores)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_metadata_and_tensors_round_trip(donor, tmp_path, tied, dtype):
    model = make_tiny_llama(tie_word_embeddings=tied)
    c = model.config
    path = gguf_export.write_llama_gguf(model, tmp_path / "m.gguf", donor, name="tiny", dtype=dtype)
    reader = GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    expected = {
        "general.architecture": "llama",
        "general.name": "tiny",
        "general.file_type": {"f32": 0, "f16": 1}[dtype],
        "llama.context_length": c.max_position_embeddings,
        "llama.embedding_length": c.hidden_size,
        "llama.block_count": c.num_hidden_layers,
        "llama.feed_forward_length": c.intermediate_size,
        "llama.attention.head_count": c.num_attention_heads,
        "llama.attention.head_count_kv": c.num_key_value_heads,
        "llama.rope.dimension_count": c.head_dim,
        "llama.vocab_size": c.vocab_size,
    }
    assert {k: fields[k] for k in expected} == expected
    assert fields["llama.rope.freq_base"] == pytest.approx(c.rope_parameters["rope_theta"])
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(c.rms_norm_eps)
    source = GGUFReader(donor).fields
    copied = {k: (f.contents(), f.types) for k, f in source.items() if k.startswith("tokenizer.")}
    assert {k: (reader.fields[k].contents(), reader.fields[k].types) for k in copied} == copied
    assert "general.note" not in fields

    tensors = {t.name: t for t in reader.tensors}
    assert ("output.weight" in tensors) == (not tied)
    assert len(tensors) == 2 + 9 * c.num_hidden_layers + (not tied)
    layer = decoder_layers(model)[1]
    q = gguf_export.permute_rope_rows(layer.get_submodule(LLAMA.q).weight, c.num_attention_heads)
    checks = {
        "token_embd.weight": model.get_submodule(LLAMA.embed).weight,
        "blk.1.attn_q.weight": q,
        "blk.1.ffn_down.weight": layer.get_submodule(LLAMA.down).weight,
        "blk.1.ffn_norm.weight": layer.get_submodule(LLAMA.mlp_norm).weight,
    }
    for name, want in checks.items():
        got = torch.from_numpy(np.array(tensors[name].data)).float()
        want = want.detach().half().float() if dtype == "f16" and want.dim() == 2 else want
        assert torch.equal(got, want.detach()), name
    assert tensors["blk.1.ffn_norm.weight"].tensor_type.name == "F32"  # norms stay F32
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == dtype.upper()


def test_tensor_bytes_counts_what_a_decode_step_reads(donor, tmp_path):
    model = make_tiny_llama(tie_word_embeddings=False)
    path = gguf_export.write_llama_gguf(model, tmp_path / "m.gguf", donor, name="tiny")
    every = sum(p.numel() * 4 for p in model.parameters())
    embedding = model.get_submodule(LLAMA.embed).weight.numel() * 4
    assert gguf_export.tensor_bytes(path) == every
    assert gguf_export.tensor_bytes(path, decode=True) == every - embedding
    assert (
        gguf_export.tensor_types(path) == "F32 x21"
    )  # 9 per layer, embedding, output norm, output


def test_a_failed_write_leaves_no_file(donor, tmp_path, monkeypatch):
    calls = []

    def fail_third(self, tensor, *args):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return write(self, tensor, *args)

    write = GGUFWriter.write_tensor_data
    monkeypatch.setattr(GGUFWriter, "write_tensor_data", fail_third)
    path = tmp_path / "m.gguf"
    with pytest.raises(OSError, match="disk full"):
        gguf_export.write_llama_gguf(make_tiny_llama(), path, donor, name="tiny")
    assert list(tmp_path.iterdir()) == [donor]  # neither m.gguf nor m.gguf.part


def test_a_failed_quantize_leaves_no_file(donor, tmp_path):
    dst = tmp_path / "q.gguf"
    with pytest.raises(RuntimeError, match="llama_model_quantize .* Q8_0 failed"):
        gguf_export.quantize_gguf(donor, dst, "Q8_0", Path(sys.executable))  # no llama_cpp here
    assert list(tmp_path.iterdir()) == [donor]


def test_a_model_the_donor_tokenizer_does_not_fit_is_refused(donor, tmp_path):
    with pytest.raises(ValueError, match="vocab_size=320"):
        gguf_export.write_llama_gguf(
            make_tiny_llama(vocab_size=400), tmp_path / "m.gguf", donor, name="tiny"
        )
    scaled = make_tiny_llama(rope_parameters={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        gguf_export.write_llama_gguf(scaled, tmp_path / "m.gguf", donor, name="tiny")
    assert list(tmp_path.iterdir()) == [donor]


# ---- llama.cpp itself --------------------------------------------------------------------------

LLAMA_PY = cache_dir() / "venvs" / "llamacpp" / "bin" / "python"
# F32 KV cache (type 0): the default F16 cache alone moves the logits by ~2e-4 relative
LOGITS = r"""
import json, sys, numpy as np
import llama_cpp
from llama_cpp import Llama
defaults = llama_cpp.llama_cpp.llama_model_default_params
def without_extra_buffers():  # AMX buffers crash some VMs (bench_e2e.llama_extra_buffers_work)
    params = defaults()
    params.use_extra_bufts = False
    return params
llama_cpp.llama_cpp.llama_model_default_params = without_extra_buffers
llm = Llama(sys.argv[1], logits_all=True, n_ctx=64, n_threads=1, verbose=False, type_k=0, type_v=0)
ids = json.loads(sys.argv[2])
llm.eval(ids)
np.save(sys.argv[3], np.asarray(llm.scores[: len(ids)], dtype=np.float32))
"""
IDS = [1, 530, 3012, 77, 9000, 12, 49151, 4]


@functools.cache
def _llama_cpp_missing() -> str | None:
    if not LLAMA_PY.exists():
        return f"{LLAMA_PY} not built (scripts/bench_e2e.py builds it, ~25 min)"
    if subprocess.run([LLAMA_PY, "-c", "import llama_cpp"], capture_output=True).returncode:
        return f"{LLAMA_PY} cannot import llama_cpp (a build cut short?)"
    if importlib.util.find_spec(EMBEDDED["smollm2-135m"].package) is None:
        return "the donor tokenizer (SmolLM2's GGUF) needs " + EMBEDDED["smollm2-135m"].install
    return None


needs_llama_cpp = pytest.mark.skipif(
    _llama_cpp_missing() is not None, reason=str(_llama_cpp_missing())
)


@pytest.fixture(scope="module")
def smollm2_vocab_llama(tmp_path_factory):
    """(model, F32 GGUF): tiny random Llama with SmolLM2's vocab, untied head, SmolLM2's rope
    base and eps (so a metadata key llama.cpp ignored would show)."""
    rope = {"rope_theta": 100000.0, "rope_type": "default"}
    model = make_tiny_llama(
        vocab_size=49152, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_parameters=rope
    )
    path = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    donor = _gguf_location(EMBEDDED["smollm2-135m"])
    return model, gguf_export.write_llama_gguf(model, path, donor, name="tiny")


def _llama_cpp_logits(path: Path, out: Path) -> torch.Tensor:
    done = subprocess.run(
        [LLAMA_PY, "-c", LOGITS, str(path), json.dumps(IDS), str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.from_numpy(np.load(out)).double()  # [T, V]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@needs_llama_cpp
def test_llama_cpp_computes_our_logits_from_the_f32_gguf(smollm2_vocab_llama, tmp_path):
    model, path = smollm2_vocab_llama
    with torch.no_grad():
        want = model.double()(torch.tensor([IDS])).logits[0]
    got = _llama_cpp_logits(path, tmp_path / "logits.npy")
    assert _relative(got, want) < 1e-5  # measured 1.3e-7; 7e-3 without the q/k permutation


@needs_llama_cpp
def test_llama_cpp_quantizes_our_gguf(smollm2_vocab_llama, tmp_path):
    model, path = smollm2_vocab_llama
    q8 = gguf_export.quantize_gguf(path, tmp_path / "q8.gguf", "Q8_0", LLAMA_PY, threads=1)
    assert gguf_export.tensor_types(q8).startswith("Q8_0 x")
    assert not (tmp_path / "q8.gguf.part").exists()
    with torch.no_grad():
        want = model.double()(torch.tensor([IDS])).logits[0]
    got = _llama_cpp_logits(q8, tmp_path / "logits.npy")
    assert 1e-4 < _relative(got, want) < 5e-2  # measured 1.3e-2 (weights and activations Q8_0)


@needs_llama_cpp
def test_the_q8_0_file_holds_our_weights_to_q8_0_precision(smollm2_vocab_llama, tmp_path):
    from gguf.quants import dequantize

    _, path = smollm2_vocab_llama
    q8 = gguf_export.quantize_gguf(path, tmp_path / "q8.gguf", "Q8_0", LLAMA_PY, threads=1)
    source = {t.name: np.array(t.data) for t in GGUFReader(path).tensors}
    for t in GGUFReader(q8).tensors:
        if t.tensor_type.name != "Q8_0":
            continue
        w = torch.from_numpy(source[t.name]).double().reshape(-1, 32)  # Q8_0 blocks of 32
        got = torch.from_numpy(dequantize(t.data, t.tensor_type)).double().reshape(-1, 32)
        # scale = block absmax / 127, stored as fp16: rounding error <= scale * (1/2 + 127/2048)
        bound = w.abs().amax(1, keepdim=True) / 127 * 0.57 + 1e-12
        assert ((got - w).abs() <= bound).all(), t.name


@needs_llama_cpp
def test_the_bench_worker_generates_transformers_greedy_tokens(smollm2_vocab_llama):
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "scripts" / "bench_e2e.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model, path = smollm2_vocab_llama
    with torch.no_grad():
        want = (
            model.float()
            .generate(torch.tensor([IDS]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[
                0, len(IDS) :
            ]
            .tolist()
        )
    # path, threads, context tokens, then flags: the worker's arguments as the bench passes them
    command = [LLAMA_PY, "-c", bench.LLAMA_WORKER, str(path), "1", "256", "--no-extra-buffers"]
    stream = bench.worker_stream(command)
    try:
        assert list(stream(IDS, 6)) == want
    finally:
        stream.worker.stdin.close()
        stream.worker.wait(timeout=30)


@needs_llama_cpp
def test_cached_ggufs_are_made_once_from_an_f16_source(smollm2_vocab_llama, tmp_path, monkeypatch):
    model, _ = smollm2_vocab_llama
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path))
    donor = _gguf_location(EMBEDDED["smollm2-135m"])
    kw = dict(donor=donor, python=LLAMA_PY, threads=1, dtype="f16")
    paths = gguf_export.cached_llama_ggufs(model, "tiny", ("Q4_1", "Q8_0"), **kw)
    assert paths == {f: tmp_path / "gguf" / f"tiny-{f.lower()}.gguf" for f in ("Q4_1", "Q8_0")}
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == [
        "tiny-q4_1.gguf",
        "tiny-q8_0.gguf",
    ]  # the f16 source is gone, no .part left
    assert gguf_export.tensor_types(paths["Q4_1"]).startswith("Q4_1 x")

    def must_not_write(*args, **kwargs):
        raise AssertionError("cached files were written again")

    monkeypatch.setattr(gguf_export, "write_llama_gguf", must_not_write)
    assert gguf_export.cached_llama_ggufs(model, "tiny", ("Q4_1", "Q8_0"), **kw) == paths
