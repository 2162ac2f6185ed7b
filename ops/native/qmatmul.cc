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
// the dot; and its dot's summation order for a row changes with the number of rows. Here
// 8-bit values become float weights in registers and are multiplied with x in float32, and
// 4-bit values run as exact integer dot products with x in 24-bit integers per block of 32
// (`Prepare`, `PackedTile`, VNNI), up to 4 rows at once. For any number of rows, each
// output is the same operations in the same order, so a row's result never depends on the
// other rows of its step. Neither quantizes activations the way llama.cpp does (8 bits).
// Rows are read ahead with
// software prefetches (a token's weights come from memory), and the output rows are split
// over XLA's intra-op thread pool, whose threads read memory in parallel.
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || \
    !defined(__AVX512VNNI__) || !defined(__F16C__)
#error "xlaserve's CPU kernels need AVX-512 (F, BW, VL, VNNI) and F16C"
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

struct Prepared;

struct Problem {
  const float* x;         // [T, I]
  const int8_t* q;        // [O, I] values, or [O, I / 2] packed (uint8), this layer's
  bool packed;            // symmetric packed values are stored plus 8: min = -8 * scale
  const uint16_t* scale;  // [O, G] float16 bits
  const uint16_t* minimum;  // [O, G] or null
  const float* xsum;      // [T, G]: each group's sum of x (one value per int8 with minimums)
  const Prepared* prep;   // packed: x's rows as integer digits
  float* y;               // [T, O]
  int64_t T, I, O, G;
  int shift;              // packed: log2 of the blocks of 32 per scale group
};

// Packed output row o: its values, read ahead kAhead rows on, and its scales and minimums
// as float32 in sc and mn (symmetric values are stored plus 8: minimum = -8 * scale).
inline const uint8_t* PackedRowStart(const Problem& p, int64_t o, float* sc, float* mn) {
  const int64_t G = p.G, row = p.I / 2;
  const uint8_t* qo = reinterpret_cast<const uint8_t*>(p.q) + o * row;
  Prefetch(qo + kAhead * row, row);
  Prefetch(p.scale + (o + kAhead) * G, 2 * G);
  if (p.minimum) Prefetch(p.minimum + (o + kAhead) * G, 2 * G);
  Halves(p.scale + o * G, G, sc);
  if (p.minimum) {
    Halves(p.minimum + o * G, G, mn);
  } else {
    for (int64_t g = 0; g < G; ++g) mn[g] = -8.0f * sc[g];
  }
  return qo;
}

// x's rows as the packed kernel reads them (`Prepare`, once a call, shared by its matrices).
// Each block of 32 inputs of a row is held as 24-bit integers, round(x / s) with s = the
// block's largest |x| / (2^23 - 1) (float32's precision at the block's largest value), split
// into three bytes, a signed high one and two unsigned ones (x = s * (65536 * high + 256 *
// middle + low)), so that the products with 4-bit values run as integer dot products
// (AVX-512 VNNI: 64 byte pairs an instruction), exact. The bytes are laid out as a packed
// block's nibbles are: per quad of 4 blocks, 64 bytes for the values at the low nibbles'
// places (each block's inputs 0-15), 64 for those at the high ones' (16-31); high bytes
// first, then middle, then low.
//
// Why integers for every row count: each output is then the same operations, in the same
// order, for a row whatever else the call holds (a lone decode, 64 of them, a prompt's
// chunk), so a seeded request samples the same tokens alone or under load. (Sixteen bits,
// two dot products fewer, made the default model's logits differ from the float product
// by 4 parts in 10,000 of their range; 24 bits keep float32's own error.)
constexpr int kDigits = 3;

struct Prepared {
  int64_t Q = 0, Bp = 0;          // quads of blocks in a row; blocks rounded up to 16
  std::vector<__m512i> digits;    // [T, Q, 2 * kDigits]
  std::vector<__m512> scale;      // [T, Q]: lanes 4k .. 4k + 3 hold block k's s
  std::vector<float> sums;        // [T, Bp]: each block's sum of x as rounded (for the minimums)
};

void Prepare(const float* x, int64_t T, int64_t I, Prepared* out) {
  const int64_t B = I / 32, Q = (B + 3) / 4, Bp = (B + 15) / 16 * 16;
  const float top = 8388607.0f;  // 2^23 - 1
  const __m512i lim = _mm512_set1_epi32(8388607), neg = _mm512_set1_epi32(-8388607);
  out->Q = Q;
  out->Bp = Bp;
  out->digits.assign(T * Q * 2 * kDigits, _mm512_setzero_si512());
  out->scale.assign(T * Q, _mm512_setzero_ps());
  out->sums.assign(T * Bp, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + t * I + b * 32;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float s = m / top;
      const __m512 inv = _mm512_set1_ps(m > 0 ? top / m : 0.0f);
      // Rounded to nearest (the default rounding mode), and clamped: the largest |x| times
      // inv can round up to 2^23, which the high byte cannot hold.
      const __m512i i0 = _mm512_max_epi32(
          neg, _mm512_min_epi32(lim, _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
      const __m512i i1 = _mm512_max_epi32(
          neg, _mm512_min_epi32(lim, _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
      // The minimums multiply the sum of x as the dots see it: the rounding then errs by
      // sum(w * dx), as a float product would, not by sum(q * scale * dx).
      out->sums[t * Bp + b] = s * static_cast<float>(
          _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
      const int64_t qd = b / 4, k = b % 4;
      char* d = reinterpret_cast<char*>(&out->digits[(t * Q + qd) * 2 * kDigits]) + 16 * k;
      for (int j = 0; j < kDigits; ++j) {  // the high byte first (vpmovdb keeps low bits)
        const int bits = 8 * (kDigits - 1 - j);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 128 * j),
                         _mm512_cvtepi32_epi8(_mm512_srai_epi32(i0, bits)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 128 * j + 64),
                         _mm512_cvtepi32_epi8(_mm512_srai_epi32(i1, bits)));
      }
      float* sc = reinterpret_cast<float*>(&out->scale[t * Q + qd]) + 4 * k;
      sc[0] = sc[1] = sc[2] = sc[3] = s;
    }
  }
}

// Output rows [r0, r1) for N rows of x starting at row t0 (as `p.prep` holds them), from packed
// 4-bit values. A quad of blocks is one 64-byte load, its nibbles (0-15) split once for the N
// rows; times each row's three bytes they are six VNNI dot products into 32-bit lanes (8
// inputs of one block each), an exact integer sum, then a float times the block's weight scale
// and x's; each block's minimum times its sum of x is added at the end. Every row's output is
// the same sequence of operations whatever N is (see `Prepare`). The result differs from the
// float product only by x's rounding to 24 bits per block, as float32's own at the block's
// largest value.
template <int N>
void PackedTile(const Problem& p, int64_t t0, int64_t r0, int64_t r1) {
  const Prepared& x = *p.prep;
  const int64_t G = p.G, B = p.I / 32, Q = x.Q, Bp = x.Bp;
  const int shift = p.shift;  // block b's group is b >> shift
  const __m512i nibble = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  const __m512i by_block = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __mmask64 last = B % 4 ? (1ULL << (16 * (B % 4))) - 1 : ~0ULL;  // the last quad's bytes
  // Per block: its scale and minimum, 0 past the last block (they meet zero digits and sums).
  alignas(64) float sc[kMaxGroups], mn[kMaxGroups], bs[kMaxGroups], bm[kMaxGroups];
  for (int64_t b = G; b < Bp; ++b) sc[b] = mn[b] = 0.0f;  // rows write [0, G) of these
  for (int64_t b = B; b < Bp; ++b) bs[b] = bm[b] = 0.0f;  // and [0, B) of these
  const float* block_scale = shift ? bs : sc;
  const float* block_min = shift ? bm : mn;
  const __m512i* digits = &x.digits[t0 * Q * 2 * kDigits];
  const __m512* xscale = &x.scale[t0 * Q];
  for (int64_t o = r0; o < r1; ++o) {
    const uint8_t* qo = PackedRowStart(p, o, sc, mn);
    if (shift) {
      for (int64_t b = 0; b < B; ++b) bs[b] = sc[b >> shift], bm[b] = mn[b >> shift];
    }
    __m512 acc[N];
    for (int t = 0; t < N; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t qd = 0; qd < Q; ++qd) {
      const __m512i v = qd + 1 < Q ? _mm512_loadu_si512(qo + 64 * qd)
                                   : _mm512_maskz_loadu_epi8(last, qo + 64 * qd);
      const __m512i lo = _mm512_and_si512(v, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      const __m512 ws = _mm512_permutexvar_ps(
          by_block, _mm512_castps128_ps512(_mm_load_ps(block_scale + 4 * qd)));
      for (int t = 0; t < N; ++t) {
        // Per 32-bit lane: |high| <= 8 * 15 * 128, so 65536 * high + 256 * middle + low, exact,
        // stays below 2^31.
        const __m512i* d = digits + (t * Q + qd) * 2 * kDigits;
        __m512i high = _mm512_dpbusd_epi32(zero, lo, d[0]);  // nibbles unsigned, bytes signed
        high = _mm512_dpbusd_epi32(high, hi, d[1]);
        __m512i middle = _mm512_dpbusd_epi32(zero, d[2], lo);  // bytes unsigned, nibbles signed
        middle = _mm512_dpbusd_epi32(middle, d[3], hi);
        __m512i low = _mm512_dpbusd_epi32(zero, d[4], lo);
        low = _mm512_dpbusd_epi32(low, d[5], hi);
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(
            _mm512_add_epi32(_mm512_slli_epi32(high, 16), _mm512_slli_epi32(middle, 8)), low));
        acc[t] = _mm512_fmadd_ps(sum, _mm512_mul_ps(ws, xscale[t * Q + qd]), acc[t]);
      }
    }
    for (int t = 0; t < N; ++t) {
      const float* sums = &x.sums[(t0 + t) * Bp];
      for (int64_t b = 0; b < Bp; b += 16)
        acc[t] = _mm512_fmadd_ps(_mm512_load_ps(block_min + b), _mm512_loadu_ps(sums + b), acc[t]);
      p.y[(t0 + t) * p.O + o] = _mm512_reduce_add_ps(acc[t]);
    }
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
  Prepared prep;  // x's rows as integer digits, when a matrix is packed
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
  if (packed && I / 32 > kMaxGroups)
    return ffi::Error::InvalidArgument("xlaserve_qmatmul: packed rows of at most 32768 inputs");
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
                       xsum.data(), &work->prep, (*y)->typed_data(), T, I, O, G,
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
  for (int64_t m = 0; m < n; ++m) {
    if (work->p[m].packed) {
      Prepare(x.typed_data(), T, I, &work->prep);
      break;
    }
  }
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
