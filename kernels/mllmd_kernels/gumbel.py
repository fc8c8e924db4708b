"""gumbel: the stateless, counter-based Gumbel noise of seeded sampling (the torch and plain-Python
definitions; `sampling.gumbel_argmax` computes the same words in its kernel).

The noise of one vocabulary column depends only on (seed, output position, column), never on the
device, the batch size or the other rows, so a seeded request samples the same tokens whatever
else is batched with it. Everything is defined on 32-bit words held in int64 tensors and masked
back into [0, 2^32) after every step (each product is < 2^63: the multipliers are < 2^31), so the
integer part is bit-identical on CPU, CUDA and in the Triton kernel (uint32 wrap-around gives
the same words).

Definition (all words uint32, ``^`` xor, ``>>`` logical shift, ``*`` multiply mod 2^32)::

    mix32(x)   = x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x *= 0x735A2D97; x ^= x >> 15
    s          = seed mod 2^64;  s_lo = s & 0xFFFFFFFF;  s_hi = s >> 32;  p = position & 0xFFFFFFFF
    chain(h)   = mix32(mix32(mix32(h ^ s_lo) ^ s_hi) ^ p)
    k0, k1     = chain(0x243F6A88), chain(0x85A308D3)            # the row key
    hash32(c)  = mix32(mix32(c ^ k0) ^ k1)                       # c = vocabulary column
    u          = (hash32(c) + 0.5) * 2^-32                       # exact in float64, in (0, 1)
    g          = float32(-log(-log(u)))                          # evaluated in float64

``mix32`` is the "lowbias32" integer hash found by Chris Wellons' hash-prospector.
"""

from __future__ import annotations

import math

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
MIX_MUL1 = 0x21F0AAAD
MIX_MUL2 = 0x735A2D97
KEY_INIT0 = 0x243F6A88
KEY_INIT1 = 0x85A308D3
_INV_2_32 = 2.0**-32


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """lowbias32 in place on uint32 words held in int64 x (values in [0, 2^32)); tmp: scratch like x."""
    for shift, mul in ((16, MIX_MUL1), (15, MIX_MUL2)):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=tmp))
        x.mul_(mul).bitwise_and_(MASK32)  # < 2^32 * 2^31: no int64 overflow
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=tmp))


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on uint32 words held in an int64 tensor (values in [0, 2^32)); returns a new tensor."""
    y = x.clone()
    return _mix32_(y, torch.empty_like(y))


def split_seed(seed: int) -> tuple[int, int]:
    """(lo, hi) 32-bit words of ``seed mod 2^64`` (negative and huge seeds are accepted)."""
    s = int(seed) % (1 << 64)
    return s & MASK32, s >> 32


def _mix32_np(x: np.ndarray) -> np.ndarray:
    """lowbias32 on uint32 words held in a uint64 array (each product < 2^63)."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(MIX_MUL1)) & np.uint64(MASK32)
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(MIX_MUL2)) & np.uint64(MASK32)
    return x ^ (x >> np.uint64(15))


def row_keys_np(seed_words: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Per-row keys (k0, k1): seed_words [B, 2] (split_seed's lo, hi), positions [B] -> int64 [B, 2]."""
    w = np.empty((len(positions), 3), dtype=np.uint64)
    w[:, :2] = seed_words.astype(np.uint64)
    w[:, 2] = positions.astype(np.uint64) & np.uint64(MASK32)
    h = np.empty((len(positions), 2), dtype=np.uint64)
    h[:, 0], h[:, 1] = KEY_INIT0, KEY_INIT1
    for j in range(3):
        h = _mix32_np(h ^ w[:, j : j + 1])
    return h.astype(np.int64)


def row_keys(seeds: list[int], positions: list[int]) -> torch.Tensor:
    """Per-row keys (k0, k1) of (seed, output position): int64 [B, 2] on the CPU, values in [0, 2^32)
    (the caller copies them to the device)."""
    if len(seeds) != len(positions):
        raise ValueError(f"{len(seeds)} seeds for {len(positions)} positions")
    words = np.array([split_seed(s) for s in seeds], dtype=np.int64).reshape(-1, 2)
    keys = row_keys_np(words, np.array(positions, dtype=np.int64))
    return torch.from_numpy(keys)


def hash32(keys: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """hash32 of columns under row keys: keys [N, 2] with cols [N] or [1, V] / [N, V] -> int64 words."""
    k0, k1 = keys[:, 0], keys[:, 1]
    if cols.dim() == 2:
        k0, k1 = k0[:, None], k1[:, None]
    x = cols ^ k0
    tmp = torch.empty_like(x)
    _mix32_(x, tmp).bitwise_xor_(k1)
    return _mix32_(x, tmp)


def words_to_uniform(h: torch.Tensor) -> torch.Tensor:
    """32-bit words -> uniforms (h + 0.5) * 2^-32 in (0, 1) strictly: float64, exact."""
    return h.to(torch.float64).add_(0.5).mul_(_INV_2_32)


def uniform_to_gumbel(u: torch.Tensor) -> torch.Tensor:
    """float64 uniforms -> standard Gumbel -log(-log(u)), evaluated in float64, returned as float32."""
    return u.log().neg_().log_().neg_().to(torch.float32)


def uniform(keys: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) strictly, float64, same shape as hash32(keys, cols)."""
    return words_to_uniform(hash32(keys, cols))


def gumbel(keys: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Gumbel noise of columns under row keys (shapes as hash32): float32."""
    return uniform(keys, cols).log_().neg_().log_().neg_().to(torch.float32)


def cpu_row_chunk(vocab_size: int) -> int:
    """Rows per chunk for dense noise on CPU: about 2^17 words, so temporaries stay in cache."""
    return max(1, (1 << 17) // max(1, vocab_size))


def add_gumbel_noise_(z: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """In place: z [N, V] float32 += the dense noise of keys [N, 2] (the values of z + gumbel_noise,
    without the [N, V] noise tensor; chunked by rows on CPU). Returns z."""
    n, vocab_size = z.shape
    cols = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)[None, :]  # [1, V]
    step = cpu_row_chunk(vocab_size) if keys.device.type == "cpu" else n
    for i in range(0, n, step):
        z[i : i + step] += gumbel(keys[i : i + step], cols)
    return z


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Dense noise for every column: keys [N, 2] -> float32 [N, V] (chunked by rows on CPU)."""
    cols = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)[None, :]  # [1, V]
    n = keys.shape[0]
    step = cpu_row_chunk(vocab_size) if keys.device.type == "cpu" else n
    if step >= n:
        return gumbel(keys, cols)
    return torch.cat([gumbel(keys[i : i + step], cols) for i in range(0, n, step)])


# ---- plain-Python mirrors (reference for tests and for the kernel) ----


def mix32_py(x: int) -> int:
    """Python-int mirror of mix32."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MIX_MUL1) & MASK32
    x ^= x >> 15
    x = (x * MIX_MUL2) & MASK32
    return x ^ (x >> 15)


def row_key_py(seed: int, position: int) -> tuple[int, int]:
    """Python-int mirror of row_keys for one row."""
    lo, hi = split_seed(seed)
    out = []
    for h in (KEY_INIT0, KEY_INIT1):
        for w in (lo, hi, position & MASK32):
            h = mix32_py(h ^ w)
        out.append(h)
    return out[0], out[1]


def hash32_py(seed: int, position: int, col: int) -> int:
    """Python-int mirror of the full stream: the 32-bit word for (seed, position, column)."""
    k0, k1 = row_key_py(seed, position)
    return mix32_py(mix32_py(col ^ k0) ^ k1)


def gumbel_py(seed: int, position: int, col: int) -> float:
    """Python-float mirror of gumbel (float64; round to float32 to compare)."""
    u = (hash32_py(seed, position, col) + 0.5) * _INV_2_32
    return -math.log(-math.log(u))
