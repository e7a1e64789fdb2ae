"""Per-layer damage of key quantization on a real model, and how much key energy is a constant.

Runs the model (transformers, CPU fine) over a Shakespeare window, records each layer's
post-RoPE keys and queries, and reports for each preset the attention KL (exact keys vs keys
encoded/decoded by the codec) of the last 64 queries, per layer, plus the share of key energy in
the per-head mean direction (a constant offset that the quantizer must spend its bits on).
``--centered`` adds rows where a per-head mean key μ, measured on a *different* window of the
same text, is subtracted before encoding (scores shift by the per-query constant q·μ, which
softmax ignores): how much of the damage a fixed key offset would remove.

    PYTHONPATH=. python3 bench/key_outliers.py MODEL_DIR [--tokens 1024] [--presets a,b]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tqattn.evals.data import shakespeare_text
from tqattn.quant.codec import TQCodec


def record_keys(model_dir: str, tokens: int, start: int = 100000):
    keys, queries = {}, {}

    def record(module, q, k, v, mask, **kw):
        keys[module.layer_idx], queries[module.layer_idx] = k[0].detach(), q[0].detach()
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("tqattn_record", record)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="tqattn_record")
    ids = tok(shakespeare_text()[start:start + 40 * tokens],
              return_tensors="pt").input_ids[:, :tokens]
    with torch.no_grad():
        model(ids)
    return keys, queries


def layer_kl(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor, last: int = 64) -> float:
    hk, t, d = k.shape
    qq = q.view(hk, q.shape[0] // hk, t, d)[:, :, -last:]
    p = (torch.einsum("hgqd,hkd->hgqk", qq, k) / d ** 0.5).log_softmax(-1)
    p_hat = (torch.einsum("hgqd,hkd->hgqk", qq, k_hat) / d ** 0.5).log_softmax(-1)
    return float((p.exp() * (p - p_hat)).sum(-1).mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--presets", default="turboquant_k8v4,tq_k4v4,turboquant_k3v4_nc")
    ap.add_argument("--centered", action="store_true")
    args = ap.parse_args()
    keys, queries = record_keys(args.model_dir, args.tokens)
    means = {}
    if args.centered:  # the offset from another part of the text: no peeking at these keys
        other, _ = record_keys(args.model_dir, args.tokens, start=1000000)
        means = {i: k.mean(1, keepdim=True) for i, k in other.items()}
    layers = sorted(keys)
    print(f"| preset | {' | '.join(f'L{i}' for i in layers)} |")
    print("|---|" + "---|" * len(layers))
    for preset in args.presets.split(","):
        for centered in ([False, True] if means else [False]):
            row = []
            for i in layers:
                codec = TQCodec(preset, keys[i].shape[-1])
                mu = means[i] if centered else torch.zeros_like(keys[i][:, :1])
                k_hat = codec.decode(codec.encode(keys[i] - mu, keys[i]))[0] + mu
                row.append(layer_kl(queries[i], keys[i], k_hat))
            name = f"{preset}{' centered' if centered else ''}"
            print(f"| {name} attention KL | {' | '.join(f'{x:.3f}' for x in row)} |")
    share = [float((keys[i].mean(1).norm(dim=-1) ** 2 / (keys[i] ** 2).sum(-1).mean(1)).mean())
             for i in layers]
    print(f"| key energy in the mean | {' | '.join(f'{x:.2f}' for x in share)} |")


if __name__ == "__main__":
    main()
