"""Would outlier-split keys reach cosine >= 0.97 at <= 3.7 bits? A CPU simulation, not a codec.

The anchor's synthetic data (q, K, V ~ N(0,1), 4 key channels x8 per KV head; B = 2, L = 4096,
32/8/128) through simulated quantizers, whole-output cosine vs exact attention (fp64):

* ``tq kB vB``: TurboQuant as the presets do it — random rotation, Lloyd–Max codes of the unit
  vector (tqattn.quant.codebook), the reconstruction's norm corrected to the input's ("nc");
* ``outliers kB+n`` keys: the n largest-|k| channels of each token kept as (7-bit index, fp8
  e4m3 value), zeroed before the rotation; the rest as above. Values stay plain TQ.

Bits per element count the codes, one fp16 norm per vector and the outliers' indices + values.
The rotation spreads 4 large channels over all coordinates, so the key's norm (and every
coordinate's quantization error) grows with them; taking them out first is what the outlier
split buys.

    PYTHONPATH=. python3 bench/outlier_keys_sim.py [--out bench/results/outlier_keys_sim.md]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqattn.quant.codebook import get_codebook  # noqa: E402

B, L, HQ, HK, D = 2, 4096, 32, 8, 128


def tq(x: torch.Tensor, bits: int, gen: torch.Generator) -> torch.Tensor:
    """Rotate, Lloyd–Max code the unit vector, rescale to the input's norm (fp64)."""
    d = x.shape[-1]
    rot = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=gen))[0]
    n = x.norm(dim=-1, keepdim=True)
    u = (x / n.clamp_min(1e-30)) @ rot
    cb = get_codebook(d, bits)
    c = torch.tensor(cb.centroids, dtype=torch.float64)
    uq = c[torch.bucketize(u.contiguous(), torch.tensor(cb.boundaries, dtype=torch.float64))]
    return (uq / uq.norm(dim=-1, keepdim=True)) @ rot.T * n


def outlier_split(k: torch.Tensor, bits: int, n_out: int, gen) -> torch.Tensor:
    idx = k.abs().topk(n_out, dim=-1).indices
    mask = torch.zeros_like(k, dtype=torch.bool).scatter_(-1, idx, True)
    rest = tq(k.masked_fill(mask, 0.0), bits, gen)
    return torch.where(mask, k.to(torch.float8_e4m3fn).double(), rest)


def attention(q, k, v):
    g = HQ // HK
    s = torch.einsum("bhd,bhld->bhl", q, k.repeat_interleave(g, 1)) / math.sqrt(D)
    return torch.einsum("bhl,bhld->bhd", s.softmax(-1), v.repeat_interleave(g, 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, D, dtype=torch.float64, generator=gen)
    k = torch.randn(B, HK, L, D, dtype=torch.float64, generator=gen)
    mult = torch.ones(HK, D, dtype=torch.float64)
    for h in range(HK):
        mult[h, torch.randperm(D, generator=gen)[:4]] = 8.0
    k = k * mult[None, :, None, :]
    v = torch.randn(B, HK, L, D, dtype=torch.float64, generator=gen)
    ref = attention(q, k, v)
    vq = {b: tq(v, b, gen) for b in (3, 4)}
    rows = []

    def add(name, kq, kbits, vb):
        o = attention(q, kq, vq[vb])
        cos = torch.nn.functional.cosine_similarity(o.flatten(), ref.flatten(), dim=0).item()
        bits = (kbits + vb * D + 16) / (2 * D)
        rows.append((name, bits, cos))
        print(f"{name:<28} {bits:.3f} bits/elem  cos {cos:.4f}", flush=True)

    for kb in (3, 4):
        kq = tq(k, kb, gen)
        for vb in (3, 4):
            add(f"tq k{kb} v{vb}", kq, kb * D + 16, vb)
    for n_out in (4, 8):
        for kb in (3, 4):
            kq = outlier_split(k, kb, n_out, gen)
            for vb in (3, 4):
                add(f"outliers k{kb}+{n_out} v{vb}", kq, kb * D + 16 + n_out * 15, vb)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Outlier-split keys: CPU simulation on the anchor data (not a codec)\n\n"
                    f"- command: `PYTHONPATH=. python3 bench/outlier_keys_sim.py --out "
                    f"{args.out}` (torch {torch.__version__}, CPU)\n"
                    "- data: q, K, V ~ N(0,1), 4 key channels x8 per KV head, B = 2, L = 4096, "
                    "32/8/128; cosine of the whole output vs exact fp64 attention\n\n"
                    "| quantizer | bits/elem | cosine |\n|---|---|---|\n")
            f.writelines(f"| {n} | {b:.3f} | {c:.4f} |\n" for n, b, c in rows)


if __name__ == "__main__":
    main()
