// One decode step of a Llama/Qwen2 decoder as ONE persistent kernel (swiftspec_mpi/gpu/step_kernel.py
// builds the schedule and launches it): embedding, RMSNorm, QKV (+ bias), RoPE, KV append, tree
// attention, O projection + residual, SwiGLU MLP + residual, final norm, LM head -> fp32 logits.
//
// Grid: one block per SM (all resident: the blocks wait on each other), 9 warps. Each block walks
// its own list of instructions (built on the host once per model and N, in layer order):
//   EMBED  x = embed[tokens]
//   GEMV   `ntiles` 16-row tiles of one projection (QKV, O, gate|up, down or the LM head) over all
//          K, in rounds of up to 8 tiles (128 rows: a warp a tile), with the op's epilogue; O and
//          down add into the residual x; gate|up runs gate and up tiles of the same rows in one
//          round and writes SwiGLU's h, down's input; QKV, gate|up and the head take RMSNorm(x) (ln1, ln2, the
//          final norm), which every one of their instructions computes while staging x (no block
//          normalizes for the others, so they wait on the O / down instructions directly)
//   ATTN   one query head x up to 8 rows x one of `splits` key ranges: RoPE of this KV head's new
//          K rows + their K/V append into the cache (every instruction of the KV head writes the
//          same values), then the masked attention of the rows over its range of the slots
//          [0, n_valid) with an online softmax, the keys split again over the warps and merged in
//          shared memory; one range: O in bf16, else the range's (max, sum, unnormalized O) in
//          fp32, which the O projection's X staging merges (load_o_merged)
// Dependencies: counters in global memory (a producer's stores, a barrier, thread 0's release add;
// the consumer's thread 0 polls with relaxed loads, then one acquire fence and a barrier); no
// grid-wide barrier. The last block to finish zeroes every counter, so the next launch starts
// clean without another kernel. An acquire empties the SM's L1 cache, so what an instruction
// reads right after its wait comes from shared memory: the Params block (copied in at the start),
// the instruction's words and OpDesc / LayerDesc and a normalizing GEMV's RMSNorm weight (put
// there by compute warps 1.. while warp 0 waits: preload_instr).
//
// Weight streaming: warp 8 is the loader. It walks the same instruction list and copies each GEMV
// tile's weights, page after page (16 rows x up to 1024 k's of bf16, or 16 rows x up to 16 128-k
// chunks of 4-bit codes with their scales), into a ring of `npages` shared-memory pages with
// cp.async.bulk (the TMA's 1-D copy, completion on a `full` mbarrier per page). Weights do not
// depend on activations, so the loader runs ahead of the counters the compute warps wait on: the
// next tile's, op's and layer's weights stream while the current op finishes and while the block
// waits. Each compute warp owns one tile of a round for the whole K (the 16 W rows as A of mma
// m16n8k16, up to 32 token rows as B in m-blocks of 8): it multiplies its own pages whole (the
// other warps only pass them), and writes its 16 rows' outputs from its accumulators, so no
// cross-warp reduction and no block barrier per tile or page. A round of fewer than 5 tiles splits each tile's pages' k's over 8 / na warps (2, 4 or
// 8), whose sums meet once in shared memory at the round's end. The loader fills a round's pages in
// (page, tile) order, so the warps advance through K together and share the ring's depth. A GEMV
// instruction first stages its input X [N, K] in shared memory, whole when it fits in the host's split of the pool (step_kernel.py, pool_split),
// else in blocks of whole pages' k's (x_block_k; staged again for each round), the compute warps
// passing a barrier around each staging.
//
// Weight formats: bf16 [rows, K] row-major (each page = 16 row segments, padded to a 64-byte
// odd multiple so that the fragment loads are conflict-free); 4-bit = swiftspec_mpi.gpu.w4a16's
// tile-major codes and (scale, offset) words (cuda/w4a16.cu's layout), dequantized to bf16 in
// registers (W = bf16(q * s + o)), the same unpack as w4a16.cu's E = 0 kernels.
//
// Watchdog: every counter wait gives up after `timeout_ns` (globaltimer), writes a record (code 1,
// the global instruction index, the block, the counter, its value, the target) into `err` (host-
// mapped pinned memory, so it survives anything), raises the abort flag, and every block then
// skips its waits (still draining the pages, so that the loader ends): the kernel ends and the
// host raises an error naming the instruction (every block left waiting also writes its wait into
// err[8 + 4 block ..]: the host names the earliest stuck one, the root of the others). A page
// that never arrives (a bug; the loader's wait for a free page lasts 4x the timeout, as long
// as the compute warps may wait on counters) writes code 2 and traps.
//
// Numerics: the chain's roundings (bf16 activations, x += bf16(a) rounded to bf16, RoPE's two
// roundings, bf16(bf16(silu(g)) * u), logits = float(bf16(acc))); attention in fp32 (P not
// rounded to bf16). Sums run in a different order than the chain's kernels.

#include <cuda_bf16.h>
#include <stdint.h>

#include "lop3.cuh"
#include "mma_bf16.cuh"
#include "mbarrier.cuh"

namespace step {

typedef __nv_bfloat16 bf16;

// Compute warps a block (8 by default; gpu/step_kernel.py builds -DSTEP_COMPUTE_WARPS=16 too).
#ifndef STEP_COMPUTE_WARPS
#define STEP_COMPUTE_WARPS 8
#endif
constexpr int COMPUTE_WARPS = STEP_COMPUTE_WARPS;
static_assert(COMPUTE_WARPS == 8 || COMPUTE_WARPS == 16, "8 or 16 compute warps");
// The attention head dim compiled in: 64 or 128 (gpu/step_kernel.py builds the model's), or 0 for
// both. Attention is most of the kernel's code (unrolled over a piece of 32 keys, one copy per
// head dim and row count): one head dim halves the text (step_kernel_mb1: 635 -> 353 KB) and the
// compile time.
#ifndef STEP_HEAD_DIM
#define STEP_HEAD_DIM 0
#endif
static_assert(STEP_HEAD_DIM == 0 || STEP_HEAD_DIM == 64 || STEP_HEAD_DIM == 128, "head dim 64 or 128");
constexpr int COMPUTE_THREADS = COMPUTE_WARPS * 32;
constexpr int THREADS = COMPUTE_THREADS + 32;
// Pages of 33 KB (bf16: 16 row segments of 2 KB; 4-bit: one 16 KB copy of codes + the scale words):
// one SM streams at 97-98 % of copy bandwidth with 16-32 KB a page and at 39 % with 8 KB pages of
// 512-byte segments, whatever the ring's depth (benchmarks/bench_step_stream.py): what a page
// costs is per copy and per mbarrier round, not per byte. A few pages in flight suffice.
// The page stride is the host's (Params.page_bytes): PAGE_BYTES when a bf16 weight is streamed,
// else the 4-bit page's codes and scale words only (17-20 KB), so that more pages are in flight.
constexpr int MAX_PAGES = 11;
constexpr int PAGE_BYTES = 33792;               // the largest page
constexpr int BF16_PAGE_K = 1024;               // k's of one bf16 page
constexpr int BF16_ROW_BYTES = BF16_PAGE_K * 2 + 64;   // 2112 = 64 mod 128: conflict-free rows
constexpr int Q4_PAGE_CHUNKS = 16;              // 128-k chunks of one 4-bit page
constexpr int Q4_SCALES_OFF = 16384;            // byte offset of the page's scale words
constexpr int RED_BYTES = COMPUTE_WARPS * 16 * 32 * 4;
constexpr int INSTR_WORDS = 8;
// Shared memory: red (the k-split's partial tiles, attention's scratch, between instructions the next
// one's RMSNorm weight), the pages' mbarriers, a flag, 1 / rms of the staged rows, the Params block,
// the running instruction's slot, rows_inv_rms's partial sums, X's mbarrier, then the pool: X staged [N rows of 2 kx + 64 bytes] (`xs_bytes`, the host's choice: the largest
// op input whole when that leaves MIN_PAGES pages, else blocks of kx k's) and the ring of
// `npages` pages after it.
constexpr int INV_OFF = RED_BYTES + 2 * MAX_PAGES * 8 + 16;   // 32 floats: the staged rows' 1 / rms
constexpr int PARAMS_OFF = INV_OFF + 32 * 4;    // the Params block, copied in at the start
constexpr int PARAMS_BYTES = 42 * 8;
constexpr int SLOT_OFF = PARAMS_OFF + PARAMS_BYTES;   // the running instruction: words, then its OpDesc or LayerDesc
constexpr int SLOT_BYTES = INSTR_WORDS * 4 + 11 * 8;
constexpr int PART_OFF = SLOT_OFF + SLOT_BYTES;       // 16 floats: rows_inv_rms's partial sums
constexpr int XBAR_OFF = PART_OFF + 16 * 4;           // the mbarrier of X's bulk copies (stage_x_bulk)
constexpr int HEAD_BYTES = (XBAR_OFF + 8 + 1023) / 1024 * 1024;   // red .. the X mbarrier
constexpr int SMEM_BYTES = 227 * 1024;
constexpr int POOL_BYTES = SMEM_BYTES - HEAD_BYTES;
// Timeline words of one instruction (gpu/step_timeline.py reads them): compute thread 0's wait
// from, run from, done at (after the signal), then two marks inside the instruction (GEMV: X staged
// and normalized, every page multiplied; ATTN: the new K/V appended and q loaded, the keys'
// softmax done), the epilogue's end (before the fence), and the loader's first and last page of
// the instruction issued (GEMV only; the first is taken before its wait for a free slot).
constexpr int TL_WORDS = 8;
enum Timeline { TL_WAIT = 0, TL_RUN = 1, TL_DONE = 2, TL_MARK1 = 3, TL_MARK2 = 4, TL_EPI = 5,
                TL_LOAD0 = 6, TL_LOAD1 = 7 };

enum Op { EMBED = 0, GEMV = 1, ATTN = 2 };
enum Kind { K_QKV = 0, K_O = 1, K_GU = 2, K_DOWN = 3, K_HEAD = 4 };

// Every field 8 bytes (the host packs them with struct 'Q' / 'q' / 'd').
struct OpDesc {
  const void* w;          // bf16 [rows, K] or uint8 codes [rows, K / 2] (tile-major)
  const uint32_t* so;     // 4-bit: (scale, offset) words [rows, K / group] (tile-major), else null
  const bf16* bias;       // [rows] or null
  const bf16* norm_w;     // QKV / gate|up / head: their input is RMSNorm(x) with this weight, else null
  int64_t rows, K, fmt, group;   // fmt 0 bf16, 1 4-bit
  int64_t kind, layer, n_instr;  // n_instr: instructions of the op
};

struct LayerDesc {
  const bf16* ln1;
  bf16* kc;               // [max_slots, nkv, hd]
  bf16* vc;
  int64_t pad;
};

struct Params {
  const int64_t* tokens;      // [N]
  const int64_t* positions;   // [N]
  const int64_t* slots;       // [N]
  const uint8_t* mask;        // [N, mask_stride]
  const int* n_valid;         // [1]
  bf16* x;                    // [N, H] residual
  bf16* qkv;                  // [N, QKV]
  bf16* o;                    // [N, nh * hd]
  bf16* h;                    // [N, I] SwiGLU's output (gate|up's epilogue), down's input
  float* logits;              // [N, V]
  int* counters;
  int* err;                   // host-mapped [8]
  const int* instr;           // [n, INSTR_WORDS]
  const int* block_start;     // [gridDim.x + 1]
  const OpDesc* ops;
  const LayerDesc* layers;
  const bf16* embed;          // [V_embed, H]
  const bf16* rope_cos;       // [rope_len, hd]
  const bf16* rope_sin;
  uint64_t* timeline;         // [n_instr, TL_WORDS] or null: per instruction, globaltimer ns (the
                              // profile of the schedule): TL_* below
  float* attn_part;           // attn_splits > 1: (max, sum) [splits, N, nh, 2], then O [splits, N, nh, hd]
  int64_t N, H, nh, nkv, hd, I, V, n_layers, max_slots, rope_len, mask_stride, qkv_cols, vocab_embed;
  int64_t n_counters, timeout_ns, npages, xs_bytes, attn_splits, page_bytes;
  double eps, scale_log2;
};
// swiftspec_mpi/gpu/step_kernel.py packs these with struct: keep the sizes in step.
static_assert(sizeof(OpDesc) == 11 * 8, "OpDesc layout");
static_assert(sizeof(LayerDesc) == 4 * 8, "LayerDesc layout");
static_assert(sizeof(Params) == PARAMS_BYTES, "Params layout");
static_assert(sizeof(OpDesc) <= 11 * 8 && sizeof(LayerDesc) <= 11 * 8 && PARAMS_OFF % 16 == 0 && SLOT_OFF % 8 == 0,
              "shared-memory copies of Params and of the running instruction");
static_assert(XBAR_OFF % 8 == 0 && XBAR_OFF + 8 <= HEAD_BYTES, "shared memory head");
static_assert(MAX_PAGES * Q4_SCALES_OFF <= POOL_BYTES, "pages (the host gives fewer when they are larger)");
static_assert(16 * BF16_ROW_BYTES <= PAGE_BYTES && BF16_ROW_BYTES % 128 == 64, "bf16 page");
static_assert(Q4_PAGE_CHUNKS * 1024 == Q4_SCALES_OFF && Q4_SCALES_OFF + Q4_PAGE_CHUNKS * 64 * 4 <= PAGE_BYTES,
              "4-bit page: codes, then the scale words of group 32");

// ------------------------------------------------------------------ small helpers
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ uint4 ldcg16(const void* p) {      // L2 only: data other blocks wrote
  uint4 r;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ uint2 ldcg8(const void* p) {
  uint2 r;
  asm volatile("ld.global.cg.v2.u32 {%0,%1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
__device__ __forceinline__ uint32_t ldcg4(const void* p) {
  uint32_t r;
  asm volatile("ld.global.cg.u32 %0, [%1];\n" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ float ldcg_bf16(const bf16* p) {
  unsigned short r;
  asm volatile("ld.global.cg.u16 %0, [%1];\n" : "=h"(r) : "l"(p));
  return __bfloat162float(__ushort_as_bfloat16(r));
}
__device__ __forceinline__ uint4 lds16(uint32_t addr) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
  return r;
}
__device__ __forceinline__ uint32_t lds4(uint32_t addr) {
  uint32_t r;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(r) : "r"(addr));
  return r;
}
// A strong, relaxed load at gpu scope (a poll: no acquire, so no emptying of L1 on each try).
__device__ __forceinline__ int ld_relaxed(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void compute_sync() { asm volatile("bar.sync 1, %0;\n" :: "n"(COMPUTE_THREADS) : "memory"); }
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ float2 unpack_bf16x2(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}

// Watchdog record (host-mapped memory): code, instruction, block, counter, value, target. The
// first reporter raises the abort flag and writes the record; the others only see the flag up.
__device__ void report(const Params& p, int code, int instr, int ctr, int value, int target) {
  if (atomicCAS(p.counters + p.n_counters - 2, 0, 1) == 0) {
    volatile int* e = p.err;
    e[1] = instr; e[2] = blockIdx.x; e[3] = ctr; e[4] = value; e[5] = target;
    __threadfence_system();
    e[0] = code;
    __threadfence_system();
  }
}

__device__ void mbar_wait(const Params& p, uint32_t bar, uint32_t parity, int instr, uint64_t limit_ns) {
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t t0 = globaltimer();
  while (!mbar_try_wait(bar, parity)) {
    if (globaltimer() - t0 > limit_ns) {
      report(p, 2, instr, -1, 0, 0);
      asm volatile("trap;");
    }
  }
}

// Compute thread 0 (or the loader's lane 0) stamps word w of instruction i's timeline when profiling.
__device__ __forceinline__ void mark(const Params& p, int i, int w) {
  if (p.timeline != nullptr) p.timeline[(int64_t)TL_WORDS * i + w] = globaltimer();
}

// Token t's RoPE row: its position clamped to the table.
__device__ __forceinline__ int64_t rope_pos(const Params& p, int t) {
  const int64_t pos = p.positions[t];
  return pos < 0 ? 0 : pos >= p.rope_len ? p.rope_len - 1 : pos;
}

// An ATTN instruction's word 7: rows | split << 8 | splits << 16 (step_schedule.attn_word).
struct AttnFields {
  int rows, split, splits;
};
__device__ __forceinline__ AttnFields attn_fields(int w) { return {w & 0xFF, (w >> 8) & 0xFF, w >> 16}; }

// Keys [kb, ke) of key range `split` of `splits` over the n_valid slots (ranges of whole 32s).
__device__ __forceinline__ void attn_key_range(int n_valid, int split, int splits, int& kb, int& ke) {
  const int per = ((n_valid + splits - 1) / splits + 31) / 32 * 32;
  kb = min(n_valid, split * per);
  ke = min(n_valid, kb + per);
}

__device__ __forceinline__ void prefetch_l2(const void* a) { asm volatile("prefetch.global.L2 [%0];\n" :: "l"(a)); }

// Compute warps 1.. while warp 0 waits on the instruction's counter: what the instruction reads
// that no instruction of this step writes. The wait's acquire empties the SM's L1 cache, so what
// the instruction reads right after it is put in shared memory first: the instruction's words
// and its OpDesc (GEMV) or LayerDesc (ATTN) into `slot`, a normalizing GEMV's RMSNorm weight
// into `wsm` (red: free between instructions; H <= RED_BYTES / 2). For attention, the cache's K
// and V rows of its key range are requested into L2 (the new tokens' rows are written by this
// step and read after the wait).
__device__ void preload_instr(const Params& p, const int* in, int* slot, bf16* wsm) {
  const int t = threadIdx.x - 32, nt = COMPUTE_THREADS - 32;
  if (t < INSTR_WORDS) slot[t] = in[t];
  int64_t* desc = reinterpret_cast<int64_t*>(slot + INSTR_WORDS);
  const int opc = in[0];
  if (opc == GEMV) {
    const OpDesc* op = p.ops + in[1];
    if (t < (int)(sizeof(OpDesc) / 8)) desc[t] = reinterpret_cast<const int64_t*>(op)[t];
    const bf16* nw = op->norm_w;
    const int H = (int)p.H;
    if (nw != nullptr && 2 * H <= RED_BYTES) {
      for (int c0 = t * 8; c0 < H; c0 += 4 * nt * 8) {      // 4 loads in flight a thread
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (c0 + u * nt * 8 < H) v[u] = *reinterpret_cast<const uint4*>(nw + c0 + u * nt * 8);
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (c0 + u * nt * 8 < H) *reinterpret_cast<uint4*>(wsm + c0 + u * nt * 8) = v[u];
      }
    }
  } else if (opc == ATTN) {
    const LayerDesc* L = p.layers + in[1];
    if (t < (int)(sizeof(LayerDesc) / 8)) desc[t] = reinterpret_cast<const int64_t*>(L)[t];
    const int hd = (int)p.hd;
    const AttnFields f = attn_fields(in[7]);
    const int kh = in[2] / (int)(p.nh / p.nkv);
    int kb_i, ke_i;
    attn_key_range(*p.n_valid, f.split, f.splits, kb_i, ke_i);
    const int lines = (hd * 2 + 127) / 128;
    const bf16* kc = L->kc;
    const bf16* vc = L->vc;
    for (int i = t; i < 2 * lines * (ke_i - kb_i); i += nt) {
      const int j = kb_i + i / (2 * lines), w = i % (2 * lines);
      prefetch_l2(((w & 1) ? vc : kc) + ((int64_t)j * p.nkv + kh) * hd + 64 * (w >> 1));
    }
  }
}

// Thread 0 of the compute warps waits until counters[ctr] >= target (or the abort flag is up),
// then the compute warps pass a barrier. Other threads pass ctr = -1.
__device__ void wait_counter(const Params& p, int ctr, int target, int instr) {
  if (threadIdx.x == 0 && ctr >= 0) {
    int* c = p.counters + ctr;
    int* abort_flag = p.counters + p.n_counters - 2;
    int v = ld_relaxed(c);
    if (v < target) {
      const uint64_t t0 = globaltimer();
      while ((v = ld_relaxed(c)) < target) {
        const bool aborted = ld_relaxed(abort_flag) != 0;
        if (aborted || globaltimer() - t0 > (uint64_t)p.timeout_ns) {
          if (!aborted) report(p, 1, instr, ctr, v, target);
          // every block left waiting says where, its first stuck wait only (the later ones of an
          // aborted block are consequences); the host names the earliest stuck wait
          volatile int* b = p.err + 8 + 4 * blockIdx.x;
          if (b[0] == 0) {
            b[1] = ctr; b[2] = v; b[3] = target;
            __threadfence_system();
            b[0] = instr + 1;
            __threadfence_system();
          }
          break;
        }
        __nanosleep(32);
      }
    }
    // the poll's read and this fence: an acquire pattern (the producers' release adds)
    asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
  }
  compute_sync();
}

// Thread 0, after a barrier of the compute warps: publish the block's writes and add one to
// counters[ctr]. The add is a gpu-scope release, cumulative over the writes the barrier ordered
// before it (the other threads' too), so no thread fences on its own; a reduction, not an atomic
// with a result, so the thread does not wait for the add's round trip.
__device__ __forceinline__ void signal(const Params& p, int ctr) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" :: "l"(p.counters + ctr) : "memory");
}

// The same add, returning the old value (the exit count: the last block out zeroes the counters).
__device__ __forceinline__ int signal_old(const Params& p, int ctr) {
  int old;
  asm volatile("atom.add.release.gpu.global.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(p.counters + ctr) : "memory");
  return old;
}

// RMSNorm folded into its consumers: the GEMVs whose input is RMSNorm(x) (QKV, gate|up, the head)
// stage x and normalize it themselves, so no block waits for one that normalizes for all.
// inv[r] = 1 / rms(x[r]) for the N rows of x, read from global memory (xs == 0) or from x staged
// whole in shared memory at xs (rows of xstride bytes); compute warps: 8 / N warps a row when
// N < 8, a warp a row from N = 8; `part` holds COMPUTE_WARPS floats; ends with a barrier.
__device__ void rows_inv_rms(const Params& p, float* inv, float* part, uint32_t xs = 0, int xstride = 0) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int H = (int)p.H, N = (int)p.N;
  int wpr = 1;                                                   // warps per row: a power of 2
  while (2 * wpr * N <= COMPUTE_WARPS) wpr *= 2;
  for (int r0 = 0; r0 < N; r0 += COMPUTE_WARPS / wpr) {
    const int r = r0 + warp / wpr, sub = warp % wpr;
    const bf16* xr = p.x + (int64_t)r * H;
    float ss = 0.f;
    if (r < N) {
#pragma unroll 4
      for (int c = (sub * 32 + lane) * 8; c < H; c += wpr * 256) {
        const uint4 v = xs != 0 ? lds16(xs + r * xstride + c * 2) : ldcg16(xr + c);
        const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = unpack_bf16x2(u[i]);
          ss = fmaf(f.x, f.x, ss);
          ss = fmaf(f.y, f.y, ss);
        }
      }
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) part[warp] = ss;
    compute_sync();
    if (r < N && sub == 0 && lane == 0) {
      float tot = 0.f;
      for (int i = 0; i < wpr; ++i) tot += part[warp + i];
      inv[r] = rsqrtf(tot / (float)H + (float)p.eps);
    }
    compute_sync();
  }
}

// x staged whole in shared memory (rows of xstride bytes, H columns) normalized in place: inv from
// the staged rows, then each row to bf16(x * inv * w), the chain's RMSNorm rounding (the caller's
// barrier precedes it).
__device__ void normalize_staged(const Params& p, const bf16* w, uint32_t xs, int xstride, float* inv, float* part) {
  const int H = (int)p.H, N = (int)p.N;
  rows_inv_rms(p, inv, part, xs, xstride);
  for (int i = threadIdx.x; i < N * (H / 8); i += COMPUTE_THREADS) {
    const int r = i / (H / 8), c = (i % (H / 8)) * 8;
    const uint32_t a = xs + r * xstride + c * 2;
    const uint4 v = lds16(a);
    const uint4 wv = *reinterpret_cast<const uint4*>(w + c);
    const uint32_t u[4] = {v.x, v.y, v.z, v.w}, wu[4] = {wv.x, wv.y, wv.z, wv.w};
    const float iv = inv[r];
    uint32_t o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = unpack_bf16x2(u[k]), g = unpack_bf16x2(wu[k]);
      o[k] = pack_bf16x2(f.x * iv * g.x, f.y * iv * g.y);
    }
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" :: "r"(a), "r"(o[0]), "r"(o[1]), "r"(o[2]), "r"(o[3])
                 : "memory");
  }
}

// ------------------------------------------------------------------ pages of a GEMV instruction
// A page = one 16-row tile's weights over `page_k` k's (bf16: 1024 k's, 16 row segments of 2 KB at
// a BF16_ROW_BYTES pitch; 4-bit: 16 chunks of 128 k's, the tile-major codes then the scale words).
// A GEMV instruction runs its `ntiles` tiles in rounds of up to 8 (one tile a warp, 128 rows): in
// round r, `na` = min(8, ntiles - 8 r) tiles; the loader fills the ring in the order
// (page j, tile i of the round), so the page (i, j) of the round is ring sequence number
//   seq = base + j * na + i          (base: the pages of the block's earlier rounds)
// and is computed by the ks = k_split(na) warps i + na * s (s < ks): ks = 1 from 5 tiles on, else
// 8 / na rounded down to 2, 4 or 8; warp s of a tile takes the page's k-steps (bf16) or chunks
// (4-bit) s, s + ks, ..., and the ks partial sums meet once, in `red`, at the end of the round.
// Every compute warp still passes every page in seq order: it waits for the page's `full`
// mbarrier, does its part if it has one, and arrives once on the page's `empty` mbarrier (count
// 8). That keeps the parity waits exact: a warp waiting for fill f of a slot has seen fill f - 1
// land (it passed the slot's previous page) and fill f + 1 cannot start before its own arrival;
// were a page released by its owners alone, a warp skipping other warps' pages could see a
// slot's parity two fills away and read a page not yet there. tests/test_step_schedule.py holds
// the same index math on the host (the order checked against the loader's, the handshake run
// step by step with that parity bound asserted).
// A position in the ring of pages, advanced one page at a time: slot = seq % npages and parity =
// (seq / npages) & 1 (the phase of the slot's `full` mbarrier that page seq completes), kept
// without a division a page.
struct RingCursor {
  int slot = 0, parity = 0;
  __device__ __forceinline__ void next(int np) {
    if (++slot == np) {
      slot = 0;
      parity ^= 1;
    }
  }
};

struct Page {
  int tile, k0, kspan;    // k0, kspan in k's (4-bit: multiples of 128)
};

__device__ __forceinline__ int page_k(const OpDesc& op) { return op.fmt == 0 ? BF16_PAGE_K : Q4_PAGE_CHUNKS * 128; }

__device__ __forceinline__ int pages_per_tile(const OpDesc& op) {
  return (int)((op.K + page_k(op) - 1) / page_k(op));
}

__device__ __forceinline__ Page page_of(const OpDesc& op, int tile, int j) {
  Page pg;
  pg.tile = tile;
  pg.k0 = j * page_k(op);
  pg.kspan = min(page_k(op), (int)op.K - pg.k0);
  return pg;
}

// The op's tile that round-local tile ti (of na) of the round starting at r0 computes: the run
// tile0 + r0 + ti, except for gate|up, whose instructions hold pairs of tiles (tile0: the first
// pair; ntiles = 2 pairs): in a round, tiles ti < na / 2 are gate tiles p0 + ti and the others
// the up tiles of the same rows (I / 16 tiles further), p0 = tile0 + r0 / 2, so that the
// epilogue has both of SwiGLU's inputs.
__device__ __forceinline__ int round_tile(const OpDesc& op, int tile0, int r0, int na, int ti) {
  if (op.kind != K_GU) return tile0 + r0 + ti;
  const int half = na / 2, p0 = tile0 + r0 / 2;
  return ti < half ? p0 + ti : (int)(op.rows / 32) + p0 + ti - half;
}

// A warp's m16n8 C fragments (acc[mb][e]: rows g, g + 8 of a tile x tokens 8 mb + 2 q, + 1) in
// shared memory: r[row 16][token 32].
__device__ __forceinline__ int frag_at(int mb, int e, int g, int q) {
  return (g + (e >= 2 ? 8 : 0)) * 32 + 8 * mb + 2 * q + (e & 1);
}

// Warps sharing each tile's pages in a round of `na` tiles.
// (the largest power of 2 with na * ks <= COMPUTE_WARPS)
__device__ __forceinline__ int k_split(int na) {
  int ks = 1;
  while (2 * ks * na <= COMPUTE_WARPS) ks *= 2;
  return ks;
}

// k's of X staged at a time: all K when N rows of 2 K + 64 bytes fit in xs_bytes, else the
// largest multiple of the page's k's that fits (the host makes xs_bytes hold at least one page's).
__device__ __forceinline__ int x_block_k(int64_t xs_bytes, int N, int K, int pk) {
  const int fit = (int)((xs_bytes / N - 64) / 2);
  return K <= fit ? K : fit / pk * pk;
}

// Loader lane: issue the copies of one page into `dst` (shared address) on mbarrier `bar`.
__device__ void load_page(const OpDesc& op, const Page& pg, uint32_t dst, uint32_t bar, int lane, uint64_t pol) {
  const int64_t K = op.K;
  if (op.fmt == 0) {
    const uint32_t bytes = (uint32_t)pg.kspan * 2;
    if (lane == 0) mbar_expect_tx(bar, bytes * 16);
    __syncwarp();
    if (lane < 16) {
      const bf16* src = reinterpret_cast<const bf16*>(op.w) + ((int64_t)pg.tile * 16 + lane) * K + pg.k0;
      bulk_copy(dst + lane * BF16_ROW_BYTES, src, bytes, bar, pol);
    }
  } else {
    const int c0 = pg.k0 / 128, nch = pg.kspan / 128;
    const int SW = 128 / (int)op.group;
    const uint32_t code_bytes = 1024u * nch, so_bytes = 64u * SW * nch;
    if (lane == 0) {
      mbar_expect_tx(bar, code_bytes + so_bytes);
      const uint8_t* q = reinterpret_cast<const uint8_t*>(op.w) + (int64_t)pg.tile * 16 * (K / 2) + 1024 * (int64_t)c0;
      const uint32_t* so = op.so + (int64_t)pg.tile * 16 * (K / op.group) + 16 * SW * (int64_t)c0;
      bulk_copy(dst, q, code_bytes, bar, pol);
      bulk_copy(dst + Q4_SCALES_OFF, so, so_bytes, bar, pol);
    }
  }
}

// The O projection's input when attention ran in key ranges: 8 consecutive columns k (one head,
// k % 8 == 0) of token row `row`, the ranges' partial softmax sums merged (online, MERGE_BATCH
// ranges' loads in flight at once: no load waits for a max), rounded to bf16 as the one-range
// path rounds O.
constexpr int MERGE_BATCH = 4;
__device__ __forceinline__ uint4 load_o_merged(const Params& p, int row, int k) {
  const int hd = (int)p.hd, nh = (int)p.nh, N = (int)p.N, S = (int)p.attn_splits;
  const int hq = k / hd, d = k % hd;
  const float* ml = p.attn_part;
  const float* po = p.attn_part + 2 * (int64_t)S * N * nh;
  float M = -INFINITY, lsum = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int s0 = 0; s0 < S; s0 += MERGE_BATCH) {
    float2 m_l[MERGE_BATCH];
    float4 a[MERGE_BATCH], b[MERGE_BATCH];
#pragma unroll
    for (int u = 0; u < MERGE_BATCH; ++u) {
      const int64_t i = ((int64_t)min(s0 + u, S - 1) * N + row) * nh + hq;
      m_l[u] = __ldcg(reinterpret_cast<const float2*>(ml + 2 * i));
      a[u] = __ldcg(reinterpret_cast<const float4*>(po + i * hd + d));
      b[u] = __ldcg(reinterpret_cast<const float4*>(po + i * hd + d + 4));
    }
#pragma unroll
    for (int u = 0; u < MERGE_BATCH; ++u) {
      const float m_new = fmaxf(M, m_l[u].x);
      if (s0 + u >= S || m_new == -INFINITY) continue;        // a range with no unmasked key
      const float f_old = exp2f(M - m_new), f = exp2f(m_l[u].x - m_new);
      lsum = lsum * f_old + m_l[u].y * f;
      acc[0] = acc[0] * f_old + a[u].x * f; acc[1] = acc[1] * f_old + a[u].y * f;
      acc[2] = acc[2] * f_old + a[u].z * f; acc[3] = acc[3] * f_old + a[u].w * f;
      acc[4] = acc[4] * f_old + b[u].x * f; acc[5] = acc[5] * f_old + b[u].y * f;
      acc[6] = acc[6] * f_old + b[u].z * f; acc[7] = acc[7] * f_old + b[u].w * f;
      M = m_new;
    }
  }
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = lsum > 0.f ? acc[2 * i] / lsum : 0.f, hi = lsum > 0.f ? acc[2 * i + 1] / lsum : 0.f;
    o[i] = pack_bf16x2(lo, hi);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// A (scale, offset) word (bf16 s low, o high) as the bf16x2 pairs (s, s) and (o, o).
__device__ __forceinline__ void so_pairs(uint32_t so, uint32_t& s2, uint32_t& o2) {
  s2 = (so & 0xFFFFu) | (so << 16);
  o2 = (so >> 16) | (so & 0xFFFF0000u);
}

// Nibbles i and i + 4 of a code word as bf16x2 (q * s + o): the nibble ORed into the mantissa of
// 128 (exact, one lop3), 128 subtracted, then one fma in fp32 rounded to bf16.
__device__ __forceinline__ uint32_t dq_pair(uint32_t word, int i, uint32_t s2, uint32_t o2) {
  const uint32_t t = lop3_andor(word >> (4 * i), 0x000F000Fu, 0x43004300u);   // bf16 (128 + q)
  __nv_bfloat162 tv = *reinterpret_cast<const __nv_bfloat162*>(&t);
  const uint32_t c128 = 0x43004300u;
  const __nv_bfloat162 q = __hsub2(tv, *reinterpret_cast<const __nv_bfloat162*>(&c128));
  const __nv_bfloat162 r = __hfma2(q, *reinterpret_cast<const __nv_bfloat162*>(&s2),
                                   *reinterpret_cast<const __nv_bfloat162*>(&o2));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// The 4-bit pages' MMAs for SW = 128 / group scale words a 128-k chunk and row: a chunk's four
// parts of 32 k's share one group at g128 (its scale words loaded and split into (s, s), (o, o)
// once a chunk), two parts one at g64, each part its own at g32. xr: this lane's token row of
// each m-block in the staged X, at the page's first k.
template <int MB, int SW>
__device__ __forceinline__ void page_mma_q4(const Page& pg, uint32_t page, const uint32_t (&xr)[MB], int sub, int ks,
                                            float (&acc)[MB][4], float (&acc2)[MB][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int nch = pg.kspan / 128;
#pragma unroll 2
  for (int c = sub; c < nch; c += ks) {
    const uint32_t cb = page + c * 1024;
    const uint4 wa = lds16(cb + g * 64 + q * 16);
    const uint4 wb = lds16(cb + (g + 8) * 64 + q * 16);
    const uint32_t sb = page + Q4_SCALES_OFF + c * 64 * SW;
    const uint32_t wav[4] = {wa.x, wa.y, wa.z, wa.w}, wbv[4] = {wb.x, wb.y, wb.z, wb.w};
    uint32_t sa2 = 0, oa2 = 0, sb2 = 0, ob2 = 0;
#pragma unroll
    for (int part = 0; part < 4; ++part) {
      if (part % (4 / SW) == 0) {                  // the part opens a group: its scale words
        const int gi = part * SW / 4;
        so_pairs(lds4(sb + (g * SW + gi) * 4), sa2, oa2);
        so_pairs(lds4(sb + ((g + 8) * SW + gi) * 4), sb2, ob2);
      }
      const uint32_t a0 = dq_pair(wav[part], 0, sa2, oa2), a1 = dq_pair(wav[part], 1, sa2, oa2);
      const uint32_t a2 = dq_pair(wav[part], 2, sa2, oa2), a3 = dq_pair(wav[part], 3, sa2, oa2);
      const uint32_t b0 = dq_pair(wbv[part], 0, sb2, ob2), b1 = dq_pair(wbv[part], 1, sb2, ob2);
      const uint32_t b2 = dq_pair(wbv[part], 2, sb2, ob2), b3 = dq_pair(wbv[part], 3, sb2, ob2);
      const uint32_t xo = (c * 128 + 32 * part + 8 * q) * 2;
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) {
        const uint4 xv = lds16(xr[mb] + xo);
        mma_bf16(acc[mb], a0, b0, a1, b1, xv.x, xv.y);
        mma_bf16(acc2[mb], a2, b2, a3, b3, xv.z, xv.w);
      }
    }
  }
}

// One whole page's MMAs by one warp: acc[mb] += W[16 rows of the tile, the page's k's] x X[8 tokens
// of m-block mb, the same k's]^T. xs: the staged X block (rows of xstride bytes) whose first
// column is k = xk0.
// This warp takes part `sub` of `ks` (the k-steps / chunks sub, sub + ks, ...).
template <int MB>
__device__ __forceinline__ void page_mma(const OpDesc& op, const Page& pg, uint32_t page, uint32_t xs, int xstride,
                                         int xk0, int N, int sub, int ks, float (&acc)[MB][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  // two accumulator sets (each step's second mma into acc2): half the dependent mma chain
  float acc2[MB][4];
#pragma unroll
  for (int mb = 0; mb < MB; ++mb) acc2[mb][0] = acc2[mb][1] = acc2[mb][2] = acc2[mb][3] = 0.f;
  uint32_t xr[MB];       // this lane's token row of each m-block (rows past N read row N-1, dropped)
#pragma unroll
  for (int mb = 0; mb < MB; ++mb) xr[mb] = xs + min(8 * mb + g, N - 1) * xstride + (pg.k0 - xk0) * 2;
  if (op.fmt == 0) {
    const int steps = pg.kspan / 32;
    const uint32_t ra = page + g * BF16_ROW_BYTES + q * 16, rb = ra + 8 * BF16_ROW_BYTES;
#pragma unroll 4
    for (int s = sub; s < steps; s += ks) {
      const uint4 wa = lds16(ra + s * 64);
      const uint4 wb = lds16(rb + s * 64);
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) {
        const uint4 xv = lds16(xr[mb] + s * 64 + q * 16);
        mma_bf16(acc[mb], wa.x, wb.x, wa.y, wb.y, xv.x, xv.y);
        mma_bf16(acc2[mb], wa.z, wb.z, wa.w, wb.w, xv.z, xv.w);
      }
    }
  } else if (op.group == 128) {
    page_mma_q4<MB, 1>(pg, page, xr, sub, ks, acc, acc2);
  } else if (op.group == 64) {
    page_mma_q4<MB, 2>(pg, page, xr, sub, ks, acc, acc2);
  } else {
    page_mma_q4<MB, 4>(pg, page, xr, sub, ks, acc, acc2);
  }
#pragma unroll
  for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[mb][e] += acc2[mb][e];
  }
}

// ------------------------------------------------------------------ instructions
__device__ void run_embed(const Params& p) {
  const int H = (int)p.H;
  for (int i = threadIdx.x; i < p.N * (H / 8); i += COMPUTE_THREADS) {
    const int r = i / (H / 8), c = (i % (H / 8)) * 8;
    int64_t t = p.tokens[r];
    t = t < 0 ? 0 : t >= p.vocab_embed ? p.vocab_embed - 1 : t;
    *reinterpret_cast<uint4*>(p.x + (int64_t)r * H + c) = *reinterpret_cast<const uint4*>(p.embed + t * H + c);
  }
}

// The op's epilogue for output row n (of W; gate|up: of the gate rows) and token row m: value v
// (fp32 sum over K); extra: O and down's x[m, n] before the add (read before the instruction's
// MMAs), gate|up's sum of the up row n + I.
__device__ __forceinline__ void gemv_out(const Params& p, const OpDesc& op, int64_t n, int m, float v, float extra) {
  switch ((int)op.kind) {
    case K_QKV: {
      if (op.bias) v += __bfloat162float(op.bias[n]);
      p.qkv[(int64_t)m * p.qkv_cols + n] = __float2bfloat16_rn(v);
      break;
    }
    case K_O:
    case K_DOWN: {
      if (op.bias) v += __bfloat162float(op.bias[n]);
      p.x[(int64_t)m * p.H + n] = __float2bfloat16_rn(extra + round_bf16(v));
      break;
    }
    case K_GU: {           // h = bf16(bf16(silu(g)) * u) of the rounded gate and up sums
      const float g = round_bf16(v), u = round_bf16(extra);
      p.h[(int64_t)m * p.I + n] = __float2bfloat16_rn(round_bf16(g / (1.f + __expf(-g))) * u);
      break;
    }
    default: p.logits[(int64_t)m * p.V + n] = round_bf16(v); break;
  }
}

// X[:, xk0 : xk0 + kn] (N rows; merge: O's input, the attention's key ranges merged) into shared memory at xs,
// rows of xstride bytes, by the compute threads: X_BATCH 16-byte L2 loads in flight a thread
// before their stores (a load-store pair at a time would pay an L2 round trip per 16 bytes).
constexpr int X_BATCH = 4;
__device__ __forceinline__ void stage_x(const bf16* X, int64_t ld, int N, int xk0, int kn,
                                        uint32_t xs, int xstride, const Params* merge, const bf16* norm_w,
                                        const float* inv) {
  const int per_row = kn / 8, total = N * per_row;
  for (int i0 = threadIdx.x; i0 < total; i0 += X_BATCH * COMPUTE_THREADS) {
    uint4 v[X_BATCH];
#pragma unroll
    for (int u = 0; u < X_BATCH; ++u) {
      const int i = i0 + u * COMPUTE_THREADS;
      if (i < total) {
        const int r = i / per_row, c = (i - r * per_row) * 8;
        v[u] = merge != nullptr ? load_o_merged(*merge, r, xk0 + c) : ldcg16(X + (int64_t)r * ld + xk0 + c);
      }
    }
#pragma unroll
    for (int u = 0; u < X_BATCH; ++u) {
      const int i = i0 + u * COMPUTE_THREADS;
      if (i < total) {
        const int r = i / per_row, c = (i - r * per_row) * 8;
        if (norm_w != nullptr) {            // bf16(x * inv * w): the chain's RMSNorm rounding
          const uint4 wv = *reinterpret_cast<const uint4*>(norm_w + xk0 + c);
          const uint32_t xu[4] = {v[u].x, v[u].y, v[u].z, v[u].w}, wu[4] = {wv.x, wv.y, wv.z, wv.w};
          uint32_t o[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const float2 f = unpack_bf16x2(xu[k]), g = unpack_bf16x2(wu[k]);
            o[k] = pack_bf16x2(f.x * inv[r] * g.x, f.y * inv[r] * g.y);
          }
          v[u] = make_uint4(o[0], o[1], o[2], o[3]);
        }
        asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" :: "r"(xs + r * xstride + c * 2), "r"(v[u].x),
                     "r"(v[u].y), "r"(v[u].z), "r"(v[u].w) : "memory");
      }
    }
  }
}

// X[:, xk0 : xk0 + kn] (N rows) into shared memory at xs (rows of xstride bytes) as N bulk copies
// of kn * 2 bytes on the mbarrier `bar`, issued by thread 0: one round trip, however many rows
// (stage_x's loads cost one a X_BATCH 16-byte chunks a thread). Every compute thread waits for
// the phase `phase` of `bar` and flips it. The proxy fences order what the issuing thread has seen
// before the copies: the generic writes of X by other blocks (acquired by the counter wait) and
// this block's accesses of the area (ordered by the caller's barrier). One fence per state space:
// `fence.proxy.async` of all spaces is a GPU-scope MEMBAR, these two are a CTA one and view fences.
__device__ __forceinline__ void stage_x_bulk(const Params& p, const bf16* X, int64_t ld, int N, int xk0, int kn,
                                             uint32_t xs, int xstride, uint32_t bar, uint32_t& phase, int instr) {
  if (threadIdx.x == 0) {
    asm volatile("fence.proxy.async.global;\nfence.proxy.async.shared::cta;\n" ::: "memory");
    mbar_expect_tx(bar, (uint32_t)(N * kn * 2));
    for (int r = 0; r < N; ++r) bulk_copy(xs + r * xstride, X + (int64_t)r * ld + xk0, (uint32_t)kn * 2, bar);
  }
  mbar_wait(p, bar, phase, instr, (uint64_t)p.timeout_ns);
  phase ^= 1;
}

// Tiles [tile0, tile0 + ntiles) of one GEMV op (gate|up: ntiles / 2 pairs from pair tile0,
// round_tile), in rounds of up to 8 tiles (the ring order above). X [N, K] is staged in shared
// memory once for the instruction when it fits, else in blocks of x_block_k k's, again for each
// round; the compute warps pass a barrier only around a staging, at a round's k-split reduction
// and around gate|up's hand-over of the up sums.
template <int MB>
__device__ void run_gemv(const Params& p, const OpDesc& op_g, int tile0, int ntiles, uint32_t pages, uint32_t full,
                         uint32_t empty, RingCursor& ring, float* red, float* inv, float* part, uint32_t xs,
                         uint32_t xbar, uint32_t& xphase, int instr) {
  const OpDesc op = op_g;       // in registers for the loops
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int N = (int)p.N, K = (int)op.K, np = (int)p.npages;
  const bf16* X;
  int64_t ld;
  switch ((int)op.kind) {
    case K_O: X = p.o; ld = p.nh * p.hd; break;
    case K_DOWN: X = p.h; ld = p.I; break;
    default: X = p.x; ld = p.H; break;         // RMSNorm(x) (op.norm_w), normalized while staged
  }
  const int pk = page_k(op), npt = pages_per_tile(op);
  const int kx = x_block_k(p.xs_bytes, N, K, pk);
  const int xstride = kx * 2 + 64;             // 64 mod 128 bytes: conflict-free fragment loads
  const int nxb = (K + kx - 1) / kx, ppx = kx / pk;
  const bf16* norm_w = op.norm_w;
  if (norm_w != nullptr && nxb > 1) rows_inv_rms(p, inv, part);   // blocks of x: 1 / rms first
  for (int r0 = 0; r0 < ntiles; r0 += COMPUTE_WARPS) {
    const int na = min(COMPUTE_WARPS, ntiles - r0), ks = k_split(na);
    const int ti = warp % na, sub = warp / na;                // this warp's tile of the round, its k-split part
    const bool active = sub < ks;
    float acc[MB][4];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) acc[mb][0] = acc[mb][1] = acc[mb][2] = acc[mb][3] = 0.f;
    // O and down add into x: the x values this warp's outputs update, loaded now so that the L2
    // round trip overlaps the MMAs instead of following them
    float x_old[MB][4];
    const int64_t n0 = (int64_t)round_tile(op, tile0, r0, na, ti) * 16;
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = 8 * mb + 2 * q + (e & 1);
        x_old[mb][e] = (op.kind == K_O || op.kind == K_DOWN) && sub == 0 && m < N
                           ? ldcg_bf16(p.x + (int64_t)m * p.H + n0 + g + (e >= 2 ? 8 : 0)) : 0.f;
      }
    }
    for (int xb = 0; xb < nxb; ++xb) {
      const int xk0 = xb * kx;
      if (r0 == 0 || nxb > 1) {
        if (r0 > 0 || xb > 0) compute_sync();                // every warp is done with the staged block
        const bool merge = op.kind == K_O && p.attn_splits > 1, norm_in_stage = nxb > 1 && norm_w != nullptr;
        if (!merge && !norm_in_stage)          // X as it is in memory: bulk copies
          stage_x_bulk(p, X, ld, N, xk0, min(kx, K - xk0), xs, xstride, xbar, xphase, instr);
        else
          stage_x(X, ld, N, xk0, min(kx, K - xk0), xs, xstride, merge ? &p : nullptr, norm_in_stage ? norm_w : nullptr, inv);
        compute_sync();
        if (norm_w != nullptr && nxb == 1) {   // x staged whole: normalized in place
          // the weight preload_instr put in red when it fits, else from global memory
          normalize_staged(p, 2 * p.H <= RED_BYTES ? reinterpret_cast<const bf16*>(red) : norm_w, xs, xstride, inv, part);
          compute_sync();
        }
        if (r0 == 0 && xb == 0 && threadIdx.x == 0) mark(p, instr, TL_MARK1);
      }
      {
        const int j_end = xb == nxb - 1 ? npt : (xb + 1) * ppx;
        for (int j = xb * ppx; j < j_end; ++j) {
          for (int t = 0; t < na; ++t) {                       // every page passed, this warp's done
            const int slot = ring.slot;
            mbar_wait(p, full + 8 * slot, ring.parity, instr, (uint64_t)p.timeout_ns);
            ring.next(np);
            if (active && t == ti)
              page_mma<MB>(op, page_of(op, (int)(n0 / 16), j), pages + slot * (uint32_t)p.page_bytes, xs, xstride, xk0, N, sub,
                           ks, acc);
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + 8 * slot);
          }
        }
      }
    }
    if (r0 + COMPUTE_WARPS >= ntiles && threadIdx.x == 0) mark(p, instr, TL_MARK2);
    if (ks > 1) {
      // the k-split parts meet: red[warp][row 16][token 32]; warp ti (sub 0) adds the others'
      if (active && sub > 0) {
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
          for (int e = 0; e < 4; ++e) red[warp * 512 + frag_at(mb, e, g, q)] = acc[mb][e];
        }
      }
      compute_sync();
      if (sub == 0) {
        for (int s = 1; s < ks; ++s) {
#pragma unroll
          for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mb][e] += red[(warp + na * s) * 512 + frag_at(mb, e, g, q)];
          }
        }
      }
    }
    // gate|up: the up tiles' sums go to the gate tiles of the same rows, in red[ti] (ti < na: not
    // the k-split's parts, which are warps na..)
    const bool paired = op.kind == K_GU;
    if (paired) {
      if (sub == 0 && ti >= na / 2) {
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
          for (int e = 0; e < 4; ++e) red[ti * 512 + frag_at(mb, e, g, q)] = acc[mb][e];
        }
      }
      compute_sync();
    }
    if (sub == 0 && (!paired || ti < na / 2)) {
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = 8 * mb + 2 * q + (e & 1);
          const float extra = paired ? red[(ti + na / 2) * 512 + frag_at(mb, e, g, q)] : x_old[mb][e];
          if (m < N) gemv_out(p, op, n0 + g + (e >= 2 ? 8 : 0), m, acc[mb][e], extra);
        }
      }
    }
    if (ks > 1 || paired) compute_sync();                     // red is free again
  }
  if (threadIdx.x == 0) mark(p, instr, TL_EPI);
  compute_sync();               // the barrier that orders every warp's outputs before the signal
}

// One warp's online softmax over keys [kb, ke) for the nrows (<= R) query rows of an attention
// instruction (qs: [8][HD] floats in shared memory; row r is token t0 + r): lane = key within a
// piece of 32. A piece's loads go out together, before any arithmetic: the lane's mask bytes
// (one a row) and K row (HD / 8 16-byte loads), and the piece's 32 V rows (lane = HD / 32 dims),
// so a piece costs one L2 round trip, and every row of the instruction uses the same K / V
// registers (the rows share the KV head). Writes the warp's partials (max, sum, O) of row r to
// pm / pl [warp * nrows + r] and po [(warp * nrows + r) * HD ..]. R = 1, 2 are inlined into
// run_attn (not inlined itself, so its registers stay out of the GEMV loops' budget); R = 4, 8
// are called (attn_warp_outlined: their rows' state beside a piece's K / V spills a little).
template <int HD, int R>
__device__ __forceinline__ void attn_warp(const float* qs, int nrows, const uint8_t* mask, int64_t mask_stride,
                                          int t0, const bf16* kbase, const bf16* vbase, int64_t kv_stride, int kb,
                                          int ke, float sl2, float* pm, float* pl, float* po) {
  constexpr int DPL = HD / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float m_run[R], l_run[R], o[R][DPL];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m_run[r] = -INFINITY;
    l_run[r] = 0.f;
#pragma unroll
    for (int e = 0; e < DPL; ++e) o[r][e] = 0.f;
  }
  for (int j0 = kb; j0 < ke; j0 += 32) {
    const int j = j0 + lane, jc = min(j, ke - 1);          // keys past ke read key ke - 1, dropped
    uint8_t keep[R];
#pragma unroll
    for (int r = 0; r < R; ++r) keep[r] = r < nrows ? mask[(int64_t)(t0 + r) * mask_stride + jc] : 0;
    const bf16* kr = kbase + (int64_t)jc * kv_stride;
    uint4 kv[HD / 8];
#pragma unroll
    for (int c = 0; c < HD / 8; ++c) kv[c] = ldcg16(kr + 8 * c);
    uint32_t v[32][DPL / 2];
#pragma unroll
    for (int jj = 0; jj < 32; ++jj) {
      const bf16* vr = vbase + (int64_t)min(j0 + jj, ke - 1) * kv_stride + lane * DPL;
      if constexpr (DPL == 4) {
        const uint2 w = ldcg8(vr);
        v[jj][0] = w.x;
        v[jj][1] = w.y;
      } else {
        v[jj][0] = ldcg4(vr);
      }
    }
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = 0.f;
#pragma unroll
    for (int c = 0; c < HD / 8; ++c) {
      const uint32_t u[4] = {kv[c].x, kv[c].y, kv[c].z, kv[c].w};
      float f[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 t = unpack_bf16x2(u[e]);
        f[2 * e] = t.x;
        f[2 * e + 1] = t.y;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < nrows) {
          const float4 qa = *reinterpret_cast<const float4*>(qs + r * HD + 8 * c);
          const float4 qb = *reinterpret_cast<const float4*>(qs + r * HD + 8 * c + 4);
          float d = s[r];
          d = fmaf(qa.x, f[0], d); d = fmaf(qa.y, f[1], d); d = fmaf(qa.z, f[2], d); d = fmaf(qa.w, f[3], d);
          d = fmaf(qb.x, f[4], d); d = fmaf(qb.y, f[5], d); d = fmaf(qb.z, f[6], d); d = fmaf(qb.w, f[7], d);
          s[r] = d;
        }
      }
    }
    float p_own[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      p_own[r] = 0.f;
      if (r < nrows) {
        const float sr = j < ke && keep[r] ? s[r] * sl2 : -INFINITY;
        float mx = sr;
#pragma unroll
        for (int off = 16; off; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float m_new = fmaxf(m_run[r], mx);
        if (m_new != -INFINITY) {                          // else no key of the row so far: all stays 0
          const float alpha = exp2f(m_run[r] - m_new);
          p_own[r] = exp2f(sr - m_new);
          float ps = p_own[r];
#pragma unroll
          for (int off = 16; off; off >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, off);
          l_run[r] = l_run[r] * alpha + ps;
#pragma unroll
          for (int e = 0; e < DPL; ++e) o[r][e] *= alpha;
          m_run[r] = m_new;
        }
      }
    }
#pragma unroll
    for (int jj = 0; jj < 32; ++jj) {
      float vf[DPL];
#pragma unroll
      for (int e = 0; e < DPL / 2; ++e) {
        const float2 t = unpack_bf16x2(v[jj][e]);
        vf[2 * e] = t.x;
        vf[2 * e + 1] = t.y;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < nrows) {
          const float pj = __shfl_sync(0xffffffffu, p_own[r], jj);     // 0 for masked keys and j >= ke
#pragma unroll
          for (int e = 0; e < DPL; ++e) o[r][e] = fmaf(pj, vf[e], o[r][e]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r < nrows) {
      const int w = warp * nrows + r;
      if (lane == 0) { pm[w] = m_run[r]; pl[w] = l_run[r]; }
#pragma unroll
      for (int e = 0; e < DPL; ++e) po[w * HD + lane * DPL + e] = o[r][e];
    }
  }
}

// attn_warp called, not inlined (R = 4, 8).
template <int HD, int R>
__device__ __noinline__ void attn_warp_outlined(const float* qs, int nrows, const uint8_t* mask, int64_t mask_stride,
                                                int t0, const bf16* kbase, const bf16* vbase, int64_t kv_stride,
                                                int kb, int ke, float sl2, float* pm, float* pl, float* po) {
  attn_warp<HD, R>(qs, nrows, mask, mask_stride, t0, kbase, vbase, kv_stride, kb, ke, sl2, pm, pl, po);
}

// attn_warp with R = the smallest of 1, 2, 4, 8 that holds nrows (an instruction's rows,
// step_schedule.attn_rows: 1-2 up to N = 8 on 32 heads and 132 blocks, 8 at N = 32).
template <int HD>
__device__ __forceinline__ void attn_rows_warp(const float* qs, int nrows, const uint8_t* mask, int64_t mask_stride,
                                               int t0, const bf16* kbase, const bf16* vbase, int64_t kv_stride,
                                               int kb, int ke, float sl2, float* pm, float* pl, float* po) {
  if (nrows == 1) attn_warp<HD, 1>(qs, 1, mask, mask_stride, t0, kbase, vbase, kv_stride, kb, ke, sl2, pm, pl, po);
  else if (nrows == 2) attn_warp<HD, 2>(qs, 2, mask, mask_stride, t0, kbase, vbase, kv_stride, kb, ke, sl2, pm, pl, po);
  else if (nrows <= 4) attn_warp_outlined<HD, 4>(qs, nrows, mask, mask_stride, t0, kbase, vbase, kv_stride, kb, ke, sl2, pm, pl, po);
  else attn_warp_outlined<HD, 8>(qs, nrows, mask, mask_stride, t0, kbase, vbase, kv_stride, kb, ke, sl2, pm, pl, po);
}

// Attention of rows [row0, row0 + nrows) of query head hq (nrows <= 8) in layer `layer`, over key
// range `split` of `splits`. scratch: attention's part of `red` (q rows and the warps' max / sum);
// po: [COMPUTE_WARPS][nrows][hd] floats of the pool's X area (no GEMV stages X during attention;
// the host's pool_split leaves room for them).
__device__ __noinline__ void run_attn(const Params& p, const LayerDesc& L, int hq, int row0, int nrows, int split,
                                      int splits, float* scratch, float* po, int instr) {
  const int warp = threadIdx.x / 32;
  const int hd = (int)p.hd, half = hd / 2, N = (int)p.N;
  const int group = (int)(p.nh / p.nkv), kh = hq / group;
  float* qs = scratch;                              // [ATTN_ROWS = 8][hd]
  float* pm = scratch + 8 * hd;                     // [COMPUTE_WARPS][nrows] partial max (log2 units)
  float* pl = pm + COMPUTE_WARPS * 8;               // [COMPUTE_WARPS][nrows] partial sum
  // 1. one pass (its loads in flight together): items [0, N half) RoPE this KV head's new K rows
  // and append them and their V rows to the cache (all N tokens; every instruction of the KV head
  // writes the same values), items [N half, (N + nrows) half) put this instruction's q rows,
  // RoPE'd and rounded to bf16 as the chain stores them, into shared memory
  for (int i = threadIdx.x; i < (N + nrows) * half; i += COMPUTE_THREADS) {
    const bool is_q = i >= N * half;
    const int ii = is_q ? i - N * half : i;
    const int t = is_q ? row0 + ii / half : ii / half, j = ii % half;
    const int64_t pos = rope_pos(p, t);
    const bf16* xr = p.qkv + (int64_t)t * p.qkv_cols + (is_q ? (int64_t)hq : p.nh + kh) * hd;
    const float x0 = ldcg_bf16(xr + j), x1 = ldcg_bf16(xr + j + half);
    const float v0 = is_q ? 0.f : ldcg_bf16(xr + p.nkv * hd + j), v1 = is_q ? 0.f : ldcg_bf16(xr + p.nkv * hd + j + half);
    const int64_t slot = is_q ? -1 : p.slots[t];
    const float c0 = __bfloat162float(p.rope_cos[pos * hd + j]), c1 = __bfloat162float(p.rope_cos[pos * hd + j + half]);
    const float s0 = __bfloat162float(p.rope_sin[pos * hd + j]), s1 = __bfloat162float(p.rope_sin[pos * hd + j + half]);
    const float y0 = round_bf16(x0 * c0) + x1 * s0, y1 = round_bf16(x1 * c1) + x0 * s1;
    if (is_q) {
      const int r = ii / half;
      qs[r * hd + j] = round_bf16(y0);
      qs[r * hd + j + half] = round_bf16(y1);
    } else if (slot >= 0 && slot < p.max_slots) {
      bf16* kd = L.kc + (slot * p.nkv + kh) * hd;
      bf16* vd = L.vc + (slot * p.nkv + kh) * hd;
      kd[j] = __float2bfloat16_rn(y0);
      kd[j + half] = __float2bfloat16_rn(y1);
      vd[j] = __float2bfloat16_rn(v0);
      vd[j + half] = __float2bfloat16_rn(v1);
    }
  }
  __threadfence_block();
  compute_sync();
  if (threadIdx.x == 0) mark(p, instr, TL_MARK1);
  // 3. the warps split the instruction's keys; each warp runs every row over its keys
  int kb_i, ke_i;                                   // this instruction's keys
  attn_key_range(*p.n_valid, split, splits, kb_i, ke_i);
  {
    int kb, ke;                                     // this warp's keys: range `warp` of the instruction's
    attn_key_range(ke_i - kb_i, warp, COMPUTE_WARPS, kb, ke);
    kb += kb_i;
    ke += kb_i;
    const bf16* kbase = L.kc + kh * hd;
    const bf16* vbase = L.vc + kh * hd;
    const int64_t kv_stride = p.nkv * hd;
    const float sl2 = (float)p.scale_log2;
#if STEP_HEAD_DIM == 0
    if (hd == 128) attn_rows_warp<128>(qs, nrows, p.mask, p.mask_stride, row0, kbase, vbase, kv_stride, kb, ke, sl2, pm, pl, po);
    else attn_rows_warp<64>(qs, nrows, p.mask, p.mask_stride, row0, kbase, vbase, kv_stride, kb, ke, sl2, pm, pl, po);
#else
    attn_rows_warp<STEP_HEAD_DIM>(qs, nrows, p.mask, p.mask_stride, row0, kbase, vbase, kv_stride, kb, ke, sl2, pm, pl, po);
#endif
  }
  compute_sync();
  if (threadIdx.x == 0) mark(p, instr, TL_MARK2);
  // 4. merge the warps' partials of each row -> o[t, hq * hd + d]
  for (int i = threadIdx.x; i < nrows * hd; i += COMPUTE_THREADS) {
    const int r = i / hd, d = i % hd;
    float M = -INFINITY;
    for (int w = 0; w < COMPUTE_WARPS; ++w) M = fmaxf(M, pm[w * nrows + r]);
    float lsum = 0.f, acc = 0.f;
    if (M != -INFINITY) {
      for (int w = 0; w < COMPUTE_WARPS; ++w) {
        const float f = exp2f(pm[w * nrows + r] - M);  // 0 for a warp with no unmasked key
        lsum += pl[w * nrows + r] * f;
        acc += po[(w * nrows + r) * hd + d] * f;
      }
    }
    if (splits == 1) {
      p.o[(int64_t)(row0 + r) * p.nh * hd + (int64_t)hq * hd + d] = __float2bfloat16_rn(lsum > 0.f ? acc / lsum : 0.f);
    } else {
      const int64_t at = ((int64_t)split * N + row0 + r) * p.nh + hq;
      if (d == 0) { p.attn_part[2 * at] = M; p.attn_part[2 * at + 1] = lsum; }
      p.attn_part[2 * (int64_t)splits * N * p.nh + at * hd + d] = acc;
    }
  }
  compute_sync();
  if (threadIdx.x == 0) mark(p, instr, TL_EPI);
}

// ------------------------------------------------------------------ the kernel
template <int MB>
__device__ void step_body(const Params* p_global) {
  extern __shared__ __align__(1024) uint8_t smem[];
  // Params into shared memory: read all along, and every counter wait's acquire empties L1
  for (int i = threadIdx.x; i < PARAMS_BYTES / 8; i += THREADS)
    reinterpret_cast<int64_t*>(smem + PARAMS_OFF)[i] = reinterpret_cast<const int64_t*>(p_global)[i];
  const Params& p = *reinterpret_cast<const Params*>(smem + PARAMS_OFF);
  const int np = (int)p_global->npages;
  float* red = reinterpret_cast<float*>(smem);
  int* slot = reinterpret_cast<int*>(smem + SLOT_OFF);          // the running instruction (preload_instr)
  float* part = reinterpret_cast<float*>(smem + PART_OFF);
  const uint32_t xbar = smem_addr(smem + XBAR_OFF);
  uint32_t xphase = 0;                                           // the next phase of xbar to wait for
  const uint32_t full = smem_addr(smem + RED_BYTES);
  const uint32_t empty = full + 8 * MAX_PAGES;
  int* flag = reinterpret_cast<int*>(smem + RED_BYTES + 16 * MAX_PAGES);
  float* inv = reinterpret_cast<float*>(smem + INV_OFF);
  const uint32_t xs_area = smem_addr(smem + HEAD_BYTES);
  float* xs_floats = reinterpret_cast<float*>(smem + HEAD_BYTES);   // the same area (attention's partials)
  const uint32_t pages = xs_area + (uint32_t)p_global->xs_bytes;   // (p: after the barrier below)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int i = 0; i < np; ++i) {
      mbar_init(full + 8 * i, 1);
      mbar_init(empty + 8 * i, COMPUTE_WARPS);     // every compute warp passes every page
    }
    mbar_init(xbar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int i_begin = p.block_start[blockIdx.x], i_end = p.block_start[blockIdx.x + 1];

  if (warp == COMPUTE_WARPS) {
    // loader: every page of every GEMV instruction of this block, in order
    const uint64_t pol = evict_first_policy();
    int seq = 0;
    RingCursor fill;                   // the slot of page seq and the parity of its fill
    for (int i = i_begin; i < i_end; ++i) {
      const int* in = p.instr + (int64_t)i * INSTR_WORDS;
      if (in[0] != GEMV) continue;
      const OpDesc op = p.ops[in[1]];
      const int npt = pages_per_tile(op), tile0 = in[2], ntiles = in[3];
      if (lane == 0) mark(p, i, TL_LOAD0);
      for (int r0 = 0; r0 < ntiles; r0 += COMPUTE_WARPS) {       // rounds: (page j, tile i) order
        const int na = min(COMPUTE_WARPS, ntiles - r0);
        for (int j = 0; j < npt; ++j) {
          for (int ti = 0; ti < na; ++ti, ++seq) {
            const int slot = fill.slot;       // seq % np; the slot's fill seq / np waits for the previous one's release
            if (seq >= np) mbar_wait(p, empty + 8 * slot, fill.parity ^ 1, i, 4 * (uint64_t)p.timeout_ns);
            fill.next(np);
            load_page(op, page_of(op, round_tile(op, tile0, r0, na, ti), j), pages + slot * (uint32_t)p.page_bytes, full + 8 * slot, lane,
                      pol);
            __syncwarp();
          }
        }
      }
      if (lane == 0) mark(p, i, TL_LOAD1);
    }
    return;
  }

  RingCursor ring;                     // the next page this block's compute warps pass
  for (int i = i_begin; i < i_end; ++i) {
    const int* in = p.instr + (int64_t)i * INSTR_WORDS;
    if (threadIdx.x == 0) mark(p, i, TL_WAIT);
    if (threadIdx.x >= 32) preload_instr(p, in, slot, reinterpret_cast<bf16*>(red));
    wait_counter(p, threadIdx.x == 0 ? in[4] : -1, threadIdx.x == 0 ? in[5] : 0, i);   // then the slot is in place
    if (threadIdx.x == 0) mark(p, i, TL_RUN);
    const int4 w0 = *reinterpret_cast<const int4*>(slot), w1 = *reinterpret_cast<const int4*>(slot + 4);
    const void* desc = slot + INSTR_WORDS;         // read only before the instruction's last barrier
    if (w0.x == EMBED) {
      run_embed(p);
    } else if (w0.x == ATTN) {
      const AttnFields f = attn_fields(w1.w);
      run_attn(p, *reinterpret_cast<const LayerDesc*>(desc), w0.z, w0.w, f.rows, f.split, f.splits, red, xs_floats, i);
    } else {
      run_gemv<MB>(p, *reinterpret_cast<const OpDesc*>(desc), w0.z, w0.w, pages, full, empty, ring, red, inv, part,
                   xs_area, xbar, xphase, i);
      if (threadIdx.x == 0 && w1.z >= 0) signal(p, w1.z);      // run_gemv ended with a barrier
      if (threadIdx.x == 0) mark(p, i, TL_DONE);
      continue;
    }
    compute_sync();
    if (threadIdx.x == 0 && w1.z >= 0) signal(p, w1.z);
    if (threadIdx.x == 0) mark(p, i, TL_DONE);
  }
  // the last block out zeroes the counters for the next launch (abort flag included)
  compute_sync();
  if (threadIdx.x == 0) *flag = signal_old(p, (int)p.n_counters - 1) == (int)gridDim.x - 1;
  compute_sync();
  if (*flag) {
    __threadfence();
    for (int c = threadIdx.x; c < p.n_counters; c += COMPUTE_THREADS) atomicExch(p.counters + c, 0);
  }
}

}  // namespace step

// Launch bounds: 1 block an SM; 8 compute warps get 168 registers. 16 compute warps (544 threads)
// get 96 with spills: at 120 registers the driver allows only 512 threads a block (measured on an
// H100: registers go to warps in groups of four, so 17 warps count as 20).
#define STEP_BOUNDS __launch_bounds__(step::THREADS, 1)
// step_kernel_mb<MB>: grid = the schedule's blocks (<= one per SM), step::THREADS threads,
// step::SMEM_BYTES of dynamic shared memory; MB = m-blocks of 8 token rows (N <= 8 MB).
extern "C" __global__ void STEP_BOUNDS step_kernel_mb1(const step::Params* p) {
  step::step_body<1>(p);
}
extern "C" __global__ void STEP_BOUNDS step_kernel_mb2(const step::Params* p) {
  step::step_body<2>(p);
}
extern "C" __global__ void STEP_BOUNDS step_kernel_mb4(const step::Params* p) {
  step::step_body<4>(p);
}
