// Copyright 2026 The xlaserve Authors. SPDX-License-Identifier: Apache-2.0
//
// The CPU kernels (ops/native) without XLA, for tests/test_native_variants.py: it is built
// for each variant (and for AArch64, run under qemu-aarch64), reads one problem on stdin and
// writes the kernel's outputs to stdout, in the machine's byte order.
//
//   qmatmul:   int64 T, I, n, threads, x_bits (24 or 8); per matrix int64 kind (0 int8, 1 packed
//              4-bit, 2 8-bit values plus 128 in the kernel's order), has_min, O, G; float32
//              x[T, I]; per matrix its values (int8 [O, I], uint8 [O, I / 2] or uint8 [O, I]),
//              float16 scales [O, G] and, with has_min, minimums [O, G]  ->  per matrix float32
//              y[T, O]
//   attention: int64 T, H, D, Hkv, S, L, P, page, max_pages, layer, dtype (0 float32,
//              1 float16, 2 bfloat16, 3 int8), window, split_keys, threads; float32
//              sm_scale, soft_cap; float32 q[T, H, D]; k, v [L, P, page, Hkv, D] of dtype;
//              with int8, float32 k and v scales [L, P, page, Hkv]; int32 query_start_loc
//              [S + 1], kv_lens [S], page_tables [S, max_pages]  ->  float32 out[T, H, D]
//
// `threads` > 1 hands the kernel a scheduler that runs each task at once, so the paths that
// split work (a long decode cut by keys) run and combine as with XLA's thread pool.
#define XLASERVE_NO_FFI
#include "../ops/native/attention.cc"
#include "../ops/native/qmatmul.cc"

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

template <typename T>
std::vector<T> Read(int64_t n) {
  std::vector<T> v(n);
  if (n && std::fread(v.data(), sizeof(T), n, stdin) != static_cast<size_t>(n)) {
    std::fprintf(stderr, "short input\n");
    std::exit(2);
  }
  return v;
}

int64_t Int() { return Read<int64_t>(1)[0]; }

template <typename T>
void Write(const std::vector<T>& v) {
  std::fwrite(v.data(), sizeof(T), v.size(), stdout);
}

auto Inline = [](std::function<void()> task) { task(); };

int QMatmul() {
  const int64_t T = Int(), I = Int(), n = Int(), threads = Int(), x_bits = Int();
  struct Shape { int64_t kind, has_min, O, G; };
  std::vector<Shape> shapes;
  for (int64_t m = 0; m < n; ++m) shapes.push_back({Int(), Int(), Int(), Int()});
  const std::vector<float> x = Read<float>(T * I);
  std::vector<std::vector<uint8_t>> values;
  std::vector<std::vector<uint16_t>> scales, minimums;
  std::vector<std::vector<float>> ys;
  std::vector<xlaserve::qmatmul::Matrix> matrices;
  for (const Shape& s : shapes) {
    if (const char* why = xlaserve::qmatmul::Refusal(I, s.kind != 0, s.O, s.G, T, T, s.O)) {
      std::fprintf(stderr, "%s\n", why);
      return 3;
    }
    values.push_back(Read<uint8_t>(s.O * (s.kind == 1 ? I / 2 : I)));
    scales.push_back(Read<uint16_t>(s.O * s.G));
    minimums.push_back(Read<uint16_t>(s.has_min ? s.O * s.G : 0));
    ys.emplace_back(T * s.O);
  }
  for (size_t m = 0; m < shapes.size(); ++m)
    matrices.push_back({values[m].data(), shapes[m].kind == 1, shapes[m].kind == 2,
                        scales[m].data(), shapes[m].has_min ? minimums[m].data() : nullptr,
                        ys[m].data(), shapes[m].O, shapes[m].G});
  xlaserve::qmatmul::Compute(x.data(), T, I, matrices.data(), n, static_cast<int>(x_bits), threads,
                             Inline);
  for (const auto& y : ys) Write(y);
  return 0;
}

int Attention() {
  namespace at = xlaserve::attention;
  const int64_t T = Int(), H = Int(), D = Int(), Hkv = Int(), S = Int(), L = Int(), P = Int(),
                page = Int(), max_pages = Int(), layer = Int(), dtype = Int(), window = Int(),
                split_keys = Int(), threads = Int();
  const std::vector<float> attrs = Read<float>(2);
  const std::vector<float> q = Read<float>(T * H * D);
  const int64_t elements = L * P * page * Hkv * D, size = dtype == 0 ? 4 : dtype == 3 ? 1 : 2;
  const std::vector<uint8_t> k = Read<uint8_t>(elements * size), v = Read<uint8_t>(elements * size);
  const std::vector<float> k_scale = Read<float>(dtype == 3 ? elements / D : 0);
  const std::vector<float> v_scale = Read<float>(dtype == 3 ? elements / D : 0);
  const std::vector<int32_t> qsl = Read<int32_t>(S + 1), kv_lens = Read<int32_t>(S),
                             tables = Read<int32_t>(S * max_pages);
  std::vector<float> out(T * H * D);
  const at::Pages pages[] = {at::Pages::kF32, at::Pages::kF16, at::Pages::kBF16, at::Pages::kI8};
  const at::Problem p{q.data(), k.data(), v.data(), dtype == 3 ? k_scale.data() : nullptr,
                      dtype == 3 ? v_scale.data() : nullptr, qsl.data(), kv_lens.data(),
                      tables.data(), out.data(), T, H, Hkv, D, S, max_pages, page, P, layer,
                      attrs[0], attrs[1], window};
  at::Compute(p, pages[dtype], split_keys, threads, Inline);
  Write(out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string kernel = argc > 1 ? argv[1] : "";
  if (kernel == "qmatmul") return QMatmul();
  if (kernel == "attention") return Attention();
  std::fprintf(stderr, "usage: %s qmatmul|attention < problem > outputs\n", argv[0]);
  return 2;
}
