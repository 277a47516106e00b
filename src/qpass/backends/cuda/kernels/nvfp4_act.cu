// NVFP4 activation quantization for the rollout GEMMs (SPEC §3, rule 5; SPEC §3.1 operands; SPEC §2 RAC).
//
// Every kernel hands the GEMM the exact operand B_X = e2m1 · s_b (bf16, exact) and the decode scale
// S_dec_X (float32; one, or one per row with PER_TOKEN); S_dec_X goes to the GEMM's alpha. Arithmetic
// is the reference's, operation for operation, in IEEE float32 with round-to-nearest (NVRTC
// --fmad=false, explicit __f*_rn): amax -> S_enc = min(fl(2688/amax), FLT_MAX) (1 if amax == 0 or
// S_enc == 0), S_dec = fl(1/S_enc), mult = fl(S_enc · fl(1/6)); per 16-element block
// s_b = e4m3_rne_satfinite(min(fl(vmax · mult), FLT_MAX)), enc = min(fl(1/fl(s_b · S_dec)), FLT_MAX),
// q = e2m1_rne(clamp(fl(x · enc), -6, 6)).
//
// Kernels (one forward batch x [M, K], K % 16 == 0, rows with stride sx elements):
//   act_amax:     per-CTA partial max|x| (PER_TOKEN: per-row max), as float bits (NaN/inf propagate as
//                 the largest magnitudes); also zeroes a scratch area of `zero_words` u32 (RAC stats).
//   act_quant:    B_X and S_dec_X from the partials; with RAC: the residual R = fl(x - x_hat)
//                 (x_hat = bf16(fl(fl(e2m1·s_b)·S_dec)), the full dequant, saturated to the input
//                 dtype's finite range), max|R| (per tensor or per row, atomic max on float bits) and
//                 the exact channel scores score_j = sum_i floor(fl(R_ij^2) · 2^shift) (int64 atomic adds:
//                 any order gives the same bits), shift = clamp(61 - ceil(log2 M) - 2 e_a, -100, 100).
//   rac_select:   one CTA: the k channels with the largest score, ties to the lower index (radix
//                 select on the 64-bit scores), as a bitmap [ceil(K/32)].
//   rac_residual: B_R = M_S ⊙ (e2m1_R · s_b,R), R quantized over all K channels with its own global
//                 scale from max|R| (masked mode), and S_dec_R.
//
// Compile-time: X_KIND (0 bf16, 1 fp16, 2 fp32 input), PER_TOKEN, RAC (act_quant computes R stats),
// THREADS.

#include "nvfp4_quant.cuh"

#ifndef PER_TOKEN
#define PER_TOKEN 0
#endif
#ifndef RAC
#define RAC 0
#endif
#ifndef THREADS
#define THREADS 256
#endif

// One 16-channel block of B_R: X quantized again (x_hat), R = fl(x - x_hat), R quantized with the residual's
// global scale over all 16 channels (masked mode), then channels outside the mask (bit i of mw) set to 0.
DEV void residual_block(const xt* __restrict__ xp, const Glob& g, const Glob& gr, u32 mw, float lim,
                        u16* __restrict__ brp) {
  float v[16], b[16], xh[16], r[16];
  load16(xp, v);
  quant_block(v, g, b, xh, lim);
#pragma unroll
  for (int i = 0; i < 16; ++i) r[i] = __fsub_rn(v[i], xh[i]);
  quant_block(r, gr, b, 0, lim);
#pragma unroll
  for (int i = 0; i < 16; ++i)
    if (!((mw >> i) & 1u)) b[i] = 0.0f;
  store16_bf16(brp, b);
}

DEV u32 block_max_u32(u32 v, u32* sm) {
  for (int o = 16; o; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  const int w = threadIdx.x >> 5;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sm[w] = v;
  __syncthreads();
  u32 r = 0;
  for (int i = 0; i < THREADS / 32; ++i) r = max(r, sm[i]);
  return r;
}

// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(THREADS) act_amax(const xt* __restrict__ x, int M, int K, int sx,
                                                             u32* __restrict__ partial, u32* __restrict__ zero_buf,
                                                             int zero_words) {
  __shared__ u32 sm[THREADS / 32];
  for (int i = blockIdx.x * THREADS + threadIdx.x; i < zero_words; i += gridDim.x * THREADS) zero_buf[i] = 0u;
  const int nb = K >> 4;
  float v[16];
#if PER_TOKEN
  for (int m = blockIdx.x; m < M; m += gridDim.x) {
    u32 mx = 0;
    for (int c = threadIdx.x; c < nb; c += THREADS) {
      load16(x + (size_t)m * sx + 16 * c, v);
#pragma unroll
      for (int i = 0; i < 16; ++i) mx = max(mx, mag_bits(v[i]));
    }
    mx = block_max_u32(mx, sm);
    if (threadIdx.x == 0) partial[m] = mx;
  }
#else
  u32 mx = 0;
  const long total = (long)M * nb;
  for (long p = (long)blockIdx.x * THREADS + threadIdx.x; p < total; p += (long)gridDim.x * THREADS) {
    const int m = (int)(p / nb), c = (int)(p - (long)m * nb);
    load16(x + (size_t)m * sx + 16 * c, v);
#pragma unroll
    for (int i = 0; i < 16; ++i) mx = max(mx, mag_bits(v[i]));
  }
  mx = block_max_u32(mx, sm);
  if (threadIdx.x == 0) partial[blockIdx.x] = mx;
#endif
}

DEV float tensor_amax(const u32* partial, int P, u32* sm) {
  u32 mx = 0;
  for (int i = threadIdx.x; i < P; i += THREADS) mx = max(mx, partial[i]);
  return __uint_as_float(block_max_u32(mx, sm));
}

// fixed-point score exponent of qpass.quant.rac.score_shift (amax of the whole activation, M rows)
DEV int score_shift(float amax, int M) {
  if (amax == 0.0f) return 0;
  int e;
  frexpf(amax, &e);
  int c = 0;
  while ((1 << c) < M) ++c;
  return max(-100, min(100, 61 - c - 2 * e));
}

DEV u64 score_term(float r, int shift) {
  const float sq = __fmul_rn(r, r);
  const float p2 = __uint_as_float((u32)(shift + 127) << 23);
  return (u64)__float2ll_rd(__fmul_rn(sq, p2));
}

extern "C" __global__ void __launch_bounds__(THREADS) act_quant(
    const xt* __restrict__ x, int M, int K, int sx, const u32* __restrict__ partial, int P,
    u16* __restrict__ bx, int sbx, float* __restrict__ s_dec_out, float lim,
    u64* __restrict__ scores, u32* __restrict__ ramax) {
  __shared__ u32 sm[THREADS / 32];
  const int nb = K >> 4;
  float v[16], b[16], xh[16];
#if PER_TOKEN
  (void)P;
#else
  const float amax = tensor_amax(partial, P, sm);
  const Glob g = globals(amax);
  if (blockIdx.x == 0 && threadIdx.x == 0) s_dec_out[0] = g.s_dec;
#endif
#if RAC
  // the score exponent uses the amax of the whole activation (also with per-token scales)
#if PER_TOKEN
  const float amax_all = tensor_amax(partial, M, sm);
#else
  const float amax_all = amax;
#endif
  const int shift = score_shift(amax_all, M);
  u32 rmx = 0;
#endif
#if RAC
  // column slabs: a CTA owns whole 16-channel column blocks, so it completes their scores itself (no
  // atomics on the scores: a fixed per-thread order, then a tree over the CTA, all in integers)
  __shared__ u64 s_sc[16];
  for (int c = blockIdx.x; c < nb; c += gridDim.x) {
    u64 sc[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) sc[i] = 0ull;
    for (int m = threadIdx.x; m < M; m += THREADS) {
#if PER_TOKEN
      const Glob g = globals(__uint_as_float(partial[m]));
      if (c == 0) s_dec_out[m] = g.s_dec;
#endif
      load16(x + (size_t)m * sx + 16 * c, v);
      quant_block(v, g, b, xh, lim);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float r = __fsub_rn(v[i], xh[i]);
        rmx = max(rmx, mag_bits(r));
        sc[i] += score_term(r, shift);
      }
#if PER_TOKEN
      atomicMax(ramax + m, rmx);
      rmx = 0;
#endif
      store16_bf16(bx + (size_t)m * sbx + 16 * c, b);
    }
    if (scores) {
      if (threadIdx.x < 16) s_sc[threadIdx.x] = 0ull;
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        u64 a = sc[i];
        for (int o = 16; o; o >>= 1) a += __shfl_xor_sync(0xFFFFFFFFu, a, o);
        if ((threadIdx.x & 31) == 0 && a) atomicAdd(&s_sc[i], a);
      }
      __syncthreads();
      if (threadIdx.x < 16) scores[16 * c + threadIdx.x] = s_sc[threadIdx.x];
      __syncthreads();
    }
  }
#if !PER_TOKEN
  rmx = block_max_u32(rmx, sm);
  if (threadIdx.x == 0) atomicMax(ramax, rmx);
#endif
#else
  const long total = (long)M * nb;
  for (long p = (long)blockIdx.x * THREADS + threadIdx.x; p < total; p += (long)gridDim.x * THREADS) {
    const int c = (int)(p / M), m = (int)(p - (long)c * M);
#if PER_TOKEN
    const Glob g = globals(__uint_as_float(partial[m]));
    if (c == 0) s_dec_out[m] = g.s_dec;
#endif
    quant_store(x + (size_t)m * sx + 16 * c, g, bx + (size_t)m * sbx + 16 * c);
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// select_topk (one CTA of THREADS = 2^SEL_BITS >= 256 threads): mask bit j set iff channel j is among the
// k largest scores, ties toward the lower index. Radix select with one histogram bin per thread (1024 bins at
// 1024 threads): stage 1 bins a key by its bit length and the SUB_BITS bits below its leading one (the
// scores span many orders of magnitude, so a plain top-digit pass would put nearly every key in one bin,
// and one token's keys share few bit lengths: the sub-bits spread each length over 2^SUB_BITS bins, so
// fewer lanes collide on one shared atomic), then SEL_BITS-bit digits below the decided bits. Each pass
// also reduces the OR and the AND of its candidates' keys: bits where every candidate agrees are skipped
// by the next window (the scores of one token are a float's 24-bit significand shifted up, so the low bits
// are zero for all of them: at 1024 threads stage 1 and two 10-bit windows cover it), and the select stops
// when no bit below the decided ones differs (the remaining candidates are equal keys: ties by index) or
// when the candidates of the chosen bin are exactly the ones still needed. The bin holding the need-th
// largest key is found by a parallel suffix scan of the bins (one per thread), not by a serial loop.
#define SEL_BITS (THREADS >= 1024 ? 10 : THREADS >= 512 ? 9 : 8)
#define SEL_BINS (1 << SEL_BITS)
#define SUB_BITS (SEL_BITS - 7)  // 7 bits hold the bit length 0..64

DEV void hist_add(u32* hist, u32 bin, bool active) {
  // a plain shared atomic (lanes of a warp on one bin are serialised by the hardware), not run 3's
  // aggregation by __match_any_sync; cuda_check's act_profile times the select
  if (active) atomicAdd(&hist[bin], 1u);
}

#ifndef SEL_AGG
#define SEL_AGG 0
#endif
// stage 1's histogram add (SEL_AGG, benchmarks compare the variants: cuda_check act_profile): 0 a plain
// shared atomic per key; 1 the lanes of a warp with the same bin found by SEL_BITS ballots, one atomic of
// their count by the lowest; 2 the same grouping by __match_any_sync. Every lane of the warp must call it.
DEV void hist_add_stage1(u32* hist, u32 bin, bool active) {
#if SEL_AGG == 1
  u32 peers = __ballot_sync(0xFFFFFFFFu, active);
#pragma unroll
  for (int b = 0; b < SEL_BITS; ++b) {
    const bool on = (bin >> b) & 1u;
    const u32 bb = __ballot_sync(0xFFFFFFFFu, on);
    peers &= on ? bb : ~bb;
  }
  if (active && __ffs(peers) - 1 == (int)(threadIdx.x & 31)) atomicAdd(&hist[bin], (u32)__popc(peers));
#elif SEL_AGG == 2
  const u32 peers = __match_any_sync(0xFFFFFFFFu, active ? bin : 0xFFFFFFFFu);
  if (active && __ffs(peers) - 1 == (int)(threadIdx.x & 31)) atomicAdd(&hist[bin], (u32)__popc(peers));
#else
  hist_add(hist, bin, active);
#endif
}

// stage-1 bin of a key: bit length L, then the SUB_BITS bits below the leading one (zero-padded when
// the key has fewer); order-preserving: a larger key never gets a smaller bin
DEV u32 stage1_bin(u64 key) {
  const int L = 64 - __clzll((long long)key);
  if (L <= 1) return (u32)L << SUB_BITS;
  const u64 below = key & ((1ull << (L - 1)) - 1ull);  // the L - 1 bits under the leading one
  const u32 top = L - 1 >= SUB_BITS ? (u32)(below >> (L - 1 - SUB_BITS)) : (u32)(below << (SUB_BITS - (L - 1)));
  return (u32)L << SUB_BITS | top;
}

struct Pick {
  int bin, need, all;
};

// the bin d (0..SEL_BINS-1) with sum(hist[d+1..]) < need <= sum(hist[d..]); need in that bin; whether the
// bin's count equals it. Requires 1 <= need <= sum(hist) and SEL_BINS == THREADS. Two __syncthreads.
DEV Pick pick_bin(const u32* hist, int need, u32* s_wsum, int* s_pick) {
  const int t = threadIdx.x, lane = t & 31, wid = t >> 5;
  const u32 h = hist[SEL_BINS - 1 - t];
  u32 inc = h;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u32 v = __shfl_up_sync(0xFFFFFFFFu, inc, o);
    if (lane >= o) inc += v;
  }
  if (lane == 31) s_wsum[wid] = inc;
  __syncthreads();
  // the counts of the warps before this one: lane w < wid holds warp w's sum, one warp reduction
  const u32 mine = lane < wid ? s_wsum[lane] : 0u;
  const u32 before = __reduce_add_sync(0xFFFFFFFFu, mine) + inc - h;
  if ((int)before < need && (int)(before + h) >= need) {
    s_pick[0] = SEL_BINS - 1 - t;
    s_pick[1] = need - (int)before;
    s_pick[2] = (int)h == need - (int)before;
  }
  __syncthreads();
  Pick p;
  p.bin = s_pick[0];
  p.need = s_pick[1];
  p.all = s_pick[2];
  return p;
}

// OR and AND of the keys over the CTA (neutral 0 / ~0 from threads without candidates), into s_oa[0..3]
// (low/high words of OR, then of AND), which the caller reset to 0 / ~0 before the pass.
DEV void or_and_add(u64 o, u64 a, u32* s_oa) {
  const u32 olo = __reduce_or_sync(0xFFFFFFFFu, (u32)o), ohi = __reduce_or_sync(0xFFFFFFFFu, (u32)(o >> 32));
  const u32 alo = __reduce_and_sync(0xFFFFFFFFu, (u32)a), ahi = __reduce_and_sync(0xFFFFFFFFu, (u32)(a >> 32));
  if ((threadIdx.x & 31) == 0) {
    atomicOr(s_oa, olo);
    atomicOr(s_oa + 1, ohi);
    atomicAnd(s_oa + 2, alo);
    atomicAnd(s_oa + 3, ahi);
  }
}

// Order-preserving rank of one chunk of THREADS entries: returns this thread's rank among the kept
// entries so far (valid where keep) and adds the chunk's count to *total. Two __syncthreads.
DEV int compact_slot(bool keep, int* s_cnt, int* total) {
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  const u32 bal = __ballot_sync(0xFFFFFFFFu, keep);
  if (lane == 0) s_cnt[wid] = __popc(bal);
  __syncthreads();
  int before = *total;
  for (int w = 0; w < wid; ++w) before += s_cnt[w];
  int all = 0;
  for (int w = 0; w < THREADS / 32; ++w) all += s_cnt[w];
  const int slot = before + __popc(bal & ((1u << lane) - 1u));
  __syncthreads();  // every thread has read s_cnt and *total
  if (threadIdx.x == 0) *total += all;
  return slot;
}

// Each pass reads all K keys (from shared memory where the caller put them there); the histogram and
// the OR/AND words are double-buffered, so a pass resets the next pass's copy instead of spending a
// barrier on it. The mask words come from warp ballots (32 channels per word); only when the k-th
// key's bin is not taken whole, a last pass ranks the tied keys in index order.
DEV void select_topk(const u64* scores, int K, int k, u32* __restrict__ mask) {
  static_assert(THREADS == SEL_BINS && THREADS <= 1024, "select_topk: one histogram bin per thread");
  __shared__ u32 hist2[2][SEL_BINS];
  __shared__ u32 s_wsum[32];
  __shared__ u32 s_oa2[2][4];
  __shared__ int s_pick[3];
  __shared__ int s_cnt[THREADS / 32];
  __shared__ int s_rank;
  k = min(k, K);
  hist2[0][threadIdx.x] = 0u;
  hist2[1][threadIdx.x] = 0u;
  if (threadIdx.x < 8) (&s_oa2[0][0])[threadIdx.x] = (threadIdx.x & 3) < 2 ? 0u : ~0u;
  if (threadIdx.x == 0) s_rank = 0;
  __syncthreads();
  u64 pf = 0, pm = 0;  // decided bits (mask) and their values: the candidates are (key & pm) == pf
  int need = k, all = 0, buf = 0;
  if (k > 0) {
    // stage 1: bit length and the SUB_BITS bits below the leading one
    u32* hist = hist2[0];
    u32* s_oa = s_oa2[0];
    u64 o = 0, a = ~0ull;
    for (int base = 0; base < K; base += THREADS) {
      const int j = base + threadIdx.x;
      const u64 key = j < K ? scores[j] : 0ull;
      hist_add_stage1(hist, stage1_bin(key), j < K);
      if (j < K) {
        o |= key;
        a &= key;
      }
    }
    or_and_add(o, a, s_oa);
    __syncthreads();
    // s_oa is read before pick_bin's barriers: the pass after next zeroes this buffer
    u64 diff = ((u64)s_oa[1] << 32 | s_oa[0]) ^ ((u64)s_oa[3] << 32 | s_oa[2]);
    Pick p = pick_bin(hist, need, s_wsum, s_pick);
    const int L = p.bin >> SUB_BITS;  // the candidates' bit length (0: the candidates are 0)
    need = p.need;
    all = p.all;
    pm = L == 64 ? 0ull : ~((1ull << L) - 1ull);  // bits above the leading one are zero...
    int lo = 0;  // bits [0, lo) are undecided
    if (L > 0) {  // ... the leading one set, and up to SUB_BITS bits below it decided
      pm |= 1ull << (L - 1);
      pf = 1ull << (L - 1);
      const u32 top = (u32)p.bin & ((1u << SUB_BITS) - 1u);
      if (L - 1 >= SUB_BITS) {
        lo = L - 1 - SUB_BITS;
        pm |= ((1ull << SUB_BITS) - 1ull) << lo;
        pf |= (u64)top << lo;
      } else {  // every bit below the leading one is decided
        pm = ~0ull;
        pf |= (u64)(top >> (SUB_BITS - (L - 1)));
      }
    }
    // stage 2: SEL_BITS-bit windows starting at the highest bit below lo where the candidates differ
    while (!all && lo > 0) {
      const u64 below = diff & ((1ull << lo) - 1ull);
      if (!below) break;  // the candidates are equal keys
      const int hi = 63 - __clzll((long long)below);
      const int wlo = hi >= SEL_BITS - 1 ? hi - (SEL_BITS - 1) : 0;
      const int width = hi - wlo + 1;
      const u64 wmask = ((1ull << width) - 1ull);
      // this pass uses the other buffer (zeroed at the start or by the pass before the last); it
      // zeroes the one the last pass used (every thread has read it: pick_bin ended with a barrier)
      u32* prev = hist2[buf];
      u32* prev_oa = s_oa2[buf];
      buf ^= 1;
      hist = hist2[buf];
      s_oa = s_oa2[buf];
      prev[threadIdx.x] = 0u;
      if (threadIdx.x < 4) prev_oa[threadIdx.x] = threadIdx.x < 2 ? 0u : ~0u;
      o = 0;
      a = ~0ull;
      for (int base = 0; base < K; base += THREADS) {
        const int j = base + threadIdx.x;
        const u64 key = j < K ? scores[j] : 0ull;
        const bool cand = j < K && (key & pm) == pf;
        hist_add(hist, (u32)((key >> wlo) & wmask), cand);
        if (cand) {
          o |= key;
          a &= key;
        }
      }
      or_and_add(o, a, s_oa);
      __syncthreads();
      diff = ((u64)s_oa[1] << 32 | s_oa[0]) ^ ((u64)s_oa[3] << 32 | s_oa[2]);
      p = pick_bin(hist, need, s_wsum, s_pick);
      need = p.need;
      all = p.all;
      pf |= (u64)p.bin << wlo;
      pm |= wmask << wlo;
      lo = wlo;
    }
  }
  // every key above the decided prefix, and with `all` the keys equal to it: one ballot per 32 channels
  for (int base = 0; base < K; base += THREADS) {
    const int j = base + threadIdx.x;
    bool sel = false;
    if (k > 0 && j < K) {
      const u64 km = scores[j] & pm;
      sel = km > pf || (all && km == pf);
    }
    const u32 w = __ballot_sync(0xFFFFFFFFu, sel);
    if ((threadIdx.x & 31) == 0 && j < K) mask[j >> 5] = w;
  }
  if (k > 0 && !all) {
    // ties: the first `need` keys equal to the prefix, in index order
    __syncthreads();
    for (int base = 0; base < K; base += THREADS) {
      const int j = base + threadIdx.x;
      const bool t = j < K && (scores[j] & pm) == pf;
      const int rank = compact_slot(t, s_cnt, &s_rank);
      if (t && rank < need) atomicOr(mask + (j >> 5), 1u << (j & 31));
    }
  }
  __syncthreads();
}

extern __shared__ u64 dyn_smem[];

extern "C" __global__ void __launch_bounds__(THREADS) rac_select(const u64* __restrict__ scores, int K, int k,
                                                                u32* __restrict__ mask, int smem_keys) {
  // smem_keys: the host gave K * 8 bytes of dynamic shared memory; every select pass then reads its
  // keys from shared memory instead of L2 (each pass re-reads all K keys)
  const u64* keys = scores;
  if (smem_keys) {
    for (int j = threadIdx.x; j < K; j += THREADS) dyn_smem[j] = __ldcg(scores + j);
    __syncthreads();
    keys = dyn_smem;
  }
  select_topk(keys, K, k, mask);
}

extern "C" __global__ void __launch_bounds__(THREADS) rac_residual(
    const xt* __restrict__ x, int M, int K, int sx, const u32* __restrict__ partial, int P,
    const u32* __restrict__ ramax, const u32* __restrict__ mask, u16* __restrict__ br, int sbr,
    float* __restrict__ s_dec_r_out, float lim) {
  __shared__ u32 sm[THREADS / 32];
  const int nb = K >> 4;
  float v[16], b[16], xh[16], r[16];
#if !PER_TOKEN
  const Glob g = globals(tensor_amax(partial, P, sm));
  const Glob gr = globals(__uint_as_float(__ldcg(ramax)));
  if (blockIdx.x == 0 && threadIdx.x == 0) s_dec_r_out[0] = gr.s_dec;
#endif
  const long total = (long)M * nb;
  for (long p = (long)blockIdx.x * THREADS + threadIdx.x; p < total; p += (long)gridDim.x * THREADS) {
    const int c = (int)(p / M), m = (int)(p - (long)c * M);
#if PER_TOKEN
    const Glob g = globals(__uint_as_float(partial[m]));
    const Glob gr = globals(__uint_as_float(__ldcg(ramax + m)));
    if (c == 0) s_dec_r_out[m] = gr.s_dec;
#endif
    residual_block(x + (size_t)m * sx + 16 * c, g, gr, __ldg(mask + ((16 * c) >> 5)) >> ((16 * c) & 31), lim,
                   br + (size_t)m * sbr + 16 * c);
  }
}

// ---------------------------------------------------------------------------------------------
// act_fused: the whole chain (amax, B_X, and with RAC the scores, the top-k and B_R) in ONE CTA, for
// the small forward batches of decode (M <= FUSED_MAX_ROWS, M*K small): one launch instead of four,
// the same arithmetic as act_amax + act_quant (+ rac_select + rac_residual).
//
// With RAC the CTA's dynamic shared memory holds the K channel scores (u64, 8K bytes) and, when the
// host gave room for it (keep_r), the residual R itself (float, 4MK bytes, one 64-byte row per
// 16-element block): the scores never go through L2 atomics, every select pass reads shared memory,
// and the last phase quantizes R from shared memory instead of reading and quantizing X again.
// Scores are sums of integers, so their bits do not depend on the order of the additions: with
// M == 1 each block's thread stores its 16 terms; with R in shared memory one thread per channel sums
// its M terms; otherwise a segmented sum over the lanes of a warp that hold rows of the same block,
// then one 64-bit add per segment as two 32-bit shared atomics with the carry (smem_add_u64).
//
// prof (optional, u64[2 * 6]): thread 0 records clock64() and %globaltimer after each phase
// (start, amax, B_X + scores, select, B_R, end) for the phase profile of the benchmarks.
#ifndef FUSED_MAX_ROWS
#define FUSED_MAX_ROWS 128
#endif
#ifndef FUSED_MAX_K
#define FUSED_MAX_K 16384
#endif

// *p += v for a u64 in shared memory, exact modulo 2^64, with 32-bit atomics (the 64-bit shared
// atomicAdd is a CAS loop on sm_90): the low word's carry is added to the high word.
DEV void smem_add_u64(u64* p, u64 v) {
  u32* w = (u32*)p;
  const u32 lo = (u32)v;
  const u32 old = atomicAdd(w, lo);
  const u32 hi = (u32)(v >> 32) + ((u32)(old + lo) < old ? 1u : 0u);
  if (hi) atomicAdd(w + 1, hi);
}

DEV void prof_mark(u64* prof, int i) {
  if (prof && threadIdx.x == 0) {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    prof[2 * i] = (u64)clock64();
    prof[2 * i + 1] = t;
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) act_fused(
    const xt* __restrict__ x, int M, int K, int sx, u16* __restrict__ bx, int sbx, float* __restrict__ s_dec_out,
    float lim, u32* __restrict__ amax_bits_out, int rac_k, const u32* __restrict__ static_mask,
    u32* __restrict__ mask_out, u16* __restrict__ br, int sbr, float* __restrict__ s_dec_r_out, int keep_r,
    u64* __restrict__ prof) {
  __shared__ u32 sm[THREADS / 32];
  __shared__ u32 s_amax[FUSED_MAX_ROWS];
  __shared__ u32 s_ramax[FUSED_MAX_ROWS];
  __shared__ u32 s_mask[FUSED_MAX_K / 32];
  const int nb = K >> 4;
  const int total = M * nb;  // <= FUSED_MAX_ROWS * FUSED_MAX_K / 16
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  float v[16], b[16], xh[16];
  prof_mark(prof, 0);
#if RAC
  u64* keys = dyn_smem;                    // [K] channel scores (selection: batch)
  float* rbuf = (float*)(dyn_smem + K);    // [total][16] the residual (keep_r), block p = c * M + m
  const bool want_scores = !static_mask;
  for (int i = threadIdx.x; i < FUSED_MAX_ROWS; i += THREADS) s_ramax[i] = 0u;
  if (want_scores)
    for (int i = threadIdx.x; i < K; i += THREADS) keys[i] = 0ull;
#else
  (void)keep_r;
#endif
  // phase 1: amax
#if PER_TOKEN
  for (int m = wid; m < M; m += THREADS / 32) {
    u32 mx = 0;
    for (int c = lane; c < nb; c += 32) {
      load16(x + (size_t)m * sx + 16 * c, v);
#pragma unroll
      for (int i = 0; i < 16; ++i) mx = max(mx, mag_bits(v[i]));
    }
    for (int o = 16; o; o >>= 1) mx = max(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
    if (lane == 0) {
      s_amax[m] = mx;
      amax_bits_out[m] = mx;
    }
  }
  __syncthreads();
#if RAC
  // per-row globals once (not per block: fewer registers live across the division's slow-path call)
  __shared__ Glob s_gx[FUSED_MAX_ROWS], s_gr[FUSED_MAX_ROWS];
  for (int m = threadIdx.x; m < M; m += THREADS) {
    s_gx[m] = globals(__uint_as_float(s_amax[m]));
    s_dec_out[m] = s_gx[m].s_dec;
  }
  u32 all = 0;
  for (int m = threadIdx.x; m < M; m += THREADS) all = max(all, s_amax[m]);
  const float amax_all = __uint_as_float(block_max_u32(all, sm));
#endif
#else
  u32 mx = 0;
  for (int p = threadIdx.x; p < total; p += THREADS) {
    const int m = p / nb, c = p - m * nb;
    load16(x + (size_t)m * sx + 16 * c, v);
#pragma unroll
    for (int i = 0; i < 16; ++i) mx = max(mx, mag_bits(v[i]));
  }
  mx = block_max_u32(mx, sm);
  if (threadIdx.x == 0) {
    amax_bits_out[0] = mx;
    s_amax[0] = mx;  // phase 4 recomputes the globals from here (fewer registers live across the select)
  }
  const float amax = __uint_as_float(mx);
  const Glob g = globals(amax);
  if (threadIdx.x == 0) s_dec_out[0] = g.s_dec;
#if RAC
  const float amax_all = amax;
#endif
#endif
  __syncthreads();
  prof_mark(prof, 1);
  // phase 2: B_X (and the residual statistics). Every lane of a warp runs every iteration (the
  // segmented score sum shuffles across the warp); lanes past the end carry zeros.
#if RAC
  const int shift = score_shift(amax_all, M);
  for (int base = 0; base < total; base += THREADS) {
    const int p = base + threadIdx.x;
    const bool act = p < total;
    const int c = act ? p / M : -1, m = act ? p - c * M : 0;
    if (act) {
#if PER_TOKEN
      const Glob g = s_gx[m];
#endif
      load16(x + (size_t)m * sx + 16 * c, v);
      quant_block(v, g, b, xh, lim);
      store16_bf16(bx + (size_t)m * sbx + 16 * c, b);
    }
    u32 rmx = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      v[i] = act ? __fsub_rn(v[i], xh[i]) : 0.0f;  // R
      rmx = max(rmx, mag_bits(v[i]));
    }
    if (keep_r && act) {
      float4* q = (float4*)(rbuf + p * 16);
#pragma unroll
      for (int i = 0; i < 4; ++i) q[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
    }
    if (act) atomicMax(&s_ramax[PER_TOKEN ? m : 0], rmx);
    if (want_scores && (M == 1 || !keep_r)) {
      if (M == 1) {
        if (act)
#pragma unroll
          for (int i = 0; i < 16; ++i) keys[16 * c + i] = score_term(v[i], shift);
      } else {
        // lanes [lane, lane + o) hold rows of the same block: bit s of `same` for o = 2^s
        const int span = M < 32 ? M : 32;
        u32 same = 0;
        for (int o = 1, sbit = 0; o < span; o <<= 1, ++sbit) {
          const int co = __shfl_down_sync(0xFFFFFFFFu, c, o);
          if (lane + o < 32 && co == c) same |= 1u << sbit;
        }
        const int cprev = __shfl_up_sync(0xFFFFFFFFu, c, 1);
        const bool head = act && (lane == 0 || cprev != c);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          u64 a = act ? score_term(v[i], shift) : 0ull;
          for (int o = 1, sbit = 0; o < span; o <<= 1, ++sbit) {
            const u64 t = __shfl_down_sync(0xFFFFFFFFu, a, o);
            if ((same >> sbit) & 1u) a += t;
          }
          if (head && a) smem_add_u64(keys + 16 * c + i, a);
        }
      }
    }
  }
  if (want_scores && M > 1 && keep_r) {
    // the residual is in shared memory: one thread per channel sums its M terms in row order
    __syncthreads();
    for (int j = threadIdx.x; j < K; j += THREADS) {
      const int c = j >> 4;
      const int i = j & 15;
      u64 sc = 0;
      for (int m = 0; m < M; ++m) sc += score_term(rbuf[(c * M + m) * 16 + i], shift);
      keys[j] = sc;
    }
  }
#else
  for (int p = threadIdx.x; p < total; p += THREADS) {
    const int c = p / M, m = p - c * M;
#if PER_TOKEN
    const Glob g = globals(__uint_as_float(s_amax[m]));
    if (c == 0) s_dec_out[m] = g.s_dec;
#endif
    quant_store(x + (size_t)m * sx + 16 * c, g, bx + (size_t)m * sbx + 16 * c);
  }
#endif
#if RAC
  __syncthreads();
  prof_mark(prof, 2);
  // phase 3: the channels
  if (static_mask) {
    for (int i = threadIdx.x; i < (K + 31) / 32; i += THREADS) s_mask[i] = static_mask[i];
    __syncthreads();
  } else {
    select_topk(keys, K, rac_k, s_mask);
    __syncthreads();
  }
  for (int i = threadIdx.x; i < (K + 31) / 32; i += THREADS) mask_out[i] = s_mask[i];
  prof_mark(prof, 3);
  // phase 4: B_R = M_S ⊙ (e2m1_R · s_b,R)
#if !PER_TOKEN
  const Glob gr = globals(__uint_as_float(s_ramax[0]));
  if (threadIdx.x == 0) s_dec_r_out[0] = gr.s_dec;
#else
  for (int m = threadIdx.x; m < M; m += THREADS) {
    s_gr[m] = globals(__uint_as_float(s_ramax[m]));
    s_dec_r_out[m] = s_gr[m].s_dec;
  }
  __syncthreads();
#endif
  for (int p = threadIdx.x; p < total; p += THREADS) {
    const int c = p / M, m = p - c * M;
#if PER_TOKEN
    const Glob gr = s_gr[m];
#endif
    const u32 mw = s_mask[(16 * c) >> 5] >> ((16 * c) & 31);
    if (keep_r) {
      const float4* q = (const float4*)(rbuf + p * 16);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 f = q[i];
        v[4 * i] = f.x;
        v[4 * i + 1] = f.y;
        v[4 * i + 2] = f.z;
        v[4 * i + 3] = f.w;
      }
      quant_block(v, gr, b, 0, lim);
#pragma unroll
      for (int i = 0; i < 16; ++i)
        if (!((mw >> i) & 1u)) b[i] = 0.0f;
      store16_bf16(br + (size_t)m * sbr + 16 * c, b);
    } else {
#if PER_TOKEN
      const Glob gx = s_gx[m];
#else
      const Glob gx = globals(__uint_as_float(s_amax[0]));
#endif
      residual_block(x + (size_t)m * sx + 16 * c, gx, gr, mw, lim, br + (size_t)m * sbr + 16 * c);
    }
  }
#endif
  __syncthreads();
  prof_mark(prof, RAC ? 4 : 2);
}
