"""Tensor parallelism against one process: the same model, weights and cache, N ranks vs one.

Per case (model, kv-cache dtype, ranks): teacher-forced log-probs of random token ids at each
chunk size (1: the decode path, every query reading the cache; larger: prefill and
continuations) — max |difference|, top-1 agreement, mean cosine of the centred rows (the logits
less their mean) — and greedy generations of a few prompts: how many are identical, and where
one is not, one process's top-2 margin at its first difference. Each engine's start-up seconds.

CPU (2 cores; ~2 min, ~3 min compiled, ~9 min for SmolLM2 on three ranks), the files of
bench/results/ (README, Tensor parallelism):

    PYTHONPATH=. python bench/tp_agreement.py --device cpu \\
        --cases llama-tiny:auto:2,qwen3-tiny:tq_k4v3:2 --out bench/results/tp_agreement_cpu
    PYTHONPATH=. python bench/tp_agreement.py --device cpu --compile --cases qwen3-tiny:tq_k4v3:2 \\
        --out bench/results/tp_agreement_cpu_compiled
    PYTHONPATH=. python bench/tp_agreement.py --device cpu --cases default:tq_k4v3:3 --tokens 128 \\
        --out bench/results/tp_agreement_cpu_smollm2

``--noise-floor EPS`` runs no ranks: one process against itself with every o_proj weight scaled
by (1 + EPS * N(0, 1)), the yardstick for a difference N ranks show (a TurboQuant cache turns a
rounding-level change into a few flipped codes):

    PYTHONPATH=. python bench/tp_agreement.py --device cpu --noise-floor 1e-7 --tokens 128 \\
        --cases default:tq_k4v3,default:auto,qwen3-tiny:tq_k4v3 --out bench/results/tp_noise_floor_cpu

GPU (two GPUs, machine kind nvidia-h100-x2; compiled with decode CUDA graphs, the default):

    PYTHONPATH=. python bench/tp_agreement.py --device cuda --dtype bfloat16 --tokens 512 \\
        --cases Llama-3.1-8B:auto:2,Llama-3.1-8B:turboquant_k3v4_nc:2 --out $OUT/tp_agreement_h100x2

Shipped config names run with dummy weights; "default" is the embedded SmolLM2 GGUF.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqattn import LLM, SamplingParams  # noqa: E402
from tqattn.models.configs import list_model_configs  # noqa: E402


def _env() -> dict:
    from tqattn.attention.env_report import collect_env

    env = {k: v for k, v in collect_env().items() if k in ("torch", "triton", "transformers", "tqattn")}
    device = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
              else f"CPU, {os.cpu_count()} cores")
    return {**env, "device": device, "python": platform.python_version(), "gpus": torch.cuda.device_count(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python"] + sys.argv)}


def _agreement(lp: torch.Tensor, ref: torch.Tensor) -> dict:
    a, b = lp - lp.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True)
    return {"max_abs_logprob_diff": (lp - ref).abs().max().item(),
            "top1_agreement": (lp.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "centred_cosine": torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()}


def _inputs(model: str, common: dict, args) -> tuple[list[int], list[list[int]]]:
    """Random token ids below the model's vocabulary: the scored sequence and the prompts."""
    from tqattn.models import load_config
    from tqattn.models.info import model_info

    vocab = model_info(load_config(model, common.get("load_format", "auto"))).vocab_size
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(3, vocab, (args.tokens,), generator=g).tolist()
    return ids, [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 40, 90)]


def _run(model: str, kwargs: dict, ids: list[int], prompts: list[list[int]], args) -> tuple[LLM, dict]:
    t = time.perf_counter()
    llm = LLM(model, **kwargs)
    startup = time.perf_counter() - t
    scores = {c: llm.score(ids, chunk_size=c) for c in args.chunks}
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return llm, {"scores": scores, "tokens": [list(o.outputs[0].token_ids) for o in outs],
                 "startup_s": startup, "generate_s": time.perf_counter() - t,
                 "plan": {k: v for k, v in llm.kv_cache_plan.items() if k != "groups"}}


def _engine_kwargs(model: str, kv_cache_dtype: str, args) -> dict:
    common = dict(kv_cache_dtype=kv_cache_dtype, device=args.device, dtype=args.dtype,
                  max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                  max_num_seqs=8, max_num_batched_tokens=max(args.chunks), enable_prefix_caching=False,
                  # every layer compressed uncentered on both sides: the figures measure the
                  # sharding alone (the calibration's choices are tested in test_tensor_parallel)
                  kv_cache_key_centering=False, kv_cache_dtype_skip_layers=[])
    if model in list_model_configs():
        common["load_format"] = "dummy"
    if args.compile:
        common["compile_model"] = True
    return common


def run_case(case: str, args) -> dict:
    model, kv_cache_dtype, tp = case.split(":")
    common = _engine_kwargs(model, kv_cache_dtype, args)
    ids, prompts = _inputs(model, common, args)
    one, ref = _run(model, common, ids, prompts, args)
    tp_llm, got = _run(model, dict(common, tensor_parallel_size=int(tp)), ids, prompts, args)
    tp_llm.shutdown()
    del tp_llm
    greedy = []
    for prompt, a, b in zip(prompts, got["tokens"], ref["tokens"]):
        if a == b:
            greedy.append({"identical": True})
            continue
        k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        top2 = torch.topk(one.score(prompt + b[:k])[-1], 2).values
        greedy.append({"identical": False, "first_difference": k, "top2_margin": float(top2[0] - top2[1])})
    del one
    gc.collect()
    return {"case": case, "model": model, "kv_cache_dtype": kv_cache_dtype, "tensor_parallel_size": int(tp),
            "engine_kwargs": common, "num_tokens": len(ids),
            "agreement": {str(c): _agreement(got["scores"][c], ref["scores"][c]) for c in args.chunks},
            "greedy": greedy, "startup_s": {"one": ref["startup_s"], "tp": got["startup_s"]},
            "generate_s": {"one": ref["generate_s"], "tp": got["generate_s"]}, "plan_tp": got["plan"]}


def noise_floor(case: str, args) -> dict:
    """One process against itself with every o_proj weight scaled by (1 + eps * N(0, 1)): how far
    a rounding-level change (what another all-reduce order amounts to) moves the log-probs."""
    model, kv_cache_dtype = case.split(":")[:2]
    common = _engine_kwargs(model, kv_cache_dtype, args)
    ids, _ = _inputs(model, common, args)
    llm = LLM(model, **common)
    ref = {c: llm.score(ids, chunk_size=c) for c in args.chunks}
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, w in llm.llm_engine.loaded.model.named_parameters():
            if name.endswith("o_proj.weight"):
                w.mul_(1 + args.noise_floor * torch.randn(w.shape, generator=g).to(w))
    got = {c: llm.score(ids, chunk_size=c) for c in args.chunks}
    del llm
    gc.collect()
    return {"case": case, "model": model, "kv_cache_dtype": kv_cache_dtype, "engine_kwargs": common,
            "num_tokens": len(ids), "o_proj_relative_noise": args.noise_floor,
            "agreement": {str(c): _agreement(got[c], ref[c]) for c in args.chunks}}


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"# Tensor parallelism against one process ({env['device']})", "",
             f"- command: `{env['command']}`; torch {env.get('torch')}, transformers {env.get('transformers')}, "
             f"python {env['python']}, {env['date']}.", "",
             "| case | chunk | max abs Δ log-prob | top-1 agreement | centred cosine | greedy identical | "
             "start-up s (1 / N) |", "|---|---|---|---|---|---|---|"]
    if "noise_floor" in result:
        lines[-2:] = ["| case | chunk | o_proj noise | max abs Δ log-prob | top-1 agreement | centred cosine |",
                      "|---|---|---|---|---|---|"]
        for r in result["noise_floor"]:
            for c, a in r["agreement"].items():
                lines.append(f"| `{r['case']}` (one process vs itself, perturbed) | {c} | "
                             f"{r['o_proj_relative_noise']:.0e} | {a['max_abs_logprob_diff']:.2g} | "
                             f"{a['top1_agreement']:.4f} | {a['centred_cosine']:.6f} |")
        return "\n".join(lines) + "\n"
    for r in result["cases"]:
        same = sum(g["identical"] for g in r["greedy"])
        notes = "; ".join(f"differs at {g['first_difference']} (margin {g['top2_margin']:.2g})"
                          for g in r["greedy"] if not g["identical"])
        for c, a in r["agreement"].items():
            lines.append(f"| `{r['case']}` | {c} | {a['max_abs_logprob_diff']:.2g} | {a['top1_agreement']:.4f} | "
                         f"{a['centred_cosine']:.6f} | {same}/{len(r['greedy'])}{' ' + notes if notes else ''} | "
                         f"{r['startup_s']['one']:.1f} / {r['startup_s']['tp']:.1f} |")
    lines += ["", "Engine arguments per case are in the JSON (`engine_kwargs`); the case is "
              "model:kv-cache dtype:ranks."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", required=True, help="comma-separated model:kv_cache_dtype:ranks")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compile", action="store_true", help="compile the model (the default on CUDA)")
    p.add_argument("--tokens", type=int, default=256, help="teacher-forced sequence length")
    p.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per prompt")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=64 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise-floor", type=float, metavar="EPS",
                   help="instead of N ranks: one process against itself with o_proj weights scaled "
                        "by (1 + EPS * N(0, 1)), cases model:kv_cache_dtype")
    p.add_argument("--out", required=True, help="path stem: writes .json and .md")
    args = p.parse_args()
    cases = args.cases.split(",")
    result = ({"env": _env(), "noise_floor": [noise_floor(c, args) for c in cases]} if args.noise_floor
              else {"env": _env(), "cases": [run_case(c, args) for c in cases]})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result)
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
