// W4A16 projections for decode-sized batches (M <= 32 rows): Y[M, N] = X[M, K] @ W[N, K]^T with W
// held as 4-bit codes and a scale and an offset per group of GS inputs (W = q * scale + offset,
// swiftspec_mpi.packed.int4.PackedInt4), bf16 activations, fp32 accumulation on tensor cores,
// bf16 out; the same product fused with the tensor-parallel all-reduce through NCCL's device API
// (as cuda/gemm_allreduce.cu does for bf16 weights); and the dequantization to a bf16 [N, K] matrix
// (prompts: dequantized layer by layer, then cuBLAS).
//
// Device layout (swiftspec_mpi/gpu/w4a16.py repacks a PackedInt4 into it at load time), tile-
// major: the 16 rows of a tile (n = 16 t + r) and the 128 k's of a chunk c are one 1 KiB piece, so
// a warp's 16-byte loads of a chunk read 512 contiguous bytes (rows 0..7, then 8..15) instead of
// 64 bytes of 8 rows 2 KiB .. 14 KiB apart:
//   qweight uint8 [N, K/2]: (tile t, chunk c) = bytes [16 t K/2 + 1024 c, + 1024); row r of the
//     tile = its bytes [64 r, 64 r + 64); inside them, the 4-byte word (lane q, part p) at byte
//     16 q + 4 p holds the 8 codes of k = 128 c + 32 p + 8 q + i', nibble i (bits 4i..4i+3)
//     holding i' = PERM[i] = {0, 2, 4, 6, 1, 3, 5, 7}: (nibble i, nibble i + 4) are the
//     consecutive k's (2i, 2i + 1).
//   so uint32 [N, K/GS]: bf16 scale (low half) and bf16 offset (high half) of each group; (tile t,
//     chunk c) = words [16 t K/GS + 16 SW c, + 16 SW), row r = SW words from 16 SW c + SW r
//     (SW = 128 / GS: the chunk's groups of one row).
// So lane q of a warp reads one 16-byte vector per row and 128-k chunk, and its 4 words are
// groups 4c + p for GS = 32 (one group each), 2c + p/2 for GS = 64, c for GS = 128.
//
// GEMV on tensor cores with W as the A operand (mma.sync m16n8k16: 16 W rows x 16 k's, times X^T:
// 16 k's x 8 rows of X). Lane (g = lane/4, q = lane%4) supplies W rows g and g + 8 of the tile and
// X row 8 b + g of m-block b at the same 4 k's per MMA: MMA 2p of a chunk takes k = 32p + 8q + 0..3,
// MMA 2p + 1 k = 32p + 8q + 4..7 (a permutation of the k's inside each MMA, the same for A and B,
// so the sum is the same). One 16-byte load of X row m gives both MMAs' B fragments, one 16-byte
// load of W row g their A halves. Dequantization in registers: (word >> 4i) & 0x000F000F | 0x43004300
// is the bf16 pair (128 + q_2i, 128 + q_2i+1) (one lop3 and one shift), minus 128 exactly, then one
// bf16x2 FMA with (scale, offset) of the row's group: W = bf16(q * s + o) with s, o rounded to bf16
// (relative error of W about 2^-9 of |q s| + |o|, the same as a bf16 weight's rounding).
//
// A block of 8 warps owns T tiles of 16 W rows; warp w takes the k-chunks w U, (w + 8) U, ... of
// U x 128 k's, double-buffering its loads in registers (the next chunk's W, scales in flight while
// the current one is multiplied); the 8 warps' partial [16 x 8 MB] tiles are summed in shared
// memory in warp order. MB = 1, 2, 4 m-blocks of 8 rows: M <= 8, 16, 32. The summation order
// depends on U and GS only. Programmatic dependent launch: launch_dependents at once, and
// griddepcontrol.wait after the first chunk's W loads are issued (W is a weight, X the previous
// kernel's output).
//
// Instructions per 128-k chunk of a tile (E = 1): one shift and one lop3 per bf16x2 pair (the
// mask and the 0x4300 exponent live in registers, a lop3 takes a single immediate), 2 + 2 MMAs per
// 32 k's, the group's scale and offset in fp32; the W, scale and X addresses are loop-carried
// pointers (not rebuilt from the thread index per chunk), units past K are skipped rather than
// zero-filled, and X rows past M read row 0 (their MMA columns are dropped; the others do not
// depend on them). About 105 instructions per KiB of codes a warp at T = 1 (was 183).
//
// Floor: the packed bytes. Llama-3-8B down_proj 4096 x 14336 at group 128: 28 MiB codes + 1.8 MiB
// scales -> 7.5 us at 4.17 TB/s; Llama-3-70B down_proj 8192 x 28672: 117 + 7.3 MiB -> 31 us.

#include <cuda_bf16.h>
#include <stdint.h>

#include "lop3.cuh"
#include "mma_bf16.cuh"

#ifdef SWIFTSPEC_WITH_NCCL
#include <nccl.h>
#include <nccl_device.h>

#include "nccl_window.cuh"
#endif

namespace w4 {

constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}


__device__ __forceinline__ uint32_t as_u32(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 as_bf2(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }

// An opaque copy of v: the compiler keeps it in a register instead of folding it into immediates
// (a lop3 takes one immediate: (w & m) | c with both constants costs two).
__device__ __forceinline__ uint32_t opaque(uint32_t v) {
  asm volatile("" : "+r"(v));
  return v;
}

// Pair i (0..3) of a code word as bf16x2 weights: (q_2i, q_2i+1) * scale + offset, so = (scale, offset).
__device__ __forceinline__ uint32_t dq_pair(uint32_t word, int i, uint32_t so) {
  const uint32_t t = lop3_andor(word >> (4 * i), 0x000F000Fu, 0x43004300u);   // bf16 128 + q, one lop3
  const __nv_bfloat162 q = __hsub2(as_bf2(t), as_bf2(0x43004300u));          // exact q
  const __nv_bfloat162 s2 = as_bf2((so & 0xFFFFu) | (so << 16));
  const __nv_bfloat162 o2 = as_bf2((so >> 16) | (so & 0xFFFF0000u));
  return as_u32(__hfma2(q, s2, o2));
}

// Scales of one row for one 128-k chunk: SW = 128 / GS words (group of word p = p * SW / 4).
template <int GS>
struct Scales {
  static constexpr int SW = 128 / GS;
  uint32_t v[SW];
};

template <int GS>
__device__ __forceinline__ void load_scales(Scales<GS>& s, const uint32_t* p) {
  if constexpr (GS == 32) {
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
    s.v[0] = r.x; s.v[1] = r.y; s.v[2] = r.z; s.v[3] = r.w;
  } else if constexpr (GS == 64) {
    const uint2 r = __ldg(reinterpret_cast<const uint2*>(p));
    s.v[0] = r.x; s.v[1] = r.y;
  } else {
    s.v[0] = __ldg(p);
  }
}

template <int GS>
__device__ __forceinline__ uint32_t scale_of(const Scales<GS>& s, int p) {
  return s.v[(p * Scales<GS>::SW) / 4];
}

// One warp's chunk: U 128-k units of the T tiles' rows g (h = 0) and g + 8 (h = 1).
template <int T, int U, int GS>
struct Chunk {
  uint4 w[T][U][2];
  Scales<GS> s[T][U][2];
};

// Partial Y tiles of the T tiles tile0 .. tile0 + T - 1 (those < n_tiles) over all of K, summed
// over the block's warps, into res[t][n (16)][m (8 MB)] (shared, T * 128 * MB floats). red: shared
// scratch [WARPS][T * 128 * MB]. All THREADS threads call it; ends with a barrier.
// SWI (the gate|up product of gemm_swiglu, W = [gate (I rows) | up (I rows)], I = 8 n_tiles): tile
// j stands for gate rows 8j .. 8j + 7 (its rows 0..7) and up rows I + 8j .. I + 8j + 7 (rows
// 8..15), each half 512 contiguous bytes a chunk in the tile-major layout when I % 16 == 0. A row's
// sum does not depend on the tile it sits in, so each output has the bits of the plain product.
template <int T, int U, int GS, int MB, bool EX, bool SWI = false>
__device__ __forceinline__ void w4_tiles(const __nv_bfloat16* __restrict__ x, long long ldx,
                                         const uint8_t* __restrict__ qw, const uint32_t* __restrict__ so,
                                         int M, int K, int n_tiles, int tile0, float* red, float* res) {
  constexpr int KC = 128 * U;
  constexpr int STEP = WARPS * KC;
  constexpr int TS = 128 * MB;               // floats of one tile's [16 x 8 MB] partial
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, q = lane & 3;
  const long long qrow = K / 2, srow = K / GS;
  // Per-lane streams, advanced chunk by chunk (loop-carried, so kept in registers instead of
  // recomputed from the thread index): 16-byte vector q of each row at this warp's next chunk (a
  // tile past n_tiles reads tile0's rows, its results are dropped), the rows' scales, and X row
  // 8 b + g (rows past M read row 0: their MMA columns are dropped, the others do not depend on them).
  constexpr int SW = 128 / GS;               // scale words of a row and chunk
  constexpr int UNIT_V = 64;                 // 16-byte vectors of a tile and chunk (1 KiB)
  const uint4* wp[T][2];
  const uint32_t* sp[T][2];
  const int kw = warp * KC;
#pragma unroll
  for (int t = 0; t < T; ++t) {
    const int tile = tile0 + t < n_tiles ? tile0 + t : tile0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long long n = SWI ? (h ? 8LL * n_tiles : 0LL) + 8LL * tile + g : 16LL * tile + g + 8 * h;
      const long long nt = n / 16;           // the weight row's tile and its row in it
      const int r = (int)(n % 16);
      wp[t][h] = reinterpret_cast<const uint4*>(qw + nt * 16 * qrow) + (kw / 128) * UNIT_V + 4 * r + q;
      sp[t][h] = so + nt * 16 * srow + (kw / 128) * 16 * SW + SW * r;
    }
  }
  const uint4* xp[MB];
#pragma unroll
  for (int b = 0; b < MB; ++b)
    xp[b] = reinterpret_cast<const uint4*>(x + (long long)(8 * b + g < M ? 8 * b + g : 0) * ldx + kw) + q;
  // loop-invariant operands kept in registers: one lop3 a pair (no second immediate), all-ones A
  const uint32_t lo4 = opaque(0x000F000Fu), magic = opaque(0x43004300u);

  // the chunk at k0 into ch (units past K left unloaded: never multiplied); the streams advance
  auto load = [&](Chunk<T, U, GS>& ch, int k0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (k0 + 128 * u < K) {
#pragma unroll
        for (int t = 0; t < T; ++t)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            ch.w[t][u][h] = ld_stream(wp[t][h] + UNIT_V * u);
            load_scales<GS>(ch.s[t][u][h], sp[t][h] + 16 * SW * u);
          }
      }
    }
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wp[t][h] += (STEP / 128) * UNIT_V;
        sp[t][h] += (STEP / 128) * 16 * SW;
      }
  };
  float cc[T][MB][4];
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int b = 0; b < MB; ++b) cc[t][b][0] = cc[t][b][1] = cc[t][b][2] = cc[t][b][3] = 0.f;

  // EX (exact group scaling): the MMAs take the codes' bf16 (128 + q) as they come out of one
  // lop3 (no per-weight subtract and FMA); per group, P = sum x (128 + q) of each output and
  // X = sum x (one MMA with an all-ones A per X fragment), then Y += s P + (o - 128 s) X in fp32.
  auto compute_exact = [&](const Chunk<T, U, GS>& ch, int u, int k) {
    constexpr int PG = GS / 32;               // words p per group (1, 2, 4)
    const uint32_t one = opaque(0x3F803F80u); // bf16 (1, 1)
    float tp[T][MB][4], xs[MB][4];
    uint4 xb[4][MB];                          // the unit's X fragments, loaded up front
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
      for (int b = 0; b < MB; ++b) xb[p][b] = __ldg(xp[b] + 16 * u + 4 * p);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      if (p % PG == 0) {
#pragma unroll
        for (int b = 0; b < MB; ++b) {
          xs[b][0] = xs[b][1] = xs[b][2] = xs[b][3] = 0.f;
#pragma unroll
          for (int t = 0; t < T; ++t) tp[t][b][0] = tp[t][b][1] = tp[t][b][2] = tp[t][b][3] = 0.f;
        }
      }
#pragma unroll
      for (int b = 0; b < MB; ++b) {
        mma_bf16(xs[b], one, one, one, one, xb[p][b].x, xb[p][b].y);
        mma_bf16(xs[b], one, one, one, one, xb[p][b].z, xb[p][b].w);
      }
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const uint32_t wg = (&ch.w[t][u][0].x)[p], wh = (&ch.w[t][u][1].x)[p];
        const uint32_t a0 = lop3_andor(wg, lo4, magic), a1 = lop3_andor(wh, lo4, magic);
        const uint32_t a2 = lop3_andor(wg >> 4, lo4, magic), a3 = lop3_andor(wh >> 4, lo4, magic);
        const uint32_t e0 = lop3_andor(wg >> 8, lo4, magic), e1 = lop3_andor(wh >> 8, lo4, magic);
        const uint32_t e2 = lop3_andor(wg >> 12, lo4, magic), e3 = lop3_andor(wh >> 12, lo4, magic);
#pragma unroll
        for (int b = 0; b < MB; ++b) {
          mma_bf16(tp[t][b], a0, a1, a2, a3, xb[p][b].x, xb[p][b].y);
          mma_bf16(tp[t][b], e0, e1, e2, e3, xb[p][b].z, xb[p][b].w);
        }
      }
      if (p % PG == PG - 1) {                 // the group ends: scale and offset in fp32
#pragma unroll
        for (int t = 0; t < T; ++t) {
          const uint32_t sg = scale_of<GS>(ch.s[t][u][0], p), sh = scale_of<GS>(ch.s[t][u][1], p);
          const float s0 = __uint_as_float(sg << 16), o0 = __uint_as_float(sg & 0xFFFF0000u) - 128.f * s0;
          const float s1 = __uint_as_float(sh << 16), o1 = __uint_as_float(sh & 0xFFFF0000u) - 128.f * s1;
#pragma unroll
          for (int b = 0; b < MB; ++b) {
            cc[t][b][0] = fmaf(s0, tp[t][b][0], fmaf(o0, xs[b][0], cc[t][b][0]));
            cc[t][b][1] = fmaf(s0, tp[t][b][1], fmaf(o0, xs[b][1], cc[t][b][1]));
            cc[t][b][2] = fmaf(s1, tp[t][b][2], fmaf(o1, xs[b][0], cc[t][b][2]));
            cc[t][b][3] = fmaf(s1, tp[t][b][3], fmaf(o1, xs[b][1], cc[t][b][3]));
          }
        }
      }
    }
  };

  auto compute = [&](const Chunk<T, U, GS>& ch, int k0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + 128 * u;
      if (k >= K) break;                      // uniform over the warp
      if constexpr (EX) {
        compute_exact(ch, u, k);
      } else {
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          uint4 xb[MB];
#pragma unroll
          for (int b = 0; b < MB; ++b) xb[b] = __ldg(xp[b] + 16 * u + 4 * p);
#pragma unroll
          for (int t = 0; t < T; ++t) {
            const uint32_t wg = (&ch.w[t][u][0].x)[p], wh = (&ch.w[t][u][1].x)[p];
            const uint32_t sg = scale_of<GS>(ch.s[t][u][0], p), sh = scale_of<GS>(ch.s[t][u][1], p);
            // MMA 2p: k's 0..3 of this word (pairs 0, 1); MMA 2p + 1: k's 4..7 (pairs 2, 3)
            const uint32_t a0 = dq_pair(wg, 0, sg), a1 = dq_pair(wh, 0, sh);
            const uint32_t a2 = dq_pair(wg, 1, sg), a3 = dq_pair(wh, 1, sh);
            const uint32_t e0 = dq_pair(wg, 2, sg), e1 = dq_pair(wh, 2, sh);
            const uint32_t e2 = dq_pair(wg, 3, sg), e3 = dq_pair(wh, 3, sh);
#pragma unroll
            for (int b = 0; b < MB; ++b) {
              mma_bf16(cc[t][b], a0, a1, a2, a3, xb[b].x, xb[b].y);
              mma_bf16(cc[t][b], e0, e1, e2, e3, xb[b].z, xb[b].w);
            }
          }
        }
      }
    }
#pragma unroll
    for (int b = 0; b < MB; ++b) xp[b] += STEP / 8;
  };

  int k0 = kw;
  {
    Chunk<T, U, GS> c0, c1;
    if (k0 < K) load(c0, k0);
    asm volatile("griddepcontrol.wait;\n" ::: "memory");   // no-op without PDL
    while (k0 < K) {
      load(c1, k0 + STEP);                    // past K: nothing loaded
      compute(c0, k0);
      k0 += STEP;
      if (k0 >= K) break;
      load(c0, k0 + STEP);
      compute(c1, k0);
      k0 += STEP;
    }
  }
  // partials: c[0] (n g, m 8b + 2q), c[1] (g, 8b + 2q + 1), c[2] (g + 8, 2q), c[3] (g + 8, 2q + 1)
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int b = 0; b < MB; ++b) {
      float* r = red + warp * (T * TS) + t * TS;
      const int m0 = 8 * b + 2 * q;
      r[g * (8 * MB) + m0] = cc[t][b][0];
      r[g * (8 * MB) + m0 + 1] = cc[t][b][1];
      r[(g + 8) * (8 * MB) + m0] = cc[t][b][2];
      r[(g + 8) * (8 * MB) + m0 + 1] = cc[t][b][3];
    }
  __syncthreads();
  for (int e = tid; e < T * TS; e += THREADS) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) s += red[i * (T * TS) + e];
    res[e] = s;
  }
  __syncthreads();
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Y = X W^T (SWI = false: Y [M, N]) or Y = bf16(bf16(silu(G)) * U) with [G | U] = X W^T rounded to
// bf16 (SWI = true: Y [M, N / 2]; fused_ops.cu's silu_mul and its roundings, so the same bits as
// silu_mul(gemm(X, W)) with the same variant).
template <int T, int U, int GS, int MB, bool EX, bool SWI = false>
__device__ __forceinline__ void gemm_body(const __nv_bfloat16* __restrict__ x, long long ldx,
                                          const uint8_t* __restrict__ qw, const uint32_t* __restrict__ so,
                                          __nv_bfloat16* __restrict__ y, long long ldy, int M, int N, int K) {
  constexpr int TS = 128 * MB;
  __shared__ float red[WARPS * T * TS];
  __shared__ float res[T * TS];
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int n_tiles = N / 16;
  for (int tile0 = blockIdx.x * T; tile0 < n_tiles; tile0 += gridDim.x * T) {
    w4_tiles<T, U, GS, MB, EX, SWI>(x, ldx, qw, so, M, K, n_tiles, tile0, red, res);
    for (int e = threadIdx.x; e < T * TS; e += THREADS) {
      const int t = e / TS, n = (e % TS) / (8 * MB), m = e % (8 * MB);
      if (m >= M || tile0 + t >= n_tiles) continue;
      if constexpr (SWI) {
        if (n < 8) {                          // gate row n, its up row n + 8
          const float gv = round_bf16(res[e]), uv = round_bf16(res[e + 8 * (8 * MB)]);
          y[(long long)m * ldy + (tile0 + t) * 8 + n] = __float2bfloat16_rn(round_bf16(gv / (1.f + __expf(-gv))) * uv);
        }
      } else {
        y[(long long)m * ldy + (tile0 + t) * 16 + n] = __float2bfloat16_rn(res[e]);
      }
    }
  }
}

}  // namespace w4

// w4a16_gemm_mb<MB>_g<GS>_t<T>_u<U>_e<EX>: grid <= ceil(N / 16 / T) blocks of 256 threads (blocks
// stride over the tile groups); MINB blocks per SM (2: at most 128 registers a thread, 3: 80).
#define W4_GEMM(MB, GS, T, U, EX, MINB)                                                                \
  extern "C" __global__ void __launch_bounds__(w4::THREADS, MINB)                                     \
  w4a16_gemm_mb##MB##_g##GS##_t##T##_u##U##_e##EX(const __nv_bfloat16* __restrict__ x, long long ldx, \
      const uint8_t* __restrict__ qw, const uint32_t* __restrict__ so, __nv_bfloat16* __restrict__ y,   \
      long long ldy, int M, int N, int K) {                                                           \
    w4::gemm_body<T, U, GS, MB, EX>(x, ldx, qw, so, y, ldy, M, N, K);                                \
  }
#define W4_GEMM_MB(GS, T, U, EX, MINB) \
  W4_GEMM(1, GS, T, U, EX, MINB) W4_GEMM(2, GS, T, U, EX, MINB) W4_GEMM(4, GS, T, U, EX, MINB)
#define W4_GEMM_ALL(T, U, EX, MINB) \
  W4_GEMM_MB(32, T, U, EX, MINB) W4_GEMM_MB(64, T, U, EX, MINB) W4_GEMM_MB(128, T, U, EX, MINB)
// w4a16_swiglu_mb<MB>_g<GS>_t1_u<U>_e1: the gate|up product with the SwiGLU in its epilogue (W
// [2I, K], Y [M, I]), for the variants default_config picks; grid = ceil(2I / 16) blocks.
#define W4_SWIGLU(MB, GS, U, MINB)                                                                     \
  extern "C" __global__ void __launch_bounds__(w4::THREADS, MINB)                                     \
  w4a16_swiglu_mb##MB##_g##GS##_t1_u##U##_e1(const __nv_bfloat16* __restrict__ x, long long ldx,    \
      const uint8_t* __restrict__ qw, const uint32_t* __restrict__ so, __nv_bfloat16* __restrict__ y,   \
      long long ldy, int M, int N, int K) {                                                           \
    w4::gemm_body<1, U, GS, MB, true, true>(x, ldx, qw, so, y, ldy, M, N, K);                        \
  }
#define W4_SWIGLU_ALL(U, MINB)                                                                         \
  W4_SWIGLU(1, 32, U, MINB) W4_SWIGLU(2, 32, U, MINB) W4_SWIGLU(4, 32, U, MINB)                        \
  W4_SWIGLU(1, 64, U, MINB) W4_SWIGLU(2, 64, U, MINB) W4_SWIGLU(4, 64, U, MINB)                        \
  W4_SWIGLU(1, 128, U, MINB) W4_SWIGLU(2, 128, U, MINB) W4_SWIGLU(4, 128, U, MINB)
W4_SWIGLU_ALL(1, 3)
W4_SWIGLU_ALL(2, 2)
W4_GEMM_ALL(1, 2, 0, 2)
W4_GEMM_ALL(2, 2, 0, 1)
W4_GEMM_ALL(1, 2, 1, 2)
W4_GEMM_ALL(2, 2, 1, 1)
W4_GEMM_ALL(1, 4, 1, 1)
W4_GEMM_ALL(1, 1, 1, 3)

// The dequantized matrix: out [N, K] bf16 (row stride ldo), the very values the GEMV multiplies.
// One thread per code word (8 consecutive k's, one 16-byte store), words in memory order.
template <int GS>
__device__ __forceinline__ void dequant_body(const uint8_t* __restrict__ qw, const uint32_t* __restrict__ so,
                                             __nv_bfloat16* __restrict__ out, long long ldo, int N, int K) {
  constexpr int SW = 128 / GS;
  const long long words = (long long)N * (K / 8);
  const long long tile_words = 16LL * (K / 8);
  for (long long wi = blockIdx.x * (long long)blockDim.x + threadIdx.x; wi < words;
       wi += (long long)gridDim.x * blockDim.x) {
    const long long t = wi / tile_words;
    const int r = (int)(wi % tile_words);       // word of the tile: chunk c, row rr, lane q, part p
    const int c = r >> 8, rr = (r >> 4) & 15, q = (r >> 2) & 3, p = r & 3;
    const long long n = 16 * t + rr;
    const int k = 128 * c + 32 * p + 8 * q;
    const uint32_t word = reinterpret_cast<const uint32_t*>(qw)[wi];
    const uint32_t s = so[t * 16 * (K / GS) + c * 16 * SW + rr * SW + (k % 128) / GS];
    uint4 v;
    v.x = w4::dq_pair(word, 0, s);
    v.y = w4::dq_pair(word, 1, s);
    v.z = w4::dq_pair(word, 2, s);
    v.w = w4::dq_pair(word, 3, s);
    *reinterpret_cast<uint4*>(out + n * ldo + k) = v;
  }
}

#define W4_DEQUANT(GS)                                                                                 \
  extern "C" __global__ void __launch_bounds__(256) w4a16_dequant_g##GS(const uint8_t* __restrict__ qw, \
      const uint32_t* __restrict__ so, __nv_bfloat16* __restrict__ out, long long ldo, int N, int K) { \
    dequant_body<GS>(qw, so, out, ldo, N, K);                                                         \
  }
W4_DEQUANT(32)
W4_DEQUANT(64)
W4_DEQUANT(128)

#ifdef SWIFTSPEC_WITH_NCCL
namespace w4 {

// GEMM + all-reduce over the LSA team, like rowpar::gemm_allreduce_body (cuda/gemm_allreduce.cu):
// a persistent grid, block b computes the same 16-row tiles on every rank, writes its fp32
// partials [tile][16 n][16 m] into its half (parity) of the symmetric window (2 * N * 16 * 4 bytes,
// the DeviceAllReduce's), meets block b of every peer at LSA barrier b, then sums the peers'
// partials in rank order (same bits on every rank) and writes Y. M <= 16 (MB <= 2: the window).
template <int T, int U, int GS, int MB, bool EX>
__device__ __forceinline__ void allreduce_body(const __nv_bfloat16* __restrict__ x, long long ldx,
                                               const uint8_t* __restrict__ qw, const uint32_t* __restrict__ so,
                                               __nv_bfloat16* __restrict__ y, long long ldy, int M, int N, int K,
                                               ncclWindow_t win, const ncclDevComm* __restrict__ dcomm_p,
                                               unsigned int* __restrict__ seq) {
  static_assert(MB <= 2, "the window holds 16 rows");
  constexpr int TS = 128 * MB;
  __shared__ float red[WARPS * T * TS];
  __shared__ float res[T * TS];
  const ncclDevComm& dcomm = *dcomm_p;
  const int tid = threadIdx.x;
  const int n_tiles = N / 16;
  const size_t base = window::store_partials<T, TS, THREADS>(
      win, seq, (size_t)n_tiles * 16 * 16 * sizeof(float), n_tiles, res,
      [&](int tile0) { w4_tiles<T, U, GS, MB, EX>(x, ldx, qw, so, M, K, n_tiles, tile0, red, res); });
  ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), dcomm, ncclTeamLsa(dcomm), dcomm.lsaBarrier, blockIdx.x);
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
  const int nranks = dcomm.lsaSize;
  for (int tile0 = blockIdx.x * T; tile0 < n_tiles; tile0 += gridDim.x * T) {
    for (int e = tid; e < T * TS; e += THREADS) {
      const int t = e / TS, n = (e % TS) / (8 * MB), m = e % (8 * MB);
      if (tile0 + t < n_tiles && m < M)
        y[(long long)m * ldy + (tile0 + t) * 16 + n] =
            __float2bfloat16_rn(window::peer_sum(win, base, nranks, (size_t)tile0 * TS + e));
    }
  }
}

}  // namespace w4

// w4a16_allreduce_mb<MB>_g<GS>_t<T>_u<U>_e<EX>, launched with the DeviceAllReduce's persistent grid.
#define W4_ALLREDUCE(MB, GS, T, U, EX)                                                                 \
  extern "C" __global__ void __launch_bounds__(w4::THREADS, 2)                                        \
  w4a16_allreduce_mb##MB##_g##GS##_t##T##_u##U##_e##EX(const __nv_bfloat16* __restrict__ x, long long ldx, \
      const uint8_t* __restrict__ qw, const uint32_t* __restrict__ so, __nv_bfloat16* __restrict__ y,   \
      long long ldy, int M, int N, int K, ncclWindow_t win, const ncclDevComm* __restrict__ dcomm,     \
      unsigned int* __restrict__ seq) {                                                               \
    w4::allreduce_body<T, U, GS, MB, EX>(x, ldx, qw, so, y, ldy, M, N, K, win, dcomm, seq);          \
  }
#define W4_ALLREDUCE_MB(GS, EX) W4_ALLREDUCE(1, GS, 1, 2, EX) W4_ALLREDUCE(2, GS, 1, 2, EX)
W4_ALLREDUCE_MB(32, 0)
W4_ALLREDUCE_MB(64, 0)
W4_ALLREDUCE_MB(128, 0)
W4_ALLREDUCE_MB(32, 1)
W4_ALLREDUCE_MB(64, 1)
W4_ALLREDUCE_MB(128, 1)
// U = 1 (the default variant for wide products: the same bits as gemm at TP = 1)
W4_ALLREDUCE(1, 32, 1, 1, 1) W4_ALLREDUCE(2, 32, 1, 1, 1)
W4_ALLREDUCE(1, 64, 1, 1, 1) W4_ALLREDUCE(2, 64, 1, 1, 1)
W4_ALLREDUCE(1, 128, 1, 1, 1) W4_ALLREDUCE(2, 128, 1, 1, 1)
#endif
