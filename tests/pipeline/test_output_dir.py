"""Output folders: compress never deletes data it did not write, never writes into the model's
folder, and writes files with ordinary permissions."""

from __future__ import annotations

import json
import os
import stat

import pytest
import yaml

from compress.cli import main
from compress.core.errors import OutputError
from compress.io.export import export_checkpoint
from compress.output_dir import MARKER, check_output_dir


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _user_folder(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.txt").write_text("years of work")
    return folder


def _recipe(tmp_path, **extra):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny", "passes": [{"pass": "quantize.int8_rtn"}],
                                    "eval": {"perplexity": None, "baseline": False}, **extra}))
    return path


def test_folder_holding_a_user_file_is_refused_and_the_file_survives(
    tiny_model, tiny_tokenizer, tmp_path, capsys
):
    folder = _user_folder(tmp_path)
    with pytest.raises(OutputError, match="--overwrite") as info:
        export_checkpoint(tiny_model, tiny_tokenizer, folder)
    assert str(folder) in str(info.value) and "thesis.txt" in str(info.value)
    # the CLI refuses it before loading anything
    model_dir = tmp_path / "model"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    assert main(["run", str(_recipe(tmp_path)), "--model", str(model_dir), "--out", str(folder),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "not written by compress" in err and "--overwrite" in err
    assert sorted(p.name for p in folder.iterdir()) == ["thesis.txt"]
    assert (folder / "thesis.txt").read_text() == "years of work"


def test_overwrite_replaces_a_foreign_folder_only_with_the_flag(
    tiny_model, tiny_tokenizer, tmp_path
):
    folder = _user_folder(tmp_path)
    with pytest.raises(OutputError):
        export_checkpoint(tiny_model, tiny_tokenizer, folder)
    assert (folder / "thesis.txt").exists()
    export_checkpoint(tiny_model, tiny_tokenizer, folder, overwrite=True)
    assert not (folder / "thesis.txt").exists()
    assert (folder / "model.safetensors").is_file()
    assert json.loads((folder / MARKER).read_text())["kind"] == "checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # nothing left aside


def test_run_overwrite_flag_reaches_the_export(tiny_model, tiny_tokenizer, tmp_path):
    model_dir = tmp_path / "model"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    folder = _user_folder(tmp_path)
    argv = ["run", str(_recipe(tmp_path)), "--model", str(model_dir), "--out", str(folder),
            "--no-progress"]
    assert main(argv) == 2 and (folder / "thesis.txt").exists()
    assert main([*argv, "--overwrite"]) == 0
    assert not (folder / "thesis.txt").exists()
    assert (folder / "results.json").is_file() and (folder / MARKER).is_file()
    assert main(argv) == 0  # now a compress output: rerunning needs no flag


def test_earlier_compress_output_and_empty_folder_are_replaced(
    tiny_model, tiny_tokenizer, tmp_path
):
    empty = tmp_path / "empty"
    empty.mkdir()
    export_checkpoint(tiny_model, tiny_tokenizer, empty)
    target = export_checkpoint(tiny_model, tiny_tokenizer, tmp_path / "ckpt")
    (target / "stale.txt").write_text("from an earlier run")  # inside a compress output
    export_checkpoint(tiny_model, tiny_tokenizer, target)
    assert not (target / "stale.txt").exists() and (target / MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "empty"]


def test_model_folder_is_refused_even_with_overwrite(tiny_model, tiny_tokenizer, tmp_path,
                                                     capsys):
    model_dir = tmp_path / "models" / "tiny"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    before = sorted(p.name for p in model_dir.iterdir())
    recipe = _recipe(tmp_path)
    for out in (model_dir, model_dir / "sub", model_dir.parent):
        argv = ["run", str(recipe), "--model", str(model_dir), "--out", str(out), "--overwrite",
                "--no-progress"]
        assert main(argv) == 2
        assert "the input model's folder" in capsys.readouterr().err
    assert sorted(p.name for p in model_dir.iterdir()) == before
    # a previous compress output used as the model is protected the same way
    ckpt = export_checkpoint(tiny_model, tiny_tokenizer, tmp_path / "ckpt")
    with pytest.raises(OutputError, match="input model's folder"):
        check_output_dir(ckpt, overwrite=True, protect=[ckpt])


def test_current_directory_and_its_parents_are_refused(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for out in (".", "..", str(work)):
        with pytest.raises(OutputError, match="current directory"):
            check_output_dir(out, overwrite=True)
    check_output_dir("out/x")  # below the current directory is the normal case


def test_exported_files_have_ordinary_permissions(tiny_model, tiny_tokenizer, tmp_path):
    target = export_checkpoint(tiny_model, tiny_tokenizer, tmp_path / "ckpt")
    assert _mode(target) == 0o755
    files = [p for p in target.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"model.safetensors", "config.json", MARKER}
    assert {p.name: _mode(p) for p in files} == {p.name: 0o644 for p in files}


def test_results_and_compare_refuse_a_foreign_folder(tmp_path, capsys):
    from compress.eval.report import write_results

    folder = _user_folder(tmp_path)
    with pytest.raises(OutputError, match="--overwrite"):
        write_results(folder, "results", "# x", {})
    write_results(tmp_path / "new", "results", "# x", {})
    assert (tmp_path / "new" / MARKER).is_file()
    # compare checks its folder before it loads any model
    assert main(["compare", "no-such-base", "no-such-variant", "--out", str(folder)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["thesis.txt"]


def _write_into(folder, **kwargs):
    from compress.output_dir import atomic_directory

    with atomic_directory(folder, **kwargs) as tmp:
        (tmp / "model.safetensors").write_text("new weights")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "file").write_text("x")


@pytest.mark.parametrize("earlier", ["empty", "compress-output"])
def test_a_mount_point_is_written_in_place_not_renamed(tmp_path, monkeypatch, earlier):
    """A container's volume mounted at --out cannot be renamed (EBUSY): the job ran to its end,
    then lost its checkpoint with a traceback. The folder itself now stays; its entries are
    replaced, the marker last."""
    folder = tmp_path / "volume"
    folder.mkdir()
    if earlier == "compress-output":
        _write_into(folder)
        (folder / "stale.bin").write_text("from the earlier run")
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == os.fspath(folder)
                        or real_ismount(p))  # fmt: skip
    renamed = []
    real_replace = os.replace

    def replace(src, dst):
        if os.fspath(src) == os.fspath(folder):
            renamed.append(src)
            raise OSError(16, "Device or resource busy")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    _write_into(folder)
    assert not renamed
    assert sorted(p.name for p in folder.iterdir()) == [MARKER, "model.safetensors", "sub"]
    assert (folder / "model.safetensors").read_text() == "new weights"
    assert (folder / "sub" / "file").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["volume"]  # nothing beside it


def test_a_folder_that_cannot_be_replaced_keeps_the_finished_work(tmp_path, monkeypatch):
    """An immutable folder refused the final rename: a traceback, and the finished checkpoint
    was deleted with the temporary folder. Now the error names where the complete one is, and
    the folder at --out is as it was."""
    folder = tmp_path / "out"
    folder.mkdir()
    real_replace = os.replace

    def replace(src, dst):
        if os.fspath(src) == os.fspath(folder):
            raise PermissionError(1, "Operation not permitted")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OutputError, match="cannot put the new folder in place of") as info:
        _write_into(folder)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(kept) == 1 and str(kept[0]) in str(info.value)
    assert (kept[0] / "model.safetensors").read_text() == "new weights"
    assert (kept[0] / MARKER).is_file()
    assert list(folder.iterdir()) == []


def test_an_output_path_in_a_symlink_loop_is_refused(tmp_path):
    """Was RuntimeError: Symlink loop, a traceback."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(OutputError, match="cannot be resolved"):
        check_output_dir(loop / "out")
