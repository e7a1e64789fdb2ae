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

* 3-bit code sub-planes (keys and values) are column-major: byte position ``g`` of all
  ``block_size`` tokens, then ``g + 1``…, so a thread loads 4- or 8-byte words of consecutive
  tokens of one byte position and converts them in registers: into pairs of one token's
  coordinates (a QK operand) or of one coordinate's tokens (a PV operand, tensor-core decode);
  every other plane is token-major (4-bit codes hold a token's coordinate pairs in a byte).

So byte ``j`` of field ``f`` of the token at page offset ``t`` (after the bit reorder of 3-bit
words) lives at ``block_size·f.offset + s·block_size·G + t·G + g`` (token-major planes) or
``block_size·f.offset + s·block_size·G + g·block_size + t`` (3-bit fields) with ``W = 3``
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

from .attention_ref import attend, visible_keys
from .codec import TQCodec, _read_fp16, dense_outliers
from .layout import Field, build_layout
from .packing import gather_rows, lookup_table, pack_bits, unpack_bits, unpack_lookup


def _is_fp16_field(f: Field) -> bool:
    return f.count == 0 and f.nbytes == 2


def field_words(f: Field) -> int:
    """Bytes per word of a packed field as laid out in the page: 3 for 3-bit sub-planes, else 1.

    Only whole words of 8 codes: 6 codes also fill 3 bytes (with 6 pad bits), but they are not a word.
    """
    return 3 if (not _is_fp16_field(f) and f.bits == 3 and f.count % 8 == 0) else 1


def column_major(f: Field) -> bool:
    """3-bit code planes (keys and values) are stored byte position after byte position (module
    docstring)."""
    return field_words(f) == 3


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
    s = torch.arange(3, device=codes.device, dtype=torch.int32)
    out = (c[..., 0:6:2] | (c[..., 1:6:2] << 4) | (((c[..., 6:7] >> s) & 1) << 3)
           | (((c[..., 7:8] >> s) & 1) << 7))
    return out.flatten(-2).to(torch.uint8)


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


# ---- reading pages ---------------------------------------------------------------------------------
# The decode and dequantize references read the codes where the page keeps them: whole pages
# of every sequence in one gather, each field's plane sliced out of them, codes turned into
# values by table lookups — no per-sequence or per-block Python loop and no repacking.

def sequence_pages(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages (B, Hk, n, block_size·slot_bytes), valid (B, n·block_size)): the first n blocks of
    every sequence (n covers the longest; blocks past a sequence's own read block 0) and which
    of their token positions the sequence holds."""
    lens = seq_lens.to(device=kv_cache.device, dtype=torch.int64)
    n = -(-int(lens.max()) // block_size) if lens.numel() else 0
    cols = torch.arange(n, device=kv_cache.device)
    ids = block_table[:, :n].to(device=kv_cache.device, dtype=torch.int64)
    ids = torch.where(cols[None, :] * block_size < lens[:, None], ids, 0)
    valid = torch.arange(n * block_size, device=kv_cache.device)[None, :] < lens[:, None]
    pages = kv_cache.index_select(0, ids.flatten()).unflatten(0, ids.shape)
    return pages.transpose(1, 2), valid


def field_planes(pages: torch.Tensor, f: Field, block_size: int) -> list[torch.Tensor]:
    """The ``W = field_words(f)`` sub-planes of field f of every token of pages (..., n,
    block_size·slot_bytes): W tensors (..., n·block_size, G), ``G = f.nbytes / W``.

    Token-major or column-major as :func:`column_major` says, so the reader follows the layout
    that :func:`page_positions` tabulates (and the store writes) instead of assuming one."""
    w = field_words(f)
    g = f.nbytes // w
    plane = pages[..., block_size * f.offset:block_size * (f.offset + f.nbytes)]
    if column_major(f):
        subs = plane.unflatten(-1, (w, g, block_size)).transpose(-1, -2)
    else:
        subs = plane.unflatten(-1, (w, block_size, g))
    return [subs[..., s, :, :].flatten(-3, -2) for s in range(w)]


def field_bytes(pages: torch.Tensor, f: Field, block_size: int) -> torch.Tensor:
    """A field of one byte per word (module docstring) of every token of pages (..., n,
    block_size·slot_bytes): (..., n·block_size, nbytes) in slot byte order."""
    if field_words(f) != 1:
        raise ValueError(f"field {f.name} is stored as 3-byte words; read it with field_planes")
    return field_planes(pages, f, block_size)[0]


def fp16_field(pages: torch.Tensor, f: Field, block_size: int) -> torch.Tensor:
    """An fp16 field of every token as float32 (..., n·block_size)."""
    return _read_fp16(field_bytes(pages, f, block_size), 0)


def page_word_lut(table: torch.Tensor) -> torch.Tensor:
    """(2**14, 4): the table values of the codes that two ``byte & 0x77`` selectors of a page
    word hold (the first selector in the low 7 bits)."""
    r = torch.arange(1 << 14, device=table.device)
    return table[torch.stack([r & 7, (r >> 4) & 7, (r >> 7) & 7, (r >> 11) & 7], -1)]


def page_word_values(planes: list[torch.Tensor], lut: torch.Tensor) -> torch.Tensor:
    """``table[page_word_codes(words)]`` (..., 8·words) from the three sub-planes (..., words)
    of page-order words, ``lut = page_word_lut(table)``.

    As the decode kernel does: ``byte & 0x77`` holds codes 2s and 2s+1 as nibbles, and bits 3
    and 7 of the three bytes gathered into one byte give codes 6 and 7 the same way; two such
    selectors index one row of four values."""
    b0, b1, b2 = planes
    hi = ((b0 >> 3) & 0x11) | ((b1 >> 2) & 0x22) | ((b2 >> 1) & 0x44)
    lo = (b0 & 0x77).int() | ((b1 & 0x77).int() << 7)
    up = (b2 & 0x77).int() | (hi.int() << 7)
    return gather_rows(lut, torch.stack([lo, up], -1)).flatten(-3)


@lru_cache(maxsize=64)
def _code_luts(codec: TQCodec) -> dict[str, torch.Tensor]:
    """The decode table of every packed field of the codec, by field name: page words read two
    selectors per index, 4-bit fields two bytes, other widths that divide a byte one byte; 3-bit
    fields that are not whole words keep the plain code table."""
    lay, dev = codec.layout, codec.device
    tables = []
    for codes in (codec.keys, codec.values):
        if codes is not None:
            tables += list(zip(codes.fields, codes.centroids))
    if codec.qjl_matrix is not None:
        tables.append((lay.field("k_qjl"), torch.tensor([-1.0, 1.0], device=dev)))
    if lay.has("v_q"):
        f = lay.field("v_q")
        tables.append((f, torch.arange(2 ** f.bits, device=dev, dtype=torch.float32)))
    luts = {}
    for f, table in tables:
        if field_words(f) == 3:
            luts[f.name] = page_word_lut(table)
        elif 8 % f.bits == 0:
            luts[f.name] = lookup_table(table, f.bits, 2 if f.bits == 4 else 1)
        else:
            luts[f.name] = table
    return luts


def _field_values(codec: TQCodec, pages, f: Field, block_size: int) -> torch.Tensor:
    lut = _code_luts(codec)[f.name].to(pages.device)
    if field_words(f) == 3:
        return page_word_values(field_planes(pages, f, block_size), lut)
    if 8 % f.bits:
        return lut[unpack_bits(field_bytes(pages, f, block_size), f.bits, f.count)]
    return unpack_lookup(field_bytes(pages, f, block_size), f.bits, f.count, lut)


def _unit_vectors(codec: TQCodec, codes, pages, block_size: int) -> torch.Tensor:
    """The (corrected) centroid vectors of one of the codec's ``_ScalarCodes`` (what
    ``codes.centroid_vectors`` gives on the same slots)."""
    parts = [_field_values(codec, pages, f, block_size) for f in codes.fields]
    c = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
    if codes.correction == "nc":
        return c / c.norm(dim=-1, keepdim=True)
    return c * codes.debias if codes.correction == "debias" else c


def decode_pages(codec: TQCodec, pages: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """:func:`~tqattn.quant.attention_ref.decode_for_attention` of every token of pages (B, Hk,
    n, page bytes) → tensors (B, n·block_size, Hk, ...), computed in the same order (so to the
    same bits). Values at positions outside ``valid`` (B, n·block_size) are 0: stale page bytes
    never reach an output through a zero weight (0 · NaN would)."""
    lay, bs = codec.layout, pages.shape[-1] // codec.slot_bytes
    keep = valid[:, None, :]                                                       # (B, 1, L)
    if codec.preset.key.codec == "fp8":
        raw = field_bytes(pages, lay.field("k_fp8"), bs).contiguous()
        dec = {"keys": raw.view(torch.float8_e4m3fn).float()}
    else:
        n = fp16_field(pages, lay.field("k_norm"), bs)
        dec = {"keys": _unit_vectors(codec, codec.keys, pages, bs).mul_(n[..., None])}
        if codec.qjl_matrix is not None:
            dec["qjl_signs"] = _field_values(codec, pages, lay.field("k_qjl"), bs)
            dec["qjl_coef"] = (n * fp16_field(pages, lay.field("k_rnorm"), bs)
                               * math.sqrt(math.pi / 2) / codec.head_dim)
        if codec.preset.key.outliers:
            dec["outliers"] = dense_outliers(field_bytes(pages, lay.field("k_out_idx"), bs),
                                             field_bytes(pages, lay.field("k_out_val"), bs),
                                             codec.head_dim)
    if codec.values is not None:
        n = torch.where(keep, fp16_field(pages, lay.field("v_norm"), bs), 0.0)
        dec["values"] = _unit_vectors(codec, codec.values, pages, bs).mul_(n[..., None])
    else:
        scale = torch.where(keep, fp16_field(pages, lay.field("v_scale"), bs), 0.0)
        zero = torch.where(keep, fp16_field(pages, lay.field("v_zero"), bs), 0.0)
        q = _field_values(codec, pages, lay.field("v_q"), bs)
        dec["values"] = q.mul_(scale[..., None]).add_(zero[..., None])
    return {k: v.transpose(1, 2) for k, v in dec.items()}


# ---- decode attention -------------------------------------------------------------------------------

def _row_layout(seq_lens, query_start_loc, query_pos_start, num_rows, device):
    """(query_start_loc, first row position) per sequence as int64 tensors on ``device``."""
    b = seq_lens.numel()
    if query_start_loc is None:
        if num_rows != b:
            raise ValueError(f"q has {num_rows} rows but there are {b} sequences; pass "
                             f"query_start_loc for several rows per sequence")
        qsl = torch.arange(b + 1, device=device)
    else:
        qsl = query_start_loc.to(device=device, dtype=torch.int64)
        if qsl.numel() != b + 1 or int(qsl[-1]) > num_rows:
            raise ValueError(f"query_start_loc {qsl.tolist()} does not fit {b} sequences and "
                             f"{num_rows} rows")
    lens = seq_lens.to(device=device, dtype=torch.int64)
    if query_pos_start is None:
        return qsl, lens - (qsl[1:] - qsl[:-1])
    return qsl, query_pos_start.to(device=device, dtype=torch.int64)


def decode_attention_ref(codec: TQCodec, q: torch.Tensor, kv_cache: torch.Tensor,
                         block_table: torch.Tensor, seq_lens: torch.Tensor,
                         query_start_loc: torch.Tensor | None = None,
                         query_pos_start: torch.Tensor | None = None, scale: float | None = None,
                         window: int | None = None, softcap: float = 0.0,
                         return_lse: bool = False):
    """Attention of q (rows, Hq, D) over the paged compressed cache → fp32 (rows, Hq, D) [, lse].

    Row semantics: see the module docstring. All sequences at once: their caches are decoded
    padded to the longest and their rows padded to the most rows of one sequence.
    """
    rows, hq, d = q.shape
    hk = kv_cache.shape[1]
    if d != codec.head_dim or hq % hk:
        raise ValueError(f"q shape {tuple(q.shape)} does not fit {hk} KV heads at head size "
                         f"{codec.head_dim}")
    dev = q.device
    qsl, starts = _row_layout(seq_lens, query_start_loc, query_pos_start, rows, dev)
    out = torch.zeros(rows, hq, d, dtype=torch.float32, device=dev)
    lse = torch.full((rows, hq), -math.inf, dtype=torch.float32, device=dev)
    counts = qsl[1:] - qsl[:-1]
    n_rows = int(qsl[-1])
    if n_rows == 0 or not bool((seq_lens > 0).any()):
        return (out, lse) if return_lse else out
    pages, valid = sequence_pages(kv_cache, block_table, seq_lens, cache_block_size(codec, kv_cache))
    dec = decode_pages(codec.folded(), pages, valid.to(dev))
    # rows → (sequence, row within it), padded to the most rows of one sequence
    seq = torch.repeat_interleave(torch.arange(len(counts), device=dev), counts)
    t = torch.arange(n_rows, device=dev) - qsl[seq]
    q_pad = q.new_zeros(len(counts), int(counts.max()), hq, d)
    q_pad[seq, t] = q[:n_rows]
    pos = starts[:, None] + torch.arange(q_pad.shape[1], device=dev)                # (B, T)
    kv_lens = torch.minimum(pos + 1, seq_lens.to(device=dev, dtype=torch.int64)[:, None])
    visible = visible_keys(valid.shape[1], kv_lens.clamp_min(0), window, row_pos=pos)
    o, l = attend(codec, q_pad, dec, visible, scale=scale, softcap=softcap)
    out[:n_rows], lse[:n_rows] = o[seq, t], l[seq, t]
    return (out, lse) if return_lse else out


# ---- dequantize -------------------------------------------------------------------------------------

def dequant_ref(codec: TQCodec, kv_cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Paged cache → K, V (sum(seq_lens), Hk, D) in the original basis, packed by sequence
    (sequence b at rows cu_seqlens[b]:cu_seqlens[b+1], cu_seqlens = [0, cumsum(seq_lens)])."""
    d, hk = codec.head_dim, kv_cache.shape[1]
    if int(seq_lens.sum()) == 0:
        return (torch.zeros(0, hk, d, dtype=dtype, device=kv_cache.device),) * 2
    folded = codec.folded()
    pages, valid = sequence_pages(kv_cache, block_table, seq_lens, cache_block_size(codec, kv_cache))
    dec = {k: v[valid] for k, v in decode_pages(folded, pages, valid).items()}   # (N, Hk, ...)
    k, v = dec["keys"], dec["values"]
    if folded.preset.key.codec != "fp8":               # the order of TQCodec.decode_keys
        k = k @ folded.rotation.T
        if "outliers" in dec:
            k = k + dec["outliers"]
        if folded.qjl_matrix is not None:
            k = k + dec["qjl_coef"][..., None] * (dec["qjl_signs"] @ folded.qjl_matrix)
    if folded.values is not None:
        v = v @ folded.rotation.T
    return k.to(dtype), v.to(dtype)
