// How fast can one block an SM stream weights into shared memory? The persistent step kernel's
// weight path (cuda/step_kernel.cu: a loader warp, cp.async.bulk pages into a ring, mbarriers)
// without its math, in the variants that decide its design (benchmarks/bench_step_stream.py):
//   layout  0: a page = 16 row segments of the [rows, K] bf16 matrix (16 copies of page_bytes / 16)
//           1: a page = one contiguous copy (the tile-major layout the 4-bit weights have)
//   protocol 0: every compute warp passes every page (step_kernel.cu's handshake, empty count 8)
//            1: only the page's owner (seq % 8) waits for it and frees it (empty count 1; slots
//               a multiple of 8, so a slot always has the same owner)
//   ldg_probe: no loader; the 8 warps stream with 16-byte ld.global.nc, `UNROLL` loads in flight.
// Each page is read from shared memory by its owner (16-byte loads, XOR-folded into `out`, so
// nothing is elided). Grid: one block an SM, 8 compute warps + 1 loader warp.
#include <stdint.h>

#include "mbarrier.cuh"   // cuda/: mbarriers and the bulk copy, as step_kernel.cu has them

namespace probe {
constexpr int WARPS = 8;

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
__device__ __forceinline__ uint4 lds16(uint32_t addr) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
  return r;
}
}  // namespace probe

// w: [rows, row_bytes] (layout 0) or tiles of 16 rows stored contiguously (layout 1), bytes equal.
// Block b streams tiles b, b + grid, ...; a tile is row_bytes / (page_bytes / 16) pages.
extern "C" __global__ void __launch_bounds__(288, 1)
ring_probe(const uint8_t* w, int64_t rows, int64_t row_bytes, int page_bytes, int npages, int layout, int protocol,
           uint32_t* out) {
  using namespace probe;
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
  const uint32_t full = base, empty = base + 8 * 64, pages = base + 1024;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int i = 0; i < npages; ++i) {
      mbar_init(full + 8 * i, 1);
      mbar_init(empty + 8 * i, protocol == 0 ? WARPS : 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int64_t tiles = rows / 16;
  const int seg = page_bytes / 16, ppt = (int)(row_bytes / seg);
  const int64_t my_tiles = tiles > blockIdx.x ? (tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const int64_t total = my_tiles * ppt;
  if (warp == WARPS) {
    for (int64_t seq = 0; seq < total; ++seq) {
      const int slot = (int)(seq % npages);
      if (seq >= npages) mbar_wait(empty + 8 * slot, ((seq / npages) - 1) & 1);
      const int64_t tile = blockIdx.x + (seq / ppt) * gridDim.x;
      const int j = (int)(seq % ppt);
      const uint32_t dst = pages + slot * page_bytes, bar = full + 8 * slot;
      if (lane == 0) mbar_expect_tx(bar, page_bytes);
      __syncwarp();
      if (layout == 0) {
        if (lane < 16) bulk_copy(dst + lane * seg, w + (tile * 16 + lane) * row_bytes + (int64_t)j * seg, seg, bar);
      } else if (lane == 0) {
        bulk_copy(dst, w + tile * 16 * row_bytes + (int64_t)j * page_bytes, page_bytes, bar);
      }
      __syncwarp();
    }
    return;
  }
  uint32_t acc = 0;
  for (int64_t seq = 0; seq < total; ++seq) {
    const int slot = (int)(seq % npages);
    const bool own = (int)(seq % WARPS) == warp;
    if (protocol == 1 && !own) continue;
    mbar_wait(full + 8 * slot, (seq / npages) & 1);
    if (own) {
      const uint32_t pg = pages + slot * page_bytes;
      for (int o = lane * 16; o < page_bytes; o += 512) {
        const uint4 v = lds16(pg + o);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + 8 * slot);
  }
  atomicXor(out, acc);
}

// Reference without a loader: every thread streams 16-byte ld.global.nc, UNROLL in flight.
template <int UNROLL>
__device__ void ldg_body(const uint4* w, int64_t n16, uint32_t* out) {
  uint32_t acc = 0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (UNROLL - 1) * stride < n16; i += UNROLL * stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(w + i + u * stride));
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n16; i += stride) acc ^= w[i].x;
  atomicXor(out, acc);
}
extern "C" __global__ void __launch_bounds__(256, 1) ldg_probe4(const uint4* w, int64_t n16, uint32_t* out) {
  ldg_body<4>(w, n16, out);
}
extern "C" __global__ void __launch_bounds__(256, 1) ldg_probe8(const uint4* w, int64_t n16, uint32_t* out) {
  ldg_body<8>(w, n16, out);
}
extern "C" __global__ void __launch_bounds__(256, 1) ldg_probe16(const uint4* w, int64_t n16, uint32_t* out) {
  ldg_body<16>(w, n16, out);
}
