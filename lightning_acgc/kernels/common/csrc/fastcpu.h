/* Shared helpers of the compiled CPU kernels (the .c files beside this one, one per codec,
 * built into one library by lightning_acgc/kernels/common/cpu_lib.py with gcc on first
 * use; Python passes data pointers through ctypes). C99 + OpenMP (and GCC's unsigned
 * __int128 for intpack's 64-bit widths), no torch headers. Every function computes exactly
 * what its pure-torch reference computes (same float32 operations, no FMA contraction:
 * built with -ffp-contract=off), so the outputs are bit-identical. -fno-trapping-math (no
 * value changes) lets loops with selects and divisions vectorize. Here: the statistics of
 * a run of values, quant's group parameters, noise, codes and packing (quant, split and
 * division share them), and the bit streams of every width. */
#ifndef LIGHTNING_ACGC_FASTCPU_H
#define LIGHTNING_ACGC_FASTCPU_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The bit streams and the noise's 16-bit halves are read and written through words in
 * little-endian order: elsewhere the build fails and the codecs take the torch reference
 * (cpu_lib.py's one-line notice) rather than writing other bytes. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the CPU kernels assume a little-endian host"
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
 * lane k + half where that one is smaller (fold_min) or larger (fold_max), half = 8, 4,
 * 2, 1; OP names the min or max intrinsics. */
#define FOLD(NAME, OP)                                                                    \
    static inline float NAME(__m512 v) {                                                  \
        __m256 a = _mm512_castps512_ps256(v);                                             \
        __m256 b = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));      \
        a = _mm256_##OP##_ps(b, a);                                                       \
        __m128 c = _mm_##OP##_ps(_mm256_extractf128_ps(a, 1), _mm256_castps256_ps128(a)); \
        c = _mm_##OP##_ps(_mm_movehl_ps(c, c), c);                                        \
        return _mm_cvtss_f32(_mm_##OP##_ss(_mm_movehdup_ps(c), c));                       \
    }
FOLD(fold_min, min)
FOLD(fold_max, max)
#undef FOLD

/* The lanes of a row of 16 values with `left` of them left (all 16 from 16 on): the
 * masked loads and stores of a tail. */
static inline __mmask16 lanes16(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* A 16-value row's mask as bytes of a bit pattern (bit k of byte b: value 8b + k), the
 * bytes `left` values cover (1 or 2), and back. */
static inline void put_bits16(uint8_t *out, uint16_t z, int64_t left) {
    out[0] = (uint8_t)z;
    if (left > 8) out[1] = (uint8_t)(z >> 8);
}

static inline uint16_t get_bits16(const uint8_t *in, int64_t left) {
    return (uint16_t)(in[0] | (left > 8 ? in[1] << 8 : 0));
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
    int64_t i = 0;
    /* rows of 32 into two sets of lanes (each min or max waits for the one before it in
     * its lanes: one set was a chain of 16 a group of 256, a third of quant's encode),
     * folded into one, then the rest as below; only the sign of a zero can differ */
    if (len >= 32) {
        __m512 mn2 = mn, mx2 = mx, mp2 = mp;
        for (; i + 32 <= len; i += 32) {
            __m512 v = _mm512_loadu_ps(p + i), u = _mm512_loadu_ps(p + i + 16);
            if (want & STAT_FINITE)
                nf |= (__mmask16)~(_mm512_cmp_ps_mask(_mm512_abs_ps(v), top, _CMP_LE_OQ) &
                                   _mm512_cmp_ps_mask(_mm512_abs_ps(u), top, _CMP_LE_OQ));
            if (want & STAT_MIN) mn = _mm512_min_ps(v, mn), mn2 = _mm512_min_ps(u, mn2);
            if (want & STAT_MAX) mx = _mm512_max_ps(v, mx), mx2 = _mm512_max_ps(u, mx2);
            if (want & STAT_POS) {
                mp = _mm512_mask_min_ps(mp, _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ), v, mp);
                mp2 = _mm512_mask_min_ps(mp2, _mm512_cmp_ps_mask(u, zero, _CMP_GT_OQ), u, mp2);
            }
        }
        mn = _mm512_min_ps(mn2, mn), mx = _mm512_max_ps(mx2, mx), mp = _mm512_min_ps(mp2, mp);
    }
    for (; i < len; i += 16) {
        __mmask16 m = lanes16(len - i);
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
static const uint8_t __attribute__((unused)) STREAM_BYTES[8][64] = TABLE(STREAM_AT);
static const uint8_t __attribute__((unused)) WORD_BYTES[8][64] = TABLE(WORD_AT);
#undef TABLE
#undef ROW
#undef WORD_AT
#undef STREAM_AT
#endif

/* Codes q[0..len) (len <= CHUNK, a multiple of 8), one per byte, of width w (1..8) as a
 * little-endian bit stream into out (len / 8 * w bytes): each 8 codes squeezed into a word
 * (a loop that vectorizes), stored as its w low bytes (little-endian hosts: x86-64,
 * aarch64). With AVX-512 VBMI, eight words at a time: one byte permutation gathers their
 * 8w stream bytes, one 64-byte store writes them where room (the bytes writable from out,
 * at least len / 8 * w) allows: the next words, or the caller's next codes, overwrite the
 * rest (a scalar store a word was 13% of a 3-bit encode; a copy through a buffer at each
 * 256-value group's end, a ninth of bounded's encode); elsewhere an 8-byte store where 8
 * bytes of room remain. */
static inline void pack_bytes_w(const uint8_t *q, int64_t len, int w, uint8_t *out,
                                int64_t room) {
    uint64_t words[CHUNK / 8];
    int64_t units = len / 8, b = 0;
    memcpy(words, q, (size_t)units * 8);
    for (int64_t k = 0; k < units; k++) words[k] = squeeze8(words[k], w);
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
    __m512i index = _mm512_loadu_si512(STREAM_BYTES[w - 1]);
    for (; b + 8 <= units; b += 8) {
        __m512i v = _mm512_permutexvar_epi8(index, _mm512_loadu_si512(words + b));
        if (b * w + 64 <= room) { /* a whole store: later words or codes overwrite the rest */
            _mm512_storeu_si512(out + b * w, v);
        } else { /* the stream's end (a masked store cost 120 cycles on an AMD EPYC) */
            uint8_t last[64];
            _mm512_storeu_si512(last, v);
            memcpy(out + b * w, last, (size_t)(8 * w));
        }
    }
#endif
    for (; b < units; b++) {
        if (b * w + 8 <= room)
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
static __attribute__((unused)) void pack_bytes_room(const uint8_t *q, int64_t len, int w,
                                                     uint8_t *out, int64_t room) {
#define PACK_BYTES(W) CASE_W(W, pack_bytes_w(q, len, W, out, room))
    switch (w) { PACK_BYTES(1) PACK_BYTES(2) PACK_BYTES(3) PACK_BYTES(4) PACK_BYTES(5)
                 PACK_BYTES(6) PACK_BYTES(7) PACK_BYTES(8) default: break; }
#undef PACK_BYTES
}

/* pack_bytes_room writing only the stream's own len / 8 * w bytes. */
static __attribute__((unused)) void pack_bytes(const uint8_t *q, int64_t len, int w, uint8_t *out) {
    pack_bytes_room(q, len, w, out, len / 8 * w);
}

static __attribute__((unused)) void unpack_bytes(const uint8_t *src, int64_t m, int w, int64_t avail, uint8_t *q) {
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

/* Stochastic rounding and packing of m consecutive groups of gs values at once (m * gs <=
 * CHUNK), the first at element index base (even: groups hold a multiple of 8): p[0..valid)
 * their values, pad the value of the elements past them (the tail group of the padded
 * array), each group with its own lo l, inv iv (1 / step, 0 for a zero step), top tp and
 * zero-kept flag z; see code_of (p's values and pad lie in their group's range: the
 * callers' l is the min of the very values they pass, pad the last of them), and
 * pair_hashes for the noise. One hash loop and one pack
 * loop for all of them (per group, those loops' set-up was a third of quant's and
 * division's packing at 256 values a group). A little-endian bit stream of bits-bit codes
 * (1..8 bits): 8 codes fill bits bytes, code k at bit bits * k; group k's codes at out + k *
 * gs * bits / 8. */
#pragma GCC diagnostic push /* noise: pair_hashes writes its len / 2 words, which GCC */
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized" /* does not follow into the loops */
static inline void pack_groups(const float *p, int64_t valid, float pad, int64_t base, int64_t gs,
                               int m, int bits, const float *l, const float *iv, const float *tp,
                               const uint8_t *z, uint32_t key, uint8_t *out) {
    uint8_t q[CHUNK];
    union {
        uint32_t w[CHUNK / 2];
        uint16_t half[CHUNK];
    } noise;
    int64_t len = (int64_t)m * gs;
    pair_hashes((uint64_t)base >> 1, len / 2, key, noise.w);
    for (int k = 0; k < m; k++) {
        int64_t s = k * gs, real = valid - s < gs ? (valid - s > 0 ? valid - s : 0) : gs;
        const float *pk = p + s;
        const uint16_t *u16 = noise.half + s;
        uint8_t *qk = q + s;
        float lk = l[k], ik = iv[k], tk = tp[k];
        if (z[k])
            for (int64_t j = 0; j < real; j++)
                qk[j] = code_of(pk[j], (float)u16[j] * NOISE_UNIT, lk, ik, tk, 1);
        else
            for (int64_t j = 0; j < real; j++)
                qk[j] = code_of(pk[j], (float)u16[j] * NOISE_UNIT, lk, ik, tk, 0);
        for (int64_t j = real; j < gs; j++)
            qk[j] = code_of(pad, (float)u16[j] * NOISE_UNIT, lk, ik, tk, z[k]);
    }
    if (bits == 8) {
        memcpy(out, q, (size_t)len);
    } else if (bits == 4) {
        for (int64_t b = 0; b < len / 2; b++) out[b] = q[2 * b] | (q[2 * b + 1] << 4);
    } else if (bits == 2) {
        for (int64_t b = 0; b < len / 4; b++)
            out[b] = q[4 * b] | (q[4 * b + 1] << 2) | (q[4 * b + 2] << 4) | (q[4 * b + 3] << 6);
    } else if (bits == 1) {
        for (int64_t b = 0; b < len / 8; b++) {
            uint8_t byte = 0;
            for (int k = 0; k < 8; k++) byte |= (uint8_t)(q[8 * b + k] << k);
            out[b] = byte;
        }
    } else {
        pack_bytes(q, len, bits, out);
    }
}
#pragma GCC diagnostic pop

/* pack_groups of one group of any size gs (a chunk of CHUNK values at a time), written to
 * gout (the group's gs * bits / 8 bytes). */
static inline void pack_span(const float *p, int64_t valid, float pad, int64_t base, int64_t gs,
                             int bits, float l, float iv, float tp, uint8_t z, uint32_t key,
                             uint8_t *gout) {
    for (int64_t c0 = 0; c0 < gs; c0 += CHUNK) { /* the group a chunk at a time */
        int64_t len = gs - c0 < CHUNK ? gs - c0 : CHUNK;
        pack_groups(p + c0, valid - c0, pad, base + c0, len, 1, bits, &l, &iv, &tp, &z, key,
                    gout + c0 * bits / 8);
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
static __attribute__((unused)) int meta_wide(const void *lo, const void *scale, int bf16, int64_t groups, int bits) {
    float levels = (float)((1 << bits) - 1);
    int wide = 0;
    for (int64_t g = 0; g < groups; g++) { /* G values: one thread, no team to wake */
        float top = meta_value(lo, g, bf16) + levels * fabsf(meta_value(scale, g, bf16));
        wide |= !(fabsf(top) <= 3.4028234663852886e38f);
    }
    return wide;
}

/* ---- 9- to 16-bit codes as bit streams (bounded's wide groups, intpack's widths) ---- */

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
static __attribute__((unused)) void pack_codes(const uint32_t *q, int64_t m, int w, uint8_t *dst) {
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

/* The inverse of pack8 (above): the 8 codes of width w (9..16) held by the w bytes at src
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

/* The inverse of pack_codes: the codes of the bytes at src (avail of them readable) into
 * q[0..m) (m <= CHUNK, rounded up to a multiple of 8). */
static __attribute__((unused)) void unpack_codes(const uint8_t *src, int64_t m, int w, int64_t avail, uint32_t *q) {
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

#endif /* LIGHTNING_ACGC_FASTCPU_H */
