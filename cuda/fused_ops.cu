// Fused elementwise kernels of the GPU decode step (Transformer.forward_graphable): each replaces
// 2-7 small torch launches per use with one, so that a CUDA-graph replay of a decode step is the
// GEMMs, tree attention and these few launches. bf16 in and out, fp32 arithmetic.
//
// Every kernel is CUDA-graph safe: no workspace, no host sync, every index that changes between
// replays (positions, KV slots) is read on the device. Each has a vectorized variant (V = 8: one
// 16-byte access per thread and operand; needs the sizes and strides to be multiples of 8 and
// 16-byte aligned bases, which swiftspec_mpi/fused_ops.py checks) and a scalar one (V = 1) for
// any other size (e.g. a tensor-parallel shard of an intermediate size that 8 does not divide).
//
// 1. add_rmsnorm (residual add + RMSNorm):  x[r] += a[r] (rounded to bf16, as torch's x.add_(a));
//    out[r] = bf16(x[r] * rsqrt(mean(x[r]^2) + eps) * w).  a may be null (plain RMSNorm).
//    Grid N blocks (one row each), 32..512 threads. The second pass re-reads the row this thread
//    just wrote (L1/L2), so any hidden size works without a register array.
//    Floor: 3 * N * H * 2 B (+ H * 2 B of weights): 25 KB for Llama-3-8B at N = 1, < 0.01 us of
//    HBM time; it is latency bound (2 dependent global round trips + one block reduction).
//    Replaces add + rms_norm (2 launches).
//
// 2. rope_kv_write (RoPE on q and k + KV-cache write):  for token t with position p = pos[t] and
//    slot s = slots[t], per head, with half = D / 2 and the model's tables (rotate-half folded into
//    a signed sin table, Transformer.__init__):
//        y[j] = bf16( bf16(x[j] * cos[p, j]) + x[(j + half) % D] * sin[p, j] )
//    (the same two roundings as torch.addcmul(qk * cos, roll(qk, half), sin) in bf16). q heads are
//    rotated in place inside the fused QKV row; rotated k heads go to k_cache[s], v heads are
//    copied to v_cache[s]. One thread owns element j and j + half of a head (V of each), so the
//    in-place update has no race. p is clamped to the table, a slot outside [0, max_slots) is
//    not written (a device-side guard instead of the out-of-bounds write torch would assert on).
//    Floor: N * (H + 2 Hkv) * D * 2 B read + as much written + 2 * N * D * 2 * 2 B of tables:
//    ~25 KB at N = 1 for Llama-3-8B: latency bound. Replaces mul, roll, addcmul and 2 index_copy_.
//
// 3. silu_mul:  out[r, i] = bf16( bf16(silu(gu[r, i])) * gu[r, I + i] ), gu = [gate | up] of the
//    fused gate-up GEMM (torch: F.silu then mul_, the same two roundings). Grid-stride over
//    N * I / V elements. Floor: 3 * N * I * 2 B = 86 KB at N = 1 (Llama-3-8B, I = 14336): < 0.03 us
//    of HBM time, latency bound. Replaces 2 launches.
//
// 4. logits_topk (what the engine reads of the logits, in one pass): per row r of fp32 logits
//    [N, V], the k largest (value desc, index asc on ties: torch.argmax's first index for k = 1)
//    and, with `logprobs`, their log_softmax x - (m + log(sum exp(x - m))), m the row max.
//    Phase 1 (logits_topk_part): P <= 32 blocks of 256 threads per row, each over 8192+ columns
//    (8 float4 loads in flight per thread when the row is 16-byte aligned); each thread keeps a
//    sorted top-K in registers and an online (max, sum of exp); the warps merge their threads'
//    lists in k rounds of a warp arg-max, warp 0 merges the warps' lists the same way, and the
//    block writes its list and (max, sum) to a workspace. Phase 2 (logits_topk_merge): one warp
//    per row merges the P lists and sums. Replaces log_softmax + topk (4+ launches, an fp32
//    [N, V] written and read back) or argmax. Floor: N * V * 4 B read (4.1 MB for Llama-3's
//    128256 x 8 rows, ~1 us of HBM at 4 TB/s). Measured (H200, a CUDA graph of one call,
//    benchmarks/bench_logits_topk.py, 2026-12-01): top-8 log-probs 19.8 / 20.4 us at N = 1 / 8
//    (torch log_softmax + topk 89.3 / 98.4), argmax 11.1 / 11.2 (torch 30.3 / 30.9). What limits
//    it: two dependent launches and the k merge rounds, not the bytes. A first version with one
//    512-thread block per row took 82 us (its loads one at a time: latency bound).
//
// Measured (one NVIDIA H200, CUDA graph of the whole decode step, context 1024, 2026-11-29,
// benchmarks/bench_gpu_step.py, docs/benchmarks.md "GPU step and engine"): the three kernels
// take a layer from (at least) 16 graph nodes to 9 and the step from 5.59-5.73 to 4.93-5.07 ms
// (Llama-3-8B, N = 1; 32 layers: 224 fewer nodes, ~2.9 us each) and from 1.65-1.78 to
// 1.26-1.38 ms (Llama-3.2-1B, N = 8), logits bit-identical to the torch-ops path. The kernels
// were not timed one by one: at these sizes each is one dependent graph node of a few us,
// whatever its bytes.
// What limits all three: launch and dependency latency inside the graph (a few us per node), not
// bytes; fewer nodes (fusing these into the GEMMs' prologues/epilogues) is the lever left.

#include <cuda_bf16.h>
#include <stdint.h>

namespace fused_ops {

typedef __nv_bfloat16 bf16;

template <int V>
__device__ __forceinline__ void load(const bf16* p, float (&f)[V]) {
  if constexpr (V == 8) {
    uint4 u = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 t = __bfloat1622float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) f[i] = __bfloat162float(p[i]);
  }
}

template <int V>
__device__ __forceinline__ void store(bf16* p, const float (&f)[V]) {
  if constexpr (V == 8) {
    uint4 u;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = u;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = __float2bfloat16_rn(f[i]);
  }
}

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < nwarps ? part[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// x [N, H] (row stride x_stride), a [N, H] (a_stride) or null, w [H], out [N, H] (out_stride).
template <int V>
__device__ __forceinline__ void add_rmsnorm_body(bf16* __restrict__ x, int64_t x_stride,
                                                 const bf16* __restrict__ a, int64_t a_stride,
                                                 const bf16* __restrict__ w, bf16* __restrict__ out,
                                                 int64_t out_stride, int H, float eps) {
  const int row = blockIdx.x;
  bf16* xr = x + row * x_stride;
  bf16* orow = out + row * out_stride;
  const int chunks = H / V;
  float ss = 0.f;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    float xv[V];
    load<V>(xr + c * V, xv);
    if (a != nullptr) {
      float av[V];
      load<V>(a + row * a_stride + c * V, av);
#pragma unroll
      for (int i = 0; i < V; ++i) xv[i] = round_bf16(xv[i] + av[i]);
      store<V>(xr + c * V, xv);
    }
#pragma unroll
    for (int i = 0; i < V; ++i) ss = fmaf(xv[i], xv[i], ss);
  }
  const float r = rsqrtf(block_sum(ss) / (float)H + eps);
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    float xv[V], wv[V];
    load<V>(xr + c * V, xv);   // this thread's own write above (or the input): program order
    load<V>(w + c * V, wv);
#pragma unroll
    for (int i = 0; i < V; ++i) xv[i] = xv[i] * r * wv[i];
    store<V>(orow + c * V, xv);
  }
}

// rope + KV write. qkv [N, (nh + 2 nkv) * D] (row stride qkv_stride): q heads, k heads, v heads.
// cos_t, sin_t [rope_len, D] contiguous. k_cache, v_cache [max_slots, nkv, D] (slot stride
// kv_stride, head stride D). One work unit = V elements at j and V at j + half of one q/k head,
// or V elements of one v head (a plain copy).
template <int V>
__device__ __forceinline__ void rope_kv_body(bf16* __restrict__ qkv, int64_t qkv_stride,
                                             const int64_t* __restrict__ positions,
                                             const int64_t* __restrict__ slots,
                                             const bf16* __restrict__ cos_t, const bf16* __restrict__ sin_t,
                                             int rope_len, bf16* __restrict__ k_cache,
                                             bf16* __restrict__ v_cache, int64_t kv_stride, int max_slots,
                                             int N, int nh, int nkv, int D) {
  const int half = D / 2;
  const int rope_per_head = half / V;
  const int v_per_head = D / V;
  const int rope_units = (nh + nkv) * rope_per_head;
  const int units = rope_units + nkv * v_per_head;
  const int64_t total = (int64_t)N * units;
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total;
       t += (int64_t)gridDim.x * blockDim.x) {
    const int tok = (int)(t / units);
    const int u = (int)(t - (int64_t)tok * units);
    bf16* row = qkv + tok * qkv_stride;
    const int64_t slot = slots[tok];
    const bool slot_ok = slot >= 0 && slot < max_slots;
    if (u < rope_units) {
      const int head = u / rope_per_head;
      const int j = (u - head * rope_per_head) * V;
      int64_t p = positions[tok];
      p = p < 0 ? 0 : (p >= rope_len ? rope_len - 1 : p);
      const bf16* cp = cos_t + p * D;
      const bf16* sp = sin_t + p * D;
      float xl[V], xh[V], cl[V], ch[V], sl[V], sh[V];
      load<V>(row + head * D + j, xl);
      load<V>(row + head * D + half + j, xh);
      load<V>(cp + j, cl);
      load<V>(cp + half + j, ch);
      load<V>(sp + j, sl);
      load<V>(sp + half + j, sh);
      float yl[V], yh[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        yl[i] = round_bf16(xl[i] * cl[i]) + xh[i] * sl[i];
        yh[i] = round_bf16(xh[i] * ch[i]) + xl[i] * sh[i];
      }
      bf16* dst;
      if (head < nh) {
        dst = row + head * D;
      } else {
        if (!slot_ok) continue;
        dst = k_cache + slot * kv_stride + (head - nh) * D;
      }
      store<V>(dst + j, yl);
      store<V>(dst + half + j, yh);
    } else {
      if (!slot_ok) continue;
      const int w = u - rope_units;
      const int head = w / v_per_head;
      const int j = (w - head * v_per_head) * V;
      const bf16* src = row + (nh + nkv) * D + head * D + j;
      bf16* dst = v_cache + slot * kv_stride + head * D + j;
      if constexpr (V == 8) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      } else {
        dst[0] = src[0];
      }
    }
  }
}

// gu [N, 2I] (row stride gu_stride), out [N, I] (out_stride).
template <int V>
__device__ __forceinline__ void silu_mul_body(const bf16* __restrict__ gu, int64_t gu_stride,
                                              bf16* __restrict__ out, int64_t out_stride, int N, int I) {
  const int per_row = I / V;
  const int64_t total = (int64_t)N * per_row;
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total;
       t += (int64_t)gridDim.x * blockDim.x) {
    const int r = (int)(t / per_row);
    const int c = (int)(t - (int64_t)r * per_row) * V;
    float g[V], u[V];
    load<V>(gu + r * gu_stride + c, g);
    load<V>(gu + r * gu_stride + I + c, u);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float s = round_bf16(g[i] / (1.f + __expf(-g[i])));
      g[i] = s * u[i];
    }
    store<V>(out + r * out_stride + c, g);
  }
}

// ---------------------------------------------------------------------------- logits_topk
// (value, index) order of logits_topk: larger value first, the lower index on ties.
__device__ __forceinline__ bool topk_better(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib);
}

// One element into a thread's sorted top-K (tv[0] the best).
template <int K>
__device__ __forceinline__ void topk_insert(float x, int i, float (&tv)[K], int (&ti)[K]) {
  if (topk_better(x, i, tv[K - 1], ti[K - 1])) {
    tv[K - 1] = x;
    ti[K - 1] = i;
#pragma unroll
    for (int j = K - 1; j > 0; --j) {
      if (topk_better(tv[j], ti[j], tv[j - 1], ti[j - 1])) {
        const float a = tv[j]; tv[j] = tv[j - 1]; tv[j - 1] = a;
        const int b = ti[j]; ti[j] = ti[j - 1]; ti[j - 1] = b;
      }
    }
  }
}

// (m, s) pairs of an online logsumexp, merged.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  const float M = fmaxf(m, m2);
  if (M == -INFINITY) return;
  s = (m == -INFINITY ? 0.f : s * expf(m - M)) + (m2 == -INFINITY ? 0.f : s2 * expf(m2 - M));
  m = M;
}

// The warp's (max, sum of exp) of its lanes' pairs, in every lane.
__device__ __forceinline__ void warp_lse(float& m, float& s) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    lse_merge(m, s, __shfl_xor_sync(0xffffffffu, m, off), __shfl_xor_sync(0xffffffffu, s, off));
}

// The warp's k best of its lanes' sorted lists (tv, ti): round r leaves the r-th best in
// (best_v, best_i) of every lane (lane r keeps it in out_v / out_i); the winning lane pops its head.
template <int K>
__device__ __forceinline__ void warp_topk_merge(float (&tv)[K], int (&ti)[K], int k, float& out_v, int& out_i) {
  const int lane = threadIdx.x & 31;
  out_v = -INFINITY;
  out_i = 0x7fffffff;
  for (int r = 0; r < k; ++r) {
    float bv = tv[0];
    int bi = ti[0];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
      if (topk_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if (lane == r) { out_v = bv; out_i = bi; }
    if (ti[0] == bi && tv[0] == bv) {            // the winner (indices are unique) pops its head
#pragma unroll
      for (int j = 0; j < K - 1; ++j) { tv[j] = tv[j + 1]; ti[j] = ti[j + 1]; }
      tv[K - 1] = -INFINITY;
      ti[K - 1] = 0x7fffffff;
    }
  }
}

constexpr int TOPK_THREADS = 256;     // logits_topk_part's block
constexpr int TOPK_UNROLL = 8;        // float4 loads in flight per thread
constexpr int TOPK_CHUNK = 4 * TOPK_THREADS * TOPK_UNROLL;   // 8192 columns: one pass per block
constexpr int TOPK_MAX_PARTS = 32;    // blocks per row (one warp merges their lists)

// Phase 1: block (p, r) takes columns [p chunk, (p + 1) chunk) of row r (chunk a multiple of
// TOPK_CHUNK) and writes its k best (value desc, index asc) and its (max, sum of exp) to the
// workspace: pv/pi [N][P][K], pm/ps [N][P]. LSE = false skips the sum (argmax).
template <int K, bool LSE>
__device__ __forceinline__ void logits_topk_part_body(const float* __restrict__ x, int64_t ld, int V, int chunk, int k,
                                                      float* __restrict__ pv, int* __restrict__ pi,
                                                      float* __restrict__ pm, float* __restrict__ ps) {
  __shared__ float sv[TOPK_THREADS / 32][K];
  __shared__ int si[TOPK_THREADS / 32][K];
  __shared__ float sm[TOPK_THREADS / 32], ss[TOPK_THREADS / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r = blockIdx.y, p = blockIdx.x, P = gridDim.x;
  const float* row = x + (int64_t)r * ld;
  const int lo = p * chunk, hi = min(V, lo + chunk);
  float tv[K];
  int ti[K];
#pragma unroll
  for (int j = 0; j < K; ++j) { tv[j] = -INFINITY; ti[j] = 0x7fffffff; }
  float m = -INFINITY, s = 0.f;
  auto push = [&](float v, int i) {
    if constexpr (LSE) {
      if (v > m) {
        s = s * expf(m - v) + 1.f;     // m = -inf at first: s = 0 * 0 + 1
        m = v;
      } else if (v != -INFINITY) {
        s += expf(v - m);
      }
    }
    topk_insert<K>(v, i, tv, ti);
  };
  if ((reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    const int hi4 = lo + ((hi - lo) & ~3);
    for (int base = lo + 4 * tid; base < hi4; base += TOPK_CHUNK) {
      float4 v[TOPK_UNROLL];
#pragma unroll
      for (int u = 0; u < TOPK_UNROLL; ++u) {       // every load in flight first
        const int i = base + u * 4 * TOPK_THREADS;
        v[u] = i < hi4 ? *reinterpret_cast<const float4*>(row + i) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
      }
#pragma unroll
      for (int u = 0; u < TOPK_UNROLL; ++u) {
        const int i = base + u * 4 * TOPK_THREADS;
        if (i < hi4) { push(v[u].x, i); push(v[u].y, i + 1); push(v[u].z, i + 2); push(v[u].w, i + 3); }
      }
    }
    for (int i = hi4 + tid; i < hi; i += TOPK_THREADS) push(row[i], i);
  } else {
    for (int i = lo + tid; i < hi; i += TOPK_THREADS) push(row[i], i);
  }
  if constexpr (LSE) warp_lse(m, s);
  float wv;
  int wi;
  warp_topk_merge<K>(tv, ti, k, wv, wi);
  if (lane < K) { sv[warp][lane] = wv; si[warp][lane] = wi; }
  if (lane == 0) { sm[warp] = m; ss[warp] = s; }
  __syncthreads();
  if (warp == 0) {
    constexpr int NW = TOPK_THREADS / 32;
    if constexpr (LSE) {
      m = lane < NW ? sm[lane] : -INFINITY;
      s = lane < NW ? ss[lane] : 0.f;
      warp_lse(m, s);
    }
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const bool have = lane < NW && j < k;
      tv[j] = have ? sv[lane][j] : -INFINITY;
      ti[j] = have ? si[lane][j] : 0x7fffffff;
    }
    warp_topk_merge<K>(tv, ti, k, wv, wi);
    const int64_t part = (int64_t)r * P + p;
    if (lane < K) { pv[part * K + lane] = wv; pi[part * K + lane] = wi; }
    if (lane == 0) { pm[part] = m; ps[part] = s; }
  }
}

// Phase 2: one warp per row merges its P <= 32 parts (lane l holds part l's sorted list).
template <int K>
__device__ __forceinline__ void logits_topk_merge_body(const float* __restrict__ pv, const int* __restrict__ pi,
                                                       const float* __restrict__ pm, const float* __restrict__ ps,
                                                       int P, int k, int logprobs, int64_t* __restrict__ ids,
                                                       int64_t ld_ids, float* __restrict__ vals, int64_t ld_vals) {
  static_assert(TOPK_MAX_PARTS <= 32, "one lane per part");
  const int lane = threadIdx.x, r = blockIdx.x;
  const int64_t part = (int64_t)r * P + lane;
  float tv[K];
  int ti[K];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const bool have = lane < P && j < k;
    tv[j] = have ? pv[part * K + j] : -INFINITY;
    ti[j] = have ? pi[part * K + j] : 0x7fffffff;
  }
  float m = lane < P ? pm[part] : -INFINITY, s = lane < P ? ps[part] : 0.f;
  warp_lse(m, s);
  float wv;
  int wi;
  warp_topk_merge<K>(tv, ti, k, wv, wi);
  if (lane < k) {
    ids[(int64_t)r * ld_ids + lane] = wi;
    vals[(int64_t)r * ld_vals + lane] = logprobs ? wv - (m + logf(s)) : wv;
  }
}

}  // namespace fused_ops

// Programmatic dependent launch (fused_ops.py pdl=True): wait for the previous kernel of the
// stream (its outputs are our inputs) and only then let the next one launch, so at most one
// dependent grid sits waiting behind us. Both are no-ops for launches without the PDL attribute.
#define FUSED_OPS_PDL_ENTER()                                  \
  asm volatile("griddepcontrol.wait;\n" ::: "memory");         \
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory")

#define FUSED_OPS_INSTANTIATE(V)                                                                       \
  extern "C" __global__ void __launch_bounds__(512) add_rmsnorm_v##V(                                  \
      bf16* x, int64_t x_stride, const bf16* a, int64_t a_stride, const bf16* w, bf16* out,           \
      int64_t out_stride, int H, float eps) {                                                          \
    FUSED_OPS_PDL_ENTER();                                                                             \
    fused_ops::add_rmsnorm_body<V>(x, x_stride, a, a_stride, w, out, out_stride, H, eps);              \
  }                                                                                                    \
  extern "C" __global__ void __launch_bounds__(256) rope_kv_write_v##V(                                \
      bf16* qkv, int64_t qkv_stride, const int64_t* positions, const int64_t* slots,                   \
      const bf16* cos_t, const bf16* sin_t, int rope_len, bf16* k_cache, bf16* v_cache,                \
      int64_t kv_stride, int max_slots, int N, int nh, int nkv, int D) {                               \
    FUSED_OPS_PDL_ENTER();                                                                             \
    fused_ops::rope_kv_body<V>(qkv, qkv_stride, positions, slots, cos_t, sin_t, rope_len, k_cache,     \
                               v_cache, kv_stride, max_slots, N, nh, nkv, D);                          \
  }                                                                                                    \
  extern "C" __global__ void __launch_bounds__(256) silu_mul_v##V(                                     \
      const bf16* gu, int64_t gu_stride, bf16* out, int64_t out_stride, int N, int I) {                \
    FUSED_OPS_PDL_ENTER();                                                                             \
    fused_ops::silu_mul_body<V>(gu, gu_stride, out, out_stride, N, I);                                 \
  }

using fused_ops::bf16;
FUSED_OPS_INSTANTIATE(8)
FUSED_OPS_INSTANTIATE(1)

// logits_topk_part_k<K>_l<LSE>: grid (P, N) blocks of fused_ops::TOPK_THREADS; then
// logits_topk_merge_k<K>: grid N blocks of 32 threads (k <= K, fused_ops.py picks K and P).
#define LOGITS_TOPK_INSTANTIATE(K)                                                                     \
  extern "C" __global__ void __launch_bounds__(fused_ops::TOPK_THREADS) logits_topk_part_k##K##_l1(    \
      const float* x, int64_t ld, int V, int chunk, int k, float* pv, int* pi, float* pm, float* ps) { \
    FUSED_OPS_PDL_ENTER();                                                                             \
    fused_ops::logits_topk_part_body<K, true>(x, ld, V, chunk, k, pv, pi, pm, ps);                     \
  }                                                                                                    \
  extern "C" __global__ void __launch_bounds__(fused_ops::TOPK_THREADS) logits_topk_part_k##K##_l0(    \
      const float* x, int64_t ld, int V, int chunk, int k, float* pv, int* pi, float* pm, float* ps) { \
    FUSED_OPS_PDL_ENTER();                                                                             \
    fused_ops::logits_topk_part_body<K, false>(x, ld, V, chunk, k, pv, pi, pm, ps);                    \
  }                                                                                                    \
  extern "C" __global__ void __launch_bounds__(32) logits_topk_merge_k##K(                             \
      const float* pv, const int* pi, const float* pm, const float* ps, int P, int k, int logprobs,    \
      int64_t* ids, int64_t ld_ids, float* vals, int64_t ld_vals) {                                    \
    FUSED_OPS_PDL_ENTER();                                                                             \
    fused_ops::logits_topk_merge_body<K>(pv, pi, pm, ps, P, k, logprobs, ids, ld_ids, vals, ld_vals);  \
  }
LOGITS_TOPK_INSTANTIATE(1)
LOGITS_TOPK_INSTANTIATE(8)
LOGITS_TOPK_INSTANTIATE(16)
LOGITS_TOPK_INSTANTIATE(32)
