"""Command-line flags of the engine and of sampling, defined once for every subcommand.

``add_engine_args(parser)`` / ``engine_kwargs_from_args(args)`` map the :class:`EngineArgs`
fields to ``--kebab-case`` flags (defaults read from the dataclass), and ``add_sampling_args`` /
``sampling_params_from_args`` do the same for :class:`SamplingParams`. Values are checked when
they are parsed or when the dataclasses are built, so a bad flag fails before a model loads.

Command-line sampling defaults differ from the API's: a command answers greedily with up to
:data:`CLI_MAX_TOKENS` tokens, while ``SamplingParams()`` samples at temperature 1.0 and stops
after 16 tokens (vLLM's defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

from ..models.loader import LOAD_FORMATS
from .llm_engine import _DTYPES as DTYPES
from .llm_engine import EngineArgs
from .sampling import SEED_MAX, SEED_MIN, SamplingParams

CLI_MAX_TOKENS = 64
CLI_TEMPERATURE = 0.0
_BYTES = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?", re.IGNORECASE)


# ---- value parsers (argparse `type=`): each error names the value and what is allowed ---------

def _int(s: str, lowest: int, what: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = lowest - 1
    if v < lowest:
        raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
    return v


def positive_int(s: str) -> int:
    return _int(s, 1, "a positive integer")


def non_negative_int(s: str) -> int:
    return _int(s, 0, "an integer >= 0")


def _number(s: str, what: str, ok) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
    return v


def temperature(s: str) -> float:
    return _number(s, "a finite number >= 0 (0 = greedy)", lambda v: 0 <= v < math.inf)


def probability(s: str) -> float:
    return _number(s, "a number in (0, 1]", lambda v: 0 < v <= 1)


def seed(s: str) -> int:
    what = f"an integer in [{SEED_MIN}, {SEED_MAX}]"
    v = _int(s, SEED_MIN, what)
    if v > SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
    return v


def top_k(s: str) -> int:
    return _int(s, -1, "an integer >= 1, or 0 / -1 for no top-k")


def num_bytes(s: str) -> int:
    """An integer number of bytes, optionally with a K/M/G/T suffix (powers of 1024): 512M, 2GiB."""
    m = _BYTES.fullmatch(s.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 268435456, 256M or 2G, got {s!r}")
    value = float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower())
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a positive whole number of bytes, got {s!r}")
    return int(value)


def kv_cache_dtype(s: str) -> str:
    from ..quant.presets import PRESETS

    if s in DTYPES or s in PRESETS:
        return s
    raise argparse.ArgumentTypeError(
        f"unknown KV-cache dtype {s!r}; allowed: {', '.join(DTYPES)} or a preset: "
        f"{', '.join(PRESETS)} (see `tqattn presets`)")


def device(s: str) -> str:
    if re.fullmatch(r"cpu|cuda(:\d+)?", s):
        return s
    raise argparse.ArgumentTypeError(f"unknown device {s!r}; allowed: cpu, cuda, cuda:N")


def skip_layers(s: str) -> list[int | str]:
    """Comma-separated layer indices, 'sliding_window' and/or 'auto' (checked against the model
    later); 'none' (or an empty string) for no layer."""
    if s.strip().lower() == "none":
        return []
    return [int(x) if x.strip().lstrip("-").isdigit() else x.strip() for x in s.split(",") if x.strip()]


def non_negative_number(s: str) -> float:
    return _number(s, "a number >= 0", lambda v: v >= 0 and v != float("inf"))


def int_list(s: str) -> list[int]:
    try:
        return [int(t) for t in s.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


# ---- engine flags -------------------------------------------------------------------------------

_DEFAULTS = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
             for f in dataclasses.fields(EngineArgs)
             if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def add_engine_args(parser: argparse.ArgumentParser, exclude: dict[str, str] | None = None
                    ) -> argparse.ArgumentParser:
    """The EngineArgs flags, in a group of their own; defaults are EngineArgs'. ``exclude``:
    fields the command sets itself -> why; their flags are refused with that reason."""
    g = parser.add_argument_group("engine")
    exclude = exclude or {}

    def flag(name: str, **kw):  # --kebab-case of the field, its dataclass default
        option = "--" + name.replace("_", "-")
        if name in exclude:
            refuse = [option] + ([f"--no-{option[2:]}"] if kw.get("action") is argparse.BooleanOptionalAction else [])
            g.add_argument(*refuse, action=_Refused, nargs=0 if "action" in kw else None,
                           reason=exclude[name], help=argparse.SUPPRESS)
            return
        g.add_argument(option, default=_DEFAULTS.get(name, []), **kw)

    flag("model", help="HF model dir, .gguf file, shipped config name (with --load-format dummy, see "
                       "tqattn/configs/models/), or 'default' (SmolLM2-135M-Instruct GGUF)")
    flag("load_format", choices=LOAD_FORMATS, help="dummy: random weights from the model's config")
    flag("dtype", choices=DTYPES, help="model dtype; auto = float32 on CPU, the config's dtype on GPU")
    flag("kv_cache_dtype", type=kv_cache_dtype,
         help="auto (the model dtype) or a TurboQuant preset (`tqattn presets`); recommended: tq_k4v3")
    flag("kv_cache_dtype_skip_layers", type=skip_layers,
         help="layers kept full precision: comma-separated indices, 'sliding_window' and/or "
              "'auto' (the layers the start-up calibration finds the preset cannot hold; the "
              "default), or 'none'")
    flag("kv_cache_key_centering", action=argparse.BooleanOptionalAction,
         help="subtract each layer's mean key (from the start-up calibration) before compressing "
              "keys: on every layer, or off (default: the layers whose calibration error it at least "
              "halves; never on models that soft-cap attention logits)")
    flag("kv_cache_auto_skip_budget", type=non_negative_number,
         help="the most extra cache bytes 'auto' may spend on full-precision layers, as a share of "
              "the all-compressed cache (full precision counted at 16 bits)")
    flag("kv_cache_boundary_layers", type=non_negative_int,
         help="keep the first and last N layers full precision")
    flag("max_model_len", type=positive_int,
         help="prompt + generated tokens per request (default: the model's max_position_embeddings)")
    flag("max_num_seqs", type=positive_int, help="sequences running at once")
    flag("max_num_batched_tokens", type=positive_int, help="token budget of one step (decodes + prefill chunks)")
    flag("block_size", type=positive_int, help="tokens per KV-cache block")
    flag("enable_prefix_caching", action=argparse.BooleanOptionalAction,
         help="reuse cached blocks of shared prompt prefixes")
    flag("enable_chunked_prefill", action=argparse.BooleanOptionalAction,
         help="split long prompts over several steps")
    flag("kv_cache_memory_bytes", type=num_bytes,
         help="KV-cache budget, e.g. 256M or 2G (default: 1 GiB on CPU, what --gpu-memory-utilization "
              "leaves on GPU)")
    flag("gpu_memory_utilization", type=probability,
         help="share of GPU memory for weights, activations and the KV cache")
    flag("num_gpu_blocks_override", type=positive_int, help="exact number of KV-cache blocks (overrides the budgets)")
    flag("device", type=device, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    flag("enforce_eager", action="store_true", help="no compiled model, no CUDA graphs")
    flag("compile_model", action=argparse.BooleanOptionalAction,
         help="torch.compile the model at start-up (default: on CUDA unless --enforce-eager)")
    flag("kv_cache_pad_head_size", action=argparse.BooleanOptionalAction,
         help="store compressed caches of head sizes the tensor-core decode kernel lacks (80, 96) "
              "zero-padded to the next it runs (128): its speed, for 1.6x / 1.33x the bytes per "
              "token (default: where that kernel then runs them: sm_80+ GPUs, GQA group <= 8)")
    flag("fuse_projections", action=argparse.BooleanOptionalAction,
         help="run the q/k/v projections as one GEMM and the gate/up projections as another "
              "(default: on CUDA without tensor parallelism)")
    flag("async_scheduling", action=argparse.BooleanOptionalAction,
         help="launch each step before reading the previous step's tokens, overlapping host and "
              "device work (default: on CUDA)")
    flag("seed", type=seed, help="engine seed (weights of dummy models, sampling of unseeded requests)")
    flag("tensor_parallel_size", type=positive_int,
         help="split the model over N processes (one GPU each, cuda:0..N-1; gloo ranks on CPU): "
              "N must divide the attention heads, and divide or be a multiple of the KV heads")
    return parser


class _Refused(argparse.Action):
    """A flag the command sets itself: using it is an error that says why."""

    def __init__(self, option_strings, dest, reason: str = "", **kw):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kw)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not taken here: {self.reason}")


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments from the parsed flags, checked by EngineArgs (raises ValueError)."""
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(args, f.name)}
    EngineArgs(**kwargs)
    return kwargs


# ---- sampling flags -----------------------------------------------------------------------------

def add_sampling_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The SamplingParams flags with the command-line defaults (greedy, CLI_MAX_TOKENS tokens);
    a subcommand that needs others calls ``parser.set_defaults(...)`` after this."""
    g = parser.add_argument_group("sampling (defaults of the command line; Python's SamplingParams() "
                                  "samples at temperature 1.0, max_tokens 16)")
    g.add_argument("--max-tokens", type=positive_int, default=CLI_MAX_TOKENS, help="tokens to generate at most")
    g.add_argument("--min-tokens", type=non_negative_int, default=0,
                   help="end-of-sequence and stop tokens are ignored before this many tokens")
    g.add_argument("--temperature", type=temperature, default=CLI_TEMPERATURE, help="0 = greedy")
    g.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling: keep this much probability mass")
    g.add_argument("--top-k", type=top_k, default=0, help="keep the k most likely tokens (0 or -1: all)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeatable)")
    g.add_argument("--stop-token-ids", type=int_list, default=[], metavar="IDS",
                   help="comma-separated token ids that end generation")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after end-of-sequence")
    return parser


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the parsed flags (raises ValueError, e.g. min_tokens > max_tokens).

    Sampled (temperature > 0) requests are seeded with --seed when the parser has one, so a
    command's output is reproducible.
    """
    seed = getattr(args, "seed", None)
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                          stop=list(args.stop) or None, stop_token_ids=list(args.stop_token_ids),
                          ignore_eos=args.ignore_eos, seed=seed if args.temperature > 0 else None)
