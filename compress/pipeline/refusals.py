"""What a job refuses, and whether it can stream, decided before any work from file headers and
config.json alone (``compress.pipeline.job.plan_job`` asks, in order)."""

from __future__ import annotations

from pathlib import Path

from compress.core.errors import RecipeError
from compress.core.registry import PASSES, pass_name_of
from compress.io.export import resolve_export_dtype
from compress.recipe import Recipe


def stream_refusal(recipe: Recipe, where) -> str | None:
    """None when the recipe can run layer by layer from the checkpoint at ``where`` (the model
    a meta skeleton, ``compress.io.stream``), else why not (the job then loads the model whole,
    after the memory preflight)."""
    from compress.io.load import is_compressed_checkpoint

    if not isinstance(where, Path):
        return "the model is not a local folder"
    if is_compressed_checkpoint(where):
        return "the model is already a compressed checkpoint"
    if not recipe.export.enabled:
        return "export is disabled (a streamed run writes its result as it goes)"
    if not recipe.passes:
        return "the recipe has no passes"
    whole = [PASSES[pass_name_of(p)].name for p in recipe.passes
             if not PASSES[pass_name_of(p)].layerwise]
    if whole:
        return f"{', '.join(whole)} work on the whole model"
    return None


def skeleton_refusal(skeleton, reader) -> str | None:
    """Streaming reads tensors under the module tree's names (renamed where transformers or an
    MoE layout rename them: ``under_model_names``, ``MoeTreeReader``): a checkpoint stored
    under other names is loaded by transformers instead."""
    from compress.arch import ARCHS, model_type
    from compress.io.export import _tied_head_key

    arch = ARCHS.get(model_type(skeleton))
    if arch is None:
        return f"model_type {model_type(skeleton)!r} is not streamed (an unknown family)"
    names = set(skeleton.state_dict()) - {_tied_head_key(skeleton)}
    stored = set(reader.names())
    if names != stored:
        odd = sorted(names ^ stored)[:3]
        return f"the checkpoint's tensor names differ from the model's ({', '.join(odd)})"
    return None


def check_lengths(recipe: Recipe, where) -> None:
    """Sequence lengths past the model's positions, refused before any work (a job failed at
    its evaluation, after its passes)."""
    from compress.io.checkpoint import check_positions
    from compress.io.stream import causal_lm_config

    if not (isinstance(where, Path) and (where / "config.json").is_file()):
        return
    config, _ = causal_lm_config(where)
    ppl, cal = recipe.eval.perplexity, recipe.calibration
    if ppl is not None:
        check_positions(config, ppl.context_length, "eval.perplexity.context_length")
    if cal is not None:
        check_positions(config, cal.seq_len, "calibration.seq_len")


def eval_refusal(recipe: Recipe, where, reader) -> str | None:
    """A streamed job scores its export; that is the whole-model path's numbers only when the
    export holds the checkpoint's float values exactly: in their own dtype, or in float32,
    which holds every bf16 and fp16 value (a float32 source exported in bf16 would be scored
    with rounded embeddings and norms)."""
    from compress.core.registry import DTYPES

    stored = {reader.dtype(n) for n in reader.names() if reader.dtype(n).is_floating_point}
    export = DTYPES[export_dtype(recipe, where)]
    if stored <= {export} or export is DTYPES["float32"]:
        return None
    names = ", ".join(sorted(str(d).removeprefix("torch.") for d in stored))
    return (f"evaluation scores the model in its checkpoint's {names}; a streamed job would "
            f"score the export, rounded to {str(export).removeprefix('torch.')}")


def export_dtype(recipe: Recipe, where) -> str:
    """The dtype the export writes float tensors in: the recipe's (``resolve_export_dtype``),
    but float32, the compute dtype, for a bitsandbytes model: its export keeps the model's
    dtype (``export_checkpoint``: casting would change the bnb modules' compute path)."""
    if any(pass_name_of(p) == "quantize.bnb" for p in recipe.passes):
        return "float32"
    return resolve_export_dtype(recipe.export.dtype, where)


def refuse_bnb_of_multimodal(recipe: Recipe, where) -> None:
    """A bitsandbytes export (``save_pretrained``) of a checkpoint that stores more than its
    causal LM (``compress.io.wrapped``) would lose the rest: refused before any work."""
    from compress.io.wrapped import wrapped_text

    wrapped = wrapped_text(where) if isinstance(where, Path) and recipe.export.enabled else None
    if wrapped and any(pass_name_of(p) == "quantize.bnb" for p in recipe.passes):
        rest = "vision tower" if wrapped.multimodal else "multi-token-prediction modules"
        raise RecipeError(
            f"{where} stores a {rest} beside its causal LM: quantize.bnb exports through "
            f"transformers' save_pretrained, which would write the causal LM without it; "
            "use quantize.int4_rtn, quantize.int8_rtn, quantize.gptq or quantize.awq (their "
            "compressed-tensors exports keep it), or set export.enabled: false")
