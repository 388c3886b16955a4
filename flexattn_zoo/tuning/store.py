"""Where :mod:`flexattn_zoo.tuning` keeps its measurements between processes: one JSON file per
machine environment, written atomically and merged under a lock.

* Directory: ``$FLEXATTN_ZOO_CACHE_DIR``, else ``$XDG_CACHE_HOME/flexattn_zoo``, else
  ``~/.cache/flexattn_zoo`` (read at every load and save; :data:`ENV_VARS` lists every variable
  it depends on, ``HOME`` included, which the plan cache keys on). A relative value is taken
  relative to the working directory when the process first reads it, and keeps that meaning
  after a change of directory.
* File: ``tune-<device>-<hash>.json``, where the hash covers the *environment key*
  (:func:`environment`): the device name, the CPU architecture, the versions of torch (and its
  CUDA / HIP), cuDNN, Triton, FlashAttention-4 (``flash-attn-4``; ``"unknown"`` when
  ``flash_attn.cute`` imports from another distribution) and flexattn_zoo, the file format and
  :data:`ROUTES_REVISION` (the routes' own cost per call). A change of any of them starts a
  fresh file: timings measured under another kernel library, or with routes that cost
  differently, are not reused.
* Writes: under an exclusive advisory lock (``fcntl.flock`` on ``<file>.lock``; where there is no
  ``fcntl`` the write goes ahead unlocked), the file is read again, merged with what this process
  holds (per signature the newer measurement wins), written to a temporary file in the same
  directory and moved over the old one with ``os.replace``: readers see the old file or the new
  one, never a torn one, and entries another process wrote meanwhile survive.
* A file that cannot be read or parsed is ignored with a warning (and replaced at the next
  write); an entry that does not parse is dropped with a warning. A failed write warns and keeps
  the measurement in memory, and so does no directory at all (no home directory). Nothing here
  raises into an attention call.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import re
import secrets
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from flexattn_zoo import _compat

CACHE_DIR_ENV = "FLEXATTN_ZOO_CACHE_DIR"
#: Every environment variable :func:`cache_dir` reads (``HOME`` through ``~``): a change of any of
#: them can switch the tuning file, so cached plans chosen from the old file's table must go.
ENV_VARS = (CACHE_DIR_ENV, "XDG_CACHE_HOME", "HOME")
#: Bumped when the file layout changes (it is part of the environment key).
FORMAT = 1
#: Bumped when a route's own cost per call changes enough to reorder routes (part of the
#: environment key, so tables measured before are not reused): 2 = the ``fa4`` route replays
#: FA4's recorded launches instead of running its Python launcher per call.
ROUTES_REVISION = 2

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows: writes go unlocked
    fcntl = None  # type: ignore[assignment]


def cache_dir() -> Path:
    """The directory of the tuning files (see the module docstring).

    Raises:
        OSError: no home directory to put it in (``HOME`` unset and the user not in the password
            database, as for a container's arbitrary uid) and no variable naming another; callers
            treat it as a directory that cannot be read or written.
    """
    try:
        explicit = os.environ.get(CACHE_DIR_ENV)
        if explicit:
            return _absolute(explicit)
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = _absolute(xdg) if xdg else _absolute(str(Path.home())) / ".cache"
        return base / "flexattn_zoo"
    except RuntimeError as exc:  # pathlib's "Could not determine home directory."
        raise OSError(f"no tuning cache directory: {exc} Set {CACHE_DIR_ENV} or XDG_CACHE_HOME") from None


@functools.lru_cache(maxsize=64)
def _absolute(raw: str) -> Path:
    """``raw`` (``~`` expanded) as an absolute path. A relative one is resolved against the working
    directory the first time this process reads it and keeps that meaning: cached plans key on the
    variables' values, so a later ``os.chdir`` must not switch the tuning file under them."""
    return Path(raw).expanduser().absolute()


def environment(device_name: str) -> dict[str, Any]:
    """The environment key of ``device_name``'s measurements: what, when it changes, makes them
    stale. Versions are read from the installed distributions (nothing is imported), once per
    process: installing another version takes a restart to be used anyway."""
    return dict(_environment(device_name))


@functools.cache
def _environment(device_name: str) -> tuple[tuple[str, Any], ...]:
    from flexattn_zoo import __version__

    env = {
        "format": FORMAT,
        "device": device_name,
        "machine": platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": _compat.dist_version("triton", "pytorch-triton", "pytorch-triton-rocm"),
        "fa4": _compat.dist_version("flash-attn-4", "flash_attn_4")
        or ("unknown" if _compat.flash_cute_available() else None),
        "flexattn_zoo": __version__,
        "routes": ROUTES_REVISION,
    }
    return tuple(env.items())


def env_hash(env: Mapping[str, Any]) -> str:
    text = json.dumps(dict(env), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def path_for(device_name: str) -> Path:
    """The file holding ``device_name``'s measurements in this environment."""
    return cache_dir() / _file_name(device_name, env_hash(environment(device_name)))


@functools.cache
def _file_name(device_name: str, digest: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower()[:40] or "device"
    return f"tune-{slug}-{digest}.json"


def read(path: Path, *, unreadable_raises: bool = False) -> list[dict[str, Any]] | None:
    """The raw entries of ``path``; ``[]`` when it does not exist, None (with a warning) when it
    cannot be read or is not a tuning file. ``unreadable_raises``: an existing file that cannot
    be read (permissions, I/O) raises its ``OSError`` instead, for a writer that must not replace
    entries it could not see (a corrupt file still reads as None: replacing it is its repair)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        if unreadable_raises:
            raise
        warnings.warn(f"flexattn_zoo tuning: cannot read {path}: {exc}; ignoring it", stacklevel=2)
        return None
    try:
        # Bytes, decoded by the parser: a corrupt file's undecodable bytes are a ValueError here
        # (UnicodeDecodeError), its nesting beyond the parser's depth a RecursionError.
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        warnings.warn(f"flexattn_zoo tuning: {path} is not valid JSON ({exc}); ignoring it", stacklevel=2)
        return None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list) or data.get("format") != FORMAT:
        warnings.warn(
            f"flexattn_zoo tuning: {path} is not a tuning file of format {FORMAT}; ignoring it", stacklevel=2
        )
        return None
    return [e for e in entries if isinstance(e, dict)]


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (through ``<path>.lock``), for one read-merge-write.
    Creates the directory. Without ``fcntl`` (Windows) it holds nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def write(path: Path, env: Mapping[str, Any], entries: list[dict[str, Any]]) -> None:
    """Replace ``path`` atomically with ``entries`` (call under :func:`locked`)."""
    data = {"format": FORMAT, "env": dict(env), "entries": entries}
    # Created like any file of the user's (mode 0o666 less the umask), not mkstemp's 0o600: a
    # cache directory shared by a team stays readable to it. O_EXCL and a random name keep
    # concurrent writers off each other's temporary files.
    tmp = str(path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=1)  # insertion order: routes as they were timed
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove(path: Path) -> None:
    """Delete ``path`` (under its lock) if it exists."""
    if not path.parent.is_dir():
        return
    with locked(path), contextlib.suppress(FileNotFoundError):
        path.unlink()


__all__ = [
    "CACHE_DIR_ENV",
    "ENV_VARS",
    "FORMAT",
    "ROUTES_REVISION",
    "cache_dir",
    "environment",
    "locked",
    "path_for",
    "read",
    "remove",
    "write",
]
