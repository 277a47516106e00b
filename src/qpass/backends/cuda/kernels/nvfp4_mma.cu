// NVFP4-weight small-M GEMM on the tensor cores (mma.sync m16n8k16), SPEC §3.1 (factored decode).
//
//   Y[m, n] = fl( acc_m,n( X · B_W^T ) · alpha_m )  (+ fl( acc( X2 · B_W^T ) · alpha2_m ))  (+ bias[n])
//   B_W[n, k] = e2m1(code[n, k]) · s_b[n, k/16]       (exact in bf16 and fp16)
//
// One warp owns 16 weight rows (the MMA's M side) and every token of the call (the MMA's N side, in
// n8 tiles: NT tiles = 8*NT token slots; the tokens of X2, the RAC compensation operand, follow those of
// X); the NW warps of a CTA split K and their partial sums are added in warp order through shared
// memory (no atomics: the result does not depend on scheduling).
//
// K order inside an MMA is free (a dot product is a sum over k, A and B only have to agree on which
// slot holds which k): lane (g, t) = (lane / 4, lane % 4) feeds, for rows g and g + 8, the 32 consecutive
// k of its 16-byte code load (k0 + 32 t + [0, 32)), and loads the same 32 k of the activation rows.
// A code word (8 nibbles, nibble p = element k0 + 8w + p) yields 4 operand pairs (p, p + 4),
// p = 3, 2, 1, 0, by bit placement: the nibble's sign goes to a half's sign bit and its 3 magnitude
// bits to the half's exponent / top mantissa bits, which is the E2M1 value times a fixed power of two
// (the "power-of-two carrier" of SPEC §3.1):
//   bf16: (q & 0x80008000) | ((q & 0x70007000) >> 6)  = e2m1 · 2^-126  (code ±1 -> bf16 subnormal 2^-127)
//   fp16: (q & 0x80008000) | ((q & 0x70007000) >> 3)  = e2m1 · 2^-14   (code ±1 -> fp16 subnormal 2^-15)
// The block scale byte becomes s_b · 2^C (cvt e4m3x2 -> f16x2, exact; -> f32; · 2^C exact; -> bf16/fp16
// exact: <= 4 significant bits) and one packed multiply gives the operand pair:
//   bf16: C = 119: (e2m1 · 2^-126) · (s_b · 2^119) = B · 2^-7    fp16: C = 7: (e2m1 · 2^-14)(s_b · 2^7) = B · 2^-7
// exact: <= 6 significant bits, and every value stays inside the format (bf16: |B·2^-7| in [2^-17, 21],
// normal; s_b·2^119 <= 448·2^119 < 2^128; fp16: B·2^-7 in [2^-17, 21], the subnormal part of that range
// has its lowest set bit >= 2^-17-5 >= 2^-24, so it is exact too). Products and float32 sums scale
// exactly by 2^-7, so acc = 2^7 · acc' exactly unless |acc| < 2^-119 (an accumulator below the float32
// normal range); the epilogue multiplies by 2^7 (exact) and then by alpha, as SPEC §3.1 writes it.
//
// Compile-time parameters (NVRTC -D): NT (n8 token tiles, 1..4), NW (warps per CTA), XH (1: fp16
// activations and fp16 operands, 0: bf16), OUT_KIND (0 bf16, 1 fp16, 2 fp32), HAS_X2, HAS_BIAS,
// ALPHA_KIND (0: alpha = s_dec_w; 1: alpha = fl(s_dec_x[0] * s_dec_w); 2: per token fl(s_dec_x[m] * s_dec_w)),
// QX (1: x is the raw activation [M, K] in X_KIND's dtype; every CTA first quantizes all of it with the
// activation kernels' arithmetic (nvfp4_quant.cuh) into B_X rows in dynamic shared memory (M*K*2 bytes)
// and S_dec_X (per tensor, or per token with ALPHA_KIND 2): W4A4 in one launch, no B_X in memory).

#ifndef QX
#define QX 0
#endif
#if QX
// QX: the kernel quantizes its own activations (W4A4 without RAC): X_KIND is the raw input's dtype
// (0 bf16, 1 fp16); the operand it multiplies is B_X in bf16 (XH = 0)
#ifndef X_KIND
#define X_KIND 0
#endif
#endif
#include "nvfp4_quant.cuh"

#ifndef NT
#define NT 1
#endif
#ifndef NW
#define NW 4
#endif
#ifndef XH
#define XH 0
#endif
#ifndef OUT_KIND
#define OUT_KIND 0
#endif
#ifndef HAS_X2
#define HAS_X2 0
#endif
#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif
#ifndef ALPHA_KIND
#define ALPHA_KIND 0
#endif

DEV void ld_w16(const u8* p, u32& a, u32& b, u32& c, u32& d) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
}
DEV void ld_w8(const u8* p, u32& a, u32& b) {
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(a), "=r"(b) : "l"(p));
}
DEV void ld_x16(const u16* p, u32& a, u32& b, u32& c, u32& d) {
#if QX  // B_X rows in shared memory
  const uint4 v = *(const uint4*)p;
  a = v.x;
  b = v.y;
  c = v.z;
  d = v.w;
#else
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
#endif
}
DEV u32 ld_u16(const u8* p) {
  u16 v;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return (u32)v;
}
DEV u32 ld_u8(const u8* p) {
  u16 v;
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(v) : "l"(p));
  return (u32)v;
}

// operand pair (carrier) of the nibbles at bits 12..15 and 28..31 of q
DEV u32 e2m1_pair(u32 q) {
#if XH
  return (q & 0x80008000u) | ((q & 0x70007000u) >> 3);
#else
  return (q & 0x80008000u) | ((q & 0x70007000u) >> 6);
#endif
}

DEV u32 mul2(u32 a, u32 b) {
  u32 d;
#if XH
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#else
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#endif
  return d;
}

// two E4M3 scale bytes (low byte = first block) -> two broadcast carriers (s_b·2^C, s_b·2^C)
DEV void scale_carriers(u32 s2, u32& c0, u32& c1) {
  u32 h2;
  u16 s16 = (u16)s2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(s16));
  float f0, f1;
  asm("{\n .reg .f16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.f32.f16 %0, lo;\n cvt.f32.f16 %1, hi;\n}"
      : "=f"(f0), "=f"(f1) : "r"(h2));
#if XH
  f0 = __fmul_rn(f0, 128.0f);
  f1 = __fmul_rn(f1, 128.0f);
  asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(c0) : "f"(f0));
  asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(c1) : "f"(f1));
#else
  f0 = __fmul_rn(f0, 6.64613997892457936451903530140172288e35f);  // 2^119
  f1 = __fmul_rn(f1, 6.64613997892457936451903530140172288e35f);
  asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(c0) : "f"(f0));
  asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(c1) : "f"(f1));
#endif
}

DEV void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if XH
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

DEV u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// One lane's share of one 128-wide K chunk: code words of rows g and g+8 (4 words = 32 k each), their
// two scale bytes, and the same 32 k of the lane's token in every n8 tile.
struct Chunk {
  u32 w[2][4];
  u32 s[2];
  u32 x[NT][4][4];
};

// Row and token pointers always point at valid memory (rows >= N and tokens >= M are clamped to a
// real row; their outputs are computed and never stored), so a full chunk loads without branches.
DEV void load_w(Chunk& c, const u8* const* wr, const u8* const* sr, int kb) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    ld_w16(wr[r] + kb / 2, c.w[r][0], c.w[r][1], c.w[r][2], c.w[r][3]);
    c.s[r] = ld_u16(sr[r] + kb / 16);
  }
}
DEV void load_x(Chunk& c, const u16* const* xr, int kb) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int w = 0; w < 4; ++w) ld_x16(xr[j] + kb + 8 * w, c.x[j][w][0], c.x[j][w][1], c.x[j][w][2], c.x[j][w][3]);
}
DEV void load_full(Chunk& c, const u8* const* wr, const u8* const* sr, const u16* const* xr, int kb) {
  load_w(c, wr, sr, kb);
  load_x(c, xr, kb);
}

// The K tail: nb = number of valid 16-element blocks of the lane's 32 (0, 1 or 2); the rest is zero
// (codes 0 decode to +0, activations 0: the padding adds exact zeros).
DEV void load_tail(Chunk& c, const u8* const* wr, const u8* const* sr, const u16* const* xr, int kb, int nb) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    c.s[r] = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) c.w[r][i] = 0;
  }
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int w = 0; w < 4; ++w)
#pragma unroll
      for (int i = 0; i < 4; ++i) c.x[j][w][i] = 0;
  if (nb <= 0) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (nb == 2) {
      ld_w16(wr[r] + kb / 2, c.w[r][0], c.w[r][1], c.w[r][2], c.w[r][3]);
      c.s[r] = ld_u16(sr[r] + kb / 16);
    } else {
      ld_w8(wr[r] + kb / 2, c.w[r][0], c.w[r][1]);
      c.s[r] = ld_u8(sr[r] + kb / 16);
    }
  }
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int w = 0; w < 4; ++w)
      if (w < 2 * nb) ld_x16(xr[j] + kb + 8 * w, c.x[j][w][0], c.x[j][w][1], c.x[j][w][2], c.x[j][w][3]);
}

DEV void compute_chunk(const Chunk& c, float (*acc)[4]) {
  u32 sc[2][2];
  scale_carriers(c.s[0], sc[0][0], sc[0][1]);
  scale_carriers(c.s[1], sc[1][0], sc[1][1]);
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // pairs q = 2h (nibbles p = 3 - 2h, p + 4) and q = 2h + 1 (p = 2 - 2h) of word w
      const u32 g0 = c.w[0][w] << (8 * h), g8 = c.w[1][w] << (8 * h);
      const u32 a0 = mul2(e2m1_pair(g0), sc[0][w >> 1]);
      const u32 a1 = mul2(e2m1_pair(g8), sc[1][w >> 1]);
      const u32 a2 = mul2(e2m1_pair(g0 << 4), sc[0][w >> 1]);
      const u32 a3 = mul2(e2m1_pair(g8 << 4), sc[1][w >> 1]);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        // x pairs (x[8w+p], x[8w+p+4]): p odd -> high halves (0x7632), p even -> low halves (0x5410)
        const u32 lo = c.x[j][w][1 - h], hi = c.x[j][w][3 - h];
        mma(acc[j], a0, a1, a2, a3, prmt(lo, hi, 0x7632u), prmt(lo, hi, 0x5410u));
      }
    }
  }
}

DEV u16 f32_to_half_bits(float v) {
  u16 h;
#if OUT_KIND == 0
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
#endif
  return h;
}

DEV float half_bits_to_f32(u16 h) {
  float f;
#if OUT_KIND == 0
  f = __uint_as_float(((u32)h) << 16);
#else
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
#endif
  return f;
}

// Y[m, n] = fl(acc · alpha_m) (+ fl(acc2 · alpha2_m)) (+ bias[n]), rounded once to the output type and
// stored at out[idx]; alpha_m = S_dec_W (ALPHA_KIND 0), fl(S_dec_X · S_dec_W) (1) or fl(S_dec_X[m] · S_dec_W) (2).
DEV void finish_store(float acc, float acc2, int m, int n, const float* __restrict__ s_dec_x,
                      const float* __restrict__ s_dec_x2, float sw, const void* __restrict__ bias,
                      void* __restrict__ out, size_t idx) {
#if ALPHA_KIND == 0
  const float alpha = sw;
#elif QX  // S_dec_X computed by this CTA, in shared memory
  const float alpha = __fmul_rn(s_dec_x[ALPHA_KIND == 2 ? m : 0], sw);
#elif ALPHA_KIND == 1
  const float alpha = __fmul_rn(__ldg(s_dec_x), sw);
#else
  const float alpha = __fmul_rn(__ldg(s_dec_x + m), sw);
#endif
  float y = __fmul_rn(acc, alpha);
#if HAS_X2
#if ALPHA_KIND == 2
  const float alpha2 = __fmul_rn(__ldg(s_dec_x2 + m), sw);
#else
  const float alpha2 = __fmul_rn(__ldg(s_dec_x2), sw);
#endif
  y = __fadd_rn(y, __fmul_rn(acc2, alpha2));
#else
  (void)acc2;
  (void)s_dec_x2;
#endif
#if HAS_BIAS
#if OUT_KIND == 2
  y = __fadd_rn(y, ((const float*)bias)[n]);
#else
  y = __fadd_rn(y, half_bits_to_f32(((const u16*)bias)[n]));
#endif
#else
  (void)bias;
  (void)n;
#endif
#if OUT_KIND == 2
  ((float*)out)[idx] = y;
#else
  ((u16*)out)[idx] = f32_to_half_bits(y);
#endif
}

// Up to MAX_SEGS weights that multiply the same activations (sibling linears of one input, e.g. q/k/v):
// segment s owns the row groups [g0, g0 + ceil(n/16)) of the grid and writes output columns
// [col0, col0 + n); each has its own codes, scales, S_dec_W and bias.
#define MAX_SEGS 4
struct Seg {
  const u8* codes;
  const u8* scales;
  const float* s_dec_w;
  const void* bias;
  int n, g0, col0, pad;
};
struct Segs {
  Seg s[MAX_SEGS];
  int count;
};

#if QX
extern __shared__ u16 qx_rows[];  // [M][K] B_X (bf16 bits) of this call, built by every CTA

// The activation quantization of act_fused (phase 1 and 2 without RAC), by the NW warps of this CTA:
// amax (per tensor, or per row with ALPHA_KIND 2), S_dec_X into s_sdx, B_X into qx_rows; CTA 0 also
// writes the amax bits (the host's NaN/inf check). Every CTA computes the same bits from the same x.
DEV void quantize_rows(const xt* __restrict__ xin, int M, int K, int sx, float* s_sdx, u32* s_rowmax,
                       u32* __restrict__ amax_out) {
  const int T = NW * 32, nb = K >> 4;
  const long total = (long)M * nb;
  float v[16];
  for (int i = threadIdx.x; i < 32; i += T) s_rowmax[i] = 0u;
  __syncthreads();
  u32 mx = 0;
  for (long p = threadIdx.x; p < total; p += T) {
    const int m = (int)(p / nb), c = (int)(p - (long)m * nb);
    load16(xin + (size_t)m * sx + 16 * c, v);
    u32 bm = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) bm = max(bm, mag_bits(v[i]));
#if ALPHA_KIND == 2
    atomicMax(&s_rowmax[m], bm);
#else
    mx = max(mx, bm);
#endif
  }
#if ALPHA_KIND != 2
  for (int o = 16; o; o >>= 1) mx = max(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, o));
  if ((threadIdx.x & 31) == 0) atomicMax(&s_rowmax[0], mx);
#endif
  __syncthreads();
#if ALPHA_KIND == 2
  for (int m = threadIdx.x; m < M; m += T) {
    s_sdx[m] = globals(__uint_as_float(s_rowmax[m])).s_dec;
    if (blockIdx.x == 0 && amax_out) amax_out[m] = s_rowmax[m];
  }
#else
  const Glob g = globals(__uint_as_float(s_rowmax[0]));
  if (threadIdx.x == 0) {
    s_sdx[0] = g.s_dec;
    if (blockIdx.x == 0 && amax_out) amax_out[0] = s_rowmax[0];
  }
#endif
  for (long p = threadIdx.x; p < total; p += T) {
    const int m = (int)(p / nb), c = (int)(p - (long)m * nb);
#if ALPHA_KIND == 2
    const Glob g = globals(__uint_as_float(s_rowmax[m]));
#endif
    quant_store(xin + (size_t)m * sx + 16 * c, g, qx_rows + (size_t)m * K + 16 * c);
  }
  __syncthreads();
}
#endif

extern "C" __global__ void __launch_bounds__(NW * 32) nvfp4_mma_gemm(
    const u16* __restrict__ x, const u16* __restrict__ x2, const Segs segs, const float* __restrict__ s_dec_x,
    const float* __restrict__ s_dec_x2, void* __restrict__ out, int M, int K, int sx, int sx2, int so,
    u32* __restrict__ amax_out) {
  __shared__ float red[NW][16][8 * NT + 1];
#if QX
  static_assert(!HAS_X2 && ALPHA_KIND != 0, "QX: W4A4 without a compensation operand");
  __shared__ float s_sdx[32];
  __shared__ u32 s_rowmax[32];
  const xt* __restrict__ xin = (const xt*)x;
  const int sx_in = sx;
  s_dec_x = s_sdx;
  sx = K;  // the B_X rows in shared memory
#else
  (void)amax_out;
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  int si = 0;
#pragma unroll
  for (int i = 1; i < MAX_SEGS; ++i)
    if (i < segs.count && (int)blockIdx.x >= segs.s[i].g0) si = i;
  const u8* __restrict__ codes = segs.s[si].codes;
  const u8* __restrict__ scales = segs.s[si].scales;
  const float* __restrict__ s_dec_w = segs.s[si].s_dec_w;
  const void* __restrict__ bias = segs.s[si].bias;
  const int N = segs.s[si].n, col0 = segs.s[si].col0;
  const int n0 = ((int)blockIdx.x - segs.s[si].g0) * 16;
  const int rg = n0 + g, rg8 = n0 + g + 8;
  const int kh = K >> 1, ks = K >> 4;
  const int rc = min(rg, N - 1), rc8 = min(rg8, N - 1);
  const u8* wr[2] = {codes + (size_t)rc * kh, codes + (size_t)rc8 * kh};
  const u8* sr[2] = {scales + (size_t)rc * ks, scales + (size_t)rc8 * ks};
  const u16* xr[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int tok = 8 * j + g;
#if QX
    const u16* xb = qx_rows;
#else
    const u16* xb = x;
#endif
    xr[j] = xb;  // a token slot past the call's tokens reads token 0 (its column is never stored)
    if (tok < M) xr[j] = xb + (size_t)tok * sx;
#if HAS_X2
    else if (tok < 2 * M) xr[j] = x2 + (size_t)(tok - M) * sx2;
#endif
  }
  // this warp's full chunks of 128 k: [c0, c1); the partial chunk (K % 128 != 0) goes to the last warp
  const int nfull = K >> 7;
  const int per = (nfull + NW - 1) / NW;
  const int c0 = min(nfull, warp * per);
  const int c1 = min(nfull, c0 + per);
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  const int lk = 32 * t;
  Chunk ca, cb;
  int c = c0;
#if QX
  if (c < c1) load_w(ca, wr, sr, c * 128 + lk);  // the first weights are in flight while x is quantized
  quantize_rows(xin, M, K, sx_in, s_sdx, s_rowmax, amax_out);
  if (c < c1) load_x(ca, xr, c * 128 + lk);
#else
  if (c < c1) load_full(ca, wr, sr, xr, c * 128 + lk);
#endif
  for (; c + 1 < c1; c += 2) {
    load_full(cb, wr, sr, xr, (c + 1) * 128 + lk);
    compute_chunk(ca, acc);
    if (c + 2 < c1) load_full(ca, wr, sr, xr, (c + 2) * 128 + lk);
    compute_chunk(cb, acc);
  }
  if (c < c1) compute_chunk(ca, acc);
  if ((K & 127) && warp == NW - 1) {
    const int kb = nfull * 128 + lk;
    load_tail(ca, wr, sr, xr, kb, min(2, max(0, (K - kb) >> 4)));
    compute_chunk(ca, acc);
  }
  // cross-warp sum in warp order
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    red[warp][g][8 * j + 2 * t] = acc[j][0];
    red[warp][g][8 * j + 2 * t + 1] = acc[j][1];
    red[warp][g + 8][8 * j + 2 * t] = acc[j][2];
    red[warp][g + 8][8 * j + 2 * t + 1] = acc[j][3];
  }
  __syncthreads();
  const float sw = __ldg(s_dec_w);
  for (int e = threadIdx.x; e < 16 * M; e += NW * 32) {
    const int r = e / M, m = e - r * M;
    const int n = n0 + r;
    if (n >= N) continue;
    float a = red[0][r][m];
#pragma unroll
    for (int w = 1; w < NW; ++w) a = __fadd_rn(a, red[w][r][m]);
    float a2 = 0.0f;
#if HAS_X2
    a2 = red[0][r][M + m];
#pragma unroll
    for (int w = 1; w < NW; ++w) a2 = __fadd_rn(a2, red[w][r][M + m]);
#endif
    // the 2^-7 of the operand carriers comes back exactly before alpha
    finish_store(__fmul_rn(a, 128.0f), __fmul_rn(a2, 128.0f), m, n, s_dec_x, s_dec_x2, sw, bias, out,
                 (size_t)m * so + col0 + n);
  }
}

// ---------------------------------------------------------------------------------------------
// Epilogue of a GEMM whose float32 accumulators came from elsewhere (cuBLAS on exact operands):
//   Y[m, n] = fl(acc[m, n] · alpha_m) (+ fl(acc2[m, n] · alpha2_m)) (+ bias[n])
// alpha_m as in nvfp4_mma_gemm (ALPHA_KIND), without the 2^7 carrier (cuBLAS multiplies B itself).
extern "C" __global__ void __launch_bounds__(256) nvfp4_epilogue(
    const float* __restrict__ acc, const float* __restrict__ acc2, const float* __restrict__ s_dec_w,
    const float* __restrict__ s_dec_x, const float* __restrict__ s_dec_x2, const void* __restrict__ bias,
    void* __restrict__ out, int M, int N, int so) {
  const float sw = __ldg(s_dec_w);
  const long total = (long)M * N;
  for (long i = (long)blockIdx.x * 256 + threadIdx.x; i < total; i += (long)gridDim.x * 256) {
    const int m = (int)(i / N), n = (int)(i - (long)m * N);
    finish_store(acc[i], HAS_X2 ? acc2[i] : 0.0f, m, n, s_dec_x, s_dec_x2, sw, bias, out, (size_t)m * so + n);
  }
}
