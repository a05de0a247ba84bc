// The symmetric-window steps shared by the fused GEMM + all-reduce kernels (gemm_allreduce.cu,
// w4a16.cu). Every rank's window holds two halves (parities) of fp32 partials at the same
// offsets; block b of a launch uses the half its launch counter seq[b] picks, so a rank that runs
// ahead into the next launch writes the other half while peers may still read this one.
// Everything is device state: CUDA-graph safe. Needs nccl.h + nccl_device.h (NCCL >= 2.28).
#pragma once

namespace window {

// Byte offset of this launch's half for block blockIdx.x (flips seq[blockIdx.x]); a CTA barrier.
__device__ __forceinline__ size_t launch_half(unsigned int* __restrict__ seq, size_t half_bytes) {
  __shared__ unsigned int s_parity;
  if (threadIdx.x == 0) {
    s_parity = seq[blockIdx.x] & 1u;
    seq[blockIdx.x] += 1u;
  }
  __syncthreads();
  return s_parity * half_bytes;
}

// Step 1 of a fused GEMM + all-reduce: this block's tile groups (tile0 = blockIdx.x * T, then
// + gridDim.x * T, ...), each computed by tiles(tile0) into res[T * TS] (fp32, TS floats a tile),
// stored at tile0 * TS of this launch's local half of the window (launch_half, `half_bytes` a
// half); tiles past n_tiles are not stored. -> the half's byte offset, for peer_sum.
template <int T, int TS, int NTHREADS, class Tiles>
__device__ __forceinline__ size_t store_partials(ncclWindow_t win, unsigned int* __restrict__ seq,
                                                 size_t half_bytes, int n_tiles, const float* res,
                                                 Tiles tiles) {
  const size_t base = launch_half(seq, half_bytes);
  float* mine = reinterpret_cast<float*>(ncclGetLocalPointer(win, base));
  for (int tile0 = blockIdx.x * T; tile0 < n_tiles; tile0 += gridDim.x * T) {
    tiles(tile0);
    for (int e = threadIdx.x; e < T * TS; e += NTHREADS)
      if (tile0 + e / TS < n_tiles) mine[(size_t)tile0 * TS + e] = res[e];
  }
  return base;
}

// Sum of element `idx` (fp32) of the half at `base` over the ranks 0 .. nranks-1 of the LSA team,
// in rank order: the same bits on every rank.
__device__ __forceinline__ float peer_sum(ncclWindow_t win, size_t base, int nranks, size_t idx) {
  float s = 0.f;
  for (int peer = 0; peer < nranks; ++peer) {
    const float* p = reinterpret_cast<const float*>(ncclGetLsaPointer(win, base, peer));
    s += p[idx];
  }
  return s;
}

}  // namespace window
