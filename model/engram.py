"""Engram: hashed n-gram memory injected into the mHC residual streams (docs/model.md section 7).

An Engram layer looks up rows of a large embedding table addressed by hashes of the last few token
ids, turns them into one key per residual stream and one shared value, and adds the value to every
stream through a per-stream sigmoid gate. The hash depends on token ids only, so the rows a batch
needs are known before the layer runs and the runtime can prefetch them from host memory.

Dataflow for one token at position p (K = engram_max_ngram - 1 n-gram orders, H_e heads)::

    ids  ... id[p-K] .. id[p-1]  id[p]          (positions < 0: pad)
             |                   |
             c = id mod V'      (pad = V')                       EngramHasher
             |
    r_0 = c[p]*m_0;  r_k = r_{k-1} XOR c[p-k]*m_k      (unsigned 64-bit, products mod 2^64)
             |
    row[k,h] = (r_k mod P[k][h]) + offset[k,h]        k = 1..K, h = 0..H_e-1
             |                                          -> R = K*H_e row ids
             v
    table[row]  [R, head_dim] --flatten--> flat [R*head_dim]                 lookup_flat
             |
           wkv  --> key [n, D] (one per stream) | value [D] (shared)
             |
    X [n, D] --+--> dot_c = <X_c * qk_w_c, key_c> / (rms(X_c) rms(key_c) sqrt(D))      inject
               |    gate_c = sigmoid(sign(dot_c) sqrt(max(|dot_c|, 1e-6)))
               +--> X'_c = X_c + gate_c * value       (every stream gets the same value)

Column order of the row ids is order-major: column ``(k-1)*H_e + h``. Every (k, h) owns the disjoint
row range ``[offset[k,h], offset[k,h] + P[k][h])`` of one table, so one gather serves all heads.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

_U64 = 1 << 64


def _is_prime(n: int) -> bool:
    """Deterministic trial division; head_rows are at most ~1e8, so sqrt(n) <= 1e4 steps."""
    if n < 2:
        return False
    if n % 2 == 0 or n % 3 == 0:
        return n in (2, 3)
    f = 5
    while f * f <= n:
        if n % f == 0 or n % (f + 2) == 0:
            return False
        f += 6
    return True


def consecutive_primes(start: int, count: int) -> list[int]:
    """The first `count` primes >= `start`, ascending (hence distinct)."""
    primes = []
    n = max(start, 2)
    while len(primes) < count:
        if _is_prime(n):
            primes.append(n)
        n += 1
    return primes


def _as_int64(u: int) -> int:
    """Reinterpret an unsigned 64-bit value as the signed int64 with the same bits."""
    return u - _U64 if u >= 1 << 63 else u


# 64-bit arithmetic on 32-bit limbs.
#
# The hash is defined on unsigned 64-bit words: products wrap mod 2^64 and `mod P` reads all 64 bits
# as unsigned. The obvious int64 code (`c * m` wrapping, then a sign fix-up with 2^64 mod P) is
# right in eager PyTorch but NOT under inductor's C++ backend: signed overflow is undefined in C++,
# so with the multipliers baked in as literals the compiler may assume `c * m >= 0` and drop the
# `r < 0` fix-up (observed: compiled rows differed from eager in ~16% of entries). Instead every
# word is a pair (hi, lo) of 32-bit limbs held in int64 and every intermediate stays in [0, 2^63):
# no overflow anywhere, so eager, C++ and Triton agree bit for bit.
_MASK32 = (1 << 32) - 1


def mul_u64(c: torch.Tensor, m_hi: int, m_lo: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(c * m) mod 2^64 as limbs (hi, lo), for int64 c in [0, 2^31) and m = m_hi * 2^32 + m_lo.

    c * m = c*m_hi*2^32 + c*m_lo. Both partial products are below 2^31 * 2^32 = 2^63; the carry of
    the low product into the high limb is below 2^31, and (c*m_hi + carry) < 2^63 still. Bits above
    2^64 are c*m_hi's high half, dropped by the mask.
    """
    low = c * m_lo
    hi = torch.bitwise_and(c * m_hi + torch.bitwise_right_shift(low, 32), _MASK32)
    return hi, torch.bitwise_and(low, _MASK32)


def mod_u64(hi: torch.Tensor, lo: torch.Tensor, p: int, two32_mod_p: int) -> torch.Tensor:
    """(hi * 2^32 + lo) mod p for limbs in [0, 2^32) and a prime 1 < p < 2^31; result in [0, p).

    u mod p = (hi * (2^32 mod p) + lo) mod p. With 2^32 mod p < p < 2^31 the sum is below
    2^32 * 2^31 = 2^63: no overflow. `two32_mod_p` is passed in precomputed so a traced graph does
    no big-int arithmetic even when torch.compile turns p into a symbol.
    """
    return torch.remainder(hi * two32_mod_p + lo, p)


class EngramHasher:
    """Token ids -> table row ids for one Engram layer. Pure function of the ids; no parameters.

    All constants are Python ints (not tensors): they are independent of the device the model is
    built on (meta included), need no buffers to re-materialise, and torch.compile folds them into
    the graph.

    - Compression: ``c = id mod engram_vocab``, the chosen deterministic surjection vocab -> V'.
    - Pad: ``pad_id = engram_vocab`` (one past the last compressed id, so it never aliases a real
      token). It stands for positions before the sequence start; any negative id (in `ids` or in
      `history`) also maps to it, so callers mark "no token here" with -1.
    - Multipliers m_0..m_K (`multipliers`, signed int64 with the bits of the unsigned draw): odd
      64-bit values from numpy's legacy RandomState seeded with (engram_seed, layer_id).
      RandomState's stream is frozen by numpy's compatibility policy, so the hash (and therefore
      which table row holds which n-gram) survives library upgrades.
    - Primes: ``K*H_e`` consecutive primes >= engram_head_rows, the same for every layer so all
      Engram layers have tables of the same shape; layers differ through their multipliers.
    """

    def __init__(self, cfg, layer_id: int):
        self.layer_id = int(layer_id)
        self.compressed_vocab = int(cfg.engram_vocab)
        self.pad_id = self.compressed_vocab
        self.max_ngram = int(cfg.engram_max_ngram)
        self.num_orders = self.max_ngram - 1  # K: orders 1..K are (k+1)-grams
        self.num_heads = int(cfg.engram_heads)
        assert self.num_orders >= 1 and self.num_heads >= 1
        assert 1 <= self.compressed_vocab < (1 << 31) - 1, "mul_u64 needs compressed ids < 2^31"

        rs = np.random.RandomState([int(cfg.engram_seed), self.layer_id])
        halves = rs.randint(0, 1 << 32, size=(self.max_ngram, 2), dtype=np.uint64)
        # `| 1`: an odd multiplier is invertible mod 2^64, so c -> c*m loses no bits of c.
        unsigned = [(int(hi) << 32) | int(lo) | 1 for hi, lo in halves]
        self.multipliers = [_as_int64(u) for u in unsigned]
        self._mult_limbs = [(u >> 32, u & _MASK32) for u in unsigned]

        # primes[k-1][h] and offsets[k-1][h] for order k and head h, cumulative in column order.
        n_cols = self.num_orders * self.num_heads
        flat_primes = consecutive_primes(int(cfg.engram_head_rows), n_cols)
        assert flat_primes[-1] < 1 << 31, "mod_u64 needs primes < 2^31"
        self.primes = [flat_primes[i * self.num_heads:(i + 1) * self.num_heads]
                       for i in range(self.num_orders)]
        offsets, acc = [], 0
        for p in flat_primes:
            offsets.append(acc)
            acc += p
        self.offsets = [offsets[i * self.num_heads:(i + 1) * self.num_heads]
                        for i in range(self.num_orders)]
        self._two32_mods = [[(1 << 32) % p for p in per_order] for per_order in self.primes]
        self._total_rows = acc

    @property
    def total_rows(self) -> int:
        """Rows of the layer's table: the sum of all primes."""
        return self._total_rows

    @property
    def rows_per_token(self) -> int:
        """R = (max_ngram - 1) * engram_heads row ids per token."""
        return self.num_orders * self.num_heads

    def compress(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> compressed ids in [0, V'); negative ids -> pad_id."""
        return torch.where(ids < 0, self.pad_id, torch.remainder(ids, self.compressed_vocab))

    def rows_from_windows(self, windows: torch.Tensor) -> torch.Tensor:
        """Row ids from explicit n-gram windows.

        windows: int64 [..., max_ngram], oldest first: ``windows[..., K - k]`` is the id at p - k
        (the last entry is the current token); negative entries mean "before the sequence start".
        Returns int64 [..., R]. This is the general entry point (e.g. for packed varlen batches,
        where each token's window is gathered per request); `rows` builds the windows for [B, T].
        """
        c = self.compress(windows.to(torch.int64))  # int32 ids would overflow in mul_u64
        k_max = self.num_orders
        r_hi, r_lo = mul_u64(c[..., k_max], *self._mult_limbs[0])  # r_0 = c_p * m_0
        cols = []
        for k in range(1, k_max + 1):
            t_hi, t_lo = mul_u64(c[..., k_max - k], *self._mult_limbs[k])
            # r_k = r_{k-1} XOR c_{p-k} * m_k, limb by limb.
            r_hi, r_lo = torch.bitwise_xor(r_hi, t_hi), torch.bitwise_xor(r_lo, t_lo)
            for h in range(self.num_heads):
                row = mod_u64(r_hi, r_lo, self.primes[k - 1][h], self._two32_mods[k - 1][h])
                cols.append(row + self.offsets[k - 1][h])
        return torch.stack(cols, dim=-1)

    def rows(self, ids: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """ids int64 [B, T] (T >= 1) -> row ids int64 [B, T, R].

        history: int64 [B, max_ngram - 1], the ids just before ids[:, 0], oldest first (-1 where
        that position is before the sequence start), or None when ids[:, 0] is position 0.
        Hashing a sequence in chunks, each passing the previous max_ngram - 1 ids as history, gives
        exactly the rows of one call (incremental decode relies on it).
        """
        k_max = self.num_orders
        if history is None:
            history = ids.new_full((ids.shape[0], k_max), -1)
        ctx = torch.cat([history.to(ids.dtype), ids], dim=1)  # [B, K + T]
        t = ids.shape[1]
        # windows[b, i, j] = ctx[b, i + j]: ids at positions i - K + j, j = 0..K.
        windows = torch.stack([ctx[:, j:j + t] for j in range(k_max + 1)], dim=-1)
        return self.rows_from_windows(windows)


def engram_gate(x: torch.Tensor, key: torch.Tensor, qk_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-stream Engram gate, fp32 (the reference the fused kernels compare against).

    x: [..., n, D] streams, key: [..., n, D], qk_w: [n, D]. Returns [..., n] in (0, 1):
        dot_c  = sum_d x_c[d] qk_w[c,d] key_c[d]
                 * rsqrt(mean(x_c^2) + eps) * rsqrt(mean(key_c^2) + eps) * D^-0.5
        gate_c = sigmoid(sign(dot_c) * sqrt(max(|dot_c|, 1e-6)))
    The signed square root flattens large |dot| so the gate saturates slowly.
    """
    x = x.float()
    key = key.float()
    dim = x.shape[-1]
    dot = (x * qk_w.float() * key).sum(-1)
    dot = dot * torch.rsqrt(x.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = dot * dim ** -0.5
    return torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))


class Engram(nn.Module):
    """One Engram layer: ``X' = Engram(X, ids)`` on the mHC streams, before its attention site.

    Parameters: ``table [total_rows, head_dim]`` (host-resident at full size: 384M rows of 256, ~200 GB in bf16),
    ``wkv: R*head_dim -> (n+1)*D`` (n keys then one value), ``qk_w [n, D]``.
    Split for the runtime: ``forward = inject(X, lookup_flat(ids, history))``; `lookup_flat` touches
    only the table, so it can run (prefetch) ahead of the layer.
    """

    def __init__(self, cfg, layer_id: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.hasher = EngramHasher(cfg, layer_id)
        self.dim = int(cfg.dim)
        self.hc_mult = int(cfg.hc_mult)
        self.eps = float(cfg.rms_norm_eps)
        self.head_dim = int(cfg.engram_head_dim)
        fan_in = self.hasher.rows_per_token * self.head_dim
        # table and wkv take the model dtype; qk_w stays fp32 (it only enters the fp32 gate).
        self.table = nn.Parameter(torch.empty(self.hasher.total_rows, self.head_dim, dtype=dtype))
        self.wkv = nn.Linear(fan_in, (self.hc_mult + 1) * self.dim, bias=False, dtype=dtype)
        self.qk_w = nn.Parameter(torch.empty(self.hc_mult, self.dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random init from the default RNG (a no-op on meta tensors).

        table ~ N(0, 1) and wkv ~ N(0, 1/fan_in) give key and value entries of unit variance; with
        rms-normalised x and key the gate's dot is ~N(0, 1), so gates start near sigmoid(+-1), far
        from saturation. qk_w = 1 + small noise so the n streams' gates are not identical.
        """
        self.table.normal_(0.0, 1.0)
        self.wkv.weight.normal_(0.0, self.wkv.in_features ** -0.5)
        self.qk_w.normal_(1.0, 0.02)

    def lookup_flat(self, ids: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, T], history (see EngramHasher.rows) -> flat [B, T, R*head_dim] in table dtype."""
        rows = self.hasher.rows(ids, history)
        return F.embedding(rows, self.table).flatten(-2)

    def lookup_windows(self, windows: torch.Tensor) -> torch.Tensor:
        """n-gram windows [..., max_ngram] (see EngramHasher.rows_from_windows) -> flat [..., R*head_dim]."""
        return F.embedding(self.hasher.rows_from_windows(windows), self.table).flatten(-2)

    def inject(self, x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """x [..., n, D], flat [..., R*head_dim] -> x + gate * value, in x's dtype.

        Gate and add run in fp32 and round once at the end.
        """
        n, d = self.hc_mult, self.dim
        kv = self.wkv(flat.to(self.wkv.weight.dtype))
        key = kv[..., :n * d].unflatten(-1, (n, d)).float()
        value = kv[..., n * d:].float()
        xf = x.float()
        gate = engram_gate(xf, key, self.qk_w, self.eps)  # [..., n]
        return (xf + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(x.dtype)

    def forward(self, x: torch.Tensor, ids: torch.Tensor,
                history: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, n, D], ids [B, T] int64, history [B, max_ngram-1] or None -> x' [B, T, n, D]."""
        return self.inject(x, self.lookup_flat(ids, history))
