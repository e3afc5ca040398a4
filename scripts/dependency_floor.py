"""Do exports load correctly on the lowest transformers / compressed-tensors we declare?

Driven by ``scripts/check_dependency_floor.sh``, in two environments:

``export DIR`` (main environment, imports compress): tiny random Llamas (``compress.testing``;
rope_theta != 10000 and a llama3-scaled RoPE, so that a config the floor misreads shows up as
different tokens), quantized with our RTN passes and exported to ``DIR/<case>``; beside them
``DIR/expected.json`` holds the prompt ids, the prompt logits and the greedy tokens of the
in-memory compressed model.

``check DIR`` (the floor venv; must not import compress): every checkpoint loads with plain
``AutoTokenizer`` + ``AutoModelForCausalLM`` (compressed-tensors decompresses it), encodes the
prompt to the same ids, reads the same rope_theta, gives the same greedy tokens and prompt logits
within ``ATOL``. Exits 1 with one line per mismatch.

``floors`` prints the transformers and compressed-tensors floors that pyproject.toml declares.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PROMPT = "The floor check: 0123456789 abcdefghij"
NEW_TOKENS = 24
ATOL = 1e-3  # prompt logits; compressed-tensors dequantizes with fp16-scale arithmetic
# initializer_range 0.1 (not 0.02): with the default init attention is nearly uniform and a
# wrong rope_theta changes no token; at 0.1 theta 1e4 instead of 1e5 changes most of them.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
CASES = {
    # name: (quantization pass, tiny-Llama overrides)
    "w4g32-theta1e5": ("int4", {"rope_theta": 100000.0}),
    "w8-llama3-rope": ("int8", {"rope_parameters": LLAMA3_ROPE}),
    "w4-mixed-groups-asym8": ("mixed", {"rope_theta": 100000.0}),
}


def floors(pyproject: Path) -> tuple[str, str]:
    text = pyproject.read_text()
    found = []
    for package in ("transformers", "compressed-tensors"):
        values = set(re.findall(rf'"{package}>=([0-9.]+)', text))
        if len(values) != 1:
            raise SystemExit(f"{pyproject}: want one {package}>= floor, found {sorted(values)}")
        found.append(values.pop())
    return found[0], found[1]


def _greedy(model, ids):
    import torch

    with torch.no_grad():
        logits = model(ids).logits[0]
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                             attention_mask=torch.ones_like(ids), pad_token_id=2)
    return logits, out[0, ids.shape[1]:].tolist()


def export(out: Path) -> None:
    import torch

    from compress.core.registry import CompressionState, run_passes
    from compress.io.export import export_checkpoint
    from compress.quant.linear import set_backend
    from compress.quant.rtn import Int4RtnConfig, Int8RtnConfig
    from compress.testing import make_char_tokenizer, make_tiny_llama

    passes = {
        "int4": [Int4RtnConfig(group_size=32)],
        "int8": [Int8RtnConfig()],
        # mixed-precision format: int4 g32 (pack-quantized) on attention, int8 asymmetric
        # group 32 (int-quantized with zero points) on the MLP
        "mixed": [Int4RtnConfig(group_size=32, targets=["re:.*self_attn.*"]),
                  Int8RtnConfig(group_size=32, symmetric=False, targets=["re:.*mlp.*"])],
    }
    tokenizer = make_char_tokenizer()
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    expected = {}
    for name, (quant, overrides) in CASES.items():
        model = make_tiny_llama(initializer_range=0.1, **overrides)
        run_passes(model, passes[quant], CompressionState(progress=False))
        set_backend(model, "reference")  # fp32 dequantized weights: what the floor computes
        logits, tokens = _greedy(model, ids)
        export_checkpoint(model, tokenizer, out / name, dtype="float32")  # logits as computed
        rope = getattr(model.config, "rope_parameters", None) or {}
        expected[name] = {
            "prompt_ids": ids[0].tolist(),
            "rope_theta": rope.get("rope_theta", getattr(model.config, "rope_theta", None)),
            "tokens": tokens,
            "text": tokenizer.decode(tokens, skip_special_tokens=True),
            "logits": logits.tolist(),
        }
    (out / "expected.json").write_text(json.dumps(expected))
    print(f"exported {len(CASES)} checkpoints to {out}")


def check(out: Path) -> int:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    try:
        import compressed_tensors

        versions["compressed-tensors"] = compressed_tensors.__version__
    except ImportError:
        versions["compressed-tensors"] = "missing"
    print("floor environment:", ", ".join(f"{k} {v}" for k, v in versions.items()))
    expected = json.loads((out / "expected.json").read_text())
    problems = []
    for name, want in expected.items():
        ckpt = out / name
        try:
            tokenizer = AutoTokenizer.from_pretrained(ckpt)
            config = AutoConfig.from_pretrained(ckpt)
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        except Exception as exc:  # noqa: BLE001  (report every case, not only the first)
            problems.append(f"{name}: does not load: {type(exc).__name__}: {exc}")
            continue
        ids = tokenizer(PROMPT)["input_ids"]
        if ids != want["prompt_ids"]:
            problems.append(f"{name}: tokenizer gives {ids}, exported {want['prompt_ids']}")
        # 4.x: the rope_theta attribute (a rope_parameters key would only be stored, unread)
        theta = getattr(config, "rope_theta", None)
        if theta is None:  # 5.x
            theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
        if theta != want["rope_theta"]:
            problems.append(f"{name}: rope_theta read as {theta}, exported {want['rope_theta']}")
        logits, tokens = _greedy(model, torch.tensor([want["prompt_ids"]]))
        diff = (logits - torch.tensor(want["logits"])).abs().max().item()
        same = tokens == want["tokens"]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        print(f"  {name}: rope_theta {theta}, greedy tokens {'equal' if same else 'DIFFER'} "
              f"({NEW_TOKENS}), prompt logits max |diff| {diff:.2e}")
        if not same:
            problems.append(f"{name}: greedy tokens differ: {tokens} != {want['tokens']}")
        elif text != want["text"]:
            problems.append(f"{name}: decoded text differs: {text!r} != {want['text']!r}")
        if diff > ATOL:
            problems.append(f"{name}: prompt logits differ by {diff:.3g} > {ATOL}")
    if "compress" in sys.modules:
        problems.append("the floor check imported compress: it must use plain transformers")
    for problem in problems:
        print("FAIL", problem)
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] in ("export", "check"):
        out = Path(argv[1])
        if argv[0] == "export":
            out.mkdir(parents=True, exist_ok=True)
            export(out)
            return 0
        return check(out)
    if len(argv) == 1 and argv[0] == "floors":
        print(*floors(Path(__file__).resolve().parents[1] / "pyproject.toml"))
        return 0
    print(__doc__.split("\n\n")[0], "\nusage: dependency_floor.py export DIR | check DIR | floors")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
