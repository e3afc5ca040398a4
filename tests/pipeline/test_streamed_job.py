"""Streamed jobs (``compress.io.stream`` + ``run_job(stream=...)``): the layer-wise passes give
the same checkpoint, tensor for tensor and bit for bit, as the in-memory run; the export is
sharded in the Hugging Face layout and plain transformers reads it; a killed run leaves
nothing at ``--out``; the memory preflight refuses a job that cannot fit, writing nothing; and
a streamed run's peak resident memory follows one layer, not the model."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from compress.core.errors import RecipeError
from compress.io.stream import CheckpointReader, meta_skeleton
from compress.pipeline.job import run_job
from compress.recipe import parse_recipe
from compress.testing import make_char_tokenizer, make_tiny_llama, make_tiny_model

TEXT = "".join(f"Line {i}: the quick brown fox number {i * 7 % 13} jumps over {i % 5} dogs.\n"
               for i in range(80))


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    """A tiny Llama stored in bf16, untied head (the case 7B checkpoints are), with 3 layers."""
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny_llama(num_hidden_layers=3, tie_word_embeddings=False).to(torch.bfloat16)
    folder = tmp_path / "tiny-bf16"
    model.save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    (tmp_path / "text.txt").write_text(TEXT)
    return folder


def _recipe(tmp_path, passes: str, evaluate: dict | None = None, **export) -> object:
    """A recipe whose ``passes`` is the YAML list ``passes``, calibrated on the test text
    (evaluation off unless ``evaluate`` gives the eval section)."""
    return parse_recipe({
        "name": "tiny-stream",
        "calibration": {"source": str(tmp_path / "text.txt"), "num_samples": 3, "seq_len": 24,
                        "seed": 0},
        "passes": yaml.safe_load(textwrap.dedent(passes)),
        "export": {"dtype": "auto", **export},
        "eval": evaluate or {"baseline": False, "perplexity": None},
    })


def _tensors(folder) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(folder)
    return {name: reader.read(name) for name in reader.names()}


PASSES = {
    "int4_rtn": "- {pass: quantize.int4_rtn, group_size: 32}",
    "int8_rtn": "- {pass: quantize.int8_rtn}",
    "gptq": "- {pass: quantize.gptq, group_size: 32, act_order: true}",
    "awq": "- {pass: quantize.awq, group_size: 32, n_grid: 4, clip_grid: 4}",
    "smoothquant": "- {pass: quantize.smoothquant}",
    "autoround": "- {pass: quantize.autoround, group_size: 32, iters: 3, batch_size: 2}",
    "rtn_then_head": """
        - {pass: quantize.int4_rtn, group_size: 32}
        - {pass: quantize.int8_rtn, targets: [lm_head], ignore: []}
    """,
    "rtn_then_fp8_kv": """
        - {pass: quantize.int4_rtn, group_size: 32}
        - {pass: quantize.kv_cache_fp8}
    """,
    "smoothquant_then_gptq": """
        - {pass: quantize.smoothquant, targets: ["re:.*mlp.*"]}
        - {pass: quantize.gptq, group_size: 32, targets: ["re:.*self_attn.*"]}
    """,
}


@pytest.mark.parametrize("name", list(PASSES))
def test_streamed_equals_in_memory_bit_for_bit(name, checkpoint, tmp_path, one_thread):
    recipe = _recipe(tmp_path, PASSES[name])
    memory = run_job(recipe, model=str(checkpoint), out_dir=tmp_path / "mem", stream=False,
                     progress=False)
    streamed = run_job(recipe, model=str(checkpoint), out_dir=tmp_path / "stream", stream=True,
                       progress=False)
    assert streamed.payload["memory"]["streamed"] and not memory.payload["memory"]["streamed"]
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "stream")
    assert sorted(a) == sorted(b)
    if "fp8_kv" in name:  # one scale pair per layer, written by the layer that holds it
        assert sum(key.endswith(("self_attn.k_scale", "self_attn.v_scale")) for key in a) == 6
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    config_a = json.loads((tmp_path / "mem" / "config.json").read_text())
    config_b = json.loads((tmp_path / "stream" / "config.json").read_text())
    assert config_a == config_b
    reports = [p["changed"] for p in streamed.payload["passes"]]
    assert reports == [p["changed"] for p in memory.payload["passes"]] and all(reports)


# One family per layout the Llama checkpoint above lacks: parallel blocks on one LayerNorm with a
# non-gated MLP and a differently named final norm (Phi), (1 + w) LayerNorms with biases
# (Nemotron), post-norms (Gemma 2), a head its checkpoints name otherwise than its module
# (GPT-NeoX: embed_out, lm_head in transformers 5's tree).
@pytest.mark.parametrize("family", ["phi", "nemotron", "gemma2", "gpt_neox"])
def test_streamed_equals_in_memory_for_other_layouts(family, tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    model = make_tiny_model(family, num_hidden_layers=3, tie_word_embeddings=False)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "ck")
    make_char_tokenizer().save_pretrained(tmp_path / "ck")
    (tmp_path / "text.txt").write_text(TEXT)
    recipe = _recipe(tmp_path, PASSES["awq"])
    runs = {mode: run_job(recipe, model=str(tmp_path / "ck"), out_dir=tmp_path / mode,
                          stream=mode == "stream", progress=False)
            for mode in ("mem", "stream")}  # fmt: skip
    assert runs["stream"].payload["memory"]["streamed"]
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "stream")
    assert sorted(a) == sorted(b) and any(k.endswith("weight_packed") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # every tensor not quantized keeps the name save_pretrained gave it (GPT-NeoX: embed_out,
    # which transformers 4 and vLLM read)
    quantized = {k.rpartition(".")[0] for k in a if k.endswith("weight_packed")}
    stored = set(CheckpointReader(tmp_path / "ck").names())
    assert {k for k in stored if k.rpartition(".")[0] not in quantized} <= set(a)


@pytest.mark.parametrize(("passes", "reads_source"), [
    (PASSES["gptq"], True),
    (PASSES["smoothquant_then_gptq"], False),  # GPTQ reads smoothquant's float32 scratch
    ("""
        - {pass: quantize.gptq, group_size: 32, targets: ["re:.*self_attn.*"]}
        - {pass: quantize.smoothquant, targets: ["re:.*mlp.*"]}
    """, True),
])
def test_streamed_gptq_on_narrow_bf16_layers_equals_in_memory(passes, reads_source, checkpoint,
                                                              tmp_path, monkeypatch, one_thread):
    """GPTQ reads a streamed layer's weights as they are stored (bf16, widened per call: the
    7B/13B memory path; the tiny layers take it once the size rule is lowered): the checkpoint
    is the in-memory run's, bit for bit, also when a pass after it changes float weights in
    place (the scratch file holds them as stored, and the next pass reads them widened)."""
    from compress.core import device as core_device
    from compress.io import stream as stream_module

    monkeypatch.setattr(stream_module, "KEEP_STORED_BYTES", 0)
    widened = []
    real = core_device.compute_in
    monkeypatch.setattr(stream_module, "compute_in",
                        lambda m, d: (widened.append(type(m).__name__), real(m, d)))
    recipe = _recipe(tmp_path, passes)
    run_job(recipe, model=str(checkpoint), out_dir=tmp_path / "mem", stream=False,
            progress=False)
    assert not widened  # the in-memory run is plain float32
    run_job(recipe, model=str(checkpoint), out_dir=tmp_path / "stream", stream=True,
            progress=False)
    assert ("Linear" in widened) == reads_source
    assert "Embedding" in widened  # the capture looks rows up in the stored bf16 table
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "stream")
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


PASSES["gptq_attention_then_rtn"] = """
    - {pass: quantize.gptq, group_size: 32, targets: ["re:.*self_attn.*"]}
    - {pass: quantize.int4_rtn, group_size: 32}
"""


# the last: a first pass that leaves the experts float hands them on in a scratch file as
# stored, and RTN reads them back narrow (they were widened whole for the file: 12.7 GB for a
# GPT-OSS-120B layer)
@pytest.mark.parametrize("kind", ["gptq", "int4_rtn", "int8_rtn", "awq", "autoround",
                                  "gptq_attention_then_rtn"])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])  # experts held [E, 2I, H]; transposed
def test_streamed_moe_keeps_bf16_experts_and_works_one_expert_at_a_time(family, kind, tmp_path,
                                                                        monkeypatch, one_thread):
    """A streamed pass keeps a layer's bf16 experts bf16: the calibrated passes run them one
    expert's projection at a time (``viewed_experts``), never widening the fused tensors whole
    (a GPT-OSS-120B layer's were 12.7 GB), and every pass rounds them (GPTQ's experts with too
    few tokens, AWQ's and AutoRound's all, RTN's) one projection at a time; the checkpoint is
    the in-memory run's, bit for bit."""
    from compress.core import device as core_device
    from compress.io import stream as stream_module
    from compress.quant.linear import QuantExperts
    from compress.testing import make_tiny_moe

    monkeypatch.setattr(stream_module, "KEEP_STORED_BYTES", 0)
    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    widened = []  # modules whose stored tensors were widened for a call, whole
    real = core_device._widen_tensors

    def widen(module, args) -> None:  # a pre-hook: returns None, the arguments unchanged
        widened.append(type(module).__name__)
        real(module, args)

    monkeypatch.setattr(core_device, "_widen_tensors", widen)
    rounded = []  # the stored dtype of the fused experts RTN rounds
    like = QuantExperts.like.__func__

    def record(cls, experts, moe, *args, **kwargs):
        rounded.append(getattr(experts, moe.down).dtype)
        return like(cls, experts, moe, *args, **kwargs)

    monkeypatch.setattr(QuantExperts, "like", classmethod(record))
    make_tiny_moe(family, tie_word_embeddings=False).to(torch.bfloat16).save_pretrained(
        tmp_path / "ck")
    make_char_tokenizer().save_pretrained(tmp_path / "ck")
    (tmp_path / "text.txt").write_text(TEXT)
    recipe = _recipe(tmp_path, PASSES[kind])
    # enough tokens that some experts get GPTQ (>= 64 routed), others RTN
    recipe = dataclasses.replace(recipe, calibration=recipe.calibration.model_copy(
        update={"num_samples": 8, "seq_len": 32}))
    runs = {}
    for mode in ("mem", "stream"):
        rounded.clear()
        runs[mode] = run_job(recipe, model=str(tmp_path / "ck"), out_dir=tmp_path / mode,
                             stream=mode == "stream", progress=False)
    assert set(rounded) == {torch.bfloat16}  # streamed: the experts as stored
    assert not [t for t in widened if t.endswith("Experts")], sorted(set(widened))
    if kind == "gptq":
        assert "Linear" in widened  # the narrow path was taken (attention, router)
        per_expert = runs["stream"].payload["passes"][0]["metrics"]["per_expert"]
        assert {v["method"] for v in per_expert.values()} == {"gptq", "rtn"}  # both taken
    if kind == "int8_rtn":  # the streamed export packs int8 as the in-memory one does
        from compress.io.checkpoint import read_header

        stored = {e["dtype"] for f in (tmp_path / "stream").glob("*.safetensors")
                  for e in read_header(f)[1].values()}
        assert "I32" in stored and "I8" not in stored, stored
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "stream")
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("kind", ["gptq", "int4_rtn", "awq", "autoround"])
def test_a_streamed_moe_pass_frees_each_layers_float_experts(kind, tmp_path, monkeypatch,
                                                             one_thread):
    """Once a layer's experts are quantized, their float tensors are freed before the next
    layer is read: the pass's plan held them to its end (each layer of a deep MoE added its
    own: two GPT-OSS-120B layers' bf16 experts measured 15.9 GB, one layer's 9.0)."""
    import gc
    import weakref

    from compress.arch import ARCHS
    from compress.io import stream as stream_module
    from compress.testing import make_tiny_moe

    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    make_tiny_moe("mixtral", num_hidden_layers=3, tie_word_embeddings=False).to(
        torch.bfloat16).save_pretrained(tmp_path / "ck")
    make_char_tokenizer().save_pretrained(tmp_path / "ck")
    (tmp_path / "text.txt").write_text(TEXT)
    moe = ARCHS["mixtral"].moe
    read, alive_at_load = [], []  # a weakref to each layer's experts as read
    real = stream_module.StreamedModel.load_layer

    def note(parameter) -> None:  # once per tensor (a freed one's id may be reused: no ids)
        if not parameter.is_meta and not any(ref() is parameter for ref in read):
            read.append(weakref.ref(parameter))

    def load_layer(self, index, *args, **kwargs):
        gc.collect()
        alive_at_load.append(sum(ref() is not None for ref in read))
        layer = real(self, index, *args, **kwargs)
        note(getattr(layer.get_submodule(moe.fused), moe.down))  # RTN reads it later
        return layer

    def load_part(self, index, module, *args, **kwargs):
        real_part(self, index, module, *args, **kwargs)
        if hasattr(module, moe.down):
            note(getattr(module, moe.down))

    real_part = stream_module.StreamedModel.load_part
    monkeypatch.setattr(stream_module.StreamedModel, "load_layer", load_layer)
    monkeypatch.setattr(stream_module.StreamedModel, "load_part", load_part)
    run_job(_recipe(tmp_path, PASSES[kind]), model=str(tmp_path / "ck"),
            out_dir=tmp_path / "out", stream=True, progress=False)
    assert len(read) == 3, len(read)
    assert not any(alive_at_load), alive_at_load


def test_stream_reads_the_checkpoint_dtype_and_layers_one_at_a_time(checkpoint, tmp_path,
                                                                   monkeypatch, one_thread):
    """Every decoder layer is read once per pass, in bf16 from the file and float32 only while
    the pass works on it; at most one layer is resident at any time."""
    from compress.io import stream as stream_module

    resident_max = []
    original = stream_module.StreamedModel.load_layer

    def load_layer(self, index, device="cpu", **kwargs):
        layer = original(self, index, device, **kwargs)
        resident = [i for i, other in enumerate(self.layers) if stream_module.is_resident(other)]
        resident_max.append(len(resident))
        assert all(p.dtype == torch.float32 for p in layer.parameters())
        return layer

    monkeypatch.setattr(stream_module.StreamedModel, "load_layer", load_layer)
    recipe = _recipe(tmp_path, PASSES["gptq"])
    run_job(recipe, model=str(checkpoint), out_dir=tmp_path / "out", stream=True, progress=False)
    assert resident_max == [1, 1, 1]
    reader = CheckpointReader(checkpoint)
    assert reader.dtype("model.layers.0.mlp.up_proj.weight") == torch.bfloat16


def test_streamed_rtn_holds_one_float_linear_at_a_time(checkpoint, tmp_path, monkeypatch,
                                                     one_thread):
    """RTN reads a layer's targets one at a time: when a linear is quantized, it is the only
    float nn.Linear of the decoder stack in memory (the peak follows the largest linear, not
    the layer); the checkpoint is still the in-memory run's (test above)."""
    from compress.quant import rtn

    seen = []
    original = rtn._squared_error

    def squared_error(quant, weight):
        layers = run_model["model"].model.layers
        seen.append(sum(1 for m in layers.modules() if isinstance(m, torch.nn.Linear)
                        and m.weight.device.type != "meta"))
        return original(quant, weight)

    run_model = {}
    from compress.io import stream as stream_module

    skeleton = stream_module.meta_skeleton

    def keep_skeleton(path):
        run_model["model"] = skeleton(path)
        return run_model["model"]

    monkeypatch.setattr(stream_module, "meta_skeleton", keep_skeleton)
    monkeypatch.setattr(rtn, "_squared_error", squared_error)
    recipe = _recipe(tmp_path, PASSES["int4_rtn"])
    run_job(recipe, model=str(checkpoint), out_dir=tmp_path / "out", stream=True, progress=False)
    assert len(seen) >= 3 * 7 and max(seen[: 3 * 7]) == 1, seen


def test_sharded_export_reloads_in_transformers_with_the_same_logits(checkpoint, tmp_path,
                                                                    one_thread):
    pytest.importorskip("compressed_tensors")
    from compress.io.load import load_model
    from compress.testing import plain_transformers_logits

    recipe = _recipe(tmp_path, PASSES["int4_rtn"], max_shard_size="20KB")
    run_job(recipe, model=str(checkpoint), out_dir=tmp_path / "out", stream=True, progress=False)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not list(out.glob("*.part")) and not (out / "model.safetensors").exists()
    ids = [[5, 17, 33, 2, 60, 61, 7]]
    with torch.no_grad():
        ours = load_model(str(out)).model(torch.tensor(ids)).logits
    (plain,) = plain_transformers_logits([out], ids, tmp_path)  # a child without compress
    # transformers decompresses into the export's bf16: the tolerance the export tests use
    assert float((plain - ours).norm() / ours.norm()) < 1e-2


def test_preflight_refuses_a_job_that_cannot_fit_and_writes_nothing(checkpoint, tmp_path,
                                                                    monkeypatch):
    import compress.pipeline.preflight as preflight

    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: 10 * 2**20)
    recipe = _recipe(tmp_path, PASSES["int4_rtn"])
    out = tmp_path / "out"
    with pytest.raises(RecipeError, match=r"needs about .* GiB .* is available; nothing was "
                                          r"written\. Way out"):
        run_job(recipe, model=str(checkpoint), out_dir=out, progress=False)
    assert not out.exists()
    assert {p.name for p in tmp_path.iterdir()} <= {"cache", "text.txt", "tiny-bf16"}


def test_whole_model_pass_is_not_streamed_and_says_why(checkpoint, tmp_path, one_thread):
    recipe = _recipe(tmp_path, "- {pass: prune.mlp_channels, intermediate_size: 64}\n"
                               "- {pass: quantize.int4_rtn, group_size: 32}")
    with pytest.raises(RecipeError, match="cannot stream: prune.mlp_channels work on the whole"):
        run_job(recipe, model=str(checkpoint), out_dir=tmp_path / "x", stream=True,
                progress=False)
    result = run_job(recipe, model=str(checkpoint), out_dir=tmp_path / "y", progress=False)
    assert result.payload["memory"]["not_streamed_because"].startswith("prune.mlp_channels")


_KILLED_RUN = """
import sys, time
import compress.io.stream as s
from compress.pipeline.job import run_job
from compress.recipe import parse_recipe
original = s.StreamedModel.finish_layer
def slow_finish(self, index):
    original(self, index)
    print("layer", index, "done", flush=True)
    time.sleep(60)  # killed here, mid-run, with shards half-written
s.StreamedModel.finish_layer = slow_finish
run_job(parse_recipe(sys.argv[1]), model=sys.argv[2], out_dir=sys.argv[3], progress=False)
"""


def test_killed_streamed_run_leaves_nothing_at_out(checkpoint, tmp_path):
    recipe = ("name: k\npasses: [{pass: quantize.int4_rtn, group_size: 32}]\n"
              "eval: {baseline: false, perplexity: null}")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, recipe, str(checkpoint), str(out)],
                            stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert proc.stdout.readline().startswith("layer 0 done")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not out.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(leftovers) == 1 and list(leftovers[0].glob("*.part"))  # named as unfinished


_PEAK = """
import sys
kind = sys.argv[1]
import torch, transformers  # the same imports in both children
from compress.pipeline.job import run_job
from compress.recipe import parse_recipe
from compress.io.stream import meta_skeleton
if kind == "base":
    meta_skeleton(sys.argv[3])  # everything but the layers' tensors
else:
    run_job(parse_recipe(sys.argv[2]), model=sys.argv[3], out_dir=sys.argv[4], progress=False)
# VmHWM: the peak of this process's own memory map. ru_maxrss would not do: Linux carries it
# over fork and exec, so a child of a large pytest process reports pytest's size.
print(next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
           if line.startswith("VmHWM:")))
"""


def test_streamed_peak_memory_follows_one_layer_not_the_model(tmp_path, monkeypatch):
    """16 layers at hidden 512 (17 MB per layer in float32, 270 MB in all): the streamed RTN
    run's peak stays within 8 layers of a child that only imports and builds the skeleton.
    Loading the model whole (the in-memory path, today's before streaming) fails that bound."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    config = LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=16,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=512,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    folder = tmp_path / "m16"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    layer_bytes = (4 * 512 * 512 + 3 * 512 * 2048) * 4
    recipe = ("name: m\npasses: [{pass: quantize.int4_rtn, group_size: 128}]\n"
              "eval: {baseline: false, perplexity: null}")

    def peak(kind: str, stream: bool | None = None) -> int:
        code = _PEAK.replace("progress=False)", f"progress=False, stream={stream})")
        out = subprocess.run([sys.executable, "-c", code, kind, recipe, str(folder),
                              str(tmp_path / f"out-{kind}-{stream}")], capture_output=True,
                             text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)
        return int(out.stdout.strip().splitlines()[-1])

    base = peak("base")
    streamed = peak("run")  # stream=None: streams when it can, as the CLI does
    whole = peak("run", stream=False)
    numbers = {"base": base, "streamed": streamed, "whole": whole, "layer": layer_bytes}
    # measured: streamed +5 layers, whole +29 (every float32 linear is alive until RTN ends)
    assert streamed - base < 8 * layer_bytes, numbers
    assert whole - base > 16 * layer_bytes, numbers  # the bound separates the two paths


@pytest.mark.parametrize("passes", [PASSES["int4_rtn"], PASSES["gptq"]])
def test_streamed_job_evaluates_layer_by_layer_with_the_whole_models_numbers(
        passes, checkpoint, tmp_path, one_thread):
    """A streamed job scores the baseline and its export one decoder layer at a time
    (perplexity and KL), never loading either whole, and gets the in-memory job's numbers."""
    recipe = _recipe(tmp_path, passes, {
        "baseline": True,
        "perplexity": {"dataset": str(tmp_path / "text.txt"), "context_length": 32, "limit": 6},
    })
    memory = run_job(recipe, model=str(checkpoint), out_dir=tmp_path / "mem", stream=False,
                     progress=False)
    streamed = run_job(recipe, model=str(checkpoint), out_dir=tmp_path / "stream",
                       stream=True, progress=False)
    a, b = memory.payload, streamed.payload
    assert b["memory"]["streamed"] and "eval (layer by layer)" in b["memory"]["estimate"][
        "phases_bytes"]
    for variant in ("baseline", "compressed"):
        pa, pb = a["eval"][variant], b["eval"][variant]
        assert pb["perplexity"] == pa["perplexity"], variant
        assert pb["protocol"]["scored"] == "layer by layer"
    assert b["eval"]["compressed"]["kl"]["kl_mean"] == a["eval"]["compressed"]["kl"]["kl_mean"]
    assert a["eval"]["compressed"]["perplexity"] != a["eval"]["baseline"]["perplexity"]


# Peak resident bytes that scripts/bench_memory.py measured (docs/results.md section 6): W4 RTN
# g128 streamed whole, and W4 GPTQ g128 (16 x 512 calibration tokens) over its first layers.
# The 70B-wide checkpoint held 4 of the 80 layers (8 gave the same RTN peak).
MEASURED_PEAKS = {
    ("7b", "quantize.int4_rtn"): 1.76e9,
    ("13b", "quantize.int4_rtn"): 2.08e9,
    ("70b", "quantize.int4_rtn"): 4.50e9,
    ("7b", "quantize.gptq"): 2.19e9,
    ("13b", "quantize.gptq"): 3.03e9,
    ("70b", "quantize.gptq"): 8.09e9,
}


def _estimated_peak(name: str, config, samples: int = 16, seq_len: int = 512) -> int:
    """The preflight's streamed peak for one W4 g128 ``name`` pass over a meta skeleton of the
    transformers ``config``."""
    from transformers import AutoModelForCausalLM

    from compress.io.stream import no_weight_init, parameters_on_meta
    from compress.pipeline.preflight import estimate

    recipe = parse_recipe({
        "name": "x", "passes": [{"pass": name, "group_size": 128}],
        "calibration": {"source": "wikitext2-valid", "num_samples": samples,
                        "seq_len": seq_len},
        "eval": {"baseline": False, "perplexity": None},
    })  # fmt: skip
    with no_weight_init(), parameters_on_meta():
        skeleton = AutoModelForCausalLM.from_config(config)
    return estimate(recipe, None, streamed=True, skeleton=skeleton)["peak_bytes"]


@pytest.mark.parametrize("shape, name", sorted(MEASURED_PEAKS))
def test_preflight_estimate_tracks_the_measured_peaks_from_7b_to_70b_widths(shape, name):
    """The memory preflight on skeletons of the benchmarked shapes: within -3% / +25% of the
    peak each streamed run measured (the preflight refuses what would not fit, so it may
    over-estimate more than under), and the same at 4 layers as at the full depth: a
    streamed pass holds one layer at a time."""
    from compress.testing import LLAMA_SHAPES, synthetic_config

    peaks = [_estimated_peak(name, synthetic_config(shape, num_hidden_layers=layers))
             for layers in (LLAMA_SHAPES[shape]["num_hidden_layers"], 4)]
    assert peaks[0] == peaks[1]
    assert 0.97 <= peaks[0] / MEASURED_PEAKS[shape, name] <= 1.25, peaks[0]


# The same for the MoE shapes (compress.testing.MOE_SHAPES; first 2 layers written, 16 x 512
# calibration tokens, docs/results.md section 6), a layer's experts kept as stored (bf16) and
# freed once quantized (2026-12-06). GPTQ's experts were all rounded by RTN at 16 x 512 (too
# few routed tokens per expert).
MOE_MEASURED_PEAKS = {
    ("mixtral-8x7b", "quantize.int4_rtn", 16): 5.15e9,
    ("mixtral-8x7b", "quantize.gptq", 16): 5.26e9,
    ("mixtral-8x7b", "quantize.awq", 16): 5.54e9,  # its first layer
    ("qwen3-30b-a3b", "quantize.int4_rtn", 16): 2.12e9,
    ("qwen3-30b-a3b", "quantize.gptq", 16): 2.42e9,
    # 128 x 512 tokens: 4096 routed to an expert on average, so most get GPTQ, not RTN
    ("qwen3-30b-a3b", "quantize.gptq", 128): 3.82e9,
    ("gpt-oss-120b", "quantize.int4_rtn", 16): 8.95e9,  # g64 (2880 takes no g128)
    ("gpt-oss-120b", "quantize.gptq", 16): 9.51e9,
    ("gpt-oss-120b", "quantize.awq", 16): 10.35e9,
    ("gpt-oss-20b", "quantize.gptq", 16): 3.14e9,
}


def test_preflight_estimate_tracks_long_calibration_samples():
    """GPTQ of the 1.1B shape's first 2 layers at 64 x 2048 calibration tokens measured 4.13 GB
    with the hidden states in memory (docs/results.md section 6): one 2048-token sample's
    attention scores and MLP activations are 0.82 GB of it, which the estimate missed (3.42)."""
    from compress.testing import synthetic_config

    peak = _estimated_peak("quantize.gptq", synthetic_config("1.1b", num_hidden_layers=2),
                           samples=64, seq_len=2048)
    assert 0.97 <= peak / 4.13e9 <= 1.25, peak


@pytest.mark.parametrize("shape, name, samples", sorted(MOE_MEASURED_PEAKS))
def test_preflight_estimate_tracks_the_measured_moe_peaks(shape, name, samples):
    """Within -3% / +30% of what the streamed runs measured, at 2 layers as at the full depth.
    Before, the fused experts counted as one matrix for every quantizer's temporaries: 29.4 GB
    for Mixtral-8x7B's AWQ, refused on a 24 GB machine; RTN 20.6 GB for 8.42 measured."""
    from compress.testing import MOE_SHAPES, synthetic_config

    peaks = [_estimated_peak(name, synthetic_config(shape, num_hidden_layers=layers), samples)
             for layers in (MOE_SHAPES[shape]["num_hidden_layers"], 2)]
    assert peaks[0] == peaks[1]
    assert 0.97 <= peaks[0] / MOE_MEASURED_PEAKS[shape, name, samples] <= 1.3, peaks[0]


def test_a_tied_config_over_a_head_of_its_own_reads_that_head_everywhere(tmp_path, monkeypatch,
                                                                         one_thread):
    """config.json ties the head to the embedding but the checkpoint stores a head with other
    values: transformers 5's from_pretrained keeps the stored head (4 ties it). The in-memory
    job, the streamed job and layer-by-layer reading all take the head a whole load takes, and
    an untied head is exported with ``tie_word_embeddings: false`` (every loader reads it)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from compress.eval.quality import perplexity
    from compress.io.export import layerwise_model
    from compress.io.load import load_model

    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "ck"
    make_tiny_llama(num_hidden_layers=3).to(torch.bfloat16).save_pretrained(folder)
    make_char_tokenizer().save_pretrained(folder)
    (tmp_path / "text.txt").write_text(TEXT)
    stored = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in stored and json.loads(
        (folder / "config.json").read_text())["tie_word_embeddings"]
    head = torch.randn_like(stored["model.embed_tokens.weight"])
    save_file({**stored, "lm_head.weight": head}, folder / "model.safetensors",
              metadata={"format": "pt"})
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    untied = whole.lm_head.weight is not whole.model.embed_tokens.weight
    expected = head if untied else stored["model.embed_tokens.weight"]
    assert torch.equal(whole.lm_head.weight, expected)

    stream = layerwise_model(folder)
    assert stream.model.config.tie_word_embeddings == (not untied)
    scores = [perplexity(model, make_char_tokenizer(), TEXT, context_length=32, limit=3,
                         progress=False, state_dir=tmp_path / name, stream=stream)
              for name, model, stream in (("whole", load_model(str(folder)).model, None),
                                          ("layers", stream.model, stream))]
    assert scores[0].nll_mean == scores[1].nll_mean
    recipe = _recipe(tmp_path, PASSES["int4_rtn"])
    for mode in ("mem", "stream"):
        run_job(recipe, model=str(folder), out_dir=tmp_path / mode, stream=mode == "stream",
                progress=False)
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "stream")
    assert sorted(a) == sorted(b) and ("lm_head.weight" in a) == untied
    for key in a:
        assert torch.equal(a[key], b[key]), key
    for mode in ("mem", "stream"):
        config = json.loads((tmp_path / mode / "config.json").read_text())
        assert config["tie_word_embeddings"] == (not untied), mode
    if untied:
        assert torch.equal(a["lm_head.weight"], head)


MOE_CASES = [(family, "int4_rtn") for family in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe",
                                                  "hunyuan_v1_moe", "granitemoe", "solar_open",
                                                  "gpt_oss")]
MOE_CASES += [(family, kind) for family in ("mixtral", "qwen2_moe")
              for kind in ("gptq", "awq", "autoround")]  # fmt: skip
MOE_CASES += [("gpt_oss", "gptq")]  # experts with biases, held transposed


@pytest.mark.parametrize(("family", "kind"), MOE_CASES)
def test_streamed_moe_equals_in_memory(family, kind, tmp_path, monkeypatch, one_thread):
    """An MoE checkpoint stores one weight per expert and projection (Mixtral's block under
    another name); a streamed job reads each layer's experts fused, as transformers does on
    load (``MoeTreeReader``), and writes them back per expert: the checkpoint is the in-memory
    run's, tensor for tensor and bit for bit. AWQ and AutoRound round the experts by RTN in
    their per-layer step (streamed, the layer is resident only there)."""
    from compress.testing import make_tiny_moe

    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    make_tiny_moe(family, tie_word_embeddings=False).to(torch.bfloat16).save_pretrained(
        tmp_path / "ck")
    make_char_tokenizer().save_pretrained(tmp_path / "ck")
    (tmp_path / "text.txt").write_text(TEXT)
    stored = set(CheckpointReader(tmp_path / "ck").names())
    # per expert, as on the hub (GPT-OSS's hub checkpoints store them fused, as transformers
    # holds them)
    assert any(k.endswith("gate_up_proj") for k in stored) == (family == "gpt_oss")
    recipe = _recipe(tmp_path, PASSES[kind])
    runs = {mode: run_job(recipe, model=str(tmp_path / "ck"), out_dir=tmp_path / mode,
                          stream=mode == "stream", progress=False)
            for mode in ("mem", "stream")}  # fmt: skip
    assert runs["stream"].payload["memory"]["streamed"]
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "stream")
    assert sorted(a) == sorted(b) and any(".experts.0." in k and "weight_packed" in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    configs = [json.loads((tmp_path / m / "config.json").read_text()) for m in ("mem", "stream")]
    assert configs[0] == configs[1]
    # the same modules changed (a streamed RTN takes each layer's linears and experts together)
    reports = [[sorted(p["changed"]) for p in runs[m].payload["passes"]] for m in ("mem", "stream")]
    assert reports[0] == reports[1]


def test_a_streamed_moe_job_scores_layer_by_layer_as_the_whole_model(tmp_path, monkeypatch,
                                                                       one_thread):
    """A streamed MoE job that evaluates scores the source and its export layer by layer (the
    experts fused as each layer is read, quantized ones as ``QuantExperts``): the in-memory
    job's perplexity and KL, bit for bit, and the same checkpoint."""
    from compress.testing import make_tiny_moe

    monkeypatch.setenv("COMPRESS_CACHE_DIR", str(tmp_path / "cache"))
    make_tiny_moe("mixtral", tie_word_embeddings=False).to(torch.bfloat16).save_pretrained(
        tmp_path / "ck")
    make_char_tokenizer().save_pretrained(tmp_path / "ck")
    (tmp_path / "text.txt").write_text(TEXT)
    evaluate = {"baseline": True,
                "perplexity": {"dataset": str(tmp_path / "text.txt"), "context_length": 32,
                               "limit": 3}}  # fmt: skip
    recipe = _recipe(tmp_path, PASSES["int4_rtn"], evaluate=evaluate)
    runs = {mode: run_job(recipe, model=str(tmp_path / "ck"), out_dir=tmp_path / mode,
                          stream=mode == "stream", progress=False)
            for mode in ("mem", "stream")}  # fmt: skip
    assert runs["stream"].payload["memory"]["streamed"]
    def numbers(run):
        scores = run.payload["eval"]
        kl = scores["compressed"]["kl"]
        return ([scores[side][k] for side in ("baseline", "compressed")
                 for k in ("nll_mean", "perplexity")], kl["kl_mean"], kl["top1_changed_pct"])

    assert numbers(runs["mem"]) == numbers(runs["stream"]) and numbers(runs["mem"])[1] > 0
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "stream")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_preflight_says_whether_fewer_calibration_samples_would_fit(checkpoint, tmp_path,
                                                                    monkeypatch):
    """A calibrated pass that does not fit: where one sample would fit, the way out is fewer
    samples; where even one does not (a layer's own weights fill the memory, as GPT-OSS-120B's
    6.4 GB of experts under GPTQ), it says that fewer samples do not help."""
    import compress.pipeline.preflight as preflight

    base = _recipe(tmp_path, PASSES["gptq"])
    recipe, least = (dataclasses.replace(base, calibration=base.calibration.model_copy(
        update={"num_samples": n, "activations": "memory"})) for n in (180, 1))
    skeleton = meta_skeleton(checkpoint)
    need = {r.calibration.num_samples: preflight.estimate(
        r, checkpoint, streamed=True, skeleton=skeleton)["peak_bytes"] for r in (recipe, least)}
    assert need[180] > need[1]
    for available, way in (((need[180] + need[1]) // 2, r"lower calibration\.num_samples"),
                           (need[1] - 1, r"fewer calibration samples do not help: with one it "
                                         r"still needs about")):
        monkeypatch.setattr(preflight, "available_memory_bytes", lambda a=available: a)
        with pytest.raises(RecipeError, match=way):
            run_job(recipe, model=str(checkpoint), out_dir=tmp_path / "out", stream=True,
                    progress=False)
        assert not (tmp_path / "out").exists()
