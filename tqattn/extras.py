"""What to install for a missing optional dependency: the requirements of the tqattn extra that
brings it, read from the installed package's metadata (pyproject.toml is their one source)."""

from __future__ import annotations

import shlex
from importlib import metadata


def extra_requirements(extra: str) -> list[str]:
    """The requirement strings of ``tqattn[extra]`` (empty when the metadata is missing)."""
    try:
        reqs = metadata.requires("tqattn") or []
    except metadata.PackageNotFoundError:
        return []
    out = []
    for r in reqs:
        req, _, marker = r.partition(";")
        if marker.replace("'", '"').replace(" ", "") == f'extra=="{extra}"':
            out.append(req.strip())
    return out


def missing_extra(what: str, extra: str, error: ImportError) -> ImportError:
    """An ImportError saying what needs the missing module and the command that installs the
    extra (its pinned requirements; in a source checkout, the extra itself)."""
    reqs = extra_requirements(extra)
    cmd = ("pip install " + " ".join(shlex.quote(r) for r in reqs) if reqs
           else f'pip install -e ".[{extra}]"')
    return ImportError(f"{what} needs {error.name or 'a package that is missing'}, from tqattn's "
                       f"[{extra}] extra: {cmd} (in a source checkout: pip install -e \".[{extra}]\")")
