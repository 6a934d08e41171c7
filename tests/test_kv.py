"""Ring == uniform == one-shot prefill, for several chunk sizes and for decode steps after a prefill,
on prompts several sliding windows long."""
import os

import numpy as np
import pytest

from reference import gguf
from reference.kv import CacheError, KVCache, cache_bytes, check_fits
from reference.text import TextModel
from reference.metrics import nmse
from conftest import MODELS

# The reference accumulates every product in float64 and rounds once (ops.linear, ops.attention),
# so chunking and cache layout change nothing but the order of f64 sums: 1e-12 is the required gate,
# and in practice the logits are bit-identical.
CHUNK_NMSE = 1e-12


@pytest.fixture(scope="module", params=["tiny-a-f32.gguf", "tiny-b-f32.gguf"])
def lm(request):
    return TextModel(gguf.load(os.path.join(MODELS, request.param), "text"))


def prompt(lm, n, seed=0):  # n random ordinary token ids
    return np.random.default_rng(seed).integers(0, lm.cfg.n_vocab - 16, n)


def test_prompt_spans_several_windows(lm):
    assert 100 >= 3 * lm.cfg.n_swa + 1


@pytest.mark.parametrize("kind", ["uniform", "ring"])
@pytest.mark.parametrize("chunk", [1, 3, 16, 17, 64])
def test_chunked_prefill_equals_one_shot(lm, kind, chunk):
    ids = prompt(lm, 100)
    one_shot = lm.prefill(ids, lm.new_cache(100, "uniform", 100), 100)
    chunked = lm.prefill(ids, lm.new_cache(100, kind, chunk), chunk)
    assert nmse(one_shot.ravel(), chunked.ravel()) <= CHUNK_NMSE


def test_ring_is_smaller_than_uniform_and_wraps(lm):
    cache = lm.new_cache(4096, "ring", 8)
    swa = [il for il, s in enumerate(lm.cfg.swa_layers) if s]
    assert cache.layers[swa[0]].rows == 256 < cache.layers[lm.cfg.swa_layers.index(False)].rows
    # 300 tokens through a 256-row ring: it wraps, and still matches one-shot
    ids = prompt(lm, 300, seed=3)
    ring = lm.prefill(ids, cache, 8)
    one_shot = lm.prefill(ids, lm.new_cache(300, "uniform", 300), 300)
    assert nmse(one_shot.ravel(), ring.ravel()) <= CHUNK_NMSE


@pytest.mark.parametrize("kind", ["uniform", "ring"])
def test_decode_after_prefill_equals_one_shot(lm, kind):
    ids = prompt(lm, 80, seed=1)
    one_shot = lm.prefill(ids, lm.new_cache(80, "uniform", 80), 80)
    cache = lm.new_cache(80, kind, 16)
    head = lm.prefill(ids[:50], cache, 16)
    steps = [lm.prefill([t], cache, 16) for t in ids[50:]]
    assert nmse(one_shot.ravel(), np.concatenate([head, *steps]).ravel()) <= CHUNK_NMSE


def test_truncate_then_refeed_is_identical(lm):
    ids = prompt(lm, 40, seed=2)
    cache = lm.new_cache(64, "ring", 8)
    first = lm.prefill(ids, cache, 8)
    cache.truncate(30)
    again = lm.prefill(ids[30:], cache, 8)
    assert np.array_equal(first[30:], again)


def test_context_full_and_oversized_batch():
    cache = KVCache(2, (True, False), 4, 16, 1, 8, np.float32, "ring", chunk=4)
    with pytest.raises(CacheError, match="context full"):
        cache.check_room(17, 4)
    with pytest.raises(CacheError, match="exceeds the ring's chunk size"):
        cache.check_room(8, 8)
    with pytest.raises(CacheError, match="unknown KV cache kind"):
        KVCache(2, (True, False), 4, 16, 1, 8, np.float32, "paged")


@pytest.mark.parametrize("kind, n_ctx, chunk", [("uniform", 100, 100), ("ring", 700, 16), ("ring", 100, 64)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cache_bytes_is_what_the_cache_allocates(lm, kind, n_ctx, chunk, dtype):
    # reference.run refuses a context from this figure before allocating it: it must be the allocation
    cache = KVCache(lm.cfg.n_layer, lm.cfg.swa_layers, lm.cfg.n_swa, n_ctx, lm.cfg.n_head_kv, lm.cfg.head_dim, dtype,
                    kind, chunk)
    allocated = sum(layer.k.nbytes + layer.v.nbytes + layer.pos.nbytes for layer in cache.layers)
    assert cache_bytes(lm.cfg, n_ctx, kind, chunk, dtype) == allocated


def test_a_cache_larger_than_memory_is_refused_before_it_is_allocated(lm):
    with pytest.raises(CacheError, match=r"^a context of 2\*\*40 tokens needs a .* GiB KV cache, more than the"):
        check_fits(lm.cfg, 1 << 40, "uniform", 2048, np.float32, "a context of 2**40 tokens")
