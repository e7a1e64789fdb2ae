"""Lab: bench/model_step.py under a variant of Inductor's settings (issue 24: the decode step's
small fused elementwise kernels, 6 a Qwen3-4B layer), one variant per process:

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TORCH_LOGS=fusion,output_code \
        python3 bench/lab/inductor_variants.py VARIANT -- --skip-trivial --sizes 1,256 \
        --kv-cache-dtypes turboquant_k3v4_nc --profile --out $OUT/VARIANT.json

Variants (joined with '+'): main (the engine's settings), persist (persistent reductions up to
8,192 elements, Inductor's own limit being 1,024 for inner reductions: RMSNorm over 2,560),
aggr (``aggressive_fusion``), notile (the fusions a 2-D tiling would prevent allowed:
``triton.tiling_prevents_*_fusion`` off), noemu (``emulate_precision_casts`` off, a diagnostic:
the engine needs it), unbacked (the token dimension unbacked, the engine's setting before
session 31, when this script's 'backed' variant, the engine's since, measured 0.6 ms faster at
256 tokens: bench/results/inductor_variants_h100_s31.json). Give each process its own Inductor
cache: the persist patch is not in the cache key.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def apply(variant: str) -> None:
    import torch
    import torch._inductor.config as ic
    from torch._inductor import choices

    from tqattn.engine import compilation

    for part in variant.split("+"):
        if part == "main":
            continue
        if part == "aggr":
            ic.aggressive_fusion = True
        elif part == "notile":
            ic.triton.tiling_prevents_reduction_fusion = False
            ic.triton.tiling_prevents_pointwise_fusion = False
        elif part == "unbacked":  # the engine's marking before session 31
            compilation._mark_tokens = functools.partial(
                compilation._mark_tokens, mark=torch._dynamo.decorators.mark_unbacked)
        elif part == "noemu":
            compilation.INDUCTOR_OPTIONS["emulate_precision_casts"] = False
        elif part == "persist":
            orig = choices.InductorChoices.should_use_persistent_reduction

            def persistent(features, cooperative_reduction, _orig=orig):
                if _orig(features, cooperative_reduction):
                    return True
                n = features.reduction_numel
                return (not cooperative_reduction and getattr(n, "is_number", False)
                        and int(n) <= 8192)
            choices.InductorChoices.should_use_persistent_reduction = staticmethod(persistent)
        else:
            raise SystemExit(f"unknown variant part {part!r}: main, persist, aggr, notile, "
                             "noemu, unbacked")


if __name__ == "__main__":
    argv = sys.argv[1:]
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit(__doc__)
    apply(argv[0])
    from bench import model_step
    sys.argv = [sys.argv[0]] + argv[2:]
    raise SystemExit(model_step.main())
