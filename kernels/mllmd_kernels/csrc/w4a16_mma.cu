// w4a16_mma: y[M, N] = x[M, K] @ dequant(W)^T for M <= 32 (decode, short prefills), compressed-tensors W4A16 weights
// (re-laid at load, below), on the tensor cores (mma.sync m16n8k16, sm80+: Ampere, Jetson Orin sm87, Hopper).
//
// Weights: int32 [N, K / 8], eight 4-bit values per word along K (value i in bits [4i, 4i + 4)), each
// stored as q + 8, the words re-laid once at load in "mma tile order" (w4a16_mma.tile_order): tile by
// tile (16 rows), stage by stage (256 columns), a stage's 512 words in the order its loads take them:
// chunk u, then rows r / r + 8, then lane (r, t), then the lane's VEC words. A warp's load is then
// 512 contiguous bytes (VEC = 4) and a tile's stage one 2 KB block, faster than the checkpoint's
// row-major words (mllmd_kernels/NOTES.md has the figures of this and of every variant below); the
// pointers step a stage at a time, with the chunks and rows r + 8 at immediate offsets. Scales
// float32 and zero points int8 (asymmetric only) are [N, G], stored G-major (element (n, g) at
// g * N + n).
// w = (q - zero_point) * scale.
//
// A warp owns 16 weight rows (a "tile": the MMA's A operand, 16 x 16 per step) and a slice of K; `split`
// warps of a CTA share a tile's K and add their partials in shared memory (in a fixed order), and a CTA
// holds warps / split tiles. Lane (r = lane / 4, t = lane % 4) reads VEC consecutive words of rows r and
// r + 8 per "chunk" (32 * VEC columns).
//
// Loads: a warp walks its K slice a "stage" (256 columns: 8 words of each of a lane's two rows, with its
// groups' scales and zero points) at a time, in registers, loading the next stage while it multiplies
// this one (two register sets that alternate: no copies). The first stage is loaded before the PDL wait
// (no kernel writes the weights). Of the forms tried this was the fastest: a per-warp cp.async ring
// of shared-memory stages, L2 prefetches of later stages, a third register stage, wider CTAs and the
// other variants NOTES.md lists were slower.
//
// MMA operands: the A fragment of m16n8k16 gives lane (r, t) the K slots {2t, 2t + 1} and {2t + 8,
// 2t + 9} of rows r and r + 8, and the B fragment gives it the same K slots of column r; any one-to-one
// map from (step, slot) to K serves as long as A and B share it. Here a word's nibbles (j, j + 4) fill
// one register pair: (word >> 4j) & 0x000F000F | magic puts q + 8 into the mantissas of two bf16 (fp16)
// halves of value 128 + q + 8 (1024 + q + 8), exactly. So a word is two MMA steps: nibbles (0, 4), (1, 5)
// and (2, 6), (3, 7), and x's matching pairs are x's 8 columns in the order 0, 4, 1, 5, 2, 6, 3, 7.
// Two ways to remove the offset 136 + zero point (1032 + zero point), both exact in the weights:
//  * "offset" (one bf16 row, SUMX): the MMA multiplies the raw halves 128 + q + 8, and the group's sum
//    subtracts (136 + zero point) * sum(x over the same columns), x in shared memory in B-fragment
//    order with its float32 sums per chunk. One LOP3 a weight pair. A launch with a fused norm stages
//    the whole row once per CTA (the norm needs all of it first); one without (16-byte vectors)
//    "streams" it: each warp stages only its own stages, one 512-byte stage at a time into a buffer
//    of its own (a 16-byte vector a lane, loaded one stage ahead; the chunk sums from the same shuffle
//    tree), with no CTA barrier, which is faster than staging the whole row in every CTA (NOTES.md).
//  * "exact" (fp16, several rows): one packed FMA subtracts the offset from each pair before the MMA
//    (fp16's offset would be 8x larger than bf16's against the same float32 sums), and x is loaded
//    from global memory (L1) with two byte permutes a pair.
// The MMA sums a group's steps in float32, then the group's scale multiplies the sum into the
// accumulator (the reference rounds each dequantized weight to x's dtype first; here the weight is exact
// and the product of sums is float32).
//
// x's rows are the B operands' columns: NT = 1, 2 or 4 tiles of 8 (M <= 8, 16, 32), each weight pair
// dequantized once for the NT MMAs of a step; with M = 1 every column holds x. Rows past M re-read row
// M - 1 (never stored). Under the launch bounds' 128 registers (two CTAs of 8 warps an SM) the NT > 1
// kernels spill a few words (4-28 bytes); without the bound NT = 4 takes 244 registers and one CTA an
// SM. NT = 8 (64 rows) spilled more and is not built: 33+ rows run the Triton kernels.
//
// Fusions (one bf16 row: batch-1 decode; kernels of their own, so that the others keep their code and
// registers): the RMSNorm before the layer (x + residual, its mean square reduced in the CTA, normed as
// mllmd_kernels.rmsnorm rounds, as x is staged; block 0 writes the residual sum), and silu(gate) * up
// after a gate/up layer (a CTA holds gate tile i with up tile i; the epilogue rounds as silu_and_mul).
// Every CTA norms the whole row itself: no kernel between, no grid-wide sync.
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kMaxWarps = 8;
constexpr int kStageCols = 256;  // columns a stage: 8 words of each of a lane's two rows
constexpr int kMaxDevices = 64;
// The weights in mma tile order (see the header): a tile's stage is 512 words in a row, a chunk's
// 64 * VEC (rows r, then rows r + 8), a lane's VEC words of each at lane * VEC.
template <int VEC>
constexpr int kChunkWords = 64 * VEC;
constexpr int kStageWords = 512;

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

// The nibbles at bits [0, 4) and [16, 20) of w as the packed pair (128 + q + 8) (fp16: 1024 + q + 8).
template <bool BF16>
__device__ __forceinline__ uint32_t raw_pair(uint32_t w) {
  uint32_t raw;  // one LOP3: (w & mask) | magic (written out: the compiler splits it in two)
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(raw) : "r"(w), "n"(0x000F000F), "n"(Magic<BF16>::base));
  return raw;
}

// (q - zero point) for the nibbles at bits [0, 4) and [16, 20) of w, as a packed pair (exact).
template <bool BF16>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t w, uint32_t neg_bias) {
  uint32_t d;
  const uint32_t raw = raw_pair<BF16>(w);
  if constexpr (BF16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(raw), "r"(Magic<BF16>::one), "r"(neg_bias));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(raw), "r"(Magic<BF16>::one), "r"(neg_bias));
  }
  return d;
}

// Kernel variants: kExact is the kernel; the probes (bench only, wrong sums) time parts of it:
// kProbeLoad keeps the weight copies and nothing else, kProbeCompute everything but the weight copies,
// kProbeNoMeta everything but the scales' loads.
constexpr int kExact = 0, kProbeLoad = 2, kProbeCompute = 3, kProbeNoMeta = 4;

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

// x's 8 columns (a 16-byte vector) in B-fragment order: pairs (0, 4), (1, 5), (2, 6), (3, 7).
__device__ __forceinline__ uint4 fragment_order(uint4 v) {
  return make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632), __byte_perm(v.y, v.w, 0x5410),
                    __byte_perm(v.y, v.w, 0x7632));
}

__device__ __forceinline__ float sum8_bf16(uint4 v) {  // fixed order: deterministic
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) s += __uint_as_float(w[i] << 16) + __uint_as_float(w[i] & 0xFFFF0000u);
  return s;
}

// Weight words: read once, so not kept in L1.
template <int VEC>
__device__ __forceinline__ void load_words(uint32_t* dst, const uint32_t* p) {
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

// A stage (256 columns) of a lane's weights in registers: 8 words of rows r and r + 8, and with 16-byte
// vectors (groups of 128+ columns: one or two chunks a stage) its chunks' scales (and zero points) of
// the two rows. Narrower vectors (groups of 32 / 64 columns, 4 / 8 chunks a stage) load those at use:
// prefetched, they would not fit the registers.
template <int VEC, bool HAS_ZP>
struct Trip {
  static constexpr int U = 8 / VEC;
  static constexpr bool kMeta = VEC == 4;  // scales (zero points) loaded with the words
  static constexpr int kMetaLen = kMeta ? U : 1;
  uint32_t lo[8], hi[8];
  float s_lo[kMetaLen], s_hi[kMetaLen];
  int z_lo[HAS_ZP ? kMetaLen : 1], z_hi[HAS_ZP ? kMetaLen : 1];
};

// The scales (and zero points) of chunk c's group for rows r and r + 8 (s_lo, z_lo: row r's first group).
template <bool HAS_ZP>
__device__ __forceinline__ void load_meta(float& s_lo, float& s_hi, int& z_lo, int& z_hi, const float* s_row,
                                          const int8_t* z_row, int c, uint32_t N, int gshift) {
  const uint32_t g = static_cast<uint32_t>(c >> gshift) * N;  // a layer's scales are far below 4 G elements
  s_lo = load_scale(s_row + g);
  s_hi = load_scale(s_row + g + 8);
  if constexpr (HAS_ZP) {
    z_lo = load_zero_point(z_row + g);
    z_hi = load_zero_point(z_row + g + 8);
  }
}

// Stage `stage` into tr: w_lo / w_hi point at the stage's first words of rows r and r + 8 (the caller
// steps them a stage at a time: no 64-bit address arithmetic a load), chunks kChunkWords apart.
template <int VEC, bool HAS_ZP, int VARIANT>
__device__ __forceinline__ void load_trip(Trip<VEC, HAS_ZP>& tr, int stage, const uint32_t* w_lo, const uint32_t* w_hi,
                                          const float* s_lo, const int8_t* z_lo, uint32_t N, int gshift) {
  constexpr int U = Trip<VEC, HAS_ZP>::U;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = stage * U + u;  // chunk: 32 * VEC columns, 4 * VEC words
    if constexpr (VARIANT == kProbeCompute) {  // no weight loads: words made from the chunk and lane
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        tr.lo[u * VEC + v] = (static_cast<uint32_t>(c * VEC + v) * 2654435761u) ^ threadIdx.x;
        tr.hi[u * VEC + v] = tr.lo[u * VEC + v] * 2246822519u;
      }
    } else {
      load_words<VEC>(&tr.lo[u * VEC], w_lo + u * kChunkWords<VEC>);
      load_words<VEC>(&tr.hi[u * VEC], w_hi + u * kChunkWords<VEC>);
    }
    if constexpr (VARIANT == kProbeNoMeta) {
      tr.s_lo[u] = tr.s_hi[u] = 1.0f;
    } else if constexpr (Trip<VEC, HAS_ZP>::kMeta) {
      load_meta<HAS_ZP>(tr.s_lo[u], tr.s_hi[u], tr.z_lo[HAS_ZP ? u : 0], tr.z_hi[HAS_ZP ? u : 0], s_lo, z_lo, c, N,
                        gshift);
    }
  }
}

// The MMAs of one stage, into the group sums `sum` (and the accumulator at each group's end).
template <bool BF16, int VEC, bool HAS_ZP, bool SUMX, int VARIANT, int NT, bool STREAM = false>
__device__ __forceinline__ void compute_trip(const Trip<VEC, HAS_ZP>& tr, int st, int s1, int chunks_per_group_mask,
                                             const unsigned char* xs_st, const float* xsum, const float (&xsc)[2],
                                             const uint16_t* x_t, int last_row, int stride_xm,
                                             const float* s_row, const int8_t* z_row, uint32_t N, int gshift, int t,
                                             float (&sum)[NT][4], float (&acc)[NT][4], float& xs_acc,
                                             uint32_t& probe) {
  using T = Trip<VEC, HAS_ZP>;
  constexpr int U = Trip<VEC, HAS_ZP>::U;
  const uint32_t nb_sym = (Magic<BF16>::bias | (Magic<BF16>::bias << 16)) ^ 0x80008000u;
  if constexpr (VARIANT == kProbeLoad) {
#pragma unroll
    for (int i = 0; i < 8; ++i) probe ^= tr.lo[i] ^ tr.hi[i];
    return;
  }
  const unsigned char* xs_stage = xs_st + t * 16;  // SUMX: this stage's x, 8 vectors x 4 lanes t
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = st * U + u;
    float s_lo = 0.f, s_hi = 0.f;
    int zp_lo = 0, zp_hi = 0;
    if constexpr (T::kMeta) {
      s_lo = tr.s_lo[u];
      s_hi = tr.s_hi[u];
      if constexpr (HAS_ZP) {
        zp_lo = tr.z_lo[u];
        zp_hi = tr.z_hi[u];
      }
    } else {
      load_meta<HAS_ZP>(s_lo, s_hi, zp_lo, zp_hi, s_row, z_row, c, N, gshift);
    }
    uint32_t nb_lo = nb_sym, nb_hi = nb_sym;
    if constexpr (HAS_ZP && !SUMX) {
      const uint32_t b_lo = Magic<BF16>::bias + zp_lo, b_hi = Magic<BF16>::bias + zp_hi;
      nb_lo = ((b_lo & 0xFFFFu) | (b_lo << 16)) ^ 0x80008000u;
      nb_hi = ((b_hi & 0xFFFFu) | (b_hi << 16)) ^ 0x80008000u;
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const uint32_t lo = tr.lo[u * VEC + v], hi = tr.hi[u * VEC + v];
      if constexpr (SUMX) {
        const uint4 b = *reinterpret_cast<const uint4*>(xs_stage + (u * VEC + v) * 64);
        mma16816<BF16>(sum[0], raw_pair<BF16>(lo), raw_pair<BF16>(hi), raw_pair<BF16>(lo >> 4),
                       raw_pair<BF16>(hi >> 4), b.x, b.y);
        mma16816<BF16>(sum[0], raw_pair<BF16>(lo >> 8), raw_pair<BF16>(hi >> 8), raw_pair<BF16>(lo >> 12),
                       raw_pair<BF16>(hi >> 12), b.z, b.w);
      } else {  // the A fragments once, for each of the NT column tiles (x rows 8j + r)
        const uint32_t a0 = dequant_pair<BF16>(lo, nb_lo), a1 = dequant_pair<BF16>(hi, nb_hi);
        const uint32_t a2 = dequant_pair<BF16>(lo >> 4, nb_lo), a3 = dequant_pair<BF16>(hi >> 4, nb_hi);
        const uint32_t a4 = dequant_pair<BF16>(lo >> 8, nb_lo), a5 = dequant_pair<BF16>(hi >> 8, nb_hi);
        const uint32_t a6 = dequant_pair<BF16>(lo >> 12, nb_lo), a7 = dequant_pair<BF16>(hi >> 12, nb_hi);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const int row = min(8 * j + (threadIdx.x & 31) / 4, last_row);  // rows past M re-read the last
          const uint4 b = fragment_order(load_x(x_t + row * stride_xm + c * 32 * VEC + 8 * v));  // lane t's 8 columns
          mma16816<BF16>(sum[j], a0, a1, a2, a3, b.x, b.y);
          mma16816<BF16>(sum[j], a4, a5, a6, a7, b.z, b.w);
        }
      }
    }
    if constexpr (SUMX) xs_acc += STREAM ? xsc[u] : xsum[c];  // STREAM: VEC 4, U = 2
    if (((c + 1) & chunks_per_group_mask) == 0 || (st + 1 == s1 && u == U - 1)) {
      if constexpr (SUMX) {  // sum - (136 + zero point) * sum(x): the raw halves' offset
        const float off_lo = 136.0f + static_cast<float>(zp_lo);
        const float off_hi = 136.0f + static_cast<float>(zp_hi);
        acc[0][0] = fmaf(fmaf(-off_lo, xs_acc, sum[0][0]), s_lo, acc[0][0]);
        acc[0][1] = fmaf(fmaf(-off_lo, xs_acc, sum[0][1]), s_lo, acc[0][1]);
        acc[0][2] = fmaf(fmaf(-off_hi, xs_acc, sum[0][2]), s_hi, acc[0][2]);
        acc[0][3] = fmaf(fmaf(-off_hi, xs_acc, sum[0][3]), s_hi, acc[0][3]);
        xs_acc = 0.f;
      } else {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          acc[j][0] = fmaf(sum[j][0], s_lo, acc[j][0]);
          acc[j][1] = fmaf(sum[j][1], s_lo, acc[j][1]);
          acc[j][2] = fmaf(sum[j][2], s_hi, acc[j][2]);
          acc[j][3] = fmaf(sum[j][3], s_hi, acc[j][3]);
        }
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) sum[j][0] = sum[j][1] = sum[j][2] = sum[j][3] = 0.f;
    }
  }
}

// Vector i's place among a chunk's vectors in B-fragment order (x staged for the offset form): lane t's
// VEC vectors together, chunk by chunk.
template <int VEC>
__device__ __forceinline__ int place(int i) {
  return (i / (4 * VEC) * VEC + i % (4 * VEC) % VEC) * 4 + i % (4 * VEC) / VEC;
}

// The streamed form (one bf16 row, no fusion, VEC 4): each warp stages only its own stages of x, one
// stage (512 bytes: a 16-byte vector a lane) at a time into its own buffer, as it walks K; xv holds the
// lane's vector of stage st, loaded one stage ahead, and is reloaded here with stage st + 1's. The
// chunk sums come out of the same shuffle tree as the CTA's staging (the same bits).
__device__ __forceinline__ void stream_x(uint4& xv, float (&xsc)[2], unsigned char* buf, const uint16_t* x, int st,
                                         int s1, int lane) {
  const uint4 v = fragment_order(xv);
  reinterpret_cast<uint4*>(buf)[place<4>(lane)] = v;
  float s = sum8_bf16(v);
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
  xsc[0] = __shfl_sync(0xFFFFFFFFu, s, 0);
  xsc[1] = __shfl_sync(0xFFFFFFFFu, s, 16);
  if (st + 1 < s1) xv = load_x(x + (static_cast<size_t>(st + 1) * 32 + lane) * 8);
  __syncwarp();
}

// x + r for 8 bf16 each, rounded to bf16 (torch's x + residual).
__device__ __forceinline__ uint4 add_bf16x8(uint4 a, uint4 b) {
  const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = __uint_as_float(wa[i] << 16) + __uint_as_float(wb[i] << 16);
    const float hi = __uint_as_float(wa[i] & 0xFFFF0000u) + __uint_as_float(wb[i] & 0xFFFF0000u);
    o[i] = static_cast<uint32_t>(to_half_bits<true>(lo)) | (static_cast<uint32_t>(to_half_bits<true>(hi)) << 16);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

__device__ __forceinline__ float sumsq8_bf16(uint4 v) {  // fixed order: deterministic
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = __uint_as_float(w[i] << 16), hi = __uint_as_float(w[i] & 0xFFFF0000u);
    s = fmaf(lo, lo, s);
    s = fmaf(hi, hi, s);
  }
  return s;
}

// RMSNorm of 8 bf16 with Hugging Face Qwen3's rounding (mllmd_kernels.rmsnorm): y = bf16(s * rinv),
// then bf16(weight * y).
__device__ __forceinline__ uint4 norm_bf16x8(uint4 v, uint4 wt, float rinv) {
  const uint32_t a[4] = {v.x, v.y, v.z, v.w}, b[4] = {wt.x, wt.y, wt.z, wt.w};
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float ylo = from_half_bits<true>(to_half_bits<true>(__uint_as_float(a[i] << 16) * rinv));
    const float yhi = from_half_bits<true>(to_half_bits<true>(__uint_as_float(a[i] & 0xFFFF0000u) * rinv));
    const uint16_t lo = to_half_bits<true>(__uint_as_float(b[i] << 16) * ylo);
    const uint16_t hi = to_half_bits<true>(__uint_as_float(b[i] & 0xFFFF0000u) * yhi);
    o[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

__device__ __forceinline__ uint4 load_const(const uint16_t* p) {  // no kernel writes it (a norm's weight)
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// silu(g) * u with the rounding of mllmd_kernels.silu_and_mul: g and u as the layer's output dtype, each
// product rounded to it.
template <bool BF16>
__device__ __forceinline__ uint16_t silu_mul(float g, float u) {
  g = from_half_bits<BF16>(to_half_bits<BF16>(g));
  u = from_half_bits<BF16>(to_half_bits<BF16>(u));
  const float s = from_half_bits<BF16>(to_half_bits<BF16>(g / (1.0f + __expf(-g))));
  return to_half_bits<BF16>(s * u);
}

// Optional fusions (null / 0: off).
struct Fuse {
  // RMSNorm before the product (one bf16 row, SUMX): x is the norm's input; with `residual`, the
  // norm's input is x + residual (rounded), which block 0 writes to `residual_out`.
  const uint16_t* residual;
  const uint16_t* norm_weight;
  uint16_t* residual_out;
  float eps;
  // silu(first half of the rows) * second half: y is [1, N / 2]; a CTA holds gate and up tiles in pairs.
  int silu;
};

template <bool BF16, int VEC, bool HAS_ZP, bool SUMX, int VARIANT, bool FUSE, int NT>
__global__ void __launch_bounds__(kMaxWarps * 32, 2) w4a16_mma_kernel(
    const uint16_t* __restrict__ x, const uint32_t* __restrict__ w, const float* __restrict__ scale,
    const int8_t* __restrict__ zero_point, const uint16_t* __restrict__ bias, uint16_t* __restrict__ y, int M,
    int N, int K, int stride_wn, int stride_xm, int stride_ym, int gshift, int split, Fuse fuse) {
  static_assert(!FUSE || (SUMX && BF16), "the fusions are built for one bf16 row (the offset form)");
  static_assert(!SUMX || NT == 1, "the offset form is one row");
  extern __shared__ __align__(16) unsigned char smem[];
  // [split-K partials: warps x 16 x 8 * NT floats][SUMX: x (K halves), its sums a chunk]
  float(*partial)[16][8 * NT] = reinterpret_cast<float(*)[16][8 * NT]>(smem);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int r = lane >> 2, t = lane & 3;
  const int tiles_per_cta = warps / split, local = warp / split, part = warp % split;
  int tile = blockIdx.x * tiles_per_cta + local;  // this warp's 16-row tile; past N: computes nothing
  if constexpr (FUSE) {
    if (fuse.silu) {  // gate tile `pair` (rows pair * 16 ..) and up tile `pair` (N / 2 rows further)
      const int half_tiles = N / 32, pair = blockIdx.x * (tiles_per_cta / 2) + local / 2;
      tile = pair < half_tiles ? (local & 1) * half_tiles + pair : N / 16;
    }
  }
  const int n0 = tile * 16;
  const int stages = n0 < N ? K / kStageCols : 0;
  const int s0 = part * stages / split, s1 = (part + 1) * stages / split;
  const int chunks_per_group_mask = (1 << gshift) - 1;

  const int n_first = min(n0, N - 16);  // a tile past N points at the last one (never read)
  // tile order: the tile's 16 rows are stride_wn * 16 words from its first row on
  const uint32_t* w_lo = w + static_cast<size_t>(n_first) * stride_wn + lane * VEC + s0 * kStageWords;
  const uint32_t* w_hi = w_lo + 32 * VEC;
  const float* s_lo = scale + n_first + r;
  const int8_t* z_lo = HAS_ZP ? zero_point + n_first + r : nullptr;
  unsigned char* xs = smem + warps * 16 * 8 * NT * sizeof(float);  // SUMX: x (streamed: the warps' stage buffers)
  float* xsum = reinterpret_cast<float*>(xs + K * 2);  // SUMX: x's sum over each chunk
  // The streamed form: one bf16 row without a fused norm (which needs the whole row first), 16-byte
  // vectors (two chunks a stage, each a half-warp's 16 vectors).
  constexpr bool kStream = SUMX && !FUSE && VEC == 4;
  unsigned char* xbuf = xs + warp * 1024;  // kStream: this warp's two 512-byte stage buffers

  // Two stages in registers: one multiplied while the next loads (they alternate: no copies). The first
  // is loaded before the PDL wait (the weights are no kernel's output); loading the second there too was
  // slower (NOTES.md).
  Trip<VEC, HAS_ZP> ta, tb;
  if (s0 < s1) load_trip<VEC, HAS_ZP, VARIANT>(ta, s0, w_lo, w_hi, s_lo, z_lo, N, gshift);
  pdl_wait_and_release();

  if constexpr (SUMX && !kStream) {  // x (one row) in B-fragment order, and its sums per chunk, for the whole CTA
    uint4* xs_vec = reinterpret_cast<uint4*>(xs);
    const int vecs = K / 8;  // 16-byte vectors: 4 * VEC a chunk (lane t's VEC vectors, t = 0..3)
    float rinv = 0.f;
    if constexpr (FUSE) {
      if (fuse.norm_weight != nullptr) {  // the norm's input (x + residual) in place, and its mean square
        float ss = 0.f;
        for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
          uint4 v = load_x(x + 8 * i);
          if (fuse.residual != nullptr) {
            v = add_bf16x8(v, load_x(fuse.residual + 8 * i));
            if (blockIdx.x == 0) *reinterpret_cast<uint4*>(fuse.residual_out + 8 * i) = v;
          }
          xs_vec[place<VEC>(i)] = fragment_order(v);
          ss += sumsq8_bf16(v);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, o);
        float* red = reinterpret_cast<float*>(smem);  // the partials' space: not used until the end
        if (lane == 0) red[warp] = ss;
        __syncthreads();
        ss = 0.f;
        for (int i = 0; i < warps; ++i) ss += red[i];  // fixed order: every CTA gets the same row
        rinv = rsqrtf(ss / static_cast<float>(K) + fuse.eps);
      }
    }
    // Every thread takes the same vectors as above (i = threadIdx.x + j * blockDim.x); whole warps
    // run each trip, so that a chunk's lanes reduce its sum together.
    for (int base = 0; base < vecs; base += blockDim.x) {
      const int i = base + threadIdx.x;
      float s = 0.f;
      if (i < vecs) {
        uint4 v;
        if (FUSE && fuse.norm_weight != nullptr) {  // its own vector from the pass above, normed
          v = norm_bf16x8(xs_vec[place<VEC>(i)], fragment_order(load_const(fuse.norm_weight + 8 * i)), rinv);
        } else {
          v = fragment_order(load_x(x + 8 * i));
        }
        xs_vec[place<VEC>(i)] = v;
        s = sum8_bf16(v);
      }
#pragma unroll
      for (int o = 1; o < 4 * VEC; o <<= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
      if (i < vecs && i % (4 * VEC) == 0) xsum[i / (4 * VEC)] = s;
    }
    __syncthreads();
  }

  // !SUMX: x row 8j + r of column tile j (rows past M re-read row M - 1, never stored)
  const uint16_t* x_t = x + t * 8 * VEC;
  float acc[NT][4], sum[NT][4];  // sum: the current group's MMA sums
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = sum[j][0] = sum[j][1] = sum[j][2] = sum[j][3] = 0.f;
  float xs_acc = 0.f;  // SUMX: x's sum over the columns in `sum`
  uint32_t probe = 0;  // kProbeLoad
  uint4 xv;  // kStream: the lane's vector of the next stage's x
  float xsc[2] = {0.f, 0.f};  // kStream: the staged stage's chunk sums
  if constexpr (kStream) {
    if (s0 < s1) xv = load_x(x + (static_cast<size_t>(s0) * 32 + lane) * 8);
  }
  for (int st = s0; st < s1; st += 2) {  // two stages a trip: the registers alternate
    if (st + 1 < s1)
      load_trip<VEC, HAS_ZP, VARIANT>(tb, st + 1, w_lo + kStageWords, w_hi + kStageWords, s_lo, z_lo, N, gshift);
    if constexpr (kStream) stream_x(xv, xsc, xbuf, x, st, s1, lane);
    compute_trip<BF16, VEC, HAS_ZP, SUMX, VARIANT, NT, kStream>(ta, st, s1, chunks_per_group_mask,
                                                               kStream ? xbuf : xs + st * 512, xsum, xsc, x_t, M - 1, stride_xm,
                                                               s_lo, z_lo, N, gshift, t, sum, acc, xs_acc, probe);
    if (st + 1 >= s1) break;
    if (st + 2 < s1)
      load_trip<VEC, HAS_ZP, VARIANT>(ta, st + 2, w_lo + 2 * kStageWords, w_hi + 2 * kStageWords, s_lo, z_lo, N,
                                      gshift);
    if constexpr (kStream) stream_x(xv, xsc, xbuf + 512, x, st + 1, s1, lane);
    compute_trip<BF16, VEC, HAS_ZP, SUMX, VARIANT, NT, kStream>(tb, st + 1, s1, chunks_per_group_mask,
                                                               kStream ? xbuf + 512 : xs + (st + 1) * 512, xsum, xsc,
                                                               x_t, M - 1, stride_xm, s_lo, z_lo, N, gshift, t, sum, acc, xs_acc,
                                                               probe);
    w_lo += 2 * kStageWords;
    w_hi += 2 * kStageWords;
  }

  if constexpr (VARIANT == kProbeLoad) acc[0][0] = static_cast<float>(probe & 1u);
  // acc[j]: rows r and r + 8 (weight rows n0 + r, n0 + r + 8) of columns 2t and 2t + 1 of tile j (x rows
  // 8j + 2t, 8j + 2t + 1)
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    partial[warp][r][8 * j + 2 * t] = acc[j][0];
    partial[warp][r][8 * j + 2 * t + 1] = acc[j][1];
    partial[warp][r + 8][8 * j + 2 * t] = acc[j][2];
    partial[warp][r + 8][8 * j + 2 * t + 1] = acc[j][3];
  }
  __syncthreads();
  if constexpr (FUSE) {
    if (fuse.silu) {  // y [1, N / 2]: silu(gate) * up
      const int pairs = tiles_per_cta / 2, half_tiles = N / 32;
      for (int i = threadIdx.x; i < pairs * 16; i += blockDim.x) {
        const int row = i & 15, pl = i >> 4, pair = blockIdx.x * pairs + pl;
        if (pair >= half_tiles) continue;
        const int n = pair * 16 + row;
        float g = 0.f, u = 0.f;
        for (int p = 0; p < split; ++p) {  // fixed order: deterministic
          g += partial[(2 * pl) * split + p][row][0];
          u += partial[(2 * pl + 1) * split + p][row][0];
        }
        if (bias != nullptr) {
          g += from_half_bits<BF16>(bias[n]);
          u += from_half_bits<BF16>(bias[n + N / 2]);
        }
        y[n] = silu_mul<BF16>(g, u);
      }
      return;
    }
  }
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
  Fuse fuse;
  cudaStream_t stream;
};

// Shared memory a launch needs (bytes): the warps' split-K partials, and (SUMX) x with its chunk sums,
// or (the streamed form, VEC 4) each warp's two 512-byte stage buffers, whichever is larger.
template <int VEC, bool SUMX>
int smem_bytes(int warps, int K, int nt) {
  const int staged = K * 2 + (K / (32 * VEC)) * 4, streamed = VEC == 4 ? warps * 1024 : 0;
  return warps * 16 * 8 * nt * 4 + (SUMX ? (staged > streamed ? staged : streamed) : 0);
}

// Column tiles of 8 x rows a launch of M rows runs (the offset form: one); w4a16_mma.column_tiles.
int column_tiles(int M) { return M <= 8 ? 1 : M <= 16 ? 2 : 4; }

template <bool BF16, int VEC, bool HAS_ZP, bool SUMX, int VARIANT, bool FUSE = false, int NT = 1>
cudaError_t launch_kernel(const Args& a) {
  auto kernel = w4a16_mma_kernel<BF16, VEC, HAS_ZP, SUMX, VARIANT, FUSE, NT>;
  const int tiles_per_cta = a.warps / a.split;
  // silu: a CTA holds tiles_per_cta / 2 pairs (a gate tile and its up tile)
  const int units = a.fuse.silu ? a.N / 32 : a.N / 16, per_cta = a.fuse.silu ? tiles_per_cta / 2 : tiles_per_cta;
  const dim3 grid((units + per_cta - 1) / per_cta), block(32 * a.warps);
  const int smem = smem_bytes<VEC, SUMX>(a.warps, a.K, NT);
  static int smem_allowed[kMaxDevices];  // per instantiation and device: raised to what a launch needs
  if (smem > 48 * 1024) {  // above the default: the attribute is set once per device and size
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    if (device >= kMaxDevices) return cudaErrorInvalidDevice;
    if (smem > smem_allowed[device]) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (err != cudaSuccess) return err;
      smem_allowed[device] = smem;
    }
  }
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
    cfg.dynamicSmemBytes = smem;
    cfg.stream = a.stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel, xp, wp, sp, zp, bp, yp, a.M, a.N, a.K, a.stride_wn, a.stride_xm,
                              a.stride_ym, a.gshift, a.split, a.fuse);
  }
#endif
  kernel<<<grid, block, smem, a.stream>>>(xp, wp, sp, zp, bp, yp, a.M, a.N, a.K, a.stride_wn, a.stride_xm,
                                          a.stride_ym, a.gshift, a.split, a.fuse);
  return cudaGetLastError();
}

template <bool BF16, int VEC, bool HAS_ZP, bool SUMX>
cudaError_t launch(const Args& a) {
  if (a.variant == kExact) {
    if constexpr (SUMX && BF16) {  // the fusions: kernels of their own, so that the others keep their code
      if (a.fuse.norm_weight != nullptr || a.fuse.silu) return launch_kernel<BF16, VEC, HAS_ZP, SUMX, kExact, true>(a);
    }
    if (a.fuse.norm_weight != nullptr || a.fuse.silu) return cudaErrorInvalidValue;
    if constexpr (SUMX) {
      return launch_kernel<BF16, VEC, HAS_ZP, SUMX, kExact>(a);
    } else {  // x's rows as NT tiles of 8 B columns
      switch (column_tiles(a.M)) {
        case 1:
          return launch_kernel<BF16, VEC, HAS_ZP, SUMX, kExact, false, 1>(a);
        case 2:
          return launch_kernel<BF16, VEC, HAS_ZP, SUMX, kExact, false, 2>(a);
        default:
          return launch_kernel<BF16, VEC, HAS_ZP, SUMX, kExact, false, 4>(a);
      }
    }
  }
  if (a.M > 8) return cudaErrorInvalidValue;  // the probes: one column tile
  if constexpr (BF16 && VEC == 4 && !HAS_ZP) {  // the probes: bf16, 16-byte vectors, symmetric
    if (a.variant == kProbeLoad) return launch_kernel<BF16, VEC, HAS_ZP, SUMX, kProbeLoad>(a);
    if (a.variant == kProbeCompute) return launch_kernel<BF16, VEC, HAS_ZP, SUMX, kProbeCompute>(a);
    if (a.variant == kProbeNoMeta) return launch_kernel<BF16, VEC, HAS_ZP, SUMX, kProbeNoMeta>(a);
  }
  return cudaErrorInvalidValue;
}

template <bool BF16, bool HAS_ZP, bool SUMX>
cudaError_t launch_vec(int vec, const Args& a) {
  switch (vec) {
    case 4:
      return launch<BF16, 4, HAS_ZP, SUMX>(a);
    case 2:
      return launch<BF16, 2, HAS_ZP, SUMX>(a);
    case 1:
      return launch<BF16, 1, HAS_ZP, SUMX>(a);
    default:
      return cudaErrorInvalidValue;
  }
}

template <int VEC>
int smem_for_vec(int warps, int K, bool sumx, int M) {
  return sumx ? smem_bytes<VEC, true>(warps, K, 1) : smem_bytes<VEC, false>(warps, K, column_tiles(M));
}

}  // namespace

extern "C" {

// Version of this entry point's arguments; the Python side refuses a library that disagrees.
int mllmd_w4a16_mma_abi() { return 11; }

// Shared memory (bytes) a launch of `warps` warps needs: the Python side checks it against the device.
int mllmd_w4a16_mma_smem(int M, int K, int vec, int warps, int bf16) {
  const bool sumx = M == 1 && bf16;
  switch (vec) {
    case 4:
      return smem_for_vec<4>(warps, K, sumx, M);
    case 2:
      return smem_for_vec<2>(warps, K, sumx, M);
    case 1:
      return smem_for_vec<1>(warps, K, sumx, M);
    default:
      return -1;
  }
}

// Returns a cudaError_t (0: launched). The caller checks shapes (w4a16_mma.supports): M in [1, 32],
// N % 16 == 0, K % 256 == 0; `vec` 4 / 2 / 1 for groups of >= 128 / 64 / 32 columns (or channel-wise:
// 4); 2**gshift chunks of 32 * vec columns per group (channel-wise: 30); `split` warps share a 16-row
// tile's K, and a CTA of `warps` warps holds warps / split tiles; `variant`: kExact, or a bench probe.
// One bf16 row takes the offset form (SUMX), anything else the exact one.
// Fusions, one bf16 row only (kernels of their own): `norm_weight`: x is RMSNorm's input (with
// `residual`: x + residual, written to `residual_out`, which must not alias x or residual); `silu`:
// y [1, N / 2] = silu(first half) * second half (N % 32 == 0, warps / split even).
int mllmd_w4a16_mma(const void* x, const void* w, const void* scale, const void* zero_point, const void* bias,
                    void* y, int M, int N, int K, int stride_wn, int stride_xm, int stride_ym, int vec, int gshift,
                    int split, int warps, int variant, int bf16, int use_pdl, const void* residual,
                    const void* norm_weight, void* residual_out, float eps, int silu, void* stream) {
  if (M < 1 || M > 32 || N % 16 || K % kStageCols || warps < 1 || warps > kMaxWarps || split < 1 || warps % split)
    return cudaErrorInvalidValue;
  if ((norm_weight != nullptr || silu) && !(M == 1 && bf16)) return cudaErrorInvalidValue;
  if (norm_weight != nullptr && residual != nullptr && residual_out == nullptr) return cudaErrorInvalidValue;
  if (silu && (N % 32 || (warps / split) % 2)) return cudaErrorInvalidValue;
  const Fuse fuse{static_cast<const uint16_t*>(residual), static_cast<const uint16_t*>(norm_weight),
                  static_cast<uint16_t*>(residual_out), eps, silu};
  const Args a{x,     w,     scale,   zero_point, bias, y,   M, N, K, stride_wn, stride_xm, stride_ym, gshift,
               split, warps, variant, use_pdl,    fuse, static_cast<cudaStream_t>(stream)};
  const bool zp = zero_point != nullptr;
  if (bf16) {
    if (M == 1) return zp ? launch_vec<true, true, true>(vec, a) : launch_vec<true, false, true>(vec, a);
    return zp ? launch_vec<true, true, false>(vec, a) : launch_vec<true, false, false>(vec, a);
  }
  return zp ? launch_vec<false, true, false>(vec, a) : launch_vec<false, false, false>(vec, a);
}

const char* mllmd_cuda_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
