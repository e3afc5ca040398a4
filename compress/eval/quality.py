"""Quality: token perplexity over a text (WikiText-2 raw test by default).

Protocol (stated in every result): the whole file is read as one string and tokenized once
without special tokens; windows of ``context_length`` tokens start every ``stride`` tokens
(default: stride = context_length, i.e. non-overlapping windows). In each window only the tokens
not already scored by the previous window are scored, each conditioned on everything before it
in the window; the first token of the text is never scored. Token perplexity =
exp(total negative log-likelihood / number of scored tokens). ``limit`` keeps the first N windows
(a prefix of the text, not a random sample: the shipped recipes score the first 16 windows of the
WikiText-2 test split by default). Published numbers differ (some use 2048-token windows, some
word-level perplexity): compare only results whose protocol matches.

Resume: with ``state_dir`` the per-window NLLs are saved as they go (every ``save_every_s``
seconds, on completion, and on an interruption such as Ctrl-C) in ``<state_dir>/<key>.json``. The
key hashes the model's tensors, the token ids and the window settings, so a later call on the same
weights and text continues after the last saved window, or returns at once when enough windows are
saved; any change (other weights, text, context, library versions) gives a new key. The windows
are summed in order in both cases, so a resumed result equals a fresh one exactly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

# Bump when the scoring itself changes, so that saved window NLLs are not mixed with new ones.
_STATE_VERSION = 1


@dataclass
class PerplexityResult:
    perplexity: float
    nll_mean: float
    scored_tokens: int
    windows: int
    protocol: dict[str, Any]
    # windows taken from a saved state instead of being recomputed (not part of the result)
    reused_windows: int = field(default=0, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def window_spans(n_tokens: int, context_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) for each window; tokens [first_scored, end) are scored."""
    spans = []
    prev_end = 0
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + context_length, n_tokens)
        first_scored = max(prev_end, begin + 1)
        if first_scored < end:
            spans.append((begin, end, first_scored))
        prev_end = end
        if end == n_tokens:
            break
    return spans


def _digest_model(model: nn.Module, digest: Any) -> None:
    """Feed every tensor of the state dict (names, dtypes, shapes, bytes) and each quantized
    module's kernel backend (it changes the rounding) into ``digest``."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        ident = (tensor.data_ptr(), tuple(tensor.shape))
        if ident in seen:  # tied weights: hashed once
            continue
        seen.add(ident)
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    for name, module in model.named_modules():
        backend = getattr(module, "backend", None)
        if isinstance(backend, str):
            digest.update(f"{name}:backend={backend}".encode())


def state_key(model: nn.Module, ids: torch.Tensor, context_length: int, stride: int) -> str:
    """What a saved perplexity state depends on: weights, token ids, windows, device, versions."""
    import transformers

    digest = hashlib.sha256()
    device = next(model.parameters()).device
    settings = (_STATE_VERSION, context_length, stride, device.type, torch.__version__,
                transformers.__version__)
    digest.update(repr(settings).encode())
    digest.update(ids.numpy().tobytes())
    _digest_model(model, digest)
    return digest.hexdigest()[:32]


def _read_state(path: Path, key: str) -> tuple[list[float], list[int]]:
    try:
        state = json.loads(path.read_text())
        nll = [float(x) for x in state["window_nll"]]
        tokens = [int(x) for x in state["window_tokens"]]
    except FileNotFoundError:
        return [], []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable perplexity state %s (%s); starting over", path, exc)
        return [], []
    if state.get("key") != key or len(nll) != len(tokens):
        return [], []
    return nll, tokens


def _write_state(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record))  # json writes floats with repr: they read back exactly
    os.replace(tmp, path)


@torch.no_grad()
def _score_windows(model, ids, spans, nll, tokens, save, *, desc: str, progress: bool) -> None:
    """Append each remaining window's summed NLL and scored-token count to ``nll``/``tokens``;
    ``save()`` is called at its own pace after each window and once more on an interruption."""
    device = next(model.parameters()).device
    bar = tqdm(total=len(spans), initial=len(nll), desc=desc, disable=not progress)
    try:
        for begin, end, first_scored in spans[len(nll) :]:
            window = ids[begin:end].unsqueeze(0).to(device)
            logits = model(window).logits[0].float()  # [T, V]
            # logits at position t predict token t+1
            targets = window[0, first_scored - begin :]
            preds = logits[first_scored - begin - 1 : end - begin - 1]
            value = float(torch.nn.functional.cross_entropy(preds, targets, reduction="sum"))
            tokens.append(targets.numel())
            nll.append(value)  # last: a window counts once its NLL is stored
            bar.update(1)
            save(False)
    except BaseException:
        del tokens[len(nll) :]  # an interruption between the two appends
        save(True)
        raise
    finally:
        bar.close()


def perplexity(
    model: nn.Module,
    tokenizer: Any,
    text: str,
    *,
    context_length: int = 512,
    stride: int | None = None,
    limit: int | None = None,
    source: str = "text",
    progress: bool = True,
    label: str = "perplexity",
    state_dir: str | os.PathLike[str] | None = None,
    resume: bool = True,
    save_every_s: float = 10.0,
) -> PerplexityResult:
    """Token perplexity of ``model`` on ``text`` under the protocol in the module docstring.

    label: the progress bar's name (e.g. "baseline perplexity"); the bar adds the file name and
    the window count. state_dir: where the resumable per-window state is kept (see the module
    docstring); None keeps nothing. resume=False ignores (and then overwrites) a saved state.
    """
    stride = stride or context_length
    if stride > context_length:
        raise ValueError(f"stride {stride} > context_length {context_length} would skip tokens")
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    all_spans = window_spans(len(ids), context_length, stride)
    spans = all_spans[:limit] if limit is not None else all_spans
    if not spans:
        raise ValueError(f"{source}: text too short to score ({len(ids)} tokens)")
    nll: list[float] = []
    tokens: list[int] = []
    path, record = None, {}
    if state_dir is not None:
        key = state_key(model, ids, context_length, stride)
        path = Path(state_dir) / f"{key}.json"
        if resume:
            nll, tokens = _read_state(path, key)
        record = {"key": key, "source": source, "context_length": context_length,
                  "stride": stride, "windows_in_text": len(all_spans),
                  "window_nll": nll, "window_tokens": tokens}
    reused = min(len(nll), len(spans))
    if reused == len(spans):
        log.info("%s: all %d windows already scored, result read from %s", label, reused, path)
    elif reused:
        log.info("%s: resuming after window %d of %d, saved in %s", label, reused, len(spans), path)
    last_save = [time.monotonic()]

    def save(now: bool) -> None:
        if path is not None and (now or time.monotonic() - last_save[0] >= save_every_s):
            _write_state(path, record)
            last_save[0] = time.monotonic()

    name = Path(source).name or source
    if len(nll) < len(spans):
        _score_windows(model, ids, spans, nll, tokens, save, progress=progress,
                       desc=f"{label} ({name}, {len(spans)} windows of {context_length})")
        save(True)
    total_nll, total_tokens = 0.0, 0
    # summed in window order, as a fresh run sums them
    for value, count in zip(nll[: len(spans)], tokens[: len(spans)], strict=True):
        total_nll += value
        total_tokens += count
    nll_mean = total_nll / total_tokens
    protocol = {
        "source": source,
        "tokenization": "whole text, one pass, no special tokens",
        "context_length": context_length,
        "stride": stride,
        "windows": len(spans),
        "limit": limit,
        "windows_in_text": len(all_spans),
        "selection": "all windows" if len(spans) == len(all_spans) else f"first {len(spans)}",
        "total_tokens_in_text": len(ids),
        "metric": "token perplexity = exp(mean NLL over scored tokens)",
    }
    return PerplexityResult(
        math.exp(nll_mean), nll_mean, total_tokens, len(spans), protocol, reused_windows=reused
    )
