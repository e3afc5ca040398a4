"""Does vLLM read every kind of our export as we do? The slow-tier check of issue 33.

For each case (a model and an export kind) it exports with ``compress run RECIPE`` (evaluation
off), scores a real WikiText-2 passage (PASSAGE_TOKENS tokens from the start of the test split,
teacher-forced) in vLLM (scripts/vllm_score.py in the cached venv of scripts/vllm_env.py, offline
``LLM``, enforce_eager) and with ``compress.load`` (fp32), and reports the share of positions
whose most likely next token is the same in both. The yardstick is the noise floor measured the
same way: the unquantized model in vLLM (bf16) against ours (fp32). Cases:

- the real SmolLM2-135M: the floor in bf16 and in fp32, W4 RTN symmetric and asymmetric (g128,
  g64 fallback), mixed groups and bits, W8 weight-only, SmoothQuant W8A8; for these also the
  agreement of each variant with its own baseline, in vLLM and in ours (quantization changes the
  same tokens in both when both read the export alike); W4 with calibrated fp8 KV-cache scales
  (``kv_cache_scheme``), run by vLLM with ``--kv-cache-dtype fp8`` and by our runtime through
  fp8 pages (``compress.runtime.paged.paged_logits``: every key written and read back, as
  vLLM's cache does);
- every runtime family (``compress.arch.runtime_model_types``: dense and MoE), as random models of
  a shape vLLM's CPU kernels take (head_dim 64, SmolLM2's tokenizer): unquantized and W4; MoE
  models also W8 (packed, as vLLM's MoE path needs), W4 in two config groups (the experts named
  by patterns), and float experts beside quantized attention. Random weights say "loads and
  computes the same function", not "keeps quality";
- the multimodal wrappers (``compress.testing.TINY_WRAPPER_TYPES``: Gemma 3, Mistral 3, LLaVA)
  around such a text model, with a tiny vision tower: vLLM serves them text-only
  (``--text-only``: no image per prompt), with torchvision's Python modules on its path
  (``vllm_env.torchvision_python_only``), since its multimodal classes import them.

A kind vLLM refuses is a result: its error message is reported (the engine's reason, read from
its stderr). Writes results.json and results.md to --out, with each vLLM log under logs/.
Takes minutes (~1 min per vLLM start on 2 cores): the slow tier (tests/scripts/test_check_vllm.py).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PASSAGE_TOKENS = 400
REAL = "smollm2"
W4 = "recipes/smollm2-w4g128-rtn.yaml"  # g128, g64 where 128 does not divide in_features
NO_EVAL = ("eval.baseline=false", "eval.perplexity=null")
MIXED = (
    "passes.0.overrides=[{layers: 're:.*self_attn.*', group_size: 32}, "
    "{layers: 're:.*layers\\.(0|29)\\.mlp\\.down_proj$', n_bits: 8, group_size: channel}]"
)
GROUPS = "passes.0.overrides=[{layers: 're:.*self_attn.*', group_size: 32}]"
EXPERTS_FLOAT = "passes.0.ignore=[lm_head, 're:.*experts$']"  # quantize attention, keep experts
# kind -> (recipe, --set overrides); None: the unquantized model itself
KINDS: dict[str, tuple[str, tuple[str, ...]] | None] = {
    "base": None,
    "w4-sym": (W4, ()),
    "w4-asym": (W4, ("passes.0.symmetric=false",)),
    "w4-groups": (W4, (GROUPS,)),  # attention g32, MLP g128 (down_proj) and g64
    "w4-mixed": (W4, (MIXED,)),  # as w4-groups, and the first and last down_proj W8 per channel
    "w8": ("recipes/smollm2-w8-rtn.yaml", ()),
    "w8a8-smoothquant": ("recipes/smollm2-w8a8-smoothquant.yaml", ("calibration.num_samples=16",)),
    "w4-sym-fp8kv": ("recipes/smollm2-w4g128-rtn-fp8kv.yaml", ()),
    "w4-experts-float": (W4, (EXPERTS_FLOAT,)),
    # two config groups, every expert in the first (g128), named by patterns
    # (compress.io.quant_config), the attention in the second (g64)
    "w4-attention-g64": (W4, ("passes.0.overrides=[{layers: 're:.*self_attn.*', "
                              "group_size: 64}]",)),
    "w8a8-smoothquant-experts-float": (
        "recipes/smollm2-w8a8-smoothquant.yaml",
        ("calibration.num_samples=16", EXPERTS_FLOAT),
    ),
}
REAL_KINDS = ("base", "w4-sym", "w4-asym", "w4-groups", "w4-mixed", "w8", "w8a8-smoothquant",
              "w4-sym-fp8kv")
FP8_KV_KINDS = ("w4-sym-fp8kv",)  # served with fp8 KV pages, in vLLM and in ours
FAMILY_KINDS = ("base", "w4-sym")
MOE_KINDS = ("base", "w4-sym", "w4-attention-g64", "w8", "w4-experts-float",
             "w8a8-smoothquant-experts-float")
# random models vLLM's CPU attention takes (head_dim 64) with SmolLM2's vocabulary; sliding
# windows of 128 so that the passage runs past them. Gemma scales the embeddings by
# sqrt(hidden): with a random tied embedding the residual stream is then mostly the input
# token's embedding and every next-token argmax is the input token itself (the decoder layers
# would not matter; vLLM's Gemma always ties the head). So the Gemma models get their post-attention
# and post-MLP norms at 10x (weight 9: Gemma norms scale by 1 + weight).
SHAPE = dict(
    vocab_size=49152,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    initializer_range=0.1,
)  # sharper logits than 0.02: fewer near-ties in the argmax
# the released models' latent widths: vLLM's CPU MLA takes a latent + rotary key of 576 only
_MLA_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, head_dim=64, qk_nope_head_dim=128,
                 v_head_dim=128)
MOE_SHAPE = {
    "mixtral": dict(intermediate_size=128),
    "qwen3_moe": dict(moe_intermediate_size=128, intermediate_size=512),
    "qwen2_moe": dict(moe_intermediate_size=128, intermediate_size=512,
                      shared_expert_intermediate_size=256),
    # OLMoE's own settings: vLLM's OLMoE never renormalizes the top-k weights and ignores
    # tie_word_embeddings (a tied model's head stays unloaded there: 0% agreement)
    "olmoe": dict(intermediate_size=128, norm_topk_prob=False, tie_word_embeddings=False),
    # a dense first layer and a trained-looking router correction bias (set in
    # make_family_model), as the released models have
    "glm4_moe": dict(moe_intermediate_size=128, intermediate_size=512, first_k_dense_replace=1,
                     tie_word_embeddings=False),
    "dots1": dict(moe_intermediate_size=128, intermediate_size=512, first_k_dense_replace=1),
    "ernie4_5_moe": dict(moe_intermediate_size=128, intermediate_size=512,
                         moe_layer_start_index=1, tie_word_embeddings=False),
    # latent attention (each query head its own expanded key and value: as many KV heads as
    # heads); V3 with the query's low-rank path and a sigmoid router's correction bias, V2
    # without it (DeepSeek-V2-Lite's layout) and a softmax router
    "deepseek_v3": dict(moe_intermediate_size=128, intermediate_size=512, first_k_dense_replace=1,
                        n_group=1, topk_group=1, q_lora_rank=128, **_MLA_DIMS,
                        num_key_value_heads=4, tie_word_embeddings=False,
                        # as the released config.json says (transformers' config has no such
                        # keys; vLLM builds the router's correction bias only with noaux_tc)
                        topk_method="noaux_tc", scoring_func="sigmoid"),
    # GLM-4.7-Flash: V3's layout, its released dense first layer (mlp_layer_types' default).
    # vLLM reads the dense count and V3's routing keys, which transformers' config keeps but
    # does not set (vLLM's defaults: softmax scores, no correction bias)
    "glm4_moe_lite": dict(moe_intermediate_size=128, intermediate_size=512, n_group=1,
                          topk_group=1, q_lora_rank=128, **_MLA_DIMS, num_key_value_heads=4,
                          tie_word_embeddings=False, mlp_layer_types=None,
                          first_k_dense_replace=1, topk_method="noaux_tc",
                          scoring_func="sigmoid"),
    # MiniMax-M2: RoPE on half of each head; vLLM reads the router's correction bias only with
    # use_routing_bias and its scoring from scoring_func, as the released config.json says
    "minimax_m2": dict(intermediate_size=128, rotary_dim=32, tie_word_embeddings=False,
                       scoring_func="sigmoid", use_routing_bias=True),
    "deepseek_v2": dict(moe_intermediate_size=128, intermediate_size=512, first_k_dense_replace=1,
                        q_lora_rank=None, **_MLA_DIMS, num_key_value_heads=4,
                        tie_word_embeddings=False),
    # HunYuan-MoE: the shared expert as wide as the routed ones (transformers' modeling);
    # vLLM runs it through its transformers backend (TransformersMoEForCausalLM)
    "hunyuan_v1_moe": dict(intermediate_size=128, tie_word_embeddings=False),
    # GraniteMoE: Granite's multipliers (make_tiny_moe's); checkpoints store experts fused
    "granitemoe": dict(intermediate_size=128, tie_word_embeddings=False),
    # Solar Open: GLM-4-MoE's block in every layer (its config has no dense-layer count)
    "solar_open": dict(moe_intermediate_size=128, tie_word_embeddings=False),
    # GPT-OSS: sinks, biases, a sliding and a full layer (the window the passage crosses),
    # experts stored fused as the released bf16 checkpoints hold them
    "gpt_oss": dict(intermediate_size=128, sliding_window=128, tie_word_embeddings=False),
}


# Qwen2-VL's image processor for the tiny towers (14-pixel patches, 2x2 merges); the export
# copies it (compress.io.wrapped.PROCESSOR_FILES)
QWEN_VL_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
    "temporal_patch_size": 2, "min_pixels": 3136, "max_pixels": 200704,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


@dataclass(frozen=True)
class Case:
    model: str  # REAL or a model_type
    kind: str  # a key of KINDS
    vllm_dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        suffix = "" if self.vllm_dtype == "bfloat16" else f"@{self.vllm_dtype}"
        return f"{self.model}/{self.kind}{suffix}"


def plan_cases(families: list[str]) -> list[Case]:
    cases = [Case(REAL, kind) for kind in REAL_KINDS]
    cases += [Case(REAL, kind, "float32") for kind in ("base", "w4-sym", "w8a8-smoothquant")]
    return cases + [
        Case(family, kind)
        for family in families
        for kind in (MOE_KINDS if family in MOE_SHAPE else FAMILY_KINDS)
    ]


# ---- pure logic: agreement, refusals, the report (tests/scripts/test_check_vllm.py) --------


def agreement(a: list[int], b: list[int]) -> float:
    if len(a) != len(b) or not a:
        raise ValueError(f"agreement: lists of {len(a)} and {len(b)} tokens")
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def floor_margin(floor: float, n: int) -> float:
    """Three binomial standard errors of an agreement rate ``floor`` over ``n`` positions (at
    least 2 positions' worth): how far below the floor a case may fall by chance."""
    return max(3 * math.sqrt(floor * (1 - floor) / n), 2 / n)


_ERROR_LINE = re.compile(r"(?:^|\s)([A-Za-z_][\w.]*(?:Error|Exception|Refused)): (.+)$")
_GENERIC = (
    "Engine core initialization failed",
    "EngineCore failed",
    "See root cause above",
    "Engine process failed to start",
    "died unexpectedly",
    "Worker failed",
)


def refusal_reason(error: str, stderr: str) -> str:
    """The most specific reason vLLM gave: the last ``SomeError: message`` line of its stderr
    that is not a generic "engine failed" wrapper, else ``error`` (the exception the LLM
    constructor raised), both stripped of vLLM's ``(EngineCore pid=N)`` prefixes."""
    found = []
    for line in stderr.splitlines():
        line = re.sub(r"^\(\w+ pid=\d+\)\s*", "", line.strip())
        match = _ERROR_LINE.search(line)
        if match and not any(g in match.group(2) for g in _GENERIC):
            found.append(f"{match.group(1)}: {match.group(2).strip()}")
    return found[-1] if found else error.strip() or "no error message (see the log)"


def compare(rows: dict[str, dict], cases: list[Case]) -> list[dict]:
    """One summary row per case from the raw scores in ``rows`` (case name -> {"vllm": ...,
    "ours": ...}): agreement with ours, the floor of its model and vLLM dtype, whether it falls
    below that floor by more than ``floor_margin``, and (quantized kinds) each side's agreement
    with its own unquantized baseline."""
    out = []
    for case in cases:
        raw = rows.get(case.name, {})
        row = {
            "case": case.name,
            "model": case.model,
            "kind": case.kind,
            "vllm_dtype": case.vllm_dtype,
            "status": raw.get("status", "not run"),
        }
        if raw.get("error"):
            row["error"] = raw["error"]
        if row["status"] == "ok":
            vllm, ours = raw["vllm"], raw["ours"]
            n = len(ours["argmax"])
            row["positions"] = n
            row["agree"] = agreement(vllm["argmax"], ours["argmax"])
            row["distinct"] = len(set(ours["argmax"]))  # a degenerate model predicts few
            row["logprob_mad"] = (
                sum(abs(a - b) for a, b in zip(vllm["logprob"], ours["logprob"], strict=True)) / n
            )
            base = rows.get(Case(case.model, "base", case.vllm_dtype).name, {})
            if base.get("status") == "ok":
                floor = agreement(base["vllm"]["argmax"], base["ours"]["argmax"])
                row["floor"] = floor
                row["below_floor"] = row["agree"] < floor - floor_margin(floor, n)
                if case.kind != "base":
                    row["vllm_vs_own_base"] = agreement(vllm["argmax"], base["vllm"]["argmax"])
                    row["ours_vs_own_base"] = agreement(ours["argmax"], base["ours"]["argmax"])
        out.append(row)
    return out


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def render_markdown(summary: list[dict], header: dict) -> str:
    lines = [f"# vLLM export check ({header['date']})", ""]
    lines += [f"- {key}: {value}" for key, value in header.items() if key != "date"]
    lines += [
        "",
        "| case | vLLM dtype | status | agree with ours | floor | Δ logprob (mean abs) "
        "| vLLM vs own base | ours vs own base | distinct argmax |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary:
        status = row["status"] + (" (below floor)" if row.get("below_floor") else "")
        mad = f"{row['logprob_mad']:.3f}" if "logprob_mad" in row else "—"
        lines.append(
            f"| {row['case']} | {row['vllm_dtype']} | {status} | {_pct(row.get('agree'))} "
            f"| {_pct(row.get('floor'))} | {mad} | {_pct(row.get('vllm_vs_own_base'))} "
            f"| {_pct(row.get('ours_vs_own_base'))} | {row.get('distinct', '—')} |"
        )
    refused = [row for row in summary if row["status"] != "ok"]
    if refused:
        lines += ["", "## Not run or refused", ""]
        lines += [
            f"- **{row['case']}** ({row['status']}): `{row.get('error', '')[:600]}`"
            for row in refused
        ]
    return "\n".join(lines) + "\n"


# ---- the work: models, exports, scores --------------------------------------------------


def passage_ids(tokenizer, data_dir: Path) -> list[int]:
    text = (data_dir / "wikitext-2-raw" / "wiki.test.raw").read_text()[: PASSAGE_TOKENS * 12]
    ids = tokenizer(text)["input_ids"][:PASSAGE_TOKENS]
    if len(ids) < PASSAGE_TOKENS:
        raise SystemExit(f"the passage has {len(ids)} tokens, fewer than {PASSAGE_TOKENS}")
    return ids


def _sharpen_gemma_norms(model) -> None:
    for name, module in model.named_modules():
        if name.endswith(("post_attention_layernorm", "post_feedforward_layernorm")):
            module.weight.data.fill_(9.0)


def make_family_model(family: str, tokenizer, folder: Path) -> Path:
    """A random ``family`` model of SHAPE with SmolLM2's tokenizer, saved to ``folder``; a
    multimodal wrapper's text model of SHAPE with the wrapper's tiny vision tower."""
    import torch

    from compress.testing import TINY_WRAPPER_TYPES, make_tiny_model, make_tiny_moe

    if family in TINY_WRAPPER_TYPES:
        from safetensors.torch import load_file, save_file

        from compress.testing import write_tiny_multimodal

        window = {"sliding_window": 128} if family in ("gemma3", "mistral3") else {}
        write_tiny_multimodal(folder, family, tokenizer=tokenizer, **SHAPE, **window)
        if family == "gemma3":  # as for Gemma below, on the stored text model's norms
            file = folder / "model.safetensors"
            tensors = load_file(file)
            for name, tensor in tensors.items():
                if name.startswith("language_model.") and name.endswith(
                        ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                    tensor.fill_(9.0)
            save_file(tensors, file, metadata={"format": "pt"})
        if family.startswith("qwen"):  # vLLM builds the image processor even for text only
            (folder / "preprocessor_config.json").write_text(json.dumps(QWEN_VL_PROCESSOR))
        return folder
    if family in MOE_SHAPE:
        model = make_tiny_moe(family, **dict(SHAPE, **MOE_SHAPE[family]))
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():  # a buffer (GLM-4-MoE, dots.llm1) or a parameter (ERNIE)
            for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
                if name.endswith("e_score_correction_bias"):
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)
    elif family.startswith("gemma"):
        model = make_tiny_model(family, **SHAPE, sliding_window=128)
        _sharpen_gemma_norms(model)
    else:
        from compress.arch import ARCHS

        shape = dict(SHAPE)
        if family in ("mistral", "ministral", "cohere2", "cwm", "vaultgemma", "granite_swa"):
            # windows the passage crosses (the tiny config's 8 would leave the sliding layers 8
            # keys)
            shape["sliding_window"] = 128
        if ARCHS[family].kv_heads_key is None:  # GPT-NeoX, OPT: each head its own k and v;
            # their modeling ignores num_key_value_heads, vLLM's transformers backend reads it
            shape["num_key_value_heads"] = SHAPE["num_attention_heads"]
        if family == "opt":  # its MLP width is ffn_dim; no projection around the layers
            shape.update(ffn_dim=SHAPE["intermediate_size"],
                         word_embed_proj_dim=SHAPE["hidden_size"])
        model = make_tiny_model(family, **shape)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if family in ("glm4_moe", "ernie4_5_moe", "deepseek_v3"):  # MTP modules, as released
        from compress.testing import add_mtp_modules

        add_mtp_modules(folder)
    return folder


def export(case: Case, model_dir: Path, out: Path, log: Path) -> str | None:
    """``compress run`` of the case's recipe on ``model_dir`` into ``out``; None, or the error."""
    recipe, sets = KINDS[case.kind]
    cmd = [
        sys.executable,
        "-m",
        "compress.cli",
        "run",
        recipe,
        "--model",
        str(model_dir),
        "--out",
        str(out),
        "--overwrite",
        "--no-progress",
    ]
    for item in (*NO_EVAL, *sets):
        cmd += ["--set", item]
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode == 0:
        return None
    return refusal_reason(f"compress run exited {proc.returncode}", log.read_text())


def ours_scores(path: Path, ids: list[int], fp8_kv: bool = False) -> dict:
    """Our argmax after each position and log-prob of each next token (fp32, compress.load);
    ``fp8_kv``: through our runtime with fp8 KV pages at the checkpoint's scales, every key
    written and read back (``paged_logits``)."""
    import torch

    import compress

    loaded = compress.load(str(path))
    with torch.no_grad():
        if fp8_kv:
            from compress.runtime.engine import Runtime
            from compress.runtime.paged import FP8, PagedKVCache, paged_logits

            runtime = Runtime(loaded.model, max_seq_len=len(ids), compile=False,
                              static_cache=False)  # fmt: skip
            if runtime.kv_scales is None:
                raise RuntimeError(f"{path} has no fp8 KV-cache scales")
            first = runtime.layers[0]
            cache = PagedKVCache(
                n_layers=len(runtime.layers), num_blocks=-(-len(ids) // 16), block_size=16,
                n_kv=first.n_kv, head_dim=first.head_dim, dtype=FP8,
                compute_dtype=runtime.kv_dtype, kv_scales=runtime.kv_scales,
            )  # fmt: skip
            logits = paged_logits(runtime, cache, ids)[:-1].float()
        else:
            logits = loaded.model(torch.tensor([ids])).logits[0, :-1].float()  # [T-1, vocab]
    logprob = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return {"argmax": logits.argmax(-1).tolist(), "logprob": logprob.tolist()}


def vllm_scores(python: Path, path: Path, ids_file: Path, dtype: str, log: Path, env: dict,
                kv_cache_dtype: str = "auto", text_only: bool = False) -> dict:
    result = log.with_suffix(".json")
    result.unlink(missing_ok=True)
    cmd = [
        str(python),
        str(ROOT / "scripts" / "vllm_score.py"),
        str(path),
        str(ids_file),
        str(result),
        "--dtype",
        dtype,
        "--kv-cache-dtype",
        kv_cache_dtype,
        *(["--text-only"] if text_only else []),
    ]
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=1200)
    if not result.is_file():
        return {"ok": False, "error": f"vllm_score.py exited {proc.returncode} without a result"}
    return json.loads(result.read_text())


def run_case(case: Case, ctx: dict) -> dict:
    out: Path = ctx["out"]
    safe = case.name.replace("/", "__").replace("@", "_")
    model_dir = ctx["models"][case.model]
    path = model_dir
    if KINDS[case.kind] is not None:
        path = out / "exports" / f"{case.model}__{case.kind}"
        if path not in ctx["exported"]:
            error = export(case, model_dir, path, out / "logs" / f"{safe}.export.log")
            if error:
                return {"status": "export failed", "error": error}
            ctx["exported"].add(path)
    started = time.perf_counter()
    multimodal = case.model in ctx["multimodal_env"]
    vllm = vllm_scores(
        ctx["python"],
        path,
        ctx["ids_file"],
        case.vllm_dtype,
        out / "logs" / f"{safe}.vllm.log",
        ctx["multimodal_env"].get(case.model, ctx["env"]),
        "fp8" if case.kind in FP8_KV_KINDS else "auto",
        text_only=multimodal,
    )
    if not vllm["ok"]:
        log = (out / "logs" / f"{safe}.vllm.log").read_text()
        return {"status": "refused", "error": refusal_reason(vllm["error"], log)}
    key = (case.model, case.kind)
    if key not in ctx["ours"]:
        ctx["ours"][key] = ours_scores(path, ctx["ids"], fp8_kv=case.kind in FP8_KV_KINDS)
    return {
        "status": "ok",
        "vllm": vllm,
        "ours": ctx["ours"][key],
        "seconds": round(time.perf_counter() - started, 1),
    }


def _header(args, versions: dict) -> dict:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next(
        (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "unknown"
    )
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    cpu += f" ({' '.join(f for f in flags if re.match('avx512_?(f|bf16|vnni)$|amx|avx_vnni', f))})"
    import torch

    return {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["scripts/check_vllm.sh", *sys.argv[1:]]),
        "cpu": f"{cpu}, torch threads {torch.get_num_threads()}",
        "vLLM venv": ", ".join(f"{k} {v}" for k, v in versions.items()),
        "vLLM settings": f"offline LLM, enforce_eager, max_model_len 1024, "
        f"VLLM_CPU_KVCACHE_SPACE={args.kv_cache_gib:g} GiB",
        "passage": f"first {PASSAGE_TOKENS} tokens of WikiText-2 test (wiki.test.raw), "
        f"{PASSAGE_TOKENS - 1} scored positions, teacher-forced",
        "ours": "compress.load, fp32 activations, auto backend (fp8-KV kinds: our runtime "
        "over fp8 pages at the checkpoint's scales)",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "check-vllm")
    parser.add_argument(
        "--only",
        default="",
        help="regex over case names (e.g. 'smollm2/|qwen'"
        "); the base cases their floors need are added",
    )
    parser.add_argument("--families", default="all", help="comma-separated model_types, or all")
    parser.add_argument("--kv-cache-gib", type=float, default=2)
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    logging_setup()
    from transformers import AutoTokenizer
    from vllm_env import torchvision_python_only, venv_versions, vllm_environ, vllm_python

    from compress.arch import runtime_model_types
    from compress.data import resolve_data_dir
    from compress.io.load import embedded_model_dir
    from compress.testing import TINY_WRAPPER_TYPES

    python = vllm_python()
    families = ([*runtime_model_types(), *TINY_WRAPPER_TYPES] if args.families == "all"
                else args.families.split(","))
    cases = plan_cases(families)
    if args.only:
        wanted = {c for c in cases if re.search(args.only, c.name)}
        wanted |= {Case(c.model, "base", c.vllm_dtype) for c in wanted}  # their floors
        cases = [c for c in cases if c in wanted]
    for sub in ("logs", "exports", "models"):
        (args.out / sub).mkdir(parents=True, exist_ok=True)
    real_dir = embedded_model_dir("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(real_dir)
    ids = passage_ids(tokenizer, resolve_data_dir(args.data_dir))
    ids_file = args.out / "passage_ids.json"
    ids_file.write_text(json.dumps(ids))
    models = {REAL: real_dir}
    for family in sorted({c.model for c in cases} - {REAL}):
        models[family] = make_family_model(family, tokenizer, args.out / "models" / family)
    ctx = {
        "out": args.out,
        "models": models,
        "python": python,
        "ids": ids,
        "ids_file": ids_file,
        "env": vllm_environ(kv_cache_gib=args.kv_cache_gib),
        "exported": set(),
        "ours": {},
    }
    wrappers = {c.model for c in cases} & set(TINY_WRAPPER_TYPES)
    if wrappers:  # their vLLM processes import torchvision
        env = dict(ctx["env"], PYTHONPATH=str(torchvision_python_only()))
        ctx["multimodal_env"] = dict.fromkeys(wrappers, env)
    else:
        ctx["multimodal_env"] = {}
    rows = {}
    for case in cases:
        print(f"[{time.strftime('%H:%M:%S')}] {case.name} ...", flush=True)
        rows[case.name] = run_case(case, ctx)
        print(
            f"    {rows[case.name]['status']} {rows[case.name].get('error', '')[:300]}", flush=True
        )
    summary = compare(rows, cases)
    header = _header(args, venv_versions())
    (args.out / "results.json").write_text(
        json.dumps({"header": header, "cases": summary, "raw": rows}, indent=1)
    )
    (args.out / "results.md").write_text(render_markdown(summary, header))
    print(render_markdown(summary, header))
    return 0


def logging_setup() -> None:
    import logging
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    sys.exit(main())
