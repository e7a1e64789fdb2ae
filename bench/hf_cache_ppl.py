"""Perplexity through transformers caches: TurboQuantCache vs QuantizedCache (quanto, HQQ).

Same text, same model, same protocol for every cache: windows of ``--context`` tokens; the first
``--prefix`` tokens of a window go through the model in one forward (every cache returns a first
update raw), the rest in consecutive chunks of ``--chunk`` tokens through the cache (each chunk
attends to the cache's history plus its own tokens raw); every position from ``--prefix`` on is
scored. KL and top-1 agreement are against DynamicCache on the same windows; bytes per token
beyond the residual window are counted from the tensors each cache holds at the end of a window
(packed codes + scales/zero points + norms), per layer summed over the model.

    PYTHONPATH=. python3 bench/hf_cache_ppl.py --out bench/results/hf_cache_ppl_smollm2.json
    PYTHONPATH=. python3 bench/hf_cache_ppl.py --sweep --out bench/results/hf_cache_window_smollm2.json

``--sweep``: TurboQuantCache tq_k4v3 at several residual windows (the default window's source).
QuantizedCache needs ``optimum-quanto`` / ``hqq`` (``pip install optimum-quanto hqq``); a backend
that is not installed is reported as such and skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore", category=FutureWarning)


def _nbytes(obj) -> int:
    """Bytes of every tensor inside obj (quanto's QTensor subclasses, HQQ's (W_q, meta) pairs)."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(_nbytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def quantized_bytes_per_token(cache) -> tuple[float, int]:
    """(bytes per compressed token summed over layers, compressed tokens) of a finished window."""
    from tqattn.integrations.transformers import TurboQuantLayer

    total, tokens = 0, None
    for layer in cache.layers:
        if isinstance(layer, TurboQuantLayer):
            b, n = layer.stored_bytes()["compressed"], layer.num_compressed_tokens
        else:  # transformers' QuantizedLayer: everything not in the residual keys is quantized
            b = _nbytes(layer._quantized_keys) + _nbytes(layer._quantized_values)
            n = layer.get_seq_length() - (layer.keys.shape[-2] if layer.keys.dim() == 4 else 0)
        total += b
        tokens = n if tokens is None else min(tokens, n)
    return (total / tokens if tokens else float("nan")), tokens


def make_cache(spec: dict, config):
    from transformers import DynamicCache, QuantizedCache

    from tqattn.integrations.transformers import TurboQuantCache

    kind = spec["kind"]
    if kind == "dynamic":
        return DynamicCache(config=config)
    if kind == "tq":
        return TurboQuantCache(config, spec["preset"], residual_length=spec["residual_length"])
    return QuantizedCache(backend=kind, config=config, nbits=spec["nbits"],
                          residual_length=spec["residual_length"],
                          q_group_size=spec.get("q_group_size", 64),
                          axis_key=spec.get("axis_key", 0), axis_value=spec.get("axis_value", 0))


@torch.inference_mode()
def run_window(model, ids: list[int], cache, prefix: int, chunk: int) -> tuple[torch.Tensor, object]:
    """Log-probs (len(ids) - prefix, vocab) of the positions from ``prefix`` on."""
    from tqattn.integrations.transformers import CACHE_ARGUMENT

    x = torch.tensor([ids])
    out = model(input_ids=x[:, :prefix], use_cache=True, **{CACHE_ARGUMENT: cache})
    rows = [out.logits[0, -1:].float()]
    for s in range(prefix, len(ids) - 1, chunk):   # the last token is only a target
        e = min(s + chunk, len(ids) - 1)
        out = model(input_ids=x[:, s:e], use_cache=True, **{CACHE_ARGUMENT: cache})
        rows.append(out.logits[0].float())
    return torch.log_softmax(torch.cat(rows), -1), cache


def specs(args) -> list[dict]:
    if args.sweep:
        return [dict(name=f"tq_k4v3 R={r}", kind="tq", preset="tq_k4v3", residual_length=r)
                for r in args.windows]
    out = [dict(name=f"TurboQuantCache tq_k4v3 R={args.residual}", kind="tq", preset="tq_k4v3",
                residual_length=args.residual)]
    for backend in ("quanto", "hqq"):
        for nbits in (4, 2):
            out.append(dict(name=f"QuantizedCache {backend} {nbits}-bit R={args.residual}",
                            kind=backend, nbits=nbits, residual_length=args.residual))
    return out


def available(kind: str) -> str | None:
    mod = {"quanto": "optimum.quanto", "hqq": "hqq"}.get(kind)
    if mod is None:
        return None
    try:
        found = importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"{mod} is not installed"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--windows-count", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--residual", type=int, default=128, help="residual window of every cache")
    ap.add_argument("--sweep", action="store_true", help="tq_k4v3 at --windows residual lengths")
    ap.add_argument("--windows", type=lambda s: [int(x) for x in s.split(",")],
                    default=[0, 16, 32, 64, 128, 256])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import transformers

    from tqattn.evals.data import shakespeare_text
    from tqattn.evals.ppl import make_windows
    from tqattn.models import load_model

    lm = load_model(args.model)
    model, tok = lm.model, lm.tokenizer
    ids = tok(shakespeare_text())["input_ids"]
    windows = make_windows(ids, args.windows_count, args.context)
    tgt = [torch.tensor(w[args.prefix:]) for w in windows]  # row j predicts token prefix + j

    t0 = time.time()
    ref = [run_window(model, w, make_cache({"kind": "dynamic"}, model.config), args.prefix,
                      args.chunk)[0] for w in windows]
    ref_nll = torch.cat([-r.gather(1, t[:, None])[:, 0] for r, t in zip(ref, tgt)])
    rows = [dict(name="DynamicCache (bf16-equivalent reference, fp32 here)", kind="dynamic",
                 ppl=math.exp(ref_nll.mean().item()), seconds=round(time.time() - t0, 1))]
    print(rows[-1], flush=True)
    bf16_bytes = 2 * 2 * lm.info.num_kv_heads * lm.info.head_dim * lm.info.num_layers
    for spec in specs(args):
        why = available(spec["kind"])
        if why:
            rows.append(dict(spec, skipped=why))
            print(rows[-1], flush=True)
            continue
        t0 = time.time()
        nll, kl, agree, bpt = [], [], [], []
        for w, r, t in zip(windows, ref, tgt):
            lp, cache = run_window(model, w, make_cache(spec, model.config), args.prefix, args.chunk)
            nll.append(-lp.gather(1, t[:, None])[:, 0])
            kl.append((r.exp() * (r - lp)).sum(-1))
            agree.append((r.argmax(-1) == lp.argmax(-1)).float())
            bpt.append(quantized_bytes_per_token(cache)[0])
        nll, kl, agree = torch.cat(nll), torch.cat(kl), torch.cat(agree)
        ppl = math.exp(nll.mean().item())
        row = dict(spec, ppl=ppl, ppl_delta_pct=100 * (ppl / rows[0]["ppl"] - 1),
                   kl=kl.mean().item(), top1=agree.mean().item(),
                   bytes_per_token=sum(bpt) / len(bpt),
                   bits_per_element=8 * sum(bpt) / len(bpt) / (bf16_bytes / 2),
                   seconds=round(time.time() - t0, 1))
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

    env = dict(machine=platform.machine(), python=platform.python_version(),
               torch=torch.__version__, transformers=transformers.__version__,
               threads=args.threads, date=time.strftime("%Y-%m-%d"),
               quanto=_version("optimum-quanto"), hqq=_version("hqq"))
    result = dict(command="PYTHONPATH=. python3 bench/hf_cache_ppl.py " + " ".join(sys.argv[1:]),
                  env=env, model=args.model, text="Shakespeare (tqattn.evals.data)",
                  windows=args.windows_count, context=args.context, prefix=args.prefix,
                  chunk=args.chunk, scored_tokens=int(ref_nll.numel()),
                  bf16_bytes_per_token=bf16_bytes, rows=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def markdown(result: dict) -> str:
    lines = ["| cache | bytes/token beyond window | bits/element | PPL | PPL Δ % | KL | top-1 |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r.get("skipped"):
            lines.append(f"| {r['name']} | skipped: {r['skipped']} | | | | | |")
        elif r["kind"] == "dynamic":
            lines.append(f"| {r['name']} | {result['bf16_bytes_per_token']} (bf16) | 16 | "
                         f"{r['ppl']:.3f} | — | — | — |")
        else:
            lines.append(f"| {r['name']} | {r['bytes_per_token']:.0f} | {r['bits_per_element']:.2f} | "
                         f"{r['ppl']:.3f} | {r['ppl_delta_pct']:+.2f} | {r['kl']:.4f} | {r['top1']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
