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

KL divergence to a baseline (as llama.cpp's ``--kl-divergence-base``): the baseline's pass
(``top_k=k``) writes, per window, each scored token's k most likely next tokens and their
log-probs plus the log of the remaining probability mass, to ``<top_k_dir>/<key>.top<k>/``. A
later pass on a variant (``kl_base=<that folder>``) reads them back, so the baseline need not be
in memory, and in the same forward as its NLL computes per token
``KL(p || q) ~= sum_{i in top-k(p)} p_i (log p_i - log q_i) + p_tail (log p_tail - log q_tail)``
and whether its own top-1 token differs from the baseline's. Merging the tail into one bucket
can only lose divergence (log-sum inequality), so the estimate is a lower bound of the
full-vocabulary KL, equal to it at k = vocabulary size. How much it loses depends on how far the
variant moves the tail: on SmolLM2-135M W4 RTN (first 4 test windows, full KL 0.524 nats)
k = 1, 8, 32, 128, 1024 kept 33%, 62%, 76%, 86%, 96% of it. Disk: per scored token k ids (2 bytes
when the vocabulary fits uint16, else 4) + k float32 log-probs + one float32 tail, i.e.
6k + 4 bytes: k = 32 on SmolLM2 (vocab 49,152) over the whole WikiText-2 test split (593
windows, 302,822 scored tokens) is 196 B/token, 59.4 MB (+ ~1 KB of npz headers per window,
measured).
The KL sums are saved and resumed per window like the NLLs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from compress.core.errors import DataError, NumericsError, OutputError
from compress.io.checkpoint import check_positions

log = logging.getLogger(__name__)

# Bump when the scoring itself changes, so that saved window NLLs are not mixed with new ones.
_STATE_VERSION = 1


@dataclass
class KlResult:
    """How far a model's next-token distributions are from a baseline's, over the scored tokens
    of the perplexity windows (module docstring)."""

    kl_mean: float  # nats per scored token, KL(baseline || this model), top-k + tail estimate
    kl_stderr: float  # standard error of that mean, tokens taken as independent (llama.cpp's ±)
    top1_changed_pct: float  # % of scored tokens whose most likely next token is not the baseline's
    top_k: int  # baseline log-probs kept per token; the rest of its mass is one tail bucket
    baseline: str  # the baseline's top-k folder name: "<its state key>.top<k>"


@dataclass
class PerplexityResult:
    perplexity: float
    nll_mean: float
    scored_tokens: int
    windows: int
    protocol: dict[str, Any]
    kl: KlResult | None = None  # with ``kl_base``: divergence from that baseline
    # windows taken from a saved state instead of being recomputed (not part of the result)
    reused_windows: int = field(default=0, compare=False)
    # with ``top_k``: the folder of this model's top-k log-probs, the ``kl_base`` of later runs
    top_k_path: str | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def exp_nll(nll: float) -> float:
    """exp(mean NLL), the perplexity: inf past float's range (a mean NLL over ~709.8 nats, a
    broken model's, raised OverflowError and lost a whole ``compress run``)."""
    return math.exp(nll) if nll < math.log(torch.finfo(torch.float64).max) else math.inf


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


# config entries that name where or by what a model was written, not what it computes
_CONFIG_PROVENANCE = ("_name_or_path", "transformers_version", "_commit_hash")


def _digest_config(model: nn.Module, digest: Any) -> None:
    """Feed the model's config into ``digest``: the same weights under another config (experts
    per token, a RoPE base, a window, an eps) compute other numbers, so their saved
    perplexities must not be reused for each other."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return
    settings = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_PROVENANCE}
    try:
        text = json.dumps(settings, sort_keys=True, default=str)
    except TypeError:  # keys of mixed types in one mapping cannot be sorted: in given order
        text = json.dumps(settings, default=str)
    digest.update(text.encode())


def _digest_files(folder: Path, digest: Any) -> None:
    """Feed a checkpoint folder's safetensors files into ``digest`` without reading their
    weights (a 13B model is 26 GB): each shard's name, size, modification time and header (every
    tensor's name, dtype, shape and offsets). A rewritten shard changes its time."""
    from compress.io.checkpoint import read_header, shard_files

    for file in shard_files(folder):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        digest.update(json.dumps(read_header(file)[1], sort_keys=True).encode())


def state_key(model: nn.Module, ids: torch.Tensor, context_length: int, stride: int,
              stream: Any = None, device: torch.device | None = None) -> str:
    """What a saved perplexity state depends on: weights, config, token ids, windows, device,
    versions.
    A model scored layer by layer (``stream``, on ``device``: None is the CPU) is known by its
    checkpoint files, not its tensors (``_digest_files``)."""
    import transformers

    digest = hashlib.sha256()
    if stream is None:
        device = next(model.parameters()).device
    device = device or torch.device("cpu")
    settings = (_STATE_VERSION, context_length, stride, device.type, torch.__version__,
                transformers.__version__, "layer by layer" if stream is not None else "whole")
    digest.update(repr(settings).encode())
    digest.update(ids.numpy().tobytes())
    _digest_config(model, digest)
    if stream is not None:
        _digest_files(stream.reader.path, digest)
        for name, module in model.named_modules():
            backend = getattr(module, "backend", None)
            if isinstance(backend, str):
                digest.update(f"{name}:backend={backend}".encode())
    else:
        _digest_model(model, digest)
    return digest.hexdigest()[:32]


def _read_state(path: Path, key: str) -> dict[str, Any]:
    """The saved state at ``path`` when it belongs to ``key``, else {} (start over)."""
    try:
        state = json.loads(path.read_text())
        state["window_nll"] = [float(x) for x in state["window_nll"]]
        state["window_tokens"] = [int(x) for x in state["window_tokens"]]
        for kl in state.get("kl", {}).values():  # saved KL sums: see _attach_kl_base
            for name in ("window_kl", "window_kl_sq", "window_changed"):
                kl[name] = [float(x) for x in kl.get(name, [])]
        _check_state_values(state)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        log.warning("ignoring unreadable perplexity state %s (%s); starting over", path, exc)
        return {}
    if state.get("key") != key or len(state["window_nll"]) != len(state["window_tokens"]):
        return {}
    return state


def _check_state_values(state: dict[str, Any]) -> None:
    """ValueError unless the saved numbers are ones a scoring could have written: a NaN, a
    negative NLL or an empty window (a damaged or hand-edited file) would otherwise be resumed
    into the reported perplexity."""
    if not all(math.isfinite(x) and x >= 0 for x in state["window_nll"]):
        raise ValueError("a window's NLL is NaN, infinite or negative")
    if not all(n > 0 for n in state["window_tokens"]):
        raise ValueError("a window scores no tokens")
    for kl in state.get("kl", {}).values():
        if not all(math.isfinite(x) for name in ("window_kl", "window_kl_sq", "window_changed")
                   for x in kl[name]):
            raise ValueError("a window's KL is NaN or infinite")


def _write_state(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record))  # json writes floats with repr: they read back exactly
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache, or something else in the file's place
        if tmp.is_file():
            tmp.unlink()
        raise OutputError(
            f"cannot save evaluation state {path} ({exc}); make that folder writable, or set "
            "COMPRESS_CACHE_DIR to a writable one"
        ) from exc


def top_k_log_probs(
    logits: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, V] logits -> (ids [T, k] int64 by falling probability, their log-probs [T, k] float32,
    log of the probability outside them [T] float32; -inf when k = V)."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    values, ids = log_p.topk(min(k, log_p.shape[-1]), dim=-1)
    return ids, values, _log_mass_outside(log_p, ids)


def _log_mass_outside(log_p: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    # logsumexp over the rest rather than log(1 - sum): exact when the top-k hold ~all the mass.
    # In place: log_p is a temporary of the caller, and a second [T, V] copy is ~100 MB/window.
    return log_p.scatter_(-1, ids, float("-inf")).logsumexp(dim=-1)


def kl_from_top_k(
    ids: torch.Tensor, log_p: torch.Tensor, log_p_tail: torch.Tensor, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token KL(p || q) [T] float64 of a model with ``logits`` [T, V] (q) from a baseline's
    ``top_k_log_probs`` (p), the tail bucket included, and whether q's most likely token is not
    p's [T] bool (a tie with p's top token does not count as a change)."""
    log_q = torch.log_softmax(logits.float(), dim=-1)
    log_q_k = log_q.gather(-1, ids)
    changed = log_q_k[:, 0] < log_q.max(dim=-1).values
    log_q_tail = _log_mass_outside(log_q, ids)
    lp = torch.cat([log_p, log_p_tail[:, None]], dim=-1).double()  # [T, k + 1]
    lq = torch.cat([log_q_k, log_q_tail[:, None]], dim=-1).double()
    p = lp.exp()
    # 0 log 0 = 0: the empty tail at k = V (its -inf - -inf would be nan)
    kl = torch.where(p > 0, p * (lp - lq), torch.zeros_like(p)).sum(dim=-1)
    return kl, changed


def _windows_digest(ids: torch.Tensor, context_length: int, stride: int) -> str:
    """What the windows depend on (not the weights): a variant checks it against its baseline."""
    digest = hashlib.sha256(repr((context_length, stride)).encode())
    digest.update(ids.numpy().tobytes())
    return digest.hexdigest()[:32]


def _window_file(folder: Path, index: int) -> Path:
    return folder / f"{index:05d}.npz"


def _save_top_k(folder: Path, index: int, preds: torch.Tensor, k: int, meta: dict) -> None:
    """Window ``index``'s top-k of ``preds`` [T, V] into ``folder`` (atomically), and the
    folder's meta.json with the first window."""
    ids, log_p, log_tail = top_k_log_probs(preds, k)
    vocab = preds.shape[-1]
    if not (folder / "meta.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        _write_state(folder / "meta.json", {**meta, "top_k": ids.shape[-1], "vocab_size": vocab})
    # ids: 2 bytes while the vocabulary fits (SmolLM2's 49,152 does), else 4
    id_dtype = np.uint16 if vocab <= 2**16 else np.int32
    path = _window_file(folder, index)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        np.savez(f, ids=ids.cpu().numpy().astype(id_dtype), log_probs=log_p.cpu().numpy(),
                 log_tail=log_tail.cpu().numpy())
    os.replace(tmp, path)


def _load_top_k(folder: Path, index: int, device: torch.device,
                tokens: int) -> tuple[torch.Tensor, ...]:
    """Window ``index``'s stored (ids, log-probs, log of the rest) for ``tokens`` scored
    tokens; a damaged file (a cache on disk: cut short, edited) is a DataError naming it, not
    a KL computed from garbage."""
    file = _window_file(folder, index)
    try:
        with np.load(file) as f:
            ids, log_p, log_tail = f["ids"].astype(np.int64), f["log_probs"], f["log_tail"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        problem = str(exc)
    else:
        problem = None
        if ids.ndim != 2 or log_p.shape != ids.shape or log_tail.shape != (ids.shape[0],) \
                or ids.shape[0] != tokens:
            problem = f"arrays of shapes {ids.shape}, {log_p.shape}, {log_tail.shape}"
        # -inf is a log-prob (a token a model rules out; the tail when k = V), NaN and +inf not
        elif np.isnan(log_p).any() or np.isnan(log_tail).any() or (log_p == np.inf).any():
            problem = "log-probs that are NaN or +inf"
    if problem is not None:
        raise DataError(f"{file}: the baseline's stored top-k log-probs are damaged ({problem}); "
                        f"delete {folder} and run again (the baseline is scored anew)")
    return (torch.from_numpy(ids).to(device), torch.from_numpy(log_p).to(device),
            torch.from_numpy(log_tail).to(device))


def _read_kl_base(folder: Path, windows_digest: str, spans: list, first: int) -> dict[str, Any]:
    """The baseline's meta.json, after checking that it scored these windows and holds every
    window from ``first`` on (before any forward)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if not isinstance(meta, dict):
            raise ValueError(f"meta.json holds a JSON {type(meta).__name__}")
    except (OSError, ValueError, RecursionError) as exc:
        # DataError: the CLI reports it in one line (a damaged cache entry is a user's to clear)
        raise DataError(f"kl_base {folder}: not a baseline top-k folder ({exc}); evaluate the "
                        "baseline with top_k first (a damaged cache entry: delete the folder "
                        "and run again)") from None
    if meta.get("windows_digest") != windows_digest:
        raise ValueError(
            f"kl_base {folder}: the baseline was scored on another text or other windows "
            f"(context {meta.get('context_length')}, stride {meta.get('stride')}); evaluate the "
            "baseline and the variant with the same text, context length and stride")
    missing = [i for i in range(first, len(spans)) if not _window_file(folder, i).exists()]
    if missing:
        raise ValueError(
            f"kl_base {folder}: the baseline's top-k log-probs lack {len(missing)} of the "
            f"{len(spans)} windows (first missing: {missing[0]}); evaluate the baseline on at "
            "least as many windows (the same limit / --full-eval) before the variant")
    return meta


@dataclass
class _Scores:
    """Per-window sums, each list a prefix of the windows (the resumable state), and what to do
    besides the NLL: write the top-k (``top_k_folder``), compare with a baseline's
    (``kl_folder``)."""

    nll: list[float]
    tokens: list[int]
    top_k: int = 0
    top_k_folder: Path | None = None
    top_k_meta: dict[str, Any] = field(default_factory=dict)
    kl_folder: Path | None = None
    kl_vocab: int = 0
    kl_top_k: int = 0
    kl: list[float] = field(default_factory=list)  # summed KL per window
    kl_sq: list[float] = field(default_factory=list)  # summed squared KL (for the stderr)
    changed: list[int] = field(default_factory=list)  # tokens whose top-1 changed

    def needs(self, index: int) -> bool:
        return (index >= len(self.nll)
                or (self.kl_folder is not None and index >= len(self.kl))
                or (self.top_k_folder is not None
                    and not _window_file(self.top_k_folder, index).exists()))

    def add(self, index: int, preds: torch.Tensor, targets: torch.Tensor) -> None:
        """Score window ``index``: ``preds`` [T, V] float32 logits for ``targets`` [T]."""
        if self.top_k_folder is not None:
            _save_top_k(self.top_k_folder, index, preds, self.top_k, self.top_k_meta)
        if self.kl_folder is not None and index == len(self.kl):
            if preds.shape[-1] != self.kl_vocab:
                raise ValueError(f"kl_base {self.kl_folder}: the baseline's vocabulary has "
                                 f"{self.kl_vocab} tokens, this model's {preds.shape[-1]}")
            base = _load_top_k(self.kl_folder, index, preds.device, targets.numel())
            kl, changed = kl_from_top_k(*base, preds)
            self.changed.append(int(changed.sum()))
            self.kl_sq.append(float(kl.square().sum()))
            self.kl.append(float(kl.sum()))  # last: a window counts once its KL is stored
        if index == len(self.nll):
            value = float(torch.nn.functional.cross_entropy(preds, targets, reduction="sum"))
            if not math.isfinite(value):  # a NaN perplexity would be a number that means nothing
                raise NumericsError(
                    f"window {index}: the model's loss is {value} (its logits hold NaN or Inf), "
                    "so there is no perplexity to report; the checkpoint's weights or scales are "
                    "corrupt, or the model overflowed in this dtype (try float32)"
                )
            self.tokens.append(targets.numel())
            self.nll.append(value)  # last: a window counts once its NLL is stored

    def trim(self) -> None:
        """Drop the half-stored window of an interruption between two appends."""
        del self.tokens[len(self.nll) :]
        del self.changed[len(self.kl) :], self.kl_sq[len(self.kl) :]


WINDOWS_PER_FORWARD = 4  # 512-token windows: 0.67 vs 0.90 s each on 2 Xeon cores (SmolLM2)


def _batches(todo: list[int], spans: list) -> list[list[int]]:
    """The forwards that score ``todo``: windows grouped by ``index // WINDOWS_PER_FORWARD``
    and length, each group whole, finished windows included. A window is therefore always
    computed beside the same neighbours, so a resumed evaluation reproduces a fresh one bit for
    bit (``_Scores.add`` skips what is already stored)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for index, (begin, end, _) in enumerate(spans):
        groups.setdefault((index // WINDOWS_PER_FORWARD, end - begin), []).append(index)
    wanted = set(todo)
    return [group for group in groups.values() if wanted.intersection(group)]


@contextlib.contextmanager
def _saving_on_interrupt(scores: _Scores, save, bar):
    """On an interruption (Ctrl-C included) drop the half-stored window and save the rest, so
    the same call resumes after it; close the progress bar in any case."""
    try:
        yield
    except BaseException:
        scores.trim()
        save(True)
        raise
    finally:
        bar.close()


def _add_batch(scores: _Scores, spans: list, batch: list[int], windows: torch.Tensor,
               logits: torch.Tensor) -> None:
    """Score each window of a forward batch: its scored tokens against the logits before them
    (logits at position t predict token t+1)."""
    for row, index in enumerate(batch):
        begin, end, first_scored = spans[index]
        targets = windows[row, first_scored - begin :]
        preds = logits[row, first_scored - begin - 1 : end - begin - 1].float()
        scores.add(index, preds, targets)


@torch.no_grad()
def _score_windows(model, ids, spans, scores: _Scores, save, *, desc: str, progress: bool) -> None:
    """Score every window that ``scores`` still needs, in order; ``save()`` is called at its own
    pace after each window and once more on an interruption."""
    device = next(model.parameters()).device
    todo = [i for i in range(len(spans)) if scores.needs(i)]
    bar = tqdm(total=len(spans), initial=len(spans) - len(todo), desc=desc, disable=not progress)
    wanted = set(todo)
    with _saving_on_interrupt(scores, save, bar):
        for batch in _batches(todo, spans):
            windows = torch.stack([ids[spans[i][0] : spans[i][1]] for i in batch]).to(device)
            logits = model(windows).logits  # [B, T, V]
            _add_batch(scores, spans, batch, windows, logits)
            bar.update(len(wanted.intersection(batch)))
            del logits
            save(False)


@torch.no_grad()
def _score_windows_layerwise(stream, ids, spans, scores: _Scores, save, *, desc: str,
                             progress: bool, device: torch.device | None = None) -> None:
    """``_score_windows`` for a model whose decoder layers stay on disk (``stream``, a
    ``compress.io.stream.StreamedModel`` without a sink): every forward batch of
    ``_batches`` through layer i, then layer i+1, each layer read, run and freed in turn;
    then the model's own forward from the final norm on (norm, head, any logit scaling), with
    the decoder stack replaced by the stored last hidden states. The batches and the ops are
    the whole-model forward's, so the numbers are its numbers. Memory: one layer plus the
    hidden states of the windows scored (windows x context x hidden x 4 bytes, twice while a
    layer runs). Quantized weight-only layers are scored dequantized, one layer at a time.
    ``device`` (None: the CPU): where each layer, the modules outside the stack and the hidden
    states go, cast as whole-model evaluation casts there (``eval_dtype``: bf16 on a GPU), so
    the numbers are those of the whole model on that device; host memory stays one layer."""
    from compress.arch import decoder_layers
    from compress.core.device import eval_dtype, on_device
    from compress.quant.calibrated import capture_first_layer_inputs, run_layer
    from compress.quant.linear import dequantized_for_scoring

    device = device or torch.device("cpu")
    dtype = eval_dtype(device)
    model = stream.model
    todo = [i for i in range(len(spans)) if scores.needs(i)]
    groups = _hidden_groups(_batches(todo, spans), spans, int(model.config.hidden_size))
    layers = decoder_layers(model, "layer-by-layer scoring")
    bar = tqdm(total=len(groups) * (len(layers) + 1), desc=f"{desc}, layer by layer",
               disable=not progress)
    with _saving_on_interrupt(scores, save, bar):
        for batches in groups:
            windows = [torch.stack([ids[spans[i][0] : spans[i][1]] for i in batch])
                       for batch in batches]
            with stream.outside(device), on_device(model, device, dtype, skip=[layers]):
                inputs = capture_first_layer_inputs(model, windows, device)
            for index in range(len(layers)):
                layer = stream.load_layer(index)  # on the host, then a copy on the device
                inputs.kwargs = inputs.per_layer[index]
                with on_device(layer, device, dtype), dequantized_for_scoring(layer):
                    inputs.hidden = run_layer(layer, inputs, check=f"decoder layer {index}")
                stream.finish_layer(index)
                bar.update(1)
            with stream.outside(device, head=True), contextlib.ExitStack() as placed:
                placed.enter_context(on_device(model, device, dtype, skip=[layers]))
                for _, module in stream.outside_modules():  # a quantized head, scored as such
                    placed.enter_context(dequantized_for_scoring(module))
                for batch, batch_ids, hidden in zip(batches, windows, inputs.hidden, strict=True):
                    batch_ids = batch_ids.to(device)
                    logits = _logits_from_last_hidden(model, layers, batch_ids, hidden)
                    _add_batch(scores, spans, batch, batch_ids, logits)
                    del logits
            del inputs
            save(True)  # a group is the unit a cut run resumes after
            bar.update(1)


def layerwise_placement(stream, device: torch.device) -> dict[str, str]:
    """What a result scored layer by layer on ``device`` records: where, in what dtype."""
    from compress.core.device import device_name, dtype_name, eval_dtype

    dtype = eval_dtype(device) or stream.dtype
    return {"device": device_name(device), "dtype": dtype_name(dtype), "scored": "layer by layer"}


# Hidden states held while scoring layer by layer (entering and leaving a layer, float32):
# windows beyond this are scored in further groups, each reading the checkpoint again.
LAYERWISE_HIDDEN_BYTES = 1 << 30


def _hidden_groups(batches: list[list[int]], spans: list, hidden: int) -> list[list[list[int]]]:
    """``batches`` in consecutive groups whose hidden states (in and out of a layer, float32)
    stay within ``LAYERWISE_HIDDEN_BYTES``, at least one batch each."""
    groups: list[list[list[int]]] = []
    held = 0
    for batch in batches:
        need = 2 * FLOAT32_BYTES * hidden * sum(spans[i][1] - spans[i][0] for i in batch)
        if not groups or held + need > LAYERWISE_HIDDEN_BYTES:
            groups.append([])
            held = 0
        groups[-1].append(batch)
        held += need
    return groups


FLOAT32_BYTES = 4


def _logits_from_last_hidden(model: nn.Module, layers: nn.ModuleList, batch_ids: torch.Tensor,
                             hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits for ``batch_ids`` whose last decoder layer output ``hidden``: its own
    forward with the stack replaced (``stack_returning``)."""
    from compress.quant.calibrated import stack_returning

    with stack_returning(layers, hidden):
        return model(batch_ids, use_cache=False).logits


def _attach_kl_base(scores: _Scores, folder: Path, saved: dict[str, Any], digest: str,
                    spans: list) -> None:
    """Make ``scores`` compare with the baseline in ``folder``, resuming the KL sums ``saved``
    in this model's state (kept only when the three lists agree)."""
    kl, kl_sq, changed = (saved.get(k, []) for k in ("window_kl", "window_kl_sq",
                                                      "window_changed"))
    if len(kl) == len(kl_sq) == len(changed):
        scores.kl, scores.kl_sq = [float(x) for x in kl], [float(x) for x in kl_sq]
        scores.changed = [int(x) for x in changed]
    meta = _read_kl_base(folder, digest, spans, len(scores.kl))
    scores.kl_folder, scores.kl_vocab, scores.kl_top_k = folder, meta["vocab_size"], meta["top_k"]


def _kl_result(scores: _Scores, n_windows: int, n_tokens: int, name: str) -> KlResult:
    total, total_sq, changed = 0.0, 0.0, 0
    for kl, kl_sq, count in zip(scores.kl[:n_windows], scores.kl_sq[:n_windows],
                                scores.changed[:n_windows], strict=True):
        total, total_sq, changed = total + kl, total_sq + kl_sq, changed + count
    mean = total / n_tokens
    variance = max(total_sq / n_tokens - mean * mean, 0.0) * n_tokens / max(n_tokens - 1, 1)
    return KlResult(mean, math.sqrt(variance / n_tokens), 100 * changed / n_tokens,
                    scores.kl_top_k, name)


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
    top_k: int | None = None,
    top_k_dir: str | os.PathLike[str] | None = None,
    kl_base: str | os.PathLike[str] | None = None,
    stream: Any = None,
    device: torch.device | None = None,
) -> PerplexityResult:
    """Token perplexity of ``model`` on ``text`` under the protocol in the module docstring.

    label: the progress bar's name (e.g. "baseline perplexity"); the bar adds the file name and
    the window count. state_dir: where the resumable per-window state is kept (see the module
    docstring); None keeps nothing. resume=False ignores (and then overwrites) a saved state.
    top_k: also write this model's top-k log-probs per window into ``<top_k_dir>/<key>.top<k>``
    (``result.top_k_path``), to serve as a later run's ``kl_base``. kl_base: such a folder of a
    baseline scored on the same text and windows: the result gets ``kl``. stream: score layer
    by layer (``_score_windows_layerwise``): ``model`` is then ``stream.model``, a skeleton
    whose layers ``stream`` (a ``compress.io.stream.StreamedModel`` without a sink) reads in
    turn; the numbers are the whole-model path's. device: where layer-by-layer scoring runs
    (None: the CPU; the whole-model path runs where ``model`` is).
    """
    stride = context_length if stride is None else stride
    if context_length < 2 or not 1 <= stride <= context_length or (limit is not None
                                                                   and limit < 1):
        raise ValueError(f"context_length={context_length} must be >= 2, stride={stride} in "
                         f"1..context_length (more would skip tokens), limit={limit} >= 1")
    if top_k is not None and (top_k < 1 or top_k_dir is None):
        raise ValueError(f"top_k={top_k} must be >= 1 and needs top_k_dir (written to disk)")
    check_positions(getattr(model, "config", None), context_length, "context_length")
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    all_spans = window_spans(len(ids), context_length, stride)
    spans = all_spans[:limit] if limit is not None else all_spans
    if not spans:
        raise DataError(f"{source}: text too short to score ({len(ids)} tokens); give a "
                        "longer text")
    key = (state_key(model, ids, context_length, stride, stream, device)
           if state_dir or top_k else None)
    path = Path(state_dir) / f"{key}.json" if state_dir is not None else None
    state = _read_state(path, key) if path is not None and resume else {}
    scores = _Scores(state.get("window_nll", []), state.get("window_tokens", []))
    digest = _windows_digest(ids, context_length, stride)
    if top_k is not None:
        scores.top_k, scores.top_k_folder = top_k, Path(top_k_dir) / f"{key}.top{top_k}"
        scores.top_k_meta = {"key": key, "windows_digest": digest, "source": source,
                             "context_length": context_length, "stride": stride}
    kl_name = None
    if kl_base is not None:
        kl_name = Path(kl_base).name
        _attach_kl_base(scores, Path(kl_base), state.get("kl", {}).get(kl_name, {}), digest, spans)
    record = {**state, "key": key, "source": source, "context_length": context_length,
              "stride": stride, "windows_in_text": len(all_spans),
              "window_nll": scores.nll, "window_tokens": scores.tokens}
    if kl_name is not None:  # other baselines' KL sums in this state are kept
        record["kl"] = {**state.get("kl", {}), kl_name: {
            "window_kl": scores.kl, "window_kl_sq": scores.kl_sq, "window_changed": scores.changed}}
    reused = sum(not scores.needs(i) for i in range(len(spans)))
    _run_windows(model, ids, spans, scores, path, record, reused, label=label, source=source,
                 progress=progress, save_every_s=save_every_s, context_length=context_length,
                 stream=stream, device=device)
    result = _result(scores, spans, all_spans, ids, limit, source, context_length, stride)
    result.reused_windows = reused
    if kl_base is not None:
        result.kl = _kl_result(scores, len(spans), result.scored_tokens, kl_name)
    if top_k is not None:
        result.top_k_path = str(scores.top_k_folder)
    return result


def _run_windows(model, ids, spans, scores, path, record, reused, *, label, source, progress,
                 save_every_s, context_length, stream=None, device=None) -> None:
    """Score what is missing, saving ``record`` at ``path`` (when not None) as it goes."""
    if reused == len(spans):
        log.info("%s: all %d windows already scored, result read from %s", label, reused, path)
        return
    if reused:
        log.info("%s: resuming after window %d of %d, saved in %s", label, reused, len(spans),
                 path)
    last_save = [time.monotonic()]

    def save(now: bool) -> None:
        if path is not None and (now or time.monotonic() - last_save[0] >= save_every_s):
            _write_state(path, record)
            last_save[0] = time.monotonic()

    name = Path(source).name or source
    desc = f"{label} ({name}, {len(spans)} windows of {context_length})"
    if stream is not None:
        _score_windows_layerwise(stream, ids, spans, scores, save, progress=progress, desc=desc,
                                 device=device)
    else:
        _score_windows(model, ids, spans, scores, save, progress=progress, desc=desc)
    save(True)


def _result(scores, spans, all_spans, ids, limit, source, context_length, stride):
    total_nll, total_tokens = 0.0, 0
    # summed in window order, as a fresh run sums them
    for value, count in zip(scores.nll[: len(spans)], scores.tokens[: len(spans)], strict=True):
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
    return PerplexityResult(exp_nll(nll_mean), nll_mean, total_tokens, len(spans), protocol)
