/* Group-of-32 dots over weights repacked at load (AVX-512 VNNI): 16 rows interleaved, a 4-byte unit at a time.
 *
 * cpu_native_groups.h includes this where AVX-512 VNNI is there (after cpu_native_groups_tiles.h). At one
 * token row_dot_tokens reads a row's chunk of 8 groups, dots it in 256-bit lanes (lane l: group l) and ends
 * each row in a horizontal sum: on a Zen 4 its stream from DRAM ran at 24-35 GB/s where the K-quants'
 * interleaved rows (cpu_native_kquants_rows16.h) run at 35-50. Here (BlockWeight.interleave writes the
 * layout) the rows go in groups of 16, and a group's rows are cut in 4-byte units stored unit by unit, the 16
 * rows' copies of a unit together (64 bytes, one vector), a chunk's units group by group: a 4-bit chunk's unit
 * 4 j + s holds the 4 values of group j's step s (the activations' bytes 32 s + 4 j) in its low nibbles and
 * those of step s + 4 in its high ones; an 8-bit chunk's unit 8 j + s holds step s. One vpdpbusd against 4
 * activations broadcast adds 4 products into each row's int32 lane, and a thread reads its weights in order
 * (a group's units 512 bytes apart, as the file orders them, streamed ~25% slower from DRAM on a Zen 4). The
 * scales and mins go [group][16 rows], one fp16 vector a group; a symmetric format's mins (-2^(bits - 1) times
 * the scale, exactly) are not stored at all, a tenth of Q4_0's bytes.
 *
 * The arithmetic is row_dot_tokens' lane by lane, as cpu_native_groups_tiles.h's is: group lane j's
 * accumulators are vectors over the 16 rows, acc = fma(sum, d xd, acc) and mins = fma(m, xs, mins) chunk
 * after chunk, then hsum8's tree across the 8 lanes and + 0: the same bits. A matrix's last rows % 16 stay in
 * the file's layout (row_dot_tokens reads them); its rows must be whole chunks (k a multiple of 256).
 */

#define GROUP_ROWS16 16
#ifndef G16_AHEAD
#define G16_AHEAD 1 /* chunks of software prefetch ahead (0: none; 2 and 4 were no faster on a Zen 4) */
#endif

/* The 16 interleaved rows at q (d, m: their [group][16] scales and mins; m NULL: -2^(bits - 1) d, a symmetric
 * format's, Q4_0's and Q8_0's, whose mins need not be read) against one token (xq, xd, xs as
 * quantize_groups_q8 wrote them): out[r]. bits a constant where inlined. */
static inline __attribute__((always_inline)) void g16_dot(const uint8_t *q, const uint16_t *d, const uint16_t *m,
                                                         int groups, int bits, const int8_t *xq, const float *xd,
                                                         const float *xs, float out[GROUP_ROWS16]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int units = 8 * bits; /* a chunk's 4-byte units */
    __m512 acc[8], mins[8];
    for (int j = 0; j < 8; j++) acc[j] = mins[j] = _mm512_setzero_ps();
    for (int c = 0; c < groups / 8; c++) {
        const uint8_t *w = q + (int64_t)c * units * 64;
        const int8_t *x = xq + c * 256;
        if (G16_AHEAD)
            for (int l = 0; l < units * 64; l += 64) __builtin_prefetch(w + G16_AHEAD * units * 64 + l, 0, 0);
#pragma GCC unroll 8 /* (acc[j] and mins[j] stay in registers only with j a constant) */
        for (int j = 0; j < 8; j++) {
            __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512(); /* (two chains: the dpbusd overlap) */
            int32_t x0, x1;
            if (bits == 4)
                for (int s = 0; s < 4; s++) {
                    __m512i v = _mm512_loadu_si512((const void *)(w + (4 * j + s) * 64));
                    memcpy(&x0, x + 32 * s + 4 * j, 4), memcpy(&x1, x + 128 + 32 * s + 4 * j, 4);
                    a = _mm512_dpbusd_epi32(a, _mm512_and_si512(v, low), _mm512_set1_epi32(x0));
                    b = _mm512_dpbusd_epi32(b, _mm512_and_si512(_mm512_srli_epi16(v, 4), low), _mm512_set1_epi32(x1));
                }
            else
                for (int s = 0; s < 8; s += 2) {
                    memcpy(&x0, x + 32 * s + 4 * j, 4), memcpy(&x1, x + 32 * s + 32 + 4 * j, 4);
                    a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512((const void *)(w + (8 * j + s) * 64)),
                                            _mm512_set1_epi32(x0));
                    b = _mm512_dpbusd_epi32(b, _mm512_loadu_si512((const void *)(w + (8 * j + s + 1) * 64)),
                                            _mm512_set1_epi32(x1));
                }
            const int g = 8 * c + j;
            __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + g * GROUP_ROWS16)));
            __m512 mv = m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + g * GROUP_ROWS16)))
                          : _mm512_mul_ps(dv, _mm512_set1_ps(-(float)(1 << (bits - 1)))); /* (exact) */
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a, b)), _mm512_mul_ps(dv, _mm512_set1_ps(xd[g])),
                                     acc[j]);
            mins[j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[g]), mins[j]);
        }
    }
    __m512 v[8];
    for (int j = 0; j < 8; j++) v[j] = _mm512_add_ps(acc[j], mins[j]);
    /* hsum8's tree: lanes i + 4, then i + 2, then i + 1; then + 0 (row_dot_finish's empty rest) */
    __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[4]), _mm512_add_ps(v[2], v[6])),
                               _mm512_add_ps(_mm512_add_ps(v[1], v[5]), _mm512_add_ps(v[3], v[7])));
    _mm512_storeu_ps(out, _mm512_add_ps(sum, _mm512_setzero_ps()));
}

#define G16_TOKENS 4 /* tokens a pass of g16_dot_tokens shares each weight load with */

/* g16_dot for T tokens (2 <= T <= G16_TOKENS, a constant where inlined; token t's xq at + t k, its xd and xs at
 * + t groups): out[t][r]. Group lane by group lane (its accumulators for T tokens fit the registers where all 8
 * lanes' would not), each unit loaded and its nibbles split once for the T tokens; a lane's chunks in order, so
 * each token's operations and their order are g16_dot's: the same bits. The 16 rows' data come from L1/L2 after
 * the first lane (a batch's few tokens: several decodes, a speculative verify). */
static inline __attribute__((always_inline)) void g16_dot_tokens(const uint8_t *q, const uint16_t *d,
                                                                const uint16_t *m, int groups, int bits, int T,
                                                                const int8_t *xq, const float *xd, const float *xs,
                                                                int64_t k, float out[G16_TOKENS][GROUP_ROWS16]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int units = 8 * bits, steps = bits; /* a chunk's units; a group's (4, or 8 on 8 bits) */
    __m512 v[8][G16_TOKENS];
    for (int j = 0; j < 8; j++) {
        __m512 acc[G16_TOKENS], mins[G16_TOKENS];
        for (int t = 0; t < T; t++) acc[t] = mins[t] = _mm512_setzero_ps();
        for (int c = 0; c < groups / 8; c++) {
            const uint8_t *w = q + ((int64_t)c * units + j * steps) * 64;
            __m512i a[G16_TOKENS], b[G16_TOKENS];
            for (int t = 0; t < T; t++) a[t] = b[t] = _mm512_setzero_si512();
            for (int s = 0; s < steps; s++) {
                __m512i u = _mm512_loadu_si512((const void *)(w + s * 64));
                __m512i lo = bits == 4 ? _mm512_and_si512(u, low) : u;
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(u, 4), low);
                for (int t = 0; t < T; t++) {
                    const int8_t *x = xq + t * k + c * 256 + 32 * s + 4 * j;
                    int32_t x0, x1;
                    memcpy(&x0, x, 4);
                    if (bits == 4) {
                        memcpy(&x1, x + 128, 4);
                        a[t] = _mm512_dpbusd_epi32(a[t], lo, _mm512_set1_epi32(x0));
                        b[t] = _mm512_dpbusd_epi32(b[t], hi, _mm512_set1_epi32(x1));
                    } else if (s % 2 == 0) {
                        a[t] = _mm512_dpbusd_epi32(a[t], lo, _mm512_set1_epi32(x0));
                    } else {
                        b[t] = _mm512_dpbusd_epi32(b[t], lo, _mm512_set1_epi32(x0));
                    }
                }
            }
            const int g = 8 * c + j;
            __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + g * GROUP_ROWS16)));
            __m512 mv = m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + g * GROUP_ROWS16)))
                          : _mm512_mul_ps(dv, _mm512_set1_ps(-(float)(1 << (bits - 1))));
            for (int t = 0; t < T; t++) {
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a[t], b[t])),
                                         _mm512_mul_ps(dv, _mm512_set1_ps(xd[t * groups + g])), acc[t]);
                mins[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[t * groups + g]), mins[t]);
            }
        }
        for (int t = 0; t < T; t++) v[j][t] = _mm512_add_ps(acc[t], mins[t]);
    }
    for (int t = 0; t < T; t++) { /* hsum8's tree, then + 0, as g16_dot */
        __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v[0][t], v[4][t]), _mm512_add_ps(v[2][t], v[6][t])),
                                   _mm512_add_ps(_mm512_add_ps(v[1][t], v[5][t]), _mm512_add_ps(v[3][t], v[7][t])));
        _mm512_storeu_ps(out[t], _mm512_add_ps(sum, _mm512_setzero_ps()));
    }
}

/* y [rows, ldy] columns 0 .. n16 (a multiple of 16) = the tokens @ the interleaved rows 0 .. n16: each thread
 * its groups of 16 rows in turn (one sequential stream), the tokens G16_TOKENS a pass against a group while it is
 * in cache (one token: g16_dot, which reads the group once, in order). */
static void groups_rows16_to(const uint8_t *q, const uint16_t *d, const uint16_t *m, int bits, int groups, int rows,
                             const int8_t *xq, const float *xd, const float *xs, int64_t k, int n16, void *y,
                             int64_t ldy, int y_f32, int threads) {
    const int64_t group_bytes = GROUP_ROWS16 * k * bits / 8, group_scales = (int64_t)GROUP_ROWS16 * groups;
#ifndef G16_SCHED
#define G16_SCHED static /* (a thread's groups one stream; dynamic chunks of 4 or 16 groups gained nothing) */
#endif
#pragma omp parallel for schedule(G16_SCHED) num_threads(threads)
    for (int p = 0; p < n16 / GROUP_ROWS16; p++)
        for (int t = 0; t < rows; t += G16_TOKENS) {
            int T = rows - t < G16_TOKENS ? rows - t : G16_TOKENS;
            float out[G16_TOKENS][GROUP_ROWS16];
            const uint8_t *qp = q + p * group_bytes;
            const uint16_t *dp = d + p * group_scales, *mp = m ? m + p * group_scales : NULL;
            const int8_t *xt = xq + t * k;
            const float *xdt = xd + (int64_t)t * groups, *xst = xs + (int64_t)t * groups;
            switch (T * 16 + bits) { /* (each pair its own unrolled copy) */
            case 16 + 4: g16_dot(qp, dp, mp, groups, 4, xt, xdt, xst, out[0]); break;
            case 16 + 8: g16_dot(qp, dp, mp, groups, 8, xt, xdt, xst, out[0]); break;
            case 32 + 4: g16_dot_tokens(qp, dp, mp, groups, 4, 2, xt, xdt, xst, k, out); break;
            case 32 + 8: g16_dot_tokens(qp, dp, mp, groups, 8, 2, xt, xdt, xst, k, out); break;
            case 48 + 4: g16_dot_tokens(qp, dp, mp, groups, 4, 3, xt, xdt, xst, k, out); break;
            case 48 + 8: g16_dot_tokens(qp, dp, mp, groups, 8, 3, xt, xdt, xst, k, out); break;
            case 64 + 4: g16_dot_tokens(qp, dp, mp, groups, 4, 4, xt, xdt, xst, k, out); break;
            default: g16_dot_tokens(qp, dp, mp, groups, 8, 4, xt, xdt, xst, k, out); break;
            }
            for (int u = 0; u < T; u++)
                for (int r = 0; r < GROUP_ROWS16; r++) {
                    int64_t at = (int64_t)(t + u) * ldy + p * GROUP_ROWS16 + r;
                    if (y_f32)
                        ((float *)y)[at] = out[u][r];
                    else
                        ((uint16_t *)y)[at] = f32_to_bf16(out[u][r]);
                }
        }
}
