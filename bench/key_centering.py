"""Where key centering's offsets should come from: per-layer attention KL on real text.

For each layer: attention KL of the last 64 queries of a Shakespeare window (exact keys vs keys
through the codec) with no centering, with the engine's calibration offsets (built-in text,
positions 0..N-1), and with an oracle offset (the window's own mean key). ``--offset P`` runs the
evaluation window at positions P..P+N-1 (RoPE sees it deep in a long sequence) while the
calibration stays at 0..N-1: how much of the offset the position rotation moves away.

    PYTHONPATH=. python3 bench/key_centering.py MODEL_DIR [--tokens 1024] [--offset 0,6144]
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
        keys[module.layer_idx], queries[module.layer_idx] = k.float().cpu(), q.float().cpu()
        meta[module.layer_idx] = (scaling, window, softcap)

    cal.record_layers(model, ids, on_layer, position_offset=offset)
    return keys, queries, meta


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--offset", default="0")
    ap.add_argument("--presets", default="tq_k4v3,turboquant_k3v4_nc")
    ap.add_argument("--cal-offsets", default="0", help="calibration passes at these positions")
    ap.add_argument("--cal-tokens", type=int, default=1024, help="tokens of each calibration pass")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    ids = cal.calibration_token_ids(tok, model.config.vocab_size, args.cal_tokens)
    passes = [record(model, ids, int(o))[0] for o in args.cal_offsets.split(",")]
    mu_cal = {i: torch.cat([p[i] for p in passes], 1).mean(1, keepdim=True) for i in passes[0]}
    text_ids = tok(shakespeare_text()[100000:100000 + 40 * args.tokens]).input_ids[:args.tokens]
    print(f"calibration: {len(ids)} tokens at positions {args.cal_offsets}; evaluation: {len(text_ids)} Shakespeare tokens")
    for off in [int(x) for x in args.offset.split(",")]:
        keys, queries, meta = record(model, text_ids, off)
        layers = sorted(keys)
        print(f"\n### positions {off}..{off + len(text_ids) - 1}\n")
        print(f"| preset | centering | {' | '.join(f'L{i}' for i in layers)} | mean |")
        print("|---|---|" + "---|" * (len(layers) + 1))
        for preset in args.presets.split(","):
            for how in ("none", "calibration", "oracle"):
                row = []
                for i in layers:
                    k, q = keys[i], queries[i]
                    codec = get_codec(preset, k.shape[-1])
                    mu = {"none": torch.zeros_like(k[:, :1]), "calibration": mu_cal[i],
                          "oracle": k.mean(1, keepdim=True)}[how]
                    k_hat = cal._through_codec(codec, k - mu) + mu
                    scale, window, softcap = meta[i]
                    row.append(cal.attention_kl(q, k, k_hat, scale or k.shape[-1] ** -0.5,
                                                window, softcap))
                print(f"| {preset} | {how} | {' | '.join(f'{x:.3f}' for x in row)} | "
                      f"{sum(row) / len(row):.3f} |")


if __name__ == "__main__":
    main()
