"""Where tqattn keeps files it derives or downloads (GGUF conversions, eval data), and where its
shipped data files are."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path


def cache_root() -> Path:
    """$TQATTN_CACHE_DIR, else $XDG_CACHE_HOME/tqattn, else ~/.cache/tqattn."""
    env = os.environ.get("TQATTN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tqattn"


def report_plans_dir() -> Path:
    """The shipped `tqattn eval report` plans."""
    return Path(str(resources.files("tqattn") / "configs" / "evals" / "report"))
