"""Where the local datasets live, and reading text from them.

The data folder (WikiText-2, LAMBADA, PIQA, ARC-Easy, BoolQ, lm-eval task configs, training
text) is never copied into the repo. Its location is, in order: an explicit argument, the
``COMPRESS_DATA_DIR`` environment variable, ``../shared/data`` relative to the current
directory, then relative to this source checkout.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from compress.core.errors import DataError

WIKITEXT2 = {
    "wikitext2": "wikitext-2-raw/wiki.test.raw",
    "wikitext2-test": "wikitext-2-raw/wiki.test.raw",
    "wikitext2-valid": "wikitext-2-raw/wiki.valid.raw",
}


def resolve_data_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The data folder; a clear error naming every place looked at if none exists."""
    candidates: list[Path] = []
    if explicit:
        candidates.append(Path(explicit))
    elif os.environ.get("COMPRESS_DATA_DIR"):
        candidates.append(Path(os.environ["COMPRESS_DATA_DIR"]))
    else:
        candidates.append(Path.cwd().parent / "shared" / "data")
        candidates.append(Path(__file__).resolve().parents[2] / "shared" / "data")
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise DataError(
        f"data folder not found (looked in: {looked}). Set COMPRESS_DATA_DIR or pass --data-dir "
        "to the folder that holds wikitext-2-raw/ and train_text/."
    )


def resolve_text_path(name_or_path: str, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """A named dataset (``wikitext2``, ``wikitext2-valid``) or a path (absolute, relative to the
    current directory, or relative to the data folder)."""
    if name_or_path in WIKITEXT2:
        path = resolve_data_dir(data_dir) / WIKITEXT2[name_or_path]
        if not path.is_file():
            raise DataError(
                f"{path} is missing; the data folder must hold {WIKITEXT2[name_or_path]}"
            )
        return path
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if not path.is_absolute():
        try:
            under = resolve_data_dir(data_dir) / path
        except DataError:
            under = None
        if under is not None and under.exists():
            return under
    raise DataError(
        f"text source not found: {name_or_path!r}. Use one of {', '.join(WIKITEXT2)}, "
        "a file path, or a path under the data folder (e.g. train_text/web)."
    )


def read_text(path: Path) -> str:
    """The UTF-8 text of the file ``path`` (an evaluation text), or a DataError naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} cannot be read as UTF-8 text ({exc}); give a .txt file") \
            from exc


def _read_jsonl(lines: list[str]) -> list[str]:
    docs = []
    for line in lines:
        line = line.strip()
        if line:
            record = json.loads(line)
            if isinstance(record, dict) and isinstance(record.get("text"), str):
                docs.append(record["text"])
    return docs


def read_documents(path: Path) -> list[str]:
    """Documents of a .txt (whole file), .jsonl or .json.gz (``text`` fields) file, or of every
    such file under a folder (sorted, so the order is deterministic)."""
    if path.is_dir():
        docs: list[str] = []
        for file in sorted(path.rglob("*")):
            if file.is_file() and file.name.endswith((".txt", ".jsonl", ".json.gz", ".raw")):
                docs.extend(read_documents(file))
        return docs
    if path.name.endswith(".json.gz"):
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            return _read_jsonl(handle.readlines())
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".jsonl":
        return _read_jsonl(text.splitlines())
    return [text]
