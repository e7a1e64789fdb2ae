"""Triton's cache key of a kernel hashes the global constexprs its functions name, but not those
they read as a module's attribute (``_asm.LUT4_ROWS``): a kernel reading one that way would run
a stale disk-cache build after the value changes (an upgrade with a warm cache). Every jit
function in tqattn/kernels must name its constexpr globals directly."""

import ast
import importlib
import inspect
import types

import pytest

pytest.importorskip("triton")
from triton.language import constexpr  # noqa: E402

MODULES = ["decode", "decode_mma", "store", "dequant", "kv_write", "_tl"]


def _jit_functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def _constexpr_attribute_reads(module, source: str | None = None) -> list[str]:
    tree = ast.parse(source or inspect.getsource(module))
    found = []
    for fn in _jit_functions(tree):
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                base = getattr(module, node.value.id, None)
                if isinstance(base, types.ModuleType) and isinstance(
                        getattr(base, node.attr, None), constexpr):
                    found.append(f"{fn.name}: {node.value.id}.{node.attr}")
    return found


@pytest.mark.parametrize("name", MODULES)
def test_kernels_name_their_constexpr_globals(name):
    try:
        module = importlib.import_module(f"tqattn.kernels.{name}")
    except ImportError as e:  # decode_mma needs Gluon
        pytest.skip(str(e))
    assert _constexpr_attribute_reads(module) == []


def test_the_check_finds_an_attribute_read():
    """The check itself: a jit function reading ``_asm.U4_VALUES`` is reported."""
    module = types.ModuleType("probe")
    module._asm = importlib.import_module("tqattn.kernels._asm")
    source = ("@triton.jit\ndef f(w):\n"
              "    return tl.inline_asm_elementwise(_asm.U4_VALUES, '', [w], tl.int32, True, 1)\n")
    assert _constexpr_attribute_reads(module, source) == ["f: _asm.U4_VALUES"]
