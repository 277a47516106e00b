// NVFP4 quantization of one 16-element block, shared by the activation kernels (nvfp4_act.cu) and the
// GEMM that quantizes its own activations (nvfp4_mma.cu, QX): one definition of the reference's
// arithmetic (SPEC §3, rule 5), operation for operation in IEEE float32 with round-to-nearest
// (NVRTC --fmad=false, explicit __f*_rn). runtime.compile_cubin inlines this file where a kernel
// source writes #include "nvfp4_quant.cuh" (NVRTC is given no include path).
//
// Compile-time: X_KIND, the input dtype of load16 (0 bf16, 1 fp16, 2 fp32).
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;
typedef long long i64;

#ifndef X_KIND
#define X_KIND 0
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

// E2M1 magnitude of index i (0..7): 0, 0.5 | 1, 1.5, 2, 3, 4, 6 = 2^(i/2 - 1) (1 + (i & 1)/2) for i >= 2
DEV float e2m1_mag(u32 i) {
  const float hi = __uint_as_float(((126u + (i >> 1)) << 23) | ((i & 1u) << 22));
  return i >= 2u ? hi : 0.5f * (float)i;
}

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
    float e = e2m1_mag(e2m1_index(fabsf(y)));
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

// One 16-element block of B_X: load, quantize, store (the plain activation operand).
DEV void quant_store(const xt* __restrict__ xp, const Glob& g, u16* __restrict__ bp) {
  float v[16], b[16];
  load16(xp, v);
  quant_block(v, g, b, 0, 0.0f);
  store16_bf16(bp, b);
}
