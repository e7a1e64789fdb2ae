"""Attention computed directly on the codes — the math of the Triton decode kernel.

The query is rotated once (q @ R); each score is scale · n_j · ⟨q R, ĉ_j⟩ (+ the QJL term
n_j‖r_j‖√(π/2)/D · ⟨q Sᵀ, s_j⟩); keys are never un-rotated. Uniform values are dequantized in
place; rotated ("tq") values are accumulated in the rotated basis and the output is un-rotated
once. fp8 keys are scored as scale · ⟨q, k̂⟩. Outlier-split keys add ⟨q, o_j⟩ (the stored
outliers, original basis) to ⟨q R, n_j ĉ_j⟩ before the scale.

Rows: ``q`` is (T, Hq, D) — T query rows of one sequence (T = 1 for decode, more for a short
chunked-prefill continuation) — and row t sees the keys [lo_t, hi_t) of the sequence's slots,
hi_t = ``kv_lens[t]`` (default all) and lo_t = max(0, p_t − window + 1) under a sliding window,
p_t = ``row_pos[t]`` (default hi_t − 1: the row's own token is the last key it sees).
"""

from __future__ import annotations

import math

import torch

from .codec import TQCodec


def visible_keys(l: int, kv_lens: torch.Tensor, window: int | None = None,
                 row_pos: torch.Tensor | None = None) -> torch.Tensor:
    """(..., T, L) mask for rows (..., T): row t sees keys [lo_t, hi_t), hi_t = kv_lens[t] and,
    under a sliding window, lo_t = row_pos[t] − window + 1 (row_pos defaults to hi_t − 1)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be None or an int >= 0 (0: no window), got {window!r}")
    pos = torch.arange(l, device=kv_lens.device)
    hi = kv_lens[..., None]
    seen = pos < hi
    if window:
        at = hi - 1 if row_pos is None else row_pos[..., None]
        seen &= pos >= at - window + 1
    return seen


def decode_for_attention(codec: TQCodec, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """What attention reads of slots (L, Hk, S), decoded once: keys in the basis they are scored
    in (+ QJL signs and coefficients) and values in the basis they are accumulated in."""
    if codec.preset.key.codec == "fp8":
        dec = {"keys": codec.decode_keys(slots)}
    else:
        dec = {"keys": codec.rotated_keys(slots)}
        if codec.qjl_matrix is not None:
            dec["qjl_signs"], dec["qjl_coef"] = codec.qjl_parts(slots)
        if codec.preset.key.outliers:
            dec["outliers"] = codec.outlier_keys(slots)
    dec["values"] = (codec.rotated_values(slots) if codec.values is not None
                     else codec.decode_values(slots))
    return dec


def attention_on_codes(codec: TQCodec, q: torch.Tensor, slots: torch.Tensor, **kw):
    """q (T, Hq, D), slots (L, Hk, slot_bytes) → out (T, Hq, D) float32 [, lse (T, Hq)];
    keyword arguments as :func:`attention_on_decoded`."""
    return attention_on_decoded(codec, q, decode_for_attention(codec, slots), **kw)


def attention_on_decoded(codec: TQCodec, q: torch.Tensor, dec: dict[str, torch.Tensor], *,
                         scale: float | None = None, kv_lens: torch.Tensor | None = None,
                         window: int | None = None, softcap: float = 0.0,
                         row_pos: torch.Tensor | None = None, return_lse: bool = False):
    """Attention of q (T, Hq, D) over keys/values (L, Hk, ...) decoded by
    :func:`decode_for_attention`; kv_lens defaults to L for every row."""
    t, l = q.shape[0], dec["keys"].shape[0]
    hi = torch.full((t,), l, device=q.device) if kv_lens is None else kv_lens.to(q.device)
    visible = visible_keys(l, hi, window, None if row_pos is None else row_pos.to(q.device))
    out, lse = attend(codec, q[None], {k: v[None] for k, v in dec.items()}, visible[None],
                      scale=scale, softcap=softcap)
    return (out[0], lse[0]) if return_lse else out[0]


def attend(codec: TQCodec, q: torch.Tensor, dec: dict[str, torch.Tensor], visible: torch.Tensor,
           *, scale: float | None = None, softcap: float = 0.0):
    """The math of every path: q (B, T, Hq, D) over decoded keys/values (B, L, Hk, ...) of B
    sequences, visible (B, T, L) → out (B, T, Hq, D) float32, lse (B, T, Hq). A row that sees
    no key gives 0 and LSE −inf."""
    b, t, hq, d = q.shape
    hk = dec["keys"].shape[2]
    if d != codec.head_dim or hq % hk:
        raise ValueError(f"query shape {tuple(q.shape[1:])} does not fit {hk} KV heads at head "
                         f"size {codec.head_dim} (query heads must be a multiple of KV heads)")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = q.float().reshape(b, t, hk, hq // hk, d)

    if codec.preset.key.codec == "fp8":
        scores = torch.einsum("btkgd,blkd->btkgl", qf, dec["keys"])
    else:
        scores = torch.einsum("btkgd,blkd->btkgl", qf @ codec.rotation, dec["keys"])
        if codec.qjl_matrix is not None:
            proj = torch.einsum("btkgd,blkd->btkgl", qf @ codec.qjl_matrix.T, dec["qjl_signs"])
            scores = scores + proj * dec["qjl_coef"].transpose(1, 2)[:, None, :, None, :]
        if "outliers" in dec:
            scores = scores + torch.einsum("btkgd,blkd->btkgl", qf, dec["outliers"])
    scores = scores * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)

    scores = scores.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                         # (B, T, Hk, G)
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)

    out = torch.einsum("btkgl,blkd->btkgd", p, dec["values"])
    if codec.values is not None:
        out = out @ codec.rotation.T
    return out.reshape(b, t, hq, d), lse.reshape(b, t, hq)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    scale: float | None = None, kv_lens: torch.Tensor | None = None,
                    window: int | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Plain softmax attention over K/V (L, Hk, D) with the same row rules, float32."""
    t, hq, d = q.shape
    l, hk, _ = k.shape
    rep = hq // hk
    kf = k.float().repeat_interleave(rep, 1)
    vf = v.float().repeat_interleave(rep, 1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = torch.einsum("thd,lhd->thl", q.float(), kf) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    hi = torch.full((t,), l, device=k.device) if kv_lens is None else kv_lens.to(k.device)
    visible = visible_keys(l, hi, window)
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("thl,lhd->thd", torch.softmax(s, -1).nan_to_num(0.0), vf)
