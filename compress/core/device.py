"""The compute device, in one place: what a recipe or ``--device`` may name, what it resolves
to, the evaluation dtype that goes with it, and moving a model's tensors there for a block.

``device: auto | cpu | cuda | cuda:N``. ``auto`` is the first GPU when torch sees one, else the
CPU; ``cuda_available`` is the only code that asks ``torch.cuda.is_available()`` (STYLE 1b: the
device is a parameter, never a global), and ``resolve_device`` is called by the orchestration
(``run_job``, the CLI), never on import. A CUDA device on a machine without one is a
``RecipeError`` that names the fix, raised before any work.

``on_device`` swaps a module's tensors for copies on the device (floating parameters cast to a
dtype) for the length of a ``with`` block and puts the original tensor objects back after:
exact (nothing is copied back), and a no-op that touches nothing when the tensors already are
where and what they should be (the CPU path is unchanged, bit for bit).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from compress.core.errors import RecipeError

DEVICE_FORMS = "auto, cpu, cuda or cuda:N (N the GPU index, e.g. cuda:0)"
_SPEC = re.compile(r"auto|cpu|cuda(?::\d+)?")


def cuda_available() -> bool:
    """Whether torch sees a usable GPU: the only place the package asks (``compress.kernels``
    aside, which imports nothing of ours)."""
    return torch.cuda.is_available()


def check_device_spec(value: object) -> str:
    """``value`` itself when it is one of ``DEVICE_FORMS``; ValueError naming it otherwise."""
    if not isinstance(value, str) or not _SPEC.fullmatch(value):
        raise ValueError(f"device={value!r} is not a device: write {DEVICE_FORMS}")
    return value


def resolve_device(spec: str = "auto", *, where: str = "device") -> torch.device:
    """The ``torch.device`` a spec names (``check_device_spec``): ``auto`` is ``cuda:0`` when
    CUDA is available, else ``cpu``. ``where`` names the setting in errors (``--device``,
    ``recipe.yaml: device``). RecipeError for a malformed spec, for CUDA without CUDA and for a
    GPU index the machine does not have."""
    try:
        check_device_spec(spec)
    except ValueError as exc:
        raise RecipeError(f"{where}: {exc}") from None
    if spec == "cpu":
        return torch.device("cpu")
    available = cuda_available()
    if spec == "auto":
        return torch.device("cuda", 0) if available else torch.device("cpu")
    if not available:
        build = (f"this torch {torch.__version__} is built for CUDA {torch.version.cuda} but "
                 "finds no GPU" if torch.version.cuda else
                 f"this torch {torch.__version__} is a CPU-only build")
        raise RecipeError(
            f"{where}: {spec} was asked for, but CUDA is not available ({build}). Fix: use "
            "device: cpu (or auto, which picks the GPU only where there is one), or run on a "
            "machine with a GPU and a CUDA build of torch"
        )
    device = torch.device(spec)
    index = 0 if device.index is None else device.index
    count = torch.cuda.device_count()
    if index >= count:
        raise RecipeError(
            f"{where}: {spec} was asked for, but this machine has {count} GPU(s) "
            f"(cuda:0 to cuda:{count - 1}). Fix: pick one of them, or device: auto"
        )
    return torch.device("cuda", index)


def current_device(device: torch.device):
    """The block in which ``device`` is this process's current CUDA device (nothing to do for
    the CPU or a ``cuda`` without an index). Torch ops run where their tensors are, but Triton
    kernels (our GEMVs and GEMMs, the GPTQ walk) launch on the current device, and CUDA graphs
    capture and replay on its stream: without this, work on ``cuda:1`` would launch on GPU 0
    with pointers into GPU 1."""
    if device.type != "cuda" or device.index is None:
        return contextlib.nullcontext()
    return torch.cuda.device(device.index)


def eval_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype evaluation casts the float weights to: bfloat16 on a GPU (its tensor cores;
    what the models are served in); None on the CPU, where the model keeps its own dtype (the
    numbers the CPU path always gave)."""
    return torch.bfloat16 if device.type == "cuda" else None


def float_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype ``module`` computes in: that of its first floating parameter, or the compute
    dtype of the submodule holding it when that submodule keeps a narrower stored dtype
    (``compute_in``). None when it has no floating parameter."""
    for owner in module.modules():
        for param in owner._parameters.values():
            if param is not None and param.is_floating_point():
                return getattr(owner, _COMPUTE_DTYPE, param.dtype)
    return None


# ---- stored narrow, computed wide ------------------------------------------------------------
# A loaded checkpoint's large dense tensors (embedding, unquantized head) stay in its bf16 and
# are widened only while their module runs: the model never holds their float32 copies.
_COMPUTE_DTYPE = "_compute_dtype"
_WIDENED = "_widened_tensors"


def compute_in(module: nn.Module, dtype: torch.dtype) -> None:
    """Run ``module`` in ``dtype`` while its own floating tensors keep the dtype they are stored
    in. Exact when ``dtype`` is wider (bf16 -> fp32 loses nothing): the outputs are those of
    the module cast to ``dtype`` first. A plain ``nn.Embedding`` casts the rows it looks up
    (the table itself is never widened); any other module gets float copies of its tensors
    for the length of its forward call. ``move_tensors`` with a dtype changes this dtype too
    (a GPU evaluation in bf16). Calling it again only sets the dtype."""
    first = not hasattr(module, _COMPUTE_DTYPE)
    setattr(module, _COMPUTE_DTYPE, dtype)
    if not first:
        return
    if type(module).forward is nn.Embedding.forward:
        module.register_forward_hook(_cast_looked_up_rows)
    else:
        module.register_forward_pre_hook(_widen_tensors)
        module.register_forward_hook(_put_back_tensors, always_call=True)


def _cast_looked_up_rows(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    return output.to(getattr(module, _COMPUTE_DTYPE))


def _widen_tensors(module: nn.Module, args) -> None:
    dtype = getattr(module, _COMPUTE_DTYPE)
    stored = []
    for name, param in list(module._parameters.items()):
        if param is not None and param.is_floating_point() and param.dtype != dtype:
            stored.append((name, param))
            module._parameters[name] = param.detach().to(dtype)  # type: ignore[assignment]
    setattr(module, _WIDENED, stored)


def _put_back_tensors(module: nn.Module, args, output):
    for name, param in getattr(module, _WIDENED, ()):
        module._parameters[name] = param
    setattr(module, _WIDENED, [])
    return output


def place_for_eval(module: nn.Module, device: torch.device) -> dict[str, str | None]:
    """Move ``module`` to ``device`` for good, floating parameters in ``eval_dtype`` (the
    commands that only evaluate or generate: nothing to put back); returns what ``on_eval_device``
    yields. On the CPU nothing moves or changes dtype."""
    move_tensors(module, device, eval_dtype(device))
    dtype = float_dtype(module)
    where = model_device(module)
    return {"device": device_name(where), "dtype": dtype_name(dtype) if dtype else None}


@contextlib.contextmanager
def on_eval_device(
    module: nn.Module, device: torch.device | None
) -> Iterator[dict[str, str | None]]:
    """``module`` where evaluation runs it (``on_device`` with ``eval_dtype``) for the block;
    yields what results record: ``{"device": device_name, "dtype": "bfloat16"}``. ``device``
    None: where the module already is."""
    with on_device(module, device, None if device is None else eval_dtype(device)):
        where = model_device(module)
        dtype = float_dtype(module)
        yield {"device": device_name(where), "dtype": dtype_name(dtype) if dtype else None}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def device_name(device: torch.device) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H200)``: what results and reports say they ran on."""
    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device)})"


def model_device(module: nn.Module) -> torch.device:
    """Where the first non-meta tensor of ``module`` lives (the CPU when it holds none)."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def move_tensor(
    tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None
) -> torch.Tensor:
    """``tensor`` on ``device``; floating tensors cast to ``dtype`` (None: kept), integer ones
    (codes, token ids) keep theirs. The tensor itself when nothing changes."""
    cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    return tensor.to(device=device, dtype=cast)


def move_tensors(
    module: nn.Module, device: torch.device, dtype: torch.dtype | None = None,
    *, skip: Iterable[nn.Module] = (),
) -> list[tuple[nn.Module, str, str, torch.Tensor]]:
    """Replace every tensor of ``module`` (its own and its submodules', except those inside
    ``skip``) that is not on ``device`` or not in ``dtype`` by a copy that is; floating
    parameters are cast to ``dtype`` (None: kept), buffers keep their dtype (rotary tables stay
    float32). Meta tensors are left alone. A tensor shared by several modules (tied weights)
    gets one copy, so ties hold. Returns what was replaced, for ``restore_tensors``. Cached
    kernel layouts (``_prepared`` dicts of quantized layers) belong to the old device: a moved
    module gets an empty one."""
    skipped = {id(m) for s in skip for m in s.modules()}
    copies: dict[int, torch.Tensor] = {}
    replaced: list[tuple[nn.Module, str, str, torch.Tensor]] = []
    for owner in module.modules():
        if id(owner) in skipped:
            continue
        moved_any = False
        for kind, table in (("param", owner._parameters), ("buffer", owner._buffers)):
            for name, tensor in list(table.items()):
                if tensor is None or tensor.device.type == "meta":
                    continue
                want = dtype if kind == "param" else None
                if tensor.device == device and (
                        want is None or not tensor.is_floating_point() or tensor.dtype == want):
                    continue
                if id(tensor) not in copies:
                    new = move_tensor(tensor.detach(), device, want)
                    if kind == "param":
                        new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                    copies[id(tensor)] = new
                table[name] = copies[id(tensor)]
                replaced.append((owner, kind, name, tensor))
                moved_any = True
        compute = getattr(owner, _COMPUTE_DTYPE, None)
        if dtype is not None and compute is not None and compute != dtype:
            replaced.append((owner, "compute", _COMPUTE_DTYPE, compute))  # type: ignore[arg-type]
            setattr(owner, _COMPUTE_DTYPE, dtype)
        prepared = getattr(owner, "_prepared", None)
        if moved_any and isinstance(prepared, dict):
            replaced.append((owner, "prepared", "_prepared", prepared))  # type: ignore[arg-type]
            owner._prepared = {}
    return replaced


def restore_tensors(replaced: list[tuple[nn.Module, str, str, torch.Tensor]]) -> None:
    """Put back the original tensors ``move_tensors`` replaced (exact: the same objects)."""
    for owner, kind, name, tensor in reversed(replaced):
        if kind == "param":
            owner._parameters[name] = tensor  # type: ignore[assignment]
        elif kind == "buffer":
            owner._buffers[name] = tensor
        elif kind == "compute":
            setattr(owner, name, tensor)
        else:
            owner._prepared = tensor


@contextlib.contextmanager
def on_device(
    module: nn.Module, device: torch.device | None, dtype: torch.dtype | None = None,
    *, skip: Iterable[nn.Module] = (),
) -> Iterator[nn.Module]:
    """``module`` with its tensors on ``device`` (floating parameters in ``dtype``) inside the
    block, as it was after (``move_tensors``). ``device`` None: nothing moves. The host copy
    stays alive meanwhile: the device holds a second copy, the host nothing extra."""
    replaced = move_tensors(module, device, dtype, skip=skip) if device is not None else []
    try:
        yield module
    finally:
        restore_tensors(replaced)
