// The C++ driver behind docs/performance-log.md, "A decode's keys asked for ahead"
// (2026-12-07): ops/native/attention.cc without XLA, as the default model's decode calls it
// (30 layers, 9 query / 3 KV heads of 64, a pool of 2,142 pages of 16 float16 tokens, the
// sequence's pages at random), each layer's call after a read of 3.5 MB standing for that
// layer's weights; one thread. READONLY=1 reads the same pages' K and V instead of calling it.
//
//   g++ -O3 -std=c++17 -fno-math-errno -ffp-contract=off -DXLASERVE_AVX512 -mavx512f \
//       -mavx512bw -mavx512vl -mf16c -mfma -mtune=native -mavx512vnni -I ops/native \
//       -DATT_SRC='"ops/native/attention.cc"' decode_driver.cc -o driver
//   ./driver ROWS KEYS
#define XLASERVE_NO_FFI
#include ATT_SRC
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>
namespace at = xlaserve::attention;
// The default model's decode as the engine runs it: 30 layers, each reads 3.5 MB of weights
// and then calls attention for one row over `kv` keys in a pool of 2142 pages.
int main(int argc, char** argv) {
  const int64_t T = atoi(argv[1]), kv = atoi(argv[2]);
  const int64_t H = 9, Hkv = 3, D = 64, page = 16, L = 30, P = 2142, maxp = (kv + page - 1) / page;
  std::mt19937 g(0);
  std::vector<float> q(T * H * D), out(T * H * D);
  for (auto& x : q) x = std::normal_distribution<float>(0, 1)(g);
  const size_t n = size_t(L) * P * page * Hkv * D;
  std::vector<uint16_t> k(n), v(n);
  for (size_t i = 0; i < n; ++i) k[i] = v[i] = _cvtss_sh(float(int(i % 7) - 3) * 0.3f, 0);
  std::vector<int32_t> qsl = {0, (int32_t)T}, lens = {(int32_t)kv}, table(maxp);
  for (int64_t i = 0; i < maxp; ++i) table[i] = (int32_t)(std::uniform_int_distribution<int>(1, P - 1)(g));
  const size_t wbytes = 3500000;
  std::vector<float> w(L * wbytes / 4, 1.0f);
  double total = 0; float sink = 0;
  const int steps = 60;
  for (int s = 0; s < steps + 10; ++s) {
    for (int64_t l = 0; l < L; ++l) {
      const float* wl = w.data() + l * wbytes / 4;
      float acc = 0;
      for (size_t i = 0; i < wbytes / 4; i += 16) acc += wl[i];
      sink += acc;
      at::Problem p{q.data(), k.data(), v.data(), nullptr, nullptr, qsl.data(), lens.data(), table.data(),
                    out.data(), T, H, Hkv, D, 1, maxp, page, P, l, 0.125f, 0.0f, 0};
      auto t0 = std::chrono::steady_clock::now();
      if (getenv("READONLY")) {
        __m512i a = _mm512_setzero_si512();
        for (int64_t j = 0; j < maxp; ++j) {
          const int64_t base = ((l * P + table[j]) * page) * Hkv * D;
          for (int64_t b = 0; b < page * Hkv * D; b += 32) {
            a = _mm512_xor_si512(a, _mm512_loadu_si512(k.data() + base + b));
            a = _mm512_xor_si512(a, _mm512_loadu_si512(v.data() + base + b));
          }
        }
        sink += _mm512_reduce_add_epi32(a);
      } else {
        at::Compute(p, at::Pages::kF16, 0, 1, [](std::function<void()> t) { t(); });
      }
      if (s >= 10) total += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    }
  }
  printf("T=%ld kv=%ld: attention %.1f us a layer (sink %g)\n", T, kv, total / steps / L, sink);
}
