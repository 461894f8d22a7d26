/* mask: 0/1 bytes, and two-valued float32 tensors, as bits and back. */
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

/* The mask of a ReLU's input x: bit i set where !(x[i] <= 0) (positive, or NaN), packed
 * as acgc_mask_pack packs bytes; one pass over float32 x, no bool tensor in between. */
void acgc_mask_positive_f32(const float *x, int64_t n, uint8_t *out, int nthreads) {
    int64_t nbytes = (n + 7) / 8, full = n / 8;
#pragma omp parallel for schedule(static) num_threads(THREADS(n))
    for (int64_t b = 0; b < full; b++) {
        const float *p = x + 8 * b;
#if defined(__AVX2__) || defined(__AVX512F__)
        /* not-less-or-equal, unordered: true for x > 0 and for NaN */
        __m256 keep = _mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_setzero_ps(), _CMP_NLE_UQ);
        out[b] = (uint8_t)_mm256_movemask_ps(keep);
#else
        uint8_t byte = 0;
        for (int k = 0; k < 8; k++) byte |= (uint8_t)(!(p[k] <= 0.0f) << k);
        out[b] = byte;
#endif
    }
    if (full < nbytes) {
        uint8_t byte = 0;
        for (int64_t i = 8 * full; i < n; i++) byte |= (uint8_t)(!(x[i] <= 0.0f) << (i - 8 * full));
        out[full] = byte;
    }
}

/* A two-valued float32 x (a dropout's float mask) in one pass: bit i set where x[i] == hi,
 * packed as acgc_mask_pack packs bytes; returns how many values equal neither lo nor hi
 * (a NaN equals neither), 0 where x holds only lo and hi. */
int64_t acgc_mask_two_f32(const float *x, int64_t n, float lo, float hi, uint8_t *out,
                          int nthreads) {
    int64_t nbytes = (n + 7) / 8, full = n / 8, other = 0;
#pragma omp parallel for schedule(static) reduction(+ : other) num_threads(THREADS(n))
    for (int64_t b = 0; b < full; b++) {
        const float *p = x + 8 * b;
#if defined(__AVX2__) || defined(__AVX512F__)
        __m256 v = _mm256_loadu_ps(p);
        int h = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(hi), _CMP_EQ_OQ));
        int l = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(lo), _CMP_EQ_OQ));
        out[b] = (uint8_t)h;
        other += __builtin_popcount(~(h | l) & 0xFF);
#else
        uint8_t byte = 0;
        for (int k = 0; k < 8; k++) {
            byte |= (uint8_t)((p[k] == hi) << k);
            other += !(p[k] == hi || p[k] == lo);
        }
        out[b] = byte;
#endif
    }
    if (full < nbytes) {
        uint8_t byte = 0;
        for (int64_t i = 8 * full; i < n; i++) {
            byte |= (uint8_t)((x[i] == hi) << (i - 8 * full));
            other += !(x[i] == hi || x[i] == lo);
        }
        out[full] = byte;
    }
    return other;
}

/* The inverse of acgc_mask_two_f32: out[i] = hi where bit i of packed is set, else lo. */
void acgc_mask_select_f32(const uint8_t *packed, int64_t n, float lo, float hi, float *out,
                          int nthreads) {
    int64_t full = n / 8;
#pragma omp parallel for schedule(static) num_threads(THREADS(n))
    for (int64_t b = 0; b < full; b++) {
#if defined(__AVX2__) || defined(__AVX512F__)
        const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        __m256i bits = _mm256_and_si256(_mm256_set1_epi32(packed[b]), lane);
        __m256 keep = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, lane));
        _mm256_storeu_ps(out + 8 * b,
                         _mm256_blendv_ps(_mm256_set1_ps(lo), _mm256_set1_ps(hi), keep));
#else
        for (int k = 0; k < 8; k++) out[8 * b + k] = (packed[b] >> k) & 1 ? hi : lo;
#endif
    }
    for (int64_t i = 8 * full; i < n; i++) out[i] = (packed[i >> 3] >> (i & 7)) & 1 ? hi : lo;
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

/* A ReLU's output remade from its BatchNorm's input with the ReLU's exact mask: element
 * i of row r (channel r % channels) is x*scale + shift (+ addend[i], a residual branch,
 * where addend is not NULL), at least tiny (NaN stays NaN: the comparison fails;
 * max_ps(tiny, v) returns v for NaN too), where bit i of packed is set, else 0. Rows of
 * `inner` values; a row starting on a whole mask byte takes the vector path (the mask
 * bits are the lane mask), the rest the scalar one. */
static inline float mask_affine_one(float x, float s, float t, const float *a, int64_t i,
                                    float tiny, int keep) {
    float v = x * s;
    v = v + t;
    if (a) v = v + a[i];
    v = v < tiny ? tiny : v;
    return keep ? v : 0.0f;
}

void acgc_mask_affine_f32(const float *x, int64_t rows, int64_t channels, int64_t inner,
                          const float *scale, const float *shift, const float *addend,
                          const uint8_t *packed, float tiny, float *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(THREADS(rows * inner))
    for (int64_t r = 0; r < rows; r++) {
        const float s = scale[r % channels], t = shift[r % channels];
        const int64_t base = r * inner;
        int64_t j = 0;
#if defined(__AVX512F__)
        if ((base & 7) == 0) {
            const __m512 sv = _mm512_set1_ps(s), tv = _mm512_set1_ps(t), lo = _mm512_set1_ps(tiny);
            for (; j + 16 <= inner; j += 16) {
                uint16_t bits;
                memcpy(&bits, packed + ((base + j) >> 3), 2);
                __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(x + base + j), sv), tv);
                if (addend) v = _mm512_add_ps(v, _mm512_loadu_ps(addend + base + j));
                _mm512_storeu_ps(out + base + j, _mm512_maskz_mov_ps(bits, _mm512_max_ps(lo, v)));
            }
        }
#elif defined(__AVX2__)
        if ((base & 7) == 0) {
            const __m256 sv = _mm256_set1_ps(s), tv = _mm256_set1_ps(t), lo = _mm256_set1_ps(tiny);
            const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
            for (; j + 8 <= inner; j += 8) {
                __m256i b = _mm256_set1_epi32(packed[(base + j) >> 3]);
                __m256 keep = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, lane), lane));
                __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(x + base + j), sv), tv);
                if (addend) v = _mm256_add_ps(v, _mm256_loadu_ps(addend + base + j));
                _mm256_storeu_ps(out + base + j, _mm256_and_ps(keep, _mm256_max_ps(lo, v)));
            }
        }
#endif
        for (; j < inner; j++) {
            const int64_t i = base + j;
            out[i] = mask_affine_one(x[i], s, t, addend, i, tiny, (packed[i >> 3] >> (i & 7)) & 1);
        }
    }
}
