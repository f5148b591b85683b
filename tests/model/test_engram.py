"""Specification of model/engram.py: the Engram hash (exact 64-bit), its history contract, the gate.

References here are written independently of the module: the hash in plain Python ints with explicit
masking to 64 bits, the gate per vector with `math`. Only the random constants (multipliers, primes,
offsets) are read from the hasher, and those are checked on their own.
"""

import math
import random
from types import SimpleNamespace

import pytest
import torch

from megafuse.model.engram import Engram, EngramHasher, engram_gate, mod_u64, mul_u64

MASK64 = (1 << 64) - 1


def tiny_cfg(**over):
    cfg = dict(dim=64, hc_mult=4, rms_norm_eps=1e-20, vocab_size=1024, engram_vocab=900,
               engram_max_ngram=3, engram_heads=2, engram_head_dim=32, engram_head_rows=300,
               engram_seed=1234)
    cfg.update(over)
    return SimpleNamespace(**cfg)


def full_cfg():
    # Full-model hash geometry (orders 1..3, 8 heads, 8M-row sub-tables); no table is built.
    return tiny_cfg(dim=5120, vocab_size=129280, engram_vocab=100_000, engram_max_ngram=4,
                    engram_heads=8, engram_head_dim=256, engram_head_rows=8_000_000)


HASH_CFGS = {"tiny": tiny_cfg, "full": full_cfg}


# ---- independent pure-Python hash -------------------------------------------------------------

def reference_rows(hasher, cfg, ids, history):
    """Python-int rolling hash for a [B, T] list of ids; history: [B, K] list or None."""
    k_max = cfg.engram_max_ngram - 1
    mults = [m & MASK64 for m in hasher.multipliers]  # the unsigned values behind the int64 bits
    pad = cfg.engram_vocab
    out = []
    for b, seq in enumerate(ids):
        hist = [-1] * k_max if history is None else list(history[b])
        ctx = [pad if x < 0 else x % cfg.engram_vocab for x in hist + list(seq)]
        rows_b = []
        for i in range(len(seq)):
            p = k_max + i
            r = (ctx[p] * mults[0]) & MASK64
            row = []
            for k in range(1, k_max + 1):
                r ^= (ctx[p - k] * mults[k]) & MASK64
                for h in range(cfg.engram_heads):
                    row.append(r % hasher.primes[k - 1][h] + hasher.offsets[k - 1][h])
            rows_b.append(row)
        out.append(rows_b)
    return out


def is_prime_slow(n):
    return n >= 2 and all(n % f for f in range(2, math.isqrt(n) + 1))


def random_ids(gen, cfg, shape):
    return torch.randint(0, cfg.vocab_size, shape, generator=gen, dtype=torch.int64)


def history_before(ids, start, k_max):
    """The k_max ids before column `start` of ids [B, T], oldest first, -1 before position 0."""
    pad = ids.new_full((ids.shape[0], k_max), -1)
    return torch.cat([pad, ids[:, :start]], dim=1)[:, -k_max:]


# ---- hasher constants --------------------------------------------------------------------------

@pytest.mark.parametrize("which", HASH_CFGS)
def test_constants_are_odd_multipliers_distinct_primes_and_cumulative_offsets(which):
    cfg = HASH_CFGS[which]()
    hasher = EngramHasher(cfg, layer_id=1)
    k_max, heads = cfg.engram_max_ngram - 1, cfg.engram_heads
    assert len(hasher.multipliers) == cfg.engram_max_ngram
    assert all(m % 2 == 1 and -(1 << 63) <= m < (1 << 63) for m in hasher.multipliers)
    assert max(m & MASK64 for m in hasher.multipliers) >= 1 << 62  # full 64-bit draws

    primes = [p for per_order in hasher.primes for p in per_order]
    offsets = [o for per_order in hasher.offsets for o in per_order]
    assert len(primes) == k_max * heads == hasher.rows_per_token
    assert len(set(primes)) == len(primes)
    assert all(is_prime_slow(p) for p in primes) if which == "tiny" else \
        all(pow(2, p - 1, p) == 1 for p in primes)  # Fermat check is enough for the 8M primes
    assert min(primes) >= cfg.engram_head_rows
    assert max(primes) < cfg.engram_head_rows * 1.01 + 1000
    assert offsets == [sum(primes[:j]) for j in range(len(primes))]
    assert hasher.total_rows == sum(primes)


def test_limb_arithmetic_is_exact_unsigned_64_bit():
    rnd = random.Random(0)
    cs = [0, 1, 2, 899, (1 << 31) - 2] + [rnd.randrange(1 << 31) for _ in range(100)]
    ms = [1, (1 << 32) - 1, 1 << 32 | 1, (1 << 63) + 1, (1 << 64) - 1, 0x9E3779B97F4A7C15] + \
        [rnd.randrange(1 << 64) | 1 for _ in range(20)]
    c = torch.tensor(cs, dtype=torch.int64)
    for m in ms:
        hi, lo = mul_u64(c, m >> 32, m & 0xFFFFFFFF)
        assert [(h << 32) | l for h, l in zip(hi.tolist(), lo.tolist())] == \
            [(x * m) & MASK64 for x in cs]
    us = [0, 1, MASK64, 1 << 63, (1 << 63) - 1, 1 << 32, (1 << 32) - 1] + \
        [rnd.randrange(1 << 64) for _ in range(200)]
    hi = torch.tensor([u >> 32 for u in us], dtype=torch.int64)
    lo = torch.tensor([u & 0xFFFFFFFF for u in us], dtype=torch.int64)
    for p in [2, 3, 307, 8_000_009, (1 << 31) - 1]:
        assert mod_u64(hi, lo, p, (1 << 32) % p).tolist() == [u % p for u in us]


# ---- hash values ------------------------------------------------------------------------------

@pytest.mark.parametrize("which", HASH_CFGS)
def test_rows_equal_python_int_reference_with_wrapping_products(which):
    cfg = HASH_CFGS[which]()
    hasher = EngramHasher(cfg, layer_id=14)
    k_max = cfg.engram_max_ngram - 1
    gen = torch.Generator().manual_seed(1)
    ids = random_ids(gen, cfg, (3, 40))
    ids[0, :4] = torch.tensor([0, cfg.engram_vocab, cfg.vocab_size - 1, cfg.engram_vocab - 1])
    history = random_ids(gen, cfg, (3, k_max))
    history[1, 0] = -1  # a sequence at position k_max - 1: its oldest context slot is before start

    # The test is only meaningful if 64-bit products really overflow.
    mults = [m & MASK64 for m in hasher.multipliers]
    assert max(c * m for c in range(2, cfg.engram_vocab + 1, 97) for m in mults) >= 1 << 64

    for hist in (None, history):
        got = hasher.rows(ids, hist)
        assert got.dtype == torch.int64
        assert got.shape == (3, 40, hasher.rows_per_token)
        want = reference_rows(hasher, cfg, ids.tolist(), None if hist is None else hist.tolist())
        assert got.tolist() == want
    assert torch.equal(hasher.rows(ids.int(), history.int()), hasher.rows(ids, history))


@pytest.mark.parametrize("which", HASH_CFGS)
def test_rows_are_deterministic_and_each_column_stays_in_its_own_range(which):
    cfg = HASH_CFGS[which]()
    ids = random_ids(torch.Generator().manual_seed(2), cfg, (4, 256))
    a = EngramHasher(cfg, layer_id=1).rows(ids)
    hasher = EngramHasher(cfg, layer_id=1)
    assert torch.equal(a, hasher.rows(ids))
    for k in range(cfg.engram_max_ngram - 1):
        for h in range(cfg.engram_heads):
            col = a[..., k * cfg.engram_heads + h]
            lo = hasher.offsets[k][h]
            assert col.min() >= lo and col.max() < lo + hasher.primes[k][h]
    assert a.max() < hasher.total_rows


def test_rows_differ_between_layers():
    cfg = full_cfg()
    ids = random_ids(torch.Generator().manual_seed(3), cfg, (2, 200))
    r1 = EngramHasher(cfg, layer_id=1).rows(ids)
    r14 = EngramHasher(cfg, layer_id=14).rows(ids)
    assert (r1 != r14).float().mean() > 0.99
    assert EngramHasher(cfg, 1).multipliers != EngramHasher(tiny_cfg(engram_seed=7), 1).multipliers


def test_rows_are_causal_and_see_exactly_max_ngram_tokens():
    cfg = tiny_cfg()
    hasher = EngramHasher(cfg, layer_id=1)
    ids = random_ids(torch.Generator().manual_seed(4), cfg, (1, 20))
    base = hasher.rows(ids)
    changed = ids.clone()
    changed[0, 10] = (changed[0, 10] + 1) % cfg.engram_vocab
    diff = (hasher.rows(changed) != base).any(-1)[0]
    # Position 10 enters the windows of positions 10 .. 10 + max_ngram - 1 only.
    assert diff.nonzero().flatten().tolist() == list(range(10, 10 + cfg.engram_max_ngram))


# ---- history contract -------------------------------------------------------------------------

@pytest.mark.parametrize("which", HASH_CFGS)
def test_chunked_hashing_with_history_equals_one_call(which):
    cfg = HASH_CFGS[which]()
    hasher = EngramHasher(cfg, layer_id=1)
    k_max = cfg.engram_max_ngram - 1
    ids = random_ids(torch.Generator().manual_seed(5), cfg, (2, 23))
    whole = hasher.rows(ids)
    # Prefill chunks (one shorter than the history), then token-by-token decode.
    bounds = [0, 1, 9, 16] + list(range(17, 24))
    parts = [hasher.rows(ids[:, s:e], history_before(ids, s, k_max))
             for s, e in zip(bounds[:-1], bounds[1:])]
    assert torch.equal(torch.cat(parts, dim=1), whole)


def test_positions_before_start_use_the_pad_id():
    cfg = tiny_cfg()
    hasher = EngramHasher(cfg, layer_id=1)
    k_max = cfg.engram_max_ngram - 1
    ids = random_ids(torch.Generator().manual_seed(6), cfg, (2, 5))
    no_history = hasher.rows(ids)
    assert torch.equal(no_history, hasher.rows(ids, torch.full((2, k_max), -1)))
    # The pad is not any real token: id 0 and id engram_vocab (both compress to 0) hash differently.
    zeros = torch.zeros(2, k_max, dtype=torch.int64)
    assert (no_history[:, 0] != hasher.rows(ids, zeros)[:, 0]).all()
    # Written out: pad = engram_vocab fills the slots of positions < 0.
    pad = cfg.engram_vocab
    m = [x & MASK64 for x in hasher.multipliers]
    c0 = ids[0, 0].item() % cfg.engram_vocab
    r1 = ((c0 * m[0]) & MASK64) ^ ((pad * m[1]) & MASK64)
    r2 = r1 ^ ((pad * m[2]) & MASK64)
    assert no_history[0, 0, 0].item() == r1 % hasher.primes[0][0]
    assert no_history[0, 0, 2].item() == r2 % hasher.primes[1][0] + hasher.offsets[1][0]


# ---- gate and injection -----------------------------------------------------------------------

def reference_gate(x, key, qk_w, eps):
    """Straight from docs/model.md section 7, one (token, stream) vector at a time, in float64."""
    d = len(x)
    dot = sum(x[i] * qk_w[i] * key[i] for i in range(d))
    dot /= math.sqrt(sum(v * v for v in x) / d + eps)
    dot /= math.sqrt(sum(v * v for v in key) / d + eps)
    dot /= math.sqrt(d)
    s = math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot) if dot != 0 else 0.0
    return 1.0 / (1.0 + math.exp(-s))


def test_gate_matches_straightforward_reference():
    gen = torch.Generator().manual_seed(7)
    n, d = 4, 64
    x = torch.randn(2, 5, n, d, generator=gen) * 3.0
    key = torch.randn(2, 5, n, d, generator=gen)
    qk_w = 1.0 + 0.5 * torch.randn(n, d, generator=gen)
    x[0, 0, 1] = 0.0  # an all-zero stream: rsqrt(eps) times 0 gives dot 0 and gate 0.5
    got = engram_gate(x, key, qk_w, 1e-20)
    assert got.dtype == torch.float32 and got.shape == (2, 5, n)
    want = torch.tensor([[[reference_gate(x[b, t, c].tolist(), key[b, t, c].tolist(),
                                          qk_w[c].tolist(), 1e-20) for c in range(n)]
                          for t in range(5)] for b in range(2)], dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
    assert got[0, 0, 1].item() == 0.5


def test_injection_adds_the_same_gated_value_to_every_stream():
    cfg = tiny_cfg()
    torch.manual_seed(8)
    layer = Engram(cfg, layer_id=1)
    gen = torch.Generator().manual_seed(9)
    ids = random_ids(gen, cfg, (2, 6))
    x = torch.randn(2, 6, cfg.hc_mult, cfg.dim, generator=gen)
    with torch.no_grad():
        out = layer(x, ids)
        rows = layer.hasher.rows(ids)
        flat = layer.table.double()[rows].flatten(-2)  # [2, 6, R*head_dim]
        kv = flat @ layer.wkv.weight.double().T
    n, d = cfg.hc_mult, cfg.dim
    key, value = kv[..., :n * d].unflatten(-1, (n, d)), kv[..., n * d:]
    delta = (out - x).double()
    for b in range(2):
        for t in range(6):
            for c in range(n):
                g = reference_gate(x[b, t, c].tolist(), key[b, t, c].tolist(),
                                   layer.qk_w[c].tolist(), cfg.rms_norm_eps)
                torch.testing.assert_close(delta[b, t, c], g * value[b, t], atol=2e-5, rtol=1e-5)
    # The streams receive one shared direction: delta_c / |delta_c| is the same for every c.
    unit = delta / delta.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(unit, unit[..., :1, :].expand_as(unit), atol=1e-6, rtol=0)


def test_lookup_flat_concatenates_the_hashed_table_rows():
    cfg = tiny_cfg()
    torch.manual_seed(10)
    layer = Engram(cfg, layer_id=4)
    ids = random_ids(torch.Generator().manual_seed(11), cfg, (2, 3))
    hist = torch.tensor([[-1, 5], [7, 8]])
    flat = layer.lookup_flat(ids, hist)
    rows = layer.hasher.rows(ids, hist)
    assert flat.shape == (2, 3, layer.hasher.rows_per_token * cfg.engram_head_dim)
    for j in range(layer.hasher.rows_per_token):
        chunk = flat[..., j * cfg.engram_head_dim:(j + 1) * cfg.engram_head_dim]
        assert torch.equal(chunk, layer.table[rows[..., j]])


def test_init_keeps_activations_finite_and_gates_unsaturated():
    cfg = tiny_cfg(dim=256, engram_head_rows=2000)
    torch.manual_seed(12)
    layer = Engram(cfg, layer_id=1)
    assert layer.table.shape == (layer.hasher.total_rows, cfg.engram_head_dim)
    assert layer.wkv.weight.shape == ((cfg.hc_mult + 1) * cfg.dim, 4 * cfg.engram_head_dim)
    qk_noise = (layer.qk_w - 1).std().item()
    assert 0.005 < qk_noise < 0.05
    gen = torch.Generator().manual_seed(13)
    ids = random_ids(gen, cfg, (4, 128))
    x = torch.randn(4, 128, cfg.hc_mult, cfg.dim, generator=gen)
    with torch.no_grad():
        kv = layer.wkv(layer.lookup_flat(ids))
        n, d = cfg.hc_mult, cfg.dim
        key, value = kv[..., :n * d].unflatten(-1, (n, d)), kv[..., n * d:]
        gate = engram_gate(x, key, layer.qk_w, cfg.rms_norm_eps)
        # The gate sees rms-normalised streams: scaling X leaves it unchanged.
        gate_scaled = engram_gate(1000.0 * x, key, layer.qk_w, cfg.rms_norm_eps)
        out = layer(x, ids)
        out_bf16 = layer.to(torch.bfloat16)(x.bfloat16(), ids)
    assert torch.isfinite(out).all() and torch.isfinite(out_bf16.float()).all()
    assert out_bf16.dtype == torch.bfloat16
    assert 0.8 < value.pow(2).mean().sqrt().item() < 1.2  # unit-variance value entries
    assert 0.8 < key.pow(2).mean().sqrt().item() < 1.2
    assert 0.1 < gate.min().item() and gate.max().item() < 0.9
    assert 0.45 < gate.mean().item() < 0.55 and gate.std().item() > 0.1
    torch.testing.assert_close(gate_scaled, gate)


def test_construction_on_meta_device_keeps_the_hash_constants():
    cfg = tiny_cfg()
    with torch.device("meta"):
        layer = Engram(cfg, layer_id=1)
    assert layer.table.is_meta and layer.wkv.weight.is_meta and layer.qk_w.is_meta
    cpu = EngramHasher(cfg, layer_id=1)
    assert layer.hasher.multipliers == cpu.multipliers
    assert layer.hasher.primes == cpu.primes and layer.hasher.offsets == cpu.offsets
    assert layer.table.shape == (cpu.total_rows, cfg.engram_head_dim)


# ---- torch.compile ----------------------------------------------------------------------------

def test_compiled_rows_equal_eager_with_constant_multipliers():
    # Default compile bakes the multipliers in as C++ literals: the case where plain int64
    # wrap-around code hits signed-overflow UB (gcc drops the sign fix-up) and differs from eager.
    torch._dynamo.reset()
    cfg = tiny_cfg()
    hasher = EngramHasher(cfg, layer_id=1)
    compiled = torch.compile(hasher.rows, fullgraph=True)
    gen = torch.Generator().manual_seed(14)
    ids = random_ids(gen, cfg, (2, 9))
    history = random_ids(gen, cfg, (2, 2))
    history[0, 0] = -1
    assert torch.equal(compiled(ids, history), hasher.rows(ids, history))
    one = random_ids(gen, cfg, (3, 1))  # a decode step without history: position 0
    assert torch.equal(compiled(one), hasher.rows(one))


def test_compiled_rows_equal_eager_with_dynamic_shapes():
    # dynamic=True turns T, B and the hash constants into symbols: one graph for every length.
    torch._dynamo.reset()
    cfg = full_cfg()
    hasher = EngramHasher(cfg, layer_id=14)
    compiled = torch.compile(hasher.rows, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(15)
    for b, t in [(2, 9), (3, 4)]:
        ids = random_ids(gen, cfg, (b, t))
        history = random_ids(gen, cfg, (b, 3))
        history[0, :2] = -1
        assert torch.equal(compiled(ids, history), hasher.rows(ids, history))


def test_compiled_forward_equals_eager():
    # Two layers through the same forward code: the second compile sees other hash constants.
    torch._dynamo.reset()
    cfg = tiny_cfg()
    torch.manual_seed(15)
    gen = torch.Generator().manual_seed(16)
    ids = random_ids(gen, cfg, (2, 7))
    hist = random_ids(gen, cfg, (2, 2))
    x = torch.randn(2, 7, cfg.hc_mult, cfg.dim, generator=gen)
    for layer_id, history in ((1, hist), (4, None)):
        layer = Engram(cfg, layer_id=layer_id)
        compiled = torch.compile(layer, fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, ids, history), layer(x, ids, history),
                                       atol=1e-5, rtol=1e-5)
