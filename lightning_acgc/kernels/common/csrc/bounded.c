/* bounded (COMET's error-bounded codec): group statistics, the per-group plan, the pack
 * with its check of every decoded value, the unpack. */
#include "fastcpu.h"

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

/* 2^e for -1022 <= e <= 1023, exactly (the bits of a double: ldexp was a call a use, a
 * third of the plan's time). */
static inline double pow2_of(int e) {
    uint64_t b = (uint64_t)(e + 1023) << 52;
    double r;
    memcpy(&r, &b, 8);
    return r;
}

/* plan.py's _ulp: the spacing of a format with mant mantissa bits and smallest normal
 * exponent emin in the binade of mag (float64, >= 0). */
static inline double ulp_of(double mag, int mant, int emin) {
    uint64_t b;
    memcpy(&b, &mag, 8);
    b &= 0x7FF0000000000000ULL; /* 2^floor(log2 mag), exactly */
    double pow2;
    memcpy(&pow2, &b, 8);
    double r = pow2 * pow2_of(-mant), least = pow2_of(emin - mant);
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
        /* frexpf's exponent of a coded top (an integer in [0, top_code]; 0 for 0), from
         * its bits (the call was a fifth of the plan's time) */
        uint32_t tb = coded ? bits_of(top) : 0u;
        int e = tb ? (int)((tb >> 23) & 0xFFu) - 126 : 0;
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

/* 1 where no value of a coded group (lo l, |step| s, width w) can decode further than eb32
 * from itself, so that its check may be skipped (the pack's check costs as much as its
 * coding). |x̂ - x| is at most s / 2 (the rounding to a code) plus the float32 rounding of
 * x - l, its division by s, q * s and the + l, each within a unit roundoff u = 2^-24 of a
 * magnitude below 2M + s, where M = |l| + (2^w + 1) s bounds the group's values (its top
 * code is at most 2^w - 1), plus 2^-150 each in the subnormal range, and the cast to the
 * output kind, half its spacing at M + s: taken here as 16u(M + s) + 2^-147 and a whole
 * spacing, about twice what that sum needs. Far from float32's largest values (no clamp). */
static inline int group_safe(float l, float s, int w, int kind, float eb32) {
    double m = fabs((double)l) + (double)((1 << w) + 1) * (double)s + (double)s;
    double err = 0.5 * (double)s + 16.0 * 0x1p-24 * m + 0x1p-147;
    if (kind != 0) err += ulp_of(m, kind == 1 ? 10 : 7, kind == 1 ? -14 : -126);
    return m < 1e37 && err < (double)eb32;
}

#define PACK_GROUPS 16 /* groups a work item of the pack encodes, in order (see room) */

/* Encode: per group g of kind width[g] (0 constant, 1..16 coded, 255 raw) with lo/step from
 * the plan, the codes round((x - lo) / |step|) (half to even; +1 in zero-kept groups, 0 at
 * zeros) packed from byte off[g] as a little-endian bit stream; then, if check, each
 * element's decoded value (cast to kind) compared with x: |x̂ - x| < eb32 or it violates,
 * eb32 the largest float32 <= eb. Returns the number of violators among the first n
 * elements; flags (if not NULL) gets 1 at each. The tail group is padded with x[n - 1].
 * A work item's groups are packed in order, each with the room up to the item's last code:
 * a group's last whole store spills into the next group's bytes, which it then writes. */
int64_t acgc_bounded_pack(const float *x, int64_t n, int64_t gs, const uint8_t *width,
                          const float *lo, const float *step, const int64_t *off, double eb,
                          float top, int kind, int check, uint8_t *codes, uint8_t *flags,
                          int nthreads) {
    int64_t groups = (n + gs - 1) / gs, violators = 0;
    int64_t blocks = (groups + PACK_GROUPS - 1) / PACK_GROUPS;
    int last = width[groups - 1];
    int64_t total = off[groups - 1] + (last == 255 ? 0 : last * (gs / 8)); /* bytes of codes */
    float eb32 = f32_down(eb);
#pragma omp parallel for schedule(static) num_threads(THREADS(n)) reduction(+ : violators)
    for (int64_t blk = 0; blk < blocks; blk++) {
        int64_t g1 = (blk + 1) * PACK_GROUPS < groups ? (blk + 1) * PACK_GROUPS : groups;
        int64_t end = g1 < groups ? off[g1] : total; /* the block's codes end: its own room */
        for (int64_t g = blk * PACK_GROUPS; g < g1; g++) {
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
            int safe = group_safe(l, s, w, kind, eb32);
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
                int chk = check && !safe; /* this group's values checked */
#define CODES(CHECK, KIND)                                                                \
    (zk ? bounded_codes(xs, m, valid, l, div, s, 1, top, eb32, CHECK, KIND, q)             \
        : bounded_codes(xs, m, valid, l, div, s, 0, top, eb32, CHECK, KIND, q))
                if (!chk)
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
                    uint8_t *o = out + c0 / 8 * w;
                    pack_bytes_room(qb, m, w, o, codes + end - o);
                } else if (w > 8) {
                    uint32_t qi[CHUNK];
                    for (int64_t j = 0; j < m; j++) qi[j] = (uint32_t)q[j];
                    pack_codes(qi, m, w, out + c0 / 8 * w);
                }
                if (chk) {
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
