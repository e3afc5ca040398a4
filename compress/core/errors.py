"""Exception types users see.

Every message names what is wrong, where (file, pass index, layer) and how to fix it.
``KernelConstraintError`` is defined beside the kernels (which may not import this package) and
re-exported here.
"""

from __future__ import annotations

from compress.kernels import KernelConstraintError

__all__ = [
    "ConfigError",
    "DataError",
    "KernelConstraintError",
    "ModelLoadError",
    "NumericsError",
    "OutputError",
    "RecipeError",
]


class RecipeError(ValueError):
    """A recipe (file, dict or overrides) is invalid; the message lists every problem found."""


class ConfigError(RecipeError):
    """A single pass or section config has a bad value."""


class ModelLoadError(ValueError):
    """A model or checkpoint cannot be loaded (missing path, corrupt file, unsupported layout)."""


class DataError(ValueError):
    """Evaluation or calibration data is missing or too short."""


class OutputError(ValueError):
    """An output folder cannot or may not be written (see ``compress.output_dir``)."""


class NumericsError(ValueError):
    """A model computed NaN or Inf where numbers were needed (logits to decode from)."""
