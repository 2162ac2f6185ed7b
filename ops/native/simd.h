// Copyright 2026 The xlaserve Authors. SPDX-License-Identifier: Apache-2.0
//
// The vectors xlaserve's CPU kernels are written in (qmatmul.cc, attention.cc), one kernel
// source for every instruction set: 16 float32 lanes (Floats), 16 int32 lanes (Ints), 64
// bytes (Bytes) and a mask of 16 lanes (Mask), with the operations the kernels use. The
// target is chosen when a kernel is compiled (ops/native/__init__.py's variants):
//
//   XLASERVE_AVX512  one 512-bit register each (AVX-512 F, BW, VL; VNNI where present)
//   XLASERVE_AVX2    two 256-bit halves (AVX2, FMA, F16C; AVX-VNNI where present)
//   XLASERVE_NEON    four 128-bit quarters (AArch64; the dot-product extension where present)
//   neither          plain C++ loops over the lanes, which the compiler vectorises
//
// Every operation is defined lane by lane, the same on every target: products and sums are
// float32 in the order written (fused only where the kernel says Fma or Fnma: the kernels
// are built with -ffp-contract=off), horizontal sums follow one fixed tree (ReduceAdd,
// Sums16), and the 4-bit products are exact integer sums. So a kernel gives the same bits
// on every target (tests/test_native_variants.py checks the x86 ones against each other on
// one machine), and a row's result never depends on the other rows of its call.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(XLASERVE_AVX512) || defined(XLASERVE_AVX2)
#include <immintrin.h>
#elif defined(XLASERVE_NEON)
#include <arm_neon.h>
#endif

#if defined(XLASERVE_AVX512) && \
    (!defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__F16C__))
#error "the AVX-512 target needs AVX-512 Floats, BW, VL and F16C"
#endif
#if defined(XLASERVE_AVX2) && (!defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__))
#error "the AVX2 target needs AVX2, FMA and F16C"
#endif
#if defined(XLASERVE_NEON) && !defined(__aarch64__)
#error "the NEON target is AArch64's"
#endif

namespace xlaserve::simd {

// 64 bytes as held in memory (the kernels' prepared operands).
struct alignas(64) Bytes64 {
  uint8_t b[64];
};

// A float16's bits -> its float32 value (exact), for the portable target.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(mant & 0x400)) mant <<= 1, --exp;
    bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(XLASERVE_AVX512)

struct Floats { __m512 v; };
struct Ints { __m512i v; };
struct Bytes { __m512i v; };
using Mask = __mmask16;

inline Floats Zero() { return {_mm512_setzero_ps()}; }
inline Floats Set(float x) { return {_mm512_set1_ps(x)}; }
inline Floats Load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void Store(float* p, Floats a) { _mm512_storeu_ps(p, a.v); }
inline Floats FromHalves(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
// The first n < 16 halves, zeros after; and a's first n lanes stored.
inline Floats FromHalves(const uint16_t* p, int64_t n) {
  return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p))};
}
inline void Store(float* p, Floats a, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), a.v);
}
inline Floats FromBF16(const uint16_t* p) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))};
}
inline Floats FromInt8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline Floats Add(Floats a, Floats b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Floats Sub(Floats a, Floats b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Floats Mul(Floats a, Floats b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Floats Fma(Floats a, Floats b, Floats c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a * b + c
inline Floats Fnma(Floats a, Floats b, Floats c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a * b
inline Floats Max(Floats a, Floats b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Floats Min(Floats a, Floats b) { return {_mm512_min_ps(a.v, b.v)}; }
inline Floats Abs(Floats a) { return {_mm512_abs_ps(a.v)}; }
inline Floats Round(Floats a) {  // to the nearest integer, ties to even
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline Floats TimesPow2(Floats a, Floats n) { return {_mm512_scalef_ps(a.v, n.v)}; }  // a * 2^n, n integral
// Lanes 4k .. 4k + 3 hold s[k].
inline Floats Repeat4(const float* s) {
  const __m512i by_block = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return {_mm512_permutexvar_ps(by_block, _mm512_castps128_ps512(_mm_loadu_ps(s)))};
}
// ((v0 + v8) ...): lanes i + 8 onto i, then i + 4, i + 2, i + 1.
inline float ReduceAdd(Floats a) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}
inline float ReduceMax(Floats a) { return _mm512_reduce_max_ps(a.v); }
// Lanes j with lo <= base + j < hi.
inline Mask KeysIn(int32_t base, int32_t lo, int32_t hi) {
  const __m512i keys = _mm512_add_epi32(
      _mm512_set1_epi32(base), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  return _mm512_cmpge_epi32_mask(keys, _mm512_set1_epi32(lo)) &
         _mm512_cmplt_epi32_mask(keys, _mm512_set1_epi32(hi));
}
inline Floats Keep(Mask m, Floats a) { return {_mm512_maskz_mov_ps(m, a.v)}; }  // 0 outside m
inline float ReduceMax(Mask m, Floats a) { return _mm512_mask_reduce_max_ps(m, a.v); }

// out[j] = the sum of v[j]'s lanes, j < 16, by the tree ((c0 + c2) + (c1 + c3)) of its
// quarters' sums c = (l0 + l2) + (l1 + l3) (a transposing tree: 45 instructions, not 16
// horizontal reductions).
inline Floats Sums16(const Floats* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: keys 2i, 2i + 1, 2i, 2i + 1
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v),
                         _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: keys 4i .. 4i + 3
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)))};
}

inline Ints ZeroI() { return {_mm512_setzero_si512()}; }
inline Ints RoundToInt(Floats a) { return {_mm512_cvtps_epi32(a.v)}; }  // ties to even
inline Ints Clamp(Ints a, int32_t lo, int32_t hi) {
  return {_mm512_max_epi32(_mm512_set1_epi32(lo), _mm512_min_epi32(_mm512_set1_epi32(hi), a.v))};
}
inline Ints AddI(Ints a, Ints b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline Ints ShiftLeft(Ints a, int n) { return {_mm512_slli_epi32(a.v, n)}; }
inline int32_t ReduceAddI(Ints a) { return _mm512_reduce_add_epi32(a.v); }
inline Floats ToFloat(Ints a) { return {_mm512_cvtepi32_ps(a.v)}; }
// 16 bytes: lane j's bits [shift, shift + 8) (arithmetic shift, then its low byte).
inline void StoreBytes(void* p, Ints a, int shift) {
  _mm_storeu_si128(static_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_srai_epi32(a.v, shift)));
}

inline Bytes LoadB(const void* p) { return {_mm512_loadu_si512(p)}; }
inline void StoreB(void* p, Bytes a) { _mm512_storeu_si512(p, a.v); }
// Four quads of blocks (in[q] lane 4b + k: block 4q + b's bytes 4k .. 4k + 3) as the 4-byte
// parts of 16 blocks (out[k] lane l: block l's bytes 4k .. 4k + 3), by two rounds of
// two-source permutes.
inline void TransposeQuads(const Bytes in[4], Bytes out[4]) {
  const __m512i k01 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i k23 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i a01 = _mm512_permutex2var_epi32(in[0].v, k01, in[1].v);  // blocks 0-7, parts 0, 1
  const __m512i a23 = _mm512_permutex2var_epi32(in[0].v, k23, in[1].v);
  const __m512i b01 = _mm512_permutex2var_epi32(in[2].v, k01, in[3].v);  // blocks 8-15
  const __m512i b23 = _mm512_permutex2var_epi32(in[2].v, k23, in[3].v);
  out[0].v = _mm512_permutex2var_epi32(a01, even, b01);
  out[1].v = _mm512_permutex2var_epi32(a01, odd, b01);
  out[2].v = _mm512_permutex2var_epi32(a23, even, b23);
  out[3].v = _mm512_permutex2var_epi32(a23, odd, b23);
}
inline Bytes LoadB(const void* p, int64_t n) {  // n <= 64 bytes, zeros after
  return {_mm512_maskz_loadu_epi8(n < 64 ? (1ULL << n) - 1 : ~0ULL, p)};
}
inline Bytes LowNibbles(Bytes a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(0x0F))}; }
inline Bytes HighNibbles(Bytes a) {
  return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(0x0F))};
}
// acc's lane j + the sum over its 4 bytes of u (unsigned) times s (signed), exact: one of the
// two is always nibbles (0-15), so no pair of products leaves 16 bits.
inline __m512i Dot(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
// Nibbles (0-15) times signed bytes, and unsigned bytes times nibbles, summed by 4 into acc.
inline Ints DotNibblesSigned(Ints acc, Bytes nibbles, Bytes s) { return {Dot(acc.v, nibbles.v, s.v)}; }
inline Ints DotUnsignedNibbles(Ints acc, Bytes u, Bytes nibbles) { return {Dot(acc.v, u.v, nibbles.v)}; }
// Bytes of any value times signed bytes (qmatmul.cc's `Lanes8Tile`: 8-bit weights stored plus
// 128, and x's bytes): acc + per 32-bit lane the sum over its 4 bytes of u (0-255) times s,
// exact (at most 4 * 255 * 128 a lane). Without VNNI each of u's nibbles goes alone: maddubs
// sums pairs in 16 bits, which two products of 255 * 128 would overflow.
inline Ints DotBytes(Ints acc, Bytes u, Bytes s) {
#if defined(__AVX512VNNI__)
  return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)};
#else
  const __m512i one = _mm512_set1_epi16(1);
  const __m512i lo = _mm512_madd_epi16(_mm512_maddubs_epi16(LowNibbles(u).v, s.v), one);
  const __m512i hi = _mm512_madd_epi16(_mm512_maddubs_epi16(HighNibbles(u).v, s.v), one);
  return {_mm512_add_epi32(acc.v, _mm512_add_epi32(_mm512_slli_epi32(hi, 4), lo))};
#endif
}
// Bytes stored plus 128 as signed bytes (the values themselves), and back.
inline Bytes FlipSigns(Bytes a) {
  return {_mm512_xor_si512(a.v, _mm512_set1_epi8(static_cast<char>(0x80)))};
}
inline Ints LoadI(const int32_t* p) { return {_mm512_loadu_si512(p)}; }
// 16 values stored plus 128 (uint8) -> float.
inline Floats FromOffset8(const uint8_t* p) {
  const __m128i b = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                                  _mm_set1_epi8(static_cast<char>(0x80)));
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))};
}
// Output rows the packed kernel's groups read x's digits once for (32 vector registers).
constexpr int kColumns = 2;
#if !defined(__AVX512VNNI__)
// Two dot products into acc without VNNI: their pairs' products summed in 16 bits and widened
// once (a 16-bit lane holds at most 2 * 2 * 255 * 15: one of each pair is nibbles).
inline Ints DotPairs16(Ints acc, Bytes u0, Bytes s0, Bytes u1, Bytes s1) {
  const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(u0.v, s0.v), _mm512_maddubs_epi16(u1.v, s1.v));
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
}
inline Ints DotNibblesSigned2(Ints acc, Bytes n0, Bytes s0, Bytes n1, Bytes s1) {
  return DotPairs16(acc, n0, s0, n1, s1);
}
inline Ints DotUnsignedNibbles2(Ints acc, Bytes u0, Bytes n0, Bytes u1, Bytes n1) {
  return DotPairs16(acc, u0, n0, u1, n1);
}
#define XLASERVE_DOT_PAIRS
// `DotNibblesSignedGroup`: the 8 dot products summed in 16 bits, widened once (see below).
inline Ints DotNibblesSignedGroup(Ints acc, const Bytes* lo, const Bytes* hi, const uint8_t* s) {
  __m512i pairs = _mm512_setzero_si512();
  for (int k = 0; k < 4; ++k) {
    const __m512i a = _mm512_maddubs_epi16(lo[k].v, _mm512_loadu_si512(s + 128 * k));
    const __m512i b = _mm512_maddubs_epi16(hi[k].v, _mm512_loadu_si512(s + 128 * k + 64));
    pairs = _mm512_add_epi16(pairs, _mm512_add_epi16(a, b));
  }
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
}
#define XLASERVE_DOT_GROUP
#endif

inline void Prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void Pause() { _mm_pause(); }

#elif defined(XLASERVE_AVX2)

struct Floats { __m256 lo, hi; };
struct Ints { __m256i lo, hi; };
struct Bytes { __m256i lo, hi; };
struct Mask { __m256 lo, hi; };  // all ones in a kept lane

inline Floats Zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Floats Set(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Floats Load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void Store(float* p, Floats a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline Floats FromHalves(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline __m256 BF16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline Floats FromBF16(const uint16_t* p) { return {BF16x8(p), BF16x8(p + 8)}; }
inline __m256 Int8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Floats FromInt8(const int8_t* p) { return {Int8x8(p), Int8x8(p + 8)}; }
inline Floats Add(Floats a, Floats b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Floats Sub(Floats a, Floats b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Floats Mul(Floats a, Floats b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Floats Fma(Floats a, Floats b, Floats c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Floats Fnma(Floats a, Floats b, Floats c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline Floats Max(Floats a, Floats b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Floats Min(Floats a, Floats b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline Floats Abs(Floats a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline Floats Round(Floats a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
inline __m256 Pow2(__m256 n) {  // 2^n for integral n in [-126, 127]
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Floats TimesPow2(Floats a, Floats n) {  // n in [-126, 127]: 2^n is a normal float
  return {_mm256_mul_ps(a.lo, Pow2(n.lo)), _mm256_mul_ps(a.hi, Pow2(n.hi))};
}
inline Floats Repeat4(const float* s) {
  const __m256 four = _mm256_castps128_ps256(_mm_loadu_ps(s));
  return {_mm256_permutevar8x32_ps(four, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)),
          _mm256_permutevar8x32_ps(four, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3))};
}
inline float ReduceAdd(Floats a) {
  const __m256 h = _mm256_add_ps(a.lo, a.hi);
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}
inline float ReduceMax(Floats a) {
  const __m256 h = _mm256_max_ps(a.lo, a.hi);
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}
inline Mask KeysIn(int32_t base, int32_t lo, int32_t hi) {
  const __m256i k0 = _mm256_add_epi32(_mm256_set1_epi32(base), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i k1 = _mm256_add_epi32(k0, _mm256_set1_epi32(8));
  const __m256i l = _mm256_set1_epi32(lo - 1), h = _mm256_set1_epi32(hi);
  return {_mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(k0, l), _mm256_cmpgt_epi32(h, k0))),
          _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(k1, l), _mm256_cmpgt_epi32(h, k1)))};
}
inline Floats Keep(Mask m, Floats a) { return {_mm256_and_ps(m.lo, a.lo), _mm256_and_ps(m.hi, a.hi)}; }
inline float ReduceMax(Mask m, Floats a) {
  const __m256 none = _mm256_set1_ps(-INFINITY);
  return ReduceMax(Floats{_mm256_blendv_ps(none, a.lo, m.lo), _mm256_blendv_ps(none, a.hi, m.hi)});
}

// The AVX-512 tree, each 256-bit half holding two of its 128-bit quarters.
inline Floats Sums16(const Floats* v) {
  __m256 w[4];
  for (int i = 0; i < 4; ++i) {  // keys 4i .. 4i + 3: each half's quarters, then the halves
    __m256 u[2];
    for (int half = 0; half < 2; ++half) {
      __m256 t[2];
      for (int k = 0; k < 2; ++k) {
        const __m256 a = half ? v[4 * i + 2 * k].hi : v[4 * i + 2 * k].lo;
        const __m256 b = half ? v[4 * i + 2 * k + 1].hi : v[4 * i + 2 * k + 1].lo;
        t[k] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
      }
      u[half] = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    w[i] = _mm256_add_ps(u[0], u[1]);  // quarters (c0 + c2, c1 + c3)
  }
  return {_mm256_add_ps(_mm256_permute2f128_ps(w[0], w[1], 0x20), _mm256_permute2f128_ps(w[0], w[1], 0x31)),
          _mm256_add_ps(_mm256_permute2f128_ps(w[2], w[3], 0x20), _mm256_permute2f128_ps(w[2], w[3], 0x31))};
}

inline Ints ZeroI() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline Ints RoundToInt(Floats a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline Ints Clamp(Ints a, int32_t lo, int32_t hi) {
  const __m256i l = _mm256_set1_epi32(lo), h = _mm256_set1_epi32(hi);
  return {_mm256_max_epi32(l, _mm256_min_epi32(h, a.lo)), _mm256_max_epi32(l, _mm256_min_epi32(h, a.hi))};
}
inline Ints AddI(Ints a, Ints b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline Ints ShiftLeft(Ints a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
inline int32_t ReduceAddI(Ints a) {
  const __m256i h = _mm256_add_epi32(a.lo, a.hi);
  __m128i q = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, _MM_SHUFFLE(1, 0, 3, 2)));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(q);
}
inline Floats ToFloat(Ints a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline void StoreBytes(void* p, Ints a, int shift) {
  alignas(32) int32_t v[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(v), _mm256_srai_epi32(a.lo, shift));
  _mm256_store_si256(reinterpret_cast<__m256i*>(v + 8), _mm256_srai_epi32(a.hi, shift));
  for (int j = 0; j < 16; ++j) static_cast<uint8_t*>(p)[j] = static_cast<uint8_t>(v[j]);
}

inline Bytes LoadB(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline void StoreB(void* p, Bytes a) {
  __m256i* q = static_cast<__m256i*>(p);
  _mm256_storeu_si256(q, a.lo), _mm256_storeu_si256(q + 1, a.hi);
}
// 8 blocks of 4 parts (y[j]: blocks 2j, 2j + 1) -> part k of each, in block order (out[k]).
inline void TransposeHalf(__m256i y0, __m256i y1, __m256i y2, __m256i y3, __m256i out[4]) {
  const __m256i a0 = _mm256_unpacklo_epi32(y0, y1), a1 = _mm256_unpackhi_epi32(y0, y1);
  const __m256i a2 = _mm256_unpacklo_epi32(y2, y3), a3 = _mm256_unpackhi_epi32(y2, y3);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // blocks 0 2 4 6 1 3 5 7
  out[0] = _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi64(a0, a2), order);
  out[1] = _mm256_permutevar8x32_epi32(_mm256_unpackhi_epi64(a0, a2), order);
  out[2] = _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi64(a1, a3), order);
  out[3] = _mm256_permutevar8x32_epi32(_mm256_unpackhi_epi64(a1, a3), order);
}
inline void TransposeQuads(const Bytes in[4], Bytes out[4]) {  // see the AVX-512 target's
  __m256i lo[4], hi[4];
  TransposeHalf(in[0].lo, in[0].hi, in[1].lo, in[1].hi, lo);
  TransposeHalf(in[2].lo, in[2].hi, in[3].lo, in[3].hi, hi);
  for (int k = 0; k < 4; ++k) out[k] = {lo[k], hi[k]};
}
inline Bytes LoadB(const void* p, int64_t n) {  // n <= 64, a multiple of 4: zeros after
  const __m256i lane = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)), lane);
  const __m256i hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n) - 32), lane);
  const int* q = static_cast<const int*>(p);
  return {_mm256_maskload_epi32(q, lo), _mm256_maskload_epi32(q + 8, hi)};  // no fault past n
}
inline Bytes LowNibbles(Bytes a) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m)};
}
inline Bytes HighNibbles(Bytes a) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(a.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(a.hi, 4), m)};
}
inline __m256i Dot8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline Ints DotNibblesSigned(Ints acc, Bytes nibbles, Bytes s) {
  return {Dot8(acc.lo, nibbles.lo, s.lo), Dot8(acc.hi, nibbles.hi, s.hi)};
}
inline Ints DotUnsignedNibbles(Ints acc, Bytes u, Bytes nibbles) {
  return {Dot8(acc.lo, u.lo, nibbles.lo), Dot8(acc.hi, u.hi, nibbles.hi)};
}
constexpr int kColumns = 1;  // 16 vector registers: one output row's nibbles fill them
// `DotBytes`, `FlipSigns`, `LoadI`, `FromOffset8`: see the AVX-512 target's.
inline __m256i DotBytes8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  const __m256i one = _mm256_set1_epi16(1), m = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(u, m), s), one);
  const __m256i hi = _mm256_madd_epi16(
      _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(u, 4), m), s), one);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_slli_epi32(hi, 4), lo));
#endif
}
inline Ints DotBytes(Ints acc, Bytes u, Bytes s) {
  return {DotBytes8(acc.lo, u.lo, s.lo), DotBytes8(acc.hi, u.hi, s.hi)};
}
inline Bytes FlipSigns(Bytes a) {
  const __m256i f = _mm256_set1_epi8(static_cast<char>(0x80));
  return {_mm256_xor_si256(a.lo, f), _mm256_xor_si256(a.hi, f)};
}
inline Ints LoadI(const int32_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
}
inline __m256 Offset8x8(const uint8_t* p) {
  const __m128i b = _mm_xor_si128(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)),
                                  _mm_set1_epi8(static_cast<char>(0x80)));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
inline Floats FromOffset8(const uint8_t* p) { return {Offset8x8(p), Offset8x8(p + 8)}; }
#if !defined(__AVXVNNI__)
// `DotDigits` without VNNI, where each 8-bit dot product is a maddubs (16-bit sums of pairs)
// and a madd to widen them, both multiplies, the scarce ones: each digit's two dot products
// (at the low nibbles' places and the high ones') are summed in 16 bits and widened once,
// 18 multiplies a quad where 24 were. Exact, so the same bits as VNNI's: a 16-bit lane holds
// at most 2 * 2 * 255 * 15 = 15300.
inline __m256i Pairs16(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
  return _mm256_madd_epi16(
      _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)),
      _mm256_set1_epi16(1));
}
// Two dot products into acc, their pairs' products summed in 16 bits and widened once (a
// 16-bit lane holds at most 2 * 2 * 255 * 15, as below).
inline Ints DotPairs16(Ints acc, Bytes u0, Bytes s0, Bytes u1, Bytes s1) {
  return {_mm256_add_epi32(acc.lo, Pairs16(u0.lo, s0.lo, u1.lo, s1.lo)),
          _mm256_add_epi32(acc.hi, Pairs16(u0.hi, s0.hi, u1.hi, s1.hi))};
}
inline Ints DotNibblesSigned2(Ints acc, Bytes n0, Bytes s0, Bytes n1, Bytes s1) {
  return DotPairs16(acc, n0, s0, n1, s1);
}
inline Ints DotUnsignedNibbles2(Ints acc, Bytes u0, Bytes n0, Bytes u1, Bytes n1) {
  return DotPairs16(acc, u0, n0, u1, n1);
}
#define XLASERVE_DOT_PAIRS
// `DotNibblesSignedGroup`: the 8 dot products summed in 16 bits, widened once (see below):
// 18 multiplies a group where 24 were.
inline Ints DotNibblesSignedGroup(Ints acc, const Bytes* lo, const Bytes* hi, const uint8_t* s) {
  __m256i pairs[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int k = 0; k < 4; ++k) {
    const uint8_t* sk = s + 128 * k;
    const __m256i nibbles[2][2] = {{lo[k].lo, hi[k].lo}, {lo[k].hi, hi[k].hi}};
    for (int j = 0; j < 2; ++j) {
      const __m256i* x = reinterpret_cast<const __m256i*>(sk + 32 * j);
      const __m256i a = _mm256_maddubs_epi16(nibbles[j][0], _mm256_loadu_si256(x));
      const __m256i b = _mm256_maddubs_epi16(nibbles[j][1], _mm256_loadu_si256(x + 2));
      pairs[j] = _mm256_add_epi16(pairs[j], _mm256_add_epi16(a, b));
    }
  }
  const __m256i one = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(pairs[0], one)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(pairs[1], one))};
}
#define XLASERVE_DOT_GROUP
// `DotDigitsGroup`: each digit's 8 dot products summed in 16 bits, widened once: 25
// multiplies a group where 36 were. The high digit's lanes hold at most 8 * 2 * 15 * 128 =
// 30720 and are widened as signed (madd); the unsigned digits' at most 8 * 2 * 255 * 15 =
// 61200, which a 16-bit lane holds unsigned, so they are widened by masks and shifts.
inline __m256i Widen16(__m256i v) {  // unsigned 16-bit pairs -> 32-bit sums
  return _mm256_add_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(v, 16));
}
inline void DotDigitsGroup(Ints& h, Ints& m, Ints& l, const Bytes* lo, const Bytes* hi,
                           const uint8_t* d) {
  __m256i sh[2] = {}, sm[2] = {}, sl[2] = {};
  for (int k = 0; k < 4; ++k) {
    const __m256i* x = reinterpret_cast<const __m256i*>(d + 384 * k);  // 6 * 64 bytes a quad
    const __m256i nibbles[2][2] = {{lo[k].lo, hi[k].lo}, {lo[k].hi, hi[k].hi}};
    for (int j = 0; j < 2; ++j) {
      const __m256i n0 = nibbles[j][0], n1 = nibbles[j][1];
      sh[j] = _mm256_add_epi16(sh[j], _mm256_add_epi16(
          _mm256_maddubs_epi16(n0, _mm256_loadu_si256(x + j)),
          _mm256_maddubs_epi16(n1, _mm256_loadu_si256(x + 2 + j))));
      sm[j] = _mm256_add_epi16(sm[j], _mm256_add_epi16(
          _mm256_maddubs_epi16(_mm256_loadu_si256(x + 4 + j), n0),
          _mm256_maddubs_epi16(_mm256_loadu_si256(x + 6 + j), n1)));
      sl[j] = _mm256_add_epi16(sl[j], _mm256_add_epi16(
          _mm256_maddubs_epi16(_mm256_loadu_si256(x + 8 + j), n0),
          _mm256_maddubs_epi16(_mm256_loadu_si256(x + 10 + j), n1)));
    }
  }
  const __m256i one = _mm256_set1_epi16(1);
  h = {_mm256_add_epi32(h.lo, _mm256_madd_epi16(sh[0], one)),
       _mm256_add_epi32(h.hi, _mm256_madd_epi16(sh[1], one))};
  m = {_mm256_add_epi32(m.lo, Widen16(sm[0])), _mm256_add_epi32(m.hi, Widen16(sm[1]))};
  l = {_mm256_add_epi32(l.lo, Widen16(sl[0])), _mm256_add_epi32(l.hi, Widen16(sl[1]))};
}
#define XLASERVE_DIGITS_GROUP
inline __m256i DotDigits8(__m256i lo, __m256i hi, __m256i h0, __m256i h1, __m256i m0,
                          __m256i m1, __m256i l0, __m256i l1) {
  const __m256i h = Pairs16(lo, h0, hi, h1), m = Pairs16(m0, lo, m1, hi);
  const __m256i l = Pairs16(l0, lo, l1, hi);
  return _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(h, 16), _mm256_slli_epi32(m, 8)), l);
}
inline Ints DotDigits(Bytes lo, Bytes hi, Bytes h0, Bytes h1, Bytes m0, Bytes m1, Bytes l0,
                      Bytes l1) {
  return {DotDigits8(lo.lo, hi.lo, h0.lo, h1.lo, m0.lo, m1.lo, l0.lo, l1.lo),
          DotDigits8(lo.hi, hi.hi, h0.hi, h1.hi, m0.hi, m1.hi, l0.hi, l1.hi)};
}
#define XLASERVE_DOT_DIGITS
#endif

inline void Prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void Pause() { _mm_pause(); }

#elif defined(XLASERVE_NEON)

struct Floats { float32x4_t q[4]; };
struct Ints { int32x4_t q[4]; };
struct Bytes { uint8x16_t q[4]; };
struct Mask { uint32x4_t q[4]; };

#define XLASERVE_EACH(expr) \
  { { expr(0), expr(1), expr(2), expr(3) } }

inline Floats Zero() { return {{vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)}}; }
inline Floats Set(float x) { return {{vdupq_n_f32(x), vdupq_n_f32(x), vdupq_n_f32(x), vdupq_n_f32(x)}}; }
inline Floats Load(const float* p) {
#define X(k) vld1q_f32(p + 4 * (k))
  return XLASERVE_EACH(X);
#undef X
}
inline void Store(float* p, Floats a) {
  for (int k = 0; k < 4; ++k) vst1q_f32(p + 4 * k, a.q[k]);
}
inline Floats FromHalves(const uint16_t* p) {
#define X(k) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * (k))))
  return XLASERVE_EACH(X);
#undef X
}
inline Floats FromBF16(const uint16_t* p) {
#define X(k) vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p + 4 * (k)), 16))
  return XLASERVE_EACH(X);
#undef X
}
inline Floats FromInt8(const int8_t* p) {
  const int16x8_t lo = vmovl_s8(vld1_s8(p)), hi = vmovl_s8(vld1_s8(p + 8));
  return {{vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))),
           vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)))}};
}
#define XLASERVE_BINARY(name, op)                              \
  inline Floats name(Floats a, Floats b) {                                    \
    Floats r;                                                       \
    for (int k = 0; k < 4; ++k) r.q[k] = op(a.q[k], b.q[k]);   \
    return r;                                                  \
  }
XLASERVE_BINARY(Add, vaddq_f32)
XLASERVE_BINARY(Sub, vsubq_f32)
XLASERVE_BINARY(Mul, vmulq_f32)
XLASERVE_BINARY(Max, vmaxq_f32)
XLASERVE_BINARY(Min, vminq_f32)
#undef XLASERVE_BINARY
inline Floats Fma(Floats a, Floats b, Floats c) {
  Floats r;
  for (int k = 0; k < 4; ++k) r.q[k] = vfmaq_f32(c.q[k], a.q[k], b.q[k]);
  return r;
}
inline Floats Fnma(Floats a, Floats b, Floats c) {
  Floats r;
  for (int k = 0; k < 4; ++k) r.q[k] = vfmsq_f32(c.q[k], a.q[k], b.q[k]);
  return r;
}
inline Floats Abs(Floats a) {
  for (int k = 0; k < 4; ++k) a.q[k] = vabsq_f32(a.q[k]);
  return a;
}
inline Floats Round(Floats a) {
  for (int k = 0; k < 4; ++k) a.q[k] = vrndnq_f32(a.q[k]);
  return a;
}
inline Floats TimesPow2(Floats a, Floats n) {
  for (int k = 0; k < 4; ++k)
    a.q[k] = vmulq_f32(a.q[k], vreinterpretq_f32_s32(vshlq_n_s32(
                                   vaddq_s32(vcvtnq_s32_f32(n.q[k]), vdupq_n_s32(127)), 23)));
  return a;
}
inline Floats Repeat4(const float* s) {
  return {{vdupq_n_f32(s[0]), vdupq_n_f32(s[1]), vdupq_n_f32(s[2]), vdupq_n_f32(s[3])}};
}
inline float ReduceAdd(Floats a) {
  const float32x4_t q = vaddq_f32(vaddq_f32(a.q[0], a.q[2]), vaddq_f32(a.q[1], a.q[3]));
  // lanes i + 8 onto i, then i + 4: (q0 + q2) + (q1 + q3) per lane, as AVX's halves
  const float32x2_t d = vadd_f32(vget_low_f32(q), vget_high_f32(q));
  return vget_lane_f32(d, 0) + vget_lane_f32(d, 1);
}
inline float ReduceMax(Floats a) {
  return vmaxvq_f32(vmaxq_f32(vmaxq_f32(a.q[0], a.q[1]), vmaxq_f32(a.q[2], a.q[3])));
}
inline Mask KeysIn(int32_t base, int32_t lo, int32_t hi) {
  static const int32_t kLane[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  Mask m;
  for (int k = 0; k < 4; ++k) {
    const int32x4_t keys = vaddq_s32(vdupq_n_s32(base), vld1q_s32(kLane + 4 * k));
    m.q[k] = vandq_u32(vcgeq_s32(keys, vdupq_n_s32(lo)), vcltq_s32(keys, vdupq_n_s32(hi)));
  }
  return m;
}
inline Floats Keep(Mask m, Floats a) {
  for (int k = 0; k < 4; ++k)
    a.q[k] = vreinterpretq_f32_u32(vandq_u32(m.q[k], vreinterpretq_u32_f32(a.q[k])));
  return a;
}
inline float ReduceMax(Mask m, Floats a) {
  for (int k = 0; k < 4; ++k) a.q[k] = vbslq_f32(m.q[k], a.q[k], vdupq_n_f32(-INFINITY));
  return ReduceMax(a);
}
inline Floats Sums16(const Floats* v) {
  Floats r;
  for (int k = 0; k < 4; ++k) {  // output lanes 4k .. 4k + 3: each from its vector's quarters
    float32x4_t c[4];            // c[quarter] = per key: (l0 + l2) + (l1 + l3)
    for (int quarter = 0; quarter < 4; ++quarter) {
      float32x4x4_t t;
      for (int j = 0; j < 4; ++j) t.val[j] = v[4 * k + j].q[quarter];
      // transpose 4 keys x 4 lanes: lane l of key j
      const float32x4_t a01 = vtrn1q_f32(t.val[0], t.val[1]), b01 = vtrn2q_f32(t.val[0], t.val[1]);
      const float32x4_t a23 = vtrn1q_f32(t.val[2], t.val[3]), b23 = vtrn2q_f32(t.val[2], t.val[3]);
      const float32x4_t l0 = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(a01), vreinterpretq_f64_f32(a23)));
      const float32x4_t l1 = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(b01), vreinterpretq_f64_f32(b23)));
      const float32x4_t l2 = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(a01), vreinterpretq_f64_f32(a23)));
      const float32x4_t l3 = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(b01), vreinterpretq_f64_f32(b23)));
      c[quarter] = vaddq_f32(vaddq_f32(l0, l2), vaddq_f32(l1, l3));
    }
    r.q[k] = vaddq_f32(vaddq_f32(c[0], c[2]), vaddq_f32(c[1], c[3]));
  }
  return r;
}

inline Ints ZeroI() { return {{vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)}}; }
inline Ints RoundToInt(Floats a) {
  Ints r;
  for (int k = 0; k < 4; ++k) r.q[k] = vcvtnq_s32_f32(a.q[k]);
  return r;
}
inline Ints Clamp(Ints a, int32_t lo, int32_t hi) {
  for (int k = 0; k < 4; ++k) a.q[k] = vmaxq_s32(vdupq_n_s32(lo), vminq_s32(vdupq_n_s32(hi), a.q[k]));
  return a;
}
inline Ints AddI(Ints a, Ints b) {
  for (int k = 0; k < 4; ++k) a.q[k] = vaddq_s32(a.q[k], b.q[k]);
  return a;
}
inline Ints ShiftLeft(Ints a, int n) {
  for (int k = 0; k < 4; ++k) a.q[k] = vshlq_s32(a.q[k], vdupq_n_s32(n));
  return a;
}
inline int32_t ReduceAddI(Ints a) {
  return vaddvq_s32(vaddq_s32(vaddq_s32(a.q[0], a.q[1]), vaddq_s32(a.q[2], a.q[3])));
}
inline Floats ToFloat(Ints a) {
  Floats r;
  for (int k = 0; k < 4; ++k) r.q[k] = vcvtq_f32_s32(a.q[k]);
  return r;
}
inline void StoreBytes(void* p, Ints a, int shift) {
  int8_t* out = static_cast<int8_t*>(p);
  for (int k = 0; k < 4; ++k) {
    const int32x4_t v = vshlq_s32(a.q[k], vdupq_n_s32(-shift));  // arithmetic right shift
    const int16x4_t h = vmovn_s32(v);                              // low halves, then low bytes
    const int8x8_t b = vmovn_s16(vcombine_s16(h, h));
    vst1_lane_s32(reinterpret_cast<int32_t*>(out + 4 * k), vreinterpret_s32_s8(b), 0);
  }
}

inline Bytes LoadB(const void* p) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  return {{vld1q_u8(b), vld1q_u8(b + 16), vld1q_u8(b + 32), vld1q_u8(b + 48)}};
}
inline void StoreB(void* p, Bytes a) {
  uint8_t* b = static_cast<uint8_t*>(p);
  for (int k = 0; k < 4; ++k) vst1q_u8(b + 16 * k, a.q[k]);
}
// A register is one block's 4 parts here: each quad's 4 registers transposed 4 x 4 are part
// k of its 4 blocks (see the AVX-512 target's).
inline void TransposeQuads(const Bytes in[4], Bytes out[4]) {
  for (int j = 0; j < 4; ++j) {
    const uint32x4x2_t a = vtrnq_u32(vreinterpretq_u32_u8(in[j].q[0]), vreinterpretq_u32_u8(in[j].q[1]));
    const uint32x4x2_t b = vtrnq_u32(vreinterpretq_u32_u8(in[j].q[2]), vreinterpretq_u32_u8(in[j].q[3]));
    const uint64x2_t a0 = vreinterpretq_u64_u32(a.val[0]), a1 = vreinterpretq_u64_u32(a.val[1]);
    const uint64x2_t b0 = vreinterpretq_u64_u32(b.val[0]), b1 = vreinterpretq_u64_u32(b.val[1]);
    out[0].q[j] = vreinterpretq_u8_u64(vzip1q_u64(a0, b0));
    out[1].q[j] = vreinterpretq_u8_u64(vzip1q_u64(a1, b1));
    out[2].q[j] = vreinterpretq_u8_u64(vzip2q_u64(a0, b0));
    out[3].q[j] = vreinterpretq_u8_u64(vzip2q_u64(a1, b1));
  }
}
inline Bytes LoadB(const void* p, int64_t n) {
  alignas(64) uint8_t tmp[64] = {};
  std::memcpy(tmp, p, n);
  return LoadB(tmp);
}
inline Bytes LowNibbles(Bytes a) {
  for (int k = 0; k < 4; ++k) a.q[k] = vandq_u8(a.q[k], vdupq_n_u8(0x0F));
  return a;
}
inline Bytes HighNibbles(Bytes a) {
  for (int k = 0; k < 4; ++k) a.q[k] = vshrq_n_u8(a.q[k], 4);
  return a;
}
// With the nibbles first both operands fit signed bytes (sdot); with them second both are
// non-negative (udot).
inline int32x4_t Dot16(int32x4_t acc, uint8x16_t a, uint8x16_t b, bool signed_bytes) {
#if defined(__ARM_FEATURE_DOTPROD)
  if (signed_bytes) return vdotq_s32(acc, vreinterpretq_s8_u8(a), vreinterpretq_s8_u8(b));
  return vreinterpretq_s32_u32(vdotq_u32(vreinterpretq_u32_s32(acc), a, b));
#else
  int16x8_t lo, hi;  // products of pairs, widened to sums of 2, then of 4
  if (signed_bytes) {
    lo = vmull_s8(vreinterpret_s8_u8(vget_low_u8(a)), vreinterpret_s8_u8(vget_low_u8(b)));
    hi = vmull_s8(vreinterpret_s8_u8(vget_high_u8(a)), vreinterpret_s8_u8(vget_high_u8(b)));
  } else {
    lo = vreinterpretq_s16_u16(vmull_u8(vget_low_u8(a), vget_low_u8(b)));  // <= 255 * 15
    hi = vreinterpretq_s16_u16(vmull_u8(vget_high_u8(a), vget_high_u8(b)));
  }
  return vaddq_s32(acc, vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
#endif
}
inline Ints DotNibblesSigned(Ints acc, Bytes nibbles, Bytes s) {
  for (int k = 0; k < 4; ++k) acc.q[k] = Dot16(acc.q[k], nibbles.q[k], s.q[k], true);
  return acc;
}
inline Ints DotUnsignedNibbles(Ints acc, Bytes u, Bytes nibbles) {
  for (int k = 0; k < 4; ++k) acc.q[k] = Dot16(acc.q[k], u.q[k], nibbles.q[k], false);
  return acc;
}

// `DotBytes`, `FlipSigns`, `LoadI`, `FromOffset8`: see the AVX-512 target's. sdot multiplies
// signed bytes only: u - 128 times s, plus 128 times the sum of s.
inline int32x4_t DotBytes16(int32x4_t acc, uint8x16_t u, uint8x16_t s) {
  const int8x16_t ss = vreinterpretq_s8_u8(s);
#if defined(__ARM_FEATURE_DOTPROD)
  const int8x16_t f = vreinterpretq_s8_u8(veorq_u8(u, vdupq_n_u8(0x80)));
  const int32x4_t sums = vdotq_s32(vdupq_n_s32(0), vdupq_n_s8(1), ss);
  return vaddq_s32(vdotq_s32(acc, f, ss), vshlq_n_s32(sums, 7));
#else
  const int16x8_t s0 = vmovl_s8(vget_low_s8(ss)), s1 = vmovl_s8(vget_high_s8(ss));
  const int16x8_t u0 = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(u)));
  const int16x8_t u1 = vreinterpretq_s16_u16(vmovl_u8(vget_high_u8(u)));
  const int32x4_t p0 = vmull_s16(vget_low_s16(u0), vget_low_s16(s0)), p1 = vmull_high_s16(u0, s0);
  const int32x4_t p2 = vmull_s16(vget_low_s16(u1), vget_low_s16(s1)), p3 = vmull_high_s16(u1, s1);
  return vaddq_s32(acc, vpaddq_s32(vpaddq_s32(p0, p1), vpaddq_s32(p2, p3)));
#endif
}
inline Ints DotBytes(Ints acc, Bytes u, Bytes s) {
  for (int k = 0; k < 4; ++k) acc.q[k] = DotBytes16(acc.q[k], u.q[k], s.q[k]);
  return acc;
}
inline Bytes FlipSigns(Bytes a) {
  for (int k = 0; k < 4; ++k) a.q[k] = veorq_u8(a.q[k], vdupq_n_u8(0x80));
  return a;
}
inline Ints LoadI(const int32_t* p) {
  Ints r;
  for (int k = 0; k < 4; ++k) r.q[k] = vld1q_s32(p + 4 * k);
  return r;
}
inline Floats FromOffset8(const uint8_t* p) {
  const int8x16_t v = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p), vdupq_n_u8(0x80)));
  const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_s8(vget_high_s8(v));
  return {{vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))),
           vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)))}};
}

inline void Prefetch(const void* p) { __builtin_prefetch(p); }
inline void Pause() { asm volatile("yield"); }

#undef XLASERVE_EACH

#else  // portable

struct Floats { float l[16]; };
struct Ints { int32_t l[16]; };
struct Bytes { uint8_t b[64]; };
struct Mask { bool l[16]; };

#define XLASERVE_LANES(expr) \
  Floats r;                       \
  for (int j = 0; j < 16; ++j) r.l[j] = (expr); \
  return r

inline Floats Zero() { XLASERVE_LANES(0.0f); }
inline Floats Set(float x) { XLASERVE_LANES(x); }
inline Floats Load(const float* p) { XLASERVE_LANES(p[j]); }
inline void Store(float* p, Floats a) { std::memcpy(p, a.l, sizeof a.l); }
inline Floats FromHalves(const uint16_t* p) { XLASERVE_LANES(HalfToFloat(p[j])); }
inline float BF16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline Floats FromBF16(const uint16_t* p) { XLASERVE_LANES(BF16ToFloat(p[j])); }
inline Floats FromInt8(const int8_t* p) { XLASERVE_LANES(static_cast<float>(p[j])); }
inline Floats Add(Floats a, Floats b) { XLASERVE_LANES(a.l[j] + b.l[j]); }
inline Floats Sub(Floats a, Floats b) { XLASERVE_LANES(a.l[j] - b.l[j]); }
inline Floats Mul(Floats a, Floats b) { XLASERVE_LANES(a.l[j] * b.l[j]); }
inline Floats Fma(Floats a, Floats b, Floats c) { XLASERVE_LANES(std::fma(a.l[j], b.l[j], c.l[j])); }
inline Floats Fnma(Floats a, Floats b, Floats c) { XLASERVE_LANES(std::fma(-a.l[j], b.l[j], c.l[j])); }
// As x86's max/min: the second operand where either is NaN.
inline Floats Max(Floats a, Floats b) { XLASERVE_LANES(a.l[j] > b.l[j] ? a.l[j] : b.l[j]); }
inline Floats Min(Floats a, Floats b) { XLASERVE_LANES(a.l[j] < b.l[j] ? a.l[j] : b.l[j]); }
inline Floats Abs(Floats a) { XLASERVE_LANES(std::fabs(a.l[j])); }
inline Floats Round(Floats a) { XLASERVE_LANES(std::nearbyint(a.l[j])); }
inline float Pow2(float n) {  // 2^n for integral n in [-126, 127]
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline Floats TimesPow2(Floats a, Floats n) { XLASERVE_LANES(a.l[j] * Pow2(n.l[j])); }
inline Floats Repeat4(const float* s) { XLASERVE_LANES(s[j / 4]); }
inline float ReduceAdd(Floats a) {
  float h[8], q[4];
  for (int j = 0; j < 8; ++j) h[j] = a.l[j] + a.l[j + 8];
  for (int j = 0; j < 4; ++j) q[j] = h[j] + h[j + 4];
  return (q[0] + q[2]) + (q[1] + q[3]);
}
inline float ReduceMax(Floats a) {
  float m = a.l[0];
  for (int j = 1; j < 16; ++j) m = a.l[j] > m ? a.l[j] : m;
  return m;
}
inline Mask KeysIn(int32_t base, int32_t lo, int32_t hi) {
  Mask m;
  for (int j = 0; j < 16; ++j) m.l[j] = base + j >= lo && base + j < hi;
  return m;
}
inline Floats Keep(Mask m, Floats a) { XLASERVE_LANES(m.l[j] ? a.l[j] : 0.0f); }
inline float ReduceMax(Mask m, Floats a) {
  float top = -INFINITY;
  for (int j = 0; j < 16; ++j)
    if (m.l[j] && a.l[j] > top) top = a.l[j];
  return top;
}
inline Floats Sums16(const Floats* v) {
  Floats r;
  for (int j = 0; j < 16; ++j) {
    float c[4];
    for (int k = 0; k < 4; ++k) {
      const float* l = v[j].l + 4 * k;
      c[k] = (l[0] + l[2]) + (l[1] + l[3]);
    }
    r.l[j] = (c[0] + c[2]) + (c[1] + c[3]);
  }
  return r;
}
#undef XLASERVE_LANES

#define XLASERVE_INTS(expr) \
  Ints r;                      \
  for (int j = 0; j < 16; ++j) r.l[j] = (expr); \
  return r
inline Ints ZeroI() { XLASERVE_INTS(0); }
inline Ints RoundToInt(Floats a) { XLASERVE_INTS(static_cast<int32_t>(std::nearbyint(a.l[j]))); }
inline Ints Clamp(Ints a, int32_t lo, int32_t hi) {
  XLASERVE_INTS(a.l[j] < lo ? lo : a.l[j] > hi ? hi : a.l[j]);
}
inline Ints AddI(Ints a, Ints b) { XLASERVE_INTS(static_cast<int32_t>(static_cast<uint32_t>(a.l[j]) + static_cast<uint32_t>(b.l[j]))); }
inline Ints ShiftLeft(Ints a, int n) { XLASERVE_INTS(static_cast<int32_t>(static_cast<uint32_t>(a.l[j]) << n)); }
#undef XLASERVE_INTS
inline int32_t ReduceAddI(Ints a) {
  int32_t s = 0;
  for (int j = 0; j < 16; ++j) s += a.l[j];
  return s;
}
inline Floats ToFloat(Ints a) {
  Floats r;
  for (int j = 0; j < 16; ++j) r.l[j] = static_cast<float>(a.l[j]);
  return r;
}
inline void StoreBytes(void* p, Ints a, int shift) {
  for (int j = 0; j < 16; ++j) static_cast<uint8_t*>(p)[j] = static_cast<uint8_t>(a.l[j] >> shift);
}

inline Bytes LoadB(const void* p) {
  Bytes r;
  std::memcpy(r.b, p, 64);
  return r;
}
inline Bytes LoadB(const void* p, int64_t n) {
  Bytes r = {};
  std::memcpy(r.b, p, n);
  return r;
}
inline void StoreB(void* p, Bytes a) { std::memcpy(p, a.b, 64); }
inline void TransposeQuads(const Bytes in[4], Bytes out[4]) {  // see the AVX-512 target's
  for (int k = 0; k < 4; ++k)
    for (int l = 0; l < 16; ++l) std::memcpy(out[k].b + 4 * l, in[l / 4].b + 16 * (l % 4) + 4 * k, 4);
}
inline Bytes LowNibbles(Bytes a) {
  for (int k = 0; k < 64; ++k) a.b[k] &= 0x0F;
  return a;
}
inline Bytes HighNibbles(Bytes a) {
  for (int k = 0; k < 64; ++k) a.b[k] >>= 4;
  return a;
}
inline Ints DotUS(Ints acc, const Bytes& u, const Bytes& s) {
  for (int j = 0; j < 16; ++j) {
    int32_t sum = 0;
    for (int k = 4 * j; k < 4 * j + 4; ++k) sum += u.b[k] * static_cast<int8_t>(s.b[k]);
    acc.l[j] += sum;
  }
  return acc;
}
inline Ints DotNibblesSigned(Ints acc, Bytes nibbles, Bytes s) { return DotUS(acc, nibbles, s); }
inline Ints DotUnsignedNibbles(Ints acc, Bytes u, Bytes nibbles) { return DotUS(acc, u, nibbles); }
// `DotBytes`, `FlipSigns`, `LoadI`, `FromOffset8`: see the AVX-512 target's.
inline Ints DotBytes(Ints acc, Bytes u, Bytes s) { return DotUS(acc, u, s); }
inline Bytes FlipSigns(Bytes a) {
  for (int k = 0; k < 64; ++k) a.b[k] ^= 0x80;
  return a;
}
inline Ints LoadI(const int32_t* p) {
  Ints r;
  std::memcpy(r.l, p, sizeof r.l);
  return r;
}
inline Floats FromOffset8(const uint8_t* p) {
  Floats r;
  for (int j = 0; j < 16; ++j) r.l[j] = static_cast<float>(static_cast<int32_t>(p[j]) - 128);
  return r;
}

inline void Prefetch(const void* p) { __builtin_prefetch(p); }
inline void Pause() {}

#endif

#if defined(XLASERVE_NEON) || !(defined(XLASERVE_AVX512) || defined(XLASERVE_AVX2))
constexpr int kColumns = 1;
#endif
#if !defined(XLASERVE_DOT_PAIRS)
// Two of the dot products above into acc: nibbles n0 and n1 times signed bytes, or unsigned
// bytes times them (exact, so the same bits however a target sums them).
inline Ints DotNibblesSigned2(Ints acc, Bytes n0, Bytes s0, Bytes n1, Bytes s1) {
  return DotNibblesSigned(DotNibblesSigned(acc, n0, s0), n1, s1);
}
inline Ints DotUnsignedNibbles2(Ints acc, Bytes u0, Bytes n0, Bytes u1, Bytes n1) {
  return DotUnsignedNibbles(DotUnsignedNibbles(acc, u0, n0), u1, n1);
}
#endif

#if !defined(XLASERVE_DOT_GROUP)
// A whole group's dot products with 8-bit x (qmatmul.cc's `PackedColumns`, one byte an
// input): acc + the sum over k < 4 of lo[k] times s's 64 bytes at 128 k and hi[k] times those
// at 128 k + 64, nibbles times signed bytes, summed by 4 into 32-bit lanes. Exact, so the
// same bits however a target sums them; without VNNI on x86 (above) in 16 bits first: a
// 16-bit lane then holds at most 8 * 2 * 15 * 127 = 30480 (x's bytes are within +-127).
inline Ints DotNibblesSignedGroup(Ints acc, const Bytes* lo, const Bytes* hi, const uint8_t* s) {
  for (int k = 0; k < 4; ++k)
    acc = DotNibblesSigned2(acc, lo[k], LoadB(s + 128 * k), hi[k], LoadB(s + 128 * k + 64));
  return acc;
}
#endif

#if !defined(XLASERVE_DIGITS_GROUP)
// A whole group's dot products with 24-bit x (qmatmul.cc's `PackedColumns`, three bytes an
// input): for each of x's digits (high, middle, low; `Prepare` lays each quad out as 6 * 64
// bytes: the high digit at the low nibbles' places, at the high ones', then the middle, the
// low), the sum over the 4 quads of lo[k] and hi[k] times that digit, into h, m and l. Exact,
// so the same bits however a target sums them.
inline void DotDigitsGroup(Ints& h, Ints& m, Ints& l, const Bytes* lo, const Bytes* hi,
                           const uint8_t* d) {
  for (int k = 0; k < 4; ++k, d += 384) {
    h = DotNibblesSigned2(h, lo[k], LoadB(d), hi[k], LoadB(d + 64));
    m = DotUnsignedNibbles2(m, LoadB(d + 128), lo[k], LoadB(d + 192), hi[k]);
    l = DotUnsignedNibbles2(l, LoadB(d + 256), lo[k], LoadB(d + 320), hi[k]);
  }
}
#endif

#if !defined(XLASERVE_DOT_DIGITS)
// A quad of 4-bit values (its low nibbles `lo` and high ones `hi`) times 24-bit integers held
// as three digits, a signed high byte and two unsigned ones, each for the low nibbles' places
// (h0, m0, l0) and the high ones' (h1, m1, l1): per 32-bit lane, 65536 * high + 256 * middle
// + low, exact (qmatmul.cc's `Prepare` says why it stays below 2^31).
inline Ints DotDigits(Bytes lo, Bytes hi, Bytes h0, Bytes h1, Bytes m0, Bytes m1, Bytes l0,
                      Bytes l1) {
  const Ints h = DotNibblesSigned(DotNibblesSigned(ZeroI(), lo, h0), hi, h1);
  const Ints m = DotUnsignedNibbles(DotUnsignedNibbles(ZeroI(), m0, lo), m1, hi);
  const Ints l = DotUnsignedNibbles(DotUnsignedNibbles(ZeroI(), l0, lo), l1, hi);
  return AddI(AddI(ShiftLeft(h, 16), ShiftLeft(m, 8)), l);
}
#endif

// Ask for the line at p into the L2 cache rather than L1 (the attention kernel's keys a block
// ahead: into L1 they gained nothing, the L1's outstanding misses being few). An asm statement
// where there is one: GCC 12 deleted a loop whose body only computed addresses and called
// __builtin_prefetch (or _mm_prefetch), which it holds to have no effect to keep.
inline void PrefetchL2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#elif defined(__aarch64__)
  asm volatile("prfm pldl2keep, %0" : : "Q"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
  asm volatile("" : : "r"(p));
#endif
}

#if !defined(XLASERVE_AVX512)
inline Floats FromHalves(const uint16_t* p, int64_t n) {  // the first n < 16, zeros after
  uint16_t rest[16] = {};
  std::memcpy(rest, p, 2 * n);
  return FromHalves(rest);
}
inline void Store(float* p, Floats a, int64_t n) {  // a's first n lanes
  float all[16];
  Store(all, a);
  std::memcpy(p, all, 4 * n);
}
#endif

}  // namespace xlaserve::simd
