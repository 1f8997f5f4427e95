// One thread's AMX bf16 tile loop, the shape of gemm_amx.h's items (32-row tiles, two panel
// halves, 2 x 2 tiles of C), on three B layouts, alternated and best of 7: how fast the tile
// unit runs right now (ns a tile product; ~7 at its peak on a 2.3 GHz core), and what the
// panel layout costs with the kernel's prefetching, epilogue and threads taken away.
//   layout 0: pagedllm's panels: a k-pair's 64 channels in a 256-byte row (B tile stride 256)
//   layout 1: 32-channel halves stored apart (stride 128)
//   layout 2: every B tile 1 KB contiguous, a half's tiles in a row (stride 64)
//
//   gcc -O2 -mamx-tile -mamx-bf16 -mavx512f -o /tmp/amx_tile_loop scripts/amx_tile_loop.c
//   /tmp/amx_tile_loop PANELS ROWS K [ORDER] [REPS]
//
// PANELS panels of 64 channels (48 x K = 576: 3.5 MB, streamed from memory; 4: hot in L2),
// ROWS rows of x (a multiple of 32), K inputs (a multiple of 32). ORDER 0: each 32-row tile
// sweeps both halves (gemm_amx.h's order); 1: each half sweeps all row tiles. The sums are
// not checked (the bytes are constant); only the time is.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

struct __attribute__((aligned(64))) tile_config {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s PANELS ROWS K [ORDER] [REPS]\n", argv[0]);
    return 2;
  }
  const long panels = atol(argv[1]), rows = atol(argv[2]), K = atol(argv[3]);
  const int order = argc > 4 ? atoi(argv[4]) : 0;
  const int reps = argc > 5 ? atoi(argv[5]) : (panels > 16 ? 3 : 20);
  if (rows % 32 || K % 32 || panels < 1) {
    fprintf(stderr, "ROWS and K must be multiples of 32\n");
    return 2;
  }
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
    fprintf(stderr, "no AMX tile data permission\n");
    return 1;
  }
  struct tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int i = 0; i < 8; i++) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
  const long ldx = K * 2, panel_bytes = K / 2 * 64 * 4, half_bytes = panel_bytes / 2;
  char* x = aligned_alloc(4096, rows * ldx);
  char* w = aligned_alloc(4096, panel_bytes * panels);
  char* c = aligned_alloc(4096, rows * 256);
  memset(x, 1, rows * ldx);
  memset(w, 1, panel_bytes * panels);
  double best[3] = {1e9, 1e9, 1e9};
  long products = 0;
  for (int round = 0; round < 7; round++)
    for (int layout = 0; layout < 3; layout++) {
      const double t0 = now();
      products = 0;
      for (int rep = 0; rep < reps; rep++)
        for (long p = 0; p < panels; p++) {
          const char* panel = w + p * panel_bytes;
          for (long o = 0; o < 2 * (rows / 32); o++) {
            const long m = order ? (o % (rows / 32)) * 32 : (o / 2) * 32;
            const int half = order ? (int)(o / (rows / 32)) : (int)(o % 2);
            const char* xm = x + m * ldx;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (long k = 0; k < K * 2; k += 64) {
              const char* b;
              long stride, second;
              if (layout == 0) {
                b = panel + half * 128 + k * 64;
                stride = 256;
                second = 64;
              } else if (layout == 1) {
                b = panel + half * half_bytes + k * 32;
                stride = 128;
                second = 64;
              } else {
                b = panel + half * half_bytes + k * 32;
                stride = 64;
                second = 1024;
              }
              _tile_loadd(4, xm + k, ldx);
              _tile_loadd(6, b, stride);
              _tile_loadd(7, b + second, stride);
              _tile_dpbf16ps(0, 4, 6);
              _tile_dpbf16ps(1, 4, 7);
              _tile_loadd(5, xm + 16 * ldx + k, ldx);
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
              products += 4;
            }
            char* cm = c + m * 256 + half * 128;
            _tile_stored(0, cm, 256);
            _tile_stored(1, cm + 64, 256);
            _tile_stored(2, cm + 16 * 256, 256);
            _tile_stored(3, cm + 16 * 256 + 64, 256);
          }
        }
      const double dt = now() - t0;
      if (dt < best[layout]) best[layout] = dt;
    }
  _tile_release();
  for (int layout = 0; layout < 3; layout++)
    printf("panels %ld rows %ld K %ld order %d layout %d: %.2f ns a tile product, x%.3f layout 0\n",
           panels, rows, K, order, layout, best[layout] / products * 1e9, best[0] / best[layout]);
  return 0;
}
