"""Which pass works on which model family: the README's family x pass table (issue 17).

    python scripts/family_matrix.py [--out out/family_matrix] [--update-readme]

Every family of ``compress.arch`` as a tiny random model built from its transformers config
(``compress.testing``). Each pass runs alone on a fresh model (4 random calibration sequences of
32 tokens): a cell is ✓ with the share of the targeted weight elements the pass quantized (or the
share of parameters a prune pass kept), or the reason a ``ConfigError`` gave (a stated refusal).
Any other exception is a bug: the cell says ✗ and the script exits 1. Then the GPTQ W4 model is
exported and reloaded by plain transformers in a subprocess that does not import compress
(relative logit difference), and the runtime column says whether ``compress.runtime`` runs the
family (greedy tokens equal transformers' in fp32) or why it falls back. Writes
``family_matrix.json`` / ``.md`` and, with ``--update-readme``, the table between the README's
``family-matrix`` markers.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import torch

from compress.arch import ARCHS
from compress.core.errors import ConfigError, RecipeError
from compress.core.registry import CompressionState, get_pass, run_passes
from compress.io.export import export_checkpoint
from compress.recipe import parse_recipe  # noqa: F401  (registers every pass)
from compress.runtime.engine import Runtime, unsupported_reason
from compress.testing import (
    TINY_MODEL_TYPES,
    TINY_MOE_TYPES,
    hf_greedy,
    make_char_tokenizer,
    make_tiny_model,
    make_tiny_moe,
    plain_transformers_logits,
)

ROOT = Path(__file__).resolve().parents[1]
MOE_TYPES = TINY_MOE_TYPES
PASSES = [  # (column, pass name, settings)
    ("RTN W4", "quantize.int4_rtn", {"group_size": 32}),
    ("RTN W8", "quantize.int8_rtn", {}),
    ("GPTQ W4", "quantize.gptq", {"group_size": 32}),
    ("AWQ W4", "quantize.awq", {"group_size": 32}),
    ("AutoRound W4", "quantize.autoround", {"group_size": 32, "iters": 20}),
    ("SmoothQuant W8A8", "quantize.smoothquant", {}),
    ("rotate (Hadamard)", "rotate.hadamard", {}),
    ("bnb nf4", "quantize.bnb", {"format": "nf4"}),
    ("prune heads", "prune.attention_heads", {"sparsity": 0.5}),
    ("prune MLP", "prune.mlp_channels", {"sparsity": 0.5}),
    ("prune hidden", "prune.hidden_size", {"sparsity": 0.25}),
    ("prune layers", "prune.layers", {"sparsity": 0.5}),
]


def build(model_type: str):
    if model_type in MOE_TYPES:
        return make_tiny_moe(model_type)
    return make_tiny_model(model_type)


def calibration(seed: int = 0) -> CompressionState:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (4, 1, 32), generator=gen)
    return CompressionState(calibration_batches=lambda: list(ids), progress=False)


def run_pass(model_type: str, name: str, settings: dict) -> tuple[str, bool]:
    """(cell text, is a bug)."""
    model = build(model_type)
    note = ""
    if name.startswith("rotate.") and ARCHS[model_type].latent_attention:
        # the per-head value rotation (R2) is refused for latent attention with that advice
        settings, note = {**settings, "value_output": False}, " (value_output: false)"
    params = sum(p.numel() for p in model.parameters())
    try:
        spec = get_pass(name)
    except RecipeError as exc:
        return f"n/a: {exc}", False
    state = calibration()
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 12, 64, 33, 21, 8]])
    with torch.no_grad():
        before = model(ids).logits
    try:
        run_passes(model, [spec.config_cls(**settings)], state)
    except (ConfigError, RecipeError) as exc:
        return f"refused: {str(exc).splitlines()[0][:140]}", False
    except ImportError as exc:  # bitsandbytes not installed
        return f"n/a: {exc}"[:140], False
    except Exception as exc:  # noqa: BLE001 - anything else is a bug of ours
        return f"✗ {type(exc).__name__}: {str(exc)[:120]}", True
    metrics = state.reports[-1].metrics
    if name.startswith("quantize."):
        share = metrics.get("quantized_share")
        left = metrics.get("unquantized") or {}
        if left:  # a partial pass: named in its report and a warning; strict refuses it
            return f"partial: {share:.0%} ({len(left)} float, named; strict refuses)", False
        return (f"✓ {share:.0%}" if share is not None else "✓"), False
    if name.startswith("rotate."):  # an exact fold: the logits must not move
        with torch.no_grad():
            rel = float((model(ids).logits - before).norm() / before.norm())
        return (f"✓ logits rel {rel:.0e}{note}" if rel < 1e-4 else f"✗ logits rel {rel:.2g}"
                ), rel >= 1e-4
    kept = sum(p.numel() for p in model.parameters()) / params
    return f"✓ {kept:.0%} params", False


def reload_check(model_type: str) -> tuple[str, bool]:
    """GPTQ W4 export, reloaded by plain transformers in a subprocess."""
    model = build(model_type)
    state = calibration()
    try:
        run_passes(model, [get_pass("quantize.gptq").config_cls(group_size=32)], state)
    except (ConfigError, RecipeError) as exc:
        return f"refused: {str(exc).splitlines()[0][:120]}", False
    ids = [[5, 17, 42, 99, 7, 3, 250, 12, 64, 33, 21, 8, 140, 77, 9, 31]]
    with torch.no_grad():
        ours = model(torch.tensor(ids)).logits
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "export"
        export_checkpoint(model, make_char_tokenizer(), folder, dtype="float32")
        try:
            [theirs] = plain_transformers_logits([folder], ids, tmp)
        except AssertionError as exc:
            last = (str(exc).strip().splitlines() or ["?"])[-1]
            return f"✗ reload failed: {last[:140]}", False
    rel = float((theirs - ours).norm() / ours.norm())
    return (f"✓ rel {rel:.0e}" if rel < 1e-2 else f"✗ rel {rel:.2g}"), rel >= 1e-2


def runtime_check(model_type: str) -> tuple[str, bool]:
    model = build(model_type)
    reason = unsupported_reason(model)
    if reason is not None:
        return f"fallback: {reason[:120]}", False
    prompt = [5, 17, 42, 99, 7, 3, 250, 12, 64, 33, 21, 8]
    expected = hf_greedy(model, prompt, 12)
    got = Runtime(copy.deepcopy(model), max_seq_len=64).generate([prompt], 12)[0]
    return ("✓ runtime" if got == expected else f"✗ tokens differ {got} vs {expected}"), (
        got != expected
    )


def markdown(rows: list[dict]) -> str:
    columns = [c for c, _, _ in PASSES] + ["export → transformers", "runtime"]
    lines = ["| family | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for row in rows:
        cells = [row["cells"].get(c, "") for c in columns]
        lines.append(f"| {row['family']} | " + " | ".join(c.replace("|", "/") for c in cells)
                     + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/family_matrix"))
    parser.add_argument("--families", nargs="*", help="default: every family of compress.arch")
    parser.add_argument("--update-readme", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    families = args.families or [t for t in ARCHS if t in TINY_MODEL_TYPES or t in MOE_TYPES]
    rows, bugs = [], []
    for family in families:
        cells = {}
        for column, name, settings in PASSES:
            cells[column], bug = run_pass(family, name, settings)
            bugs += [f"{family} / {column}: {cells[column]}"] if bug else []
        for column, check in (("export → transformers", reload_check), ("runtime", runtime_check)):
            try:
                cells[column], bug = check(family)
            except Exception as exc:  # noqa: BLE001 - a bug of ours, reported in the table
                cells[column], bug = f"✗ {type(exc).__name__}: {str(exc)[:120]}", True
            bugs += [f"{family} / {column}: {cells[column]}"] if bug else []
        rows.append({"family": family, "cells": cells})
        print(f"{family}: {cells}", flush=True)
    previous = args.out / "family_matrix.json"
    if args.families and previous.is_file():  # a partial rerun replaces only its rows
        fresh = {row["family"]: row for row in rows}
        old = json.loads(previous.read_text())
        rows = [fresh.pop(row["family"], row) for row in old] + list(fresh.values())
    table = markdown(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "family_matrix.json").write_text(json.dumps(rows, indent=1, ensure_ascii=False))
    (args.out / "family_matrix.md").write_text(table)
    print(table)
    if args.update_readme:
        readme = ROOT / "README.md"
        text = readme.read_text()
        start, end = "<!-- family-matrix:start -->", "<!-- family-matrix:end -->"
        head, rest = text.split(start)
        _, tail = rest.split(end)
        readme.write_text(f"{head}{start}\n{table}{end}{tail}")
    if bugs:
        print("BUGS:\n  " + "\n  ".join(bugs))
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
