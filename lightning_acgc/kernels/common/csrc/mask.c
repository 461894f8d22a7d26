/* mask: 0/1 bytes as bits and back. */
#include "fastcpu.h"

/* 1-bit packing of n bytes holding 0/1: bit i % 8 of byte i / 8 is element i (tail 0). */
void acgc_mask_pack(const uint8_t *m, int64_t n, uint8_t *out, int nthreads) {
    int64_t nbytes = (n + 7) / 8, full = n / 8;
#pragma omp parallel for schedule(static) num_threads(THREADS(n))
    for (int64_t b = 0; b < full; b++) {
        const uint8_t *p = m + 8 * b;
        uint8_t byte = 0;
        for (int k = 0; k < 8; k++) byte |= (uint8_t)((p[k] != 0) << k);
        out[b] = byte;
    }
    if (full < nbytes) {
        uint8_t byte = 0;
        for (int64_t i = 8 * full; i < n; i++) byte |= (uint8_t)((m[i] != 0) << (i - 8 * full));
        out[full] = byte;
    }
}

void acgc_mask_unpack(const uint8_t *packed, int64_t n, uint8_t *out, int nthreads) {
    int64_t full = n / 8;
    /* one 8-byte store per packed byte: the byte copied to all 8 lanes, lane k keeps bit
     * k, then each lane's 0 or 2^k becomes 0 or 1 (adding 0x7F carries into bit 7 only) */
#pragma omp parallel for schedule(static) num_threads(THREADS(n))
    for (int64_t b = 0; b < full; b++) {
        uint64_t v = ((uint64_t)packed[b] * 0x0101010101010101ULL) & 0x8040201008040201ULL;
        v = ((v + 0x7F7F7F7F7F7F7F7FULL) >> 7) & 0x0101010101010101ULL;
        memcpy(out + 8 * b, &v, 8); /* little-endian hosts (x86-64, aarch64) */
    }
    for (int64_t i = 8 * full; i < n; i++) out[i] = (packed[i >> 3] >> (i & 7)) & 1;
}
