// Copyright 2026 The xlaserve Authors. SPDX-License-Identifier: Apache-2.0
//
// y[T, O] = x[T, I] @ w[O, I]^T for a quantized w, as an XLA FFI custom call on CPU
// (ops/native/__init__.py builds and registers it; ops/quantization.linear calls it), for up
// to 4 matrices w of the same layer at once (ops/quantization.linears: a layer's q, k and v
// projections, its gate and up ones).
//
// w is one layer l of a stacked parameter: values q[L, O, I] (one per int8: int4 in
// [-8, 7], GGUF Q4_1's [0, 15] or int8) or 4-bit values packed two a byte, uint8
// [L, O, I / 2] (ops/quantization.pack), with per group of G = I / gs inputs of one output
// row a float16 scale and, optionally, a float16 minimum:
//
//     w[o, i] = q[l, o, i] * scale[l, o, i / gs] (+ min[l, o, i / gs])
//
// The layer is an operand, not a slice: a slice of the stack passed to a custom call is
// copied first (4.4 ms a token for the default model's 30 layers, measured).
//
// Why a kernel of our own: XLA:CPU runs a one-row product with the dequantization fused
// as a loop on one thread, and at 2-8 rows materializes the dequantized matrix before
// the dot. Here each group's values become float weights in registers (int8 by conversion,
// 4-bit ones by a lane permutation of the group's 16 possible weights) and are multiplied
// with x in float32 (no activation quantization: the result is the float product up to
// summation order), for up to 4 rows at once; rows are read ahead with software prefetches
// (a token's weights come from memory), and the output rows are split over XLA's intra-op
// thread pool, whose threads read memory in parallel.
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__F16C__)
#error "xlaserve's CPU kernels need AVX-512 (F, BW, VL) and F16C"
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxGroups = 1024;  // groups per output row held in a stack buffer
constexpr int64_t kChunkRows = 32;    // output rows per unit of work

inline __m512 Values16(const int8_t* p) {  // 16 int8 -> 16 float
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Output rows read ahead: the hardware's prefetchers stop at 4 KiB pages, and a token's
// weights (tens of MB) come from memory, not cache (1 thread, all 30 layers of the default
// model: 17.2 ms without, against 8.7 ms for the same work from cache).
constexpr int64_t kAhead = 4;

// Ask for `bytes` from `p` on into the cache, a line at a time (reading past the end of an
// array is harmless for a prefetch: it never faults).
inline void Prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// One output row's float16 scales (or minimums) -> float32 in `out`.
inline void Halves(const uint16_t* h, int64_t n, float* out) {
  for (int64_t g = 0; g < n; g += 16) {
    const __mmask16 m = n - g >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - g)) - 1);
    _mm512_mask_storeu_ps(out + g, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, h + g)));
  }
}

struct Problem {
  const float* x;         // [T, I]
  const int8_t* q;        // [O, I] values, or [O, I / 2] packed (uint8), this layer's
  bool packed;            // symmetric packed values are stored plus 8: min = -8 * scale
  const uint16_t* scale;  // [O, G] float16 bits
  const uint16_t* minimum;  // [O, G] or null
  const float* xsum;      // [T, G]: each group's sum of x (one value per int8 with minimums)
  float* y;               // [T, O]
  int64_t T, I, O, G;
  int shift;              // packed: log2 of the blocks of 32 per scale group
};

// The 32 weights of one packed block of 4-bit values (16 bytes, llama.cpp's Q4 layout: byte
// j holds value j in its low nibble, value j + 16 in its high one) as two vectors, when the
// group's 16 possible weights, scale * k + minimum, are the lanes of `table`: each nibble
// becomes its weight by a lane permutation, which reads only an index's low 4 bits (no
// masking, no int-to-float conversion: the port those use is the one the multiplies need).
inline void PackedWeights(const uint8_t* b, __m512 table, __m512* lo, __m512* hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  *lo = _mm512_permutexvar_ps(v, table);
  *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}

// Output rows [r0, r1) for N rows of x starting at row t0, from packed 4-bit values. Blocks
// go two a trip into four accumulators per row (independent chains: the multiplies' latency
// is hidden), held in registers; each scale group's table is made once for the N rows.
template <int N>
void PackedTile(const Problem& p, int64_t t0, int64_t r0, int64_t r1) {
  const int64_t I = p.I, G = p.G, B = I / 32;  // blocks of 32 per output row
  const int shift = p.shift;  // block b's group is b >> shift (a division cost more than a block)
  const float* x = p.x + t0 * I;
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) float sc[kMaxGroups], mn[kMaxGroups];
  for (int64_t o = r0; o < r1; ++o) {
    const uint8_t* qo = reinterpret_cast<const uint8_t*>(p.q) + o * (I / 2);
    Prefetch(qo + kAhead * (I / 2), I / 2);
    Prefetch(p.scale + (o + kAhead) * G, 2 * G);
    if (p.minimum) Prefetch(p.minimum + (o + kAhead) * G, 2 * G);
    Halves(p.scale + o * G, G, sc);
    if (p.minimum) {
      Halves(p.minimum + o * G, G, mn);
    } else {  // symmetric values are stored plus 8
      for (int64_t g = 0; g < G; ++g) mn[g] = -8.0f * sc[g];
    }
    auto table = [&](int64_t b) {
      const int64_t g = b >> shift;
      return _mm512_fmadd_ps(levels, _mm512_set1_ps(sc[g]), _mm512_set1_ps(mn[g]));
    };
    __m512 acc[N][4];
    for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < B; b += 2) {
      __m512 w[4];
      PackedWeights(qo + b * 16, table(b), &w[0], &w[1]);
      PackedWeights(qo + b * 16 + 16, table(b + 1), &w[2], &w[3]);
      for (int t = 0; t < N; ++t) {
        const float* xt = x + t * I + b * 32;
        for (int k = 0; k < 4; ++k)
          acc[t][k] = _mm512_fmadd_ps(w[k], _mm512_loadu_ps(xt + 16 * k), acc[t][k]);
      }
    }
    if (b < B) {
      __m512 w[2];
      PackedWeights(qo + b * 16, table(b), &w[0], &w[1]);
      for (int t = 0; t < N; ++t)
        for (int k = 0; k < 2; ++k)
          acc[t][k] = _mm512_fmadd_ps(w[k], _mm512_loadu_ps(x + t * I + b * 32 + 16 * k), acc[t][k]);
    }
    for (int t = 0; t < N; ++t)
      p.y[(t0 + t) * p.O + o] = _mm512_reduce_add_ps(_mm512_add_ps(
          _mm512_add_ps(acc[t][0], acc[t][1]), _mm512_add_ps(acc[t][2], acc[t][3])));
  }
}

// Output rows [r0, r1) for N rows of x starting at row t0, from one value per int8.
template <int N>
void Tile(const Problem& p, int64_t t0, int64_t r0, int64_t r1) {
  const int64_t I = p.I, G = p.G, gs = I / G;
  const float* x = p.x + t0 * I;
  alignas(64) float sc[kMaxGroups], mn[kMaxGroups];
  for (int64_t o = r0; o < r1; ++o) {
    const int8_t* qo = p.q + o * I;
    Prefetch(qo + kAhead * I, I);
    Prefetch(p.scale + (o + kAhead) * G, 2 * G);
    if (p.minimum) Prefetch(p.minimum + (o + kAhead) * G, 2 * G);
    Halves(p.scale + o * G, G, sc);
    if (p.minimum) Halves(p.minimum + o * G, G, mn);
    __m512 acc0[N], acc1[N];  // two chains, alternating groups
    for (int t = 0; t < N; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
    if (gs == 32) {  // GGUF's blocks and int4's default groups: two groups per trip
      int64_t g = 0;
      for (; g + 1 < G; g += 2) {
        const int8_t* b = qo + g * 32;
        const __m512 w0 = Values16(b), w1 = Values16(b + 16);
        const __m512 w2 = Values16(b + 32), w3 = Values16(b + 48);
        const __m512 s0 = _mm512_set1_ps(sc[g]), s1 = _mm512_set1_ps(sc[g + 1]);
        for (int t = 0; t < N; ++t) {
          const float* xt = x + t * I + g * 32;
          __m512 a = _mm512_mul_ps(w0, _mm512_loadu_ps(xt));
          __m512 c = _mm512_mul_ps(w2, _mm512_loadu_ps(xt + 32));
          a = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), a);
          c = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xt + 48), c);
          acc0[t] = _mm512_fmadd_ps(a, s0, acc0[t]);
          acc1[t] = _mm512_fmadd_ps(c, s1, acc1[t]);
        }
      }
      if (g < G) {
        const int8_t* b = qo + g * 32;
        const __m512 w0 = Values16(b), w1 = Values16(b + 16);
        const __m512 s0 = _mm512_set1_ps(sc[g]);
        for (int t = 0; t < N; ++t) {
          const float* xt = x + t * I + g * 32;
          __m512 a = _mm512_mul_ps(w0, _mm512_loadu_ps(xt));
          a = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), a);
          acc0[t] = _mm512_fmadd_ps(a, s0, acc0[t]);
        }
      }
    } else {  // any group of a multiple of 16 inputs (per-channel int8: one group)
      for (int64_t g = 0; g < G; ++g) {
        __m512 part0[N], part1[N];
        for (int t = 0; t < N; ++t) part0[t] = part1[t] = _mm512_setzero_ps();
        int64_t k = g * gs;
        for (; k + 32 <= (g + 1) * gs; k += 32) {
          const __m512 w0 = Values16(qo + k), w1 = Values16(qo + k + 16);
          for (int t = 0; t < N; ++t) {
            part0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * I + k), part0[t]);
            part1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + t * I + k + 16), part1[t]);
          }
        }
        if (k < (g + 1) * gs) {
          const __m512 w0 = Values16(qo + k);
          for (int t = 0; t < N; ++t)
            part0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * I + k), part0[t]);
        }
        const __m512 s = _mm512_set1_ps(sc[g]);
        for (int t = 0; t < N; ++t)
          acc0[t] = _mm512_fmadd_ps(_mm512_add_ps(part0[t], part1[t]), s, acc0[t]);
      }
    }
    for (int t = 0; t < N; ++t) {
      float v = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t]));
      if (p.minimum) {
        const float* xs = p.xsum + (t0 + t) * G;
        for (int64_t g = 0; g < G; ++g) v += mn[g] * xs[g];
      }
      p.y[(t0 + t) * p.O + o] = v;
    }
  }
}

void Rows(const Problem& p, int64_t r0, int64_t r1) {
  for (int64_t t = 0; t < p.T; t += 4) {
    switch ((p.T - t < 4 ? p.T - t : 4) + (p.packed ? 4 : 0)) {
      case 1: Tile<1>(p, t, r0, r1); break;
      case 2: Tile<2>(p, t, r0, r1); break;
      case 3: Tile<3>(p, t, r0, r1); break;
      case 4: Tile<4>(p, t, r0, r1); break;
      case 5: PackedTile<1>(p, t, r0, r1); break;
      case 6: PackedTile<2>(p, t, r0, r1); break;
      case 7: PackedTile<3>(p, t, r0, r1); break;
      default: PackedTile<4>(p, t, r0, r1); break;
    }
  }
}

// Up to kMaxMatrices products of the same rows x (a layer's q, k and v projections, its gate
// and up ones) in one call: their chunks of output rows are handed out to the caller and the
// pool's threads alike, so the threads split the matrices' rows together (k's and v's 192 rows
// alone are 6 chunks for 2 threads) and wait once. A thread that starts after the last chunk
// was taken touches nothing; the caller returns once every chunk is done (the shared state
// outlives it in the late tasks' hands).
constexpr int64_t kMaxMatrices = 4;

struct Work {
  Problem p[kMaxMatrices];
  int64_t first_chunk[kMaxMatrices + 1];  // matrix m's chunks are [first_chunk[m], first_chunk[m + 1])
  int64_t n = 0;
  std::vector<float> xsum[kMaxMatrices];
  std::atomic<int64_t> next{0}, done{0};
  void Run() {
    const int64_t num_chunks = first_chunk[n];
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < num_chunks;) {
      int64_t m = 0;
      while (c >= first_chunk[m + 1]) ++m;
      const int64_t r0 = (c - first_chunk[m]) * kChunkRows;
      Rows(p[m], r0, r0 + kChunkRows < p[m].O ? r0 + kChunkRows : p[m].O);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

using Rows2 = ffi::Buffer<ffi::F32, 2>;    // x [T, I]
using Halves3 = ffi::Buffer<ffi::F16, 3>;  // scale [L, O, G]
using Index = ffi::Buffer<ffi::S32, 0>;    // layer
using Out2 = ffi::Buffer<ffi::F32, 2>;     // y [T, O]

// Matrix m's operands are args 3m .. 3m + 2 (values, scales, minimums or [0]) and its
// product is result m.
ffi::Error Setup(const float* x, int64_t T, int64_t I, int64_t l, const ffi::RemainingArgs& args,
                 const ffi::RemainingRets& rets, int64_t m, Work* work) {
  auto q = args.get<ffi::AnyBuffer>(3 * m);
  auto scale = args.get<Halves3>(3 * m + 1);
  auto minimum = args.get<ffi::AnyBuffer>(3 * m + 2);
  auto y = rets.get<Out2>(m);
  if (!q.has_value() || !scale.has_value() || !minimum.has_value() || !y.has_value())
    return ffi::Error::InvalidArgument("xlaserve_qmatmul: each matrix is values, float16 "
                                       "scales and minimums, with a float32 result");
  const auto qd = q->dimensions(), sd = scale->dimensions();
  const bool packed = q->element_type() == ffi::DataType::U8;
  if (!packed && q->element_type() != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("xlaserve_qmatmul: values must be int8 or packed uint8");
  if (qd.size() != 3) return ffi::Error::InvalidArgument("xlaserve_qmatmul: values must be [L, O, I]");
  const int64_t L = qd[0], O = qd[1], G = sd[2];
  const auto yd = (*y)->dimensions();
  if (qd[2] * (packed ? 2 : 1) != I || sd[0] != L || sd[1] != O || G < 1 || G > kMaxGroups ||
      I % G || (I / G) % (packed ? 32 : 16) || yd[0] != T || yd[1] != O)
    return ffi::Error::InvalidArgument("xlaserve_qmatmul: shapes do not agree");
  const int64_t per_group = I / G / 32;  // packed: blocks per scale group, a power of two
  if (packed && (per_group & (per_group - 1)))
    return ffi::Error::InvalidArgument("xlaserve_qmatmul: packed groups must be 32 times a power of two");
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("xlaserve_qmatmul: layer out of range");
  const bool has_min = minimum->element_count() != 0;
  if (has_min && (minimum->element_type() != ffi::DataType::F16 ||
                  minimum->element_count() != scale->element_count()))
    return ffi::Error::InvalidArgument("xlaserve_qmatmul: minimums must match the scales");

  const int64_t gs = I / G;
  // Packed values carry their minimums in each group's table; only one value per int8 with
  // minimums needs the group sums of x.
  std::vector<float>& xsum = work->xsum[m];
  xsum.resize(has_min && !packed ? T * G : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(xsum.size()); ++i) {
    const float* xg = x + (i / G) * I + (i % G) * gs;
    __m512 s = _mm512_setzero_ps();
    for (int64_t k = 0; k < gs; k += 16) s = _mm512_add_ps(s, _mm512_loadu_ps(xg + k));
    xsum[i] = _mm512_reduce_add_ps(s);
  }
  work->p[m] = Problem{x,
                       static_cast<const int8_t*>(q->untyped_data()) + l * O * (packed ? I / 2 : I),
                       packed,
                       reinterpret_cast<const uint16_t*>(scale->typed_data()) + l * O * G,
                       has_min ? reinterpret_cast<const uint16_t*>(minimum->untyped_data()) + l * O * G
                               : nullptr,
                       xsum.data(), (*y)->typed_data(), T, I, O, G,
                       packed ? __builtin_ctzll(per_group) : 0};
  work->first_chunk[m + 1] = work->first_chunk[m] + (O + kChunkRows - 1) / kChunkRows;
  return ffi::Error::Success();
}

ffi::Error QMatmul(ffi::ThreadPool pool, Rows2 x, Index layer, ffi::RemainingArgs args,
                   ffi::RemainingRets rets) {
  const int64_t n = rets.size();
  if (n < 1 || n > kMaxMatrices || args.size() != static_cast<size_t>(3 * n))
    return ffi::Error::InvalidArgument("xlaserve_qmatmul: 1 to 4 matrices of 3 operands each");
  const auto xd = x.dimensions();
  const int64_t T = xd[0], I = xd[1], l = *layer.typed_data();
  auto work = std::make_shared<Work>();
  work->n = n;
  work->first_chunk[0] = 0;
  for (int64_t m = 0; m < n; ++m) {
    ffi::Error error = Setup(x.typed_data(), T, I, l, args, rets, m, work.get());
    if (error.failure()) return error;
  }
  if (T == 0) return ffi::Error::Success();
  int64_t helpers = pool.num_threads();
  if (helpers > work->first_chunk[n] - 1) helpers = work->first_chunk[n] - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->first_chunk[n]) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveQMatmul, QMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows2>()  // x [T, I]
                                  .Arg<Index>()  // the layer of every stack
                                  .RemainingArgs()  // per matrix: q [L, O, I] int8 or [L, O, I / 2]
                                                    // uint8, scale [L, O, G], min [L, O, G] or [0]
                                  .RemainingRets());  // per matrix: y [T, O]
