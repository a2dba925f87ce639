"""The on-disk cache of compiled kernels: private to the user, and verified before a load.

Note [kernel cache]
~~~~~~~~~~~~~~~~~~~
A cached library is code the process will run, at a path anyone can predict, so nothing is
loaded on trust:

* The folder is ``$SCALEDOPTIM_CACHE_DIR``, else ``$XDG_CACHE_HOME/scaledoptim``, else
  ``~/.cache/scaledoptim`` (an empty ``SCALEDOPTIM_CACHE_DIR`` is refused: it would mean the
  current directory). Each cache lives in a subfolder of it that is created private (0700,
  whatever the umask) and must stay so: owned by the current user, writable by no one else.
* An entry is written with private permissions (0700) to a temporary file in that folder and
  renamed into place, so a reader sees a whole file or none. It carries a trailer recording
  the key it was built for (a hash of the exact sources, compiler and flags) and the sha256 of
  the bytes before the trailer.
* A read opens the entry without following links, checks that the open file is a regular file
  owned by the current user and writable by no one else, and reads it whole; the key and the
  content hash must match. The caller then loads exactly the bytes that were verified (from a
  private in-memory file, not from the path), so a file truncated or replaced after the check
  cannot be mapped: no SIGBUS, no planted code.
* An entry that is missing, truncated, empty, from another key or otherwise corrupt is rebuilt;
  a folder or entry owned by someone else, or writable by others, is refused with an error
  saying what to do (it may be an attack, so it is not silently replaced).
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["CACHE_DIR_ENV", "CacheError", "cache_dir", "private_dir", "read_entry", "write_entry"]

#: The environment variable that names the cache folder.
CACHE_DIR_ENV = "SCALEDOPTIM_CACHE_DIR"

_MAGIC = b"\0scaledoptim-cache-v1\0"
_HEX = 64  # a sha256 in hex


class CacheError(RuntimeError):
    """The kernel cache cannot be used safely; the message says why and how to fix it."""


def cache_dir() -> Path:
    """The folder of on-disk caches (Note [kernel cache]).

    Raises:
        CacheError: if ``SCALEDOPTIM_CACHE_DIR`` is set but empty.
    """
    if CACHE_DIR_ENV in os.environ:
        value = os.environ[CACHE_DIR_ENV]
        if not value:
            raise CacheError(
                f"{CACHE_DIR_ENV} is set but empty, which would put compiled kernels in the "
                f"current directory; set it to a folder of your own, or unset it for "
                "~/.cache/scaledoptim"
            )
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "scaledoptim"


def private_dir(name: str) -> Path:
    """The cache subfolder ``name``, created private (0700) if missing, and checked: a folder,
    owned by the current user, writable by no one else (Note [kernel cache]).

    Raises:
        CacheError: if it or the cache folder is not a folder, or it is not private.
    """
    root = cache_dir()
    if root.exists() and not root.is_dir():
        raise CacheError(
            f"The kernel cache folder {root} is not a folder; point {CACHE_DIR_ENV} at a folder "
            "(it is created if missing), or remove the file"
        )
    directory = root / name
    try:
        root.mkdir(parents=True, exist_ok=True)
        directory.mkdir(mode=0o700)
        os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask; chmod's is not
    except FileExistsError:
        pass
    except OSError as error:
        raise CacheError(
            f"Cannot create the kernel cache folder {directory} ({error}); point "
            f"{CACHE_DIR_ENV} at a writable folder of your own"
        ) from error
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise CacheError(
            f"The kernel cache folder {directory} is not a folder (a link or a file); remove it "
            "and it is created again"
        )
    _check_private(directory, info, "folder")
    return directory


def _check_private(path: Path, info: os.stat_result, what: str) -> None:
    if info.st_uid != os.getuid():
        raise CacheError(
            f"The kernel cache {what} {path} belongs to user id {info.st_uid}, not to you "
            f"({os.getuid()}): refusing to load code from it. Remove it (it is rebuilt), or set "
            f"{CACHE_DIR_ENV} to a folder of your own"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(
            f"The kernel cache {what} {path} is writable by other users "
            f"(mode {stat.filemode(info.st_mode)}): refusing to load code from it. Run "
            f"chmod go-w {path}, or remove it (it is rebuilt)"
        )


def read_entry(path: Path, key: str) -> bytes | None:
    """The verified content of the entry at ``path`` built for ``key``, or ``None`` when it is
    missing or corrupt (truncated, empty, another key's, or its content hash differs): rebuild
    it then.

    Raises:
        CacheError: if the entry is not the current user's, or is writable by others.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as error:  # a link (ELOOP), or no permission
        raise CacheError(
            f"Cannot open the cached kernel {path} ({error}); remove it (it is rebuilt)"
        ) from error
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise CacheError(f"The cached kernel {path} is not a regular file; remove it")
        _check_private(path, info, "file")
        data = file.read()
    trailer = len(_MAGIC) + 2 * _HEX
    if len(data) <= trailer or data[-trailer : -2 * _HEX] != _MAGIC:
        return None
    content, recorded = data[:-trailer], data[-2 * _HEX :]
    if recorded[:_HEX] != key.encode() or recorded[_HEX:] != _sha256(content).encode():
        return None
    return content


def write_entry(path: Path, key: str, content: bytes) -> None:
    """Stores ``content`` built for ``key`` at ``path`` (in a private folder), atomically, with
    private permissions and the trailer :func:`read_entry` verifies."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), 0o700)
            file.write(content + _MAGIC + key.encode() + _sha256(content).encode())
        os.replace(temporary, path)  # concurrent builders agree: each writes a whole entry
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
