"""compress: make causal language models cheaper to serve.

Public API: ``load`` (a model or compressed checkpoint, ready to serve with our backends),
``load_recipe`` / ``parse_recipe`` / ``Recipe``, ``run_passes`` and ``run_job``. Importing this
package registers every pass (explicitly, below); it does no other work.
"""

from __future__ import annotations

from compress import (  # noqa: F401  (calibrated quantize.* passes)
    awq,
    bnb,  # noqa: F401  (quantize.bnb; imports bitsandbytes only when run)
    distill,  # noqa: F401  (registers distill.* passes)
    gptq,
    prune,  # noqa: F401  (registers prune.* passes)
    quantize,  # noqa: F401  (registers quantize.* passes)
    smoothquant,
)
from compress.core import (
    PASSES,
    CompressionState,
    PassConfig,
    PassReport,
    register_pass,
    run_passes,
)
from compress.errors import (
    ConfigError,
    DataError,
    KernelConstraintError,
    ModelLoadError,
    OutputError,
    RecipeError,
)
from compress.models import LoadedModel, load_model
from compress.recipe import Recipe, load_recipe, parse_recipe

__version__ = "0.1.0"


def load(path: str = "smollm2-135m", *, backend: str = "auto", **kwargs) -> LoadedModel:
    """Load a model or an exported compressed checkpoint for serving (``.model``, ``.tokenizer``,
    ``.generate(...)``); ``backend`` picks the quantized kernels (auto|reference|cpu|triton)."""
    return load_model(path, backend=backend, **kwargs)


def run_job(*args, **kwargs):
    """See ``compress.job.run_job``."""
    from compress.job import run_job as _run_job

    return _run_job(*args, **kwargs)


__all__ = [
    "PASSES",
    "CompressionState",
    "ConfigError",
    "DataError",
    "KernelConstraintError",
    "LoadedModel",
    "ModelLoadError",
    "OutputError",
    "PassConfig",
    "PassReport",
    "Recipe",
    "RecipeError",
    "load",
    "load_model",
    "load_recipe",
    "parse_recipe",
    "register_pass",
    "run_job",
    "run_passes",
]
