/* Compiled CPU path of the codec kernels (quant, mask, bounded, division, intpack): C99 +
 * OpenMP (and GCC's unsigned __int128 for intpack's 64-bit widths), no torch
 * headers. Python passes data pointers through ctypes (lightning_acgc/kernels/common/
 * cpu_lib.py builds this file with gcc on first use). Every function computes exactly what
 * its pure-torch reference computes (same float32 operations, no FMA contraction: built
 * with -ffp-contract=off), so the outputs are bit-identical. -fno-trapping-math (no value
 * changes) lets loops with selects and divisions vectorize.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* The bit streams and the noise's 16-bit halves are read and written through words in
 * little-endian order: elsewhere the build fails and the codecs take the torch reference
 * (cpu_lib.py's one-line notice) rather than writing other bytes. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "fastcpu.c assumes a little-endian host"
#endif

/* Threads for a call over `work` elements: one below 32K elements, where waking the
 * team costs more than the work (many small saved tensors, e.g. RNN steps). */
#define THREADS(work) ((work) < 32768 ? 1 : nthreads)

/* Chris Wellons' lowbias32 integer hash (also written in torch in quant/reference.py). */
static inline uint32_t lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

/* What lane_stats computes (a constant argument: the unused lanes vanish once inlined). */
enum { STAT_MIN = 1, STAT_MAX = 2, STAT_POS = 4, STAT_FINITE = 8, STAT_ALL = 15 };

#if defined(__AVX512F__)
/* 16 lanes folded in halves as lane_stats' portable code folds them: lane k takes
 * lane k + half where that one is smaller (larger), half = 8, 4, 2, 1. */
static inline float fold_min(__m512 v) {
    __m256 a = _mm512_castps512_ps256(v);
    __m256 b = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    a = _mm256_min_ps(b, a);
    __m128 c = _mm_min_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
    c = _mm_min_ps(_mm_movehl_ps(c, c), c);
    return _mm_cvtss_f32(_mm_min_ss(_mm_movehdup_ps(c), c));
}

static inline float fold_max(__m512 v) {
    __m256 a = _mm512_castps512_ps256(v);
    __m256 b = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    a = _mm256_max_ps(b, a);
    __m128 c = _mm_max_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a));
    c = _mm_max_ps(_mm_movehl_ps(c, c), c);
    return _mm_cvtss_f32(_mm_max_ss(_mm_movehdup_ps(c), c));
}
#endif

/* Of p[0..len), as `want` asks: the min (*lo), max (*hi) and smallest positive value
 * (*min_pos, inf if none); returns 1 if STAT_FINITE is asked and some value is NaN or
 * +-inf (the other outputs then meaningless), else 0. */
static inline int lane_stats(const float *p, int64_t len, int want, float *lo, float *hi,
                             float *min_pos) {
#if defined(__AVX512F__)
    /* the same 16 lanes and folds in registers: _mm512_min_ps(v, m) is v < m ? v : m,
     * element for element (NaN and equal zeros included), as the selects below are; the
     * compiler kept those lanes and their folds in memory (a fifth of division's encode) */
    __m512 mn = _mm512_set1_ps(INFINITY), mx = _mm512_set1_ps(-INFINITY), mp = mn;
    __m512 top = _mm512_set1_ps(3.4028234663852886e38f), zero = _mm512_setzero_ps();
    __mmask16 nf = 0;
    for (int64_t i = 0; i < len; i += 16) {
        __mmask16 m = len - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(m, p + i);
        if (want & STAT_FINITE)
            nf |= m & ~_mm512_cmp_ps_mask(_mm512_abs_ps(v), top, _CMP_LE_OQ);
        if (want & STAT_MIN) mn = _mm512_mask_min_ps(mn, m, v, mn);
        if (want & STAT_MAX) mx = _mm512_mask_max_ps(mx, m, v, mx);
        if (want & STAT_POS)
            mp = _mm512_mask_min_ps(mp, m & _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ), v, mp);
    }
    *lo = fold_min(mn);
    *hi = fold_max(mx);
    *min_pos = fold_min(mp);
    return nf != 0;
#else
    /* 16 independent lanes (elementwise selects, which the compiler vectorizes; a float
     * min/max reduction it would not, without -ffast-math). */
    float mn[16], mx[16], mp[16];
    int nf[16];
    for (int k = 0; k < 16; k++) mn[k] = INFINITY, mx[k] = -INFINITY, mp[k] = INFINITY, nf[k] = 0;
    /* whole rows of 16 in a loop without an exit (one with a tail test in it did not
     * vectorize: 2.3x slower), the tail into lanes 0.. */
    int64_t full = len / 16 * 16;
#define STAT_LANE(k, v)                                                                    \
    do {                                                                                   \
        if (want & STAT_FINITE) nf[k] |= !(fabsf(v) <= 3.4028234663852886e38f);            \
        if (want & STAT_MIN) mn[k] = (v) < mn[k] ? (v) : mn[k];                            \
        if (want & STAT_MAX) mx[k] = (v) > mx[k] ? (v) : mx[k];                            \
        float c_ = (v) > 0.0f ? (v) : INFINITY; /* a masked min: no branch */              \
        if (want & STAT_POS) mp[k] = c_ < mp[k] ? c_ : mp[k];                              \
    } while (0)
    for (int64_t i = 0; i < full; i += 16)
        for (int k = 0; k < 16; k++) STAT_LANE(k, p[i + k]);
    for (int64_t i = full; i < len; i++) STAT_LANE(i - full, p[i]);
#undef STAT_LANE
    /* the lanes folded in halves (four steps of elementwise selects; one lane after the
     * other was a chain of 15 dependent selects a statistic, 45 cycles a group). The order
     * picks among equal values only, so only the sign of a zero can depend on it, which
     * no caller reads: a quant lo is stored as lo + 0.0, and bounded takes the zeros-only
     * groups' values from torch. */
    for (int half = 8; half >= 1; half /= 2)
        for (int k = 0; k < half; k++) {
            mn[k] = mn[k + half] < mn[k] ? mn[k + half] : mn[k];
            mx[k] = mx[k + half] > mx[k] ? mx[k + half] : mx[k];
            mp[k] = mp[k + half] < mp[k] ? mp[k + half] : mp[k];
        }
    int nonfinite = 0;
    for (int k = 0; k < 16; k++) nonfinite |= nf[k];
    *lo = mn[0];
    *hi = mx[0];
    *min_pos = mp[0];
    return nonfinite;
#endif
}

/* Min, max and smallest positive value of p[0..len); returns 1 if some value is NaN or
 * +-inf (outputs then meaningless), else 0. */
static inline int stats_of(const float *p, int64_t len, float *lo, float *hi, float *min_pos) {
    return lane_stats(p, len, STAT_ALL, lo, hi, min_pos);
}

/* 2^-16: the noise's resolution (one 16-bit half of a hash per element). */
#define NOISE_UNIT 1.52587890625e-05f

/* The code of value v with noise u (see pair_hashes), for a v at or above l, as every
 * value of its group is (l is the group's min, rounded down in bfloat16 metadata; in a
 * zero-kept group its smallest positive value, rounded down, and v is 0 or above it):
 * t = (v - lo) * inv; s = t + u, >= 0 with no clamp; min(s, top) truncated, plus 1 where
 * zk and v != 0, and a zero-kept 0 is code 0 (the reference's clamp at 0 gives the same
 * codes; without it the encode's loop runs 25% faster). zk is a constant where the loop
 * should vectorize. */
static inline uint8_t code_of(float v, float u, float l, float iv, float tp, int zk) {
    float t = (v - l) * iv;
    float s = t + u;
    s = s > tp ? tp : s;
    if (!zk) return (uint8_t)s;
    return v != 0.0f ? (uint8_t)((uint8_t)s + 1) : 0;
}

#define CHUNK 4096

static inline float f32_of(uint32_t b) {
    float r;
    memcpy(&r, &b, 4);
    return r;
}

static inline uint32_t bits_of(float v) {
    uint32_t b;
    memcpy(&b, &v, 4);
    return b;
}

/* The largest bfloat16 <= v, as float32 (quant/reference.py's _bf16_down). */
static inline float bf16_down(float v) {
    uint32_t b = bits_of(v), t = b & 0xFFFF0000u;
    return f32_of(((int32_t)b < 0 && (b & 0xFFFFu)) ? t + 65536u : t);
}

/* The smallest bfloat16 >= v for v >= 0, as float32 (quant/reference.py's _bf16_up). */
static inline float bf16_up(float v) {
    uint32_t b = bits_of(v), t = b & 0xFFFF0000u;
    return f32_of((b & 0xFFFFu) ? t + 65536u : t);
}

/* One group's parameters from its finite min lo, max hi and smallest positive value mp,
 * as quant/reference.py's group_meta computes them (the same float32 operations in the
 * same order), in bfloat16 metadata (bf16 set) or float32: the stored lo (+0.0 for zeros)
 * and signed scale (-step in zero-kept groups), and for the pack lo, inv, top and
 * zero-kept. Returns 0 if the format cannot hold the group (bf16: a value out of range or
 * a zero-kept lo that rounds to 0; fp32: a range or inverse beyond float32), else 1. */
static inline int group_param(float lo, float hi, float mp, int bits, int bf16, float *out_lo,
                              float *out_scale, float *out_inv, float *out_top, uint8_t *out_zk) {
    float levels = (float)((1 << bits) - 1);
    int zk = bits > 1 && lo == 0.0f && hi > 0.0f;
    float l = zk ? mp : lo;
    float top = zk ? levels - 1.0f : levels;
    float step, inv;
    int ok;
    if (bf16) {
        l = bf16_down(l) + 0.0f;
        float d = (hi - l) / top;
        step = bf16_up(d < 0.0f ? 0.0f : d);
        float reach = top * step;
        if (l + reach < hi) step = bf16_up(nextafterf(step, 1e38f));
        inv = step > 0.0f ? 1.0f / step : 0.0f;
        ok = isfinite(l) && isfinite(step) && isfinite(inv) && !(zk && l <= 0.0f);
    } else {
        step = (hi - l) / top;
        inv = step > 0.0f ? 1.0f / step : 0.0f;
        ok = isfinite(step) && isfinite(inv);
    }
    *out_lo = l + 0.0f;
    *out_scale = zk ? -step : step;
    *out_inv = inv;
    *out_top = top;
    *out_zk = (uint8_t)zk;
    return ok;
}

/* The 8 codes of width w (1..8) held one per byte in x (little-endian) as an 8w-bit stream:
 * byte pairs joined into 16-bit lanes, those into 32-bit lanes, then the two halves (shifts
 * and masks on one word, no loop over the codes). */
static inline uint64_t squeeze8(uint64_t x, int w) {
    x = (x & 0x00FF00FF00FF00FFULL) | (x & 0xFF00FF00FF00FF00ULL) >> (8 - w);
    x = (x & 0x0000FFFF0000FFFFULL) | (x & 0xFFFF0000FFFF0000ULL) >> (16 - 2 * w);
    return (x & 0xFFFFFFFFULL) | (x >> 32) << (4 * w);
}

/* The inverse of squeeze8: the 8 codes of the low 8w bits of x, one per byte. */
static inline uint64_t spread8(uint64_t x, int w) {
    uint64_t m4 = (1ULL << (4 * w)) - 1, m2 = ((1ULL << (2 * w)) - 1) * 0x0000000100000001ULL;
    uint64_t m1 = ((1ULL << w) - 1) * 0x0001000100010001ULL;
    x = (x & m4) | (x >> (4 * w) & m4) << 32;
    x = (x & m2) | (x >> (2 * w) & m2) << 16;
    return (x & m1) | (x >> w & m1) << 8;
}

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
/* Byte permutations of eight 64-bit words for width w (row w - 1 of each table):
 * STREAM_BYTES gathers the 8w stream bytes (byte j is byte j % w of word j / w; the rest
 * unused); WORD_BYTES spreads them back (byte i < w of word k is stream byte k * w + i; the
 * rest zeroed by the caller's mask). */
#define STREAM_AT(w, j) ((j) < 8 * (w) ? (j) / (w) * 8 + (j) % (w) : 0)
#define WORD_AT(w, j) ((j) % 8 < (w) ? (j) / 8 * (w) + (j) % 8 : 0)
#define ROW(P, w) \
    {P(w, 0), P(w, 1), P(w, 2), P(w, 3), P(w, 4), P(w, 5), P(w, 6), P(w, 7), \
    P(w, 8), P(w, 9), P(w, 10), P(w, 11), P(w, 12), P(w, 13), P(w, 14), P(w, 15), \
    P(w, 16), P(w, 17), P(w, 18), P(w, 19), P(w, 20), P(w, 21), P(w, 22), P(w, 23), \
    P(w, 24), P(w, 25), P(w, 26), P(w, 27), P(w, 28), P(w, 29), P(w, 30), P(w, 31), \
    P(w, 32), P(w, 33), P(w, 34), P(w, 35), P(w, 36), P(w, 37), P(w, 38), P(w, 39), \
    P(w, 40), P(w, 41), P(w, 42), P(w, 43), P(w, 44), P(w, 45), P(w, 46), P(w, 47), \
    P(w, 48), P(w, 49), P(w, 50), P(w, 51), P(w, 52), P(w, 53), P(w, 54), P(w, 55), \
    P(w, 56), P(w, 57), P(w, 58), P(w, 59), P(w, 60), P(w, 61), P(w, 62), P(w, 63)}
#define TABLE(P) {ROW(P, 1), ROW(P, 2), ROW(P, 3), ROW(P, 4), ROW(P, 5), ROW(P, 6), ROW(P, 7), ROW(P, 8)}
static const uint8_t STREAM_BYTES[8][64] = TABLE(STREAM_AT);
static const uint8_t WORD_BYTES[8][64] = TABLE(WORD_AT);
#undef TABLE
#undef ROW
#undef WORD_AT
#undef STREAM_AT
#endif

/* Codes q[0..len) (len <= CHUNK, a multiple of 8), one per byte, of width w (1..8) as a
 * little-endian bit stream into out (len / 8 * w bytes): each 8 codes squeezed into a word
 * (a loop that vectorizes), stored as its w low bytes (little-endian hosts: x86-64,
 * aarch64). With AVX-512 VBMI, eight words at a time: one byte permutation gathers their
 * 8w stream bytes, one masked store writes them (a scalar store a word was 13% of a 3-bit
 * encode); elsewhere an 8-byte store where 8 bytes of out remain (the next words overwrite
 * the rest). */
static inline void pack_bytes_w(const uint8_t *q, int64_t len, int w, uint8_t *out) {
    uint64_t words[CHUNK / 8];
    int64_t units = len / 8, b = 0;
    memcpy(words, q, (size_t)units * 8);
    for (int64_t k = 0; k < units; k++) words[k] = squeeze8(words[k], w);
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    __m512i index = _mm512_loadu_si512(STREAM_BYTES[w - 1]);
    for (; b + 8 <= units; b += 8) {
        __m512i v = _mm512_permutexvar_epi8(index, _mm512_loadu_si512(words + b));
        if ((units - b) * w >= 64) { /* a whole store: the next words overwrite the rest */
            _mm512_storeu_si512(out + b * w, v);
        } else { /* the stream's end (a masked store cost 120 cycles on an AMD EPYC) */
            uint8_t last[64];
            _mm512_storeu_si512(last, v);
            memcpy(out + b * w, last, (size_t)(8 * w));
        }
    }
#endif
    for (; b < units; b++) {
        if ((units - b) * w >= 8)
            memcpy(out + b * w, &words[b], 8);
        else
            memcpy(out + b * w, &words[b], (size_t)w);
    }
}

/* The low w bits set (w = 1..8). */
static inline uint64_t valid8(int w) { return (1ULL << w) - 1; }

/* The inverse of pack_bytes: the codes of the stream at src (avail bytes readable from it,
 * the rest read as 0), m of them rounded up to a multiple of 8 (m <= CHUNK), one per byte
 * into q; one 8-byte load per 8 codes where 8 bytes are readable. */
static inline void unpack_bytes_w(const uint8_t *src, int64_t m, int w, int64_t avail,
                                  uint8_t *q) {
    uint64_t words[CHUNK / 8];
    int64_t units = (m + 7) / 8;
    uint64_t valid = w == 8 ? ~0ULL : (1ULL << (8 * w)) - 1; /* the word's 8 codes */
    int64_t b = 0;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    /* eight words at a time where 64 stream bytes are readable: one load, one byte
     * permutation (the scalar loads were a third of a 3-bit decode) */
    __m512i index = _mm512_loadu_si512(WORD_BYTES[w - 1]);
    __mmask64 word_bytes = 0x0101010101010101ULL * (uint64_t)valid8(w);
    for (; b + 8 <= units && avail - b * w >= 64; b += 8)
        _mm512_storeu_si512(words + b, _mm512_maskz_permutexvar_epi8(
                                           word_bytes, index, _mm512_loadu_si512(src + b * w)));
#endif
    for (; b < units; b++) {
        int64_t left = avail - b * w;
        words[b] = 0;
        if (left >= 8)
            memcpy(&words[b], src + b * w, 8);
        else if (left > 0)
            memcpy(&words[b], src + b * w, (size_t)(left < w ? left : w));
    }
    for (int64_t b = 0; b < units; b++) words[b] = spread8(words[b] & valid, w);
    memcpy(q, words, (size_t)units * 8);
}

/* pack_bytes_w and unpack_bytes_w, one copy per width 1..8 (constant shifts and masks). */
#define CASE_W(W, CALL)                                                                   \
    case W:                                                                               \
        CALL;                                                                             \
        break;
static void pack_bytes(const uint8_t *q, int64_t len, int w, uint8_t *out) {
#define PACK_BYTES(W) CASE_W(W, pack_bytes_w(q, len, W, out))
    switch (w) { PACK_BYTES(1) PACK_BYTES(2) PACK_BYTES(3) PACK_BYTES(4) PACK_BYTES(5)
                 PACK_BYTES(6) PACK_BYTES(7) PACK_BYTES(8) default: break; }
#undef PACK_BYTES
}

static void unpack_bytes(const uint8_t *src, int64_t m, int w, int64_t avail, uint8_t *q) {
#define UNPACK_BYTES(W) CASE_W(W, unpack_bytes_w(src, m, W, avail, q))
    switch (w) { UNPACK_BYTES(1) UNPACK_BYTES(2) UNPACK_BYTES(3) UNPACK_BYTES(4)
                 UNPACK_BYTES(5) UNPACK_BYTES(6) UNPACK_BYTES(7) UNPACK_BYTES(8) default: break; }
#undef UNPACK_BYTES
}

/* The hashes of the element pairs p0 .. p0 + npairs - 1 (npairs <= CHUNK / 2) into w: pair p
 * draws lowbias32((p mod 2^32) ^ lowbias32((p >> 32) ^ key)), and its elements 2p and
 * 2p + 1 take the low and the high 16 bits as their noise (quant/reference.py's
 * hash_uniform): one hash for two elements. */
static inline void pair_hashes(uint64_t p0, int64_t npairs, uint32_t key, uint32_t *w) {
    if (p0 >> 32 == (p0 + (uint64_t)npairs - 1) >> 32) {
        /* a 32-bit counter: the pair indices need no 64-bit lanes (10% faster) */
        uint32_t kh = lowbias32((uint32_t)(p0 >> 32) ^ key), pl0 = (uint32_t)p0;
        for (uint32_t m = 0; m < (uint32_t)npairs; m++) w[m] = lowbias32((pl0 + m) ^ kh);
    } else {
        for (int64_t m = 0; m < npairs; m++) {
            uint64_t p = p0 + (uint64_t)m;
            w[m] = lowbias32((uint32_t)p ^ lowbias32((uint32_t)(p >> 32) ^ key));
        }
    }
}

/* Stochastic rounding and packing of one group of gs values, the group at element index
 * base (even: groups hold a multiple of 8): p[0..valid) its values, pad the value of the
 * elements past them (the tail group of the padded array) with its lo, inv (1 / step, 0
 * for a zero step), top and zk (zero-kept); see code_of (p's values and pad lie in the
 * group's range: the callers' l is the min of the very values they pass, pad the last of
 * them) and pair_hashes for the noise. A little-endian bit stream of bits-bit codes (1..8
 * bits): 8 codes fill bits bytes, code k at bit bits * k, written to out (the group's
 * gs * bits / 8 bytes). */
static inline void pack_span(const float *p, int64_t valid, float pad, int64_t base, int64_t gs,
                             int bits, float l, float iv, float tp, uint8_t z, uint32_t key,
                             uint8_t *gout) {
    uint8_t q[CHUNK];
    /* the pairs' hashes, read as 16-bit halves: element 2m's half is the low one on the
     * little-endian hosts this file assumes (x86-64, aarch64) */
    union {
        uint32_t w[CHUNK / 2];
        uint16_t half[CHUNK];
    } noise;
    for (int64_t c0 = 0; c0 < gs; c0 += CHUNK) {
        int64_t i0 = base + c0;
        int64_t len = gs - c0 < CHUNK ? gs - c0 : CHUNK;
        int64_t real = valid - c0 < len ? (valid - c0 > 0 ? valid - c0 : 0) : len;
        const float *pc = p + c0;
        pair_hashes((uint64_t)i0 >> 1, len / 2, key, noise.w);
        const uint16_t *u16 = noise.half;
        if (z) /* a constant zk in each loop: the other has no zero test */
            for (int64_t j = 0; j < real; j++)
                q[j] = code_of(pc[j], (float)u16[j] * NOISE_UNIT, l, iv, tp, 1);
        else
            for (int64_t j = 0; j < real; j++)
                q[j] = code_of(pc[j], (float)u16[j] * NOISE_UNIT, l, iv, tp, 0);
        for (int64_t j = real; j < len; j++)
            q[j] = code_of(pad, (float)u16[j] * NOISE_UNIT, l, iv, tp, z);
        uint8_t *out = gout + c0 * bits / 8;
        if (bits == 8) {
            memcpy(out, q, len);
        } else if (bits == 4) {
            for (int64_t b = 0; b < len / 2; b++) out[b] = q[2 * b] | (q[2 * b + 1] << 4);
        } else if (bits == 2) {
            for (int64_t b = 0; b < len / 4; b++)
                out[b] = q[4 * b] | (q[4 * b + 1] << 2) | (q[4 * b + 2] << 4) |
                         (q[4 * b + 3] << 6);
        } else if (bits == 1) {
            for (int64_t b = 0; b < len / 8; b++) {
                uint8_t byte = 0;
                for (int k = 0; k < 8; k++) byte |= (uint8_t)(q[8 * b + k] << k);
                out[b] = byte;
            }
        } else { /* 3, 5, 6, 7 bits: 8 codes -> one word -> its bits low bytes */
            pack_bytes(q, len, bits, out);
        }
    }
}

/* The noise of elements base .. base + n - 1 (base and n even) into out, as pack_span draws
 * it: the tests check the hash of pair indices past 2^32 with it, which no tensor that fits
 * in memory reaches. */
void acgc_quant_noise(uint64_t base, int64_t n, uint32_t key, float *out) {
    union {
        uint32_t w[CHUNK / 2];
        uint16_t half[CHUNK];
    } noise;
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        int64_t len = n - c0 < CHUNK ? n - c0 : CHUNK;
        pair_hashes((base + (uint64_t)c0) >> 1, len / 2, key, noise.w);
        for (int64_t j = 0; j < len; j++) out[c0 + j] = (float)noise.half[j] * NOISE_UNIT;
    }
}

/* pack_span of group g of the padded G * gs array (element i >= n has value x[n-1]). */
static inline void pack_group(const float *x, int64_t n, int64_t gs, int bits, int64_t g,
                              float l, float iv, float tp, uint8_t z, uint32_t key,
                              uint8_t *codes) {
    int64_t i0 = g * gs, valid = n - i0 < gs ? n - i0 : gs;
    pack_span(x + i0, valid, x[n - 1], i0, gs, bits, l, iv, tp, z, key,
              codes + g * (gs * bits / 8));
}

/* Groups a block of the encode handles together: their statistics, then their parameters
 * (16 independent chains of divisions and roundings the core overlaps: one group after the
 * other, each chain waited between two packs, 20% of the encode), then their packs; 16
 * groups of 256 values are 16 KB, still in L1 for the pack. */
#define BLOCK_GROUPS 16

/* The whole encode in one pass over each group (its values read once from memory, then
 * from cache): stats_of, group_param (bf16 or float32 metadata), pack_group, a block of
 * BLOCK_GROUPS groups at a time. Returns 0 when every group is encoded; 1 when bf16 was
 * asked and some group cannot hold it (the caller encodes again with float32 metadata, for
 * every group, as group_meta does); 2 on NaN/inf or a range or inverse beyond float32 (the
 * reference's paths). */
int acgc_quant_encode(const float *x, int64_t n, int64_t gs, int bits, int bf16, uint32_t key,
                      float *out_lo, float *out_scale, uint8_t *codes, int nthreads) {
    int64_t groups = (n + gs - 1) / gs;
    int64_t blocks = (groups + BLOCK_GROUPS - 1) / BLOCK_GROUPS;
    int status = 0;
#pragma omp parallel for schedule(static) num_threads(THREADS(n)) reduction(| : status)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t g0 = b * BLOCK_GROUPS;
        int m = groups - g0 < BLOCK_GROUPS ? (int)(groups - g0) : BLOCK_GROUPS;
        float lo[BLOCK_GROUPS], hi[BLOCK_GROUPS], mp[BLOCK_GROUPS];
        float iv[BLOCK_GROUPS], tp[BLOCK_GROUPS];
        uint8_t z[BLOCK_GROUPS];
        int bad = 0, ok = 1;
        for (int k = 0; k < m; k++) {
            int64_t g = g0 + k, len = (g + 1) * gs <= n ? gs : n - g * gs;
            bad |= stats_of(x + g * gs, len, &lo[k], &hi[k], &mp[k]);
        }
        if (bad) {
            status |= 2;
            continue;
        }
        for (int k = 0; k < m; k++)
            ok &= group_param(lo[k], hi[k], mp[k], bits, bf16, out_lo + g0 + k,
                              out_scale + g0 + k, &iv[k], &tp[k], &z[k]);
        if (!ok) {
            status |= bf16 ? 1 : 2;
            continue;
        }
        for (int k = 0; k < m; k++)
            pack_group(x, n, gs, bits, g0 + k, out_lo[g0 + k], iv[k], tp[k], z[k], key, codes);
    }
    return status & 2 ? 2 : status;
}

/* The inverse of pack8 (below): the 8 codes of width w (9..16) held by the w bytes at src
 * into q[0..7], from two 64-bit loads where 16 bytes are readable (avail: the bytes
 * readable from src; fewer than w at the end of a stream, the rest read as 0). */
static inline void unpack8(const uint8_t *src, int w, int64_t avail, uint32_t *q) {
    uint64_t low, high;
    if (avail >= 16) {
        memcpy(&low, src, 8); /* little-endian hosts (x86-64, aarch64) */
        memcpy(&high, src + 8, 8);
    } else {
        uint8_t buf[16] = {0};
        memcpy(buf, src, (size_t)(avail < w ? avail : w));
        memcpy(&low, buf, 8);
        memcpy(&high, buf + 8, 8);
    }
    uint32_t mask = (1u << w) - 1u;
    for (int k = 0; k < 8; k++) {
        int sh = k * w;
        uint64_t v = sh < 64 ? low >> sh : high >> (sh - 64);
        if (sh < 64 && sh + w > 64) v |= high << (64 - sh);
        q[k] = (uint32_t)v & mask;
    }
}

/* Decode one group: its len values (len <= gs) from the group's codes at src into dst;
 * code c is fmaf(c, step, lo) (zero-kept: code 0 is +0.0, code c >= 1 is
 * fmaf(c - 1, step, lo)), as the reference's addcmul. */
static inline void unpack_group(const uint8_t *src, int64_t len, int64_t gs, int bits, float l,
                                float st, int z, float *dst) {
    int per = 8 % bits ? 0 : 8 / bits; /* codes per byte; 0: a width that spans bytes */
    int mask = (1 << bits) - 1;
    float zf = (float)z;
    float c[CHUNK];
    for (int64_t c0 = 0; c0 < len; c0 += CHUNK) {
        int64_t m = len - c0 < CHUNK ? len - c0 : CHUNK;
        const uint8_t *s = src + c0 * bits / 8;
        if (bits == 8) { /* constant widths: loops the compiler vectorizes */
            for (int64_t j = 0; j < m; j++) c[j] = (float)s[j];
        } else if (bits == 4) {
            for (int64_t b = 0; b < (m + 1) / 2; b++) {
                uint32_t v = s[b];
                c[2 * b] = (float)(v & 15u);
                c[2 * b + 1] = (float)(v >> 4);
            }
        } else if (bits == 2) {
            for (int64_t b = 0; b < (m + 3) / 4; b++) {
                uint32_t v = s[b];
                c[4 * b] = (float)(v & 3u);
                c[4 * b + 1] = (float)((v >> 2) & 3u);
                c[4 * b + 2] = (float)((v >> 4) & 3u);
                c[4 * b + 3] = (float)(v >> 6);
            }
        } else if (per) {
            int64_t mb = (m + per - 1) / per;
            for (int64_t b = 0; b < mb; b++)
                for (int k = 0; k < per; k++)
                    c[b * per + k] = (float)((s[b] >> (bits * k)) & mask);
        } else { /* whole 8-code words of bits bytes (groups are multiples of 8) */
            uint8_t qb[CHUNK];
            unpack_bytes(s, m, bits, gs * bits / 8 - c0 * bits / 8, qb);
            for (int64_t j = 0; j < m; j++) c[j] = (float)qb[j];
        }
        if (z) { /* as the reference: v * min(c, 1) + 0, branch-free (vectorized) */
            for (int64_t j = 0; j < m; j++) {
                float keep = c[j] < 1.0f ? c[j] : 1.0f;
                dst[c0 + j] = fmaf(c[j] - zf, st, l) * keep + 0.0f;
            }
        } else {
            for (int64_t j = 0; j < m; j++) dst[c0 + j] = fmaf(c[j], st, l);
        }
    }
}

/* A stored metadata value (float32, or bfloat16 bits when bf16) as float32. */
static inline float meta_value(const void *p, int64_t g, int bf16) {
    if (bf16) return f32_of((uint32_t)((const uint16_t *)p)[g] << 16);
    return ((const float *)p)[g];
}

/* Whether some group's lo + levels * |scale| overflows float32 (decode_params then
 * switches the whole tensor to float64, which the callers leave to the reference). */
static int meta_wide(const void *lo, const void *scale, int bf16, int64_t groups, int bits) {
    float levels = (float)((1 << bits) - 1);
    int wide = 0;
    for (int64_t g = 0; g < groups; g++) { /* G values: one thread, no team to wake */
        float top = meta_value(lo, g, bf16) + levels * fabsf(meta_value(scale, g, bf16));
        wide |= !(fabsf(top) <= 3.4028234663852886e38f);
    }
    return wide;
}

/* Decode n values (unpack_group of every group) from the payload's lo and signed scale
 * (float32, or bfloat16 with bf16 set) as quant/reference.py's decode_params reads them:
 * step |scale|, zero-kept where scale's sign is set. Returns 1, writing nothing, where
 * some group's lo + levels * step overflows float32 (the reference then decodes in
 * float64), else 0. */
int acgc_quant_unpack(const uint8_t *codes, int64_t n, int64_t gs, int bits, const void *lo,
                      const void *scale, int bf16, float *out, int nthreads) {
    int64_t groups = (n + gs - 1) / gs;
    if (meta_wide(lo, scale, bf16, groups, bits)) return 1;
#pragma omp parallel for schedule(static) num_threads(THREADS(n))
    for (int64_t g = 0; g < groups; g++) {
        int64_t len = (g + 1) * gs <= n ? gs : n - g * gs;
        float sc = meta_value(scale, g, bf16);
        unpack_group(codes + g * (gs * bits / 8), len, gs, bits, meta_value(lo, g, bf16),
                     fabsf(sc), signbit(sc) ? 1 : 0, out + g * gs);
    }
    return 0;
}

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

/* ---- bounded (error-bounded) codec; see kernels/bounded/reference.py for the format ---- */

/* ---- bounded: group statistics and the per-group plan (bounded/plan.py) ---- */

/* Per group of gs values (the tail short): min, max and smallest positive value (stats_of),
 * and has_zero[g] whether it holds an exact 0, scanned (in cache) only for groups with both
 * signs, the only ones whose plan reads it (0 elsewhere); range[0..1] the least min and the
 * greatest max (a relative bound's range). Returns 1 on NaN/inf, else 2 if some group
 * holds only zeros (whose signs the caller takes from torch), else 0. */
int acgc_bounded_stats(const float *x, int64_t n, int64_t gs, float *lo, float *hi,
                       float *min_pos, uint8_t *has_zero, float *range, int nthreads) {
    int64_t groups = (n + gs - 1) / gs;
    int bad = 0, zeros = 0;
    float least = INFINITY, greatest = -INFINITY;
#pragma omp parallel for schedule(static) num_threads(THREADS(n)) reduction(| : bad, zeros) \
    reduction(min : least) reduction(max : greatest)
    for (int64_t g = 0; g < groups; g++) {
        const float *p = x + g * gs;
        int64_t len = (g + 1) * gs <= n ? gs : n - g * gs;
        bad |= stats_of(p, len, lo + g, hi + g, min_pos + g);
        zeros |= lo[g] == 0.0f && hi[g] == 0.0f;
        least = lo[g] < least ? lo[g] : least;
        greatest = hi[g] > greatest ? hi[g] : greatest;
        int z = 0;
        if (lo[g] < 0.0f && hi[g] > 0.0f)
            for (int64_t i = 0; i < len; i++) z |= p[i] == 0.0f;
        has_zero[g] = (uint8_t)z;
    }
    range[0] = least;
    range[1] = greatest;
    return bad ? 1 : zeros ? 2 : 0;
}

/* The byte offset of each group's codes (off[g]: the coded widths of the groups before g,
 * times gs / 8; raw groups, width 255, take none); returns the bytes of all codes. */
int64_t acgc_bounded_offsets(const uint8_t *width, int64_t groups, int64_t gs, int64_t *off) {
    int64_t total = 0;
    for (int64_t g = 0; g < groups; g++) {
        off[g] = total;
        total += width[g] == 255 ? 0 : width[g] * (gs / 8);
    }
    return total;
}

/* plan.py's _ulp: the spacing of a format with mant mantissa bits and smallest normal
 * exponent emin in the binade of mag (float64, >= 0). */
static inline double ulp_of(double mag, int mant, int emin) {
    uint64_t b;
    memcpy(&b, &mag, 8);
    b &= 0x7FF0000000000000ULL; /* 2^floor(log2 mag), exactly */
    double pow2;
    memcpy(&pow2, &b, 8);
    double r = pow2 * ldexp(1.0, -mant), least = ldexp(1.0, emin - mant);
    return r < least ? least : r;
}

/* plan.py's f32_down: (float)v, one step toward 0 where that rounded above v. */
static inline float f32_down(double v) {
    float f = (float)v;
    return (double)f > v ? nextafterf(f, 0.0f) : f;
}

/* group_plan of plan.py for G groups of gs values (the same float32 and float64 operations
 * in the same order): from each group's lo, hi, smallest positive value and has_zero and
 * the absolute bound eb, the payload's width (255: raw), lo and signed step. kind: the
 * input dtype (0 float32, 1 float16, 2 bfloat16); slack, max_step, grid_max_k: plan.py's
 * constants. Returns 1 if some group is coded, plus 2 if some group is raw. */
int acgc_bounded_plan(const float *lo, const float *hi, const float *min_pos,
                      const uint8_t *has_zero, int64_t groups, double eb, int kind, double slack,
                      double max_step, double grid_max_k, uint8_t *width, float *lo_p,
                      float *step_p, int nthreads) {
    int mant = kind == 1 ? 10 : 7, emin = kind == 1 ? -14 : -126;
    double dmax = kind == 1 ? 65504.0 : 3.3895313892515355e38;
    float top_code = kind == 0 ? 65535.0f : 32767.0f;
    int coded_any = 0, raw_any = 0;
#pragma omp parallel for schedule(static) num_threads(THREADS(groups * 8)) \
    reduction(| : coded_any, raw_any)
    for (int64_t g = 0; g < groups; g++) {
        float l = lo[g], h = hi[g];
        int cst = l == h;
        int zlo = l == 0.0f && !cst;
        int zk = zlo || (h == 0.0f && !cst) || (l < 0.0f && h > 0.0f && has_zero[g]);
        float base = zlo ? min_pos[g] : l;
        double al = fabs((double)l), ah = fabs((double)h);
        double mag = (al > ah ? al : ah) + eb;
        double err = 3.0 * ulp_of(mag, 23, -126);
        if (kind != 0) err = err + 0.5 * ulp_of(mag, mant, emin);
        double t = 2.0 * (eb - err) * slack;
        float step = f32_down(t > max_step ? max_step : t);
        if (kind != 0) {
            double u = ulp_of(mag, mant, emin);
            double k = floor(2.0 * eb * slack / u);
            double grid_base = floor((double)base / u) * u;
            if (!cst && k >= 1.0 && k <= grid_max_k && (grid_base > 0.0 || l < 0.0f) &&
                mag <= dmax) {
                step = (float)(k * u);
                base = (float)grid_base;
            }
        }
        float top = nearbyintf((h - base) / step) + (float)zk;
        int coded = !cst && step > 0.0f && top <= top_code;
        int raw = !cst && !coded;
        int e = 0;
        frexpf(coded ? top : 0.0f, &e);
        width[g] = raw ? 255 : (uint8_t)e;
        lo_p[g] = raw ? 0.0f : base;
        step_p[g] = coded ? (zk ? -step : step) : 0.0f;
        coded_any |= coded;
        raw_any |= raw;
    }
    return coded_any | raw_any << 1;
}

#ifdef __FLT16_MAX__
int acgc_has_f16(void) { return 1; }
#define ROUND_F16(v) ((float)(_Float16)(v))
#else
int acgc_has_f16(void) { return 0; }
#define ROUND_F16(v) (v)
#endif

/* float32 -> bfloat16 bits, round to nearest even (finite inputs). */
static inline uint16_t bf16_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* v rounded to the output kind (0 fp32, 1 fp16, 2 bf16), back in float32. */
static inline float round_kind(float v, int kind) {
    if (kind == 1) return ROUND_F16(v);
    if (kind == 2) {
        uint32_t u = (uint32_t)bf16_bits(v) << 16;
        float r;
        memcpy(&r, &u, 4);
        return r;
    }
    return v;
}

/* The format's decode of code q (float32) in a group (lo, s = |step|, zk), before the cast:
 * fl32(fl32(q' * s) + lo) clamped to +-top; zero-kept code 0 is +0.0. */
static inline float bounded_value(float q, float lo, float s, int zk, float top) {
    float v = (q - (float)zk) * s;
    v = v + lo;
    v = v < -top ? -top : v;
    v = v > top ? top : v;
    return (zk & (q == 0.0f)) ? 0.0f : v; /* a select, not a branch: loops vectorize */
}


/* 8 codes of width w (9..16) as a little-endian bit stream into the w bytes at dst, built
 * in two 64-bit registers (constant shifts for a constant w; GCC's 128-bit shifts spill to
 * the stack) and written with 8-byte stores; room: 16 bytes from dst are writable (the
 * next codes' bytes past the w, which their own stores then overwrite). */
static inline void pack8(const uint32_t *q, int w, uint8_t *dst, int room) {
    uint64_t low = 0, high = 0;
    for (int k = 0; k < 8; k++) {
        int sh = k * w;
        if (sh < 64) low |= (uint64_t)q[k] << sh;
        if (sh + w > 64) high |= sh < 64 ? (uint64_t)q[k] >> (64 - sh) : (uint64_t)q[k] << (sh - 64);
    }
    memcpy(dst, &low, 8); /* little-endian hosts (x86-64, aarch64) */
    if (room) {
        memcpy(dst + 8, &high, 8);
    } else {
        for (int j = 0; j < w - 8; j++) dst[8 + j] = (uint8_t)(high >> (8 * j));
    }
}

/* Codes q[0..m) (m <= CHUNK, a multiple of 8) of width w (1..16) as a little-endian bit
 * stream into dst (m / 8 * w bytes): through pack_bytes up to 8 bits, else one loop per
 * width, so that the shifts are constants. */
static void pack_codes(const uint32_t *q, int64_t m, int w, uint8_t *dst) {
    if (w <= 8) { /* one byte per code, squeezed 8 at a time (pack_bytes) */
        uint8_t qb[CHUNK];
        for (int64_t j = 0; j < m; j++) qb[j] = (uint8_t)q[j];
        pack_bytes(qb, m, w, dst);
        return;
    }
#define PACK_W(W)                                                                       \
    case W:                                                                             \
        for (int64_t j = 0; j < m; j += 8)                                              \
            pack8(q + j, (W), dst + j / 8 * (W), (m - j) / 8 * (W) >= 16);              \
        break;
    switch (w) {
        PACK_W(9) PACK_W(10) PACK_W(11) PACK_W(12) PACK_W(13) PACK_W(14) PACK_W(15) PACK_W(16)
        default: break;
    }
#undef PACK_W
}

/* The inverse of pack_codes: the codes of the bytes at src (avail of them readable) into
 * q[0..m) (m <= CHUNK, rounded up to a multiple of 8). */
static void unpack_codes(const uint8_t *src, int64_t m, int w, int64_t avail, uint32_t *q) {
    if (w <= 8) { /* one byte per code (unpack_bytes), then widened */
        uint8_t qb[CHUNK];
        unpack_bytes(src, m, w, avail, qb);
        for (int64_t j = 0; j < m; j++) q[j] = qb[j];
        return;
    }
#define UNPACK_W(W)                                                                     \
    case W:                                                                             \
        for (int64_t j = 0; j < m; j += 8)                                              \
            unpack8(src + j / 8 * (W), (W), avail - j / 8 * (W), q + j);                \
        break;
    switch (w) {
        UNPACK_W(9) UNPACK_W(10) UNPACK_W(11) UNPACK_W(12) UNPACK_W(13) UNPACK_W(14)
        UNPACK_W(15) UNPACK_W(16)
        default: break;
    }
#undef UNPACK_W
}

/* The code of v in a group (lo l, |step| s, div = s or 1 for a zero step, zk): round((v -
 * l) / div), half to even, +1 where zero-kept, 0 at a zero-kept 0. */
static inline float bounded_code(float v, float l, float div, int zk) {
    float r = rintf((v - l) / div) + (float)zk;
    return (zk & (v == 0.0f)) ? 0.0f : r;
}

/* The codes of xs[0..m) into q (as float); with check, the count among xs[0..valid) of
 * decoded values (cast to kind) not within eb32 of x, in the same loop (a second loop over
 * q cost 40% of the pack). Only float stores here (the bytes for the packing follow in a
 * loop of their own). */
static inline __attribute__((always_inline)) int32_t
bounded_codes(const float *xs, int64_t m, int64_t valid, float l, float div, float s, int zk,
              float top, float eb32, int check, int kind, float *q) {
    int32_t cnt = 0;
    for (int64_t j = 0; j < valid; j++) {
        float v = xs[j], c = bounded_code(v, l, div, zk);
        q[j] = c;
        if (check) cnt += !(fabsf(round_kind(bounded_value(c, l, s, zk, top), kind) - v) < eb32);
    }
    for (int64_t j = valid; j < m; j++) /* the tail group's padding: coded, not checked */
        q[j] = bounded_code(xs[j], l, div, zk);
    return cnt;
}

/* Encode: per group g of kind width[g] (0 constant, 1..16 coded, 255 raw) with lo/step from
 * the plan, the codes round((x - lo) / |step|) (half to even; +1 in zero-kept groups, 0 at
 * zeros) packed from byte off[g] as a little-endian bit stream; then, if check, each
 * element's decoded value (cast to kind) compared with x: |x̂ - x| < eb32 or it violates,
 * eb32 the largest float32 <= eb. Returns the number of violators among the first n
 * elements; flags (if not NULL) gets 1 at each. The tail group is padded with x[n - 1]. */
int64_t acgc_bounded_pack(const float *x, int64_t n, int64_t gs, const uint8_t *width,
                          const float *lo, const float *step, const int64_t *off, double eb,
                          float top, int kind, int check, uint8_t *codes, uint8_t *flags,
                          int nthreads) {
    int64_t groups = (n + gs - 1) / gs, violators = 0;
    float eb32 = f32_down(eb);
#pragma omp parallel for schedule(static) num_threads(THREADS(n)) reduction(+ : violators)
    for (int64_t g = 0; g < groups; g++) {
        int w = width[g];
        int64_t base = g * gs;
        int64_t len = base + gs <= n ? gs : n - base;
        int32_t bad = 0;
        if (w == 255) { /* raw: decodes exactly; only a zero bound fails the check */
            if (check && !(0.0f < eb32)) {
                bad = (int32_t)len;
                if (flags) memset(flags + base, 1, (size_t)len);
            }
            violators += bad;
            continue;
        }
        float l = lo[g], st = step[g];
        int zk = signbit(st) ? 1 : 0;
        float s = fabsf(st);
        float div = s > 0.0f ? s : 1.0f; /* coded groups (width 0 too): |step| */
        uint8_t *out = codes + off[g];
        float q[CHUNK], xv[CHUNK];
        for (int64_t c0 = 0; c0 < gs; c0 += CHUNK) {
            int64_t m = gs - c0 < CHUNK ? gs - c0 : CHUNK;
            int64_t valid = len - c0 < m ? (len - c0 > 0 ? len - c0 : 0) : m;
            const float *xs = x + base + c0;
            if (valid < m) { /* the tail group: padded with x[n - 1] */
                for (int64_t j = 0; j < m; j++) xv[j] = j < valid ? xs[j] : x[n - 1];
                xs = xv;
            }
            /* constant check, kind and zk in each copy of the loop (with zk a variable,
             * GCC formed a select of booleans it cannot vectorize: 14x slower) */
            int32_t cnt;
#define CODES(CHECK, KIND)                                                                \
    (zk ? bounded_codes(xs, m, valid, l, div, s, 1, top, eb32, CHECK, KIND, q)             \
        : bounded_codes(xs, m, valid, l, div, s, 0, top, eb32, CHECK, KIND, q))
            if (!check)
                cnt = CODES(0, 0);
            else if (kind == 0)
                cnt = CODES(1, 0);
            else if (kind == 1)
                cnt = CODES(1, 1);
            else
                cnt = CODES(1, 2);
#undef CODES
            if (w > 0 && w <= 8) { /* m is a multiple of 8: each chunk starts on a byte */
                uint8_t qb[CHUNK];
                for (int64_t j = 0; j < m; j++) qb[j] = (uint8_t)q[j];
                pack_bytes(qb, m, w, out + c0 / 8 * w);
            } else if (w > 8) {
                uint32_t qi[CHUNK];
                for (int64_t j = 0; j < m; j++) qi[j] = (uint32_t)q[j];
                pack_codes(qi, m, w, out + c0 / 8 * w);
            }
            if (check) {
                bad += cnt;
                if (cnt && flags) {
                    for (int64_t j = 0; j < valid; j++) {
                        float d = round_kind(bounded_value(q[j], l, s, zk, top), kind);
                        if (!(fabsf(d - xs[j]) < eb32)) flags[base + c0 + j] = 1;
                    }
                }
            }
        }
        violators += bad;
    }
    return violators;
}

/* Decode the coded and constant groups into out (G * gs values of kind: float32 or 16-bit
 * bits); raw groups are left for the caller. */
void acgc_bounded_unpack(const uint8_t *codes, int64_t groups, int64_t gs, const uint8_t *width,
                         const float *lo, const float *step, const int64_t *off, float top,
                         int kind, void *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(THREADS(groups * gs))
    for (int64_t g = 0; g < groups; g++) {
        int w = width[g];
        if (w == 255) continue;
        float l = lo[g], st = step[g];
        int zk = signbit(st) ? 1 : 0;
        float s = fabsf(st);
        const uint8_t *src = codes + off[g];
        float v[CHUNK];
        for (int64_t c0 = 0; c0 < gs; c0 += CHUNK) {
            int64_t m = gs - c0 < CHUNK ? gs - c0 : CHUNK;
            if (w == 0) {
                for (int64_t j = 0; j < m; j++) v[j] = 0.0f;
            } else if (w == 8) {
                for (int64_t j = 0; j < m; j++) v[j] = (float)src[c0 + j];
            } else {
                uint32_t qi[CHUNK];
                int64_t at = c0 / 8 * w; /* the chunk's bytes in the group's gs / 8 * w */
                unpack_codes(src + at, m, w, gs / 8 * w - at, qi);
                for (int64_t j = 0; j < m; j++) v[j] = (float)qi[j];
            }
            for (int64_t j = 0; j < m; j++) v[j] = bounded_value(v[j], l, s, zk, top);
            if (kind == 0) {
                memcpy((float *)out + g * gs + c0, v, (size_t)m * 4);
            } else if (kind == 2) {
                uint16_t *o = (uint16_t *)out + g * gs + c0;
                for (int64_t j = 0; j < m; j++) o[j] = bf16_bits(v[j]);
            } else {
#ifdef __FLT16_MAX__
                _Float16 *o = (_Float16 *)out + g * gs + c0;
                for (int64_t j = 0; j < m; j++) o[j] = (_Float16)v[j];
#endif
            }
        }
    }
}

/* ---- division: pooling along the last axis, the zero pattern, the decode's last steps ---- */

/* Averages of blk consecutive values along the last axis of a (rows, w) float32 array into
 * (rows, ceil(w / blk)): each tile summed in order (0 + x0 + x1 + ...) and divided by its
 * element count, as the reference's _pool_axis. */
void acgc_pool_last(const float *x, int64_t rows, int64_t w, int64_t blk, float *out,
                    int nthreads) {
    int64_t wo = (w + blk - 1) / blk;
#pragma omp parallel for schedule(static) num_threads(THREADS(rows * w))
    for (int64_t r = 0; r < rows; r++) {
        const float *p = x + r * w;
        float *o = out + r * wo;
        for (int64_t j = 0; j < wo; j++) {
            int64_t cnt = (j + 1) * blk <= w ? blk : w - j * blk;
            float s = 0.0f;
            for (int64_t k = 0; k < cnt; k++) s = s + p[j * blk + k];
            o[j] = s / (float)cnt;
        }
    }
}

/* The zero bits of p[0..len) (len <= CHUNK) into out[0..ceil(len / 8)), mask layout: bit k
 * of byte b is p[8b + k] == 0, tail bits 0. 8 flag bytes (0/1) become one byte by a
 * multiply that gathers bit 8k into bit 56 + k. */
static inline void zero_bits(const float *p, int64_t len, uint8_t *out) {
#if defined(__AVX512F__)
    for (int64_t i = 0; i < len; i += 16) { /* a compare's 16-bit mask is two such bytes */
        __mmask16 m = len - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - i)) - 1);
        uint16_t z = m & _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(m, p + i),
                                            _mm512_setzero_ps(), _CMP_EQ_OQ);
        out[i / 8] = (uint8_t)z;
        if (len - i > 8) out[i / 8 + 1] = (uint8_t)(z >> 8);
    }
#else
    uint8_t z[CHUNK + 8];
    for (int64_t i = 0; i < len; i++) z[i] = p[i] == 0.0f;
    for (int64_t i = len; i < len + 8; i++) z[i] = 0;
    for (int64_t b = 0; b < (len + 7) / 8; b++) {
        uint64_t w;
        memcpy(&w, z + 8 * b, 8); /* little-endian hosts (x86-64, aarch64) */
        out[b] = (uint8_t)((w * 0x0102040810204080ULL) >> 56);
    }
#endif
}

/* Bit i % 8 of byte i / 8 of packed is x[i] == 0 (mask layout; tail bits 0), and *min_pos
 * the smallest positive value (inf if none) of finite x. Parallel over chunks. */
void acgc_zero_pattern(const float *x, int64_t n, uint8_t *packed, float *min_pos,
                       int nthreads) {
    int64_t chunks = (n + CHUNK - 1) / CHUNK; /* CHUNK is a multiple of 8: chunks own whole bytes */
    float best = INFINITY;
#pragma omp parallel for schedule(static) num_threads(THREADS(n)) reduction(min : best)
    for (int64_t c = 0; c < chunks; c++) {
        const float *p = x + c * CHUNK;
        int64_t len = n - c * CHUNK < CHUNK ? n - c * CHUNK : CHUNK;
        float lo, hi, mp;
        stats_of(p, len, &lo, &hi, &mp);
        best = mp < best ? mp : best;
        zero_bits(p, len, packed + c * (CHUNK / 8));
    }
    *min_pos = best;
}

/* In place over o[0..len) (len <= CHUNK): clamp to [-fmax, fmax]; with a zero mask zm (its
 * bit k of byte b for o[8b + k]), max(o, min_pos) and +0.0 where the bit is set. */
static inline void finish_chunk(float *o, int64_t len, float fmax, const uint8_t *zm,
                                float min_pos) {
#if defined(__AVX512F__)
    /* the selects below, one compare each, in their operand order (NaN kept by the
     * clamp, replaced by min_pos), and the mask's bits as a write mask (+0.0 where set) */
    __m512 lo = _mm512_set1_ps(-fmax), hi = _mm512_set1_ps(fmax), mp = _mm512_set1_ps(min_pos);
    for (int64_t i = 0; i < len; i += 16) {
        __mmask16 m = len - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(m, o + i);
        v = _mm512_max_ps(lo, v);
        v = _mm512_min_ps(hi, v);
        v = _mm512_max_ps(v, mp);
        if (zm) {
            uint16_t z = zm[i / 8];
            if (len - i > 8) z |= (uint16_t)(zm[i / 8 + 1] << 8);
            v = _mm512_maskz_mov_ps((__mmask16)~z, v);
        }
        _mm512_mask_storeu_ps(o + i, m, v);
    }
#else
    if (!zm) { /* min_pos: -inf, or the positive tensor's minimum */
        for (int64_t i = 0; i < len; i++) {
            float v = o[i];
            v = v < -fmax ? -fmax : v;
            v = v > fmax ? fmax : v;
            o[i] = v > min_pos ? v : min_pos;
        }
        return;
    }
    /* the mask's bits as all-ones (keep) or all-zeros (+0.0) words: plain loops that
     * vectorize, where a bit test per element stays scalar */
    uint32_t keep[CHUNK];
    for (int64_t b = 0; b < (len + 7) / 8; b++)
        for (int k = 0; k < 8; k++) keep[8 * b + k] = ((uint32_t)(zm[b] >> k) & 1u) - 1u;
    for (int64_t i = 0; i < len; i++) {
        float v = o[i];
        v = v < -fmax ? -fmax : v;
        v = v > fmax ? fmax : v;
        v = v > min_pos ? v : min_pos;
        uint32_t u;
        memcpy(&u, &v, 4);
        u &= keep[i];
        memcpy(&o[i], &u, 4);
    }
#endif
}

/* In place: out = max(clamp(out, -fmax, fmax), min_pos) (-inf: no floor) and, with a zero
 * mask, +0.0 where the mask's bit is set. */
void acgc_division_finish(float *out, int64_t n, float fmax, const uint8_t *zmask,
                          float min_pos, int nthreads) {
    int64_t chunks = (n + CHUNK - 1) / CHUNK; /* CHUNK is a multiple of 8 */
#pragma omp parallel for schedule(static) num_threads(THREADS(n))
    for (int64_t c = 0; c < chunks; c++) {
        int64_t len = n - c * CHUNK < CHUNK ? n - c * CHUNK : CHUNK;
        finish_chunk(out + c * CHUNK, len, fmax, zmask ? zmask + c * (CHUNK / 8) : 0, min_pos);
    }
}

/* ---- division, fused: a float32 tensor viewed as (planes, h, w), pooled over h (ph set)
 * and/or w (pw set); 4-D NCHW is (N * C, H, W) with both, 3-D (N, L, D) pools L only,
 * 2-D and 1-D the last axis only. Two passes instead of the reference's steps: the block
 * averages; then per quant group the residual in a buffer, quantized and packed, with
 * the group's zero bits and statistics of x. The same bits as the reference. ---- */

#define LOW_TILES 256 /* output columns per work item of acgc_division_low */
#define LOW_BAND 2048 /* tile averages of one tile row computed in one call */

/* torch's float32 -> bfloat16 conversion (round to nearest even) of a finite value, back
 * as float32. */
static inline float bf16_round(float v) {
    uint32_t b = bits_of(v);
    return f32_of((b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u);
}

/* The averages of tiles t0..t1 of blk values along a row p of w values (the last tile
 * short) into out[0..t1 - t0): each summed in order from 0 and divided by its count. */
static inline void tile_means(const float *p, int64_t t0, int64_t t1, int64_t w, int64_t blk,
                              float *out) {
    int64_t t = t0;
    if (blk == 8) { /* the default block: a constant count, so that the loop vectorizes */
        int64_t whole = w / 8 < t1 ? w / 8 : t1;
        for (; t < whole; t++) {
            float s = 0.0f;
            for (int k = 0; k < 8; k++) s = s + p[8 * t + k];
            out[t - t0] = s / 8.0f;
        }
    }
    for (; t < t1; t++) {
        int64_t cnt = (t + 1) * blk <= w ? blk : w - t * blk;
        float s = 0.0f;
        for (int64_t k = 0; k < cnt; k++) s = s + p[t * blk + k];
        out[t - t0] = s / (float)cnt;
    }
}

/* o[0..len) divided by rows (the rows summed into them, 1: none), rounded to bfloat16
 * values if bf16, those also as bfloat16 into o16 unless it is NULL (their high halves:
 * the payload's averages, with no pass of torch's over them); returns 1 if some result is
 * not finite or subnormal (conversions that flush them would differ), else 0. */
static inline int finish_means(float *o, int64_t len, int64_t rows, int bf16, uint16_t *o16) {
    int status = 0;
    for (int64_t t = 0; t < len; t++) {
        float v = rows > 1 ? o[t] / (float)rows : o[t];
        if (bf16 && fabsf(v) <= 3.4028234663852886e38f) v = bf16_round(v);
        status |= !(fabsf(v) <= 3.4028234663852886e38f) || (v != 0.0f && fabsf(v) < 1.17549435e-38f);
        o[t] = v;
    }
    if (o16)
        for (int64_t t = 0; t < len; t++) o16[t] = (uint16_t)(bits_of(o[t]) >> 16);
    return status;
}

/* The averages of tile rows j0..j1 of an image of h rows of whole tiles (w % blk == 0;
 * xp its values, o its (ho, wo) averages; several planes make one image where h % blk == 0
 * or no rows are pooled): those rows lie one after the other, so one tile_means call
 * averages all their tiles (a row of a few tiles alone does not vectorize: 3x slower),
 * then each tile row sums its rows' averages in order, as acgc_division_low's general loop
 * does. (j1 - j0) tile rows hold at most LOW_BAND tiles. */
static inline int band_means(const float *xp, int64_t h, int64_t w, int64_t blk, int ph,
                             int64_t j0, int64_t j1, int bf16, float *o, uint16_t *o16) {
    int64_t wo = w / blk, r0 = ph ? j0 * blk : j0, r1 = ph ? (j1 * blk < h ? j1 * blk : h) : j1;
    float v[LOW_BAND];
    tile_means(xp + r0 * w, 0, (r1 - r0) * wo, (r1 - r0) * w, blk, v);
    int status = 0, same = !ph || h % blk == 0; /* every tile row of blk rows (or of 1) */
    for (int64_t j = j0; j < j1; j++) {
        int64_t a = ph ? j * blk : j, b = ph ? (a + blk < h ? a + blk : h) : j + 1;
        float *oj = o + j * wo;
        const float *va = v + (a - r0) * wo;
        for (int64_t t = 0; t < wo; t++) oj[t] = ph ? 0.0f + va[t] : va[t];
        for (int64_t r = 1; r < b - a; r++)
            for (int64_t t = 0; t < wo; t++) oj[t] = oj[t] + va[r * wo + t];
        if (!same) status |= finish_means(oj, wo, b - a, bf16, o16 ? o16 + j * wo : 0);
    }
    if (same)
        status |= finish_means(o + j0 * wo, (j1 - j0) * wo, ph ? blk : 1, bf16,
                               o16 ? o16 + j0 * wo : 0);
    return status;
}

/* The block averages into low, (planes, ho, wo) float32 (ho = ceil(h / blk) if ph, else
 * h; wo likewise), in the reference's order: along w first (each tile summed in order from
 * 0, divided by its count), then along h over those averages; rounded to bfloat16 values
 * if bf16, and then also written as bfloat16 into low16 unless it is NULL. Returns 0, or 1 when some average is not finite (NaN/inf in x, or a float32 sum
 * that overflowed), or is subnormal or beyond bfloat16's range after rounding: the caller
 * then takes the reference's path. */
int acgc_division_low(const float *x, int64_t planes, int64_t h, int64_t w, int64_t blk, int ph,
                      int pw, int bf16, float *low, uint16_t *low16, int nthreads) {
    int64_t ho = ph ? (h + blk - 1) / blk : h, wo = pw ? (w + blk - 1) / blk : w;
    int status = 0;
    int64_t band = (ph ? blk : 1) * wo;
    if (pw && w % blk == 0 && band <= LOW_BAND) { /* rows of whole tiles, in bands */
        int flat = !ph || h % blk == 0; /* tile rows never cross planes: one image */
        int64_t ih = flat ? planes * h : h, iho = flat ? planes * ho : ho, ims = flat ? 1 : planes;
        int64_t per = LOW_BAND / band, bands = (iho + per - 1) / per;
#pragma omp parallel for schedule(static) num_threads(THREADS(planes * h * w)) reduction(| : status)
        for (int64_t it = 0; it < ims * bands; it++) {
            int64_t pl = it / bands, j0 = it % bands * per, j1 = j0 + per < iho ? j0 + per : iho;
            status |= band_means(x + pl * ih * w, ih, w, blk, ph, j0, j1, bf16, low + pl * iho * wo,
                                 low16 ? low16 + pl * iho * wo : 0);
        }
        return status;
    }
    int64_t chunks = (wo + LOW_TILES - 1) / LOW_TILES, items = planes * ho * chunks;
#pragma omp parallel for schedule(static) num_threads(THREADS(planes * h * w)) reduction(| : status)
    for (int64_t it = 0; it < items; it++) {
        int64_t pl = it / (ho * chunks), j = it / chunks % ho, ch = it % chunks;
        int64_t t0 = ch * LOW_TILES, t1 = t0 + LOW_TILES < wo ? t0 + LOW_TILES : wo;
        int64_t r0 = ph ? j * blk : j, r1 = ph ? (r0 + blk < h ? r0 + blk : h) : j + 1;
        float *o = low + (pl * ho + j) * wo;
        for (int64_t r = r0; r < r1; r++) {
            const float *p = x + (pl * h + r) * w;
            float v[LOW_TILES];
            if (pw)
                tile_means(p, t0, t1, w, blk, v);
            else
                memcpy(v, p + t0, (size_t)(t1 - t0) * 4);
            for (int64_t t = t0; t < t1; t++)
                o[t] = !ph ? v[t - t0] : (r == r0 ? 0.0f : o[t]) + v[t - t0];
        }
        status |= finish_means(o + t0, t1 - t0, ph ? r1 - r0 : 1, bf16,
                               low16 ? low16 + (pl * ho + j) * wo + t0 : 0);
    }
    return status;
}

/* up[k] = the value of low over flat element i0 + k (k < len) of the (planes, h, w) view:
 * row by row, and along a row tile by tile (pw) or element by element (no division per
 * element or per tile); the callers then add or subtract up in loops that vectorize. */
static void upsample_span(const float *low, int64_t i0, int64_t len, int64_t h, int64_t w,
                          int64_t blk, int ph, int pw, float *up) {
    int64_t ho = ph ? (h + blk - 1) / blk : h, wo = pw ? (w + blk - 1) / blk : w;
    if (pw && blk == 8 && w % 8 == 0 && i0 % 8 == 0 && len % 8 == 0) {
        /* the default block on rows of whole tiles: one tile per 8 outputs, a counter per
         * tile and per row (the loop below costs 3x as much on rows of a few tiles) */
        int64_t c = i0 / 8, cend = (i0 + len) / 8, t = c % wo, rows = c / wo;
        int64_t row = rows % h, pl = rows / h, base = (pl * ho + (ph ? row / 8 : row)) * wo;
        for (float *u = up; c < cend; c++, u += 8) {
            float v = low[base + t];
            for (int k = 0; k < 8; k++) u[k] = v;
            if (++t == wo) {
                t = 0;
                if (++row == h) row = 0, pl++;
                base = (pl * ho + (ph ? row / 8 : row)) * wo;
            }
        }
        return;
    }
    int64_t i = i0, end = i0 + len, col = i % w, rr = i / w;
    int64_t k0 = 0, row = rr % h, pl = rr / h; /* divisions once, then counters */
    int64_t trow = ph ? row / blk : row, rin = ph ? row % blk : 0;
    while (i < end) {
        int64_t seg = w - col < end - i ? w - col : end - i;
        const float *lrow = low + (pl * ho + trow) * wo;
        float *u = up + k0;
        if (pw && blk == 8 && col % 8 == 0 && seg % 8 == 0) { /* the default block */
            const float *ltile = lrow + col / 8;
            for (int64_t q = 0; q < seg / 8; q++)
                for (int k = 0; k < 8; k++) u[8 * q + k] = ltile[q];
        } else if (pw) {
            int64_t tile = col / blk, t = 0;
            while (t < seg) {
                int64_t stop = (tile + 1) * blk - col;
                stop = stop < seg ? stop : seg;
                float lv = lrow[tile++];
                for (; t < stop; t++) u[t] = lv;
            }
        } else {
            memcpy(u, lrow + col, (size_t)seg * 4);
        }
        k0 += seg;
        i += seg;
        col = 0;
        if (++row == h) { /* the next plane */
            row = rin = trow = 0;
            pl++;
        } else if (!ph) {
            trow++;
        } else if (++rin == blk) { /* the next tile row */
            rin = 0;
            trow++;
        }
    }
}

/* r[k] = p[k] - r[k] for k < len (len <= CHUNK), with p's min (*lo), smallest positive
 * value (*min_pos, inf if none) and zero bits (zero_bits' layout, into out) from the same
 * loads where AVX-512 is there (one pass instead of three: a tenth of division's encode). */
static inline void subtract_scan(const float *p, float *r, int64_t len, uint8_t *out, float *lo,
                                 float *min_pos) {
#if defined(__AVX512F__)
    __m512 mn = _mm512_set1_ps(INFINITY), mp = mn, zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < len; i += 16) {
        __mmask16 m = len - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(m, p + i);
        _mm512_mask_storeu_ps(r + i, m, _mm512_sub_ps(v, _mm512_maskz_loadu_ps(m, r + i)));
        mn = _mm512_mask_min_ps(mn, m, v, mn);
        mp = _mm512_mask_min_ps(mp, m & _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ), v, mp);
        uint16_t z = m & _mm512_cmp_ps_mask(v, zero, _CMP_EQ_OQ);
        memcpy(out + i / 8, &z, len - i > 8 ? 2 : 1);
    }
    *lo = fold_min(mn);
    *min_pos = fold_min(mp);
#else
    for (int64_t k = 0; k < len; k++) r[k] = p[k] - r[k];
    float hi;
    *min_pos = INFINITY;
    lane_stats(p, len, STAT_MIN | STAT_POS, lo, &hi, min_pos);
    zero_bits(p, len, out);
#endif
}

/* The residual r = x - upsample(low) of each group of gs <= CHUNK values, quantized and
 * packed as acgc_quant_encode does with float32 metadata (r's tail group padded with
 * r[n-1]); zbits gets x == 0 in the mask layout, stats[0..1] x's min and smallest positive
 * value (inf if none: where x's max is <= 0). Called after acgc_division_low returned 0
 * (x finite). Works on blocks of CHUNK / gs whole groups (one upsample, one pass of x's
 * statistics and zero bits a block; the groups' parameters computed side by side, as
 * acgc_quant_encode does: a quarter less time than group by group). Returns 0, or 1 when
 * some residual is not finite or a group's range or inverse is beyond float32 (the caller
 * takes the reference's path). */
int acgc_division_residual(const float *x, int64_t planes, int64_t h, int64_t w, int64_t blk,
                           int ph, int pw, const float *low, int bits, int64_t gs, uint32_t key,
                           float *out_lo, float *out_scale, uint8_t *codes, uint8_t *zbits,
                           float *stats, int nthreads) {
    int64_t n = planes * h * w, groups = (n + gs - 1) / gs;
    int64_t per = CHUNK / gs > 0 ? CHUNK / gs : 1, blocks = (groups + per - 1) / per;
    float pad;
    upsample_span(low, n - 1, 1, h, w, blk, ph, pw, &pad);
    pad = x[n - 1] - pad;
    float mn = INFINITY, mp = INFINITY;
    int status = 0;
#pragma omp parallel for schedule(static) num_threads(THREADS(n)) reduction(min : mn, mp) reduction(| : status)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t g0 = b * per, i0 = g0 * gs, len = n - i0 < per * gs ? n - i0 : per * gs;
        int m = (int)((len + gs - 1) / gs);
        const float *p = x + i0;
        float r[CHUNK];
        upsample_span(low, i0, len, h, w, blk, ph, pw, r);
        float xl, xp;
        subtract_scan(p, r, len, zbits + i0 / 8, &xl, &xp);
        mn = xl < mn ? xl : mn;
        mp = xp < mp ? xp : mp;
        /* x is finite (acgc_division_low declined NaN/inf, their averages not being
         * finite), so r is finite or +-inf where x - up overflowed, which its min or max
         * shows; its smallest positive value matters only to a zero-kept group */
        float lo[CHUNK / 8], hi[CHUNK / 8], pos[CHUNK / 8], iv[CHUNK / 8], tp[CHUNK / 8];
        uint8_t z[CHUNK / 8];
        int ok = 1;
        for (int k = 0; k < m; k++) {
            int64_t glen = len - k * gs < gs ? len - k * gs : gs;
            float *rk = r + k * gs;
            pos[k] = INFINITY;
            lane_stats(rk, glen, STAT_MIN | STAT_MAX, &lo[k], &hi[k], &pos[k]);
            if (lo[k] == 0.0f && hi[k] > 0.0f)
                lane_stats(rk, glen, STAT_POS, &iv[k], &iv[k], &pos[k]);
            ok &= lo[k] != -INFINITY && hi[k] != INFINITY;
        }
        for (int k = 0; ok && k < m; k++)
            ok &= group_param(lo[k], hi[k], pos[k], bits, 0, out_lo + g0 + k, out_scale + g0 + k,
                              &iv[k], &tp[k], &z[k]);
        if (!ok) {
            status = 1;
            continue;
        }
        for (int k = 0; k < m; k++) {
            int64_t glen = len - k * gs < gs ? len - k * gs : gs;
            pack_span(r + k * gs, glen, pad, i0 + k * gs, gs, bits, out_lo[g0 + k], iv[k], tp[k],
                      z[k], key, codes + (g0 + k) * (gs * bits / 8));
        }
    }
    stats[0] = mn;
    stats[1] = mp;
    return status;
}

/* The division decode of n values: each group's residual unpacked into out (unpack_group,
 * from the residual's float32 lo and signed scale as acgc_quant_unpack reads them),
 * upsample(low) added, then clamped to +-fmax with the zero mask applied (finish_chunk).
 * Returns 1, writing nothing, where the residual's decode needs float64 (meta_wide). */
int acgc_division_decode(const uint8_t *codes, int64_t planes, int64_t h, int64_t w,
                         int64_t blk, int ph, int pw, const float *low, int bits, int64_t gs,
                         const float *lo, const float *scale, float fmax, const uint8_t *zmask,
                         float min_pos, float *out, int nthreads) {
    int64_t n = planes * h * w, groups = (n + gs - 1) / gs;
    if (meta_wide(lo, scale, 0, groups, bits)) return 1;
    int64_t per = CHUNK / gs > 0 ? CHUNK / gs : 1, blocks = (groups + per - 1) / per;
#pragma omp parallel for schedule(static) num_threads(THREADS(n))
    for (int64_t b = 0; b < blocks; b++) { /* blocks of whole groups, as the encoder's */
        int64_t g0 = b * per, i0 = g0 * gs, len = n - i0 < per * gs ? n - i0 : per * gs;
        float *o = out + i0;
        for (int64_t k = 0; k * gs < len; k++) {
            int64_t g = g0 + k, glen = len - k * gs < gs ? len - k * gs : gs;
            unpack_group(codes + g * (gs * bits / 8), glen, gs, bits, lo[g], fabsf(scale[g]),
                         signbit(scale[g]) ? 1 : 0, o + k * gs);
        }
        float up[CHUNK];
        upsample_span(low, i0, len, h, w, blk, ph, pw, up);
        for (int64_t k = 0; k < len; k++) o[k] = o[k] + up[k];
        finish_chunk(o, len, fmax, zmask ? zmask + i0 / 8 : 0, min_pos);
    }
    return 0;
}

/* ---- intpack: int64 values as residuals over their group's minimum, bit-packed at one
 * width for the whole tensor (intpack/reference.py's format) ---- */

#define INT_BLOCK 4096 /* values per work item: a multiple of 64, so blocks own whole words */

/* base[g] = the minimum of group g (gs values, the tail group short); returns the largest
 * residual x - base over every group, modulo 2**64 (>= 2**63: the reference's width 64). */
uint64_t acgc_intpack_base(const int64_t *x, int64_t n, int64_t gs, int64_t *base,
                           int nthreads) {
    int64_t groups = (n + gs - 1) / gs;
    uint64_t top = 0;
#pragma omp parallel for schedule(static) num_threads(THREADS(n)) reduction(max : top)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t *p = x + g * gs;
        int64_t len = (g + 1) * gs <= n ? gs : n - g * gs;
        int64_t mn = p[0], mx = p[0];
        for (int64_t j = 1; j < len; j++) {
            mn = p[j] < mn ? p[j] : mn;
            mx = p[j] > mx ? p[j] : mx;
        }
        base[g] = mn;
        uint64_t r = (uint64_t)mx - (uint64_t)mn;
        top = r > top ? r : top;
    }
    return top;
}

/* The residuals x[i] - base[i / gs] (mod 2**64) of i0 <= i < i1, the width-w bit stream of
 * acgc_intpack_pack from bit i0 * w (a byte, i0 being a multiple of 8) into o, one value
 * at a time through a 128-bit accumulator (any width 1..64). */
static void pack_wide(const int64_t *x, int64_t i0, int64_t i1, int64_t gs, const int64_t *base,
                      int width, uint8_t *o) {
    int64_t g = i0 / gs, gend = (g + 1) * gs;
    uint64_t bs = (uint64_t)base[g];
    unsigned __int128 acc = 0;
    int nb = 0;
    for (int64_t i = i0; i < i1; i++) {
        if (i == gend) {
            bs = (uint64_t)base[++g];
            gend += gs;
        }
        acc |= (unsigned __int128)((uint64_t)x[i] - bs) << nb;
        nb += width;
        if (nb >= 64) {
            uint64_t word = (uint64_t)acc;
            memcpy(o, &word, 8); /* little-endian hosts (x86-64, aarch64) */
            o += 8;
            acc >>= 64;
            nb -= 64;
        }
    }
    for (; nb > 0; nb -= 8, acc >>= 8) *o++ = (uint8_t)acc; /* the stream's tail only */
}

/* Codes r[0..len) (len <= INT_BLOCK; r has room for 8 more) of width 1..16 as a bit stream
 * into o, whole bytes of 8 codes through pack_codes, then the tail, its last byte's unused
 * bits 0. */
static void pack_block(uint32_t *r, int64_t len, int width, uint8_t *o) {
    int64_t whole = len / 8 * 8;
    pack_codes(r, whole, width, o);
    if (whole < len) {
        uint8_t tail[16];
        for (int64_t j = len; j < whole + 8; j++) r[j] = 0;
        pack_codes(r + whole, 8, width, tail);
        memcpy(o + whole / 8 * width, tail, (size_t)(((len - whole) * width + 7) / 8));
    }
}

/* pack_wide for widths 1..16: the residuals as uint32 into a buffer (a loop that
 * vectorizes), then packed 8 at a time with constant shifts (pack_codes); i1 - i0 <=
 * INT_BLOCK. */
static void pack_narrow(const int64_t *x, int64_t i0, int64_t i1, int64_t gs,
                        const int64_t *base, int width, uint8_t *o) {
    uint32_t r[INT_BLOCK + 8];
    for (int64_t s = i0; s < i1;) { /* the part of each group inside [i0, i1) */
        int64_t g = s / gs, stop = (g + 1) * gs < i1 ? (g + 1) * gs : i1;
        uint64_t bs = (uint64_t)base[g];
        for (int64_t i = s; i < stop; i++) r[i - i0] = (uint32_t)((uint64_t)x[i] - bs);
        s = stop;
    }
    pack_block(r, i1 - i0, width, o);
}

/* Residual x[i] - base[i / gs] (mod 2**64) at bits [i * width, (i + 1) * width) of out,
 * least significant bit first, the last byte's unused bits 0; width 1..64. */
void acgc_intpack_pack(const int64_t *x, int64_t n, int64_t gs, const int64_t *base, int width,
                       uint8_t *out, int nthreads) {
    int64_t blocks = (n + INT_BLOCK - 1) / INT_BLOCK;
#pragma omp parallel for schedule(static) num_threads(THREADS(n))
    for (int64_t b = 0; b < blocks; b++) {
        int64_t i0 = b * INT_BLOCK, i1 = i0 + INT_BLOCK < n ? i0 + INT_BLOCK : n;
        uint8_t *o = out + i0 / 8 * width;
        if (width <= 16)
            pack_narrow(x, i0, i1, gs, base, width, o);
        else
            pack_wide(x, i0, i1, gs, base, width, o);
    }
}

/* Bits [sh, sh + 64) of the bytes at p (sh < 8), reading no byte at or past end. */
static inline uint64_t bits_at(const uint8_t *p, const uint8_t *end, int sh) {
    uint8_t buf[16] = {0};
    int64_t room = end - p;
    memcpy(buf, p, (size_t)(room < 9 ? room : 9));
    uint64_t a, b;
    memcpy(&a, buf, 8); /* little-endian hosts (x86-64, aarch64) */
    memcpy(&b, buf + 8, 8);
    unsigned __int128 v = ((unsigned __int128)b << 64) | a;
    return (uint64_t)(v >> sh);
}

/* Residual i of the width-w (0..64) stream at bits, end its end: one 8-byte load where the
 * width and the stream's end allow. */
static inline uint64_t residual_at(const uint8_t *bits, const uint8_t *end, int64_t i, int width,
                                   uint64_t mask) {
    uint64_t bit = (uint64_t)i * (uint64_t)width;
    const uint8_t *p = bits + (bit >> 3);
    uint64_t r;
    if (width <= 56 && p + 8 <= end) {
        memcpy(&r, p, 8); /* little-endian hosts (x86-64, aarch64) */
        r >>= bit & 7;
    } else {
        r = width ? bits_at(p, end, (int)(bit & 7)) : 0;
    }
    return r & mask;
}

/* The inverse of acgc_intpack_pack (width 0..64): out[i] = base[i / gs] + residual i; widths
 * 1..16 unpacked 8 at a time with constant shifts (unpack_codes), wider ones one by one. */
void acgc_intpack_unpack(const uint8_t *bits, int64_t n, int64_t gs, const int64_t *base,
                         int width, int64_t *out, int nthreads) {
    int64_t blocks = (n + INT_BLOCK - 1) / INT_BLOCK;
    const uint8_t *end = bits + (n * width + 7) / 8;
    uint64_t mask = width == 64 ? ~(uint64_t)0 : (((uint64_t)1 << width) - 1);
    int narrow = width >= 1 && width <= 16;
#pragma omp parallel for schedule(static) num_threads(THREADS(n))
    for (int64_t b = 0; b < blocks; b++) {
        int64_t i0 = b * INT_BLOCK, i1 = i0 + INT_BLOCK < n ? i0 + INT_BLOCK : n;
        uint32_t r[INT_BLOCK];
        const uint8_t *src = bits + i0 / 8 * width;
        if (narrow) unpack_codes(src, i1 - i0, width, end - src, r);
        for (int64_t g0 = i0; g0 < i1;) { /* the part of each group inside the block */
            int64_t g = g0 / gs, stop = (g + 1) * gs < i1 ? (g + 1) * gs : i1;
            uint64_t bs = (uint64_t)base[g];
            for (int64_t i = g0; i < stop; i++) {
                uint64_t v = narrow ? r[i - i0] : residual_at(bits, end, i, width, mask);
                out[i] = (int64_t)(v + bs);
            }
            g0 = stop;
        }
    }
}

/* ---- intpack's window mode: pooling indices as their offsets from the window corner
 * s*i*win + s*j of output (i, j) in (planes, h, w) (intpack/window.py's format) ---- */

/* The offsets of the len values at x (k0 .. k0 + len of the flat tensor, len <= INT_BLOCK)
 * into u: u = x - corner + win / 2 (mod 2**64) in int32 (win < 2**28, which the caller
 * checks); window_split makes rr = floor(u / win) and rc = u - win / 2 - rr * win of it.
 * Walks row by row so that the inner loops have no branch and vectorize. Returns 0 where
 * some u is outside [-2 * win, 3 * win). */
static int window_offsets(const int64_t *restrict x, int64_t k0, int64_t len, int64_t h,
                          int64_t w, int64_t s, int64_t win, int32_t *restrict rc) {
    int64_t rem = k0 % (h * w), i = rem / w, j = rem % w, half = win / 2;
    int64_t lo = -2 * win, hi = 3 * win;
    int bad = 0;
    for (int64_t t0 = 0; t0 < len;) {
        int64_t seg = w - j < len - t0 ? w - j : len - t0;
        uint64_t corner = (uint64_t)(s * win * i + s * j) - (uint64_t)half;
        for (int64_t t = t0; t < t0 + seg; t++) {
            int64_t u = (int64_t)((uint64_t)x[t] - corner);
            corner += (uint64_t)s;
            int out = (u < lo) | (u >= hi);
            bad |= out;
            rc[t] = out ? 0 : (int32_t)u; /* |u| < 3 * win < 2**31 */
        }
        t0 += seg;
        j = 0;
        i = i + 1 == h ? 0 : i + 1;
    }
    return !bad;
}

/* The row offset rr = floor(u / win) of u in [-2 * win, 3 * win), counted by comparisons
 * (no division or multiply: rr in [-2, 2], a window of up to 5 rows), and the column
 * offset rc = u - win / 2 - rr * win. */
static inline void window_split(int32_t u, int32_t v, int32_t hv, int32_t *rr, int32_t *rc) {
    int32_t a = u >= -v, b = u >= 0, c = u >= v, e = u >= 2 * v;
    *rr = a + b + c + e - 2;
    *rc = u - hv + 2 * v - (a ? v : 0) - (b ? v : 0) - (c ? v : 0) - (e ? v : 0);
}

/* The codes ((rr - mr) << kb) | (rc - mc) of the n values as a width-bit stream into out
 * (width 0: nothing written, the ranges only), and the ranges of rr and rc into ranges (min
 * rr, max rr, min rc, max rc). Returns 0 where some value is outside its window
 * (window_offsets). The stream is the format's only where mr, mc, kb and width are the
 * ones the ranges give: the caller packs with a guess (the last tensor's), compares, and
 * packs again if they differ, so a step whose ranges did not change takes one pass. */
int acgc_window_pack(const int64_t *x, int64_t n, int64_t h, int64_t w, int64_t s, int64_t win,
                     int64_t mr, int64_t mc, int kb, int width, uint8_t *out, int64_t *ranges,
                     int nthreads) {
    int64_t blocks = (n + INT_BLOCK - 1) / INT_BLOCK;
    int64_t lo_r = INT64_MAX, hi_r = INT64_MIN, lo_c = INT64_MAX, hi_c = INT64_MIN;
    int ok = 1;
#pragma omp parallel for schedule(static) num_threads(THREADS(n)) \
    reduction(min : lo_r, lo_c) reduction(max : hi_r, hi_c) reduction(&& : ok)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t i0 = b * INT_BLOCK, len = i0 + INT_BLOCK < n ? INT_BLOCK : n - i0;
        int32_t u[INT_BLOCK];
        uint32_t r[INT_BLOCK + 8];
        ok = window_offsets(x + i0, i0, len, h, w, s, win, u) && ok;
        int32_t a = INT32_MAX, bb = INT32_MIN, c = INT32_MAX, e = INT32_MIN;
        int32_t mr32 = (int32_t)mr, mc32 = (int32_t)mc, v = (int32_t)win, hv = (int32_t)(win / 2);
        for (int64_t t = 0; t < len; t++) { /* the offsets, their ranges and codes at once */
            int32_t rr, rc;
            window_split(u[t], v, hv, &rr, &rc);
            a = rr < a ? rr : a;
            bb = rr > bb ? rr : bb;
            c = rc < c ? rc : c;
            e = rc > e ? rc : e;
            r[t] = ((uint32_t)(rr - mr32) << kb) | (uint32_t)(rc - mc32);
        }
        lo_r = a < lo_r ? a : lo_r;
        hi_r = bb > hi_r ? bb : hi_r;
        lo_c = c < lo_c ? c : lo_c;
        hi_c = e > hi_c ? e : hi_c;
        if (width) pack_block(r, len, width, out + i0 / 8 * width);
    }
    ranges[0] = lo_r, ranges[1] = hi_r, ranges[2] = lo_c, ranges[3] = hi_c;
    return ok;
}

/* The inverse: out = corner + (mr + (code >> kb)) * win + mc + (code & mask) (mod 2**64),
 * width 0..16. */
void acgc_window_unpack(const uint8_t *bits, int64_t n, int64_t h, int64_t w, int64_t s,
                        int64_t win, int64_t mr, int64_t mc, int kb, int width, int64_t *out,
                        int nthreads) {
    int64_t blocks = (n + INT_BLOCK - 1) / INT_BLOCK;
    const uint8_t *end = bits + (n * width + 7) / 8;
    uint64_t mask = ((uint64_t)1 << kb) - 1u;
#pragma omp parallel for schedule(static) num_threads(THREADS(n))
    for (int64_t b = 0; b < blocks; b++) {
        int64_t i0 = b * INT_BLOCK, len = i0 + INT_BLOCK < n ? INT_BLOCK : n - i0;
        uint32_t r[INT_BLOCK];
        const uint8_t *src = bits + i0 / 8 * width;
        if (width)
            unpack_codes(src, len, width, end - src, r);
        else
            memset(r, 0, sizeof(r));
        int64_t rem = i0 % (h * w), i = rem / w, j = rem % w;
        for (int64_t t0 = 0; t0 < len;) {
            int64_t seg = w - j < len - t0 ? w - j : len - t0;
            uint64_t corner = (uint64_t)(s * win * i + s * j);
            int64_t *o = out + i0 + t0;
            for (int64_t t = 0; t < seg; t++) {
                uint64_t c = r[t0 + t];
                uint64_t v = corner + (uint64_t)(s * t) + (uint64_t)(mr + (int64_t)(c >> kb)) *
                             (uint64_t)win + (uint64_t)mc + (c & mask);
                o[t] = (int64_t)v;
            }
            t0 += seg;
            j = 0;
            i = i + 1 == h ? 0 : i + 1;
        }
    }
}

/* Per-channel normalization in front of a codec (kernels/channels/reference.py): x is
 * [n][c][plane] float32. Per channel its lo and hi over n and plane, m = lo/2 + hi/2 and
 * s = hi/2 - lo/2 (m = 0, s = 1 where a value is NaN or +-inf, or 0 < s < tiny), then
 * y = (x - m) * (s > 0 ? 1/s : 0). Row (n, c) statistics in parallel into rlo/rhi/rbad
 * (n * c each, scratch), the per-channel reduction serial, the output rows in parallel. */
void acgc_channel_normalize(const float *x, int64_t n, int64_t c, int64_t plane, float tiny,
                            float *rlo, float *rhi, uint8_t *rbad, float *m, float *s,
                            float *y, int nthreads) {
    int64_t rows = n * c;
#pragma omp parallel for schedule(static) num_threads(THREADS(rows * plane))
    for (int64_t r = 0; r < rows; r++) {
        float unused;
        rbad[r] = (uint8_t)lane_stats(x + r * plane, plane, STAT_MIN | STAT_MAX | STAT_FINITE,
                                      rlo + r, rhi + r, &unused);
    }
    for (int64_t ch = 0; ch < c; ch++) {
        float lo = INFINITY, hi = -INFINITY;
        int bad = 0;
        for (int64_t i = 0; i < n; i++) {
            int64_t r = i * c + ch;
            lo = rlo[r] < lo ? rlo[r] : lo;
            hi = rhi[r] > hi ? rhi[r] : hi;
            bad |= rbad[r];
        }
        float mid = lo / 2.0f + hi / 2.0f, half = hi / 2.0f - lo / 2.0f;
        if (bad || (half > 0.0f && half < tiny)) mid = 0.0f, half = 1.0f;
        m[ch] = mid;
        s[ch] = half;
    }
#pragma omp parallel for schedule(static) num_threads(THREADS(rows * plane))
    for (int64_t r = 0; r < rows; r++) {
        float mid = m[r % c], half = s[r % c];
        float inv = half > 0.0f ? 1.0f / half : 0.0f;
        const float *p = x + r * plane;
        float *q = y + r * plane;
        for (int64_t j = 0; j < plane; j++) q[j] = (p[j] - mid) * inv;
    }
}

/* The expected variance of quant's stochastic rounding (policies/quant_error.py,
 * sr_variance): for the g x gs float32 values x (NaN/inf already zeroed) with their
 * groups' lo, hi, smallest positive value mp and zero-kept flag zk, and each width
 * b = 1..8 (zero-kept only for b > 1): base = zk ? mp : lo, step = (hi - base) / top with
 * top = 2^b - 1 (2^b - 2 when zero-kept), t = (x - base) * (step > 0 ? 1 / step : 0),
 * f = t - floor(t), and the sum of f * (1 - f) * step^2 (0 for the zeros of a zero-kept
 * group) into sums[b - 1], in double. 16 lanes per width so the sums vectorize. */
void acgc_sr_variance(const float *x, int64_t groups, int64_t gs, const float *lo,
                      const float *hi, const float *mp, const uint8_t *zk, double *sums,
                      int nthreads) {
    double total[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma omp parallel for schedule(static) num_threads(THREADS(groups * gs)) reduction(+ : total[:8])
    for (int64_t g = 0; g < groups; g++) {
        const float *p = x + g * gs;
        for (int b = 1; b <= 8; b++) {
            int kept = zk[g] && b > 1;
            float levels = (float)((1 << b) - 1);
            float base = kept ? mp[g] : lo[g];
            float top = kept ? levels - 1.0f : levels;
            float step = (hi[g] - base) / top;
            float inv = step > 0.0f ? 1.0f / step : 0.0f;
            float sq = step * step;
            double lane[16] = {0};
            int64_t full = gs / 16 * 16;
            for (int64_t i = 0; i < full; i += 16)
                for (int k = 0; k < 16; k++) {
                    float v = p[i + k], t = (v - base) * inv, f = t - floorf(t);
                    float var = f * (1.0f - f) * sq;
                    lane[k] += (kept && v == 0.0f) ? 0.0 : (double)var;
                }
            for (int64_t i = full; i < gs; i++) {
                float v = p[i], t = (v - base) * inv, f = t - floorf(t);
                float var = f * (1.0f - f) * sq;
                lane[0] += (kept && v == 0.0f) ? 0.0 : (double)var;
            }
            double s = 0.0;
            for (int k = 0; k < 16; k++) s += lane[k];
            total[b - 1] += s;
        }
    }
    for (int b = 0; b < 8; b++) sums[b] = total[b];
}
