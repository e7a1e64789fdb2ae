"""Plain references the engine tests compare against, and tests of the references themselves.

``ChunkedReference`` runs the transformers model one request at a time, chunk by chunk, with an
attention function that keeps each layer's history the way the engine's cache holds it:
TurboQuant layers keep ``codec.folded().decode(codec.encode(k, v, fold_nc=True))`` (what
reading a compressed page slot gives), full-precision layers the raw K/V. It follows the
backends' rule: tokens stored by earlier steps are read from that history; the K/V of the
step's own chunk are read raw, except that a one-token chunk is stored first and attends to
itself compressed. ``key_offsets`` (per layer an (Hk, D) tensor or None, the engine's): a
centered TurboQuant layer encodes k − μ and reads back the decoded keys + μ (the raw chunk as it
came), which is the un-centered attention over the codes a centering engine writes.

``record_chunks`` spies on an engine's model runner to get the chunking each request saw.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

pytest.importorskip("transformers")

from tqattn.attention.turboquant import get_codec  # noqa: E402
from tqattn.models import load_model  # noqa: E402

REF_IMPL = "tqattn_test_reference"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models: one thread is faster, and much faster when other jobs share the cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _dense(q, k, v, q_pos, scale, window, softcap):
    """q (T, Hq, D) at absolute positions q_pos over keys k, v (L, Hk, D) at positions 0..L-1."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = torch.einsum("thd,lhd->htl", q.float(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    kpos = torch.arange(k.shape[0])
    visible = kpos[None, :] <= q_pos[:, None]
    if window:
        visible &= kpos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~visible[None], -math.inf)
    return torch.einsum("htl,lhd->thd", torch.softmax(s, -1), v)


class _State:
    """The history of the request being run: per layer, the K/V the cache would return."""

    def __init__(self, kv_dtypes, key_offsets=None, pad_to=None):
        self.kv_dtypes = kv_dtypes
        self.key_offsets = key_offsets
        self.pad_to = pad_to  # a padded cache: vectors zero-padded to this head size
        self.k = defaultdict(list)
        self.v = defaultdict(list)

    def length(self, layer=0) -> int:
        return sum(x.shape[0] for x in self.k[layer])

    def truncate(self, n):
        """Keep the first n positions (a preempted request resuming from its own cached blocks)."""
        for hist in (self.k, self.v):
            for i in list(hist):
                hist[i] = [torch.cat(hist[i])[:n]]

    def stored(self, layer, k, v):
        preset = self.kv_dtypes[layer]
        if preset == "auto":
            return k, v
        d = k.shape[-1]
        codec = get_codec(preset, self.pad_to or d)
        mu = None if self.key_offsets is None else self.key_offsets[layer]
        mu = 0.0 if mu is None else mu.to(k.dtype)
        pad = (0, codec.head_dim - d)
        # the paged cache's form: "nc" norms folded (tqattn.quant.paged)
        k_hat, v_hat = codec.folded().decode(codec.encode(
            torch.nn.functional.pad(k - mu, pad), torch.nn.functional.pad(v, pad),
            on_nonfinite="propagate", fold_nc=True))
        return k_hat[..., :d] + mu, v_hat[..., :d]


_current: _State | None = None


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         sliding_window=None, softcap=None, **kwargs):
    st, i = _current, module.layer_idx
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    t, start = q.shape[0], st.length(i)
    k_st, v_st = st.stored(i, k, v)
    if t == 1 and st.kv_dtypes[i] != "auto":  # one-token chunk: stored first, read compressed
        k_all, v_all = torch.cat(st.k[i] + [k_st]), torch.cat(st.v[i] + [v_st])
    else:
        k_all, v_all = torch.cat(st.k[i] + [k]), torch.cat(st.v[i] + [v])
    st.k[i].append(k_st)
    st.v[i].append(v_st)
    out = _dense(q, k_all, v_all, start + torch.arange(t), scaling, sliding_window, softcap)
    return out.to(query.dtype).unsqueeze(0), None


def engine_key_offsets(llm):
    """The key offsets a ``tqattn.LLM`` centers its keys by, or None."""
    return llm.llm_engine.key_plan.key_offsets


class ChunkedReference:
    def __init__(self, name, kv_dtypes, key_offsets=None, pad_to=None, **load_kwargs):
        from transformers import AttentionInterface

        AttentionInterface.register(REF_IMPL, _reference_attention)
        load_kwargs.setdefault("load_format", "dummy")
        self.lm = load_model(name, **load_kwargs)
        self.lm.model.set_attn_implementation(REF_IMPL)
        n = self.lm.info.num_layers
        self.kv_dtypes = [kv_dtypes] * n if isinstance(kv_dtypes, str) else list(kv_dtypes)
        self.key_offsets = key_offsets
        self.pad_to = pad_to

    @torch.inference_mode()
    def _run_chunk(self, st, ids, start):
        global _current
        _current = st
        try:
            pos = torch.arange(start, start + len(ids))
            out = self.lm.model(input_ids=torch.tensor([ids]), position_ids=pos[None], use_cache=False)
        finally:
            _current = None
        return int(out.logits[0, -1].argmax())

    def generate(self, prompt, max_tokens, chunks=None):
        """Greedy tokens of one request; chunks = [(start, n), ...] in the order the engine ran
        them (None: the whole prompt, then one token at a time)."""
        tokens, out = list(prompt), []
        st = _State(self.kv_dtypes, self.key_offsets, self.pad_to)
        chunks = list(chunks) if chunks is not None else None
        while len(out) < max_tokens:
            if chunks is None:
                start = st.length()
                n = len(tokens) - start
            else:
                start, n = chunks.pop(0)
            if start < st.length():  # preempted: recomputed from start (0, or its own cached blocks)
                st.truncate(start)
            if start > st.length():  # a prefix-cache hit: the donor prefilled it in one chunk
                self._run_chunk(st, tokens[st.length():start], st.length())
            tok = self._run_chunk(st, tokens[start:start + n], start)
            if start + n == len(tokens):
                tokens.append(tok)
                out.append(tok)
        return out


def record_chunks(llm):
    """Spy on llm's model runner; returns {request_id: [(start, n), ...]} filled as it runs."""
    runner = llm.llm_engine.runner
    chunks = defaultdict(list)
    launch = runner.launch

    def spy(scheduled, *args, **kwargs):
        for s in scheduled:
            chunks[s.seq.seq_id].append((s.num_computed_tokens, s.num_scheduled_tokens))
        return launch(scheduled, *args, **kwargs)

    runner.launch = spy
    return chunks


def hf_greedy(lm, prompt, max_tokens):
    """transformers' own generate, greedy, never stopping early."""
    out = lm.model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                            eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", ["llama-tiny", "gemma3-tiny"])
def test_reference_with_full_precision_is_hf_generate(name):
    ref = ChunkedReference(name, "auto")
    hf = load_model(name, load_format="dummy")
    short, long = random_prompts([7, 21])
    assert ref.generate(short, 12) == hf_greedy(hf, short, 12)
    expected = hf_greedy(hf, long, 12)
    assert ref.generate(long, 12) == expected
    # chunking cannot change full-precision results
    chunks = [(0, 5), (5, 5), (10, 11)] + [(21 + j, 1) for j in range(11)]
    assert ref.generate(long, 12, chunks) == expected


def test_reference_quantizes():
    ref = ChunkedReference("llama-tiny", "turboquant_3bit_nc")
    hf = load_model("llama-tiny", load_format="dummy")
    prompt = random_prompts([30])[0]
    assert ref.generate(prompt, 16) != hf_greedy(hf, prompt, 16)
