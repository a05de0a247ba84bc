// Tree attention for speculative decoding: up to 64 query tokens (the verify tree, or the draft's
// w new leaves) attend over the committed KV plus the tree's own KV, through an explicit
// visibility mask, with grouped-query attention. One launch, split-K over the KV length, with the
// split-K combine done in the same kernel through distributed shared memory of a thread-block
// cluster (Hopper, sm_90): no workspace, no counters, nothing to reset, so it is CUDA-graph safe.
//
// Layout (matches the model's static KV buffers, docs/internals.md):
//   q        [N, H, D]        bf16, head stride D, token stride q_tok_stride (elements)
//   k, v     [slots, Hkv, D]  bf16 (one layer), head stride D, slot stride kv_slot_stride
//   mask     [N, >= L]        uint8/bool, row stride mask_stride; nonzero = visible
//   out      [N, H, D]        bf16, token stride out_tok_stride
//   L = *n_valid_ptr if n_valid_ptr != nullptr else n_valid  (read on device: graph replays may
//       change the context length without re-capture)
// Query head i uses KV head i / G, G = H / Hkv (Hugging Face repeat_kv convention).
//
// Decomposition: grid (CS, Hkv, RG), cluster (CS,1,1), 128 threads, CS = 8 or 16. The R = N*G query rows of
// one KV head are its GEMM rows ("row = token*G + group index"); a block holds MT_BLK m16 row
// tiles (RG = ceil(R / (16*MT_BLK)) row groups) and 1/CS of the KV tiles (64 slots each).
// 4 warps = MT_BLK row tiles x (4/MT_BLK) slices of every 64-slot tile. K/V tiles stream
// through a 3- or 4-stage cp.async ring in shared memory; S = Q K^T and O += P V run on mma.sync
// m16n8k16 (bf16 in, fp32 accumulate) with an online softmax in registers (FlashAttention-2
// style). At the end every warp leaves (m, l, O) for its 16 rows in shared memory; after a
// cluster barrier each block of the cluster reduces 1/CS of the outputs by reading the partials
// of all CS blocks through DSMEM (after a local pre-combine of the block's warps, so one DSMEM
// round trip reads CS partials per output), then a second cluster barrier keeps the shared memory alive
// until everyone has read it.
//
// Floor (Llama-3-8B heads: 32 q / 8 KV heads, D 128, N = 8, one layer): the KV bytes,
// L * 8 * 128 * 2 B * 2 = 4 MiB at 1k context, 16 MiB at 4k, 64 MiB at 16k, i.e. about 1 / 4 /
// 16 us at the 4.18 TB/s copy bandwidth measured on the H200. FLOPs are 4*N*H*L*D = 0.13 / 0.54 /
// 2.1 GFLOP: nothing for the tensor cores (mma.sync), which is why the CUDA-core version is no
// option at N = 64.
// Measured (H200, CUDA graph, default config, benchmarks/gpu_kernels.sh, 2026-11-29, three runs):
// 9.7 us at 1k, 18.8-19.2 us at 4k, 44.6-45.3 us at 16k (torch SDPA with the bool mask: 32 / 94 /
// 347 us). Goals were <= 8 us at 1k and <= 12 us at 4k: NOT met. What limits it (ncu, 4k, config
// 8/4/2): DRAM throughput 15 %, 1 warp per scheduler (occupancy 6 %: 139 KiB of smem per block),
// one instruction issued every 5.4 cycles: issue/latency bound, not memory bound.
// A rewrite tried on 2026-11-29 (8 warps per block holding all 32 rows of a KV head, so K/V is
// read once; the mask packed to bits with one byte load per lane and a ballot, read one tile
// ahead or for all of a block's tiles up front; O rescaled only when a row max moves; deeper
// rings; 10-14 variants swept) was no faster (1k 9.75 us, 4k 18.4, 16k 47.4; N = 64 slower) and
// was not kept. Its diagnostic builds located the time: with one 64-slot tile in all (L = 64)
// a call takes 7.7 us, 4.5 us of it with no math at all (launch, first K/V tile, combine; the
// cluster combine alone 1.7 us); streaming K/V alone (no math) reaches only ~2.4 TB/s with 64 or
// 128 blocks: each KV head reads 256-byte rows at a 2 KiB stride of the [slots, Hkv, D] cache;
// and per 64-slot tile the stream (0.87 us), the MMAs + softmax (0.56 us) and the mask reads
// (0.47 us) add up instead of overlapping (16k: 61 = 28 + 18 + 15 us for config 8/4/2, 8 warps).
// Next steps, in that order: blocks that read all KV heads of a slot range (2 KiB contiguous
// rows) or a per-head contiguous cache layout; a producer warp with bulk copies (TMA) feeding
// consumer warps so the math overlaps the stream; no mask reads for the committed prefix (pass
// its length); PDL so the launch and first tile overlap the previous kernel.

#include <cuda_bf16.h>
#include <stdint.h>
#include <cooperative_groups.h>

namespace cg = cooperative_groups;

namespace tree_attn {

constexpr int TILE = 64;      // KV slots per pipeline stage
constexpr int THREADS = 128;  // 4 warps
// Instantiated: CS (blocks per cluster = KV splits per KV head and row group) 8 with a 4-stage
// cp.async ring (139 KiB smem at D 128, one block per SM), and 16 (non-portable cluster size,
// the host sets cudaFuncAttributeNonPortableClusterSizeAllowed) with 3 stages (104 KiB: two
// blocks per SM) or 2 stages (70 KiB: three blocks per SM, latency hidden by more warps).

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  // src-size 0 zero-fills the 16 bytes: slots past L become zeros (finite V, no NaN * 0).
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// C[16x8] += A[16x16] * B[16x8], bf16 inputs, fp32 accumulators (PTX fragment layouts).
__device__ __forceinline__ void mma_bf16(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (low 16 bits)
  return *reinterpret_cast<uint32_t*>(&v);
}

template <int D>
struct Smem {
  static constexpr int LDS = D + 8;                    // padded row: ldmatrix without bank conflicts
  static constexpr int STAGE_ELEMS = 2 * TILE * LDS;   // K tile then V tile
};

template <int D, int MT_BLK, int CS, int STAGES>
__device__ __forceinline__ void tree_attention_body(
    const __nv_bfloat16* __restrict__ q, long long q_tok_stride,
    const __nv_bfloat16* __restrict__ kc, const __nv_bfloat16* __restrict__ vc, long long kv_slot_stride,
    const uint8_t* __restrict__ mask, long long mask_stride,
    const int* __restrict__ n_valid_ptr, int n_valid,
    __nv_bfloat16* __restrict__ out, long long out_tok_stride,
    int N, int H, int Hkv, float scale_log2) {
  constexpr int KV_PARTS = 4 / MT_BLK;        // warps sharing one row tile
  constexpr int PW = TILE / KV_PARTS;         // slots of a tile per warp: 16, 32 or 64
  constexpr int NT = PW / 8;                  // S n-tiles per warp and tile
  constexpr int DK = D / 16;                  // k-steps over the head dim
  constexpr int DN = D / 8;                   // O n-tiles
  constexpr int LDS = Smem<D>::LDS;
  constexpr int RB = MT_BLK * 16;             // rows per block
  constexpr int CHUNKS = D / 8;               // 16-byte chunks per K/V row
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static_assert(NT <= 8, "mask bits");
  static_assert(STAGES * Smem<D>::STAGE_ELEMS * 2 >= (4 * 16 * D + 4 * 16 * 2 + RB * D + 2 * RB) * 4,
                "warp and block partials fit in the K/V ring");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);

  // Programmatic dependent launch (kernels.py pdl=True): q, the new K/V slots and the mask come
  // from the previous kernels, so wait for the previous grid first, then let the next kernel
  // (the O projection, which prefetches its weights before waiting for us) launch. No-ops for
  // launches without the PDL attribute.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  cg::cluster_group cluster = cg::this_cluster();
  const int crank = (int)cluster.block_rank();   // == blockIdx.x (cluster spans x)
  const int h = blockIdx.y;                      // KV head
  const int rg = blockIdx.z;                     // row group
  const int G = H / Hkv;
  const int R = N * G;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, qd = lane & 3;
  const int mt = warp % MT_BLK, part = warp / MT_BLK;
  const int L = n_valid_ptr ? __ldg(n_valid_ptr) : n_valid;

  // KV tiles of this block: [t_begin, t_end) out of ceil(L / TILE), balanced over the cluster.
  const int n_tiles = (L + TILE - 1) / TILE;
  const int t_begin = (int)(((long long)n_tiles * crank) / CS);
  const int t_end = (int)(((long long)n_tiles * (crank + 1)) / CS);
  const int my_tiles = t_end - t_begin;

  const __nv_bfloat16* kh = kc + (long long)h * D;
  const __nv_bfloat16* vh = vc + (long long)h * D;

  auto load_tile = [&](int t, int stage) {
    __nv_bfloat16* ks = smem + stage * Smem<D>::STAGE_ELEMS;
    __nv_bfloat16* vs = ks + TILE * LDS;
    const int slot0 = t * TILE;
#pragma unroll
    for (int i = tid; i < TILE * CHUNKS; i += THREADS) {
      const int r = i / CHUNKS, c = i % CHUNKS;
      const int slot = slot0 + r;
      const bool ok = slot < L;
      const long long off = (long long)(ok ? slot : 0) * kv_slot_stride + c * 8;
      cp_async_16(smem_u32(ks + r * LDS + c * 8), kh + off, ok);
      cp_async_16(smem_u32(vs + r * LDS + c * 8), vh + off, ok);
    }
  };

  // Prologue: start streaming K/V first, then load Q while the copies are in flight.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < my_tiles) load_tile(t_begin + s, s);
    cp_async_commit();
  }

  // Q fragments (A operand, m16k16 row-major) for rows rowA = g and rowB = g + 8 of this warp's tile.
  const int row_base = rg * RB + mt * 16;
  const int rowA = row_base + g, rowB = row_base + g + 8;
  const bool validA = rowA < R, validB = rowB < R;
  const int tokA = validA ? rowA / G : 0, tokB = validB ? rowB / G : 0;
  const __nv_bfloat16* qA = q + (long long)tokA * q_tok_stride + (long long)(h * G + rowA % G) * D;
  const __nv_bfloat16* qB = q + (long long)tokB * q_tok_stride + (long long)(h * G + rowB % G) * D;
  uint32_t qf[DK][4];
#pragma unroll
  for (int s = 0; s < DK; ++s) {
    const int c0 = s * 16 + 2 * qd;
    qf[s][0] = validA ? __ldg(reinterpret_cast<const uint32_t*>(qA + c0)) : 0u;
    qf[s][1] = validB ? __ldg(reinterpret_cast<const uint32_t*>(qB + c0)) : 0u;
    qf[s][2] = validA ? __ldg(reinterpret_cast<const uint32_t*>(qA + c0 + 8)) : 0u;
    qf[s][3] = validB ? __ldg(reinterpret_cast<const uint32_t*>(qB + c0 + 8)) : 0u;
  }
  const uint8_t* mA = mask + (long long)tokA * mask_stride;
  const uint8_t* mB = mask + (long long)tokB * mask_stride;

  // Visibility bits of one tile for this thread: bit (4j + 2*half + e) <-> row (half ? B : A),
  // slot t*TILE + part*PW + 8j + 2qd + e. Loaded one tile ahead (raw bytes), packed after use.
  auto load_mask = [&](int t, uint8_t (&mb)[NT * 4]) {
    const int p0 = t * TILE + part * PW + 2 * qd;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int p = p0 + 8 * j + e;
        mb[4 * j + e] = (validA && p < L) ? __ldg(mA + p) : (uint8_t)0;
        mb[4 * j + 2 + e] = (validB && p < L) ? __ldg(mB + p) : (uint8_t)0;
      }
    }
  };
  auto pack_mask = [&](const uint8_t (&mb)[NT * 4]) {
    uint32_t bits = 0;
#pragma unroll
    for (int i = 0; i < NT * 4; ++i) bits |= (mb[i] ? 1u : 0u) << i;
    return bits;
  };

  float o[DN][4];
#pragma unroll
  for (int i = 0; i < DN; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // running max (log2 domain) of rows A, B
  float l_run[2] = {0.f, 0.f};              // this thread's share of the row sums

  uint8_t mbytes[NT * 4];
  uint32_t mbits = 0;
  if (my_tiles > 0) {
    load_mask(t_begin, mbytes);
    mbits = pack_mask(mbytes);
  }

  for (int it = 0; it < my_tiles; ++it) {
    const int t = t_begin + it;
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile `it` is in shared memory; stage (it-1)%STAGES is free again
    if (it + STAGES - 1 < my_tiles) load_tile(t + STAGES - 1, (it + STAGES - 1) % STAGES);
    cp_async_commit();
    if (it + 1 < my_tiles) load_mask(t + 1, mbytes);

    const __nv_bfloat16* ks = smem + (it % STAGES) * Smem<D>::STAGE_ELEMS;
    const __nv_bfloat16* vs = ks + TILE * LDS;

    // S = Q K^T for this warp's PW slots.
    float sacc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      sacc[j][0] = sacc[j][1] = sacc[j][2] = sacc[j][3] = 0.f;
      // ldmatrix x4: rows = slots (part*PW + 8j + lane%8), cols = d chunks 0,8,16,24 (+32*s2)
      const __nv_bfloat16* krow = ks + (part * PW + 8 * j + (lane & 7)) * LDS + 8 * (lane >> 3);
#pragma unroll
      for (int s2 = 0; s2 < DK / 2; ++s2) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(b0, b1, b2, b3, smem_u32(krow + 32 * s2));
        mma_bf16(sacc[j], qf[2 * s2][0], qf[2 * s2][1], qf[2 * s2][2], qf[2 * s2][3], b0, b1);
        mma_bf16(sacc[j], qf[2 * s2 + 1][0], qf[2 * s2 + 1][1], qf[2 * s2 + 1][2], qf[2 * s2 + 1][3], b2, b3);
      }
    }

    // Mask, scale to the log2 domain, online softmax. Each row lives in the 4 lanes of a quad.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int bit = 4 * j + (e >> 1) * 2 + (e & 1);
        const float s = ((mbits >> bit) & 1u) ? sacc[j][e] * scale_log2 : -INFINITY;
        sacc[j][e] = s;
        mx[e >> 1] = fmaxf(mx[e >> 1], s);
      }
    }
    float alpha[2], msub[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float m_new = fmaxf(m_run[r], mx[r]);
      msub[r] = (m_new == -INFINITY) ? 0.f : m_new;   // all masked so far: p = 0, alpha = 1
      alpha[r] = exp2f(m_run[r] - msub[r]);
      m_run[r] = m_new;
      l_run[r] *= alpha[r];
    }
#pragma unroll
    for (int i = 0; i < DN; ++i) {
      o[i][0] *= alpha[0]; o[i][1] *= alpha[0];
      o[i][2] *= alpha[1]; o[i][3] *= alpha[1];
    }
    uint32_t pf[NT][2];  // P as bf16 pairs: [j][0] row A, [j][1] row B
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float p0 = exp2f(sacc[j][0] - msub[0]), p1 = exp2f(sacc[j][1] - msub[0]);
      const float p2 = exp2f(sacc[j][2] - msub[1]), p3 = exp2f(sacc[j][3] - msub[1]);
      l_run[0] += p0 + p1;
      l_run[1] += p2 + p3;
      pf[j][0] = pack_bf16(p0, p1);
      pf[j][1] = pack_bf16(p2, p3);
    }

    // O += P V: k = slots (16 per step), n = head dim (2 n-tiles per ldmatrix.x4.trans).
#pragma unroll
    for (int ks16 = 0; ks16 < PW / 16; ++ks16) {
      const uint32_t a0 = pf[2 * ks16][0], a1 = pf[2 * ks16][1];
      const uint32_t a2 = pf[2 * ks16 + 1][0], a3 = pf[2 * ks16 + 1][1];
      const __nv_bfloat16* vrow =
          vs + (part * PW + 16 * ks16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * LDS + 8 * (lane >> 4);
#pragma unroll
      for (int dn2 = 0; dn2 < DN / 2; ++dn2) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4_trans(b0, b1, b2, b3, smem_u32(vrow + 16 * dn2));
        mma_bf16(o[2 * dn2], a0, a1, a2, a3, b0, b1);
        mma_bf16(o[2 * dn2 + 1], a0, a1, a2, a3, b2, b3);
      }
    }
    if (it + 1 < my_tiles) mbits = pack_mask(mbytes);
  }
  cp_async_wait<0>();
  __syncthreads();  // all warps done with the K/V ring: reuse it for the partials

  // Partials of this block: per warp 16 rows of (m, l, O[D]) in fp32.
  float* part_o = reinterpret_cast<float*>(smem_raw);   // [4][16][D]
  float* part_m = part_o + 4 * 16 * D;                   // [4][16]
  float* part_l = part_m + 4 * 16;                       // [4][16]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  if (qd == 0) {
    part_m[warp * 16 + g] = m_run[0];
    part_m[warp * 16 + g + 8] = m_run[1];
    part_l[warp * 16 + g] = l_run[0];
    part_l[warp * 16 + g + 8] = l_run[1];
  }
#pragma unroll
  for (int i = 0; i < DN; ++i) {
    const int c = 8 * i + 2 * qd;
    *reinterpret_cast<float2*>(&part_o[(warp * 16 + g) * D + c]) = make_float2(o[i][0], o[i][1]);
    *reinterpret_cast<float2*>(&part_o[(warp * 16 + g + 8) * D + c]) = make_float2(o[i][2], o[i][3]);
  }
  __syncthreads();

  // 1. Local pre-combine: the KV_PARTS warps sharing a row tile -> one (m, l, O) per row of the
  //    block, so the cluster step reads CS partials per row, all in one DSMEM round trip.
  constexpr int D4 = D / 4;
  constexpr int ITEMS = RB * D4;
  float* blk_o = part_l + 4 * 16;                        // [RB][D]
  float* blk_m = blk_o + RB * D;                         // [RB]
  float* blk_l = blk_m + RB;                             // [RB]
  for (int item = tid; item < ITEMS; item += THREADS) {
    const int rl = item / D4, d4 = item % D4;
    const int wmt = rl / 16, rr = rl % 16;
    float mp[KV_PARTS];
    float mmax = -INFINITY;
#pragma unroll
    for (int p = 0; p < KV_PARTS; ++p) {
      mp[p] = part_m[(wmt + MT_BLK * p) * 16 + rr];
      mmax = fmaxf(mmax, mp[p]);
    }
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float lsum = 0.f;
    if (mmax != -INFINITY) {
#pragma unroll
      for (int p = 0; p < KV_PARTS; ++p) {
        const int w = wmt + MT_BLK * p;
        const float sc = exp2f(mp[p] - mmax);
        lsum += sc * part_l[w * 16 + rr];
        const float4 v = *reinterpret_cast<const float4*>(&part_o[(w * 16 + rr) * D + 4 * d4]);
        acc.x += sc * v.x; acc.y += sc * v.y; acc.z += sc * v.z; acc.w += sc * v.w;
      }
    }
    *reinterpret_cast<float4*>(&blk_o[rl * D + 4 * d4]) = acc;
    if (d4 == 0) {
      blk_m[rl] = mmax;
      blk_l[rl] = lsum;
    }
  }
  cluster.sync();  // block partials of all CS blocks written and visible cluster-wide

  // 2. Cluster combine: this block finalizes items [crank*PER, (crank+1)*PER) of RB x D/4,
  //    loading (m, l, O[4]) of all CS blocks at once (independent DSMEM loads), then reducing.
  constexpr int PER = (ITEMS + CS - 1) / CS;
  for (int item = crank * PER + tid; item < min(ITEMS, (crank + 1) * PER); item += THREADS) {
    const int rl = item / D4, d4 = item % D4;
    const int row = rg * RB + rl;
    if (row >= R) continue;
    float mi[CS], li[CS];
    float4 oi[CS];
#pragma unroll
    for (int cb = 0; cb < CS; ++cb) {
      mi[cb] = *cluster.map_shared_rank(blk_m + rl, cb);
      li[cb] = *cluster.map_shared_rank(blk_l + rl, cb);
      oi[cb] = *cluster.map_shared_rank(reinterpret_cast<const float4*>(blk_o + rl * D + 4 * d4), cb);
    }
    float mmax = -INFINITY;
#pragma unroll
    for (int cb = 0; cb < CS; ++cb) mmax = fmaxf(mmax, mi[cb]);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float lsum = 0.f;
    if (mmax != -INFINITY) {
#pragma unroll
      for (int cb = 0; cb < CS; ++cb) {
        const float sc = exp2f(mi[cb] - mmax);
        lsum += sc * li[cb];
        acc.x += sc * oi[cb].x; acc.y += sc * oi[cb].y; acc.z += sc * oi[cb].z; acc.w += sc * oi[cb].w;
      }
    }
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;   // a row that sees nothing gives zeros
    const int tok = row / G, hq = h * G + row % G;
    __nv_bfloat16* dst = out + (long long)tok * out_tok_stride + (long long)hq * D + 4 * d4;
    uint2 pk;
    pk.x = pack_bf16(acc.x * inv, acc.y * inv);
    pk.y = pack_bf16(acc.z * inv, acc.w * inv);
    *reinterpret_cast<uint2*>(dst) = pk;
  }
  cluster.sync();  // keep this block's shared memory alive until the whole cluster has read it
}

}  // namespace tree_attn

#define TREE_ATTN_KERNEL(D, MT, CS, ST)                                                               \
  extern "C" __global__ void __cluster_dims__(CS, 1, 1) __launch_bounds__(tree_attn::THREADS)         \
  tree_attention_d##D##_mt##MT##_cs##CS##_st##ST(                                                     \
      const __nv_bfloat16* __restrict__ q, long long q_tok_stride,                                    \
      const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, long long kv_slot_stride, \
      const uint8_t* __restrict__ mask, long long mask_stride,                                        \
      const int* __restrict__ n_valid_ptr, int n_valid,                                               \
      __nv_bfloat16* __restrict__ out, long long out_tok_stride,                                      \
      int N, int H, int Hkv, float scale_log2) {                                                      \
    tree_attn::tree_attention_body<D, MT, CS, ST>(q, q_tok_stride, k, v, kv_slot_stride, mask, mask_stride,  \
                                          n_valid_ptr, n_valid, out, out_tok_stride, N, H, Hkv,       \
                                          scale_log2);                                                \
  }

TREE_ATTN_KERNEL(128, 1, 8, 4)
TREE_ATTN_KERNEL(128, 2, 8, 4)
TREE_ATTN_KERNEL(128, 4, 8, 4)
TREE_ATTN_KERNEL(64, 1, 8, 4)
TREE_ATTN_KERNEL(64, 2, 8, 4)
TREE_ATTN_KERNEL(64, 4, 8, 4)
TREE_ATTN_KERNEL(128, 1, 16, 3)
TREE_ATTN_KERNEL(128, 2, 16, 3)
TREE_ATTN_KERNEL(128, 4, 16, 3)
TREE_ATTN_KERNEL(64, 1, 16, 3)
TREE_ATTN_KERNEL(64, 2, 16, 3)
TREE_ATTN_KERNEL(64, 4, 16, 3)
TREE_ATTN_KERNEL(128, 1, 16, 2)
TREE_ATTN_KERNEL(128, 2, 16, 2)
TREE_ATTN_KERNEL(128, 4, 16, 2)
TREE_ATTN_KERNEL(64, 1, 16, 2)
TREE_ATTN_KERNEL(64, 2, 16, 2)
TREE_ATTN_KERNEL(64, 4, 16, 2)
