"""``KernelConstraintError``: a tensor does not meet a kernel's constraints.

Its own module so that every kernel module and the backend choice (``dispatch``) can raise it
without importing each other (``compress.core.errors`` re-exports it for users).
"""

from __future__ import annotations


class KernelConstraintError(ValueError):
    """A tensor does not meet a kernel's constraints; the message carries the shapes."""
