"""The ``tqattn`` command line. Subcommands import what they need lazily."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys


def _print_table(rows: list[dict], cols: list[tuple[str, str]]) -> None:
    from .text_table import format_table

    print(format_table([h for _, h in cols], [[_fmt(r.get(k)) for k, _ in cols] for r in rows]))


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return "" if x is None else str(x)


def cmd_presets(args) -> int:
    from .quant.presets import PRESETS
    from .quant.report import preset_row

    rows = [preset_row(name, args.head_dim) for name in PRESETS]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"KV-cache presets at head size {args.head_dim} (bytes per token per KV head; "
          f"bf16 K+V = {4 * args.head_dim})")
    for r in rows:
        if not r["supported"]:
            r["description"] = f"UNSUPPORTED: {r['unsupported_reason']}"
    _print_table(rows, [("preset", "preset"), ("slot_bytes", "bytes"),
                        ("bits_per_element", "bits/elem"), ("compression_vs_bf16", "vs bf16"),
                        ("key_codec", "keys"), ("key_bits", "k bits"), ("value_codec", "values"),
                        ("value_bits", "v bits"), ("description", "notes")])
    return 0


def cmd_codec_report(args) -> int:
    from .quant.report import codec_report

    rep = codec_report(args.head_dim, list(dict.fromkeys(args.preset or [])) or None, seed=args.seed)
    if args.json:
        from .evals.cli import command_line

        rep["command"] = command_line()
        print(json.dumps(rep, indent=1))
        return 0
    print(f"Codec report, head size {args.head_dim}: heavy-tailed keys with outlier channels "
          f"(gaussian-data attention cosine in the last column)")
    for r in rep["presets"]:
        r["gauss_cos"] = r["gaussian"]["attn_cosine"]
    _print_table(rep["presets"], [("preset", "preset"), ("slot_bytes", "bytes"),
                                  ("bits_per_element", "bits/elem"), ("key_mse", "key mse"),
                                  ("ip_rel_err", "ip rel err"), ("ip_bias", "ip bias"),
                                  ("value_mse", "value mse"), ("attn_cosine", "attn cos"),
                                  ("gauss_cos", "attn cos (gauss)")])
    print("\nExact-law key codebooks (levels in units of 1/sqrt(d)):")
    _print_table(rep["key_codebook"], [("bits", "bits"), ("key_mse", "mse"),
                                       ("theory_mse", "theory"), ("levels", "levels")])
    for name, reason in rep["unsupported"].items():
        print(f"not measured: {name}: {reason}")
    return 0


def cmd_env(args) -> int:
    from .attention.env_report import collect_env, format_env

    env = collect_env()
    print(json.dumps(env, indent=1, default=str) if args.json else format_env(env))
    return 0


def cmd_generate(args) -> int:
    import time

    from .engine.arg_utils import engine_kwargs_from_args, sampling_params_from_args

    # everything a user can get wrong is checked before the model loads
    engine_kwargs = engine_kwargs_from_args(args)
    params = sampling_params_from_args(args)
    token_prompts = [{"prompt_token_ids": _token_ids(p)} for p in args.prompt] if args.token_ids else None
    from .evals.cli import progress_bars

    progress_bars(not args.json and sys.stderr.isatty())

    from .engine.llm import LLM
    from .engine.llm_engine import format_plan

    llm = LLM(**engine_kwargs)
    engine = llm.llm_engine
    chat = token_prompts is None and not args.no_chat and bool(getattr(llm.tokenizer, "chat_template", None))
    if args.stream:
        return _generate_stream(args, llm, params, token_prompts, chat)
    use_tqdm = not args.json and len(args.prompt) > 1 and sys.stderr.isatty()
    start = time.perf_counter()
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=use_tqdm)
    else:
        outputs = llm.generate(token_prompts or list(args.prompt), params, use_tqdm=use_tqdm)
    end = time.perf_counter()
    _warn_empty_replies(llm, outputs, chat)

    first = max(o.metrics.first_token_time for o in outputs)
    n_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    n_decode = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    timings = {"load_s": engine.load_time, "generate_s": end - start, "prefill_s": first - start,
               "prefill_tok_s": n_prompt / max(first - start, 1e-9),
               "decode_s": end - first,
               "decode_tok_s": n_decode / max(end - first, 1e-9) if n_decode else None}
    if args.json:
        print(json.dumps({
            "model": engine.loaded.name, "device": str(engine.device), "dtype": str(engine.loaded.dtype),
            "kv_cache_dtype": args.kv_cache_dtype, "chat_template": chat, "cache_plan": engine.plan,
            "timings": timings,
            "outputs": [{"prompt": p, "prompt_token_ids": o.prompt_token_ids, "token_ids": o.outputs[0].token_ids,
                         "text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason}
                        for p, o in zip(args.prompt, outputs)]}, indent=1))
        return 0
    print(format_plan(engine.plan))
    decode = f"{timings['decode_tok_s']:.1f} tok/s" if n_decode else "- (no decode step)"
    print(f"load {timings['load_s']:.1f} s, prefill {timings['prefill_tok_s']:.1f} tok/s, decode {decode}")
    for p, o in zip(args.prompt, outputs):
        c = o.outputs[0]
        print(f"\n>>> {p}\n{c.text if llm.tokenizer is not None else c.token_ids}")
    return 0


def _generate_stream(args, llm, params, token_prompts, chat: bool) -> int:
    """--stream: the plan, then each prompt's reply as it is generated, one prompt after another."""
    from .engine.llm_engine import format_plan

    print(format_plan(llm.llm_engine.plan))
    for i, p in enumerate(args.prompt):
        print(f"\n>>> {p}", flush=True)
        if chat:
            pieces = llm.stream_chat([{"role": "user", "content": p}], params)
        else:
            pieces = llm.stream(token_prompts[i] if token_prompts else p, params)
        last = None
        for last in pieces:
            text = last.text if llm.tokenizer is not None else "".join(f" {t}" for t in last.token_ids)
            print(text, end="", flush=True)
        print(flush=True)
        if last is not None:
            _warn_empty_replies(llm, [last.output], chat)
    return 0


def cmd_serve(args) -> int:
    from .engine.arg_utils import engine_kwargs_from_args
    from .serve.frontend import uvicorn_module

    engine_kwargs = engine_kwargs_from_args(args)  # checked before the model loads
    uvicorn_module()  # the extra is installed
    from .evals.cli import progress_bars

    progress_bars(sys.stderr.isatty())
    from .engine.llm_engine import EngineArgs, LLMEngine
    from .serve.server import Server, bind, startup_message

    try:  # before the model loads: a taken port or a bad host fails in a second, not minutes
        sock = bind(args.host, args.port)
    except OSError as e:
        raise OSError(f"could not serve on {args.host}:{args.port}: {e}") from None
    try:
        engine = LLMEngine(EngineArgs(**engine_kwargs))
        server = Server(engine, args.host, args.port, args.served_model_name, args.max_waiting_requests,
                        args.request_timeout, log_level=args.uvicorn_log_level, sock=sock)
    except BaseException:
        sock.close()
        raise
    signal.signal(signal.SIGTERM, _interrupt)  # stop as on Ctrl-C: abort requests, close the socket
    try:
        try:
            server.start()
        except RuntimeError as e:  # the front end failed to start: it logged why
            raise OSError(f"could not serve on {args.host}:{args.port}: {e}") from None
        print(startup_message(server), flush=True)
        code = server.wait()
        # only a stop of ours ends the front end: anything else is a failure to report
        print(f"tqattn: the HTTP front end exited (code {code}); stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tqattn: shutting down", file=sys.stderr)
    finally:
        server.stop()
    return 0


def _interrupt(*_):
    raise KeyboardInterrupt


def cmd_chat(args) -> int:
    from .engine.arg_utils import engine_kwargs_from_args, sampling_params_from_args

    engine_kwargs = engine_kwargs_from_args(args)
    params = sampling_params_from_args(args)
    from .evals.cli import progress_bars

    progress_bars(sys.stderr.isatty())
    from .engine.llm import LLM

    llm = LLM(**engine_kwargs)
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError(f"model {llm.llm_engine.loaded.name} has no chat template; `tqattn chat` needs one "
                         f"(use `tqattn generate --no-chat` for plain text)")
    from .engine.llm_engine import format_plan

    print(format_plan(llm.kv_cache_plan))
    print("Type a message and press Enter; /reset starts over, /exit (or Ctrl-D) quits.", flush=True)
    return chat_loop(llm, params, args.system, input_fn=lambda: input("you> "))


def chat_loop(llm, params, system: str | None, input_fn, write=None) -> int:
    """The conversation: each line is a user turn, the reply streams back; history is kept."""
    write = write or (lambda s: print(s, end="", flush=True))
    history = [{"role": "system", "content": system}] if system else []
    base = len(history)
    while True:
        try:
            line = input_fn()
        except EOFError:
            write("\n")
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            del history[base:]
            write("(conversation cleared)\n")
            continue
        history.append({"role": "user", "content": line})
        write("assistant> ")
        reply = []
        try:
            for piece in llm.stream_chat(history, params):
                reply.append(piece.text)
                write(piece.text)
        except ValueError as e:  # e.g. the conversation outgrew max_model_len: say so, keep going
            history.pop()
            write(f"\ntqattn: error: {' '.join(str(e).split())}; /reset starts over\n")
            continue
        except KeyboardInterrupt:  # stop this reply (the stream aborts its request), keep the chat
            write(" [interrupted]")
        write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})


def _warn_empty_replies(llm, outputs, chat: bool) -> None:
    """Say why a reply is empty: the model's first token ended it (often a chat model fed plain
    text, which it reads as a finished user turn and answers with its end-of-turn token)."""
    tok = llm.tokenizer
    for i, o in enumerate(outputs):
        c = o.outputs[0]
        if c.text.strip() or c.finish_reason != "stop" or len(c.token_ids) > 1:
            continue
        first = tok.convert_ids_to_tokens(c.token_ids[0]) if tok is not None and c.token_ids else c.token_ids
        hint = ("this model has a chat template and --no-chat sent the prompt as plain text, which "
                "it reads as a finished user turn; drop --no-chat, or " if not chat and
                getattr(tok, "chat_template", None) else "")
        _warn(f"prompt {i + 1} got an empty reply: the model's first token was end-of-sequence "
              f"({first!r}); {hint}pass --min-tokens N to make it continue")


def _token_ids(s: str) -> list[int]:
    try:
        ids = [int(t) for t in s.replace(",", " ").split()]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise ValueError(f"--token-ids: {s!r} is not a comma-separated list of token ids (integers >= 0)")
    return ids


def _warn(msg: str) -> None:
    print(f"tqattn: warning: {msg}", file=sys.stderr)


class _LogFormatter(logging.Formatter):
    # the same shape as the command's own lines: "tqattn: warning: ..."
    def format(self, record):
        text = f"tqattn: {record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info:  # logger.exception: the traceback is what finds the bug
            text += "\n" + self.formatException(record.exc_info)
        return text


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None / False / empty (the help says what that means)."""

    def _get_help_string(self, action):
        d = action.default
        if d is None or d is False or d is argparse.SUPPRESS or (isinstance(d, list) and not d):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """A bad flag is one line on stderr (no usage dump) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


GENERATE_DESCRIPTION = """\
Generate text. Prompts are chat-formatted when the model has a chat template (--no-chat sends
them as plain text). Command-line sampling defaults: greedy (--temperature 0), up to 64 tokens;
SamplingParams() in Python defaults to temperature 1.0 and max_tokens 16 (vLLM's)."""


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .engine.arg_utils import add_engine_args, add_sampling_args

    ap = Parser(prog="tqattn", description="TurboQuant KV-cache attention", formatter_class=HelpFormatter)
    ap.add_argument("--version", action="version", version=f"tqattn {__version__}")
    ap.add_argument("--debug", action="store_true",
                    help="show the Python traceback of an error (also: TQATTN_DEBUG=1)")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("presets", help="list KV-cache presets with exact byte accounting")
    p.add_argument("--head-dim", type=_head_dim, default=128, help="head size (an even integer >= 8)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("codec-report", help="measure each preset's quantization quality")
    p.add_argument("--head-dim", type=_report_head_dim, default=128,
                   help=f"head size (an even integer, 8 to {MAX_REPORT_HEAD_DIM})")
    p.add_argument("--preset", action="append", type=_preset_name,
                   help="preset to measure (repeatable; default: every preset that encodes the head size)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_codec_report)

    p = sub.add_parser("env", help="device, FlashAttention versions and the version chosen")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("generate", help="generate text with a model (default: embedded SmolLM2-135M)",
                       description=GENERATE_DESCRIPTION)
    p.add_argument("prompt", nargs="+", help="prompt text (chat-formatted when the model has a template)")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--no-chat", action="store_true", help="send prompts as plain text, no chat template")
    p.add_argument("--token-ids", action="store_true",
                   help="each PROMPT is a comma-separated list of token ids (models without a tokenizer)")
    out = p.add_mutually_exclusive_group()  # --json prints one document at the end
    out.add_argument("--json", action="store_true",
                     help="print tokens, text, timings and the cache plan as JSON (stdout holds only the JSON)")
    out.add_argument("--stream", action="store_true",
                     help="print each reply as it is generated (prompts run one after another)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="an interactive conversation in the terminal (streams the replies)",
                       description="Chat with a model in the terminal: each line is a user turn, the "
                                   "reply streams back, the conversation is kept (/reset, /exit).")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(max_tokens=512)
    p.add_argument("--system", metavar="TEXT", help="a system message at the start of the conversation")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)",
                       description="Serve the model over OpenAI's API: /v1/completions, "
                                   "/v1/chat/completions (both with stream=true), /v1/models, "
                                   "/health, /metrics (Prometheus).")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=_port, default=8000, help="TCP port (0: any free port)")
    g.add_argument("--served-model-name", help="the model name of the API (default: the model's name)")
    g.add_argument("--max-waiting-requests", type=_positive, default=256,
                   help="requests that may wait for a slot; past it new ones get 503 with Retry-After")
    g.add_argument("--request-timeout", type=_seconds, default=None,
                   help="abort a request after this many seconds (default: no limit)")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (info logs every request)")
    p.set_defaults(func=cmd_serve)
    from .evals.cli import add_eval_parser

    add_eval_parser(sub)
    from .benchmarks.cli import add_bench_parser

    add_bench_parser(sub)
    _for_every_subcommand(ap, _common_subcommand_options)
    return ap


def _for_every_subcommand(parser: argparse.ArgumentParser, fn) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                fn(sub)
                _for_every_subcommand(sub, fn)


def _common_subcommand_options(p: argparse.ArgumentParser) -> None:
    # --help of every subcommand shows defaults; --debug works after the subcommand too
    p.formatter_class = HelpFormatter
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the Python traceback of an error (also: TQATTN_DEBUG=1)")


def _head_dim(s: str) -> int:
    try:
        d = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"head size must be an integer, got {s!r}") from None
    if d < 8 or d % 2:
        raise argparse.ArgumentTypeError(f"head size {d} not supported: need an even integer >= 8")
    return d


# The report builds head size x head size rotations and thousands of vectors per preset.
MAX_REPORT_HEAD_DIM = 1024


def _report_head_dim(s: str) -> int:
    d = _head_dim(s)
    if d > MAX_REPORT_HEAD_DIM:
        raise argparse.ArgumentTypeError(f"head size {d} is above {MAX_REPORT_HEAD_DIM}, the largest "
                                         f"the codec report measures")
    return d


def _port(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = -1
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [0, 65535], got {s!r}")
    return v


def _seconds(s: str) -> float:
    from .engine.arg_utils import _number

    return _number(s, "a finite number of seconds > 0", lambda v: 0 < v < float("inf"))


def _positive(s: str) -> int:
    from .engine.arg_utils import positive_int

    return positive_int(s)


def _preset_name(s: str) -> str:
    from .quant.presets import get_preset

    try:
        return get_preset(s).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# Errors that come from what the user asked for (a value, a path, a missing package or opt-in);
# anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError, ImportError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("TQATTN_DEBUG", "") not in ("", "0")
    handler = logging.StreamHandler()
    handler.setFormatter(_LogFormatter())
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, inside the handler
        return rc
    except BrokenPipeError:
        # `tqattn presets | head`: the reader left; stop quietly, as a SIGPIPE'd tool would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        if debug:
            raise
        print("tqattn: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        if debug:
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"tqattn: error: {msg} (--debug shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
