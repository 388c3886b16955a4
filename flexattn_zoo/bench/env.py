"""What a benchmark report records about the machine, and hiding FA4 for the no-FA4 sweep."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import flexattn_zoo
from flexattn_zoo import _compat
from flexattn_zoo._compat import dist_version

GIT_ENV = "FLEXATTN_ZOO_GIT"  # commit to record when the tree has no .git (e.g. a copy on a GPU machine)


def block_fa4() -> None:
    """Hide flash_attn.cute (FA4) from this process, to measure what users without it get."""
    # None in sys.modules makes the import raise (and find_spec return None); typeshed types the
    # values as ModuleType only, hence the ignore.
    sys.modules["flash_attn.cute"] = None  # type: ignore[assignment]
    _compat.flash_cute_available.cache_clear()


def _git() -> tuple[str | None, bool | None]:
    if os.environ.get(GIT_ENV):
        return os.environ[GIT_ENV], None
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None, None
    if rev.returncode != 0:
        return None, None
    return rev.stdout.strip(), bool(dirty.stdout.strip())


def collect_env(device: torch.device, command: str) -> dict[str, Any]:
    from flexattn_zoo.arch import detect_arch

    git, dirty = _git()
    env: dict[str, Any] = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": _compat.triton_version(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": str(device),
        "gpu": None,
        "cc": None,
        "arch": detect_arch(device),
        "flash_attn_cute": _compat.flash_cute_available(),
        "flash_attn_4": dist_version("flash-attn-4", "flash_attn_4"),
        "flexattn_zoo": dist_version("flexattn-zoo") or flexattn_zoo.__version__,
        "git": git,
        "git_dirty": dirty,
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        env["gpu"], env["cc"] = torch.cuda.get_device_name(device), f"{major}.{minor}"
    return env
