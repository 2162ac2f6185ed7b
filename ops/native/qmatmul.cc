// Copyright 2026 The xlaserve Authors. SPDX-License-Identifier: Apache-2.0
//
// y[T, O] = x[T, I] @ w[O, I]^T for a quantized w, as an XLA FFI custom call on CPU
// (ops/native/__init__.py builds and registers it; ops/cpu_linear.py calls it), for up to 4
// matrices w of the same layer at once (ops/quantized_linear.linears: a layer's q, k and v
// projections, its gate and up ones).
//
// w is one layer l of a stacked parameter: values q[L, O, I] (one per int8: int4 in
// [-8, 7], GGUF Q4_1's [0, 15] or int8) or 4-bit values packed two a byte, uint8
// [L, O, I / 2] (ops/quantization.pack with lanes: each whole group of 16 blocks in the
// order `PackedColumns` reads), with per group of G = I / gs inputs of one output
// row a float16 scale and, optionally, a float16 minimum:
//
//     w[o, i] = q[l, o, i] * scale[l, o, i / gs] (+ min[l, o, i / gs])
//
// The layer is an operand, not a slice: a slice of the stack passed to a custom call is
// copied first (4.4 ms a token for the default model's 30 layers, measured).
//
// Written once in simd.h's vectors and compiled per instruction set (AVX-512, AVX2, NEON,
// portable C++): the same operations in the same order on each, so the same bits.
//
// Why a kernel of our own: XLA:CPU runs a one-row product with the dequantization fused
// as a loop on one thread, and at 2-8 rows materializes the dequantized matrix before
// the dot; and its dot's summation order for a row changes with the number of rows. Here
// 8-bit values become float weights in registers and are multiplied with x in float32, and
// 4-bit values run as exact integer dot products with x in 24-bit integers per block of 32
// (`Prepare`, `PackedTile`: VNNI's dot products, or their exact equivalents), up to 4 rows
// at once; on request (the x_bits attribute 8, --cpu-activation-dtype int8) x in 8 bits per
// block instead, the way llama.cpp quantizes activations. For any number of rows, each
// output is the same operations in the same order, so a row's result never depends on the
// other rows of its step. Rows are read ahead with software prefetches (a token's
// weights come from memory), and the output rows are split over XLA's intra-op thread pool,
// whose threads read memory in parallel (`Compute` says how).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "simd.h"

namespace xlaserve::qmatmul {

using namespace simd;

constexpr int64_t kMaxGroups = 1024;  // groups per output row held in a stack buffer
constexpr int64_t kMaxMatrices = 4;   // products of the same rows in one call
constexpr int64_t kTileRows = 4;      // rows of x a pass over the weights multiplies (`Rows`)
// ... over packed 4-bit weights: a pass splits each group's nibbles once for all its rows, and
// on AVX2 that split, not the read, is most of a lone row's time (a first-generation EPYC:
// 5 and 8 rows took 0.84x the time in one pass of 8 as in passes of 4, x in 8 bits; 0.91x and
// 0.95x in 24). Two output columns at once (AVX-512) keep 4: 8 rows' sums for both would fill
// its 32 registers before the nibbles (not measured).
constexpr int64_t kPackedTileRows = 8 / kColumns;
// Output rows per unit of work: the call's rows over kChunksPerWorker units a worker, in
// whole multiples of 32 rows within [kMinChunkRows, kMaxChunkRows], and at most
// kMaxChunkProducts / T rows, so that a prompt's many rows (--batch-invariant) keep short
// chunks (see `Compute`).
constexpr int64_t kChunksPerWorker = 4;
constexpr int64_t kMinChunkRows = 32, kMaxChunkRows = 256, kMaxChunkProducts = 2048;

// Output rows read ahead: the hardware's prefetchers stop at 4 KiB pages, and a token's
// weights (tens of MB) come from memory, not cache (1 thread, all 30 layers of the default
// model: 17.2 ms without, against 8.7 ms for the same work from cache).
constexpr int64_t kAhead = 4;

// Ask for `bytes` from `p` on into the cache, a line at a time (reading past the end of an
// array is harmless for a prefetch: it never faults). An ordinary prefetch, into every level:
// a non-temporal one (NTA, for data read once) halved a lone decode's read rate on Sapphire
// Rapids (a [28, 8960, 1536] stack at one row, 2 threads: 10.9 against 20.8 GB/s) and gained
// at most 4% on Zen 4 (docs/performance-log.md, "A one-row product's prefetch").
inline void PrefetchBytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) Prefetch(c + i);
}

// One output row's float16 scales (or minimums) -> float32 in `out`. A row of 16 or more
// ends with its last 16, again where they overlap the ones before (the same values): a
// partial vector goes through memcpy on AVX2, a fifth of the time of a one-row product of 18
// groups (the default model's rows, a 2-vCPU Zen 3).
inline void Halves(const uint16_t* h, int64_t n, float* out) {
  if (n < 16) {
    Store(out, FromHalves(h, n), n);
    return;
  }
  int64_t g = 0;
  for (; g + 16 <= n; g += 16) Store(out + g, FromHalves(h + g));
  if (g < n) Store(out + n - 16, FromHalves(h + n - 16));
}

// One matrix of a call: w = q * scale (+ min) of one layer, and its product y [T, O].
struct Matrix {
  const void* q;            // [O, I] int8 values, or [O, I / 2] packed (uint8), or [O, I] 8-bit
                            // values plus 128 in the kernel's order (uint8, `lanes8`), this layer's
  bool packed;              // symmetric packed values are stored plus 8: min = -8 * scale
  bool lanes8;              // 8-bit values as `Lanes8Tile` reads them (no minimums)
  const uint16_t* scale;    // [O, G] float16 bits
  const uint16_t* minimum;  // [O, G] or null
  float* y;                 // [T, O]
  int64_t O, G;
};

struct Prepared;

struct Problem {
  const float* x;         // [T, I]
  Matrix m;
  const float* xsum;      // [T, G]: each group's sum of x (one value per int8 with minimums)
  const Prepared* prep;   // packed: x's rows as integers of bytes
  int64_t T, I;
  int shift;              // packed: log2 of the blocks of 32 per scale group
};

// Packed output row o: its values, read ahead kAhead rows on, and its scales and minimums
// as float32 in sc and mn (symmetric values are stored plus 8: minimum = -8 * scale).
inline const uint8_t* PackedRowStart(const Problem& p, int64_t o, float* sc, float* mn) {
  const int64_t G = p.m.G, row = p.I / 2;
  const uint8_t* qo = static_cast<const uint8_t*>(p.m.q) + o * row;
  PrefetchBytes(qo + kAhead * row, row);
  PrefetchBytes(p.m.scale + (o + kAhead) * G, 2 * G);
  if (p.m.minimum) PrefetchBytes(p.m.minimum + (o + kAhead) * G, 2 * G);
  Halves(p.m.scale + o * G, G, sc);
  if (p.m.minimum) {
    Halves(p.m.minimum + o * G, G, mn);
  } else {
    for (int64_t g = 0; g < G; ++g) mn[g] = -8.0f * sc[g];
  }
  return qo;
}

// x's rows as the packed kernel reads them (`Prepare`, once a call, shared by its matrices).
// Each block of 32 inputs of a row is held as integers of `bits` bits, round(x / s) with s =
// the block's largest |x| / (2^(bits - 1) - 1), split into bytes: 24 bits (the default) as
// three, a signed high one and two unsigned ones (x = s * (65536 * high + 256 * middle +
// low)), float32's precision at the block's largest value; 8 bits (--cpu-activation-dtype
// int8) as one signed byte, as llama.cpp's Q8 activations are. The products with 4-bit values
// then run as integer dot products (64 byte pairs a DotNibblesSigned), exact. The bytes are
// laid out as a packed block's nibbles are: per quad of 4 blocks, 64 bytes for the values at
// the low nibbles' places (each block's inputs 0-15), 64 for those at the high ones' (16-31);
// high bytes first, then middle, then low. Each whole group of 16 blocks (4 quads) is then
// held as the weights are held there (ops/quantization.to_lanes): transposed
// (TransposeQuads), quad slot k holding part k (inputs 4k .. 4k + 3, and 16 on) of the 16
// blocks, a block a 32-bit lane.
//
// Why integers for every row count: each output is then the same operations, in the same
// order, for a row whatever else the call holds (a lone decode, 64 of them, a prompt's
// chunk), so a seeded request samples the same tokens alone or under load. (Sixteen bits,
// two dot products fewer, made the default model's logits differ from the float product
// by 4 parts in 10,000 of their range; 24 bits keep float32's own error. 8 bits are a third
// of the dot products, for CPUs whose lone decode is bound by them rather than by the read:
// docs/performance-log.md, "8-bit activations for the 4-bit kernel".)
struct Prepared {
  int digits = 3;                 // bytes an input: 3 (24 bits) or 1 (8)
  int64_t Q = 0, Bp = 0, NG = 0;  // quads of blocks in a row; blocks rounded up to 16; whole
                                  // groups of 16 blocks
  std::vector<Bytes64> bytes;     // [T, Q, 2 * digits]
  std::vector<Bytes64> scale;     // [T, Q]: 16 floats, lanes 4k .. 4k + 3 hold block k's s
  std::vector<float> block_scale; // [T, Bp]: each block's s
  std::vector<float> sums;        // [T, Bp]: each block's sum of x as rounded (for the minimums)
  std::vector<int32_t> lift;      // where a matrix is `lanes8`, -128 times sums of x's high (or
                                  // only) bytes: [T, Bp] each block's, for the whole groups
  std::vector<int32_t> lift_quads;  // [T, Q, 16]: each 32-bit lane's (8 inputs: 4 at the low
                                    // nibbles' places, 4 at the high ones'), for the other quads
};

void Prepare(const float* x, int64_t T, int64_t I, int bits, bool lift, Prepared* out) {
  const int64_t B = I / 32, Q = (B + 3) / 4, Bp = (B + 15) / 16 * 16;
  const int D = out->digits = bits / 8;
  const int32_t limit = (1 << (bits - 1)) - 1;  // 2^23 - 1 or 127
  const float top = static_cast<float>(limit);
  out->Q = Q;
  out->Bp = Bp;
  out->NG = B / 16;
  out->bytes.assign(T * Q * 2 * D, Bytes64{});
  out->scale.assign(T * Q, Bytes64{});
  out->block_scale.assign(T * Bp, 0.0f);
  out->sums.assign(T * Bp, 0.0f);
  out->lift.assign(lift ? T * Bp : 0, 0);
  out->lift_quads.assign(lift ? T * Q * 16 : 0, 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + t * I + b * 32;
      const Floats v0 = Load(xb), v1 = Load(xb + 16);
      const float m = ReduceMax(Max(Abs(v0), Abs(v1)));
      const float s = m / top;
      const Floats inv = Set(m > 0 ? top / m : 0.0f);
      // Rounded to nearest, ties to even, and clamped: the largest |x| times inv can round
      // up to 2^(bits - 1), which the high byte cannot hold.
      const Ints i0 = Clamp(RoundToInt(Mul(v0, inv)), -limit, limit);
      const Ints i1 = Clamp(RoundToInt(Mul(v1, inv)), -limit, limit);
      // The minimums multiply the sum of x as the dots see it: the rounding then errs by
      // sum(w * dx), as a float product would, not by sum(q * scale * dx).
      out->sums[t * Bp + b] = s * static_cast<float>(ReduceAddI(AddI(i0, i1)));
      const int64_t qd = b / 4, k = b % 4;
      uint8_t* d = out->bytes[(t * Q + qd) * 2 * D].b + 16 * k;
      for (int j = 0; j < D; ++j) {  // the high byte first
        const int shift = 8 * (D - 1 - j);
        StoreBytes(d + 128 * j, i0, shift);
        StoreBytes(d + 128 * j + 64, i1, shift);
      }
      if (lift) {  // the high bytes' sums, as `Lanes8Tile` multiplies them (signed)
        int32_t* lanes = &out->lift_quads[(t * Q + qd) * 16 + 4 * k];
        for (int i = 0; i < 4; ++i) {
          int32_t high = 0;
          for (int j = 4 * i; j < 4 * i + 4; ++j)
            high += static_cast<int8_t>(d[j]) + static_cast<int8_t>(d[64 + j]);
          lanes[i] = -128 * high;
        }
        out->lift[t * Bp + b] = lanes[0] + lanes[1] + lanes[2] + lanes[3];
      }
      float* sc = reinterpret_cast<float*>(out->scale[t * Q + qd].b) + 4 * k;
      sc[0] = sc[1] = sc[2] = sc[3] = s;
      out->block_scale[t * Bp + b] = s;
    }
    for (int64_t g = 0; g < out->NG; ++g) {  // whole groups: transposed in place
      Bytes64* d = &out->bytes[(t * Q + 4 * g) * 2 * D];
      for (int j = 0; j < 2 * D; ++j) {
        Bytes quads[4], parts[4];
        for (int q = 0; q < 4; ++q) quads[q] = LoadB(d[2 * D * q + j].b);
        TransposeQuads(quads, parts);
        for (int k = 0; k < 4; ++k) StoreB(d[2 * D * k + j].b, parts[k]);
      }
    }
  }
}

// Output rows [r0, r1) for N rows of x starting at row t0 (as `p.prep` holds them), from packed
// 4-bit values, C output rows at a time (simd.h's kColumns: they share the loads of x).
//
// A whole group of 16 blocks (256 bytes of a row) is held with a block a 32-bit lane
// (ops/quantization.to_lanes: 4 registers, part k of every block's 16 bytes in the k-th, as
// `Prepare` transposes x's bytes with TransposeQuads; so transposed at load, not by every
// token: a lone row's products took 0.85x the time on AVX2), loaded and its nibbles split
// once for the N rows; for each row
// and each of x's D bytes, 8 integer dot products sum a block's 32 products in its lane,
// exact: h (the high bytes', |h| <= 32 * 15 * 128) and m, l (<= 32 * 15 * 255). Then per
// block one float, 65536 * h + 256 * m + l rounded once (256 * h + m is exact in float32, as
// is l; with one byte, h alone, exact), times the block's weight scale and x's, added to the
// block's lane. The blocks after the last whole group (at most 15) go a quad at a time: per
// 32-bit lane (8 inputs of one block) 65536 * high + 256 * middle + low in integers, exact
// (|high| <= 8 * 15 * 128: below 2^31), then a float times the scales. Each block's minimum times its sum of x is added at
// the end, and the 16 lanes are summed. Every row's output is the same sequence of operations
// whatever N and C are (see `Prepare`); it differs from the float product by x's rounding to
// D bytes per block (with 3, as float32's own at the block's largest value), and one rounding
// a block (a lane of a quad) where the float product rounds at each of its 32 (8).
//
// Inlined into `PackedTile`: a call per output row cost a lone decode's products 6% on AVX2
// (a first-generation EPYC; docs/performance-log.md, "The 4-bit kernel's groups on AVX2").
template <int D, int N, int C>
__attribute__((always_inline)) inline void PackedColumns(
    const Problem& p, int64_t t0, int64_t o, float (*sc)[kMaxGroups], float (*mn)[kMaxGroups],
    float (*bs)[kMaxGroups], float (*bm)[kMaxGroups]) {
  const Prepared& x = *p.prep;
  const int64_t B = p.I / 32, Q = x.Q, Bp = x.Bp;
  const int shift = p.shift;  // block b's group is b >> shift
  const int64_t last = B % 4 ? 16 * (B % 4) : 64;  // the last quad's bytes
  const uint8_t* qo[C];
  const float* block_scale[C];
  const float* block_min[C];
  for (int c = 0; c < C; ++c) {
    qo[c] = PackedRowStart(p, o + c, sc[c], mn[c]);
    if (shift) {
      for (int64_t b = 0; b < B; ++b) bs[c][b] = sc[c][b >> shift], bm[c][b] = mn[c][b >> shift];
    }
    block_scale[c] = shift ? bs[c] : sc[c];
    block_min[c] = shift ? bm[c] : mn[c];
  }
  Floats acc[C][N];
  for (int c = 0; c < C; ++c)
    for (int t = 0; t < N; ++t) acc[c][t] = Zero();
  for (int64_t g = 0; g < x.NG; ++g) {
    Bytes lo[C][4], hi[C][4];
    Floats ws[C];
    for (int c = 0; c < C; ++c) {
      for (int k = 0; k < 4; ++k) {  // part k of the 16 blocks (ops/quantization.to_lanes)
        const Bytes part = LoadB(qo[c] + 256 * g + 64 * k);
        lo[c][k] = LowNibbles(part), hi[c][k] = HighNibbles(part);
      }
      ws[c] = Load(block_scale[c] + 16 * g);
    }
    for (int t = 0; t < N; ++t) {
      const Bytes64* d = &x.bytes[((t0 + t) * Q + 4 * g) * 2 * D];
      Ints h[C], m[C], l[C];
      for (int c = 0; c < C; ++c) h[c] = m[c] = l[c] = ZeroI();
      if constexpr (D == 3) {  // each of the 4 quads: 6 * 64 bytes, the high digit first
        for (int c = 0; c < C; ++c) DotDigitsGroup(h[c], m[c], l[c], lo[c], hi[c], d[0].b);
      } else {  // the group's 4 quads of one byte an input: 512 contiguous bytes
        for (int c = 0; c < C; ++c) h[c] = DotNibblesSignedGroup(h[c], lo[c], hi[c], d[0].b);
      }
      const Floats xs = Load(&x.block_scale[(t0 + t) * Bp + 16 * g]);
      for (int c = 0; c < C; ++c) {
        Floats v;
        if constexpr (D == 3) {
          v = Fma(ToFloat(AddI(ShiftLeft(h[c], 8), m[c])), Set(256.0f), ToFloat(l[c]));
        } else {
          v = ToFloat(h[c]);
        }
        acc[c][t] = Fma(v, Mul(ws[c], xs), acc[c][t]);
      }
    }
  }
  const Bytes64* bytes = &x.bytes[t0 * Q * 2 * D];
  const Bytes64* xscale = &x.scale[t0 * Q];
  for (int c = 0; c < C; ++c) {
    for (int64_t qd = 4 * x.NG; qd < Q; ++qd) {
      const Bytes v = qd + 1 < Q ? LoadB(qo[c] + 64 * qd) : LoadB(qo[c] + 64 * qd, last);
      const Bytes lo = LowNibbles(v), hi = HighNibbles(v);
      const Floats ws = Repeat4(block_scale[c] + 4 * qd);
      for (int t = 0; t < N; ++t) {
        const Bytes64* d = bytes + (t * Q + qd) * 2 * D;
        Floats sum;
        if constexpr (D == 3) {
          sum = ToFloat(DotDigits(lo, hi, LoadB(d[0].b), LoadB(d[1].b), LoadB(d[2].b),
                                  LoadB(d[3].b), LoadB(d[4].b), LoadB(d[5].b)));
        } else {
          sum = ToFloat(DotNibblesSigned2(ZeroI(), lo, LoadB(d[0].b), hi, LoadB(d[1].b)));
        }
        const Floats xs = Load(reinterpret_cast<const float*>(xscale[t * Q + qd].b));
        acc[c][t] = Fma(sum, Mul(ws, xs), acc[c][t]);
      }
    }
    for (int t = 0; t < N; ++t) {
      const float* sums = &x.sums[(t0 + t) * Bp];
      for (int64_t b = 0; b < Bp; b += 16)
        acc[c][t] = Fma(Load(block_min[c] + b), Load(sums + b), acc[c][t]);
      p.m.y[(t0 + t) * p.m.O + o + c] = ReduceAdd(acc[c][t]);
    }
  }
}

template <int D, int N>
void PackedTile(const Problem& p, int64_t t0, int64_t r0, int64_t r1) {
  const int64_t G = p.m.G, B = p.I / 32, Bp = p.prep->Bp;
  // Per block: its scale and minimum, 0 past the last block (they meet zero digits and sums).
  alignas(64) float sc[kColumns][kMaxGroups], mn[kColumns][kMaxGroups];
  alignas(64) float bs[kColumns][kMaxGroups], bm[kColumns][kMaxGroups];
  for (int c = 0; c < kColumns; ++c) {
    for (int64_t b = G; b < Bp; ++b) sc[c][b] = mn[c][b] = 0.0f;  // rows write [0, G) of these
    for (int64_t b = B; b < Bp; ++b) bs[c][b] = bm[c][b] = 0.0f;  // and [0, B) of these
  }
  int64_t o = r0;
  for (; o + kColumns <= r1; o += kColumns) PackedColumns<D, N, kColumns>(p, t0, o, sc, mn, bs, bm);
  for (; o < r1; ++o) PackedColumns<D, N, 1>(p, t0, o, sc, mn, bs, bm);
}

// Output rows [r0, r1) for N rows of x starting at row t0, from one value per int8.
template <int N>
void Tile(const Problem& p, int64_t t0, int64_t r0, int64_t r1) {
  const int64_t I = p.I, G = p.m.G, gs = I / G;
  const float* x = p.x + t0 * I;
  const int8_t* q = static_cast<const int8_t*>(p.m.q);
  alignas(64) float sc[kMaxGroups], mn[kMaxGroups];
  for (int64_t o = r0; o < r1; ++o) {
    const int8_t* qo = q + o * I;
    PrefetchBytes(qo + kAhead * I, I);
    PrefetchBytes(p.m.scale + (o + kAhead) * G, 2 * G);
    if (p.m.minimum) PrefetchBytes(p.m.minimum + (o + kAhead) * G, 2 * G);
    Halves(p.m.scale + o * G, G, sc);
    if (p.m.minimum) Halves(p.m.minimum + o * G, G, mn);
    Floats acc0[N], acc1[N];  // two chains, alternating groups
    for (int t = 0; t < N; ++t) acc0[t] = acc1[t] = Zero();
    if (gs == 16) {  // GGUF's Q6_K groups: four per trip, one chain each, folded into two
      Floats acc2[N], acc3[N];
      for (int t = 0; t < N; ++t) acc2[t] = acc3[t] = Zero();
      int64_t g = 0;
      for (; g + 3 < G; g += 4) {
        const int8_t* b = qo + g * 16;
        const Floats w0 = FromInt8(b), w1 = FromInt8(b + 16);
        const Floats w2 = FromInt8(b + 32), w3 = FromInt8(b + 48);
        for (int t = 0; t < N; ++t) {
          const float* xt = x + t * I + g * 16;
          acc0[t] = Fma(Mul(w0, Load(xt)), Set(sc[g]), acc0[t]);
          acc1[t] = Fma(Mul(w1, Load(xt + 16)), Set(sc[g + 1]), acc1[t]);
          acc2[t] = Fma(Mul(w2, Load(xt + 32)), Set(sc[g + 2]), acc2[t]);
          acc3[t] = Fma(Mul(w3, Load(xt + 48)), Set(sc[g + 3]), acc3[t]);
        }
      }
      for (; g < G; ++g) {
        const Floats w0 = FromInt8(qo + g * 16);
        for (int t = 0; t < N; ++t)
          acc0[t] = Fma(Mul(w0, Load(x + t * I + g * 16)), Set(sc[g]), acc0[t]);
      }
      for (int t = 0; t < N; ++t) {
        acc0[t] = Add(acc0[t], acc2[t]);
        acc1[t] = Add(acc1[t], acc3[t]);
      }
    } else if (gs == 32) {  // GGUF's blocks and int4's default groups: two groups per trip
      int64_t g = 0;
      for (; g + 1 < G; g += 2) {
        const int8_t* b = qo + g * 32;
        const Floats w0 = FromInt8(b), w1 = FromInt8(b + 16);
        const Floats w2 = FromInt8(b + 32), w3 = FromInt8(b + 48);
        const Floats s0 = Set(sc[g]), s1 = Set(sc[g + 1]);
        for (int t = 0; t < N; ++t) {
          const float* xt = x + t * I + g * 32;
          Floats a = Mul(w0, Load(xt));
          Floats c = Mul(w2, Load(xt + 32));
          a = Fma(w1, Load(xt + 16), a);
          c = Fma(w3, Load(xt + 48), c);
          acc0[t] = Fma(a, s0, acc0[t]);
          acc1[t] = Fma(c, s1, acc1[t]);
        }
      }
      if (g < G) {
        const int8_t* b = qo + g * 32;
        const Floats w0 = FromInt8(b), w1 = FromInt8(b + 16);
        const Floats s0 = Set(sc[g]);
        for (int t = 0; t < N; ++t) {
          const float* xt = x + t * I + g * 32;
          Floats a = Mul(w0, Load(xt));
          a = Fma(w1, Load(xt + 16), a);
          acc0[t] = Fma(a, s0, acc0[t]);
        }
      }
    } else {  // any group of a multiple of 16 inputs (per-channel int8: one group)
      for (int64_t g = 0; g < G; ++g) {
        Floats part0[N], part1[N];
        for (int t = 0; t < N; ++t) part0[t] = part1[t] = Zero();
        int64_t k = g * gs;
        for (; k + 32 <= (g + 1) * gs; k += 32) {
          const Floats w0 = FromInt8(qo + k), w1 = FromInt8(qo + k + 16);
          for (int t = 0; t < N; ++t) {
            part0[t] = Fma(w0, Load(x + t * I + k), part0[t]);
            part1[t] = Fma(w1, Load(x + t * I + k + 16), part1[t]);
          }
        }
        if (k < (g + 1) * gs) {
          const Floats w0 = FromInt8(qo + k);
          for (int t = 0; t < N; ++t) part0[t] = Fma(w0, Load(x + t * I + k), part0[t]);
        }
        const Floats s = Set(sc[g]);
        for (int t = 0; t < N; ++t) acc0[t] = Fma(Add(part0[t], part1[t]), s, acc0[t]);
      }
    }
    for (int t = 0; t < N; ++t) {
      float v = ReduceAdd(Add(acc0[t], acc1[t]));
      if (p.m.minimum) {  // each group's minimum times its sum of x, 16 groups at a time
        const float* xs = p.xsum + (t0 + t) * G;
        Floats m = Zero();
        int64_t g = 0;
        for (; g + 16 <= G; g += 16) m = Fma(Load(mn + g), Load(xs + g), m);
        v += ReduceAdd(m);
        for (; g < G; ++g) v += mn[g] * xs[g];
      }
      p.m.y[(t0 + t) * p.m.O + o] = v;
    }
  }
}

// Output rows [r0, r1) for N rows of x starting at row t0 (as `p.prep` holds them), from 8-bit
// values stored plus 128 (uint8, u = w + 128) in the order ops/quantization.to_lanes8 gives
// them: in each whole group of 16 blocks (512 bytes of a row), 128 bytes per part k of the 16
// blocks, first at the low nibbles' places (inputs 4k .. 4k + 3 of each block), then at the high
// ones' (16 on), a block a 32-bit lane: the same order as the packed kernel's nibbles, so the
// same bytes of x meet them. Per row and group: for x's high (or only) byte, 8 integer dot
// products of u with it, less 128 times its block sums (`Prepared::lift`): the sum of w times
// that byte, exact; for the middle and low (unsigned) bytes, 8 dot products each with w itself
// (u with its sign bit flipped). Then per block, as `PackedColumns` does, 256 * h + m
// (|h| <= 32 * 128 * 128: exact in 32 bits, rounded once to float) times 256 plus l,
// times the block's weight and x scales. The blocks after the last whole group go a quad at a
// time (each quad's 128 bytes: its 4 blocks' first 16 values, then their last 16), a quarter
// of a block a lane, the same way with the lanes' sums (`Prepared::lift_quads`).
//
// Why integers: a drafting step's few rows made the float product of the 8-bit LM head
// compute-bound (`Tile`: a multiply and an add a weight a row, after converting each weight),
// 22-30 % of a 4-row step's products on a Zen 4 EPYC; here a dot product takes 64 weights a
// row (the head at 4 rows: 0.81x the time, 0.62x with x in 8 bits; docs/performance-log.md,
// "The 8-bit head as integer dot products"). Every row's output is the same sequence of
// operations whatever N is.
template <int D, int N>
void Lanes8Tile(const Problem& p, int64_t t0, int64_t r0, int64_t r1) {
  const Prepared& x = *p.prep;
  const int64_t I = p.I, G = p.m.G, B = I / 32, Q = x.Q, Bp = x.Bp, NG = x.NG;
  const int shift = p.shift;  // block b's group is b >> shift
  const uint8_t* q = static_cast<const uint8_t*>(p.m.q);
  const int64_t last = B % 4 ? 16 * (B % 4) : 64;  // the last quad's bytes of each half
  alignas(64) float sc[kMaxGroups], bs[kMaxGroups];
  const float* block_scale = shift ? bs : sc;
  for (int64_t b = shift ? B : G; b < Bp; ++b) (shift ? bs : sc)[b] = 0.0f;  // past the last block
  for (int64_t o = r0; o < r1; ++o) {
    const uint8_t* qo = q + o * I;
    PrefetchBytes(qo + kAhead * I, I);
    PrefetchBytes(p.m.scale + (o + kAhead) * G, 2 * G);
    Halves(p.m.scale + o * G, G, sc);
    if (shift) {
      for (int64_t b = 0; b < B; ++b) bs[b] = sc[b >> shift];
    }
    Floats acc[N];
    for (int t = 0; t < N; ++t) acc[t] = Zero();
    for (int64_t g = 0; g < NG; ++g) {
      Bytes u[8], w[8];  // part k at the low nibbles' places in 2k, at the high ones' in 2k + 1
      for (int i = 0; i < 8; ++i) {
        u[i] = LoadB(qo + 512 * g + 64 * i);
        if constexpr (D == 3) w[i] = FlipSigns(u[i]);
      }
      const Floats ws = Load(block_scale + 16 * g);
      for (int t = 0; t < N; ++t) {
        const uint8_t* d = x.bytes[((t0 + t) * Q + 4 * g) * 2 * D].b;
        Ints h = LoadI(&x.lift[(t0 + t) * Bp + 16 * g]);
        for (int i = 0; i < 8; ++i) h = DotBytes(h, u[i], LoadB(d + 128 * D * (i / 2) + 64 * (i % 2)));
        Floats v;
        if constexpr (D == 3) {
          Ints m = ZeroI(), l = ZeroI();
          for (int i = 0; i < 8; ++i) {
            const uint8_t* di = d + 384 * (i / 2) + 64 * (i % 2);
            m = DotBytes(m, LoadB(di + 128), w[i]);
            l = DotBytes(l, LoadB(di + 256), w[i]);
          }
          v = Fma(ToFloat(AddI(ShiftLeft(h, 8), m)), Set(256.0f), ToFloat(l));
        } else {
          v = ToFloat(h);
        }
        const Floats xs = Load(&x.block_scale[(t0 + t) * Bp + 16 * g]);
        acc[t] = Fma(v, Mul(ws, xs), acc[t]);
      }
    }
    for (int64_t qd = 4 * NG; qd < Q; ++qd) {
      const uint8_t* qq = qo + 128 * qd;
      const int64_t n = qd + 1 < Q ? 64 : last;
      const Bytes u0 = n == 64 ? LoadB(qq) : LoadB(qq, n);
      const Bytes u1 = n == 64 ? LoadB(qq + 64) : LoadB(qq + n, n);
      const Bytes w0 = FlipSigns(u0), w1 = FlipSigns(u1);
      const Floats ws = Repeat4(block_scale + 4 * qd);
      for (int t = 0; t < N; ++t) {
        const uint8_t* d = x.bytes[((t0 + t) * Q + qd) * 2 * D].b;
        Ints h = LoadI(&x.lift_quads[((t0 + t) * Q + qd) * 16]);
        h = DotBytes(DotBytes(h, u0, LoadB(d)), u1, LoadB(d + 64));
        Floats v;
        if constexpr (D == 3) {
          const Ints m = DotBytes(DotBytes(ZeroI(), LoadB(d + 128), w0), LoadB(d + 192), w1);
          const Ints l = DotBytes(DotBytes(ZeroI(), LoadB(d + 256), w0), LoadB(d + 320), w1);
          v = Fma(ToFloat(AddI(ShiftLeft(h, 8), m)), Set(256.0f), ToFloat(l));
        } else {
          v = ToFloat(h);
        }
        const Floats xs = Load(reinterpret_cast<const float*>(x.scale[(t0 + t) * Q + qd].b));
        acc[t] = Fma(v, Mul(ws, xs), acc[t]);
      }
    }
    for (int t = 0; t < N; ++t) p.m.y[(t0 + t) * p.m.O + o] = ReduceAdd(acc[t]);
  }
}

template <int D>
void Lanes8Rows(const Problem& p, int64_t t0, int64_t n, int64_t r0, int64_t r1) {
  switch (n) {
    case 1: Lanes8Tile<D, 1>(p, t0, r0, r1); break;
    case 2: Lanes8Tile<D, 2>(p, t0, r0, r1); break;
    case 3: Lanes8Tile<D, 3>(p, t0, r0, r1); break;
    default: Lanes8Tile<D, 4>(p, t0, r0, r1); break;
  }
}

template <int D>
void PackedRows(const Problem& p, int64_t t0, int64_t n, int64_t r0, int64_t r1) {
  switch (n) {
    case 1: PackedTile<D, 1>(p, t0, r0, r1); break;
    case 2: PackedTile<D, 2>(p, t0, r0, r1); break;
    case 3: PackedTile<D, 3>(p, t0, r0, r1); break;
    case 4: PackedTile<D, 4>(p, t0, r0, r1); break;
    case 5: PackedTile<D, 5>(p, t0, r0, r1); break;
    case 6: PackedTile<D, 6>(p, t0, r0, r1); break;
    case 7: PackedTile<D, 7>(p, t0, r0, r1); break;
    default: PackedTile<D, 8>(p, t0, r0, r1); break;
  }
}

void Rows(const Problem& p, int64_t r0, int64_t r1) {
  const int64_t tile = p.m.packed ? kPackedTileRows : kTileRows;
  for (int64_t t = 0; t < p.T; t += tile) {
    const int64_t n = std::min(tile, p.T - t);
    if (p.m.lanes8 || p.m.packed) {
      auto rows = p.prep->digits == 1 ? (p.m.lanes8 ? Lanes8Rows<1> : PackedRows<1>)
                                      : (p.m.lanes8 ? Lanes8Rows<3> : PackedRows<3>);
      rows(p, t, n, r0, r1);
      continue;
    }
    switch (n) {
      case 1: Tile<1>(p, t, r0, r1); break;
      case 2: Tile<2>(p, t, r0, r1); break;
      case 3: Tile<3>(p, t, r0, r1); break;
      default: Tile<4>(p, t, r0, r1); break;
    }
  }
}

// Up to kMaxMatrices products of the same rows x (a layer's q, k and v projections, its gate
// and up ones) in one call: their chunks of output rows are handed out to the caller and the
// pool's threads alike, so the threads split the matrices' rows together and wait once. A
// thread that starts after the last chunk was taken touches nothing; the caller returns once
// every chunk is done (the shared state outlives it in the late tasks' hands).
struct Work {
  Problem p[kMaxMatrices];
  int64_t first_chunk[kMaxMatrices + 1];  // matrix m's chunks are [first_chunk[m], first_chunk[m + 1])
  int64_t chunk_rows = kMinChunkRows;
  int64_t n = 0;
  std::vector<float> xsum[kMaxMatrices];
  Prepared prep;  // x's rows as integers of bytes, when a matrix is packed
  std::atomic<int64_t> next{0}, done{0};
  void Run() {
    const int64_t num_chunks = first_chunk[n];
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < num_chunks;) {
      int64_t m = 0;
      while (c >= first_chunk[m + 1]) ++m;
      const int64_t r0 = (c - first_chunk[m]) * chunk_rows;
      Rows(p[m], r0, std::min(r0 + chunk_rows, p[m].m.O));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// y_m = x [T, I] @ w_m^T for the n matrices (shapes checked by the caller), with up to
// threads - 1 more threads: schedule(task) runs task on one of them.
//
// At most as many workers as the pool has threads, the caller included (the caller may be a
// thread outside the pool; one worker more than the cores had them share the cores and spin
// on the last chunks), and a few long chunks each rather than many of 32 rows, so that each
// worker streams through long runs of rows (2-vCPU EPYC, the default model at one stream,
// one process alternating: 8.1-8.3 ms a token against 10.3-10.8 with 32-row chunks and a
// helper per pool thread; docs/performance-log.md, "The CPU kernel's threads"). How rows are
// split never changes a row's result.
template <typename Schedule>
void Compute(const float* x, int64_t T, int64_t I, const Matrix* matrices, int64_t n,
             int x_bits, int64_t threads, Schedule schedule) {
  auto work = std::make_shared<Work>();
  work->n = n;
  work->first_chunk[0] = 0;
  const int64_t workers = std::max<int64_t>(threads, 1);
  int64_t rows = 0;
  for (int64_t m = 0; m < n; ++m) rows += matrices[m].O;
  const int64_t longest = std::clamp<int64_t>(kMaxChunkProducts / std::max<int64_t>(T, 1) / 32 * 32,
                                              kMinChunkRows, kMaxChunkRows);
  const int64_t chunk_rows = work->chunk_rows = std::clamp<int64_t>(
      (rows / (kChunksPerWorker * workers) + 31) / 32 * 32, kMinChunkRows, longest);
  bool packed = false, lanes8 = false;
  for (int64_t m = 0; m < n; ++m) {
    const Matrix& w = matrices[m];
    const int64_t G = w.G, gs = I / G;
    // Packed values carry their minimums in each group's table; only one value per int8 with
    // minimums needs the group sums of x.
    std::vector<float>& xsum = work->xsum[m];
    xsum.resize(w.minimum && !w.packed ? T * G : 0);
    for (int64_t i = 0; i < static_cast<int64_t>(xsum.size()); ++i) {
      const float* xg = x + (i / G) * I + (i % G) * gs;
      Floats s = Zero();
      for (int64_t k = 0; k < gs; k += 16) s = Add(s, Load(xg + k));
      xsum[i] = ReduceAdd(s);
    }
    const int64_t per_group = I / G / 32;  // packed, lanes8: blocks per scale group, a power of two
    work->p[m] = Problem{x, w, xsum.data(), &work->prep, T, I,
                         w.packed || w.lanes8 ? __builtin_ctzll(per_group) : 0};
    work->first_chunk[m + 1] = work->first_chunk[m] + (w.O + chunk_rows - 1) / chunk_rows;
    packed = packed || w.packed;
    lanes8 = lanes8 || w.lanes8;
  }
  if (T == 0) return;
  if (packed || lanes8) Prepare(x, T, I, x_bits, lanes8, &work->prep);
  const int64_t helpers = std::min<int64_t>(workers - 1, work->first_chunk[n] - 1);
  for (int64_t i = 0; i < helpers; ++i) schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->first_chunk[n]) Pause();
}

// Why the matrices cannot be multiplied (shapes from the caller's buffers), or null. `packed`:
// the values are packed 4-bit or `lanes8` (x's rows then go through `Prepare`).
inline const char* Refusal(int64_t I, bool packed, int64_t O, int64_t G, int64_t T,
                           int64_t y_rows, int64_t y_cols) {
  if (G < 1 || G > kMaxGroups || I % G || (I / G) % (packed ? 32 : 16) || y_rows != T || y_cols != O)
    return "xlaserve_qmatmul: shapes do not agree";
  const int64_t per_group = I / G / 32;
  if (packed && I / 32 > kMaxGroups) return "xlaserve_qmatmul: packed rows of at most 32768 inputs";
  if (packed && (per_group & (per_group - 1)))
    return "xlaserve_qmatmul: packed groups must be 32 times a power of two";
  return nullptr;
}

}  // namespace xlaserve::qmatmul

#ifndef XLASERVE_NO_FFI
#include "xla/ffi/api/ffi.h"

namespace {

namespace ffi = xla::ffi;
namespace qm = xlaserve::qmatmul;

using Rows2 = ffi::Buffer<ffi::F32, 2>;    // x [T, I]
using Halves3 = ffi::Buffer<ffi::F16, 3>;  // scale [L, O, G]
using Index = ffi::Buffer<ffi::S32, 0>;    // layer
using Out2 = ffi::Buffer<ffi::F32, 2>;     // y [T, O]

// Matrix m's operands are args 3m .. 3m + 2 (values, scales, minimums or [0]) and its
// product is result m: the layer l of each, checked.
ffi::Error TakeMatrix(int64_t T, int64_t I, int64_t l, const ffi::RemainingArgs& args,
                  const ffi::RemainingRets& rets, int64_t m, qm::Matrix* out) {
  auto q = args.get<ffi::AnyBuffer>(3 * m);
  auto scale = args.get<Halves3>(3 * m + 1);
  auto minimum = args.get<ffi::AnyBuffer>(3 * m + 2);
  auto y = rets.get<Out2>(m);
  if (!q.has_value() || !scale.has_value() || !minimum.has_value() || !y.has_value())
    return ffi::Error::InvalidArgument("xlaserve_qmatmul: each matrix is values, float16 "
                                       "scales and minimums, with a float32 result");
  const auto qd = q->dimensions(), sd = scale->dimensions();
  const bool bytes = q->element_type() == ffi::DataType::U8;
  if (!bytes && q->element_type() != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("xlaserve_qmatmul: values must be int8 or uint8");
  if (qd.size() != 3) return ffi::Error::InvalidArgument("xlaserve_qmatmul: values must be [L, O, I]");
  // uint8 [L, O, I / 2]: packed 4-bit values; [L, O, I]: 8-bit ones plus 128 (`lanes8`)
  const bool lanes8 = bytes && qd[2] == I, packed = bytes && !lanes8;
  const int64_t L = qd[0], O = qd[1], G = sd[2];
  const auto yd = (*y)->dimensions();
  if (qd[2] * (packed ? 2 : 1) != I || sd[0] != L || sd[1] != O)
    return ffi::Error::InvalidArgument("xlaserve_qmatmul: shapes do not agree");
  if (const char* why = qm::Refusal(I, bytes, O, G, T, yd[0], yd[1]))
    return ffi::Error::InvalidArgument(why);
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("xlaserve_qmatmul: layer out of range");
  const bool has_min = minimum->element_count() != 0;
  if (has_min && (lanes8 || minimum->element_type() != ffi::DataType::F16 ||
                  minimum->element_count() != scale->element_count()))
    return ffi::Error::InvalidArgument(lanes8 ? "xlaserve_qmatmul: 8-bit values in the kernel's "
                                                "order take no minimums"
                                              : "xlaserve_qmatmul: minimums must match the scales");
  *out = qm::Matrix{static_cast<const int8_t*>(q->untyped_data()) + l * O * (packed ? I / 2 : I),
                    packed, lanes8,
                    reinterpret_cast<const uint16_t*>(scale->typed_data()) + l * O * G,
                    has_min ? reinterpret_cast<const uint16_t*>(minimum->untyped_data()) + l * O * G
                            : nullptr,
                    (*y)->typed_data(), O, G};
  return ffi::Error::Success();
}

ffi::Error QMatmul(ffi::ThreadPool pool, Rows2 x, Index layer, ffi::RemainingArgs args,
                   ffi::RemainingRets rets, int32_t x_bits) {
  if (x_bits != 24 && x_bits != 8)
    return ffi::Error::InvalidArgument("xlaserve_qmatmul: x_bits must be 24 or 8");
  const int64_t n = rets.size();
  if (n < 1 || n > qm::kMaxMatrices || args.size() != static_cast<size_t>(3 * n))
    return ffi::Error::InvalidArgument("xlaserve_qmatmul: 1 to 4 matrices of 3 operands each");
  const auto xd = x.dimensions();
  const int64_t T = xd[0], I = xd[1], l = *layer.typed_data();
  qm::Matrix matrices[qm::kMaxMatrices];
  for (int64_t m = 0; m < n; ++m) {
    ffi::Error error = TakeMatrix(T, I, l, args, rets, m, &matrices[m]);
    if (error.failure()) return error;
  }
  qm::Compute(x.typed_data(), T, I, matrices, n, x_bits, pool.num_threads(),
              [&pool](auto task) { pool.Schedule(std::move(task)); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveQMatmul, QMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows2>()  // x [T, I]
                                  .Arg<Index>()  // the layer of every stack
                                  .RemainingArgs()  // per matrix: q [L, O, I] int8, [L, O, I / 2]
                                                    // or [L, O, I] uint8, scale [L, O, G], min
                                                    // [L, O, G] or [0]
                                  .RemainingRets()  // per matrix: y [T, O]
                                  .Attr<int32_t>("x_bits"));  // packed: x's bits a block, 24 or 8
#endif  // XLASERVE_NO_FFI
