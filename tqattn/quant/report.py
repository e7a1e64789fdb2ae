"""Codec quality measurements behind ``tqattn presets`` and ``tqattn codec-report``.

Two synthetic data sets, both seeded:

* ``gaussian``: q, K, V ~ N(0, 1).
* ``outlier``: keys as real LLM keys look — heavy-tailed entries (Student t, 4 degrees of
  freedom, unit variance) plus 4 fixed channels scaled ×8 (the decode anchor's recipe); q, V ~ N(0, 1).

Metrics per preset: normalized key MSE ‖k̂ − k‖²/‖k‖²; relative inner-product error
rms(⟨q,k̂⟩ − ⟨q,k⟩)/rms(⟨q,k⟩); inner-product bias = least-squares slope of ⟨q,k̂⟩ on ⟨q,k⟩ − 1
(the mse codec shrinks by ≈ D_b); normalized value MSE; and the cosine similarity between the
softmax attention output over 4096 keys on the codes and the full-precision output.
"""

from __future__ import annotations

import math

import torch

from .attention_ref import attention_on_codes, dense_attention
from .codebook import get_codebook
from .codec import TQCodec
from .layout import build_layout
from .presets import PRESETS, KeySpec, TQPreset, ValueSpec, get_preset

NUM_VECTORS = 2048
NUM_KEYS = 4096
NUM_QUERIES = 16
OUTLIER_CHANNELS = 4
OUTLIER_SCALE = 8.0


def preset_row(name: str, head_dim: int) -> dict:
    """One preset's bytes and codecs at ``head_dim``; ``supported`` False (with the reason and no
    byte counts) when the preset cannot encode that head size."""
    p = get_preset(name)
    reason = p.head_dim_unsupported_reason(head_dim)
    if reason is not None:
        return {"preset": p.name, "head_dim": head_dim, "supported": False, "unsupported_reason": reason,
                "slot_bytes": None, "bits_per_element": None, "compression_vs_bf16": None,
                "description": p.description}
    lay = build_layout(name, head_dim)
    return {
        "preset": p.name, "head_dim": head_dim, "supported": True, "slot_bytes": lay.slot_bytes,
        "key_bytes": lay.key_bytes, "value_bytes": lay.value_bytes,
        "bits_per_element": round(lay.bits_per_element, 4),
        "compression_vs_bf16": round(lay.compression_vs_bf16, 3),
        "key_codec": p.key.codec, "key_bits": p.key.bits, "key_correction": p.key.correction,
        "key_qjl": p.key.qjl, "value_codec": p.value.codec, "value_bits": p.value.bits,
        "rotation": "randomized hadamard" if p.rotation_signs else "hadamard",
        "codebook": p.codebook, "vllm": p.vllm, "experimental": p.experimental,
        "description": p.description,
    }


def make_data(kind: str, n: int, head_dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(n, head_dim, generator=g)
    if kind == "outlier":
        # Student t(4) = N / sqrt(chi2_4 / 4); variance 2, rescaled to 1
        z = torch.randn(n, head_dim, generator=g)
        chi2 = torch.randn(n, head_dim, 4, generator=g).pow(2).sum(-1)
        x = z / torch.sqrt(chi2 / 4) / math.sqrt(2)
        chans = torch.randperm(head_dim, generator=g)[:OUTLIER_CHANNELS]
        x[:, chans] *= OUTLIER_SCALE
        return x
    raise ValueError(f"unknown data kind {kind!r}; valid: 'gaussian', 'outlier'")


def _nmse(x, ref) -> float:
    return (((x - ref).pow(2).sum(-1)) / ref.pow(2).sum(-1).clamp_min(1e-30)).mean().item()


def measure(codec: TQCodec, kind: str, seed: int = 0) -> dict:
    d = codec.head_dim
    k = make_data(kind, NUM_KEYS, d, seed)
    v = make_data("gaussian", NUM_KEYS, d, seed + 1)
    q = make_data("gaussian", NUM_QUERIES, d, seed + 2)
    slots = codec.encode(k, v)
    kh, vh = codec.decode(slots)
    ip, ip_hat = q @ k.T, q @ kh.T
    out = attention_on_codes(codec, q[:, None], slots[:, None])
    ref = dense_attention(q[:, None], k[:, None], v[:, None])
    return {
        "key_mse": _nmse(kh[:NUM_VECTORS], k[:NUM_VECTORS]),
        "ip_rel_err": ((ip_hat - ip).pow(2).mean() / ip.pow(2).mean()).sqrt().item(),
        "ip_bias": ((ip_hat * ip).sum() / (ip * ip).sum()).item() - 1.0,
        "value_mse": _nmse(vh[:NUM_VECTORS], v[:NUM_VECTORS]),
        "attn_cosine": torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item(),
    }


def key_codebook_rows(head_dim: int, seed: int = 0) -> list[dict]:
    """Exact-law codebooks at this head size and the plain mse key codec's MSE on unit vectors."""
    rows = []
    u = make_data("gaussian", NUM_VECTORS, head_dim, seed)
    u = u / u.norm(dim=-1, keepdim=True)
    for bits in (1, 2, 3, 4):
        p = TQPreset(f"mse{bits}", KeySpec("mse", bits), ValueSpec("tq", 4), True, "exact")
        codec = TQCodec(p, head_dim, seed=seed)
        cb = get_codebook(head_dim, bits, "exact")
        rows.append({"bits": bits, "key_mse": _nmse(codec.decode_keys(codec.encode(u, u)), u),
                     "theory_mse": cb.mse, "levels": [round(x, 4) for x in cb.levels()]})
    return rows


def codec_report(head_dim: int = 128, presets: list[str] | None = None, seed: int = 0) -> dict:
    # all presets: those that cannot encode head_dim are listed apart; named ones must encode it
    names = presets or [n for n, p in PRESETS.items() if p.supports_head_dim(head_dim)]
    unsupported = {} if presets else {n: p.head_dim_unsupported_reason(head_dim)
                                      for n, p in PRESETS.items() if not p.supports_head_dim(head_dim)}
    rows = []
    for name in names:
        codec = TQCodec(name, head_dim, seed=seed)
        row = preset_row(name, head_dim)
        row.update(measure(codec, "outlier", seed))
        row["gaussian"] = measure(codec, "gaussian", seed)
        rows.append(row)
    return {"head_dim": head_dim, "data": "outlier keys at top level; gaussian under 'gaussian'",
            "presets": rows, "unsupported": unsupported,
            "key_codebook": key_codebook_rows(head_dim, seed)}
