"""Presets' parameters shortened so a problem of a few dozen tokens shows each layer kind's pattern
(short windows and chunks, a local/global period of 2); the presets' own values otherwise."""

from __future__ import annotations

from typing import Any

SHORT: dict[str, dict[str, Any]] = {
    "mistral_7b": {"window": 9},
    "gemma2": {"window": 9},
    "gemma3": {"window": 9, "every": 2},
    "llama4": {"chunk": 16, "every": 2},
    "gpt_oss": {"window": 9},
    "modernbert": {"window": 8, "every": 2},
    "prefix_lm": {"prefix_len": 20},
}
