"""Where key centering's offsets should come from: per-layer attention KL on real text.

For each layer: attention KL of the last 64 queries of a Shakespeare window (exact keys vs keys
through the codec) with no centering; with offsets from the built-in calibration text at
positions 0..N-1 only ("start"); with the engine's offsets (the same text at positions spread
over --max-model-len, tqattn/engine/calibration.py: "spread"); and with an oracle offset (the
window's own mean key). The window runs at each of --offset's positions, so RoPE sees it deep in
a long sequence, where a constant offset measured near position 0 has rotated away.

    PYTHONPATH=. python3 bench/key_centering.py MODEL_DIR [--offset 0,2048,6144]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tqattn.attention.turboquant import get_codec
from tqattn.engine import calibration as cal
from tqattn.evals.data import shakespeare_text


def record(model, ids, offset):
    keys, queries, meta = {}, {}, {}

    def on_layer(module, q, k, scaling, window, softcap):
        i = module.layer_idx
        keys[i], queries[i] = k.float().cpu(), q[:, -cal.ERROR_QUERIES:].float().cpu()
        meta[i] = (scaling, window, softcap)

    cal.record_layers(model, ids, on_layer, position_offset=offset)
    return keys, queries, meta


def mean_keys(model, ids, positions):
    passes = [record(model, ids, p)[0] for p in positions]
    return {i: torch.cat([p[i] for p in passes], 1).mean(1, keepdim=True) for i in passes[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of the evaluation window")
    ap.add_argument("--offset", default="0,2048,6144", help="positions of the evaluation window")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--presets", default="tq_k4v3,turboquant_k3v4_nc")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    ids = cal.calibration_token_ids(tok, model.config.vocab_size)
    spread = cal.pass_positions(len(ids), args.max_model_len)
    offsets = {"start": mean_keys(model, ids, [0]), "spread": mean_keys(model, ids, spread)}
    text_ids = tok(shakespeare_text()[100000:100000 + 40 * args.tokens]).input_ids[:args.tokens]
    print(f"calibration: {len(ids)} tokens of the built-in text; start: positions 0..; spread: "
          f"passes from positions {spread}. Evaluation: {len(text_ids)} Shakespeare tokens "
          f"(characters 100,000 on), last {cal.ERROR_QUERIES} queries")
    for off in [int(x) for x in args.offset.split(",")]:
        keys, queries, meta = record(model, text_ids, off)
        layers = sorted(keys)
        print(f"\n### evaluation window at positions {off}..{off + len(text_ids) - 1}\n")
        print(f"| preset | offset | mean | mean without the worst layer | "
              f"{' | '.join(f'L{i}' for i in layers)} |")
        print("|---|---|---|---|" + "---|" * len(layers))
        for preset in args.presets.split(","):
            for how in ("none", "start", "spread", "oracle"):
                row = []
                for i in layers:
                    k, q = keys[i], queries[i]
                    codec = get_codec(preset, k.shape[-1])
                    mu = (torch.zeros_like(k[:, :1]) if how == "none" else
                          k.mean(1, keepdim=True) if how == "oracle" else offsets[how][i])
                    k_hat = cal.through_codec(codec, k - mu) + mu
                    scale, window, softcap = meta[i]
                    row.append(cal.attention_kl(q, k, k_hat, scale or k.shape[-1] ** -0.5,
                                                window, softcap))
                rest = sorted(row)[:-1]
                print(f"| {preset} | {how} | {sum(row) / len(row):.4f} | "
                      f"{sum(rest) / len(rest):.4f} | {' | '.join(f'{x:.3f}' for x in row)} |")


if __name__ == "__main__":
    main()
