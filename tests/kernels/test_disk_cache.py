"""The on-disk kernel cache is private and verified before a load (Note [kernel cache]).

Each test points ``SCALEDOPTIM_CACHE_DIR`` at a folder of its own, seeded with a valid entry of
the inf/nan check built once for the module, then plants, truncates or exposes it.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import warnings

import pytest
import torch

from scaledoptim.kernels import (
    NON_FINITE_CHECK,
    disk_cache,
    emulator,
    environment,
    non_finite_check_,
)

_ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A cache folder holding a valid emulator entry of the inf/nan check."""
    folder = tmp_path_factory.mktemp("built-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(disk_cache.CACHE_DIR_ENV, str(folder))
        emulator._library.cache_clear()
        emulator.emulator_library(NON_FINITE_CHECK)
    emulator._library.cache_clear()
    return folder


@pytest.fixture
def cache(built: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    """This test's cache folder (a copy of ``built``), and the path of its entry."""
    folder = tmp_path / "cache"
    shutil.copytree(built, folder)
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(folder))
    emulator._library.cache_clear()
    yield folder, _entry(folder)
    emulator._library.cache_clear()


def _entry(folder: pathlib.Path) -> pathlib.Path:
    (entry,) = (folder / "emulator").glob("non_finite_check-*.so")
    return entry


def _works() -> bool:
    """Whether the check loads and runs right (it finds the nan)."""
    found_inf = torch.zeros(())
    non_finite_check_([torch.tensor([1.0, float("nan")])], found_inf)
    return found_inf.item() == 1.0


def _valid(entry: pathlib.Path, key: str) -> bool:
    return disk_cache.read_entry(entry, key) is not None


def _key(entry: pathlib.Path) -> str:
    """The key a valid entry was built for (its trailer: magic, key, content hash)."""
    return entry.read_bytes()[-128:-64].decode()


@pytest.mark.parametrize(
    "damage",
    ["empty", "truncated", "garbage", "another library", "content changed", "another key"],
)
def test_a_corrupt_entry_is_rebuilt_not_loaded(cache, damage: str) -> None:
    _, entry = cache
    data, key = entry.read_bytes(), _key(entry)
    body = data[: -len(disk_cache._MAGIC) - 128]
    if damage == "empty":
        entry.write_bytes(b"")
    elif damage == "truncated":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        entry.write_bytes(b"\x7fELF" + os.urandom(4000))
    elif damage == "another library":  # a planted shared library, with no record of its build
        entry.write_bytes(body)
    elif damage == "content changed":  # one byte of the code changed, the record kept
        entry.write_bytes(body[:100] + bytes([body[100] ^ 1]) + data[len(body[:101]) :])
    else:  # a whole entry, recorded for another key
        other = "0" * 64
        entry.write_bytes(body + disk_cache._MAGIC + other.encode() + data[-64:])
    assert not _valid(entry, key)
    assert _works()
    assert _valid(entry, key)  # rebuilt in place


def test_a_truncated_entry_does_not_kill_the_process(cache) -> None:
    # Mapped as it was, a truncated library dies of SIGBUS on every run.
    folder, entry = cache
    entry.write_bytes(entry.read_bytes()[:2000])
    script = (
        "import torch; from scaledoptim.kernels import non_finite_check_\n"
        "f = torch.zeros(()); non_finite_check_([torch.tensor([1.0, float('nan')])], f)\n"
        "print(f.item())"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=_ROOT,
        env={**os.environ, disk_cache.CACHE_DIR_ENV: str(folder)}, check=False, timeout=600,
    )
    assert (result.returncode, result.stdout.strip()) == (0, "1.0"), result.stderr[-2000:]


def test_an_entry_of_another_user_is_refused(cache, monkeypatch: pytest.MonkeyPatch) -> None:
    _, entry = cache
    entry_owner = os.stat(entry).st_uid
    monkeypatch.setattr(disk_cache.os, "getuid", lambda: entry_owner + 1)
    with pytest.raises(disk_cache.CacheError, match=r"belongs to user id .* not to you"):
        emulator.emulator_library(NON_FINITE_CHECK)


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_cache_others_can_write_is_refused(cache, what: str) -> None:
    _, entry = cache
    os.chmod(entry if what == "file" else entry.parent, 0o777)
    with pytest.raises(disk_cache.CacheError, match=rf"{what} .* is writable by other users"):
        emulator.emulator_library(NON_FINITE_CHECK)


def test_a_link_in_place_of_an_entry_is_refused(cache, tmp_path: pathlib.Path) -> None:
    _, entry = cache
    target = tmp_path / "elsewhere.so"
    entry.rename(target)
    entry.symlink_to(target)
    with pytest.raises(disk_cache.CacheError, match="Cannot open the cached kernel"):
        emulator.emulator_library(NON_FINITE_CHECK)


def test_entries_are_written_private_whatever_the_umask(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "fresh"
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(folder))
    emulator._library.cache_clear()
    saved = os.umask(0)
    try:
        assert _works()
    finally:
        os.umask(saved)
        emulator._library.cache_clear()
    entry = _entry(folder)
    assert stat.S_IMODE(os.stat(entry.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(entry).st_mode) == 0o700
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temporary left
    assert _valid(entry, _key(entry))


@pytest.mark.parametrize(
    "value, error",
    [("", "SCALEDOPTIM_CACHE_DIR is set but empty"), ("a-file", "is not a folder; point")],
)
def test_a_cache_dir_variable_naming_no_folder_is_refused(
    value: str, error: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if value:  # a file where the folder should be
        (tmp_path / value).write_text("")
        value = str(tmp_path / value)
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, value)
    emulator._library.cache_clear()
    with pytest.raises(disk_cache.CacheError, match=error):
        emulator.emulator_library(NON_FINITE_CHECK)


# ------------------------------------------------------------------------ environment variables
def test_an_unknown_variable_warns_once_with_the_known_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SCALEDOPTIM_KERNEL", "emulate")
    monkeypatch.setattr(environment, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        environment.warn_unknown_variables()
        environment.warn_unknown_variables()
    messages = [str(w.message) for w in caught if "SCALEDOPTIM_KERNEL " in str(w.message)]
    assert len(messages) == 1
    assert "Did you mean SCALEDOPTIM_KERNELS?" in messages[0]
    assert all(name in messages[0] for name in environment.KNOWN_VARIABLES)


def test_importing_scaledoptim_warns_about_a_misspelt_variable() -> None:
    result = subprocess.run(
        [sys.executable, "-W", "always", "-c", "import scaledoptim"],
        capture_output=True, text=True, cwd=_ROOT, check=False, timeout=600,
        env={**os.environ, "SCALEDOPTIM_KERNEL": "emulate"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "SCALEDOPTIM_KERNEL is not one scaledoptim reads" in result.stderr


def test_the_known_variables_are_those_the_package_reads() -> None:
    package = pathlib.Path(emulator.__file__).resolve().parents[1]
    read = {
        name
        for path in package.rglob("*.py")
        for name in re.findall(r"SCALEDOPTIM_[A-Z_]+[A-Z]", path.read_text())
    }
    assert read == set(environment.KNOWN_VARIABLES)
