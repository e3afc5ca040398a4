"""Output folders: which ones compress may write or replace, and how it marks its own.

compress never deletes data it did not write. Every folder it writes as output (checkpoints,
``results.*``, ``compare.*``) holds a marker file, ``.compress-output``, a small JSON document
(kind, compress version, date). A command writes to a folder only when the folder is missing,
empty or holds that marker; any other non-empty folder is an ``OutputError`` unless the user
passed ``--overwrite``. Even with ``--overwrite``, a folder that is, contains or lies inside a
protected folder (the input model's own folder, the current directory, the home directory) is
refused. Replacing a folder happens in ``atomic_directory``: the new folder is complete before
the old one is removed.

Files are given ordinary permissions (0644, folders 0755) after writing: safetensors and
tempfile create 0600 files, which other users (a serving process, a shared cache) cannot read.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path

from compress.core.errors import OutputError

MARKER = ".compress-output"
FILE_MODE = 0o644
DIR_MODE = 0o755


def _contains(outer: Path, inner: Path) -> bool:
    return outer == inner or outer in inner.parents


def _guarded_folders(
    protect: Iterable[str | os.PathLike[str]],
) -> list[tuple[Path, str, bool]]:
    """(folder, what it is, whether an output folder may lie inside it)."""
    folders = [(Path(p).expanduser().resolve(), "the input model's folder", False)
               for p in protect]
    folders.append((Path.cwd().resolve(), "the current directory", True))
    try:
        folders.append((Path.home().resolve(), "your home directory", True))
    except RuntimeError:  # no home directory can be determined
        pass
    return folders


def is_compress_output(folder: Path) -> bool:
    """True when ``folder`` holds the marker compress writes into every output folder."""
    marker = folder / MARKER
    return marker.is_file() and not marker.is_symlink()


def check_output_dir(
    out_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    protect: Iterable[str | os.PathLike[str]] = (),
    ignore: Iterable[str] = (),
) -> None:
    """Raise ``OutputError`` unless compress may write, and replace, the folder ``out_dir``.

    protect: folders (the input model's) that ``out_dir`` may not be, contain or lie inside, even
    with ``overwrite``; the current and home directories are always protected that way.
    ignore: entry names that do not make the folder non-empty (our own temporary folder).
    """
    out = Path(out_dir)
    try:
        resolved = out.expanduser().resolve()
    except (RuntimeError, OSError) as exc:  # a symlink loop: RuntimeError before Python 3.13
        raise OutputError(f"output folder {out} cannot be resolved ({exc}); choose another "
                          "--out") from None
    for folder, what, inside_ok in _guarded_folders(protect):
        if _contains(resolved, folder) or (not inside_ok and _contains(folder, resolved)):
            relation = (
                "is" if resolved == folder else "contains" if _contains(resolved, folder)
                else "lies inside"
            )
            raise OutputError(
                f"output folder {out} {relation} {what} ({folder}); compress never writes there, "
                "not even with --overwrite. Choose another --out."
            )
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} exists and is not a directory; choose another --out")
    parent = resolved.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create output directory {parent}: {exc}") from exc
    if not os.access(parent, os.W_OK):
        raise OutputError(f"output directory {parent} is not writable; choose another --out")
    if overwrite or not out.is_dir() or is_compress_output(out):
        return
    entries = sorted(p.name for p in out.iterdir() if p.name not in set(ignore))
    if entries:
        shown = ", ".join(entries[:5]) + (f" (and {len(entries) - 5} more)" if len(entries) > 5
                                          else "")
        raise OutputError(
            f"output folder {out} is not empty and was not written by compress (no {MARKER} "
            f"file); it holds: {shown}. compress does not replace folders it did not write: "
            "choose another --out, empty the folder, or pass --overwrite to replace it (its "
            "current contents are deleted)."
        )


def write_marker(folder: Path, kind: str) -> None:
    """Mark ``folder`` as written by compress (``kind``: checkpoint, results, compare...)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("compress")
    except PackageNotFoundError:
        release = "unknown"
    info = {
        "written_by": "compress",
        "kind": kind,
        "version": release,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    path = folder / MARKER
    path.write_text(json.dumps(info) + "\n")
    path.chmod(FILE_MODE)


def claim_output_dir(
    out_dir: str | os.PathLike[str], kind: str, *, overwrite: bool = False
) -> Path:
    """Check ``out_dir`` (see ``check_output_dir``), create it and mark it, for commands that
    write files into the folder in place rather than replacing it."""
    out = Path(out_dir)
    check_output_dir(out, overwrite=overwrite)
    out.mkdir(parents=True, exist_ok=True)
    if not is_compress_output(out):
        write_marker(out, kind)
    return out


def set_permissions(folder: Path) -> None:
    """Ordinary permissions for a folder compress wrote: 0755 folders, 0644 files."""
    folder.chmod(DIR_MODE)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            Path(root, name).chmod(DIR_MODE)
        for name in files:
            path = Path(root, name)
            if not path.is_symlink():
                path.chmod(FILE_MODE)


@contextlib.contextmanager
def atomic_directory(
    out_dir: str | os.PathLike[str], *, kind: str = "checkpoint", overwrite: bool = False
) -> Iterator[Path]:
    """Yield a temporary directory; on success its contents become ``out_dir``.

    ``out_dir`` must be missing, empty or an earlier compress output, unless ``overwrite``
    (``check_output_dir``). The new folder gets the compress marker and ordinary permissions.
    Normally the temporary folder is a sibling that replaces ``out_dir`` in one rename, an
    earlier folder moved aside and deleted only once the new one is in place. A mount point
    (a container's volume) cannot be renamed: there the temporary folder lies inside it and
    its entries move up, the marker last, once the earlier entries are moved aside. On any
    exception before that the temporary directory is removed and ``out_dir`` is left as it was;
    if the final rename itself fails, the complete new folder is kept and named in the error.
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite=overwrite)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    in_place = out_dir.is_dir() and not out_dir.is_symlink() and os.path.ismount(out_dir)
    home = out_dir if in_place else out_dir.parent
    tmp, old = home / f".{out_dir.name}.tmp-{tag}", home / f".{out_dir.name}.old-{tag}"
    try:
        tmp.mkdir(parents=True)
    except OSError as exc:  # check_output_dir's os.access cannot foresee every refusal
        raise OutputError(f"cannot write into {home} ({exc}); choose another --out") from exc
    kept = False
    try:
        yield tmp
        write_marker(tmp, kind)
        set_permissions(tmp)
        # again, right before replacing it
        check_output_dir(out_dir, overwrite=overwrite, ignore=[tmp.name] if in_place else [])
        try:
            (_replace_contents if in_place else _replace_folder)(out_dir, tmp, old)
        except OSError as exc:  # an immutable folder, a busy one: keep the finished work
            kept = True
            raise OutputError(f"cannot put the new folder in place of {out_dir} ({exc}); it is "
                              f"complete at {tmp}: move it there yourself") from exc
    finally:
        if not kept:
            shutil.rmtree(tmp, ignore_errors=True)


def _replace_folder(out_dir: Path, tmp: Path, old: Path) -> None:
    """``tmp`` becomes ``out_dir`` in one rename; an earlier ``out_dir`` is put back if that
    fails, else deleted (a link is unlinked: the folder it pointed to is left alone)."""
    replacing = out_dir.exists() or out_dir.is_symlink()
    if replacing:
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if replacing:
            os.replace(old, out_dir)  # put the earlier folder back
        raise
    if old.is_symlink():
        old.unlink()
    elif replacing:
        shutil.rmtree(old, ignore_errors=True)


def _replace_contents(out_dir: Path, tmp: Path, old: Path) -> None:
    """``tmp``'s entries (inside ``out_dir``) become ``out_dir``'s: the earlier entries move
    into ``old`` (inside too) and are deleted at the end, the marker comes last, so a folder
    with the marker is complete."""
    old.mkdir()
    for entry in out_dir.iterdir():
        if entry not in (tmp, old):
            os.replace(entry, old / entry.name)
    for entry in sorted(tmp.iterdir(), key=lambda e: e.name == MARKER):
        os.replace(entry, out_dir / entry.name)
    tmp.rmdir()
    shutil.rmtree(old, ignore_errors=True)
