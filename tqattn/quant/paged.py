"""The paged TurboQuant KV cache: its byte layout and plain-PyTorch reference operations.

Each reference here is the twin of a Triton kernel in ``tqattn/kernels`` (store, decode
attention, dequantize) and is built from :class:`TQCodec` — the kernels must compute exactly
this.

Cache layout
------------
One uint8 tensor per layer, shape ``(num_blocks, num_kv_heads, block_size * slot_bytes)``
(:func:`kv_cache_shape`): a *page* of ``block_size * slot_bytes`` bytes per (block, KV head),
exactly the bytes of ``block_size`` codec slots (``layout.slot_bytes``), rearranged so that a
kernel reading a tile of tokens issues wide coalesced loads:

* the page is split into one *plane* per slot field (``layout.fields``, in slot order); the
  plane of field ``f`` starts at byte ``block_size * f.offset`` and holds that field for all
  ``block_size`` tokens, token after token (fp16 norms/scales/minimums therefore form a plain
  fp16 array ``[block_size]``);
* a 3-bit code field of whole words (a multiple of 8 codes, 8 codes in 3 bytes) is further
  split into three sub-planes: sub-plane ``s`` holds byte ``s`` of every word ``g``, token after
  token — so the bytes a kernel combines into one word sit at the same offset of three
  contiguous arrays. Inside a word the page uses its own bit order (:func:`page_word_bytes`):
  byte ``s`` holds code ``2s`` in bits 0–2, code ``2s+1`` in bits 4–6 and bit ``s`` of codes 6
  and 7 in bits 3 and 7, so that masking a byte with ``0x77`` yields two 3-bit lookup selectors
  in nibbles (the decode kernel's ``prmt`` table lookups) and codes 6–7 come from three shifts;
* "nc" norms are stored folded: the norm field holds ``n / ‖ĉ‖`` (fp16) instead of vLLM's ``n``
  (``TQCodec.encode(fold_nc=True)``; read with ``codec.folded()``), so no kernel sums ĉ² per
  token. This is one fp16 rounding away from vLLM's ``fp16(n)·ĉ/‖ĉ‖``;
* the slot's pad byte (slots are padded to an even size) goes to a tail of ``block_size``
  bytes at the end of the page; it is always 0.

* 3-bit key code sub-planes are column-major: byte position ``g`` of all ``block_size``
  tokens, then ``g + 1``…, so a thread of the decode kernel loads 4-byte words of 4 consecutive
  tokens of one byte position and converts them in registers into the order in which the QK
  dot's operand (tokens along N) goes to shared memory in 16-byte stores; every other plane is
  token-major (value dot operands have dimensions along N; the byte-wise paths of other key
  widths load token rows).

So byte ``j`` of field ``f`` of the token at page offset ``t`` (after the bit reorder of 3-bit
words) lives at ``block_size·f.offset + s·block_size·G + t·G + g`` (token-major planes) or
``block_size·f.offset + s·block_size·G + g·block_size + t`` (3-bit key fields) with ``W = 3``
(3-bit, a multiple of 8 codes) or 1, ``G = f.nbytes / W``, ``s = j % W``, ``g = j // W``;
:func:`page_positions` tabulates it.
With block sizes that are multiples of 16 every plane starts 16-byte aligned. Pages are
addressed through ``block_table`` with vLLM's slot convention ``slot = block·block_size +
offset``; a negative slot in ``slot_mapping`` is padding and is skipped.

Row semantics of decode attention
---------------------------------
``q`` is ``(num_rows, Hq, D)``; sequence ``b`` owns rows ``[qsl[b], qsl[b+1])``
(``query_start_loc`` None: one row per sequence). Row ``i`` of sequence ``b`` sits at absolute
position ``pos = query_pos_start[b] + i`` (default ``seq_lens[b] − q_len``: the rows' own tokens
are the last ones in the cache) and sees the cache keys ``[lo, hi)`` with
``hi = min(seq_lens[b], pos + 1)`` and ``lo = max(0, pos − window + 1)`` under a sliding window
(else 0). A row that sees no key gives output 0 and LSE −inf. Scores are ``scale·⟨q, k⟩``,
then ``softcap·tanh(s/softcap)`` when ``softcap`` > 0; the LSE is the natural log-sum-exp of the
final scores, ``(num_rows, Hq)`` fp32.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from .attention_ref import attention_on_decoded, decode_for_attention, split_decoded
from .codec import TQCodec
from .layout import Field, build_layout
from .packing import pack_bits, unpack_bits


def _is_fp16_field(f: Field) -> bool:
    return f.count == 0 and f.nbytes == 2


def field_words(f: Field) -> int:
    """Bytes per word of a packed field as laid out in the page: 3 for 3-bit sub-planes, else 1.

    Only whole words of 8 codes: 6 codes also fill 3 bytes (with 6 pad bits), but they are not a word.
    """
    return 3 if (not _is_fp16_field(f) and f.bits == 3 and f.count % 8 == 0) else 1


def column_major(f: Field) -> bool:
    """3-bit key code planes are stored byte position after byte position (module docstring)."""
    return f.name.startswith("k_idx") and field_words(f) == 3


@lru_cache(maxsize=None)
def _page_positions(preset, head_dim: int, block_size: int) -> torch.Tensor:
    layout = build_layout(preset, head_dim)
    slot = layout.slot_bytes
    pos = torch.empty(block_size, slot, dtype=torch.int64)
    t = torch.arange(block_size)[:, None]
    used = 0
    for f in layout.fields.values():
        w = field_words(f)
        g_count = f.nbytes // w
        j = torch.arange(f.nbytes)[None, :]
        row, col = (1, block_size) if column_major(f) else (g_count, 1)
        pos[:, f.offset:f.offset + f.nbytes] = (block_size * f.offset + (j % w) * block_size * g_count
                                                + t * row + (j // w) * col)
        used = max(used, f.offset + f.nbytes)
    if slot > used:
        j = torch.arange(slot - used)[None, :]
        pos[:, used:] = block_size * used + t * (slot - used) + j
    return pos


def page_word_bytes(codes: torch.Tensor) -> torch.Tensor:
    """3-bit codes (..., 8k) → page-order bytes (..., 3k) (see the module docstring)."""
    c = codes.to(torch.int32).unflatten(-1, (-1, 8))
    out = [c[..., 2 * s] | (c[..., 2 * s + 1] << 4) | (((c[..., 6] >> s) & 1) << 3)
           | (((c[..., 7] >> s) & 1) << 7) for s in range(3)]
    return torch.stack(out, -1).flatten(-2).to(torch.uint8)


def page_word_codes(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`page_word_bytes`: bytes (..., 3k) → int64 codes (..., 8k)."""
    b = b.to(torch.int32).unflatten(-1, (-1, 3))
    lo = [(b[..., s] >> (4 * h)) & 7 for s in range(3) for h in range(2)]
    hi = [sum(((b[..., s] >> (3 + 4 * h)) & 1) << s for s in range(3)) for h in range(2)]
    return torch.stack(lo + hi, -1).flatten(-2).to(torch.int64)


def _reorder_words(codec: TQCodec, slots: torch.Tensor, to_page: bool) -> torch.Tensor:
    """Slots with every 3-bit word field in page bit order (to_page) or back in vLLM's."""
    fields = [f for f in codec.layout.fields.values() if field_words(f) == 3]
    if not fields:
        return slots
    slots = slots.clone()
    for f in fields:
        raw = slots[..., f.offset:f.offset + f.nbytes]
        if to_page:
            slots[..., f.offset:f.offset + f.nbytes] = page_word_bytes(unpack_bits(raw, 3, f.count))
        else:
            slots[..., f.offset:f.offset + f.nbytes] = pack_bits(page_word_codes(raw), 3)
    return slots


def page_positions(codec: TQCodec, block_size: int) -> torch.Tensor:
    """(block_size, slot_bytes) int64: where byte j of the slot of page offset t lives in the page."""
    return _page_positions(codec.preset, codec.head_dim, block_size)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   codec: TQCodec) -> tuple[int, int, int]:
    """Shape of one layer's uint8 paged cache (see the module docstring for the byte layout)."""
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"block size {block_size} not supported: need a positive even number "
                         f"(the kernels take powers of two >= 16)")
    return (num_blocks, num_kv_heads, block_size * codec.slot_bytes)


def cache_block_size(codec: TQCodec, kv_cache: torch.Tensor) -> int:
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 3 or kv_cache.shape[-1] % codec.slot_bytes:
        raise ValueError(f"kv_cache must be uint8 (num_blocks, num_kv_heads, block_size * "
                         f"{codec.slot_bytes}) for preset {codec.preset.name} at head size "
                         f"{codec.head_dim}, got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    return kv_cache.shape[-1] // codec.slot_bytes


# ---- store / gather ---------------------------------------------------------------------------------

def store_ref(codec: TQCodec, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """Encode key/value (N, Hk, D) and write them at slot_mapping (N,) into kv_cache, in place.

    Non-finite vectors are stored with NaN markers (the codec's ``on_nonfinite="propagate"``);
    "nc" norms are folded and 3-bit words reordered (module docstring).
    """
    bs = cache_block_size(codec, kv_cache)
    n, hk, _ = key.shape
    if kv_cache.shape[1] != hk:
        raise ValueError(f"key has {hk} KV heads, cache has {kv_cache.shape[1]}")
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    slots = codec.encode(key[keep], value[keep], on_nonfinite="propagate", fold_nc=True)
    slots = _reorder_words(codec, slots, to_page=True)                          # (n', Hk, S)
    sm = slot_mapping[keep].long()
    pos = page_positions(codec, bs).to(kv_cache.device)[sm % bs]                  # (n', S)
    blk = (sm // bs)[:, None, None]
    heads = torch.arange(hk, device=kv_cache.device)[None, :, None]
    kv_cache[blk, heads, pos[:, None, :]] = slots


def gather_slots_ref(codec: TQCodec, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor) -> list[torch.Tensor]:
    """Paged cache → one (seq_len, Hk, slot_bytes) tensor of codec slots per sequence, in vLLM's
    bit order with the "nc" norms folded: read them with ``codec.folded()``."""
    bs = cache_block_size(codec, kv_cache)
    pos_tab = page_positions(codec, bs).to(kv_cache.device)                     # (bs, S)
    lens = seq_lens.tolist()
    if not lens:
        return []
    nblk = [-(-n // bs) for n in lens]
    # whole pages of every sequence in one gather, then the slot bytes out of each page
    ids = torch.cat([block_table[b, :k] for b, k in enumerate(nblk)]).long()
    pages = kv_cache[ids][:, :, pos_tab]                                        # (P, Hk, bs, S)
    pages = _reorder_words(codec, pages.transpose(1, 2).flatten(0, 1), to_page=False)
    starts = [0]
    for k in nblk:
        starts.append(starts[-1] + k * bs)
    return [pages[starts[b]:starts[b] + n] for b, n in enumerate(lens)]


# ---- decode attention -------------------------------------------------------------------------------

def _row_layout(seq_lens, query_start_loc, query_pos_start, num_rows):
    b = seq_lens.numel()
    if query_start_loc is None:
        if num_rows != b:
            raise ValueError(f"q has {num_rows} rows but there are {b} sequences; pass "
                             f"query_start_loc for several rows per sequence")
        qsl = list(range(b + 1))
    else:
        qsl = query_start_loc.tolist()
        if len(qsl) != b + 1 or qsl[-1] > num_rows:
            raise ValueError(f"query_start_loc {qsl} does not fit {b} sequences and {num_rows} rows")
    lens = seq_lens.tolist()
    if query_pos_start is None:
        starts = [lens[i] - (qsl[i + 1] - qsl[i]) for i in range(b)]
    else:
        starts = query_pos_start.tolist()
    return qsl, lens, starts


def decode_attention_ref(codec: TQCodec, q: torch.Tensor, kv_cache: torch.Tensor,
                         block_table: torch.Tensor, seq_lens: torch.Tensor,
                         query_start_loc: torch.Tensor | None = None,
                         query_pos_start: torch.Tensor | None = None, scale: float | None = None,
                         window: int | None = None, softcap: float = 0.0,
                         return_lse: bool = False):
    """Attention of q (rows, Hq, D) over the paged compressed cache → fp32 (rows, Hq, D) [, lse].

    Row semantics: see the module docstring.
    """
    rows, hq, d = q.shape
    hk = kv_cache.shape[1]
    if d != codec.head_dim or hq % hk:
        raise ValueError(f"q shape {tuple(q.shape)} does not fit {hk} KV heads at head size "
                         f"{codec.head_dim}")
    qsl, lens, starts = _row_layout(seq_lens, query_start_loc, query_pos_start, rows)
    # decode every sequence's codes in one pass (the per-call cost dominates on the CPU)
    slots = gather_slots_ref(codec, kv_cache, block_table, seq_lens)
    decoded = (split_decoded(decode_for_attention(codec.folded(), torch.cat(slots)), lens)
               if slots else [])
    out = torch.zeros(rows, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((rows, hq), -math.inf, dtype=torch.float32, device=q.device)
    for b, dec in enumerate(decoded):
        r0, r1 = qsl[b], qsl[b + 1]
        if r1 == r0 or lens[b] == 0:
            continue
        pos = starts[b] + torch.arange(r1 - r0, device=q.device)
        out[r0:r1], lse[r0:r1] = attention_on_decoded(
            codec, q[r0:r1], dec, scale=scale, kv_lens=torch.clamp(pos + 1, max=lens[b]),
            row_pos=pos, window=window, softcap=softcap, return_lse=True)
    return (out, lse) if return_lse else out


# ---- dequantize -------------------------------------------------------------------------------------

def dequant_ref(codec: TQCodec, kv_cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Paged cache → K, V (sum(seq_lens), Hk, D) in the original basis, packed by sequence
    (sequence b at rows cu_seqlens[b]:cu_seqlens[b+1], cu_seqlens = [0, cumsum(seq_lens)])."""
    slots = gather_slots_ref(codec, kv_cache, block_table, seq_lens)
    if sum(x.shape[0] for x in slots) == 0:
        d, hk = codec.head_dim, kv_cache.shape[1]
        return (torch.zeros(0, hk, d, dtype=dtype, device=kv_cache.device),) * 2
    k, v = codec.folded().decode(torch.cat(slots))  # one decode for all sequences, as in decode_attention_ref
    return k.to(dtype), v.to(dtype)
