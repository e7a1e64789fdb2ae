"""The compiled model forward, where compile caches live, and counting compilations.

The decoder layers are compiled (``torch.compile``, one graph per layer class shared by its
layers: :func:`compile_layers`) with the token dimension T a dynamic (backed) size: one graph
serves every step of two or more tokens, and Dynamo specializes T = 1 into a second graph, which
the engine's warm-up compiles. An unbacked T would need one graph only, but Inductor then fuses
no reduction with its consumers: Qwen3-4B's layer ran 12 kernels besides GEMMs and attention
instead of 6, and its 256-sequence decode step took 0.6 ms longer (bench/results/README.md).
Attention inside is the opaque ``tqattn::attention`` op.

Compilations are counted process-wide: Dynamo frame compiles (a compile-start callback) and
Triton/Gluon kernel variants built by Triton's JIT (``triton.knobs.compilation.listener``,
called only on a miss of the in-process kernel cache: a new specialization, compiled or loaded
from Triton's disk cache). Kernels of Inductor's own generated code are built inside a Dynamo
compile and counted with it. The engine takes a :func:`mark` when start-up ends;
:func:`since` then says what compiled during the run, and :func:`warn_new` logs each new frame
or kernel once. What compiles while any engine of the process starts (:func:`starting_up`) is
that engine's start-up, never another engine's stall.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import torch

from tqattn.paths import cache_root

logger = logging.getLogger(__name__)

CACHE_DIRS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def use_cache_dirs() -> dict[str, str]:
    """Point Inductor's and Triton's on-disk caches under the tqattn cache directory, unless the
    user set them; returns the directories in use. Inductor's is one folder per version of the
    attention ops (:func:`tqattn.attention.op.fingerprint`): its graph cache does not see their
    tags."""
    from tqattn.attention.op import fingerprint

    for env, sub in CACHE_DIRS.items():
        path = cache_root() / sub
        if env == "TORCHINDUCTOR_CACHE_DIR":
            path = path / f"ops-{fingerprint()}"
        os.environ.setdefault(env, str(path))
    return {env: os.environ[env] for env in CACHE_DIRS}


def model_logits(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                 logits_index: torch.Tensor) -> torch.Tensor:
    """Logits (len(logits_index), vocab) of a flattened (T,) step at the given token indices."""
    return model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                 logits_to_keep=logits_index).logits[0]


INDUCTOR_OPTIONS = {"emulate_precision_casts": True}
# Dynamo caches graphs per code object, and transformers' decoder layers share one (their
# checkpointing wrapper's forward): every layer class, dtype and engine of a process adds an
# entry there, and past Dynamo's default limit of 8 a layer would run eagerly.
RECOMPILE_LIMIT = 64


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the entries of the first ModuleList whose every entry holds
    a tqattn-bound attention module (``use_tqattn``; a block that carries ``layer_idx`` itself
    is bound too)."""
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and all(
                any(hasattr(s, "tqattn_spec") for s in block.modules()) for block in m):
            return list(m)
    raise RuntimeError(f"{type(model).__name__}: no list of decoder layers with one tqattn "
                       f"attention module each; compile_model=False runs it eagerly")


def compile_layers(model: torch.nn.Module) -> int:
    """Compile the decoder layers (regional compilation): one ``torch.compile`` per layer class,
    shared by all its layers — the parameters and the layer's index (a buffer, see
    ``use_tqattn``) are graph inputs, so the first layer's graph serves the rest and start-up
    traces one layer instead of the whole model. The token dimension is dynamic: one graph
    serves every step of two or more tokens, a second one the one-token steps. Embedding, final
    norm and LM head run eagerly (a few kernels; decode steps replay them inside their CUDA
    graph). Fused kernels round to the model dtype where eager rounds
    (``emulate_precision_casts``), so the cache's codec gets the keys eager computes
    (bench/results/README.md). Returns the number of compiled layer classes."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               RECOMPILE_LIMIT)
    compiled: dict[type, object] = {}
    for layer in decoder_layers(model):
        cls = type(layer)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, dynamic=False,
                                          options=dict(INDUCTOR_OPTIONS))
        layer.forward = _with_dynamic_tokens(compiled[cls], layer)
    return len(compiled)


def _with_dynamic_tokens(fn, layer: torch.nn.Module):
    """``layer.forward`` through the compiled ``fn``, the token dimension of every input marked
    dynamic (an attribute write): (1, T, ...) tensors at dim 1, (T,) tensors at dim 0."""
    def forward(hidden_states: torch.Tensor, *args, **kwargs):
        t = hidden_states.shape[1]
        _mark_tokens((hidden_states, args, tuple(kwargs.values())), t)
        return fn(layer, hidden_states, *args, **kwargs)
    return forward


def _mark_tokens(x, t: int, mark=torch._dynamo.mark_dynamic) -> None:
    if isinstance(x, torch.Tensor):
        if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == t:
            mark(x, 1)
        elif x.dim() == 1 and x.shape[0] == t:
            mark(x, 0)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _mark_tokens(y, t, mark)


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph-break reasons so far in this process (each break costs a graph)."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


# ---- counting --------------------------------------------------------------------------------

_lock = threading.Lock()
_dynamo: list[str] = []   # compile ids, in order
_triton: list[tuple[str, dict, bool]] = []   # (kernel name, its specialization, from the disk
                                             # cache), in order
# per entry of _dynamo / _triton: whether an engine was starting up when it compiled
_dynamo_startup: list[bool] = []
_triton_startup: list[bool] = []
_starting = 0   # engines now inside starting_up()
_warned: set[str] = set()


@contextlib.contextmanager
def starting_up():
    """An engine's start-up: what compiles inside is not counted after any engine's start-up
    (a second engine of the process compiles its own model and kernels, no stall of the first's)."""
    global _starting
    with _lock:
        _starting += 1
    try:
        yield
    finally:
        with _lock:
            _starting -= 1


def _on_dynamo_compile(args) -> None:
    with _lock:
        _dynamo.append(str(args.compile_id))
        _dynamo_startup.append(_starting > 0)


def _on_triton_compile(prev):
    # Triton's compile listener, not its JIT hooks: those serialize every constexpr to JSON
    # first, and the kernels take dataclass constexprs (kernels/_spec.py)
    def listener(*, src, metadata, metadata_group, times, cache_hit):
        fn = getattr(src, "fn", None)
        name = f"{fn.__module__}.{fn.__name__}" if fn is not None else str(getattr(src, "name", src))
        with _lock:
            _triton.append((name, _specialization(src), bool(cache_hit)))
            _triton_startup.append(_starting > 0)
        if prev is not None:
            prev(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                 cache_hit=cache_hit)
    listener._tqattn_counter = True
    return listener


def _specialization(src) -> dict[str, str]:
    """What a kernel build was specialized on, by argument name: the other arguments' types
    (a pointer's dtype), scalar constexprs (an integer argument equal to 1 included) and
    attributes such as divisibility by 16. Arguments of none of these kinds are absent."""
    names = getattr(getattr(src, "fn", None), "arg_names", None)
    if names is None:
        return {}
    out = {name: ty for name, ty in (getattr(src, "signature", None) or {}).items()
           if ty != "constexpr"}
    for key, value in getattr(src, "constants", {}).items():
        if len(key) == 1 and isinstance(value, (bool, int, float, str, type(None))):
            out[names[key[0]]] = repr(value)
    for key, attrs in getattr(src, "attrs", {}).items():
        if len(key) == 1:
            name, spec = names[key[0]], ",".join(f"{a}={v}" for a, v in attrs)
            out[name] = f"{out[name]} {spec}" if name in out else spec
    return out


def _differs(spec: dict, earlier: list[dict]) -> str:
    """The arguments in which a build differs from the closest earlier build of its kernel."""
    if not earlier:
        return "the kernel's first build"
    def diff(other):
        return sorted(k for k in spec.keys() | other.keys() if spec.get(k) != other.get(k))
    best = min((diff(e) for e in earlier), key=len)
    return "; ".join(f"{k}: {_closest_value(k, earlier)} -> {spec.get(k, 'plain')}"
                     for k in best) or "the same specialization as an earlier build"


def _closest_value(arg: str, earlier: list[dict]) -> str:
    values = sorted({e.get(arg, "plain") for e in earlier})
    return "/".join(values)


def install() -> None:
    """Start counting (idempotent; again after ``torch._dynamo.reset()``, which drops callbacks).
    Without triton only Dynamo compiles are counted."""
    from torch._dynamo.callback import callback_handler

    with _lock:
        if _on_dynamo_compile not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(_on_dynamo_compile)
        try:
            from triton import knobs
        except ImportError:
            return
        prev = knobs.compilation.listener
        if not getattr(prev, "_tqattn_counter", False):
            knobs.compilation.listener = _on_triton_compile(prev)


def mark() -> tuple[int, int]:
    """A point in the compile log (e.g. the end of start-up)."""
    with _lock:
        return len(_dynamo), len(_triton)


def _frame_names(compile_ids: list[str]) -> list[str]:
    from torch._dynamo.utils import get_compilation_metrics

    by_id = {str(m.compile_id): m for m in get_compilation_metrics()}
    names = []
    for cid in compile_ids:
        m = by_id.get(cid)
        if m is None:  # still compiling, or dropped from the bounded metrics log
            names.append(f"frame {cid}")
        else:
            reason = f" (recompile: {m.recompile_reason})" if m.recompile_reason else ""
            names.append(f"frame {cid} {m.co_name} {m.co_filename}:{m.co_firstlineno}{reason}")
    return names


def _after(startup: list[bool], first: int) -> list[int]:
    """Indices from ``first`` on of the entries compiled outside every engine's start-up."""
    return [i for i in range(first, len(startup)) if not startup[i]]


def since(start: tuple[int, int]) -> dict:
    """Compilations after ``start`` outside every engine's start-up: counts and what
    compiled."""
    with _lock:
        dynamo = [_dynamo[i] for i in _after(_dynamo_startup, start[0])]
        triton = _after(_triton_startup, start[1])
        builds = _triton[:triton[-1] + 1] if triton else []
    kernels = []
    for i in triton:
        name, spec, _ = builds[i]
        earlier = [s for n, s, _ in builds[:i] if n == name]
        kernels.append(f"{name} ({_differs(spec, earlier)})")
    return {"dynamo": len(dynamo), "triton": len(triton), "total": len(dynamo) + len(triton),
            "dynamo_frames": _frame_names(dynamo), "triton_kernels": kernels}


def count_since(start: tuple[int, int]) -> int:
    """since(start)'s total, without naming what compiled (cheap enough per step)."""
    with _lock:
        return (_dynamo_startup[start[0]:].count(False)
                + _triton_startup[start[1]:].count(False))


def builds_since(start: tuple[int, int]) -> dict[str, int]:
    """Counts after ``start``: Dynamo frame compiles, Triton/Gluon builds loaded from Triton's
    disk cache and builds compiled."""
    with _lock:
        hits = [hit for _, _, hit in _triton[start[1]:]]
        dynamo = len(_dynamo) - start[0]
    return {"dynamo": dynamo, "triton_loaded": sum(hits), "triton_compiled": len(hits) - sum(hits)}


def warn_new(start: tuple[int, int], seen: tuple[int, int]) -> tuple[int, int]:
    """Log once per name what compiled after ``start`` and was not logged by an earlier call
    (``seen``: what that call returned); returns the new ``seen``."""
    now = mark()
    if now == seen:
        return now
    new = since((max(start[0], seen[0]), max(start[1], seen[1])))
    for kind, names in (("Dynamo", new["dynamo_frames"]), ("Triton kernel", new["triton_kernels"])):
        for name in names:
            key = name.split(" (")[0] if kind != "Dynamo" else name.split(" ", 2)[-1]
            if key not in _warned:
                _warned.add(key)
                logger.warning("compilation after start-up (a stall of this step): %s %s; "
                               "the warm-up did not reach this variant", kind, name)
    return now
