/* nonzero: a floating tensor as a 1-bit mask of its non-zero elements and their values in
 * order, and back (nonzero/reference.py's format). Elements are compared by bit pattern
 * (4 or 2 bytes), so +0.0 alone is zero; -0.0, NaN, inf and denormals are values, copied
 * bit for bit. Each call runs over one chunk per thread (whole 64-element blocks: one bit
 * word each, so chunks own whole bytes of bits): pass 1 writes (split) or reads (merge) a
 * chunk's bits and counts its values, a prefix sum places each chunk's values, pass 2
 * gathers (split) or scatters (merge) them. AVX-512 compress/expand in registers where
 * the build has it (VBMI2 for 2-byte elements), else a portable loop over the set bits:
 * the same output. */
#include "fastcpu.h"

#define NZ_BLOCK 64 /* elements per bit word */

/* The word's low `len` bits (len 1..64). */
static inline uint64_t low_bits(uint64_t w, int64_t len) {
    return len >= 64 ? w : w & ((1ULL << len) - 1);
}

/* Bit word of the block at bits (len elements): 8 bytes, or the ceil(len / 8) there are. */
static inline uint64_t load_word(const uint8_t *bits, int64_t len) {
    uint64_t w = 0;
    memcpy(&w, bits, len >= 64 ? 8 : (size_t)((len + 7) / 8)); /* little-endian hosts */
    return low_bits(w, len);
}

static inline void store_word(uint8_t *bits, uint64_t w, int64_t len) {
    memcpy(bits, &w, len >= 64 ? 8 : (size_t)((len + 7) / 8));
}

#if defined(__AVX512BW__)
/* The lanes of a row of 32 2-byte values with `left` of them left (lanes16's twin). */
static inline __mmask32 lanes32(int64_t left) {
    return left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1);
}
#endif

/* ---- the bit word of a block: bit k set where element k (k < len) is non-zero ---- */

/* Portable: one 0/1 byte per element, then 8 bytes at a time to 8 bits by a product (byte
 * k's bit lands on bit 56 + k, every other term below 56 or past 63, none on another: no
 * carries); 5x faster than shifting each element's bit into the word. */
#define PORTABLE_WORD(T, SUFFIX)                                                         \
    static inline uint64_t word_portable##SUFFIX(const T *p, int64_t len) {              \
        uint8_t nz[NZ_BLOCK];                                                            \
        for (int64_t k = 0; k < NZ_BLOCK; k++) nz[k] = k < len && p[k] != 0;             \
        uint64_t w = 0;                                                                  \
        for (int k0 = 0; k0 < NZ_BLOCK; k0 += 8) {                                       \
            uint64_t v;                                                                  \
            memcpy(&v, nz + k0, 8); /* little-endian hosts: byte k0 + j is bit 8j */     \
            w |= ((v * 0x0102040810204080ULL) >> 56) << k0;                              \
        }                                                                                \
        return w;                                                                        \
    }
PORTABLE_WORD(uint32_t, 32)
PORTABLE_WORD(uint16_t, 16)
#undef PORTABLE_WORD

static inline uint64_t word32(const uint32_t *p, int64_t len) {
#if defined(__AVX512F__)
    uint64_t w = 0;
    for (int64_t q = 0; q < len; q += 16) { /* masked-off lanes load as 0: bits clear */
        __m512i v = _mm512_maskz_loadu_epi32(lanes16(len - q), p + q);
        w |= (uint64_t)_mm512_test_epi32_mask(v, v) << q;
    }
    return w;
#else
    return word_portable32(p, len);
#endif
}

static inline uint64_t word16(const uint16_t *p, int64_t len) {
#if defined(__AVX512BW__)
    uint64_t w = 0;
    for (int64_t q = 0; q < len; q += 32) {
        __m512i v = _mm512_maskz_loadu_epi16(lanes32(len - q), p + q);
        w |= (uint64_t)_mm512_test_epi16_mask(v, v) << q;
    }
    return w;
#else
    return word_portable16(p, len);
#endif
}

/* ---- one block's values: gathered into dst (split) or scattered from src (merge) ---- */

/* Portable: the set bits one by one (a full block is one copy; merge zeroes first). */
#define PORTABLE_BLOCK(T, SUFFIX)                                                        \
    static inline void gather_portable##SUFFIX(const T *p, uint64_t w, int64_t len,       \
                                               T *dst) {                                  \
        if (len == 64 && w == ~0ULL) {                                                   \
            memcpy(dst, p, 64 * sizeof(T));                                              \
            return;                                                                      \
        }                                                                                \
        for (int j = 0; w; w &= w - 1) dst[j++] = p[__builtin_ctzll(w)];                \
    }                                                                                    \
    static inline void scatter_portable##SUFFIX(const T *src, uint64_t w, int64_t len,    \
                                                T *out) {                                 \
        if (len == 64 && w == ~0ULL) {                                                   \
            memcpy(out, src, 64 * sizeof(T));                                            \
            return;                                                                      \
        }                                                                                \
        memset(out, 0, (size_t)len * sizeof(T));                                         \
        for (int j = 0; w; w &= w - 1) out[__builtin_ctzll(w)] = src[j++];               \
    }
PORTABLE_BLOCK(uint32_t, 32)
PORTABLE_BLOCK(uint16_t, 16)
#undef PORTABLE_BLOCK

/* Compress in a register, then store: a whole row where the chunk's room (up to limit, the
 * next chunk's values) holds W values, the c values alone near it (masked stores cost
 * a fifth more on AMD Zen 4; compressing straight to memory, vpcompressd m512, is
 * microcoded there: 14x slower). Rows of W lanes of type MASK_T, for both element sizes. */
#define GATHER_ROWS(W, MASK_T, LANES, LOADZ, COMPRESS, MSTORE)                           \
    for (int64_t q = 0; q < len; q += W) {                                               \
        MASK_T m = (MASK_T)(w >> q);                                                     \
        int c = __builtin_popcountll((uint64_t)m);                                       \
        __m512i v = COMPRESS(m, LOADZ(LANES(len - q), p + q));                           \
        if (limit - dst >= W)                                                            \
            _mm512_storeu_si512(dst, v);                                                 \
        else                                                                             \
            MSTORE(dst, (MASK_T)((1ULL << c) - 1), v);                                   \
        dst += c;                                                                        \
    }
/* Expand: the row's c values loaded, spread to the row's set lanes, the row stored. */
#define SCATTER_ROWS(W, MASK_T, LANES, LOADZ, EXPAND, MSTORE)                            \
    for (int64_t q = 0; q < len; q += W) {                                               \
        MASK_T m = (MASK_T)(w >> q);                                                     \
        int c = __builtin_popcountll((uint64_t)m);                                       \
        __m512i v = LOADZ((MASK_T)((1ULL << c) - 1), src);                               \
        MSTORE(out + q, LANES(len - q), EXPAND(m, v));                                   \
        src += c;                                                                        \
    }

static inline void gather32(const uint32_t *p, uint64_t w, int64_t len, uint32_t *dst,
                            const uint32_t *limit) {
#if defined(__AVX512F__)
    GATHER_ROWS(16, __mmask16, lanes16, _mm512_maskz_loadu_epi32, _mm512_maskz_compress_epi32,
                _mm512_mask_storeu_epi32)
#else
    (void)limit;
    gather_portable32(p, w, len, dst);
#endif
}

static inline void scatter32(const uint32_t *src, uint64_t w, int64_t len, uint32_t *out) {
#if defined(__AVX512F__)
    SCATTER_ROWS(16, __mmask16, lanes16, _mm512_maskz_loadu_epi32, _mm512_maskz_expand_epi32,
                 _mm512_mask_storeu_epi32)
#else
    scatter_portable32(src, w, len, out);
#endif
}

static inline void gather16(const uint16_t *p, uint64_t w, int64_t len, uint16_t *dst,
                            const uint16_t *limit) {
#if defined(__AVX512VBMI2__) && defined(__AVX512BW__)
    GATHER_ROWS(32, __mmask32, lanes32, _mm512_maskz_loadu_epi16, _mm512_maskz_compress_epi16,
                _mm512_mask_storeu_epi16)
#else
    (void)limit;
    gather_portable16(p, w, len, dst);
#endif
}

static inline void scatter16(const uint16_t *src, uint64_t w, int64_t len, uint16_t *out) {
#if defined(__AVX512VBMI2__) && defined(__AVX512BW__)
    SCATTER_ROWS(32, __mmask32, lanes32, _mm512_maskz_loadu_epi16, _mm512_maskz_expand_epi16,
                 _mm512_mask_storeu_epi16)
#else
    scatter_portable16(src, w, len, out);
#endif
}
#undef GATHER_ROWS
#undef SCATTER_ROWS

/* ---- chunks: blocks [b0, b1) of a tensor of n elements ---- */

/* The bit word of block b (len elements) of x, and its bits stored. */
static inline uint64_t split_word(const void *x, int esz, int64_t i, int64_t len, uint8_t *bits) {
    uint64_t w = esz == 4 ? (len == NZ_BLOCK ? word32((const uint32_t *)x + i, NZ_BLOCK)
                                             : word32((const uint32_t *)x + i, len))
                          : (len == NZ_BLOCK ? word16((const uint16_t *)x + i, NZ_BLOCK)
                                             : word16((const uint16_t *)x + i, len));
    store_word(bits + i / 8, w, len);
    return w;
}

/* Split's pass 1: the chunk's bits; returns its number of values. */
static int64_t split_count(const void *x, int64_t n, int esz, int64_t b0, int64_t b1,
                           uint8_t *bits) {
    int64_t count = 0;
    for (int64_t b = b0; b < b1; b++) {
        int64_t i = b * NZ_BLOCK, len = n - i < NZ_BLOCK ? n - i : NZ_BLOCK;
        count += __builtin_popcountll(split_word(x, esz, i, len, bits));
    }
    return count;
}

/* Split's pass 2: the chunk's values (its bits read back) into dst, writing nothing at or
 * past limit, the next chunk's first place (whole rows up to it). */
static void split_values(const void *x, int64_t n, int esz, int64_t b0, int64_t b1,
                         const uint8_t *bits, void *dst, void *limit) {
    char *d = (char *)dst;
    for (int64_t b = b0; b < b1; b++) {
        int64_t i = b * NZ_BLOCK, len = n - i < NZ_BLOCK ? n - i : NZ_BLOCK;
        uint64_t w = load_word(bits + i / 8, len);
        if (esz == 4 && len == NZ_BLOCK) /* constant lengths: whole-row loads and stores */
            gather32((const uint32_t *)x + i, w, NZ_BLOCK, (uint32_t *)d, (uint32_t *)limit);
        else if (esz == 4)
            gather32((const uint32_t *)x + i, w, len, (uint32_t *)d, (uint32_t *)limit);
        else if (len == NZ_BLOCK)
            gather16((const uint16_t *)x + i, w, NZ_BLOCK, (uint16_t *)d, (uint16_t *)limit);
        else
            gather16((const uint16_t *)x + i, w, len, (uint16_t *)d, (uint16_t *)limit);
        d += (int64_t)__builtin_popcountll(w) * esz;
    }
}

/* Merge's pass 1: the chunk's number of set bits (of elements below n). */
static int64_t merge_count(const uint8_t *bits, int64_t n, int64_t b0, int64_t b1) {
    int64_t count = 0;
    for (int64_t b = b0; b < b1; b++) {
        int64_t i = b * NZ_BLOCK;
        count += __builtin_popcountll(load_word(bits + i / 8, n - i));
    }
    return count;
}

/* Merge's pass 2: the chunk's elements from its values at src. */
static void merge_scatter(const uint8_t *bits, const void *src, int64_t n, int esz,
                          int64_t b0, int64_t b1, void *out) {
    const char *s = (const char *)src;
    for (int64_t b = b0; b < b1; b++) {
        int64_t i = b * NZ_BLOCK, len = n - i < NZ_BLOCK ? n - i : NZ_BLOCK;
        uint64_t w = load_word(bits + i / 8, len);
        if (esz == 4 && len == NZ_BLOCK)
            scatter32((const uint32_t *)s, w, NZ_BLOCK, (uint32_t *)out + i);
        else if (esz == 4)
            scatter32((const uint32_t *)s, w, len, (uint32_t *)out + i);
        else if (len == NZ_BLOCK)
            scatter16((const uint16_t *)s, w, NZ_BLOCK, (uint16_t *)out + i);
        else
            scatter16((const uint16_t *)s, w, len, (uint16_t *)out + i);
        s += (int64_t)__builtin_popcountll(w) * esz;
    }
}

/* Chunk k of `chunks` over nb blocks starts at block CHUNK_START(k) (k = chunks: nb). */
#define CHUNK_START(k) ((int64_t)(k) * nb / chunks)

/* The bits of the n elements (esz = 4 or 2 bytes each) of x into bits (ceil(n / 8) bytes,
 * tail bits 0) and their non-zero elements in order into values (room for n); returns
 * their number. */
int64_t acgc_nonzero_split(const void *x, int64_t n, int esz, uint8_t *bits, void *values,
                           int nthreads) {
    if (n <= 0) return 0;
    int64_t nb = (n + NZ_BLOCK - 1) / NZ_BLOCK;
    int chunks = THREADS(n) < 1 ? 1 : THREADS(n);
    int64_t off[chunks + 1];
    char *v = (char *)values;
    if (chunks == 1) { /* no OpenMP region: one costs 1 us, 8x the work of 1000 elements */
        int64_t count = split_count(x, n, esz, 0, nb, bits);
        split_values(x, n, esz, 0, nb, bits, v, v + count * esz);
        return count;
    }
    off[0] = 0;
#pragma omp parallel num_threads(chunks)
    {
#pragma omp for schedule(static)
        for (int k = 0; k < chunks; k++)
            off[k + 1] = split_count(x, n, esz, CHUNK_START(k), CHUNK_START(k + 1), bits);
#pragma omp single
        for (int k = 0; k < chunks; k++) off[k + 1] += off[k];
#pragma omp for schedule(static) /* the same chunk to the same thread: still in cache */
        for (int k = 0; k < chunks; k++)
            split_values(x, n, esz, CHUNK_START(k), CHUNK_START(k + 1), bits, v + off[k] * esz,
                         v + off[k + 1] * esz);
    }
    return off[chunks];
}

/* The n elements (esz = 4 or 2 bytes each) of bits (ceil(n / 8) bytes) and values into out:
 * 0 where a bit is clear, the values in order where it is set. Returns the number of set
 * bits; out is written only where that equals nvalues (the caller's check). */
int64_t acgc_nonzero_merge(const uint8_t *bits, const void *values, int64_t nvalues, int64_t n,
                           int esz, void *out, int nthreads) {
    if (n <= 0) return 0;
    int64_t nb = (n + NZ_BLOCK - 1) / NZ_BLOCK;
    int chunks = THREADS(n) < 1 ? 1 : THREADS(n);
    int64_t off[chunks + 1];
    if (chunks == 1) {
        int64_t count = merge_count(bits, n, 0, nb);
        if (count == nvalues) merge_scatter(bits, values, n, esz, 0, nb, out);
        return count;
    }
    off[0] = 0;
#pragma omp parallel num_threads(chunks)
    {
#pragma omp for schedule(static)
        for (int k = 0; k < chunks; k++)
            off[k + 1] = merge_count(bits, n, CHUNK_START(k), CHUNK_START(k + 1));
#pragma omp single
        for (int k = 0; k < chunks; k++) off[k + 1] += off[k];
        if (off[chunks] == nvalues) {
#pragma omp for schedule(static)
            for (int k = 0; k < chunks; k++)
                merge_scatter(bits, (const char *)values + off[k] * esz, n, esz,
                              CHUNK_START(k), CHUNK_START(k + 1), out);
        }
    }
    return off[chunks];
}
#undef CHUNK_START
