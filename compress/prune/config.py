"""The structured-pruning pass configs: what to remove (``sparsity``), an explicit size, or a
total parameter budget (``target_params``, e.g. ``90M``), and the importance measure.
"""

from __future__ import annotations

import math
import re
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from compress.core.registry import PassConfig

Importance = Literal["activation", "magnitude"]


def parse_param_count(value: int | float | str) -> int:
    """``90M``, ``1.5B``, ``120000`` -> an int number of parameters; ValueError otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"target_params={value!r} is not a count; write e.g. 90M or 1.2B")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"target_params={value!r} is not a count; write e.g. 90M or 1.2B")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbB]?)\s*", value)
    if not match:
        raise ValueError(
            f"target_params={value!r} is not a count; write e.g. 90M, 1.2B or 90000000"
        )
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


class PruneConfig(PassConfig):
    """Shared fields. Give exactly one target: sparsity (fraction of units removed, 0 < s < 1),
    the explicit size field of the pass, or target_params (total parameters after this pass)."""

    importance: Importance = "activation"
    sparsity: float | None = None
    target_params: int | None = None

    @field_validator("sparsity")
    @classmethod
    def _sparsity(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value < 1.0:
            raise ValueError(f"sparsity={value} must be in (0, 1): the fraction of units removed")
        return value

    @field_validator("target_params", mode="before")
    @classmethod
    def _params(cls, value: int | float | str | None) -> int | None:
        if value is None:
            return None
        count = parse_param_count(value)
        if count <= 0:
            raise ValueError(f"target_params={value!r} must be positive")
        return count

    @model_validator(mode="after")
    def _one_target(self):
        size_field = self.size_field
        given = [
            f for f in ("sparsity", size_field, "target_params") if getattr(self, f) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of sparsity, {size_field}, target_params (got "
                f"{', '.join(given) or 'none'})"
            )
        return self

    # Name of the explicit-size field of each subclass (num_attention_heads, intermediate_size...).
    size_field: ClassVar[str] = ""


class AttentionHeadsConfig(PruneConfig):
    """mode kv_groups: remove whole KV groups with their query heads; query_heads: remove the same
    number of query heads inside every KV group (KV heads stay). num_attention_heads: the
    query-head count to keep; it must be a multiple of the group size (kv_groups) or of the KV
    head count (query_heads)."""

    mode: Literal["kv_groups", "query_heads"] = "kv_groups"
    num_attention_heads: int | None = Field(None, ge=1)

    size_field: ClassVar[str] = "num_attention_heads"


class MlpChannelsConfig(PruneConfig):
    """intermediate_size: channels kept per layer; multiple_of: round kept counts to this
    (e.g. 64 or 128 so int4 group sizes still divide the down projection's in_features)."""

    intermediate_size: int | None = Field(None, ge=1)
    multiple_of: int = Field(1, ge=1)

    size_field: ClassVar[str] = "intermediate_size"


class HiddenSizeConfig(PruneConfig):
    """hidden_size: embedding/residual channels kept (head_dim is unchanged); multiple_of as for
    MLP channels (64 keeps int4 g64 possible on every projection)."""

    hidden_size: int | None = Field(None, ge=1)
    multiple_of: int = Field(1, ge=1)

    size_field: ClassVar[str] = "hidden_size"


class LayersConfig(PruneConfig):
    """num_layers: decoder layers kept. Activation importance = block influence (ShortGPT);
    magnitude = Frobenius norm of the weights that write to the residual (attention output and
    MLP down projections)."""

    num_layers: int | None = Field(None, ge=1)

    size_field: ClassVar[str] = "num_layers"
