"""Teacher-forced next-token scores of one checkpoint in vLLM; run by check_vllm.py with the
interpreter of the cached vLLM venv (scripts/vllm_env.py). It imports vllm only, never compress.

``vllm_score.py MODEL IDS_JSON OUT_JSON --dtype bfloat16 [--kv-cache-dtype fp8]`` feeds the
token ids of IDS_JSON as one prompt to an offline ``vllm.LLM`` (enforce_eager, no prefix
cache) with ``prompt_logprobs=1`` and ``max_tokens=1``, and writes for every position i >= 1
the most likely token vLLM gives for it
from the ids before it (rank 1 of the prompt logprobs) and the log-probability of the actual
token. Position i of that list predicts ids[i], i.e. it pairs with logits[i - 1] of a forward
pass. OUT_JSON gets ``{"ok": true, "argmax": [...], "logprob": [...], ...}``; when vLLM
refuses the checkpoint, ``{"ok": false, "error": "Type: message"}`` (the engine's own reason is
often only in its stderr, which check_vllm.py reads too).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback


def score(model: str, ids: list[int], dtype: str, max_model_len: int,
          kv_cache_dtype: str = "auto", text_only: bool = False) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=model,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=max_model_len,
        max_num_seqs=1,
        enable_prefix_caching=False,
        seed=0,
        kv_cache_dtype=kv_cache_dtype,
        # a multimodal model with no image per prompt: vLLM builds its text model alone
        **({"limit_mm_per_prompt": {"image": 0}} if text_only else {}),
    )
    loaded = time.perf_counter()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    argmax, logprob = [], []
    for token, entry in zip(ids[1:], out.prompt_logprobs[1:], strict=True):
        best = min(entry.items(), key=lambda kv: kv[1].rank)[0]  # rank 1; ties: vLLM's pick
        argmax.append(int(best))
        logprob.append(float(entry[token].logprob))
    return {
        "ok": True,
        "argmax": argmax,
        "logprob": logprob,
        "vllm": vllm.__version__,
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "load_s": round(loaded - started, 1),
        "score_s": round(time.perf_counter() - loaded, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("ids_json")
    parser.add_argument("out_json")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="vLLM's KV cache storage (fp8: the checkpoint's k/v scales)")
    parser.add_argument("--text-only", action="store_true",
                        help="a multimodal model served without images (limit_mm_per_prompt 0)")
    args = parser.parse_args()
    ids = json.loads(open(args.ids_json).read())
    try:
        result = score(args.model, ids, args.dtype, args.max_model_len, args.kv_cache_dtype,
                       args.text_only)
    except Exception as exc:  # noqa: BLE001  (a refusal is a result: report it, do not crash)
        result = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-4000:],
        }
    with open(args.out_json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    main()
