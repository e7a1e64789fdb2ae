"""FlashAttention-3 paged decode, the baselines of bench/decode.py: a bf16 cache, and an fp8
cache as vLLM's FA3 fp8 path runs it (q, K, V in e4m3 with per-tensor scales, passed to
``flash_attn_with_kvcache`` as descale tensors of shape (batch, KV heads)).

The module is ``flash_attn_interface`` (the ``tokenspeed-fa3`` wheel on the H200 machines).
Only torch is imported here, so the fp8 preparation is testable on a CPU (tests/bench).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tqattn.quant.codec import FP8_MAX  # largest finite e4m3fn value

FP8 = torch.float8_e4m3fn
_CHUNK = 1 << 26         # elements per conversion step: no full-size fp32 copy of a cache


def load():
    """flash_attn_with_kvcache of FA3, or None with a printed note."""
    try:
        from flash_attn_interface import flash_attn_with_kvcache
    except ImportError as e:
        print(f"FA3 not available ({e}): no fa3_bf16_paged / fa3_fp8_paged rows", flush=True)
        return None
    return flash_attn_with_kvcache


def _rows(x: torch.Tensor) -> int:
    return max(1, _CHUNK // max(1, x[0].numel())) if x.dim() else 1


def per_tensor_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as e4m3fn, its fp32 scale): x ≈ x8.float() · scale, scale = amax|x| / 448 (1 for an
    all-zero x), rounded to nearest, saturating; converted a slice of the first dimension at a
    time."""
    step = _rows(x)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    for i in range(0, x.shape[0], step):
        amax = torch.maximum(amax, x[i:i + step].abs().amax().float())
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    for i in range(0, x.shape[0], step):
        out[i:i + step] = (x[i:i + step].float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return out, scale


@dataclass
class Fp8Inputs:
    """Arguments of an FA3 fp8 decode call: e4m3 q (B, 1, Hq, D) and paged caches (blocks, page,
    Hk, D); descales (B, Hk) fp32, each the tensor's per-tensor scale (vLLM expands its layer
    scales to this shape)."""
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor


def fp8_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Fp8Inputs:
    """q (B, Hq, D) and bf16 paged caches → :class:`Fp8Inputs` (q's quantization is done here,
    outside what the benchmark times)."""
    b, hk = q.shape[0], k_cache.shape[2]
    (q8, qs), (k8, ks), (v8, vs) = (per_tensor_fp8(x) for x in (q, k_cache, v_cache))

    def descale(s):
        return s.reshape(1, 1).expand(b, hk).contiguous()

    return Fp8Inputs(q8.view(b, 1, *q.shape[1:]), k8, v8, descale(qs), descale(ks), descale(vs))


def _out(res, b):
    res = res[0] if isinstance(res, tuple) else res
    return res.view(b, *res.shape[2:])


def decode_bf16(fa3, q, k_cache, v_cache, seq_lens, block_table, window=None,
                softcap=0.0) -> torch.Tensor:
    """FA3 paged decode, bf16: q (B, Hq, D) → (B, Hq, D); window: attend to the last ``window``
    keys (FA's left window excludes the query's own key); softcap: the logits' soft-cap."""
    b = q.shape[0]
    extra = {"window_size": (window - 1, 0)} if window else {}
    if softcap:
        extra["softcap"] = softcap
    return _out(fa3(q.view(b, 1, *q.shape[1:]), k_cache, v_cache, cache_seqlens=seq_lens,
                    page_table=block_table, causal=True, **extra), b)


def decode_fp8(fa3, inp: Fp8Inputs, seq_lens, block_table) -> torch.Tensor:
    """FA3 paged decode on the fp8 inputs → (B, Hq, D) (bf16 from FA3)."""
    return _out(fa3(inp.q, inp.k_cache, inp.v_cache, cache_seqlens=seq_lens,
                    page_table=block_table, causal=True, q_descale=inp.q_descale,
                    k_descale=inp.k_descale, v_descale=inp.v_descale), inp.q.shape[0])
