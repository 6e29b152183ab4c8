/* Streaming the weights: the bytes of NR outputs' blocks (NR: the including kernel's tile), asked for
 * AHEAD tiles before they are used. Reading a model's matrices one after another from memory, with other
 * work between them, the hardware prefetchers alone left the kernels waiting on most loads (blocks.c's
 * LM head; qdot.c's layers took twice their time inside a decode step than called back to back). attention.c
 * prefetches a paged cache's keys and values with `prefetch`: its blocks lie anywhere in the pool. */
#pragma once
#include <stdint.h>

#define AHEAD 4
static inline void prefetch(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i);
}
#define PREFETCH_q4(q, d, m, n, K) (prefetch((const uint8_t *)(q) + (n) * ((K) / 2), NR * (K) / 2),          \
                                    prefetch((d) + (n) * ((K) / 32), NR * (K) / 16), prefetch((m) + (n) * ((K) / 32), NR * (K) / 16))
#define PREFETCH_q8(q, d, m, n, K) (prefetch((const int8_t *)(q) + (n) * (K), NR * (K)), prefetch((d) + (n) * ((K) / 32), NR * (K) / 16))
