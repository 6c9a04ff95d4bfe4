"""Files and folders a user names: prompt files, run folders, plots and the download cache.

Each helper turns the operating system's failure into a SpecjaxError that names the path and the role
it plays, so a bad path ends as one line and exit status 2 instead of a traceback. Outputs are checked
before any heavy work starts, so nothing is computed only to be lost at the end.
"""

from __future__ import annotations

import os
from pathlib import Path

from specjax.errors import SpecjaxError

CACHE_ENV_VAR = "SPECJAX_CACHE"


def cache_root() -> Path:
    """Where specjax keeps downloads and measurements: $SPECJAX_CACHE, else ~/.cache/specjax."""
    root = os.environ.get(CACHE_ENV_VAR)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "specjax"


def _reason(error: OSError) -> str:
    return error.strerror or type(error).__name__


def make_dir(path: str | Path, what: str) -> Path:
    """Create the folder (and its parents) if needed and check it is writable."""
    path = Path(path)
    hint = f"; set {CACHE_ENV_VAR} to a writable folder" if _inside_cache(path) else ""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise SpecjaxError(f"{what} {path}: not a folder (a file of that name is in the way){hint}") from None
    except OSError as e:
        raise SpecjaxError(f"{what} {path}: cannot create this folder ({_reason(e)}){hint}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise SpecjaxError(f"{what} {path}: this folder is not writable{hint}")
    return path


def _inside_cache(path: Path) -> bool:
    try:
        path.resolve().relative_to(cache_root().resolve())
        return True
    except (ValueError, OSError):
        return False


def check_output_file(path: str | Path, what: str) -> Path:
    """A file to be written later: its folder is created now and must be writable, the path not a folder."""
    path = Path(path)
    if path.is_dir():
        raise SpecjaxError(f"{what} {path}: is a folder, give a file name")
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecjaxError(f"{what} {path}: cannot create its folder {folder} ({_reason(e)})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SpecjaxError(f"{what} {path}: its folder {folder} is not writable")
    return path


def read_text_file(path: str | Path, what: str) -> str:
    """The whole file as UTF-8 text."""
    path = Path(path)
    if not path.exists():
        raise SpecjaxError(f"{what} {path}: file not found")
    if path.is_dir():
        raise SpecjaxError(f"{what} {path}: is a folder, not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SpecjaxError(f"{what} {path}: not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x}); "
                           f"is it a binary file?") from None
    except OSError as e:
        raise SpecjaxError(f"{what} {path}: cannot read it ({_reason(e)})") from None
