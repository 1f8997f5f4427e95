// The read bandwidth of a paged KV cache's access pattern, as decode attention at a big batch
// sees it: a 512 MB buffer cut into blocks of BLOCK bytes (a cache block's K or V for every KV
// head: 16 tokens x 3 heads x 64 x bf16 = 6 KB for SmolLM2), read in a random order (the
// blocks of many requests lie anywhere in the cache) and, for comparison, in address order;
// all OpenMP threads, AVX-512 loads, best of 5. HEADS > 1 reads each block as decode attention's
// per-KV-head items do: HEADS passes, each taking 128 bytes of every 128 x HEADS.
//
//   gcc -O2 -mavx512f -fopenmp -o /tmp/memory_block_read scripts/memory_block_read.c
//   OMP_NUM_THREADS=2 /tmp/memory_block_read [BLOCK] [HEADS]
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double read_gbs(const char* buf, const int* order, size_t nblk, size_t bsz, int heads) {
  double best = 0;
  for (int round = 0; round < 5; ++round) {
    int sink = 0;
    const double t0 = omp_get_wtime();
#pragma omp parallel reduction(| : sink)
    {
      __m512i a = _mm512_setzero_si512();
#pragma omp for schedule(static)
      for (size_t i = 0; i < nblk; ++i) {
        const char* b = buf + (size_t)order[i] * bsz;
        for (int h = 0; h < heads; ++h)
          for (size_t o = h * 128; o < bsz; o += 128 * heads) {
            a = _mm512_xor_si512(a, _mm512_load_si512(b + o));
            a = _mm512_xor_si512(a, _mm512_load_si512(b + o + 64));
          }
      }
      sink |= _mm512_reduce_or_epi32(a);
    }
    const double gbs = nblk * bsz / (omp_get_wtime() - t0) / 1e9;
    if (gbs > best) best = gbs;
    if (sink == 0x5eed) puts("");  // keeps the loads
  }
  return best;
}

int main(int argc, char** argv) {
  const size_t bsz = argc > 1 ? (size_t)atol(argv[1]) : 6144;
  const int heads = argc > 2 ? atoi(argv[2]) : 1;
  if (bsz < 128 || bsz % (128 * (size_t)heads) != 0) {
    fprintf(stderr, "BLOCK must be a multiple of 128 x HEADS bytes\n");
    return 2;
  }
  const size_t nblk = ((size_t)512 << 20) / bsz;
  char* buf = aligned_alloc(4096, nblk * bsz);
  int* order = malloc(nblk * sizeof(int));
  memset(buf, 1, nblk * bsz);  // faulted in before timing
  for (size_t i = 0; i < nblk; ++i) order[i] = (int)i;
  const double linear = read_gbs(buf, order, nblk, bsz, heads);
  srand(1);
  for (size_t i = nblk - 1; i > 0; --i) {
    const size_t j = (size_t)rand() % (i + 1);
    const int t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  const double random = read_gbs(buf, order, nblk, bsz, heads);
  printf("%d threads, blocks of %zu bytes, %d pass(es) a block: in order %.1f GB/s, random order %.1f GB/s\n",
         omp_get_max_threads(), bsz, heads, linear, random);
  free(order);
  free(buf);
  return 0;
}
