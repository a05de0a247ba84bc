// Row-parallel projection for decode-sized batches (M <= 16 rows): Y[M,N] = X[M,K] @ W[N,K]^T,
// bf16 in, fp32 accumulate, bf16 out; and the same GEMM fused with the tensor-parallel
// all-reduce through NCCL's device API (NCCL >= 2.28: ncclDevComm, symmetric LSA windows,
// ncclLsaBarrierSession, ncclGetLsaPointer), so the o_proj / down_proj of one layer plus its
// all-reduce is one kernel.
//
// Layout: X [M, K] row-major (row stride ldx elements), W [N, K] row-major (nn.Linear weight,
// contiguous), Y [M, N] row-major (row stride ldy). K % 8 == 0, N % 8 == 0, 16-byte aligned rows.
//
// GEMV on tensor cores. One block (8 warps) owns one n-tile = 8 rows of W and splits K over its
// warps (chunk c of 128 k goes to warp c % 8); at the end the 8 partial 16x8 tiles are summed in
// shared memory. Each lane streams 16-byte vectors of W with ld.global.nc.L1::no_allocate
// (4 in flight per lane, 64 KiB per SM with 4 blocks resident), and feeds mma.sync m16n8k16 with
// a *permuted* k order: lane (g = lane/4, q = lane%4) holds W[n0+g][k0+8q .. k0+8q+7] and X rows
// g, g+8 at the same 8 k's; MMA 0 takes k0+8q+{0,1,2,3}, MMA 1 k0+8q+{4,5,6,7}. A reduction is
// order-free, and the permutation depends only on q, so A and B agree: this turns the PTX
// fragment layout into one 16-byte load per lane per operand row (no shuffles, no smem staging).
// X (<= 448 KiB) is read through L1/L2 by every block; W bytes dominate.
//
// Floor: the W bytes. Llama-3-8B o_proj 4096x4096: 32 MiB -> 8.0 us, down_proj 4096x14336:
// 112 MiB -> 28.1 us at the 4.18 TB/s copy bandwidth measured on the H200. FLOPs (2*M*N*K,
// <= 1.9 GFLOP at M = 16) are nothing for mma.sync; on CUDA cores the bf16->fp32 conversions
// plus M FMAs per weight would make M = 8..16 compute bound, hence the tensor cores in a GEMV.
// Measured (H200, CUDA graph, weights streamed from HBM, 2026-11-29): o_proj 12.1 us at M = 1
// and 8 (66 % of copy bandwidth; cuBLAS 13.6), down_proj 36.2 / 34.4 us (78 / 82 %; cuBLAS
// 32.9 / 33.5). Goal >= 85 %: NOT met. Limit (ncu, o_proj M = 8): SMs busy 77 % of the elapsed
// cycles (ramp-up and tail of a 12 us kernel), 30 cycles between issues per warp at 47 %
// occupancy, i.e. too few bytes in flight per SM (4 x 16 B per lane, 64 registers); next:
// deeper per-warp prefetch (software-pipelined W loads) with fewer, fatter blocks.
//
// Fused all-reduce (TP > 1, all ranks in one LSA team, i.e. one NVLink domain): a persistent
// grid of `gridDim.x <= lsaBarrierCount` blocks, every block resident (grid <= SMs x occupancy).
// Block b computes the same n-tiles on every rank (tiles b, b + grid, ...), writes its fp32
// partials into the symmetric window (half `parity` of it), meets block b of every peer at LSA
// barrier b (release/acquire at system scope), then sums the peers' partials of its own tiles
// in rank order (identical bits on every rank) and writes Y. The window is double-buffered by
// a per-block call counter kept on the device (`seq`), so a rank that runs ahead into the next
// call writes the other half while peers may still read this one; the next call's barrier
// keeps ranks from getting two calls apart. Everything is device state: CUDA-graph safe.

#include <cuda_bf16.h>
#include <stdint.h>

#ifdef SWIFTSPEC_WITH_NCCL
#include <nccl.h>
#include <nccl_device.h>
#endif

namespace rowpar {

constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int U = 4;              // 16-byte W vectors in flight per lane per chunk
constexpr int KC = 32 * U;        // k per warp chunk (4 lanes x 8 elements x U)

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ void mma_bf16(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Partial Y tile [16 x 8] (rows m < M valid) of n-tile `tile` over all of K, summed over the
// block's warps. Returns, for threads tid < 128, the element (m = tid / 8, n = tid % 8); the
// full tile is left in red[0][*] (shared, [16][8] fp32). Must be called by all THREADS threads.
template <bool M16>
__device__ __forceinline__ float gemv_tile(const __nv_bfloat16* __restrict__ x, long long ldx,
                                           const __nv_bfloat16* __restrict__ w, int M, int K, int tile,
                                           float (*red)[16 * 8]) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, q = lane & 3;
  const __nv_bfloat16* wrow = w + (long long)(tile * 8 + g) * K + 8 * q;
  const bool hasA = g < M;                  // X row g
  const bool hasB = M16 && (g + 8 < M);     // X row g + 8
  const __nv_bfloat16* xa = x + (long long)g * ldx + 8 * q;
  const __nv_bfloat16* xb = x + (long long)(g + 8) * ldx + 8 * q;

  float c[4] = {0.f, 0.f, 0.f, 0.f};
  for (int k0 = warp * KC; k0 < K; k0 += WARPS * KC) {
    uint4 wv[U], av[U], bv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + 32 * u;              // + 8q inside the pointers
      const bool ok = k + 8 * q < K;
      wv[u] = ok ? ld_stream(wrow + k) : make_uint4(0, 0, 0, 0);
      av[u] = (ok && hasA) ? __ldg(reinterpret_cast<const uint4*>(xa + k)) : make_uint4(0, 0, 0, 0);
      if (M16) bv[u] = (ok && hasB) ? __ldg(reinterpret_cast<const uint4*>(xb + k)) : make_uint4(0, 0, 0, 0);
      else bv[u] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      mma_bf16(c, av[u].x, bv[u].x, av[u].y, bv[u].y, wv[u].x, wv[u].y);
      mma_bf16(c, av[u].z, bv[u].z, av[u].w, bv[u].w, wv[u].z, wv[u].w);
    }
  }
  // c: (row g, col 2q), (g, 2q+1), (g+8, 2q), (g+8, 2q+1)
  red[warp][g * 8 + 2 * q] = c[0];
  red[warp][g * 8 + 2 * q + 1] = c[1];
  red[warp][(g + 8) * 8 + 2 * q] = c[2];
  red[warp][(g + 8) * 8 + 2 * q + 1] = c[3];
  __syncthreads();
  float s = 0.f;
  if (tid < 128) {
#pragma unroll
    for (int i = 0; i < WARPS; ++i) s += red[i][tid];
  }
  __syncthreads();   // red may be reused by the caller's next tile
  return s;
}

template <bool M16>
__device__ __forceinline__ void gemm_rowparallel_body(const __nv_bfloat16* __restrict__ x, long long ldx,
                                                      const __nv_bfloat16* __restrict__ w,
                                                      __nv_bfloat16* __restrict__ y, long long ldy,
                                                      int M, int N, int K) {
  __shared__ float red[WARPS][16 * 8];
  const int n_tiles = N / 8;
  for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
    const float s = gemv_tile<M16>(x, ldx, w, M, K, tile, red);
    const int tid = threadIdx.x, m = tid >> 3, n = tid & 7;
    if (tid < 128 && m < M) y[(long long)m * ldy + tile * 8 + n] = __float2bfloat16_rn(s);
  }
}

}  // namespace rowpar

extern "C" __global__ void __launch_bounds__(rowpar::THREADS, 4)
gemm_rowparallel_m8(const __nv_bfloat16* __restrict__ x, long long ldx, const __nv_bfloat16* __restrict__ w,
                    __nv_bfloat16* __restrict__ y, long long ldy, int M, int N, int K) {
  rowpar::gemm_rowparallel_body<false>(x, ldx, w, y, ldy, M, N, K);
}

extern "C" __global__ void __launch_bounds__(rowpar::THREADS, 4)
gemm_rowparallel_m16(const __nv_bfloat16* __restrict__ x, long long ldx, const __nv_bfloat16* __restrict__ w,
                     __nv_bfloat16* __restrict__ y, long long ldy, int M, int N, int K) {
  rowpar::gemm_rowparallel_body<true>(x, ldx, w, y, ldy, M, N, K);
}

#ifdef SWIFTSPEC_WITH_NCCL
namespace rowpar {

// Window layout (fp32): [2 parities][n_tiles][16 rows][8 cols]; 1 KiB * N / 8 * ... =
// 2 * N * 16 * 4 bytes in all (512 KiB for N = 4096). Same offsets on every rank.
template <bool M16>
__device__ __forceinline__ void gemm_allreduce_body(const __nv_bfloat16* __restrict__ x, long long ldx,
                                                    const __nv_bfloat16* __restrict__ w,
                                                    __nv_bfloat16* __restrict__ y, long long ldy,
                                                    int M, int N, int K,
                                                    ncclWindow_t win, const ncclDevComm* __restrict__ dcomm_p,
                                                    unsigned int* __restrict__ seq) {
  __shared__ float red[WARPS][16 * 8];
  __shared__ unsigned int s_parity;
  const ncclDevComm& dcomm = *dcomm_p;
  const int tid = threadIdx.x;
  const int n_tiles = N / 8;
  if (tid == 0) {
    s_parity = seq[blockIdx.x] & 1u;
    seq[blockIdx.x] += 1u;
  }
  __syncthreads();
  const size_t half_bytes = (size_t)n_tiles * 16 * 8 * sizeof(float);
  const size_t base = s_parity * half_bytes;
  float* mine = reinterpret_cast<float*>(ncclGetLocalPointer(win, base));

  // 1. Partials of this block's tiles into the local half of the window.
  for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
    const float s = gemv_tile<M16>(x, ldx, w, M, K, tile, red);
    if (tid < 128) mine[(size_t)tile * 128 + tid] = s;
  }

  // 2. Meet block blockIdx.x of every rank: its partials of the same tiles are then visible.
  ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), dcomm, ncclTeamLsa(dcomm), dcomm.lsaBarrier, blockIdx.x);
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);

  // 3. Sum the peers' partials of this block's tiles in rank order (same bits on every rank).
  const int nranks = dcomm.lsaSize;
  for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
    const int m = tid >> 3, n = tid & 7;
    if (tid < 128 && m < M) {
      float s = 0.f;
      for (int peer = 0; peer < nranks; ++peer) {
        const float* p = reinterpret_cast<const float*>(ncclGetLsaPointer(win, base, peer));
        s += p[(size_t)tile * 128 + tid];
      }
      y[(long long)m * ldy + tile * 8 + n] = __float2bfloat16_rn(s);
    }
  }
  // The session's destructor syncs the CTA and stores the barrier epoch.
}

}  // namespace rowpar

extern "C" __global__ void __launch_bounds__(rowpar::THREADS, 2)
gemm_allreduce_m8(const __nv_bfloat16* __restrict__ x, long long ldx, const __nv_bfloat16* __restrict__ w,
                  __nv_bfloat16* __restrict__ y, long long ldy, int M, int N, int K,
                  ncclWindow_t win, const ncclDevComm* __restrict__ dcomm, unsigned int* __restrict__ seq) {
  rowpar::gemm_allreduce_body<false>(x, ldx, w, y, ldy, M, N, K, win, dcomm, seq);
}

extern "C" __global__ void __launch_bounds__(rowpar::THREADS, 2)
gemm_allreduce_m16(const __nv_bfloat16* __restrict__ x, long long ldx, const __nv_bfloat16* __restrict__ w,
                   __nv_bfloat16* __restrict__ y, long long ldy, int M, int N, int K,
                   ncclWindow_t win, const ncclDevComm* __restrict__ dcomm, unsigned int* __restrict__ seq) {
  rowpar::gemm_allreduce_body<true>(x, ldx, w, y, ldy, M, N, K, win, dcomm, seq);
}

// sizeof(ncclDevComm) as compiled here, for the host shim to check its copy against.
extern "C" __global__ void nccl_devcomm_sizeof(unsigned long long* out) { out[0] = sizeof(ncclDevComm); }
#endif
