// w4a16_mma: y[M, N] = x[M, K] @ dequant(W)^T for M <= 8 (decode), compressed-tensors W4A16 weights as
// stored, on the tensor cores (mma.sync m16n8k16, sm80+: Ampere, Jetson Orin sm87, Hopper).
//
// Weights: int32 [N, K / 8], eight 4-bit values per word along K (value i in bits [4i, 4i + 4)), each
// stored as q + 8. Scales float32 and zero points int8 (asymmetric only) are [N, G], stored G-major
// (element (n, g) at g * N + n). w = (q - zero_point) * scale.
//
// A warp owns 16 weight rows (a "tile": the MMA's A operand, 16 x 16 per step) and a slice of K; `split`
// warps of a CTA share a tile's K and add their partials in shared memory (in a fixed order), and a CTA
// holds warps / split tiles. Lane (r = lane / 4, t = lane % 4) reads VEC consecutive words of rows r and
// r + 8 per "chunk" (32 * VEC columns), so every load is as the checkpoint stores it: no re-layout.
//
// Loads: each warp streams its K slice through a private ring of kStages shared-memory stages with
// cp.async (a stage: 256 columns, i.e. 8 words of each of a lane's two rows, plus their groups' scales
// and zero points), kStages - 1 stages ahead of the MMAs; the first ones are issued before the PDL wait
// (no kernel writes the weights). A lane reads back the words it copied itself; the scales and zero
// points, copied by lanes t = 0..3 of each row, after a __syncwarp.
//
// MMA operands: the A fragment of m16n8k16 gives lane (r, t) the K slots {2t, 2t + 1} and {2t + 8,
// 2t + 9} of rows r and r + 8, and the B fragment gives it the same K slots of column r; any one-to-one
// map from (step, slot) to K serves as long as A and B share it. Here a word's nibbles (j, j + 4) fill
// one register pair: (word >> 4j) & 0x000F000F | magic puts q + 8 into the mantissas of two bf16 (fp16)
// halves of value 128 + q + 8 (1024 + q + 8), exactly. So a word is two MMA steps: nibbles (0, 4), (1, 5)
// and (2, 6), (3, 7), and x's matching pairs are x's 8 columns in the order 0, 4, 1, 5, 2, 6, 3, 7.
// Two ways to remove the offset 136 + zero point (1032 + zero point), both exact in the weights:
//  * "offset" (one bf16 row, SUMX): the MMA multiplies the raw halves 128 + q + 8, and the group's sum
//    subtracts (136 + zero point) * sum(x over the same columns). x is staged once per CTA in shared
//    memory, already in B-fragment order, with its float32 sums per chunk. One LOP3 a weight pair.
//  * "exact" (fp16, several rows): one packed FMA subtracts the offset from each pair before the MMA
//    (fp16's offset would be 8x larger than bf16's against the same float32 sums), and x is loaded
//    from global memory (L1) with two byte permutes a pair.
// The MMA sums a group's steps in float32, then the group's scale multiplies the sum into the
// accumulator (the reference rounds each dequantized weight to x's dtype first; here the weight is exact
// and the product of sums is float32).
//
// x's rows are the B operand's 8 columns (M <= 8); with M = 1 every column holds x.
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kMaxWarps = 8;
constexpr int kStages = 3;  // ring depth a warp: kStages - 1 stages in flight while it multiplies one
constexpr int kStageCols = 256;  // columns a stage: 8 words of each of a lane's two rows
constexpr int kMaxDevices = 64;

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
// kProbeLoad keeps the weight copies and nothing else, kProbeCompute everything but the weight copies.
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

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Weight words: read once, so 16-byte copies bypass L1 (.cg); narrower ones must go through it (.ca).
template <int BYTES>
__device__ __forceinline__ void cp_async(uint32_t dst, const void* src) {
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(src), "n"(BYTES) : "memory");
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
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

// A stage in a warp's ring (256 columns): a lane's 8 words of row r as two 16-byte pieces (piece p of
// every lane, then the next piece: lane * 16 bytes, conflict-free), the same for row r + 8, then for each
// of its U chunks the scales of rows 0..15 and (HAS_ZP) the 4-byte words holding their zero points.
template <int VEC, bool HAS_ZP>
struct StageLayout {
  static constexpr int U = 8 / VEC;  // chunks a stage
  static constexpr int kHi = 1024, kScale = 2048, kZero = kScale + U * 64;
  static constexpr int bytes = kZero + (HAS_ZP ? U * 64 : 0);
  // byte offset of a lane's word j (0..7) of a row within its row's half, less lane * 16
  __host__ __device__ static constexpr int word(int j) { return (j >> 2) * 512 + (j & 3) * 4; }
};

// Copies a stage into the slot at `slot`: this lane's words (w_lo / w_hi: its first word of the stage in
// rows r / r + 8) and, where `meta_src` is set, one scale or zero-point word of each of the stage's chunks
// (`meta_src` + group * meta_group_bytes, into the slot at meta_dst).
template <int VEC, bool HAS_ZP, int VARIANT>
__device__ __forceinline__ void issue_stage(uint32_t slot, int chunk0, const uint32_t* w_lo, const uint32_t* w_hi,
                                            uint32_t lane_dst, uint32_t meta_dst, const char* meta_src,
                                            uint32_t meta_group_bytes, int gshift) {
  using L = StageLayout<VEC, HAS_ZP>;
#pragma unroll
  for (int u = 0; u < L::U; ++u) {
    if constexpr (VARIANT != kProbeCompute) {
      cp_async<4 * VEC>(slot + lane_dst + L::word(u * VEC), w_lo + u * 4 * VEC);
      cp_async<4 * VEC>(slot + lane_dst + L::kHi + L::word(u * VEC), w_hi + u * 4 * VEC);
    }
    if (meta_src != nullptr) {
      // 32-bit offsets: a layer's scales are far below 4 GiB
      cp_async<4>(slot + meta_dst + u * 64, meta_src + static_cast<uint32_t>((chunk0 + u) >> gshift) * meta_group_bytes);
    }
  }
}

template <bool BF16, int VEC, bool HAS_ZP, bool SUMX, int VARIANT>
__global__ void __launch_bounds__(kMaxWarps * 32, 3) w4a16_mma_kernel(
    const uint16_t* __restrict__ x, const uint32_t* __restrict__ w, const float* __restrict__ scale,
    const int8_t* __restrict__ zero_point, const uint16_t* __restrict__ bias, uint16_t* __restrict__ y, int M,
    int N, int K, int stride_wn, int stride_xm, int stride_ym, int gshift, int split, int slots) {
  using L = StageLayout<VEC, HAS_ZP>;
  constexpr int U = L::U;
  extern __shared__ __align__(16) unsigned char smem[];
  // [rings: warps x `slots` stages (min(kStages, a warp's stages)); after the loop, the split-K partials:
  // warps x 16 x 8 floats][SUMX: x (K halves), its sums a chunk]
  float(*partial)[16][8] = reinterpret_cast<float(*)[16][8]>(smem);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int r = lane >> 2, t = lane & 3;
  const int tiles_per_cta = warps / split;
  const int tile = blockIdx.x * tiles_per_cta + warp / split, part = warp % split;
  const int n0 = tile * 16;
  const int stages = n0 < N ? K / kStageCols : 0;  // a tile past N (last CTA) computes nothing
  const int s0 = part * stages / split, s1 = (part + 1) * stages / split;
  const int chunks_per_group_mask = (1 << gshift) - 1;

  const int n_first = min(n0, N - 16);  // a tile past N points at the last one (never read)
  // this lane's first words of stage s0 in rows r and r + 8 (a stage: 32 words of a row)
  const uint32_t* w_lo = w + static_cast<size_t>(n_first + r) * stride_wn + t * VEC + s0 * 32;
  const uint32_t* w_hi = w_lo + static_cast<size_t>(8) * stride_wn;
  // metadata: lanes t = 0 / 1 copy the scales of rows r / r + 8, lanes t = 2 / 3 their zero points' words
  const int meta_row = r + ((t & 1) << 3);
  const char* meta_src = t < 2 ? reinterpret_cast<const char*>(scale + n_first + meta_row)
                         : HAS_ZP ? reinterpret_cast<const char*>(zero_point + n_first + (meta_row & ~3))
                                  : nullptr;
  const uint32_t meta_group_bytes = static_cast<uint32_t>(N) * (t < 2 ? 4u : 1u);
  const uint32_t lane_dst = lane * 16, meta_dst = (t < 2 ? L::kScale : L::kZero) + meta_row * 4;
  unsigned char* ring_base = smem + warp * slots * L::bytes;
  const uint32_t ring = smem_addr(ring_base);
  unsigned char* xs = smem + warps * slots * L::bytes;  // SUMX: x
  float* xsum = reinterpret_cast<float*>(xs + K * 2);  // SUMX: x's sum over each chunk

  // The first kStages - 1 stages before the PDL wait: the weights are no kernel's output.
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (s0 + i < s1) {
      issue_stage<VEC, HAS_ZP, VARIANT>(ring + i * L::bytes, (s0 + i) * U, w_lo + i * 32, w_hi + i * 32, lane_dst,
                                        meta_dst, meta_src, meta_group_bytes, gshift);
    }
    cp_async_commit();
  }
  pdl_wait_and_release();

  if constexpr (SUMX) {  // x (one row) in B-fragment order, and its sums per chunk, for the whole CTA
    uint4* xs_vec = reinterpret_cast<uint4*>(xs);
    const int vecs = K / 8;  // 16-byte vectors: 4 * VEC a chunk (lane t's VEC vectors, t = 0..3)
    for (int base = warp * 32; base < vecs; base += blockDim.x) {  // whole warps: a chunk's lanes align
      const int i = base + lane;
      float s = 0.f;
      if (i < vecs) {
        const uint4 v = load_x(x + 8 * i);
        const int c = i / (4 * VEC), within = i % (4 * VEC);
        xs_vec[(c * VEC + within % VEC) * 4 + within / VEC] = fragment_order(v);
        s = sum8_bf16(v);
      }
#pragma unroll
      for (int o = 1; o < 4 * VEC; o <<= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
      if (i < vecs && i % (4 * VEC) == 0) xsum[i / (4 * VEC)] = s;
    }
    __syncthreads();
  }

  const uint16_t* x_row = x + static_cast<size_t>(min(r, M - 1)) * stride_xm + t * 8 * VEC;  // !SUMX
  const uint32_t nb_sym = (Magic<BF16>::bias | (Magic<BF16>::bias << 16)) ^ 0x80008000u;
  const int zp_shift = 8 * (r & 3);  // HAS_ZP: the byte of rows r and r + 8 in their zero points' words
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  float sum[4] = {0.f, 0.f, 0.f, 0.f};  // the current group's MMA sums
  float xs_acc = 0.f;  // SUMX: x's sum over the columns in `sum`
  uint32_t probe = 0;  // kProbeLoad

  // slot j % kStages holds stage s0 + j (a warp with fewer stages than kStages never wraps)
  for (int slot_i = 0, st = s0; st < s1; ++st) {
    cp_async_wait<kStages - 2>();  // this lane's copies of stage st have landed
    __syncwarp();  // ... and every lane's (the scales); the slot of stage st - 1 is free again
    const int free_i = slot_i == 0 ? kStages - 1 : slot_i - 1;  // (slot_i + kStages - 1) % kStages
    if (st + kStages - 1 < s1) {
      const int ahead = (kStages - 1) * 32;
      issue_stage<VEC, HAS_ZP, VARIANT>(ring + free_i * L::bytes, (st + kStages - 1) * U, w_lo + ahead,
                                        w_hi + ahead, lane_dst, meta_dst, meta_src, meta_group_bytes, gshift);
    }
    cp_async_commit();
    w_lo += 32;
    w_hi += 32;
    const uint32_t slot = ring + slot_i * L::bytes;
    const unsigned char* slot_ptr = ring_base + slot_i * L::bytes;
    slot_i = slot_i == kStages - 1 ? 0 : slot_i + 1;
    const uint4 lo_a = lds128(slot + lane_dst), lo_b = lds128(slot + lane_dst + 512);
    const uint4 hi_a = lds128(slot + lane_dst + L::kHi), hi_b = lds128(slot + lane_dst + L::kHi + 512);
    const uint32_t lo_w[8] = {lo_a.x, lo_a.y, lo_a.z, lo_a.w, lo_b.x, lo_b.y, lo_b.z, lo_b.w};
    const uint32_t hi_w[8] = {hi_a.x, hi_a.y, hi_a.z, hi_a.w, hi_b.x, hi_b.y, hi_b.z, hi_b.w};
    if constexpr (VARIANT == kProbeLoad) {
#pragma unroll
      for (int i = 0; i < 8; ++i) probe ^= lo_w[i] ^ hi_w[i];
    } else {
      const unsigned char* xs_stage = xs + st * 512 + t * 16;  // SUMX: 8 vectors x 4 lanes t a stage
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = st * U + u;
        const float* scales = reinterpret_cast<const float*>(slot_ptr + L::kScale + u * 64);
        const uint32_t* zero_words = reinterpret_cast<const uint32_t*>(slot_ptr + L::kZero + u * 64);
        int zp_lo = 0, zp_hi = 0;
        if constexpr (HAS_ZP) {
          zp_lo = static_cast<int8_t>(zero_words[r] >> zp_shift);
          zp_hi = static_cast<int8_t>(zero_words[8 + r] >> zp_shift);
        }
        uint32_t nb_lo = nb_sym, nb_hi = nb_sym;
        if constexpr (HAS_ZP && !SUMX) {
          const uint32_t b_lo = Magic<BF16>::bias + zp_lo, b_hi = Magic<BF16>::bias + zp_hi;
          nb_lo = ((b_lo & 0xFFFFu) | (b_lo << 16)) ^ 0x80008000u;
          nb_hi = ((b_hi & 0xFFFFu) | (b_hi << 16)) ^ 0x80008000u;
        }
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          const uint32_t lo = lo_w[u * VEC + v], hi = hi_w[u * VEC + v];
          if constexpr (SUMX) {
            const uint4 b = *reinterpret_cast<const uint4*>(xs_stage + (u * VEC + v) * 64);
            mma16816<BF16>(sum, raw_pair<BF16>(lo), raw_pair<BF16>(hi), raw_pair<BF16>(lo >> 4),
                           raw_pair<BF16>(hi >> 4), b.x, b.y);
            mma16816<BF16>(sum, raw_pair<BF16>(lo >> 8), raw_pair<BF16>(hi >> 8), raw_pair<BF16>(lo >> 12),
                           raw_pair<BF16>(hi >> 12), b.z, b.w);
          } else {
            const uint4 b = fragment_order(load_x(x_row + c * 32 * VEC + 8 * v));  // lane t's 8 columns
            mma16816<BF16>(sum, dequant_pair<BF16>(lo, nb_lo), dequant_pair<BF16>(hi, nb_hi),
                           dequant_pair<BF16>(lo >> 4, nb_lo), dequant_pair<BF16>(hi >> 4, nb_hi), b.x, b.y);
            mma16816<BF16>(sum, dequant_pair<BF16>(lo >> 8, nb_lo), dequant_pair<BF16>(hi >> 8, nb_hi),
                           dequant_pair<BF16>(lo >> 12, nb_lo), dequant_pair<BF16>(hi >> 12, nb_hi), b.z, b.w);
          }
        }
        if constexpr (SUMX) xs_acc += xsum[c];
        if (((c + 1) & chunks_per_group_mask) == 0 || (st + 1 == s1 && u == U - 1)) {
          const float s_lo = scales[r], s_hi = scales[8 + r];
          if constexpr (SUMX) {  // sum - (136 + zero point) * sum(x): the raw halves' offset
            const float off_lo = 136.0f + static_cast<float>(zp_lo);
            const float off_hi = 136.0f + static_cast<float>(zp_hi);
            acc[0] = fmaf(fmaf(-off_lo, xs_acc, sum[0]), s_lo, acc[0]);
            acc[1] = fmaf(fmaf(-off_lo, xs_acc, sum[1]), s_lo, acc[1]);
            acc[2] = fmaf(fmaf(-off_hi, xs_acc, sum[2]), s_hi, acc[2]);
            acc[3] = fmaf(fmaf(-off_hi, xs_acc, sum[3]), s_hi, acc[3]);
            xs_acc = 0.f;
          } else {
            acc[0] = fmaf(sum[0], s_lo, acc[0]);
            acc[1] = fmaf(sum[1], s_lo, acc[1]);
            acc[2] = fmaf(sum[2], s_hi, acc[2]);
            acc[3] = fmaf(sum[3], s_hi, acc[3]);
          }
          sum[0] = sum[1] = sum[2] = sum[3] = 0.f;
        }
      }
    }
  }
  cp_async_wait<0>();  // no copy may outlive the kernel (the empty trailing groups)
  __syncthreads();  // the partials overwrite the rings

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

// Ring slots a warp: kStages, or fewer where no warp has that many stages (K / 256 split `split` ways).
int ring_slots(int K, int split) {
  const int most = (K / kStageCols + split - 1) / split;
  return most < kStages ? (most > 0 ? most : 1) : kStages;
}

// Shared memory a launch needs (bytes): the warps' rings (the split-K partials reuse them), and (SUMX) x
// with its chunk sums.
template <int VEC, bool HAS_ZP, bool SUMX>
int smem_bytes(int warps, int split, int K) {
  return warps * ring_slots(K, split) * StageLayout<VEC, HAS_ZP>::bytes + (SUMX ? K * 2 + (K / (32 * VEC)) * 4 : 0);
}

template <bool BF16, int VEC, bool HAS_ZP, bool SUMX, int VARIANT>
cudaError_t launch_kernel(const Args& a) {
  auto kernel = w4a16_mma_kernel<BF16, VEC, HAS_ZP, SUMX, VARIANT>;
  const int tiles = a.N / 16, tiles_per_cta = a.warps / a.split;
  const dim3 grid((tiles + tiles_per_cta - 1) / tiles_per_cta), block(32 * a.warps);
  const int smem = smem_bytes<VEC, HAS_ZP, SUMX>(a.warps, a.split, a.K);
  const int slots = ring_slots(a.K, a.split);
  static int smem_allowed[kMaxDevices];  // per instantiation and device: raised to what a launch needs
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (smem > 48 * 1024 && smem > smem_allowed[device]) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    smem_allowed[device] = smem;
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
                              a.stride_ym, a.gshift, a.split, slots);
  }
#endif
  kernel<<<grid, block, smem, a.stream>>>(xp, wp, sp, zp, bp, yp, a.M, a.N, a.K, a.stride_wn, a.stride_xm,
                                          a.stride_ym, a.gshift, a.split, slots);
  return cudaGetLastError();
}

template <bool BF16, int VEC, bool HAS_ZP, bool SUMX>
cudaError_t launch(const Args& a) {
  if (a.variant == kExact) return launch_kernel<BF16, VEC, HAS_ZP, SUMX, kExact>(a);
  if constexpr (BF16 && VEC == 4 && !HAS_ZP) {  // the probes: bf16, 16-byte vectors, symmetric
    if (a.variant == kProbeLoad) return launch_kernel<BF16, VEC, HAS_ZP, SUMX, kProbeLoad>(a);
    if (a.variant == kProbeCompute) return launch_kernel<BF16, VEC, HAS_ZP, SUMX, kProbeCompute>(a);
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
int smem_for_vec(int warps, int split, int K, bool zp, bool sumx) {
  if (zp) return sumx ? smem_bytes<VEC, true, true>(warps, split, K) : smem_bytes<VEC, true, false>(warps, split, K);
  return sumx ? smem_bytes<VEC, false, true>(warps, split, K) : smem_bytes<VEC, false, false>(warps, split, K);
}

}  // namespace

extern "C" {

// Version of this entry point's arguments; the Python side refuses a library that disagrees.
int mllmd_w4a16_mma_abi() { return 7; }

// Shared memory (bytes) a launch of `warps` warps needs: the Python side checks it against the device.
int mllmd_w4a16_mma_smem(int M, int K, int vec, int warps, int split, int has_zero_point, int bf16) {
  const bool sumx = M == 1 && bf16;
  switch (vec) {
    case 4:
      return smem_for_vec<4>(warps, split, K, has_zero_point, sumx);
    case 2:
      return smem_for_vec<2>(warps, split, K, has_zero_point, sumx);
    case 1:
      return smem_for_vec<1>(warps, split, K, has_zero_point, sumx);
    default:
      return -1;
  }
}

// Returns a cudaError_t (0: launched). The caller checks shapes (w4a16_mma.supports): M in [1, 8],
// N % 16 == 0, K % 256 == 0; `vec` 4 / 2 / 1 for groups of >= 128 / 64 / 32 columns (or channel-wise:
// 4); 2**gshift chunks of 32 * vec columns per group (channel-wise: 30); `split` warps share a 16-row
// tile's K, and a CTA of `warps` warps holds warps / split tiles; `variant`: kExact, or a bench probe.
// One bf16 row takes the offset form (SUMX), anything else the exact one.
int mllmd_w4a16_mma(const void* x, const void* w, const void* scale, const void* zero_point, const void* bias,
                    void* y, int M, int N, int K, int stride_wn, int stride_xm, int stride_ym, int vec, int gshift,
                    int split, int warps, int variant, int bf16, int use_pdl, void* stream) {
  if (M < 1 || M > 8 || N % 16 || K % kStageCols || warps < 1 || warps > kMaxWarps || split < 1 || warps % split)
    return cudaErrorInvalidValue;
  const Args a{x,     w,     scale,   zero_point, bias,    y, M, N, K, stride_wn, stride_xm, stride_ym, gshift,
               split, warps, variant, use_pdl,    static_cast<cudaStream_t>(stream)};
  const bool zp = zero_point != nullptr;
  if (bf16) {
    if (M == 1) return zp ? launch_vec<true, true, true>(vec, a) : launch_vec<true, false, true>(vec, a);
    return zp ? launch_vec<true, true, false>(vec, a) : launch_vec<true, false, false>(vec, a);
  }
  return zp ? launch_vec<false, true, false>(vec, a) : launch_vec<false, false, false>(vec, a);
}

const char* mllmd_cuda_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
