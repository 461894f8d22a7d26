/* quant (and split, its two parts): the encode in one pass over each group, the unpack,
 * the noise for the tests, and the expected rounding variance per width (acgc). */
#include "fastcpu.h"

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
        /* as many of the block's groups a pack_groups call as CHUNK holds (all 16 at up
         * to 256 values a group); groups beyond CHUNK a chunk at a time (pack_span) */
        int per = gs <= CHUNK ? (int)(CHUNK / gs) : 1;
        for (int k = 0; k < m; k += per) {
            int64_t i0 = (g0 + k) * gs;
            uint8_t *out = codes + (g0 + k) * (gs * bits / 8);
            if (gs > CHUNK)
                pack_span(x + i0, n - i0, x[n - 1], i0, gs, bits, out_lo[g0 + k], iv[k], tp[k],
                          z[k], key, out);
            else
                pack_groups(x + i0, n - i0, x[n - 1], i0, gs, m - k < per ? m - k : per, bits,
                            out_lo + g0 + k, iv + k, tp + k, z + k, key, out);
        }
    }
    return status & 2 ? 2 : status;
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
