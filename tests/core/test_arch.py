"""The architecture adapter (``compress.arch``): its names are the only architecture names in
the package, an unsupported family is refused by name, and the Llama entry matches a real model.

The name rule (STYLE.md section 1) is read from the source with ``ast``: a module or attribute
name of a transformers architecture (``q_proj``, ``input_layernorm``, ``lm_head``...) must not
appear as a string (f-strings included) or an attribute access in any ``compress/**/*.py``
outside the ``compress/arch/`` package. Docstrings and comments are prose and may name them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from compress.arch import ARCHS, LLAMA, arch_for, decoder_layers, output_weight_key
from compress.core.errors import ConfigError
from compress.quant.calibrated import migrate_scales
from compress.testing import make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
NAMES = {
    "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj",
    "gate_proj", "up_proj", "down_proj", "gate_up_proj",
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
    "post_feedforward_layernorm", "q_norm", "k_norm",
    "embed_tokens", "lm_head", "self_attn", "mlp", "rotary_emb",
    "experts", "block_sparse_moe", "w1", "w2", "w3", "act_fn",
    "embed_scale", "scalar_embed_scale",
}  # fmt: skip
# (file, name): why the name may stay there.
ALLOWED = {
    # The runtime's own head module is called lm_head (tests read rt.head.lm_head); it holds
    # whatever module the family's entry names, so no layout knowledge is in the name.
    ("compress/runtime/head.py", "lm_head"),
}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _hits(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: name`` for every architecture name in a string or attribute of ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstrings(tree)
    rel = path.relative_to(root).as_posix()
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found = {node.attr} & NAMES
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
        ):
            found = set(re.findall(r"\w+", node.value)) & NAMES  # f-string parts included
        else:
            continue
        hits += [f"{rel}:{node.lineno}: {n}" for n in sorted(found) if (rel, n) not in ALLOWED]
    return hits


def test_architecture_names_live_in_arch_only():
    files = sorted((ROOT / "compress").rglob("*.py"))
    files = [f for f in files if f.parent != ROOT / "compress" / "arch"]  # the adapter package
    assert len(files) > 20
    hits = [h for f in files for h in _hits(f)]
    assert not hits, "architecture names outside compress/arch/:\n" + "\n".join(hits)


def test_the_checker_sees_strings_fstrings_and_attributes(tmp_path):
    source = tmp_path / "bad.py"
    source.write_text(
        '"""Docstrings may say q_proj."""\n'
        "# and comments: down_proj\n"
        'a = layer.self_attn\nb = "mlp.up_proj"\nc = f"model.layers.{i}.lm_head"\n'
        'd = x.mlp_norm\ne = "input_layernorm"\nmlp = 1\n'
    )
    assert sorted(_hits(source, tmp_path)) == [
        "bad.py:3: self_attn",
        "bad.py:4: mlp",
        "bad.py:4: up_proj",
        "bad.py:5: lm_head",
        "bad.py:7: input_layernorm",
    ]


def test_llama_entry_names_modules_of_a_real_llama():
    model = make_tiny_llama()
    arch = arch_for(model, "test")
    assert arch is LLAMA and arch.runtime
    layer = decoder_layers(model)[0]
    for path in (arch.embed, arch.final_norm, arch.lm_head, arch.rotary):
        model.get_submodule(path)
    paths = [arch.attention, arch.q, arch.k, arch.v, arch.o, arch.gate, arch.up, arch.down]
    for path in paths + list(arch.layer_norms):
        layer.get_submodule(path)
    for mapping in arch.awq_mappings + arch.smoothquant_mappings:
        assert all(type(layer.get_submodule(c)) is torch.nn.Linear for c in mapping.consumers)
    assert set(arch.hidden_readers) | set(arch.hidden_writers) == {
        arch.q, arch.k, arch.v, arch.o, arch.gate, arch.up, arch.down
    }  # fmt: skip
    assert output_weight_key(model) == f"{arch.lm_head}.weight"
    assert set(ARCHS) >= {"llama", "qwen2", "qwen3", "mistral", "granite", "gemma2", "gemma3_text",
                          "phi3", "olmo2"}  # fmt: skip


def test_unsupported_family_is_refused_by_pass_and_model_type():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    )
    with pytest.raises(ConfigError, match=r"quantize\.awq: model_type 'gpt2'.*not supported"):
        arch_for(gpt2, "quantize.awq")
    with pytest.raises(ConfigError, match=r"prune\.layers: model_type 'gpt2'"):
        decoder_layers(gpt2, "prune.layers")


def _passes():
    from compress.prune.config import MlpChannelsConfig
    from compress.prune.mlp import prune_mlp_channels
    from compress.quant.awq import AwqConfig, awq
    from compress.quant.gptq import GptqConfig, gptq
    from compress.quant.smoothquant import SmoothquantConfig, smoothquant

    return [
        ("quantize.gptq", gptq, GptqConfig()),
        ("quantize.awq", awq, AwqConfig()),
        ("quantize.smoothquant", smoothquant, SmoothquantConfig()),
        ("prune.mlp_channels", prune_mlp_channels, MlpChannelsConfig(intermediate_size=8)),
    ]


def test_every_arch_pass_refuses_an_unknown_family_before_work():
    from transformers import GPT2Config, GPT2LMHeadModel

    from compress.core.registry import CompressionState

    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    )
    for name, fn, cfg in _passes():
        # no calibration data: the refusal must come before any calibration is asked for
        with pytest.raises(ConfigError, match=f"{name}: model_type 'gpt2'"):
            fn(gpt2, cfg, CompressionState())


@torch.no_grad()
def test_one_plus_w_norm_fold_keeps_the_output():
    """Gemma's ``(1 + w) * n(x)``: folding s into the norm gives ``(1 + w') = (1 + w) / s``."""
    torch.manual_seed(0)
    norm, lin = torch.nn.Module(), torch.nn.Linear(8, 4)
    norm.weight = torch.nn.Parameter(torch.randn(8) * 0.1)
    x = torch.randn(3, 8)
    before = lin((1 + norm.weight) * x)
    s = torch.rand(8) + 0.5
    migrate_scales(norm, [lin], s, s, norm_form="1+w")
    torch.testing.assert_close(lin((1 + norm.weight) * x), before, rtol=1e-5, atol=1e-6)


def test_fused_part_that_does_not_split_is_a_config_error():
    """``producer_rows`` on a layer whose fused linear does not have the rows its entry implies
    ([gate; up] must be twice the down projection's inputs): a ConfigError, not a bad slice."""
    from compress.arch import PHI3, producer_rows

    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.gate_up_proj = torch.nn.Linear(8, 10)  # 10 rows: not 2 x 4
    layer.mlp.down_proj = torch.nn.Linear(4, 8)
    (up_down,) = [m for m in PHI3.awq_mappings if m.part == "up"]
    with pytest.raises(ConfigError, match="do not split into a 'up' part"):
        producer_rows(layer, up_down)
    layer.mlp.gate_up_proj = torch.nn.Linear(8, 8)
    assert producer_rows(layer, up_down) == slice(4, 8)
