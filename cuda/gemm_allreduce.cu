// Row-parallel projection for decode-sized batches (M <= 16 rows): Y[M,N] = X[M,K] @ W[N,K]^T,
// bf16 in, fp32 accumulate, bf16 out; and the same GEMM fused with the tensor-parallel
// all-reduce through NCCL's device API (NCCL >= 2.28: ncclDevComm, symmetric LSA windows,
// ncclLsaBarrierSession, ncclGetLsaPointer), so the o_proj / down_proj of one layer plus its
// all-reduce is one kernel.
//
// Layout: X [M, K] row-major (row stride ldx elements), W [N, K] row-major (nn.Linear weight,
// contiguous), Y [M, N] row-major (row stride ldy). K % 8 == 0, N % 8 == 0, 16-byte aligned rows.
//
// GEMV on tensor cores. One block (8 warps) owns T consecutive n-tiles (8 rows of W each) and
// splits K over its warps (chunk c of KC = 32 U k's goes to warp c % 8); at the end the 8
// partial 16x8 tiles of each n-tile are summed in shared memory. Each lane streams 16-byte
// vectors of W with ld.global.nc.L1::no_allocate (optionally with the L2::256B prefetch hint),
// T x U vectors per chunk, and with PIPE the next chunk's loads are issued before the current
// chunk's MMAs (register double buffering: up to 2 T U loads in flight per lane). mma.sync
// m16n8k16 is fed with a *permuted* k order: lane (g = lane/4, q = lane%4) holds
// W[n0+g][k0+8q .. k0+8q+7] and X rows g, g+8 at the same 8 k's; MMA 0 takes k0+8q+{0,1,2,3},
// MMA 1 k0+8q+{4,5,6,7}. A reduction is order-free, and the permutation depends only on q, so A
// and B agree: one 16-byte load per lane per operand row (no shuffles, no smem staging). X
// (<= 448 KiB) is read through L1/L2 when a chunk is consumed, once per chunk for all T tiles.
// The summation order of a tile depends on U only, so variants with the same U (and the fused
// all-reduce at TP = 1) give the same bits. Programmatic dependent launch (kernels.py pdl=True):
// the kernel lets the next one launch at once (griddepcontrol.launch_dependents) and waits for
// the previous one (griddepcontrol.wait) only after its first W chunk is in flight.
//
// Floor: the W bytes. Llama-3-8B o_proj 4096x4096: 32 MiB -> 8.0 us, down_proj 4096x14336:
// 112 MiB -> 28.1 us at the 4.18 TB/s copy bandwidth measured on the H200. FLOPs (2*M*N*K,
// <= 1.9 GFLOP at M = 16) are nothing for mma.sync; on CUDA cores the bf16->fp32 conversions
// plus M FMAs per weight would make M = 8..16 compute bound, hence the tensor cores in a GEMV.
// Measured (H200, CUDA graph, weights streamed from HBM, benchmarks/gpu_kernels.sh, two runs on
// 2026-11-29, copy bandwidth 4.17 / 4.07 TB/s), default T=2 U=4 PF=256 PIPE: down_proj 30.9-31.5
// us at M = 1 (91-92 % of copy bandwidth; previous kernel 37.1-37.7, cuBLAS 32.3-33.8) and
// 31.5-31.9 us at M = 8 (90-91 %; previous 34.6-35.6): goal >= 85 % met. o_proj 11.1 us at
// M = 1 (73-75 %; previous 11.7-11.9, cuBLAS 13.6-13.7), 11.3-12.1 us at M = 8 (68-72 %): NOT
// met. Back-to-back calls launched with PDL: o_proj 9.6 us at M = 1 (84-86 %), 9.9-10.3 at M = 8
// (80-81 %); down_proj 29.7-30.9 (93-95 %). M = 16 works (o_proj 62-63 %, down_proj 78-79 %).
// Limit (ncu, o_proj M = 8, 11.8 us): DRAM 2.93 TB/s while the SMs are active 80 % of the
// elapsed cycles: the launch, the first loads' latency and the tail are ~2 us of a 9 us stream,
// which only overlapping the neighbouring kernels removes (PDL, or fusing o_proj into the
// attention kernel's tail).

// Fused all-reduce (TP > 1, all ranks in one LSA team, i.e. one NVLink domain): a persistent
// grid of `gridDim.x <= lsaBarrierCount` blocks, every block resident (grid <= SMs x occupancy).
// Block b computes the same n-tiles on every rank (tile groups b, b + grid, ... of T tiles,
// through the same gemv_tiles as the plain kernel, launched without PDL), writes its fp32
// partials into the symmetric window (half `parity` of it), meets block b of every peer at LSA
// barrier b (release/acquire at system scope), then sums the peers' partials of its own tiles
// in rank order (identical bits on every rank) and writes Y. The window is double-buffered by
// a per-block call counter kept on the device (`seq`), so a rank that runs ahead into the next
// call writes the other half while peers may still read this one; the next call's barrier
// keeps ranks from getting two calls apart. Everything is device state: CUDA-graph safe.

#include <cuda_bf16.h>
#include <stdint.h>

#include "mma_bf16.cuh"

#ifdef SWIFTSPEC_WITH_NCCL
#include <nccl.h>
#include <nccl_device.h>

#include "nccl_window.cuh"
#endif

namespace rowpar {

constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;

// 16-byte streaming load of W: not kept in L1; PF = 256 adds the L2::256B prefetch hint (the L2
// fetches the whole 256-byte block, which the same warp reads next).
template <int PF>
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  if constexpr (PF == 256) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  }
  return r;
}


// One warp's chunk of KC = 32 U k's of W: U 16-byte vectors per lane of each of the T n-tiles'
// rows (X, read through L1/L2, is loaded when the chunk is consumed).
template <int T, int U>
struct Chunk {
  uint4 w[T][U];
};

// The end of a GEMV block: every warp's partial tiles into red [WARPS][T * 128] (shared), then
// their sum in warp order into res [T * 128]. cc[j][t] of warp w holds (row g, col 2q),
// (g, 2q+1), (g+8, 2q), (g+8, 2q+1) of tile t for warp w + NW j of the 8-warp schedule.
template <int T, int V, int NW>
__device__ __forceinline__ void store_partials(float* red, const float (&cc)[V][T][4], int warp, int lane) {
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int j = 0; j < V; ++j)
#pragma unroll
    for (int t = 0; t < T; ++t) {
      float* r = red + (warp + NW * j) * (T * 128) + t * 128;
      r[g * 8 + 2 * q] = cc[j][t][0];
      r[g * 8 + 2 * q + 1] = cc[j][t][1];
      r[(g + 8) * 8 + 2 * q] = cc[j][t][2];
      r[(g + 8) * 8 + 2 * q + 1] = cc[j][t][3];
    }
}

template <int T>
__device__ __forceinline__ void sum_partials(const float* red, float* res, int tid, int nthreads) {
  for (int e = tid; e < T * 128; e += nthreads) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) s += red[i * (T * 128) + e];
    res[e] = s;
  }
}

// Partial Y tiles [16 x 8] (rows m < M valid) of the T n-tiles tile0 .. tile0 + T - 1 (those
// < n_tiles) over all of K, summed over the block's warps, into res[t * 128 + m * 8 + n]
// (shared). red: shared scratch [WARPS][T * 128]. Must be called by all THREADS threads; res is
// valid after the call (which ends with a barrier) until the next call. With pair_off != 0
// (T == 2) the two tiles are tile0 and tile0 + pair_off instead (the gate and up tiles of the
// same 8 columns in a fused gate|up weight).
//
// Warp w takes the k-chunks w, w + WARPS, ... (KC k's each); the loads of chunk i + 1 are issued
// before the MMAs of chunk i (register double buffering, PIPE), so each lane keeps up to
// 2 * T * U 16-byte W loads in flight. The fp32 summation order of a tile depends on U only
// (not on T, PIPE or PF), so every variant with the same U gives the same bits.
// NW < WARPS (a block of NW warps, 32 NW threads): warp w plays the WARPS / NW warps w, w + NW,
// ... of the 8-warp schedule (chunk w + NW i into accumulator set i % (WARPS / NW)), so the
// partial tiles and their sum, hence the bits, are the 8-warp block's; with fewer threads per
// block, more blocks fit per SM (the QKV GEMV's one-wave variant).
template <int T, int U, int PF, bool PIPE, bool M16, int NW = WARPS>
__device__ __forceinline__ void gemv_tiles(const __nv_bfloat16* __restrict__ x, long long ldx,
                                           const __nv_bfloat16* __restrict__ w, int M, int K, int n_tiles,
                                           int tile0, float* red, float* res, int pair_off = 0) {
  constexpr int KC = 32 * U;
  constexpr int V = WARPS / NW;             // accumulator sets (8-warp schedule warps) per warp
  static_assert(NW * V == WARPS && (V == 1 || V == 2), "NW = 8 or 4");
  static_assert(!(V == 2) || PIPE, "NW = 4 needs the double-buffered loop (chunk parity = set)");
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, q = lane & 3;
  const __nv_bfloat16* wrow[T];
  bool tv[T];
#pragma unroll
  for (int t = 0; t < T; ++t) {
    const int tile = pair_off ? tile0 + t * pair_off : tile0 + t;   // pair_off: T == 2, SwiGLU pairs
    tv[t] = tile < n_tiles;
    wrow[t] = w + (long long)((tv[t] ? tile : tile0) * 8 + g) * K + 8 * q;
  }
  const bool hasA = g < M;                  // X row g
  const bool hasB = M16 && (g + 8 < M);     // X row g + 8
  const __nv_bfloat16* xa = x + (long long)g * ldx + 8 * q;
  const __nv_bfloat16* xb = x + (long long)(g + 8) * ldx + 8 * q;

  auto load = [&](Chunk<T, U>& ch, int k0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + 32 * u;              // + 8q inside the pointers
      const bool ok = k + 8 * q < K;
#pragma unroll
      for (int t = 0; t < T; ++t)
        ch.w[t][u] = (ok && tv[t]) ? ld_stream<PF>(wrow[t] + k) : make_uint4(0, 0, 0, 0);
    }
  };
  float cc[V][T][4];
#pragma unroll
  for (int j = 0; j < V; ++j)
#pragma unroll
    for (int t = 0; t < T; ++t) cc[j][t][0] = cc[j][t][1] = cc[j][t][2] = cc[j][t][3] = 0.f;
  auto compute = [&](const Chunk<T, U>& ch, int k0, float (&c)[T][4]) {
    uint4 a[U], b[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + 32 * u;
      const bool ok = k + 8 * q < K;
      a[u] = (ok && hasA) ? __ldg(reinterpret_cast<const uint4*>(xa + k)) : make_uint4(0, 0, 0, 0);
      b[u] = (M16 && ok && hasB) ? __ldg(reinterpret_cast<const uint4*>(xb + k)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int t = 0; t < T; ++t) {
        mma_bf16(c[t], a[u].x, b[u].x, a[u].y, b[u].y, ch.w[t][u].x, ch.w[t][u].y);
        mma_bf16(c[t], a[u].z, b[u].z, a[u].w, b[u].w, ch.w[t][u].z, ch.w[t][u].w);
      }
    }
  };

  constexpr int STEP = NW * KC;
  int k0 = warp * KC;
  if constexpr (PIPE) {
    // even chunks of this warp (buffer c0) into set 0, odd ones (c1) into set V - 1
    Chunk<T, U> c0, c1;
    if (k0 < K) load(c0, k0);
    // Programmatic dependent launch: the first W chunk (a weight, not written by the previous
    // kernel) is in flight before waiting for the previous grid, whose output X may be; a no-op
    // for launches without the PDL attribute. (Two chunks before the wait, with the loop below
    // reordered to keep the same summation order, measured 5-25 % slower on every shape in the
    // PDL chain, benchmarks/bench_step_breakdown.py, 2026-11-29.)
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    while (k0 < K) {
      load(c1, k0 + STEP);                    // past K: predicated off, zeros
      compute(c0, k0, cc[0]);
      k0 += STEP;
      if (k0 >= K) break;
      load(c0, k0 + STEP);
      compute(c1, k0, cc[V - 1]);
      k0 += STEP;
    }
  } else {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    for (; k0 < K; k0 += STEP) {
      Chunk<T, U> c0;
      load(c0, k0);
      compute(c0, k0, cc[0]);
    }
  }
  store_partials<T, V, NW>(red, cc, warp, lane);
  __syncthreads();
  sum_partials<T>(red, res, tid, 32 * NW);
  __syncthreads();   // res complete; red free again
}

// Y rows m < M of the T tiles tile0 .. tile0 + T - 1 (those < n_tiles) from res (shared, as
// gemv_tiles leaves it): thread e writes element (tile t, row m, column n).
template <int T>
__device__ __forceinline__ void store_tiles(const float* res, __nv_bfloat16* __restrict__ y, long long ldy,
                                            int M, int n_tiles, int tile0, int tid, int nthreads) {
  for (int e = tid; e < T * 128; e += nthreads) {
    const int t = e / 128, m = (e % 128) >> 3, n = e & 7;
    if (m < M && tile0 + t < n_tiles) y[(long long)m * ldy + (tile0 + t) * 8 + n] = __float2bfloat16_rn(res[e]);
  }
}

template <int T, int U, int PF, bool PIPE, bool M16>
__device__ __forceinline__ void gemm_rowparallel_body(const __nv_bfloat16* __restrict__ x, long long ldx,
                                                      const __nv_bfloat16* __restrict__ w,
                                                      __nv_bfloat16* __restrict__ y, long long ldy,
                                                      int M, int N, int K) {
  __shared__ float red[WARPS * T * 128];
  __shared__ float res[T * 128];
  // PDL: the next kernel in the stream may start launching now (its blocks take SM slots as
  // ours retire, and it waits for our completion before touching our outputs).
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int n_tiles = N / 8;
  for (int tile0 = blockIdx.x * T; tile0 < n_tiles; tile0 += gridDim.x * T) {
    gemv_tiles<T, U, PF, PIPE, M16>(x, ldx, w, M, K, n_tiles, tile0, red, res);
    store_tiles<T>(res, y, ldy, M, n_tiles, tile0, threadIdx.x, THREADS);
  }
}

// SwiGLU epilogue: gate tile res[0:128], up tile res[128:256] (shared, as gemv_tiles leaves
// them with pair_off) -> Y[m, tile0*8 + n] = bf16(bf16(silu(bf16 g)) * bf16 u), silu_mul's roundings.
__device__ __forceinline__ void swiglu_store(const float* res, __nv_bfloat16* __restrict__ y, long long ldy,
                                             int M, int tile0, int tid, int nthreads) {
  for (int e = tid; e < 128; e += nthreads) {
    const int m = e >> 3, n = e & 7;
    if (m < M) {
      const float gt = __bfloat162float(__float2bfloat16_rn(res[e]));
      const float up = __bfloat162float(__float2bfloat16_rn(res[128 + e]));
      const float s = __bfloat162float(__float2bfloat16_rn(gt / (1.f + __expf(-gt))));
      y[(long long)m * ldy + tile0 * 8 + n] = __float2bfloat16_rn(s * up);
    }
  }
}

// Gate|up projection with the SwiGLU in its epilogue: Y[M, I] = bf16(bf16(silu(G)) * U) where
// G = bf16(X Wg^T), U = bf16(X Wu^T) and W = [Wg; Wu] is the fused [2I, K] gate|up weight (I % 8
// == 0). Block b computes the gate tile b and the up tile b + I/8 (8 columns each) with the same
// gemv_tiles, so G and U are bit for bit the plain kernel's outputs (same U), and the epilogue
// repeats fused_ops.cu's silu_mul roundings: the result equals silu_mul(gemm_rowparallel(X, W)).
// Saves the silu_mul launch and the [M, 2I] round trip. T must be 2 (one gate + one up tile).
template <int T, int U, int PF, bool PIPE, bool M16>
__device__ __forceinline__ void gemm_swiglu_body(const __nv_bfloat16* __restrict__ x, long long ldx,
                                                 const __nv_bfloat16* __restrict__ w,
                                                 __nv_bfloat16* __restrict__ y, long long ldy,
                                                 int M, int I, int K) {
  static_assert(T == 2, "one gate tile and one up tile per block");
  __shared__ float red[WARPS * T * 128];
  __shared__ float res[T * 128];
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");   // PDL, as above
  const int half = I / 8;
  for (int tile0 = blockIdx.x; tile0 < half; tile0 += gridDim.x) {
    gemv_tiles<T, U, PF, PIPE, M16>(x, ldx, w, M, K, 2 * half, tile0, red, res, half);
    swiglu_store(res, y, ldy, M, tile0, threadIdx.x, THREADS);
  }
}

// QKV projection with RoPE and the KV-cache write in its epilogue: the math of fused_ops.cu's
// rope_kv_write applied to the bf16 outputs of the plain kernel (same U, so the same bits), i.e.
// the result equals rope_kv_write(gemm_rowparallel(X, W)) and saves that launch.
//   W [(nh + 2 nkv) D, K]: q heads, k heads, v heads (nn.Linear layout, no bias).
//   qkv [M, (nh + 2 nkv) D] (row stride ldq): only the q part is written (rotated); the k and v
//     parts are left as they were (they go to the cache only).
//   positions, slots [M] int64; cos_t, sin_t [rope_len, D] (the model's rotate-half tables);
//   k_cache, v_cache [max_slots, nkv, D] (slot stride kv_stride, head stride D); a slot outside
//   [0, max_slots) is not written, a position is clamped to the tables.
// Block b < (nh + nkv) * D/16 takes the rotation pair of tiles (j, j + D/16) of one q/k head (so
// columns j and j + D/2 meet in its epilogue), the others two consecutive v tiles.
// The QKV epilogue: block b of the grid (see above) with its two tiles in res (shared) -> the
// rotated q into qkv, the rotated k and the v into the caches. The tile0 of block b:
__device__ __forceinline__ int qkv_rope_tile0(int b, int nh, int nkv, int D) {
  const int hp = D / 16, tpd = D / 8, n_rot = (nh + nkv) * hp;
  if (b < n_rot) {
    const int head = b / hp;
    return head * tpd + (b - head * hp);
  }
  return (nh + nkv) * tpd + 2 * (b - n_rot);
}

__device__ __forceinline__ void qkv_rope_store(
    const float* res, int b, int tile0, __nv_bfloat16* __restrict__ qkv, long long ldq, int M,
    const long long* __restrict__ positions, const long long* __restrict__ slots,
    const __nv_bfloat16* __restrict__ cos_t, const __nv_bfloat16* __restrict__ sin_t, int rope_len,
    __nv_bfloat16* __restrict__ k_cache, __nv_bfloat16* __restrict__ v_cache, long long kv_stride,
    int max_slots, int nh, int nkv, int D, int tid, int nthreads) {
  const int half = D / 2, hp = half / 8, tpd = D / 8;   // rotation pairs / tiles per head
  const int n_rot = (nh + nkv) * hp;
  const bool rot = b < n_rot;
  const int head = rot ? b / hp : 0;
  auto bf = [](float v) { return __bfloat162float(__float2bfloat16_rn(v)); };
  for (int e = tid; e < 128; e += nthreads) {
    const int m = e >> 3, n = e & 7;
    if (m >= M) continue;
    const long long slot = slots[m];
    const bool slot_ok = slot >= 0 && slot < max_slots;
    const float xa = bf(res[e]), xb = bf(res[128 + e]);
    if (rot) {
      const int j = (tile0 - head * tpd) * 8 + n;             // < half
      long long p = positions[m];
      p = p < 0 ? 0 : (p >= rope_len ? rope_len - 1 : p);
      const float cl = __bfloat162float(cos_t[p * D + j]), ch = __bfloat162float(cos_t[p * D + half + j]);
      const float sl = __bfloat162float(sin_t[p * D + j]), sh = __bfloat162float(sin_t[p * D + half + j]);
      const float yl = bf(xa * cl) + xb * sl;                 // as rope_kv_body (fused_ops.cu)
      const float yh = bf(xb * ch) + xa * sh;
      __nv_bfloat16* dst;
      if (head < nh) {
        dst = qkv + (long long)m * ldq + head * D;
      } else {
        if (!slot_ok) continue;
        dst = k_cache + slot * kv_stride + (head - nh) * D;
      }
      dst[j] = __float2bfloat16_rn(yl);
      dst[half + j] = __float2bfloat16_rn(yh);
    } else {
      if (!slot_ok) continue;
      const int col = tile0 * 8 - (nh + nkv) * D;           // v column = v head * D + d
      __nv_bfloat16* dst = v_cache + slot * kv_stride + col + n;
      dst[0] = __float2bfloat16_rn(xa);
      dst[8] = __float2bfloat16_rn(xb);
    }
  }
}

template <int U, int PF, bool PIPE, bool M16, int NW = WARPS>
__device__ __forceinline__ void gemm_qkv_rope_body(
    const __nv_bfloat16* __restrict__ x, long long ldx, const __nv_bfloat16* __restrict__ w,
    __nv_bfloat16* __restrict__ qkv, long long ldq, int M, int K,
    const long long* __restrict__ positions, const long long* __restrict__ slots,
    const __nv_bfloat16* __restrict__ cos_t, const __nv_bfloat16* __restrict__ sin_t, int rope_len,
    __nv_bfloat16* __restrict__ k_cache, __nv_bfloat16* __restrict__ v_cache, long long kv_stride,
    int max_slots, int nh, int nkv, int D) {
  __shared__ float red[WARPS * 2 * 128];
  __shared__ float res[2 * 128];
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");   // PDL, as above
  const int hp = D / 16, tpd = D / 8;
  const int n_rot = (nh + nkv) * hp;
  const int n_blocks = n_rot + nkv * D / 16;
  const int n_tiles = (nh + 2 * nkv) * tpd;
  for (int b = blockIdx.x; b < n_blocks; b += gridDim.x) {
    const int tile0 = qkv_rope_tile0(b, nh, nkv, D);
    gemv_tiles<2, U, PF, PIPE, M16, NW>(x, ldx, w, M, K, n_tiles, tile0, red, res, b < n_rot ? hp : 1);
    qkv_rope_store(res, b, tile0, qkv, ldq, M, positions, slots, cos_t, sin_t, rope_len, k_cache, v_cache,
                   kv_stride, max_slots, nh, nkv, D, threadIdx.x, 32 * NW);
  }
}

}  // namespace rowpar

// Plain row-parallel GEMM: gemm_rowparallel_m{8,16}_t<T>_u<U>_p<PF>_s<PIPE>, grid ceil(N / 8 / T)
// blocks of THREADS (any grid works: blocks stride over the tile groups).
#define ROWPAR_KERNEL(T, U, PF, PIPE, MINB)                                                            \
  extern "C" __global__ void __launch_bounds__(rowpar::THREADS, MINB)                                 \
  gemm_rowparallel_m8_t##T##_u##U##_p##PF##_s##PIPE(const __nv_bfloat16* __restrict__ x, long long ldx, \
      const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ y, long long ldy, int M, int N, int K) { \
    rowpar::gemm_rowparallel_body<T, U, PF, PIPE, false>(x, ldx, w, y, ldy, M, N, K);               \
  }                                                                                                   \
  extern "C" __global__ void __launch_bounds__(rowpar::THREADS, MINB)                                 \
  gemm_rowparallel_m16_t##T##_u##U##_p##PF##_s##PIPE(const __nv_bfloat16* __restrict__ x, long long ldx, \
      const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ y, long long ldy, int M, int N, int K) { \
    rowpar::gemm_rowparallel_body<T, U, PF, PIPE, true>(x, ldx, w, y, ldy, M, N, K);                \
  }

ROWPAR_KERNEL(1, 4, 0, 0, 4)      // the previous kernel's schedule (baseline in the sweep)
ROWPAR_KERNEL(1, 4, 256, 1, 2)
ROWPAR_KERNEL(2, 4, 256, 1, 2)
ROWPAR_KERNEL(2, 4, 0, 1, 2)
ROWPAR_KERNEL(4, 4, 256, 1, 1)
ROWPAR_KERNEL(4, 2, 256, 1, 2)
ROWPAR_KERNEL(2, 8, 256, 0, 2)
ROWPAR_KERNEL(1, 8, 256, 1, 2)

// Gate|up GEMM + SwiGLU: gemm_swiglu_m{8,16}_t2_u<U>_p<PF>_s<PIPE>, grid <= I / 8 blocks.
// MS = the kernel name's m8 / m16, M16 = its rows-8..15 flag.
#define SWIGLU_KERNEL1(MS, M16, U, PF, PIPE, MINB)                                                     \
  extern "C" __global__ void __launch_bounds__(rowpar::THREADS, MINB)                                 \
  gemm_swiglu_##MS##_t2_u##U##_p##PF##_s##PIPE(const __nv_bfloat16* __restrict__ x, long long ldx,    \
      const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ y, long long ldy, int M, int I, int K) { \
    rowpar::gemm_swiglu_body<2, U, PF, PIPE, M16>(x, ldx, w, y, ldy, M, I, K);                       \
  }
#define SWIGLU_KERNEL(U, PF, PIPE, MINB) \
  SWIGLU_KERNEL1(m8, false, U, PF, PIPE, MINB) SWIGLU_KERNEL1(m16, true, U, PF, PIPE, MINB)
SWIGLU_KERNEL(4, 256, 1, 2)

// QKV GEMM + RoPE + KV write: gemm_qkv_rope_m{8,16}_u<U>_p<PF>_s<PIPE>.
#define QKV_ROPE_PARAMS                                                                                \
    const __nv_bfloat16* __restrict__ x, long long ldx, const __nv_bfloat16* __restrict__ w,         \
    __nv_bfloat16* __restrict__ qkv, long long ldq, int M, int K,                                    \
    const long long* __restrict__ positions, const long long* __restrict__ slots,                    \
    const __nv_bfloat16* __restrict__ cos_t, const __nv_bfloat16* __restrict__ sin_t, int rope_len,   \
    __nv_bfloat16* __restrict__ k_cache, __nv_bfloat16* __restrict__ v_cache, long long kv_stride,   \
    int max_slots, int nh, int nkv, int D
#define QKV_ROPE_ARGS \
    x, ldx, w, qkv, ldq, M, K, positions, slots, cos_t, sin_t, rope_len, k_cache, v_cache, kv_stride, max_slots, nh, nkv, D
#define QKV_ROPE_KERNEL1(MS, M16, U, PF, PIPE, MINB)                                                   \
  extern "C" __global__ void __launch_bounds__(rowpar::THREADS, MINB)                                 \
  gemm_qkv_rope_##MS##_u##U##_p##PF##_s##PIPE(QKV_ROPE_PARAMS) {                                     \
    rowpar::gemm_qkv_rope_body<U, PF, PIPE, M16>(QKV_ROPE_ARGS);                                     \
  }
#define QKV_ROPE_KERNEL(U, PF, PIPE, MINB) \
  QKV_ROPE_KERNEL1(m8, false, U, PF, PIPE, MINB) QKV_ROPE_KERNEL1(m16, true, U, PF, PIPE, MINB)
QKV_ROPE_KERNEL(4, 256, 1, 2)

// The same with 4 warps per block (3 blocks per SM: the Llama-3-8B QKV GEMV's 384 blocks in one
// wave of 396 on 132 SMs instead of 1.45 waves of 264), same bits: gemm_qkv_rope_<m8|m16>_u4_p256_s1_w4.
#define QKV_ROPE_W4_KERNEL1(MS, M16)                                                                   \
  extern "C" __global__ void __launch_bounds__(128, 3)                                                \
  gemm_qkv_rope_##MS##_u4_p256_s1_w4(QKV_ROPE_PARAMS) {                                              \
    rowpar::gemm_qkv_rope_body<4, 256, true, M16, 4>(QKV_ROPE_ARGS);                                 \
  }
QKV_ROPE_W4_KERNEL1(m8, false)
QKV_ROPE_W4_KERNEL1(m16, true)

#ifdef SWIFTSPEC_WITH_NCCL
namespace rowpar {

// Window layout (fp32): [2 parities][n_tiles][16 rows][8 cols]; 1 KiB * N / 8 * ... =
// 2 * N * 16 * 4 bytes in all (512 KiB for N = 4096). Same offsets on every rank.
template <int T, int U, int PF, bool PIPE, bool M16>
__device__ __forceinline__ void gemm_allreduce_body(const __nv_bfloat16* __restrict__ x, long long ldx,
                                                    const __nv_bfloat16* __restrict__ w,
                                                    __nv_bfloat16* __restrict__ y, long long ldy,
                                                    int M, int N, int K,
                                                    ncclWindow_t win, const ncclDevComm* __restrict__ dcomm_p,
                                                    unsigned int* __restrict__ seq) {
  __shared__ float red[WARPS * T * 128];
  __shared__ float res[T * 128];
  const ncclDevComm& dcomm = *dcomm_p;
  const int tid = threadIdx.x;
  const int n_tiles = N / 8;

  // 1. Partials of this block's tile groups (tiles b*T .. b*T + T - 1, then + gridDim.x*T, ...)
  //    into the local half of the window; same per-tile summation order as gemm_rowparallel's
  //    variant of the same U.
  const size_t base = window::store_partials<T, 128, THREADS>(
      win, seq, (size_t)n_tiles * 16 * 8 * sizeof(float), n_tiles, res,
      [&](int tile0) { gemv_tiles<T, U, PF, PIPE, M16>(x, ldx, w, M, K, n_tiles, tile0, red, res); });

  // 2. Meet block blockIdx.x of every rank: its partials of the same tiles are then visible.
  ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), dcomm, ncclTeamLsa(dcomm), dcomm.lsaBarrier, blockIdx.x);
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);

  // 3. Sum the peers' partials of this block's tiles in rank order (same bits on every rank).
  const int nranks = dcomm.lsaSize;
  for (int tile0 = blockIdx.x * T; tile0 < n_tiles; tile0 += gridDim.x * T) {
    for (int e = tid; e < T * 128; e += THREADS) {
      const int tile = tile0 + e / 128, m = (e % 128) >> 3, n = e & 7;
      if (tile < n_tiles && m < M)
        y[(long long)m * ldy + tile * 8 + n] =
            __float2bfloat16_rn(window::peer_sum(win, base, nranks, (size_t)tile0 * 128 + e));
    }
  }
  // The session's destructor syncs the CTA and stores the barrier epoch.
}

}  // namespace rowpar

// GEMM + all-reduce: gemm_allreduce_m{8,16}_t<T>_u<U>_p<PF>_s<PIPE>, launched with the
// persistent grid of the DeviceAllReduce (every block resident: 2 per SM at most).
#define ALLREDUCE_KERNEL(T, U, PF, PIPE)                                                               \
  extern "C" __global__ void __launch_bounds__(rowpar::THREADS, 2)                                    \
  gemm_allreduce_m8_t##T##_u##U##_p##PF##_s##PIPE(const __nv_bfloat16* __restrict__ x, long long ldx,  \
      const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ y, long long ldy, int M, int N, int K, \
      ncclWindow_t win, const ncclDevComm* __restrict__ dcomm, unsigned int* __restrict__ seq) {     \
    rowpar::gemm_allreduce_body<T, U, PF, PIPE, false>(x, ldx, w, y, ldy, M, N, K, win, dcomm, seq);  \
  }                                                                                                   \
  extern "C" __global__ void __launch_bounds__(rowpar::THREADS, 2)                                    \
  gemm_allreduce_m16_t##T##_u##U##_p##PF##_s##PIPE(const __nv_bfloat16* __restrict__ x, long long ldx, \
      const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ y, long long ldy, int M, int N, int K, \
      ncclWindow_t win, const ncclDevComm* __restrict__ dcomm, unsigned int* __restrict__ seq) {     \
    rowpar::gemm_allreduce_body<T, U, PF, PIPE, true>(x, ldx, w, y, ldy, M, N, K, win, dcomm, seq);   \
  }

ALLREDUCE_KERNEL(1, 4, 0, 0)
ALLREDUCE_KERNEL(2, 4, 256, 1)
ALLREDUCE_KERNEL(1, 8, 256, 1)

// sizeof(ncclDevComm) as compiled here, for the host shim to check its copy against.
extern "C" __global__ void nccl_devcomm_sizeof(unsigned long long* out) { out[0] = sizeof(ncclDevComm); }
#endif
