"""compress: make causal language models cheaper to serve.

Public API: ``load`` (a model or compressed checkpoint, ready to serve with our backends),
``load_recipe`` / ``parse_recipe`` / ``Recipe``, ``run_passes`` and ``run_job``, the pass
registry (``PASSES``, ``register_pass``) and the error types.

Importing this package does no work and imports no submodule: each public name is imported on
first use (module-level ``__getattr__``), so ``import compress.kernels`` or ``compress.core.errors``
does not import the passes. The passes register themselves when ``compress.recipe`` is imported
(it imports each pass module explicitly), which every way to name a pass goes through:
``parse_recipe`` / ``load_recipe`` / ``Recipe``, ``run_job``, the CLI and ``compress.PASSES``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it, imported on first access
_LAZY = {
    "PASSES": "compress.recipe",  # defined in compress.core; full once compress.recipe is imported
    "CompressionState": "compress.core",
    "PassConfig": "compress.core",
    "PassReport": "compress.core",
    "register_pass": "compress.core",
    "run_passes": "compress.core",
    "ConfigError": "compress.core.errors",
    "DataError": "compress.core.errors",
    "KernelConstraintError": "compress.core.errors",
    "ModelLoadError": "compress.core.errors",
    "OutputError": "compress.core.errors",
    "RecipeError": "compress.core.errors",
    "LoadedModel": "compress.io.load",
    "load_model": "compress.io.load",
    "Recipe": "compress.recipe",
    "load_recipe": "compress.recipe",
    "parse_recipe": "compress.recipe",
    "run_job": "compress.pipeline.job",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'compress' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load(path: str = "smollm2-135m", *, backend: str = "auto", **kwargs: Any) -> Any:
    """Load a model or an exported compressed checkpoint for serving (``.model``, ``.tokenizer``,
    ``.generate(...)``); ``backend`` picks the quantized kernels (auto|reference|cpu|triton).
    Returns a ``compress.io.load.LoadedModel``."""
    from compress.io.load import load_model

    return load_model(path, backend=backend, **kwargs)


__all__ = ["load", *_LAZY]
