// The memory's read bandwidth as the weight-streaming bound of a batch-1 decode sees it: a
// 512 MB buffer (far past any L3) read with AVX-512 loads by all OpenMP threads, best of 5.
//
//   gcc -O2 -mavx512f -fopenmp -o /tmp/memory_read_bw scripts/memory_read_bw.c
//   OMP_NUM_THREADS=2 /tmp/memory_read_bw
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(void) {
  const size_t n = (size_t)512 << 20;
  char* buf = aligned_alloc(64, n);
  memset(buf, 1, n);  // faulted in before timing
  double best = 0;
  int sink = 0;
  for (int round = 0; round < 5; ++round) {
    const double t0 = omp_get_wtime();
#pragma omp parallel reduction(| : sink)
    {
      __m512i a = _mm512_setzero_si512();
#pragma omp for
      for (size_t i = 0; i < n; i += 256)
        for (int j = 0; j < 256; j += 64) a = _mm512_xor_si512(a, _mm512_load_si512(buf + i + j));
      sink |= _mm512_reduce_or_epi32(a);
    }
    const double gbs = n / (omp_get_wtime() - t0) / 1e9;
    if (gbs > best) best = gbs;
  }
  printf("%d threads: %.1f GB/s (best of 5)%s\n", omp_get_max_threads(), best, sink == 42 ? " " : "");
  free(buf);
  return 0;
}
