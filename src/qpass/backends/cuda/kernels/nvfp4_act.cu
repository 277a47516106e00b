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

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;
typedef long long i64;

#ifndef X_KIND
#define X_KIND 0
#endif
#ifndef PER_TOKEN
#define PER_TOKEN 0
#endif
#ifndef RAC
#define RAC 0
#endif
#ifndef THREADS
#define THREADS 256
#endif

#define DEV static __device__ __forceinline__
#define FLT_MAX_ 3.402823466e38f

#if X_KIND == 2
typedef float xt;
#else
typedef u16 xt;
#endif

DEV float x_to_f32(xt v) {
#if X_KIND == 0
  return __uint_as_float(((u32)v) << 16);
#elif X_KIND == 1
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
#else
  return v;
#endif
}

// 16 consecutive elements of a row (the row base and k0 are 16-element aligned)
DEV void load16(const xt* p, float* v) {
#if X_KIND == 2
  const float4* q = (const float4*)p;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float4 f = q[i];
    v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
  }
#else
  const uint4* q = (const uint4*)p;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    uint4 w = q[i];
    u32 a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[8 * i + 2 * j] = x_to_f32((xt)(a[j] & 0xFFFFu));
      v[8 * i + 2 * j + 1] = x_to_f32((xt)(a[j] >> 16));
    }
  }
#endif
}

DEV u32 mag_bits(float f) { return __float_as_uint(f) & 0x7FFFFFFFu; }

struct Glob {
  float s_enc, s_dec, mult;
};

DEV Glob globals(float amax) {
  Glob g;
  float s = fminf(__fdiv_rn(2688.0f, amax), FLT_MAX_);
  if (amax == 0.0f || s == 0.0f) s = 1.0f;
  g.s_enc = s;
  g.s_dec = __fdiv_rn(1.0f, s);
  g.mult = __fmul_rn(s, __uint_as_float(0x3E2AAAABu));
  return g;
}

DEV float e4m3_round_mag(float a) {  // a >= 0, finite (qpass.formats.e4m3.e4m3_round_magnitude)
  a = fminf(a, 448.0f);
  if (a >= 0.015625f) {
    u32 b = __float_as_uint(a);
    b = (b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u;
    return __uint_as_float(b);
  }
  float s = __fmul_rn(a, 512.0f);
  s = __fsub_rn(__fadd_rn(s, 8388608.0f), 8388608.0f);
  return __fmul_rn(s, 0.001953125f);
}

DEV u32 e2m1_index(float a) {  // a = |y| <= 6 (qpass.formats.e2m1.e2m1_encode, RNE ties)
  return (u32)(a > 0.25f) + (u32)(a >= 0.75f) + (u32)(a > 1.25f) + (u32)(a >= 1.75f) + (u32)(a > 2.5f) +
         (u32)(a >= 3.5f) + (u32)(a > 5.0f);
}

__constant__ float E2M1_VAL[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// Quantize one block of 16: writes B (float values, exact) and returns s_b; xhat (optional): the full
// dequant bf16(fl(fl(e2m1 s_b) S_dec)) saturated to +-lim, as float.
DEV float quant_block(const float* v, const Glob& g, float* b, float* xhat, float lim) {
  u32 vm = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) vm = max(vm, mag_bits(v[i]));
  const float vmax = __uint_as_float(vm);
  const float sb = e4m3_round_mag(fminf(__fmul_rn(vmax, g.mult), FLT_MAX_));
  const float enc = fminf(__fdiv_rn(1.0f, __fmul_rn(sb, g.s_dec)), FLT_MAX_);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float y = fminf(fmaxf(__fmul_rn(v[i], enc), -6.0f), 6.0f);
    float e = E2M1_VAL[e2m1_index(fabsf(y))];
    if (y < 0.0f) e = -e;
    b[i] = __fmul_rn(e, sb);
    if (xhat) {
      float d = __fmul_rn(b[i], g.s_dec);
      d = fminf(fmaxf(d, -lim), lim);
      u16 h;
      asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(d));
      xhat[i] = __uint_as_float(((u32)h) << 16);
    }
  }
  return sb;
}

DEV void store16_bf16(u16* p, const float* b) {  // exact values (<= 6 significant bits)
  u32 w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(b[2 * i + 1]), "f"(b[2 * i]));
  uint4* q = (uint4*)p;
  q[0] = make_uint4(w[0], w[1], w[2], w[3]);
  q[1] = make_uint4(w[4], w[5], w[6], w[7]);
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
  const long total = (long)M * nb;
  // row fastest: the lanes of a warp share a column block when M >= 32 (score atomics coalesce)
  for (long p = (long)blockIdx.x * THREADS + threadIdx.x; p < total; p += (long)gridDim.x * THREADS) {
    const int c = (int)(p / M), m = (int)(p - (long)c * M);
#if PER_TOKEN
    const Glob g = globals(__uint_as_float(partial[m]));
    if (c == 0) s_dec_out[m] = g.s_dec;
#endif
    load16(x + (size_t)m * sx + 16 * c, v);
#if RAC
    quant_block(v, g, b, xh, lim);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float r = __fsub_rn(v[i], xh[i]);
      rmx = max(rmx, mag_bits(r));
      if (scores) atomicAdd(scores + 16 * c + i, score_term(r, shift));
    }
#if PER_TOKEN
    atomicMax(ramax + m, rmx);
    rmx = 0;
#endif
#else
    quant_block(v, g, b, 0, lim);
#endif
    store16_bf16(bx + (size_t)m * sbx + 16 * c, b);
  }
#if RAC && !PER_TOKEN
  rmx = block_max_u32(rmx, sm);
  if (threadIdx.x == 0) atomicMax(ramax, rmx);
#endif
}

// ---------------------------------------------------------------------------------------------
// rac_select: one CTA of THREADS threads; mask bit j set iff channel j is among the k largest scores
// (ties toward the lower index). Radix select from the top byte; stops as soon as the candidates of
// the current prefix are exactly the ones still needed.
extern "C" __global__ void __launch_bounds__(THREADS) rac_select(const u64* __restrict__ scores, int K, int k,
                                                                u32* __restrict__ mask) {
  __shared__ u32 hist[256];
  __shared__ u64 s_prefix, s_pmask;
  __shared__ int s_need, s_all;
  __shared__ int s_cnt[THREADS / 32];
  if (threadIdx.x == 0) {
    s_prefix = 0;
    s_pmask = 0;
    s_need = k;
    s_all = 0;
  }
  for (int i = threadIdx.x; i < (K + 31) / 32; i += THREADS) mask[i] = 0u;
  __syncthreads();
  for (int sh = 56; sh >= 0; sh -= 8) {
    for (int i = threadIdx.x; i < 256; i += THREADS) hist[i] = 0u;
    __syncthreads();
    const u64 pf = s_prefix, pm = s_pmask;
    if (s_need <= 0 || s_all) break;
    for (int j = threadIdx.x; j < K; j += THREADS) {
      const u64 key = __ldcg(scores + j);
      if ((key & pm) == pf) atomicAdd(&hist[(key >> sh) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // lane l owns bins 8l..8l+7; find the bin holding the need-th largest key, counting from bin 255
      const int l = threadIdx.x;
      u32 loc[8];
      u32 sum = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) { loc[i] = hist[8 * l + i]; sum += loc[i]; }
      u32 above;  // keys in the bins of higher lanes
      // suffix sum (inclusive) over lanes l..31, then exclusive = inclusive - own
      u32 suf = sum;
      for (int o = 1; o < 32; o <<= 1) {
        const u32 v = __shfl_down_sync(0xFFFFFFFFu, suf, o);
        if (l + o < 32) suf += v;
      }
      above = suf - sum;
      const int need = s_need;
      if ((int)above < need && need <= (int)(above + sum)) {
        int nd = need - (int)above, d = 8 * l + 7;
        for (int i = 7; i > 0; --i, --d) {
          if ((int)loc[i] >= nd) break;
          nd -= (int)loc[i];
        }
        s_all = ((int)hist[d] == nd);
        s_need = nd;
        s_prefix = pf | ((u64)d << sh);
        s_pmask = pm | ((u64)255 << sh);
      }
    }
    __syncthreads();
  }
  __syncthreads();
  const u64 pf = s_prefix, pm = s_pmask;
  const int need = s_need, all = s_all;
  // contiguous index ranges per thread: ties resolved in index order by a block scan of tie counts
  const int per = (K + THREADS - 1) / THREADS;
  const int j0 = threadIdx.x * per, j1 = min(K, j0 + per);
  int ties = 0;
  for (int j = j0; j < j1; ++j) ties += ((__ldcg(scores + j) & pm) == pf);
  // exclusive block scan of the tie counts (warp shuffles, then the warp totals)
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  int inc = ties;
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xFFFFFFFFu, inc, o);
    if (lane >= o) inc += v;
  }
  if (lane == 31) s_cnt[wid] = inc;
  __syncthreads();
  int before = inc - ties;
  for (int i = 0; i < wid; ++i) before += s_cnt[i];
  for (int j = j0; j < j1; ++j) {
    const u64 key = __ldcg(scores + j), km = key & pm;
    bool sel = km > pf;
    if (km == pf) {
      sel = all || before < need;
      ++before;
    }
    if (sel) atomicOr(mask + (j >> 5), 1u << (j & 31));
  }
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
    load16(x + (size_t)m * sx + 16 * c, v);
    quant_block(v, g, b, xh, lim);
#pragma unroll
    for (int i = 0; i < 16; ++i) r[i] = __fsub_rn(v[i], xh[i]);
    quant_block(r, gr, b, 0, lim);
    const u32 mw = __ldg(mask + ((16 * c) >> 5)) >> ((16 * c) & 31);
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if (!((mw >> i) & 1u)) b[i] = 0.0f;
    store16_bf16(br + (size_t)m * sbr + 16 * c, b);
  }
}
