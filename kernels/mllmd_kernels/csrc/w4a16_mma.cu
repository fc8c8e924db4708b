// w4a16_mma: y[M, N] = x[M, K] @ dequant(W)^T for M <= 8 (decode), compressed-tensors W4A16 weights as
// stored, on the tensor cores (mma.sync m16n8k16, sm80+: Ampere, Jetson Orin sm87, Hopper).
//
// Weights: int32 [N, K / 8], eight 4-bit values per word along K (value i in bits [4i, 4i + 4)), each
// stored as q + 8. Scales float32 and zero points int8 (asymmetric only) are [N, G], stored G-major
// (element (n, g) at g * N + n). w = (q - zero_point) * scale.
//
// A warp owns 16 weight rows (a "tile": the MMA's A operand, 16 x 16 per step) and a slice of K; `split`
// warps of a CTA share a tile's K and add their partials in shared memory (in a fixed order), and a CTA
// holds warps / split tiles. Each warp loads one loop trip ahead (256 or 512 columns of its two rows
// a lane: TRIP_WORDS words) while it multiplies the current one. Lane (r = lane / 4, t = lane % 4) loads VEC
// consecutive words of rows r and r + 8 (one vector each), so every load is as the checkpoint stores
// it: no re-layout at load. The A fragment of m16n8k16 gives lane (r, t) the K slots {2t, 2t + 1} and
// {2t + 8, 2t + 9} of rows r and r + 8, and the B fragment gives it the same K slots of column r; any
// one-to-one map from (step, slot) to K serves as long as A and B share it. Here a word's nibbles
// (j, j + 4) fill one register pair: (word >> 4j) & 0x000F000F | magic puts q + 8 into the mantissas of
// two bf16 (fp16) halves of value 128 + q + 8 (1024 + q + 8), exactly; one packed FMA subtracts
// 136 + zero point (1032 + zero point), exactly. So a word is two MMA steps: nibbles (0, 4), (1, 5) and
// (2, 6), (3, 7), and x's matching pairs come from one 16-byte load of x by two byte permutes each.
// A step's 16 K slots lie in the 4 vectors of lanes t = 0..3, which are adjacent: 32 * VEC columns
// (a "chunk"), never wider than a scale group. The MMA sums a group's steps in float32, then the
// group's scale multiplies the sum into the accumulator (the reference rounds each dequantized weight
// to x's dtype first; here the weight is exact and the product of sums is float32).
//
// x's rows are the B operand's 8 columns (M <= 8); with M = 1 every column holds x.
//
// PDL (sm90): the first weights (no kernel writes them) are loaded before griddepcontrol.wait; x
// after it. Without a programmatic launch the wait returns at once.
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kMaxWarps = 8;

template <bool BF16>
struct Magic;
template <>
struct Magic<true> {  // bf16: 128 + n; subtract 136 + zero point
  static constexpr uint32_t base = 0x43004300u;
  static constexpr uint32_t bias = 0x4308u;
  static constexpr uint32_t one = 0x3F803F80u;
};
template <>
struct Magic<false> {  // fp16: 1024 + n; subtract 1032 + zero point
  static constexpr uint32_t base = 0x64006400u;
  static constexpr uint32_t bias = 0x6408u;
  static constexpr uint32_t one = 0x3C003C00u;
};

// (q - zero point) for the nibbles at bits [0, 4) and [16, 20) of w, as a packed pair (exact).
template <bool BF16>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t w, uint32_t neg_bias) {
  uint32_t raw, d;  // one LOP3: (w & mask) | magic (written out: the compiler splits it in two)
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(raw) : "r"(w), "n"(0x000F000F), "n"(Magic<BF16>::base));
  if constexpr (BF16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(raw), "r"(Magic<BF16>::one), "r"(neg_bias));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(raw), "r"(Magic<BF16>::one), "r"(neg_bias));
  }
  return d;
}

// Kernel variants: kExact is the kernel; the probes (bench only, wrong sums) time parts of it:
// kProbeLoad keeps the weight loads and nothing else, kProbeCompute everything but the weight loads.
constexpr int kExact = 0, kProbeLoad = 2, kProbeCompute = 3;

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// Weight words: read once, so not kept in L1.
template <int VEC>
__device__ __forceinline__ void load_words(uint32_t (&dst)[VEC], const uint32_t* p) {
  if constexpr (VEC == 4) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(dst[0]), "=r"(dst[1]), "=r"(dst[2]), "=r"(dst[3])
                 : "l"(p));
  } else if constexpr (VEC == 2) {
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(dst[0]), "=r"(dst[1]) : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(dst[0]) : "l"(p));
  }
}

__device__ __forceinline__ float load_scale(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ int load_zero_point(const int8_t* p) {
  int v;
  asm volatile("ld.global.nc.s8 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// x is written by the kernel before this one: a coherent load, issued after the PDL wait.
__device__ __forceinline__ uint4 load_x(const uint16_t* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void pdl_wait_and_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <bool BF16>
__device__ __forceinline__ uint16_t to_half_bits(float v) {
  uint16_t h;
  if constexpr (BF16) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  } else {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  }
  return h;
}

template <bool BF16>
__device__ __forceinline__ float from_half_bits(uint16_t h) {
  if constexpr (BF16) {
    return __uint_as_float(static_cast<uint32_t>(h) << 16);
  } else {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
  }
}

// The weights of one loop trip: U chunks of rows r and r + 8, with their groups' scales (and biases).
template <int VEC, int U, bool HAS_ZP>
struct Trip {
  uint32_t lo[U][VEC];  // row r
  uint32_t hi[U][VEC];  // row r + 8
  float s_lo[U], s_hi[U];
  uint32_t nb_lo[U], nb_hi[U];  // -(136 + zero point) as a packed pair (HAS_ZP)
};

template <bool BF16, int VEC, int U, bool HAS_ZP, int VARIANT>
__device__ __forceinline__ void load_trip(Trip<VEC, U, HAS_ZP>& tr, const uint32_t* w_lo, const uint32_t* w_hi,
                                          const float* s_lo, const float* s_hi, const int8_t* z_lo,
                                          const int8_t* z_hi, int trip, int N, int gshift) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = trip * U + u;  // chunk: 32 * VEC columns, 4 * VEC words
    if constexpr (VARIANT == kProbeCompute) {  // no weight loads: words made from the chunk and lane
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        tr.lo[u][v] = (static_cast<uint32_t>(c * VEC + v) * 2654435761u) ^ threadIdx.x;
        tr.hi[u][v] = tr.lo[u][v] * 2246822519u;
      }
    } else {
      load_words<VEC>(tr.lo[u], w_lo + c * 4 * VEC);
      load_words<VEC>(tr.hi[u], w_hi + c * 4 * VEC);
    }
    const size_t g = static_cast<size_t>(c >> gshift) * N;
    tr.s_lo[u] = load_scale(s_lo + g);
    tr.s_hi[u] = load_scale(s_hi + g);
    if constexpr (HAS_ZP) {
      const uint32_t b_lo = Magic<BF16>::bias + load_zero_point(z_lo + g);
      const uint32_t b_hi = Magic<BF16>::bias + load_zero_point(z_hi + g);
      tr.nb_lo[u] = (b_lo | (b_lo << 16)) ^ 0x80008000u;
      tr.nb_hi[u] = (b_hi | (b_hi << 16)) ^ 0x80008000u;
    }
  }
}

template <bool BF16, int VEC, bool HAS_ZP, int TRIP_WORDS, int VARIANT>
__global__ void __launch_bounds__(kMaxWarps * 32) w4a16_mma_kernel(
    const uint16_t* __restrict__ x, const uint32_t* __restrict__ w, const float* __restrict__ scale,
    const int8_t* __restrict__ zero_point, const uint16_t* __restrict__ bias, uint16_t* __restrict__ y, int M,
    int N, int K, int stride_wn, int stride_xm, int stride_ym, int gshift, int split) {
  constexpr int U = TRIP_WORDS / VEC;  // chunks per loop trip: TRIP_WORDS words of each of a lane's two rows
  constexpr int TRIP_K = 32 * TRIP_WORDS;  // 256 or 512 columns
  __shared__ float partial[kMaxWarps][16][8];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int r = lane >> 2, t = lane & 3;
  // The CTA holds warps / split row tiles of 16 rows; `split` warps share a tile's K.
  const int tiles_per_cta = warps / split;
  const int tile = blockIdx.x * tiles_per_cta + warp / split, part = warp % split;
  const int n0 = tile * 16;
  const int trips = n0 < N ? K / TRIP_K : 0;  // a tile past N (last CTA) computes nothing
  const int trip0 = part * trips / split, trip1 = (part + 1) * trips / split;
  const int chunks_per_group_mask = (1 << gshift) - 1;

  const int n_row = min(n0, N - 16) + r;  // a tile past N points at the last one (never read)
  const uint32_t* w_lo = w + static_cast<size_t>(n_row) * stride_wn + t * VEC;
  const uint32_t* w_hi = w_lo + static_cast<size_t>(8) * stride_wn;
  const float* s_lo = scale + n_row;
  const float* s_hi = s_lo + 8;
  const int8_t* z_lo = HAS_ZP ? zero_point + n_row : nullptr;
  const int8_t* z_hi = HAS_ZP ? z_lo + 8 : nullptr;
  const uint16_t* x_row = x + static_cast<size_t>(min(r, M - 1)) * stride_xm + t * 8 * VEC;
  const uint32_t nb_sym = (Magic<BF16>::bias | (Magic<BF16>::bias << 16)) ^ 0x80008000u;

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  float sum[4] = {0.f, 0.f, 0.f, 0.f};  // the current group's MMA sums
  uint32_t probe = 0;  // kProbeLoad
  Trip<VEC, U, HAS_ZP> cur, nxt;
  if (trip0 < trip1) {
    load_trip<BF16, VEC, U, HAS_ZP, VARIANT>(cur, w_lo, w_hi, s_lo, s_hi, z_lo, z_hi, trip0, N, gshift);
  }
  pdl_wait_and_release();

  for (int trip = trip0; trip < trip1; ++trip) {
    if (trip + 1 < trip1) {
      load_trip<BF16, VEC, U, HAS_ZP, VARIANT>(nxt, w_lo, w_hi, s_lo, s_hi, z_lo, z_hi, trip + 1, N, gshift);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = trip * U + u;
      uint32_t nb_lo = nb_sym, nb_hi = nb_sym;
      if constexpr (HAS_ZP) {
        nb_lo = cur.nb_lo[u];
        nb_hi = cur.nb_hi[u];
      }
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const uint32_t lo = cur.lo[u][v], hi = cur.hi[u][v];
        if constexpr (VARIANT == kProbeLoad) {
          probe ^= lo ^ hi;
          continue;
        }
        const uint4 xv = load_x(x_row + c * 32 * VEC + 8 * v);  // x[8v .. 8v + 8) of lane t's columns
        // nibbles (0, 4) and (1, 5) against x pairs (0, 4) and (1, 5), then (2, 6) and (3, 7)
        mma16816<BF16>(sum, dequant_pair<BF16>(lo, nb_lo), dequant_pair<BF16>(hi, nb_hi),
                       dequant_pair<BF16>(lo >> 4, nb_lo), dequant_pair<BF16>(hi >> 4, nb_hi),
                       __byte_perm(xv.x, xv.z, 0x5410), __byte_perm(xv.x, xv.z, 0x7632));
        mma16816<BF16>(sum, dequant_pair<BF16>(lo >> 8, nb_lo), dequant_pair<BF16>(hi >> 8, nb_hi),
                       dequant_pair<BF16>(lo >> 12, nb_lo), dequant_pair<BF16>(hi >> 12, nb_hi),
                       __byte_perm(xv.y, xv.w, 0x5410), __byte_perm(xv.y, xv.w, 0x7632));
      }
      if (((c + 1) & chunks_per_group_mask) == 0 || (trip + 1 == trip1 && u == U - 1)) {
        acc[0] = fmaf(sum[0], cur.s_lo[u], acc[0]);
        acc[1] = fmaf(sum[1], cur.s_lo[u], acc[1]);
        acc[2] = fmaf(sum[2], cur.s_hi[u], acc[2]);
        acc[3] = fmaf(sum[3], cur.s_hi[u], acc[3]);
        sum[0] = sum[1] = sum[2] = sum[3] = 0.f;
      }
    }
    if (trip + 1 < trip1) cur = nxt;
  }

  if constexpr (VARIANT == kProbeLoad) acc[0] = static_cast<float>(probe & 1u);
  // acc: rows r and r + 8 (weight rows n0 + r, n0 + r + 8) of columns 2t and 2t + 1 (x rows)
  partial[warp][r][2 * t] = acc[0];
  partial[warp][r][2 * t + 1] = acc[1];
  partial[warp][r + 8][2 * t] = acc[2];
  partial[warp][r + 8][2 * t + 1] = acc[3];
  __syncthreads();
  for (int i = threadIdx.x; i < tiles_per_cta * 16 * M; i += blockDim.x) {
    const int row = i & 15, m = (i >> 4) % M, tl = (i >> 4) / M;
    const int n = (blockIdx.x * tiles_per_cta + tl) * 16 + row;
    if (n >= N) continue;
    float out = 0.f;
    for (int p = 0; p < split; ++p) out += partial[tl * split + p][row][m];  // fixed order: deterministic
    if (bias != nullptr) out += from_half_bits<BF16>(bias[n]);
    y[static_cast<size_t>(m) * stride_ym + n] = to_half_bits<BF16>(out);
  }
}

struct Args {
  const void *x, *w, *s, *z, *bias;
  void* y;
  int M, N, K, stride_wn, stride_xm, stride_ym, gshift, split, warps, variant, use_pdl;
  cudaStream_t stream;
};

template <bool BF16, int VEC, bool HAS_ZP, int TRIP_WORDS, int VARIANT>
cudaError_t launch_kernel(const Args& a) {
  auto kernel = w4a16_mma_kernel<BF16, VEC, HAS_ZP, TRIP_WORDS, VARIANT>;
  const int tiles = a.N / 16, tiles_per_cta = a.warps / a.split;
  const dim3 grid((tiles + tiles_per_cta - 1) / tiles_per_cta), block(32 * a.warps);
  const auto* xp = static_cast<const uint16_t*>(a.x);
  const auto* wp = static_cast<const uint32_t*>(a.w);
  const auto* sp = static_cast<const float*>(a.s);
  const auto* zp = static_cast<const int8_t*>(a.z);
  const auto* bp = static_cast<const uint16_t*>(a.bias);
  auto* yp = static_cast<uint16_t*>(a.y);
#if CUDART_VERSION >= 11080
  if (a.use_pdl) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = 0;
    cfg.stream = a.stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel, xp, wp, sp, zp, bp, yp, a.M, a.N, a.K, a.stride_wn, a.stride_xm,
                              a.stride_ym, a.gshift, a.split);
  }
#endif
  kernel<<<grid, block, 0, a.stream>>>(xp, wp, sp, zp, bp, yp, a.M, a.N, a.K, a.stride_wn, a.stride_xm, a.stride_ym,
                                       a.gshift, a.split);
  return cudaGetLastError();
}

template <bool BF16, int VEC, bool HAS_ZP, int TRIP_WORDS>
cudaError_t launch(const Args& a) {
  if (a.variant == kExact) return launch_kernel<BF16, VEC, HAS_ZP, TRIP_WORDS, kExact>(a);
  if constexpr (BF16 && VEC == 4 && !HAS_ZP) {  // the probes: one build (bf16, 16-byte vectors, symmetric)
    if (a.variant == kProbeLoad) return launch_kernel<BF16, VEC, HAS_ZP, TRIP_WORDS, kProbeLoad>(a);
    if (a.variant == kProbeCompute) return launch_kernel<BF16, VEC, HAS_ZP, TRIP_WORDS, kProbeCompute>(a);
  }
  return cudaErrorInvalidValue;
}

template <bool BF16, bool HAS_ZP, int TRIP_WORDS>
cudaError_t launch_vec(int vec, const Args& a) {
  switch (vec) {
    case 4:
      return launch<BF16, 4, HAS_ZP, TRIP_WORDS>(a);
    case 2:
      return launch<BF16, 2, HAS_ZP, TRIP_WORDS>(a);
    case 1:
      return launch<BF16, 1, HAS_ZP, TRIP_WORDS>(a);
    default:
      return cudaErrorInvalidValue;
  }
}

template <bool BF16, bool HAS_ZP>
cudaError_t launch_trip(int vec, int trip_words, const Args& a) {
  // 512-column trips only with 16-byte vectors (the narrower ones would need more registers than a lane has)
  if (trip_words == 16) return vec == 4 ? launch<BF16, 4, HAS_ZP, 16>(a) : cudaErrorInvalidValue;
  return launch_vec<BF16, HAS_ZP, 8>(vec, a);
}

}  // namespace

extern "C" {

// Version of this entry point's arguments; the Python side refuses a library that disagrees.
int mllmd_w4a16_mma_abi() { return 5; }

// Returns a cudaError_t (0: launched). The caller checks shapes (w4a16_mma.supports): M in [1, 8],
// N % 16 == 0, K % (32 * trip_words) == 0; `vec` 4 / 2 / 1 for groups of >= 128 / 64 / 32 columns (or
// channel-wise: 4); 2**gshift chunks of 32 * vec columns per group (channel-wise: 30); trip_words 8 or
// 16 (columns a warp's loop trip covers: 256 or 512); `split` warps share a 16-row tile's K, and a CTA
// of `warps` warps holds warps / split tiles; `variant`: kExact, or a bench probe.
int mllmd_w4a16_mma(const void* x, const void* w, const void* scale, const void* zero_point, const void* bias,
                    void* y, int M, int N, int K, int stride_wn, int stride_xm, int stride_ym, int vec, int gshift,
                    int trip_words, int split, int warps, int variant, int bf16, int use_pdl, void* stream) {
  if (M < 1 || M > 8 || N % 16 || (trip_words != 8 && trip_words != 16) || K % (32 * trip_words) ||
      warps < 1 || warps > kMaxWarps || split < 1 || warps % split)
    return cudaErrorInvalidValue;
  const Args a{x,         w,     scale,   zero_point, bias,  y,       M,       N, K, stride_wn, stride_xm, stride_ym,
               gshift,    split, warps, variant,    use_pdl, static_cast<cudaStream_t>(stream)};
  const bool zp = zero_point != nullptr;
  if (bf16) {
    return zp ? launch_trip<true, true>(vec, trip_words, a) : launch_trip<true, false>(vec, trip_words, a);
  }
  return zp ? launch_trip<false, true>(vec, trip_words, a) : launch_trip<false, false>(vec, trip_words, a);
}

const char* mllmd_cuda_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
