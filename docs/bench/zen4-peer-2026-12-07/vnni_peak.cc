// One core's rate of 512-bit VNNI byte dot products (vpdpbusd) and float32 FMAs: 12
// independent accumulators each, 200 M trips. Build and run (two copies at once for both cores):
//   g++ -O2 -march=native vnni_peak.cc -o vnni_peak && ./vnni_peak
#include <immintrin.h>
#include <chrono>
#include <cstdio>
int main() {
  __m512i a[12]; for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
  __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(5);
  const long n = 200000000;
  auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < n; ++k) {
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], u, s);
    asm volatile("" : "+v"(u));
  }
  auto t1 = std::chrono::steady_clock::now();
  double sec = std::chrono::duration<double>(t1 - t0).count();
  int x = 0; for (int i = 0; i < 12; ++i) x += _mm512_reduce_add_epi32(a[i]);
  printf("vpdpbusd zmm: %.2f G/s (%d)\n", n * 12 / sec / 1e9, x & 1);
  __m512 f[12]; for (int i = 0; i < 12; ++i) f[i] = _mm512_set1_ps(i);
  __m512 b = _mm512_set1_ps(1.0001f), c = _mm512_set1_ps(0.999f);
  t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < n; ++k) {
    for (int i = 0; i < 12; ++i) f[i] = _mm512_fmadd_ps(f[i], b, c);
    asm volatile("" : "+v"(b));
  }
  t1 = std::chrono::steady_clock::now();
  sec = std::chrono::duration<double>(t1 - t0).count();
  float y = 0; for (int i = 0; i < 12; ++i) y += _mm512_reduce_add_ps(f[i]);
  printf("fma zmm: %.2f G/s (%d)\n", n * 12 / sec / 1e9, (int)y & 1);
}
