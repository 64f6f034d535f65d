/* Group-of-32 dots over weights repacked at load (x86, AVX2 and up): 16 rows interleaved, a 4-byte unit at a time.
 *
 * cpu_native_groups.h includes this on x86 builds with AVX2 (after cpu_native_groups_tiles.h where AVX-512 VNNI
 * is there), written once against cpu_native_vec16.h's vectors: 16 rows a register on AVX-512, 8 on AVX2. At one
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
 * the file's layout (row_dot_tokens reads them); its rows must be whole chunks (k a multiple of 256). On AVX2
 * the int32 sums are vpmaddubsw's pair sums (exact: the bounds are at g16_sums), and each chunk runs in two halves
 * of 8 rows, a one-token pass running the mins' chains first, on their own.
 */

#define GROUP_ROWS16 16
#ifndef G16_AHEAD
#define G16_AHEAD 1 /* chunks of software prefetch ahead (0: none; 2 and 4 were no faster on a Zen 4) */
#endif
#if V16_LANES == 16
#define G16_TOKENS 4 /* tokens a pass of g16_dot_tokens shares each weight load with */
#else
#define G16_MINS_APART 1
#define G16_TOKENS 2
#endif

static inline kv_i g16_x4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return kv_set1_32(v);
}

/* Group lane j's integer sums over the chunk at w (its activations at x), for the rows of `half`: each row's
 * lane the sum of its 32 products. bits a constant where inlined. */
static inline __attribute__((always_inline)) kv_i g16_sums(const uint8_t *w, int j, int bits, int half,
                                                           const int8_t *x) {
    const kv_i low = kv_set1_8(0x0f);
    kv_i a = kv_zero(), b = kv_zero(); /* (two chains: the dot products overlap) */
    if (bits == 4) {
        for (int s = 0; s < 4; s++) {
            kv_i v = kv_load(w, 4 * j + s, half);
            kv_i lo = kv_and(v, low), hi = kv_and(kv_srli16(v, 4), low);
#ifdef KV_PAIRS16 /* (exact: |4 units' pair sums, twice| <= 8 * 2 * 15 * 127 < 32767) */
            a = _mm256_add_epi16(a, _mm256_maddubs_epi16(lo, g16_x4(x + 32 * s + 4 * j)));
            b = _mm256_add_epi16(b, _mm256_maddubs_epi16(hi, g16_x4(x + 128 + 32 * s + 4 * j)));
#else
            a = kv_dpbusd(a, lo, g16_x4(x + 32 * s + 4 * j));
            b = kv_dpbusd(b, hi, g16_x4(x + 128 + 32 * s + 4 * j));
#endif
        }
#ifdef KV_PAIRS16
        return _mm256_madd_epi16(_mm256_add_epi16(a, b), _mm256_set1_epi16(1));
#endif
    } else
        for (int s = 0; s < 8; s += 2) {
            a = kv_dpbusd8(a, kv_load(w, 8 * j + s, half), g16_x4(x + 32 * s + 4 * j));
            b = kv_dpbusd8(b, kv_load(w, 8 * j + s + 1, half), g16_x4(x + 32 * s + 32 + 4 * j));
        }
    return kv_add(a, b);
}

/* A group lane's scales for the rows of `half` (d, m: the group's [16] fp16; m NULL: -2^(bits - 1) d, a
 * symmetric format's, exactly) */
static inline kv_f g16_mins(const uint16_t *m, kv_f dv, int bits, int half) {
    return m ? kv_load_f16(m, half) : kv_mul_ps(dv, kv_set1_ps(-(float)(1 << (bits - 1))));
}

/* hsum8's tree over the 8 group lanes' acc + mins (lanes i + 4, then i + 2, then i + 1), then + 0 (row_dot_finish's
 * empty rest), into out */
static inline void g16_store(const kv_f v[8], float *out) {
    kv_f sum = kv_add_ps(kv_add_ps(kv_add_ps(v[0], v[4]), kv_add_ps(v[2], v[6])),
                         kv_add_ps(kv_add_ps(v[1], v[5]), kv_add_ps(v[3], v[7])));
    kv_store_ps(out, kv_add_ps(sum, kv_zero_ps()));
}

/* The 16 interleaved rows at q (d, m: their [group][16] scales and mins; m NULL: a symmetric format's, Q4_0's and
 * Q8_0's, whose mins need not be read) against one token (xq, xd, xs as quantize_groups_q8 wrote them): out[r].
 * The chunks in order, each chunk's 16 / V16_LANES halves in turn (AVX2's second half finds the chunk in L1: the
 * read from DRAM stays steady, where a whole pass of the group a half at a time left it idle through the second
 * pass: bench/RESULTS.md, fourteenth session), prefetching a chunk ahead.
 * bits a constant where inlined. */
static inline __attribute__((always_inline)) void g16_dot(const uint8_t *q, const uint16_t *d, const uint16_t *m,
                                                         int groups, int bits, const int8_t *xq, const float *xd,
                                                         const float *xs, float out[GROUP_ROWS16]) {
    enum { HALVES = GROUP_ROWS16 / V16_LANES };
    const int units = 8 * bits; /* a chunk's 4-byte units */
    kv_f acc[HALVES][8], mins[HALVES][8];
    for (int half = 0; half < HALVES; half++)
        for (int j = 0; j < 8; j++) acc[half][j] = mins[half][j] = kv_zero_ps();
#ifdef G16_MINS_APART /* (each lane's mins chain first, on its own: the main loop's registers then hold only acc) */
    for (int c = 0; c < groups / 8; c++)
        for (int half = 0; half < HALVES; half++)
            for (int j = 0; j < 8; j++) {
                const int g = 8 * c + j;
                kv_f dv = kv_load_f16(d + g * GROUP_ROWS16, half);
                mins[half][j] = kv_fmadd_ps(g16_mins(m ? m + g * GROUP_ROWS16 : NULL, dv, bits, half),
                                            kv_set1_ps(xs[g]), mins[half][j]);
            }
#endif
    for (int c = 0; c < groups / 8; c++) {
        const uint8_t *w = q + (int64_t)c * units * 64;
        if (G16_AHEAD)
            for (int l = 0; l < units * 64; l += 64) __builtin_prefetch(w + G16_AHEAD * units * 64 + l, 0, 0);
        for (int half = 0; half < HALVES; half++)
#pragma GCC unroll 8 /* (acc[j] and mins[j] stay in registers only with j a constant) */
            for (int j = 0; j < 8; j++) {
                const int g = 8 * c + j;
                kv_i sums = g16_sums(w, j, bits, half, xq + c * 256);
                kv_f dv = kv_load_f16(d + g * GROUP_ROWS16, half);
                acc[half][j] = kv_fmadd_ps(kv_cvt(sums), kv_mul_ps(dv, kv_set1_ps(xd[g])), acc[half][j]);
#ifndef G16_MINS_APART
                mins[half][j] = kv_fmadd_ps(g16_mins(m ? m + g * GROUP_ROWS16 : NULL, dv, bits, half),
                                            kv_set1_ps(xs[g]), mins[half][j]);
#endif
            }
    }
    for (int half = 0; half < HALVES; half++) {
        kv_f v[8];
        for (int j = 0; j < 8; j++) v[j] = kv_add_ps(acc[half][j], mins[half][j]);
        g16_store(v, out + V16_LANES * half);
    }
}

/* g16_dot for T tokens (2 <= T <= G16_TOKENS, a constant where inlined; token t's xq at + t k, its xd and xs at
 * + t groups): out[t][r]. Group lane by group lane (its accumulators for T tokens fit the registers where all 8
 * lanes' would not), each unit loaded and its nibbles split once for the T tokens; a lane's chunks in order, so
 * each token's operations and their order are g16_dot's: the same bits. The 16 rows' data come from L1/L2 after
 * the first lane (a batch's few tokens: several decodes, a speculative verify). */
static inline __attribute__((always_inline)) void g16_dot_tokens(const uint8_t *q, const uint16_t *d,
                                                                const uint16_t *m, int groups, int bits, int T,
                                                                const int8_t *xq, const float *xd, const float *xs,
                                                                int64_t k, float out[G16_TOKENS][GROUP_ROWS16]) {
    const kv_i low = kv_set1_8(0x0f);
    const int units = 8 * bits, steps = bits; /* a chunk's units; a group's (4, or 8 on 8 bits) */
    for (int half = 0; half < GROUP_ROWS16 / V16_LANES; half++) {
        kv_f v[G16_TOKENS][8];
        for (int j = 0; j < 8; j++) {
            kv_f acc[G16_TOKENS], mins[G16_TOKENS];
            for (int t = 0; t < T; t++) acc[t] = mins[t] = kv_zero_ps();
            for (int c = 0; c < groups / 8; c++) {
                const uint8_t *w = q + (int64_t)c * units * 64;
                kv_i a[G16_TOKENS], b[G16_TOKENS];
                for (int t = 0; t < T; t++) a[t] = b[t] = kv_zero();
                for (int s = 0; s < steps; s++) {
                    kv_i u = kv_load(w, j * steps + s, half);
                    kv_i lo = bits == 4 ? kv_and(u, low) : u, hi = kv_and(kv_srli16(u, 4), low);
                    for (int t = 0; t < T; t++) {
                        const int8_t *x = xq + t * k + c * 256 + 32 * s + 4 * j;
                        if (bits == 4) {
#ifdef KV_PAIRS16 /* (g16_sums' int16 pair sums) */
                            a[t] = _mm256_add_epi16(a[t], _mm256_maddubs_epi16(lo, g16_x4(x)));
                            b[t] = _mm256_add_epi16(b[t], _mm256_maddubs_epi16(hi, g16_x4(x + 128)));
#else
                            a[t] = kv_dpbusd(a[t], lo, g16_x4(x));
                            b[t] = kv_dpbusd(b[t], hi, g16_x4(x + 128));
#endif
                        } else if (s % 2 == 0)
                            a[t] = kv_dpbusd8(a[t], lo, g16_x4(x));
                        else
                            b[t] = kv_dpbusd8(b[t], lo, g16_x4(x));
                    }
                }
                const int g = 8 * c + j;
                kv_f dv = kv_load_f16(d + g * GROUP_ROWS16, half);
                kv_f mv = g16_mins(m ? m + g * GROUP_ROWS16 : NULL, dv, bits, half);
                for (int t = 0; t < T; t++) {
#ifdef KV_PAIRS16
                    kv_i sums = bits == 4 ? _mm256_madd_epi16(_mm256_add_epi16(a[t], b[t]), _mm256_set1_epi16(1))
                                          : kv_add(a[t], b[t]);
#else
                    kv_i sums = kv_add(a[t], b[t]);
#endif
                    acc[t] = kv_fmadd_ps(kv_cvt(sums), kv_mul_ps(dv, kv_set1_ps(xd[t * groups + g])), acc[t]);
                    mins[t] = kv_fmadd_ps(mv, kv_set1_ps(xs[t * groups + g]), mins[t]);
                }
            }
            for (int t = 0; t < T; t++) v[t][j] = kv_add_ps(acc[t], mins[t]);
        }
        for (int t = 0; t < T; t++) g16_store(v[t], out[t] + V16_LANES * half);
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
#if G16_TOKENS == 4
            case 48 + 4: g16_dot_tokens(qp, dp, mp, groups, 4, 3, xt, xdt, xst, k, out); break;
            case 48 + 8: g16_dot_tokens(qp, dp, mp, groups, 8, 3, xt, xdt, xst, k, out); break;
            case 64 + 4: g16_dot_tokens(qp, dp, mp, groups, 4, 4, xt, xdt, xst, k, out); break;
            case 64 + 8: g16_dot_tokens(qp, dp, mp, groups, 8, 4, xt, xdt, xst, k, out); break;
#endif
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
