/* intpack: saved integer tensors packed without loss (frame of reference per group, and
 * the window mode of max-pooling indices). */
#include "fastcpu.h"

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

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* window_offsets, window_split, the ranges and the codes of the len values at x (k0 ..
 * k0 + len of the flat tensor) in one pass, 16 at a time, row by row: int64 offsets from
 * the corner, their low halves as int32 where in range. One byte per code into q (room for
 * len + 16: a row's last vector writes past it, which the next row overwrites). Returns 0
 * where some value is outside its window; q then holds no stream. */
static int window_codes(const int64_t *restrict x, int64_t k0, int64_t len, int64_t h, int64_t w,
                        int64_t s, int64_t win, int32_t mr, int32_t mc, int kb,
                        uint8_t *restrict q, int32_t ranges[4]) {
    int64_t rem = k0 % (h * w), i = rem / w, j = rem % w, half = win / 2;
    const __m512i lanes = _mm512_mullo_epi64(_mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi64(s));
    const __m512i step = _mm512_set1_epi64(8 * s);
    const int32_t v = (int32_t)win;
    /* lanes 0, 2, .., 30 of two vectors: the low halves of 16 int64 offsets */
    const __m512i low_halves =
        _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i lo = _mm512_set1_epi64(-2 * win), span = _mm512_set1_epi64(5 * win);
    const __m512i c1 = _mm512_set1_epi32(-v), c2 = _mm512_setzero_si512();
    const __m512i c3 = _mm512_set1_epi32(v), c4 = _mm512_set1_epi32(2 * v);
    const __m512i one = _mm512_set1_epi32(1), vv = _mm512_set1_epi32(v);
    const __m512i rr0 = _mm512_set1_epi32(-2), rc0 = _mm512_set1_epi32(2 * v - (int32_t)half);
    const __m512i mrv = _mm512_set1_epi32(mr), mcv = _mm512_set1_epi32(mc);
    const __m128i kbc = _mm_cvtsi32_si128(kb);
    __m512i rlo = _mm512_set1_epi32(INT32_MAX), rhi = _mm512_set1_epi32(INT32_MIN);
    __m512i clo = rlo, chi = rhi;
    __mmask16 bad = 0;
    for (int64_t t0 = 0; t0 < len;) {
        int64_t seg = w - j < len - t0 ? w - j : len - t0;
        uint64_t start = (uint64_t)(s * win * i + s * j) - (uint64_t)half;
        __m512i corner = _mm512_add_epi64(_mm512_set1_epi64((int64_t)start), lanes);
        for (int64_t t = 0; t < seg; t += 16) {
            __mmask16 m = lanes16(seg - t);
            const int64_t *p = x + t0 + t;
            __m512i a = _mm512_sub_epi64(_mm512_maskz_loadu_epi64((__mmask8)m, p), corner);
            corner = _mm512_add_epi64(corner, step);
            __mmask8 m_b = (__mmask8)(m >> 8);
            __m512i b = _mm512_sub_epi64(_mm512_maskz_loadu_epi64(m_b, p + 8), corner);
            corner = _mm512_add_epi64(corner, step);
            /* outside [-2 win, 3 win): outside the window (win < 2**28: int32 holds the rest) */
            __mmask8 out_a = _mm512_mask_cmpge_epu64_mask((__mmask8)m, _mm512_sub_epi64(a, lo), span);
            __mmask8 out_b = _mm512_mask_cmpge_epu64_mask(m_b, _mm512_sub_epi64(b, lo), span);
            bad |= (__mmask16)(out_a | (unsigned)out_b << 8);
            __m512i u = _mm512_permutex2var_epi32(a, low_halves, b);
            /* rr = floor(u / win) in [-2, 2] by comparisons, rc = u - half - rr * win */
            __mmask16 k1 = _mm512_cmpge_epi32_mask(u, c1), k2 = _mm512_cmpge_epi32_mask(u, c2);
            __mmask16 k3 = _mm512_cmpge_epi32_mask(u, c3), k4 = _mm512_cmpge_epi32_mask(u, c4);
            __m512i rr = _mm512_mask_add_epi32(rr0, k1, rr0, one);
            __m512i rc = _mm512_add_epi32(u, rc0);
            rc = _mm512_mask_sub_epi32(rc, k1, rc, vv);
            rr = _mm512_mask_add_epi32(rr, k2, rr, one);
            rc = _mm512_mask_sub_epi32(rc, k2, rc, vv);
            rr = _mm512_mask_add_epi32(rr, k3, rr, one);
            rc = _mm512_mask_sub_epi32(rc, k3, rc, vv);
            rr = _mm512_mask_add_epi32(rr, k4, rr, one);
            rc = _mm512_mask_sub_epi32(rc, k4, rc, vv);
            rlo = _mm512_mask_min_epi32(rlo, m, rlo, rr);
            rhi = _mm512_mask_max_epi32(rhi, m, rhi, rr);
            clo = _mm512_mask_min_epi32(clo, m, clo, rc);
            chi = _mm512_mask_max_epi32(chi, m, chi, rc);
            __m512i code = _mm512_or_si512(_mm512_sll_epi32(_mm512_sub_epi32(rr, mrv), kbc),
                                           _mm512_sub_epi32(rc, mcv));
            _mm_storeu_si128((__m128i *)(q + t0 + t), _mm512_cvtepi32_epi8(code));
        }
        t0 += seg;
        j = 0;
        i = i + 1 == h ? 0 : i + 1;
    }
    ranges[0] = _mm512_reduce_min_epi32(rlo), ranges[1] = _mm512_reduce_max_epi32(rhi);
    ranges[2] = _mm512_reduce_min_epi32(clo), ranges[3] = _mm512_reduce_max_epi32(chi);
    return !bad;
}
#else
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

/* The portable twin of the AVX-512 window_codes: window_offsets, then window_split. */
static int window_codes(const int64_t *restrict x, int64_t k0, int64_t len, int64_t h, int64_t w,
                        int64_t s, int64_t win, int32_t mr, int32_t mc, int kb,
                        uint8_t *restrict q, int32_t ranges[4]) {
    int32_t u[INT_BLOCK];
    int ok = window_offsets(x, k0, len, h, w, s, win, u);
    int32_t a = INT32_MAX, bb = INT32_MIN, c = INT32_MAX, e = INT32_MIN;
    int32_t v = (int32_t)win, hv = (int32_t)(win / 2);
    for (int64_t t = 0; t < len; t++) { /* the offsets, their ranges and codes at once */
        int32_t rr, rc;
        window_split(u[t], v, hv, &rr, &rc);
        a = rr < a ? rr : a;
        bb = rr > bb ? rr : bb;
        c = rc < c ? rc : c;
        e = rc > e ? rc : e;
        q[t] = (uint8_t)(((uint32_t)(rr - mr) << kb) | (uint32_t)(rc - mc));
    }
    ranges[0] = a, ranges[1] = bb, ranges[2] = c, ranges[3] = e;
    return ok;
}
#endif

/* The codes ((rr - mr) << kb) | (rc - mc) of the n values as a width-bit stream into out
 * (width 0..8; 0: nothing written, the ranges only), and the ranges of rr and rc into
 * ranges (min rr, max rr, min rc, max rc). Returns 0 where some value is outside its
 * window (window_offsets). The stream is the format's only where mr, mc, kb and width are
 * the ones the ranges give: the caller packs with a guess (the last tensor's), compares,
 * and packs again if they differ, so a step whose ranges did not change takes one pass. */
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
        uint8_t q[INT_BLOCK + 16];
        int32_t got[4];
        int32_t mr32 = (int32_t)mr, mc32 = (int32_t)mc;
        ok = window_codes(x + i0, i0, len, h, w, s, win, mr32, mc32, kb, q, got) && ok;
        lo_r = got[0] < lo_r ? got[0] : lo_r;
        hi_r = got[1] > hi_r ? got[1] : hi_r;
        lo_c = got[2] < lo_c ? got[2] : lo_c;
        hi_c = got[3] > hi_c ? got[3] : hi_c;
        if (width) { /* whole bytes of 8 codes, then the tail, its last byte's unused bits 0 */
            int64_t whole = len / 8 * 8;
            uint8_t *o = out + i0 / 8 * width;
            pack_bytes(q, whole, width, o);
            if (whole < len) {
                uint8_t tail[8];
                memset(q + len, 0, (size_t)(whole + 8 - len));
                pack_bytes(q + whole, 8, width, tail);
                memcpy(o + whole / 8 * width, tail, (size_t)(((len - whole) * width + 7) / 8));
            }
        }
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
