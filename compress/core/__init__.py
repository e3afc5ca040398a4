"""The core every pass and the pipeline share: pass configs and reports, the pass registry keyed
by config type and the runner (``registry``), the one module matcher (``matcher``) and the error
types (``errors``). It imports no pass, no evaluation and no runtime.

The names below are re-exported lazily (module ``__getattr__``) so that
``from compress.core import PassConfig`` reads as the concept, not the file, while importing
``compress.core.errors`` stays light (``compress.arch`` needs the errors, and the registry needs
``compress.arch``). The modules inside import each other directly.
"""

import importlib
from typing import Any

_MATCHER = ("check_pattern", "matches", "set_submodule", "target_modules")
_REGISTRY = (
    "CompressionState",
    "DTYPES",
    "MAX_TOKENS",
    "PASSES",
    "PassConfig",
    "PassReport",
    "PassSpec",
    "StrictConfig",
    "at_most",
    "check_text",
    "get_pass",
    "pass_name_of",
    "raise_or_report_skips",
    "register_pass",
    "run_passes",
)
__all__ = sorted(_MATCHER + _REGISTRY)


def __getattr__(name: str) -> Any:
    if name in _MATCHER:
        module = "compress.core.matcher"
    elif name in _REGISTRY:
        module = "compress.core.registry"
    else:
        raise AttributeError(f"module 'compress.core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
