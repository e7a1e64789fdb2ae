"""Which layers to center: the model's KL to the uncompressed model for several selections.

Simulates the engine's cache read exactly on CPU (in one forward per window): 256-token chunks,
each chunk's queries read the earlier chunks' K and V through the codec (keys centered on the
selected layers) and their own chunk raw — what `LLM.score` computes (it reproduces the engine's
per-window KL to 4 digits on SmolLM2). Selections: no layer, every layer, and the layers whose
start-up calibration error (tqattn/engine/calibration.py) drops more than G-fold with centering.
``--full-precision`` keeps layers exact (what automatic routing chose).

    PYTHONPATH=. python3 bench/centering_selection.py MODEL_DIR [--full-precision 0]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

from tqattn.attention.turboquant import get_codec
from tqattn.engine import calibration as cal
from tqattn.evals.data import shakespeare_text

CHUNK = 256


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--preset", default="tq_k4v3")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--gains", default="1,1.5,2,3")
    ap.add_argument("--full-precision", default="", help="comma-separated layers kept exact")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    c = cal.calibrate(model, tok, preset=args.preset, head_dim=head_dim,
                      num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size,
                      max_model_len=args.max_model_len)
    gain = [u / max(e, 1e-12) for e, u in zip(c.errors_centered, c.errors_uncentered)]
    exact = {int(x) for x in args.full_precision.split(",") if x}
    state = {"on": set()}

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        i = module.layer_idx
        q, k, v = query[0].float(), key[0].float(), value[0].float()
        g = q.shape[0] // k.shape[0]
        if i in exact:
            kh, vh = k, v
        else:
            codec = get_codec(args.preset, k.shape[-1])
            mu = c.key_offsets[i][:, None, :] if i in state["on"] else torch.zeros(())
            kh, vh = codec.decode(codec.encode(k - mu, v))
            kh = kh + mu
        rep = lambda x: x.repeat_interleave(g, 0)  # noqa: E731
        t = k.shape[1]
        pos = torch.arange(t)
        older = (pos[None, :] // CHUNK) < (pos[:, None] // CHUNK)
        s = torch.where(older, torch.einsum("hqd,hkd->hqk", q, rep(kh)),
                        torch.einsum("hqd,hkd->hqk", q, rep(k))) * scaling
        p = s.masked_fill(pos[None, :] > pos[:, None], float("-inf")).softmax(-1)
        out = (torch.einsum("hqk,hkd->hqd", p * older, rep(vh))
               + torch.einsum("hqk,hkd->hqd", p * ~older, rep(v)))
        return out.transpose(0, 1)[None].to(query.dtype), None

    AttentionInterface.register("tqattn_centering_selection", attend)
    text = shakespeare_text()
    wins = [tok(text[s:s + 40 * args.tokens]).input_ids[:args.tokens]
            for s in (100000, 400000, 700000, 1000000)]
    print(f"calibration gain (uncentered / centered error) per layer: "
          f"{[round(x, 2) for x in gain]}; exact layers: {sorted(exact)}")
    print(f"{len(wins)} Shakespeare windows of {args.tokens} tokens, {CHUNK}-token chunks, KL "
          f"(nats/token) to the uncompressed model from position {CHUNK}\n")
    print("| centered layers | how many | KL | per window |\n|---|---|---|---|")
    with torch.no_grad():
        refs = [model(torch.tensor([w])).logits[0].log_softmax(-1) for w in wins]
        model.set_attn_implementation("tqattn_centering_selection")
        n = cfg.num_hidden_layers
        sels = {"none": set(), "all": set(range(n))}
        sels.update({f"gain > {g}": {i for i in range(n) if gain[i] > float(g)}
                     for g in args.gains.split(",")})
        for name, sel in sels.items():
            state["on"] = sel
            kls = []
            for w, r in zip(wins, refs):
                lp = model(torch.tensor([w])).logits[0].log_softmax(-1)
                kls.append(float((r.exp() * (r - lp)).sum(-1)[CHUNK:].mean()))
            print(f"| {name} | {len(sel)} | {sum(kls) / len(kls):.4f} | "
                  f"{', '.join(f'{x:.4f}' for x in kls)} |", flush=True)


if __name__ == "__main__":
    main()
