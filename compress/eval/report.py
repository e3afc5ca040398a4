"""Result tables: markdown, CSV and JSON for baseline-vs-compressed comparisons."""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
              "COMPRESS_CPU_ISA")  # fmt: skip


def environment() -> dict[str, Any]:
    """Machine and versions, recorded in every result file."""
    import torch
    import transformers

    from compress.core.device import cuda_available
    from compress.kernels import cpu_q8, cpuinfo

    flags = cpuinfo.cpu_flags()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpuinfo.cpu_model_name() or platform.processor() or platform.machine(),
        "cpu_flags": [f for f in cpuinfo.KERNEL_FLAGS if f in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "q8_kernel_isa": cpu_q8.planned_isa(),  # our integer-dot kernels' level (cpu_q8)
        "threads": torch.get_num_threads(),
        # switches that cap the ISA of torch, MKL, oneDNN or our kernels (set ones only)
        "isa_limits": {k: os.environ[k] for k in ISA_LIMITS if os.environ.get(k)},
        "cuda": torch.cuda.get_device_name(0) if cuda_available() else None,
    }


def kl_cells(result: Any, baseline: Any) -> dict[str, Any]:
    """The KL cells of a row from ``PerplexityResult``s: ``result.kl``'s, 0 for the baseline
    itself (``result is baseline``), none when the baseline stored no top-k log-probs."""
    if result is None or baseline is None or baseline.top_k_path is None:
        return {}
    if result is baseline:
        return {"kl": 0.0, "kl_stderr": 0.0, "top1_changed_pct": 0.0}
    kl = result.kl
    return {"kl": kl.kl_mean, "kl_stderr": kl.kl_stderr, "top1_changed_pct": kl.top1_changed_pct}


def kl_note(top_k: int) -> str:
    """What the KL and top-1 changed columns measured (a table footnote sentence)."""
    return (
        f"KL: mean per-token KL(baseline ‖ variant) in nats over the same scored tokens, from the "
        f"baseline's top-{top_k} log-probs plus one bucket for the rest of its mass (a lower "
        "bound of the full-vocabulary KL); top-1 changed: share of those tokens whose most "
        "likely next token is not the baseline's."
    )


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        # 4 significant digits, trailing zeros kept (36.00, not 36); no trailing point above 1000
        return f"{value:#.4g}".rstrip(".") if abs(value) < 1e3 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """``columns`` are (key, header) pairs; missing values print as an em dash."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |"]
    lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|")
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(k)) for k, _ in columns) + " |")
    return "\n".join(lines)


def write_results(
    out_dir: Path, stem: str, markdown: str, payload: dict[str, Any], *, overwrite: bool = False
) -> None:
    """``<stem>.md`` and ``<stem>.json`` in ``out_dir``, which must be missing, empty or a
    compress output folder unless ``overwrite`` (see ``compress.output_dir``)."""
    from compress.output_dir import claim_output_dir

    claim_output_dir(out_dir, stem, overwrite=overwrite)
    (out_dir / f"{stem}.md").write_text(markdown + "\n")
    (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    """One row per dict, ``columns`` in order; missing values are empty cells."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in columns})
