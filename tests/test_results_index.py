"""bench/results/README.md indexes every current result, and every result path cited exists.

Current results sit at the top level of bench/results/ and each is linked from its index;
everything older is in bench/results/archive/. The README and the notes at the top level cite
results by path (``bench/results/NAME``, ``archive/NAME``) or by bare file name; each must name
a file that is there.
"""

from __future__ import annotations

import fnmatch
import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
INDEX = RESULTS / "README.md"
ARCHIVE = "archive"

_LINK = re.compile(r"\]\(([^)\s]+)\)")
# a cited path: letters, digits and _ . - / plus the glob and shorthand characters the notes use
_PATH_CHARS = r"[A-Za-z0-9_.\-/*{},…]"
_RESULTS_PATH = re.compile(r"bench/results/(" + _PATH_CHARS + r"*)")
_ARCHIVE_PATH = re.compile(r"(?<![A-Za-z0-9_.\-/])archive/(" + _PATH_CHARS + r"*)")
# a bare result file name in backticks, e.g. `decode_h200_s14.md` (names with "_" for .md, so
# that `README.md` and the like are not taken for results)
_BARE_NAME = re.compile(r"`([A-Za-z0-9_.\-*]+\.(?:json|log|txt|csv|xz|png)"
                        r"|[A-Za-z0-9.\-*]*_[A-Za-z0-9_.\-*]*\.md)`")


def _text(path: Path) -> str:
    # notes wrap long names after an underscore ("decode_tune_s9_latepf_\n  h200_prelim.md")
    return re.sub(r"_\n\s*", "_", path.read_text(encoding="utf-8"))


def _expand(pattern: str) -> list[str]:
    """Brace groups ({json,md}) become alternatives; the shorthand "…" matches anything."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern.replace("…", "*")]
    return [e for alt in m.group(1).split(",")
            for e in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _exists(base: Path, rel: str) -> bool:
    rel = rel.rstrip(".,;:")
    return all(glob.glob(str(base / p)) for p in _expand(rel))


def _top_level() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir()
                  if p.name not in (INDEX.name, ARCHIVE) and not p.name.startswith("."))


def _index_links() -> list[str]:
    links = [t.split("#")[0] for t in _LINK.findall(INDEX.read_text(encoding="utf-8"))]
    return [t.removeprefix("./") for t in links if t and "://" not in t]


def _current_names() -> set[str]:
    """File names under bench/results/ outside archive/ (top level and indexed folders)."""
    return {p.name for p in RESULTS.rglob("*")
            if p.is_file() and ARCHIVE not in p.relative_to(RESULTS).parts}


def _cited_docs() -> list[Path]:
    return [ROOT / "README.md"] + sorted(RESULTS.glob("*.md"))


def test_every_top_level_result_is_indexed():
    links = _index_links()
    missing = [name for name in _top_level()
               if not any(t == name or t.startswith(name + "/") for t in links)]
    assert not missing, (
        f"bench/results/{missing[0]} (of {missing}) is not linked from bench/results/README.md: "
        "add a row for the claim it backs, or `git mv` it into bench/results/archive/")


def test_index_links_resolve():
    broken = [t for t in _index_links() if not (RESULTS / t).exists()]
    assert not broken, f"bench/results/README.md links to missing paths: {broken}"


@pytest.mark.parametrize("doc", _cited_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_result_paths_exist(doc: Path):
    text = _text(doc)
    bad = [f"bench/results/{rel}" for rel in _RESULTS_PATH.findall(text)
           if not _exists(RESULTS, rel)]
    bad += [f"archive/{rel}" for rel in _ARCHIVE_PATH.findall(text)
            if not _exists(RESULTS / ARCHIVE, rel)]
    assert not bad, f"{doc.relative_to(ROOT)} cites result paths that do not exist: {bad}"


@pytest.mark.parametrize("doc", _cited_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_bare_result_names_are_current(doc: Path):
    current = _current_names()
    bad = []
    for name in _BARE_NAME.findall(_text(doc)):
        if not any(fnmatch.fnmatch(c, p) for p in _expand(name) for c in current):
            bad.append(name)
    assert not bad, (
        f"{doc.relative_to(ROOT)} cites {bad} by bare name, but no current result under "
        "bench/results/ (outside archive/) has that name: cite it as archive/NAME or fix the name")


def test_checks_catch_what_they_should(tmp_path: Path):
    # the helpers the tests above rely on: braces, globs, the notes' shorthand, wrapped names
    (tmp_path / "a_h200.json.xz").write_text("")
    (tmp_path / "a_h200.md").write_text("")
    (tmp_path / "decode_timeline2_s13.json.xz").write_text("")
    assert _exists(tmp_path, "a_h200.{json.xz,md}")
    assert not _exists(tmp_path, "a_h200.{json,md}")
    assert _exists(tmp_path, "decode_timeline2_…") and _exists(tmp_path, "*_h200.md,")
    assert not _exists(tmp_path, "b_h200.md")
    wrapped = tmp_path / "n.md"
    wrapped.write_text("(`archive/decode_tune_s9_\n  h200.md`)")
    assert _ARCHIVE_PATH.findall(_text(wrapped)) == ["decode_tune_s9_h200.md"]
