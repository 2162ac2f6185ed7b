// Copyright 2026 The xlaserve Authors. SPDX-License-Identifier: Apache-2.0
//
// Ragged paged attention on CPU, as an XLA FFI custom call (ops/native/__init__.py builds
// and registers it; ops/cpu_attention.py calls it; ops/attention.py documents the layout).
//
// One step is T query rows of S sequences laid end to end; sequence s owns rows
// qsl[s]:qsl[s + 1], its KV is kv_lens[s] long (this step's tokens included: they were
// written before this call) and lives in the pages page_tables[s]. The pool of one layer l
// of the stack is read in place: k, v [L, P, page, Hkv, D] in float32, float16, bfloat16 or
// int8 (with a float32 scale per token and KV head, [L, P, page, Hkv]).
//
// Written once in simd.h's vectors and compiled per instruction set (AVX-512, AVX2, NEON,
// portable C++): the same operations in the same order on each, so the same bits.
//
// Why a kernel of our own: XLA:CPU runs the pure-JAX reference as gathers, small batched
// dots and a loop of whole-array elementwise passes, and a 64-row decode step spent about
// half its time there (docs/performance.md). Here each work item, one sequence's block of
// up to kMaxQueries query vectors, reads its keys and values once, 16 at a time, converts
// them to float32, and folds them into an online softmax in float32: the scores of a key
// block are one vector, their exp is vectorised, and nothing beyond a row's own keys
// (causal, sliding window) is read; each KV head asks for its next block into L2 while it
// folds one (`PrefetchHead`). A sequence with few rows (a decode) is one item over
// all its KV heads, so its pages are read in order; a longer chunk's items are rows x the
// query heads of one KV head. Each value vector is loaded once for up to 4 queries of its
// KV head, and the running maximum's exp is taken only when a block raises it (together:
// 64 decodes of 200 keys 543-587 -> 458-472 us a call from cache, 2-vCPU EPYC). Work items
// are handed to the caller and XLA's intra-op threads alike; with fewer items than threads
// (a lone decode), a decode of `split_keys` keys or more is cut by keys into one part per
// thread and the parts' softmax states are combined after (one decode of 1,024 keys from
// memory: 181-191 -> 81-102 us a call; of 256: 19.8-21.6 -> 11.4-11.7 us). `split_keys` 0
// never cuts one: every query's keys are then folded in order into one state, so a row's
// output is the same bits whatever else the call holds (--batch-invariant).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "simd.h"

namespace xlaserve::attention {

using namespace simd;

constexpr int64_t kKeys = 16;          // keys per block: one vector of scores
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxQueries = 48;    // query vectors per work item (rows x group)
constexpr int64_t kInlineWork = 1 << 15;  // query-key pairs below which one thread does all

enum class Pages { kF32, kF16, kBF16, kI8 };

// exp(x) for 16 floats: Cephes' expf polynomial on [-ln2 / 2, ln2 / 2], times 2^n.
inline Floats Exp16(Floats x) {
  x = Min(Max(x, Set(-87.0f)), Set(88.0f));
  const Floats n = Round(Mul(x, Set(1.44269504088896341f)));
  Floats r = Fnma(n, Set(0.693359375f), x);
  r = Fnma(n, Set(-2.12194440e-4f), r);
  Floats p = Set(1.9875691500e-4f);
  p = Fma(p, r, Set(1.3981999507e-3f));
  p = Fma(p, r, Set(8.3334519073e-3f));
  p = Fma(p, r, Set(4.1665795894e-2f));
  p = Fma(p, r, Set(1.6666665459e-1f));
  p = Fma(p, r, Set(5.0000001201e-1f));
  p = Fma(p, Mul(r, r), Add(r, Set(1.0f)));
  return TimesPow2(p, n);
}

struct Problem {
  const float* q;          // [T, H, D]
  const void* k;           // [L, P, page, Hkv, D]
  const void* v;
  const float* k_scale;    // [L, P, page, Hkv] (int8 pages), else null
  const float* v_scale;
  const int32_t* qsl;      // [S + 1]
  const int32_t* kv_lens;  // [S]
  const int32_t* tables;   // [S, max_pages]
  float* out;              // [T, H, D]
  int64_t T, H, Hkv, D, S, max_pages, page_size, num_pages, layer;
  float sm_scale, soft_cap;  // soft_cap 0: none
  int64_t window;            // 0: none
};

struct Item {
  int64_t seq, row0, rows;  // query rows [row0, row0 + rows) of seq
  int64_t head0, heads;     // its KV heads [head0, head0 + heads)
  // A part of a long decode split by keys: keys [key0, key1) only (key0 and key1 multiples
  // of kKeys, or key1 past the last key), and its unnormalised state (per query: the
  // running maximum, the sum of weights, then the weighted values) goes to `partial`.
  int64_t key0 = 0, key1 = std::numeric_limits<int64_t>::max();
  float* partial = nullptr;
};

// Query vector x of an item (head-major: KV head, row, group member): its offset in q and
// out [T, H, D], and its row.
inline int64_t VectorAt(const Problem& p, const Item& it, int64_t x, int64_t* row = nullptr) {
  const int64_t G = p.H / p.Hkv, per_head = it.rows * G;
  const int64_t h = it.head0 + x / per_head, r = it.row0 + x % per_head / G;
  if (row) *row = r;
  return (r * p.H + h * G + x % G) * p.D;
}

// One token's K or V of one KV head, as D floats in `dst`.
template <Pages kPages>
inline void LoadVector(const void* pool, const float* scales, int64_t vec, int64_t D, float* dst) {
  for (int64_t d = 0; d < D; d += 16) {
    Floats x;
    if constexpr (kPages == Pages::kF32) {
      x = Load(static_cast<const float*>(pool) + vec * D + d);
    } else if constexpr (kPages == Pages::kF16) {
      x = FromHalves(static_cast<const uint16_t*>(pool) + vec * D + d);
    } else if constexpr (kPages == Pages::kBF16) {
      x = FromBF16(static_cast<const uint16_t*>(pool) + vec * D + d);
    } else {
      x = Mul(FromInt8(static_cast<const int8_t*>(pool) + vec * D + d), Set(scales[vec]));
    }
    Store(dst + d, x);
  }
}

// For NQ queries xs of one KV head, acc[x][d0, d0 + 16W) = acc * corr[q] + sum_j
// wts[q][j] * vf[j] over the block's n keys: each value vector is loaded once for the NQ
// queries, and the NQ x W sums are independent chains of FMAs (one chain per 16 dims,
// looping over keys inside, would wait on each FMA's latency).
template <int W, int NQ>
inline void AddTile(float* acc, const int64_t* xs, const float* wts, const float* corr,
                    const float* vf, int64_t n, int64_t D, int64_t d0) {
  Floats o[NQ][W];
  for (int q = 0; q < NQ; ++q) {
    const Floats c = Set(corr[q]);
    for (int w = 0; w < W; ++w) o[q][w] = Mul(Load(acc + xs[q] * D + d0 + 16 * w), c);
  }
  for (int64_t j = 0; j < n; ++j) {
    Floats v[W];
    for (int w = 0; w < W; ++w) v[w] = Load(vf + j * D + d0 + 16 * w);
    for (int q = 0; q < NQ; ++q) {
      const Floats wq = Set(wts[q * kKeys + j]);
      for (int w = 0; w < W; ++w) o[q][w] = Fma(wq, v[w], o[q][w]);
    }
  }
  for (int q = 0; q < NQ; ++q)
    for (int w = 0; w < W; ++w) Store(acc + xs[q] * D + d0 + 16 * w, o[q][w]);
}

template <int NQ>
inline void AddValues(float* acc, const int64_t* xs, const float* wts, const float* corr,
                      const float* vf, int64_t n, int64_t D) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) AddTile<4, NQ>(acc, xs, wts, corr, vf, n, D, d);
  if (D - d >= 32) { AddTile<2, NQ>(acc, xs, wts, corr, vf, n, D, d); d += 32; }
  if (D - d >= 16) AddTile<1, NQ>(acc, xs, wts, corr, vf, n, D, d);
}

// The token rows in the pool (without the KV head) of keys [j0, j0 + n), n <= kKeys, one
// block: page and offset advance by counting (two integer divisions per key cost more than
// the key's arithmetic at head_dim 64), and a page outside the pool is never read.
inline void BlockRows(const Problem& p, const int32_t* table, int64_t j0, int64_t n,
                      int64_t* rows) {
  int64_t slot = j0 / p.page_size, offset = j0 % p.page_size, base = -1;
  for (int64_t j = 0; j < n; ++j) {
    if (base < 0 || offset == p.page_size) {
      if (offset == p.page_size) ++slot, offset = 0;
      const int64_t page = std::clamp<int64_t>(table[slot], 0, p.num_pages - 1);
      base = (p.layer * p.num_pages + page) * p.page_size;
    }
    rows[j] = base + offset++;
  }
}

// Each KV head asks for the next block's keys while it folds one. A decode's keys come from
// memory (a layer's weights pass through the caches between its attention calls) and its
// pages lie anywhere in the pool, so each page starts the hardware's prefetchers cold: the
// default model's lone decode over 620 keys of float16 pages, one thread, each layer's call
// after a read of 3.5 MB (a C++ driver, 2-vCPU EPYC Zen 4), took 104-114 us a layer against
// ~34 from cache, and a plain read of the same pages ~50. With the next block asked for into
// L2: 62 us (4 rows 180-186 -> 137; 2,000 keys 312-315 -> 179-196); 30 such calls in one jit
// with XLA's threads, 1.96-2.20 -> 1.16-1.21 ms. Into L1, or two blocks ahead, gained less or
// nothing. This asks for one KV head's K and V vectors (and int8 scales) of the n keys at
// `rows`, a line at a time.
template <Pages kPages>
inline void PrefetchHead(const Problem& p, const int64_t* rows, int64_t n, int64_t head) {
  constexpr int64_t kBytes = kPages == Pages::kF32 ? 4 : kPages == Pages::kI8 ? 1 : 2;
  const char* k = static_cast<const char*>(p.k);
  const char* v = static_cast<const char*>(p.v);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t vec = rows[j] * p.Hkv + head;
    for (int64_t b = 0; b < p.D * kBytes; b += 64) {
      PrefetchL2(k + vec * p.D * kBytes + b);
      PrefetchL2(v + vec * p.D * kBytes + b);
    }
    if constexpr (kPages == Pages::kI8) PrefetchL2(p.k_scale + vec), PrefetchL2(p.v_scale + vec);
  }
}

template <Pages kPages>
void RunItem(const Problem& p, const Item& it) {
  // Query vectors x = (KV head, row, group member), head-major: each KV head's block of
  // keys is read once for its own rows x group.
  const int64_t D = p.D, G = p.H / p.Hkv, per_head = it.rows * G, M = it.heads * per_head;
  const int64_t start = p.qsl[it.seq];
  const int64_t kv_len = std::min<int64_t>(p.kv_lens[it.seq], p.max_pages * p.page_size);
  const int64_t first_pos = kv_len - (p.qsl[it.seq + 1] - start);  // of the sequence's row 0
  const int32_t* table = p.tables + it.seq * p.max_pages;
  alignas(64) float qs[kMaxQueries * kMaxHeadDim], acc[kMaxQueries * kMaxHeadDim];
  alignas(64) float kf[kKeys * kMaxHeadDim], vf[kKeys * kMaxHeadDim];
  alignas(64) float wts[kMaxQueries * kKeys], corr[kMaxQueries];  // a head's block's
  int64_t xs[kMaxQueries];  // ... weights and corrections, for its queries xs
  float m[kMaxQueries], l[kMaxQueries];
  int32_t lo[kMaxQueries], hi[kMaxQueries];  // each query's visible keys [lo, hi)
  int64_t keys_begin = std::numeric_limits<int64_t>::max(), keys_end = 0;  // any query's
  for (int64_t x = 0; x < M; ++x) {
    int64_t row;
    const float* src = p.q + VectorAt(p, it, x, &row);
    const int64_t pos = first_pos + row - start;
    for (int64_t d = 0; d < D; d += 16) {
      Store(qs + x * D + d, Mul(Load(src + d), Set(p.sm_scale)));
      Store(acc + x * D + d, Zero());
    }
    m[x] = -std::numeric_limits<float>::infinity();
    l[x] = 0.0f;
    hi[x] = static_cast<int32_t>(std::max<int64_t>(pos + 1, 0));
    lo[x] = static_cast<int32_t>(p.window > 0 ? std::max<int64_t>(pos - p.window + 1, 0) : 0);
    keys_begin = std::min<int64_t>(keys_begin, lo[x]);
    keys_end = std::max<int64_t>(keys_end, hi[x]);
  }
  keys_begin = std::max(keys_begin, it.key0);  // a part of a split decode: its keys only
  keys_end = std::min(keys_end, it.key1);
  // The block's keys' token rows in the pool, and the next block's (`BlockRows`): two
  // buffers that trade places each block
  int64_t rows_a[kKeys], rows_b[kKeys];
  int64_t* rows_at = rows_a;
  int64_t* rows_next = rows_b;
  const int64_t keys_first = keys_begin / kKeys * kKeys;
  int64_t n_next = std::min(kKeys, keys_end - keys_first);
  if (n_next > 0) BlockRows(p, table, keys_first, n_next, rows_next);
  for (int64_t hh = 0; hh < it.heads; ++hh)
    PrefetchHead<kPages>(p, rows_next, n_next, it.head0 + hh);
  for (int64_t j0 = keys_first; j0 < keys_end; j0 += kKeys) {
    const int64_t n = n_next;
    std::swap(rows_at, rows_next);
    n_next = std::min(kKeys, keys_end - j0 - kKeys);
    if (n_next > 0) BlockRows(p, table, j0 + kKeys, n_next, rows_next);
    for (int64_t hh = 0; hh < it.heads; ++hh) {
      const int64_t head = it.head0 + hh;
      PrefetchHead<kPages>(p, rows_next, n_next, head);  // the next block's, as this one folds
      for (int64_t j = 0; j < kKeys; ++j) {  // this KV head's keys and values of the block
        if (j < n) {
          const int64_t vec = rows_at[j] * p.Hkv + head;
          LoadVector<kPages>(p.k, p.k_scale, vec, D, kf + j * D);
          LoadVector<kPages>(p.v, p.v_scale, vec, D, vf + j * D);
        } else {  // past the last key: zeros (their weights are 0; stale values could be NaN)
          for (int64_t d = 0; d < D; d += 16) {
            Store(kf + j * D + d, Zero());
            Store(vf + j * D + d, Zero());
          }
        }
      }
      // Scores and softmax weights of each query that sees part of the block, then the
      // values, up to 4 queries at a time.
      int64_t live = 0;
      for (int64_t x = hh * per_head; x < (hh + 1) * per_head; ++x) {
        if (hi[x] <= j0 || lo[x] >= j0 + kKeys) continue;  // none of this block is visible
        Floats part[kKeys];
        for (int64_t j = 0; j < kKeys; ++j) part[j] = Zero();
        for (int64_t d = 0; d < D; d += 16) {
          const Floats qd = Load(qs + x * D + d);
          for (int64_t j = 0; j < kKeys; ++j) part[j] = Fma(qd, Load(kf + j * D + d), part[j]);
        }
        Floats s = Sums16(part);  // [16] scores
        if (p.soft_cap > 0.0f) {
          alignas(64) float sv[kKeys];
          Store(sv, s);
          // tanh in double, rounded once: the C library's float tanh differed in last bits
          // between its x86-64 and AArch64 builds (tests/test_native_variants.py)
          for (int64_t j = 0; j < kKeys; ++j)
            sv[j] = p.soft_cap * static_cast<float>(std::tanh(static_cast<double>(sv[j] / p.soft_cap)));
          s = Load(sv);
        }
        const Mask seen = KeysIn(static_cast<int32_t>(j0), lo[x], hi[x]);
        const float m_block = ReduceMax(seen, s);
        const float m_next = std::max(m[x], m_block);
        // 0 before the first key; 1 (no exp) while the maximum stands, as in most blocks
        const float correction = m_block > m[x] ? std::exp(m[x] - m_next) : 1.0f;
        const Floats w = Keep(seen, Exp16(Sub(s, Set(m_next))));
        l[x] = l[x] * correction + ReduceAdd(w);
        m[x] = m_next;
        Store(wts + live * kKeys, w);
        corr[live] = correction;
        xs[live++] = x;
      }
      for (int64_t t = 0; t < live; t += 4) {
        const int64_t* xt = xs + t;
        const float *wt = wts + t * kKeys, *ct = corr + t;
        switch (std::min<int64_t>(4, live - t)) {
          case 1: AddValues<1>(acc, xt, wt, ct, vf, n, D); break;
          case 2: AddValues<2>(acc, xt, wt, ct, vf, n, D); break;
          case 3: AddValues<3>(acc, xt, wt, ct, vf, n, D); break;
          default: AddValues<4>(acc, xt, wt, ct, vf, n, D); break;
        }
      }
    }
  }
  if (it.partial) {
    std::copy(m, m + M, it.partial);
    std::copy(l, l + M, it.partial + M);
    std::copy(acc, acc + M * D, it.partial + 2 * M);
    return;
  }
  for (int64_t x = 0; x < M; ++x) {
    const Floats inv = Set(l[x] > 0.0f ? 1.0f / l[x] : 0.0f);
    float* dst = p.out + VectorAt(p, it, x);
    for (int64_t d = 0; d < D; d += 16) Store(dst + d, Mul(Load(acc + x * D + d), inv));
  }
}

// The output of a decode split into `parts` items by keys, from their partial states.
void Combine(const Problem& p, const Item* parts, int64_t num_parts) {
  const int64_t M = parts[0].heads * parts[0].rows * (p.H / p.Hkv), D = p.D;
  for (int64_t x = 0; x < M; ++x) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < num_parts; ++k) top = std::max(top, parts[k].partial[x]);
    float sum = 0.0f;
    alignas(64) float o[kMaxHeadDim] = {};
    for (int64_t k = 0; k < num_parts; ++k) {
      const float* part = parts[k].partial;
      if (part[M + x] == 0.0f) continue;  // saw no key
      const float c = std::exp(part[x] - top);
      sum += part[M + x] * c;
      for (int64_t d = 0; d < D; ++d) o[d] += c * part[2 * M + x * D + d];
    }
    float* dst = p.out + VectorAt(p, parts[0], x);
    for (int64_t d = 0; d < D; ++d) dst[d] = sum > 0.0f ? o[d] / sum : 0.0f;
  }
}

// Items handed out to the caller and the pool's threads alike. A thread that starts after
// the last item was taken touches nothing; the caller returns once every item is done (the
// shared state outlives it in the late tasks' hands).
struct Work {
  Problem p;
  Pages pages;
  std::vector<Item> items;
  std::vector<float> partials;  // the split decodes' parts' states
  std::atomic<int64_t> next{0}, done{0};
  void Run() {
    const int64_t num = static_cast<int64_t>(items.size());
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < num;) {
      switch (pages) {
        case Pages::kF32: RunItem<Pages::kF32>(p, items[i]); break;
        case Pages::kF16: RunItem<Pages::kF16>(p, items[i]); break;
        case Pages::kBF16: RunItem<Pages::kBF16>(p, items[i]); break;
        case Pages::kI8: RunItem<Pages::kI8>(p, items[i]); break;
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// The attention of p's rows (shapes checked by the caller) with up to threads - 1 more
// threads: schedule(task) runs task on one of them.
template <typename Schedule>
void Compute(const Problem& p, Pages pages, int64_t split_keys, int64_t threads, Schedule schedule) {
  auto work = std::make_shared<Work>();
  work->p = p;
  work->pages = pages;
  const int64_t T = p.T, H = p.H, Hkv = p.Hkv, D = p.D, S = p.S;
  const int32_t* starts = p.qsl;
  const int64_t group = H / Hkv, block_rows = std::max<int64_t>(1, kMaxQueries / group);
  // Rows no sequence owns (padding) are zeros.
  float* o = p.out;
  const int64_t first = std::clamp<int64_t>(starts[0], 0, T), last = std::clamp<int64_t>(starts[S], first, T);
  std::fill(o, o + first * H * D, 0.0f);
  std::fill(o + last * H * D, o + T * H * D, 0.0f);
  int64_t pairs = 0;  // query-key pairs, to judge whether threads pay
  for (int64_t s = 0; s < S; ++s) {
    const int64_t r0 = std::max<int64_t>(starts[s], first), r1 = std::min<int64_t>(starts[s + 1], last);
    pairs += (r1 - r0) * H * std::max<int64_t>(p.kv_lens[s], 0);
    if ((r1 - r0) * H <= kMaxQueries) {  // a decode: every KV head in one item, so a page's
      if (r1 > r0) work->items.push_back(Item{s, r0, r1 - r0, 0, Hkv});  // rows are read in order
      continue;
    }
    for (int64_t r = r0; r < r1; r += block_rows)
      for (int64_t h = 0; h < Hkv; ++h)
        work->items.push_back(Item{s, r, std::min(block_rows, r1 - r), h, 1});
  }
  // Fewer items than threads (a lone long decode): split the long ones by keys, so every
  // thread reads a part of the pages, and combine the parts' states after.
  const int64_t workers = std::max<int64_t>(1, threads);
  std::vector<std::pair<int64_t, int64_t>> splits;  // (first part, parts) in items
  if (split_keys > 0 && static_cast<int64_t>(work->items.size()) < workers) {
    std::vector<Item> items;
    int64_t floats = 0;
    for (const Item& it : work->items) {
      const int64_t kv = std::max<int64_t>(p.kv_lens[it.seq], 0);
      const int64_t parts = it.heads == Hkv
          ? std::min<int64_t>(workers / static_cast<int64_t>(work->items.size()), kv / split_keys) : 1;
      if (parts < 2) { items.push_back(it); continue; }
      const int64_t step = (kv / parts + kKeys - 1) / kKeys * kKeys;
      splits.emplace_back(items.size(), parts);
      for (int64_t k = 0; k < parts; ++k) {
        Item part = it;
        part.key0 = k * step;
        if (k + 1 < parts) part.key1 = (k + 1) * step;
        items.push_back(part);
      }
      floats += parts * it.heads * it.rows * group * (D + 2);
    }
    work->partials.resize(floats);
    float* at = work->partials.data();
    for (auto [first, parts] : splits)
      for (int64_t k = first; k < first + parts; ++k) {
        items[k].partial = at;
        at += items[k].heads * items[k].rows * group * (D + 2);
      }
    work->items = std::move(items);
  }
  const int64_t num = static_cast<int64_t>(work->items.size());
  // At most as many workers as the pool has threads, the caller included: the caller may
  // be a thread outside the pool, and one worker more than the cores made waiters spin
  // while a descheduled helper held the last item (2-vCPU EPYC, 64 decodes of 200 keys,
  // alternating: 586-1,078 us a call against 524-552). qmatmul.cc counts its workers so too.
  int64_t helpers = pairs < kInlineWork && splits.empty()
      ? 0 : std::min<int64_t>(threads - 1, num - 1);
  for (int64_t i = 0; i < helpers; ++i) schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < num) Pause();
  for (auto [first, parts] : splits) Combine(work->p, work->items.data() + first, parts);
}


}  // namespace xlaserve::attention

#ifndef XLASERVE_NO_FFI
#include "xla/ffi/api/ffi.h"

namespace {

namespace ffi = xla::ffi;
namespace at = xlaserve::attention;

using Rows3 = ffi::Buffer<ffi::F32, 3>;     // q [T, H, D]
using Ints1 = ffi::Buffer<ffi::S32, 1>;
using Ints2 = ffi::Buffer<ffi::S32, 2>;
using Index = ffi::Buffer<ffi::S32, 0>;
using Out3 = ffi::ResultBuffer<ffi::F32, 3>;  // [T, H, D]

ffi::Error Attention(ffi::ThreadPool pool, Rows3 q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, Ints1 qsl, Ints1 kv_lens,
                     Ints2 tables, Index layer, float sm_scale, float soft_cap, int64_t window,
                     int64_t split_keys, Out3 out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (kd.size() != 5 || k.element_type() != v.element_type() ||
      k.element_count() != v.element_count())
    return ffi::Error::InvalidArgument("xlaserve_attention: k and v must be [L, P, page, Hkv, D]");
  at::Pages pages;
  switch (k.element_type()) {
    case ffi::DataType::F32: pages = at::Pages::kF32; break;
    case ffi::DataType::F16: pages = at::Pages::kF16; break;
    case ffi::DataType::BF16: pages = at::Pages::kBF16; break;
    case ffi::DataType::S8: pages = at::Pages::kI8; break;
    default: return ffi::Error::InvalidArgument("xlaserve_attention: unsupported page dtype");
  }
  const int64_t T = qd[0], H = qd[1], D = qd[2], L = kd[0], Hkv = kd[3], S = kv_lens.dimensions()[0];
  const bool scaled = pages == at::Pages::kI8;
  if (kd[4] != D || D % 16 || D > at::kMaxHeadDim || Hkv < 1 || H % Hkv || H / Hkv > at::kMaxQueries ||
      qsl.dimensions()[0] != S + 1 || td[0] != S || td[1] < 1)
    return ffi::Error::InvalidArgument("xlaserve_attention: shapes do not agree");
  if (scaled != (k_scale.element_count() != 0) ||
      (scaled && (k_scale.element_type() != ffi::DataType::F32 ||
                  v_scale.element_type() != ffi::DataType::F32 ||
                  k_scale.element_count() * D != k.element_count() ||
                  v_scale.element_count() != k_scale.element_count())))
    return ffi::Error::InvalidArgument("xlaserve_attention: int8 pages need [L, P, page, Hkv] scales");
  const int64_t l = *layer.typed_data();
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("xlaserve_attention: layer out of range");

  const at::Problem p{q.typed_data(), k.untyped_data(), v.untyped_data(),
                      scaled ? static_cast<const float*>(k_scale.untyped_data()) : nullptr,
                      scaled ? static_cast<const float*>(v_scale.untyped_data()) : nullptr,
                      qsl.typed_data(), kv_lens.typed_data(), tables.typed_data(),
                      out->typed_data(), T, H, Hkv, D, S, td[1], kd[2], kd[1], l,
                      sm_scale, soft_cap, window};
  at::Compute(p, pages, split_keys, pool.num_threads(),
              [&pool](auto task) { pool.Schedule(std::move(task)); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows3>()           // q [T, H, D]
                                  .Arg<ffi::AnyBuffer>()  // k [L, P, page, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // k scales [L, P, page, Hkv], or [0]
                                  .Arg<ffi::AnyBuffer>()  // v scales, or [0]
                                  .Arg<Ints1>()           // query_start_loc [S + 1]
                                  .Arg<Ints1>()           // kv_lens [S]
                                  .Arg<Ints2>()           // page_tables [S, max_pages]
                                  .Arg<Index>()           // layer
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("split_keys")  // 0: never split a decode
                                  .Ret<Rows3>());
#endif  // XLASERVE_NO_FFI
