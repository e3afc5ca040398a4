// The AMX-BF16 tile loop of csrc/q8_amx.cpp (2 x 2 result tiles, two A and two B tile loads per
// four TDPBF16PS) in isolation: ns per TDPBF16PS by where its tiles come from and how they are
// aligned. Linux, a CPU with AMX-BF16, one thread:
//
//     g++ -O2 -std=c++17 -mamx-tile -mamx-bf16 scripts/bench_amx_tile_loop.cpp -o tile_loop
//     ./tile_loop            # buffers on 64-byte boundaries
//     OFFSET=16 ./tile_loop  # 16 bytes off, as glibc's malloc may return them
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile,amx-bf16"))) void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// n steps over `blocks` 1 KB tiles per operand, cyclic: A row tiles at a, a + stride; B column
// tiles at b, b + stride
__attribute__((target("amx-tile,amx-bf16"))) void loop(const uint16_t* a, const uint16_t* b,
                                                        int64_t stride, int64_t blocks,
                                                        int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t o = (i % blocks) * 512;
    _tile_loadd(6, b + o, 64);
    _tile_loadd(7, b + stride + o, 64);
    _tile_loadd(4, a + o, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + stride + o, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

__attribute__((target("amx-tile,amx-bf16"))) void compute_only(const uint16_t* a, int64_t n) {
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a + 512, 64);
  _tile_loadd(6, a + 1024, 64);
  _tile_loadd(7, a + 1536, 64);
  for (int64_t i = 0; i < n; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

template <typename F>
double ns_per_product(const F& f, double products) {
  f();
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < 5; ++r) f();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return s / 5 * 1e9 / products;
}

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    std::puts("Linux did not grant the AMX tile state");
    return 1;
  }
  configure();
  const int64_t offset = std::getenv("OFFSET") ? std::atoi(std::getenv("OFFSET")) : 0;
  const int64_t max_blocks = 4096, elements = 2 * max_blocks * 512 + 64;
  auto* a = static_cast<uint16_t*>(std::aligned_alloc(64, elements * 2));
  auto* b = static_cast<uint16_t*>(std::aligned_alloc(64, elements * 2));
  for (int64_t i = 0; i < elements; ++i) a[i] = b[i] = 0x3f80;  // bf16 1.0
  const uint16_t* ao = a + offset / 2;
  const uint16_t* bo = b + offset / 2;
  const int64_t n = 1 << 16;
  std::printf("buffers %ld bytes off a 64-byte boundary\n", static_cast<long>(offset));
  std::printf("no loads: %.1f ns a product\n", ns_per_product([&] { compute_only(ao, n); }, 4.0 * n));
  for (int64_t blocks : {8, 32, 128, 512, 1024, 2048}) {
    const double ns = ns_per_product([&] { loop(ao, bo, blocks * 512, blocks, n); }, 4.0 * n);
    std::printf("A and B cycling over %5ld KB in all: %.1f ns a product\n",
                static_cast<long>(blocks * 4), ns);
  }
  return 0;
}
