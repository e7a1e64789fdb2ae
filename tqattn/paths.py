"""Where tqattn keeps files it derives or downloads (GGUF conversions, eval data)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$TQATTN_CACHE_DIR, else $XDG_CACHE_HOME/tqattn, else ~/.cache/tqattn."""
    env = os.environ.get("TQATTN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tqattn"
