/* division (DIVISION's block averages plus a few-bit residual): pooling, the zero
 * pattern, the fused encoder and decoder. */
#include "fastcpu.h"

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
        __mmask16 m = lanes16(len - i);
        uint16_t z = m & _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(m, p + i),
                                            _mm512_setzero_ps(), _CMP_EQ_OQ);
        put_bits16(out + i / 8, z, len - i);
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

#if defined(__AVX512F__)
/* 16 values: lv[0] eight times, then lv[1] eight times, from one load and one permutation
 * (lv[1] read, unused, past a row of 8 at a span's end: the callers' buffers have room). */
static inline __m512 tiles16(const float *lv) {
    const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m128 two = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)lv));
    return _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(two));
}
#endif

/* In place over o[0..len) (len <= CHUNK): with lv, lv[k / 8] added to o[k] first (tile_lows);
 * then clamp to [-fmax, fmax]; with a zero mask zm (its bit k of byte b for o[8b + k]),
 * max(o, min_pos) and +0.0 where the bit is set. */
static inline void finish_chunk(float *o, int64_t len, float fmax, const uint8_t *zm,
                                float min_pos, const float *lv) {
#if defined(__AVX512F__)
    /* the selects below, one compare each, in their operand order (NaN kept by the
     * clamp, replaced by min_pos), and the mask's bits as a write mask (+0.0 where set) */
    __m512 lo = _mm512_set1_ps(-fmax), hi = _mm512_set1_ps(fmax), mp = _mm512_set1_ps(min_pos);
    for (int64_t i = 0; i < len; i += 16) {
        __mmask16 m = lanes16(len - i);
        __m512 v = _mm512_maskz_loadu_ps(m, o + i);
        if (lv) v = _mm512_add_ps(v, tiles16(lv + i / 8));
        v = _mm512_max_ps(lo, v);
        v = _mm512_min_ps(hi, v);
        v = _mm512_max_ps(v, mp);
        if (zm) {
            v = _mm512_maskz_mov_ps((__mmask16)~get_bits16(zm + i / 8, len - i), v);
        }
        if (m == 0xFFFF) /* a masked store costs several times a plain one on an AMD EPYC */
            _mm512_storeu_ps(o + i, v);
        else
            _mm512_mask_storeu_ps(o + i, m, v);
    }
#else
    if (lv)
        for (int64_t i = 0; i < len; i++) o[i] = o[i] + lv[i / 8];
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
        finish_chunk(out + c * CHUNK, len, fmax, zmask ? zmask + c * (CHUNK / 8) : 0, min_pos, 0);
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

#if defined(__AVX2__)
/* r[0..8) transposed in place: lane k of r[i] becomes lane i of r[k]. */
static inline void transpose8x8(__m256 *r) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* Tile row j of a plane xp of h rows of w values pooled 8x8 (the default block on both
 * axes) into o[0..wo) (and o16), as acgc_division_low's general loop computes it: each
 * tile's rows loaded side by side and transposed, so that each row's tile sum runs down
 * the lanes in the reference's order (0 + x0 + x1 + ...; a short tile's first values
 * only), then 8 tiles' row averages transposed back, summed over the tile row's rows in
 * order (8 tiles at once). For maps whose rows are not whole tiles (28x28, 14x14, 7x7):
 * the general loop's rows of a few tiles ran 4x slower a value than the bands. */
static inline int tile_row_means8(const float *xp, int64_t h, int64_t w, int64_t j, int bf16,
                                  float *o, uint16_t *o16) {
    int64_t wo = (w + 7) / 8, rows = h - 8 * j < 8 ? h - 8 * j : 8;
    const float *base = xp + 8 * j * w;
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < wo; t0 += 8) {
        __m256 a[8];
        for (int tt = 0; tt < 8; tt++) {
            int64_t t = t0 + tt, cnt = w - 8 * t < 8 ? w - 8 * t : 8;
            if (t >= wo) {
                a[tt] = zero;
                continue;
            }
            __m256 v[8];
            __m256i keep = _mm256_set1_epi32(-1); /* a short tile (the row's last): its values */
            if (cnt < 8)
                keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cnt),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            for (int r = 0; r < 8; r++) {
                const float *p = base + r * w + 8 * t;
                v[r] = r >= rows ? zero : cnt == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, keep);
            }
            transpose8x8(v);
            __m256 sum = _mm256_add_ps(zero, v[0]);
            for (int k = 1; k < cnt; k++) sum = _mm256_add_ps(sum, v[k]);
            a[tt] = _mm256_div_ps(sum, _mm256_set1_ps((float)cnt));
        }
        transpose8x8(a);
        __m256 col = _mm256_add_ps(zero, a[0]);
        for (int r = 1; r < rows; r++) col = _mm256_add_ps(col, a[r]);
        float lanes[8];
        _mm256_storeu_ps(lanes, col);
        memcpy(o + t0, lanes, (size_t)(wo - t0 < 8 ? wo - t0 : 8) * 4);
    }
    return finish_means(o, wo, rows, bf16, o16);
}
#endif

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
#if defined(__AVX2__)
    if (ph && pw && blk == 8) { /* rows of a few tiles and a short one: tile row by tile row */
#pragma omp parallel for schedule(static) num_threads(THREADS(planes * h * w)) reduction(| : status)
        for (int64_t it = 0; it < planes * ho; it++)
            status |= tile_row_means8(x + it / ho * h * w, h, w, it % ho, bf16, low + it * wo,
                                      low16 ? low16 + it * wo : 0);
        return status;
    }
#endif
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

/* Whether tile_lows serves the span i0 .. i0 + len: the default block on rows of whole
 * tiles, the span on whole tiles. */
static inline int tiled_span(int64_t i0, int64_t len, int64_t w, int64_t blk, int pw) {
    return pw && blk == 8 && w % 8 == 0 && i0 % 8 == 0 && len % 8 == 0;
}

/* The values of low over the 8 flat elements i0 + 8c .. of the (planes, h, w) view, for
 * c < len / 8 (tiled_span): without pooled rows, low's tiles lie in the same order as x's,
 * so the span's are low + i0 / 8 itself (a copy into lv only for the span that reaches
 * low's end: tiles16 reads one value past a span; a copy per tile took a tenth of a 1-D
 * tensor's encode and a quarter of its decode); with pooled rows, copied into lv, a counter
 * per tile and per row (upsample_span's loop costs 3x as much on rows of a few tiles). The
 * callers add or subtract them 8 values at a time, with no buffer of the upsampled values. */
static const float *tile_lows(const float *low, int64_t i0, int64_t len, int64_t h, int64_t w,
                              int ph, float *lv) {
    int64_t ho = ph ? (h + 7) / 8 : h, wo = w / 8, n = h * w;
    int64_t c = i0 / 8, cend = (i0 + len) / 8, t = c % wo, rows = c / wo;
    if (!ph && (i0 + len) % n != 0) return low + c; /* not the last row of a plane */
    int64_t row = rows % h, pl = rows / h, base = (pl * ho + (ph ? row / 8 : row)) * wo;
    for (float *u = lv; c < cend; c++, u++) { /* a counter per tile and per row */
        *u = low[base + t];
        if (++t == wo) {
            t = 0;
            if (++row == h) row = 0, pl++;
            base = (pl * ho + (ph ? row / 8 : row)) * wo;
        }
    }
    return lv;
}

/* up[k] = the value of low over flat element i0 + k (k < len) of the (planes, h, w) view:
 * row by row, and along a row tile by tile (pw) or element by element (no division per
 * element or per tile); the callers then add or subtract up in loops that vectorize
 * (spans that tiled_span serves take tile_lows instead). */
static void upsample_span(const float *low, int64_t i0, int64_t len, int64_t h, int64_t w,
                          int64_t blk, int ph, int pw, float *up) {
    int64_t ho = ph ? (h + blk - 1) / blk : h, wo = pw ? (w + blk - 1) / blk : w;
    int64_t i = i0, end = i0 + len, col = i % w, rr = i / w;
    int64_t k0 = 0, row = rr % h, pl = rr / h; /* divisions once, then counters */
    int64_t trow = ph ? row / blk : row, rin = ph ? row % blk : 0;
    while (i < end) {
        int64_t seg = w - col < end - i ? w - col : end - i;
        const float *lrow = low + (pl * ho + trow) * wo;
        float *u = up + k0;
#if defined(__AVX512F__)
        if (pw && blk == 8 && col % 8 + seg <= 128) { /* the default block, a row of <= 16
            tiles (28x28, 14x14, 7x7 maps): 16 values a step, each lane's tile picked from
            the row's tiles in one register (the loops below ran a few values each) */
            __m512 tiles = _mm512_maskz_loadu_ps(lanes16((col % 8 + seg + 7) / 8), lrow + col / 8);
            __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            for (int64_t q = 0; q < seg; q += 16) {
                __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(col % 8 + q)));
                __m512 v = _mm512_permutexvar_ps(_mm512_srli_epi32(at, 3), tiles);
                if (seg - q >= 16)
                    _mm512_storeu_ps(u + q, v);
                else
                    _mm512_mask_storeu_ps(u + q, lanes16(seg - q), v);
            }
        } else
#endif
        if (pw && blk == 8 && col % 8 == 0) { /* the default block, from a tile's start */
            const float *ltile = lrow + col / 8;
            int64_t whole = seg / 8;
            for (int64_t q = 0; q < whole; q++)
                for (int k = 0; k < 8; k++) u[8 * q + k] = ltile[q];
            for (int64_t t = 8 * whole; t < seg; t++) u[t] = ltile[whole]; /* a short tile */
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

/* r[k] = p[k] - r[k] for k < len (len <= CHUNK; with lv, p[k] - lv[k / 8], see tile_lows),
 * with p's min (*lo), smallest positive value (*min_pos, inf if none) and zero bits
 * (zero_bits' layout, into out) from the same loads where AVX-512 is there (one pass
 * instead of three: a tenth of division's encode). */
static inline void subtract_scan(const float *p, float *r, int64_t len, uint8_t *out, float *lo,
                                 float *min_pos, const float *lv) {
#if defined(__AVX512F__)
    __m512 mn = _mm512_set1_ps(INFINITY), mp = mn, zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < len; i += 16) {
        __mmask16 m = lanes16(len - i);
        __m512 v = _mm512_maskz_loadu_ps(m, p + i);
        __m512 up = lv ? tiles16(lv + i / 8) : _mm512_maskz_loadu_ps(m, r + i);
        __m512 d = _mm512_sub_ps(v, up);
        if (m == 0xFFFF) /* a masked store costs several times a plain one on an AMD EPYC */
            _mm512_storeu_ps(r + i, d);
        else
            _mm512_mask_storeu_ps(r + i, m, d);
        mn = _mm512_mask_min_ps(mn, m, v, mn);
        mp = _mm512_mask_min_ps(mp, m & _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ), v, mp);
        uint16_t z = m & _mm512_cmp_ps_mask(v, zero, _CMP_EQ_OQ);
        put_bits16(out + i / 8, z, len - i);
    }
    *lo = fold_min(mn);
    *min_pos = fold_min(mp);
#else
    if (lv)
        for (int64_t k = 0; k < len; k++) r[k] = p[k] - lv[k / 8];
    else
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
        float xl, xp, lv[CHUNK / 8 + 1];
        if (tiled_span(i0, len, w, blk, pw)) { /* a call each: each inlined for its case */
            subtract_scan(p, r, len, zbits + i0 / 8, &xl, &xp, tile_lows(low, i0, len, h, w, ph, lv));
        } else {
            upsample_span(low, i0, len, h, w, blk, ph, pw, r);
            subtract_scan(p, r, len, zbits + i0 / 8, &xl, &xp, 0);
        }
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
        pack_groups(r, len, pad, i0, gs, m, bits, out_lo + g0, iv, tp, z, key,
                    codes + g0 * (gs * bits / 8)); /* gs <= CHUNK: the caller checks */
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
        const uint8_t *zm = zmask ? zmask + i0 / 8 : 0;
        if (tiled_span(i0, len, w, blk, pw)) { /* the averages added as finish_chunk reads o */
            float lv[CHUNK / 8 + 1];
            finish_chunk(o, len, fmax, zm, min_pos, tile_lows(low, i0, len, h, w, ph, lv));
            continue;
        }
        float up[CHUNK];
        upsample_span(low, i0, len, h, w, blk, ph, pw, up);
        for (int64_t k = 0; k < len; k++) o[k] = o[k] + up[k];
        finish_chunk(o, len, fmax, zm, min_pos, 0);
    }
    return 0;
}
