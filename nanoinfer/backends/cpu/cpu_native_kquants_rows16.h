/* K-quant dots on AVX-512 VNNI over weights repacked at load: 16 rows interleaved per super-block.
 *
 * cpu_native_kquants.h includes this with cpu_native_kquants_tiles.h (AVX-512 VNNI). At one token a
 * matmul reads each weight once, and the dots of cpu_native_kquants_x86.h, reading the file's rows,
 * spent ~60 instructions on each row's super-block (its scales unpacked in a register, a vpmaddubsw
 * and a vpdpwssd for each 32 values, a horizontal sum per row): on a Zen 4 that streamed ~21 GB/s
 * of weights from DRAM where the memory gives ~48. ggml's CPU "repack" keeps Q4_K's rows
 * interleaved for the same reason. Here (nanoinfer.quant.kquants.interleave writes the layout) the
 * rows go in groups of 16, and within a group each super-block's bytes are cut in 4-byte units and
 * stored unit by unit, the 16 rows' copies of a unit together (64 bytes, one vector); Q6_K's
 * trailing 2-byte d goes after all the group's units (so every unit stays 64-byte aligned):
 *   - a unit of values holds 4 consecutive bytes of each row, so after its nibbles (and Q5_K's/Q6_K's
 *     high bits) are masked out, one vpdpbusd against 4 activations broadcast adds 4 products into
 *     each row's int32 lane: a sub-block's dot for 16 rows in 8 (Q6_K: 4) of them, no reduction;
 *   - the scale units hold each row's scale bytes in its lane: a sub-block's 16 scales (and mins)
 *     are two to five shifts and masks, one vpmulld applies them; d and dmin convert 16 at once;
 *   - a thread's groups are one sequential stream, which the hardware prefetcher follows.
 * The sums are the reference's integers and the fp32 step is kq_acc_step's, lane by lane, per
 * super-block in order: the bits of kquants.reference_kquant_matmul. A matrix's last rows % 16 stay
 * in the file's layout (kquant_rows_dot reads them).
 */

#define KQ16 16 /* rows interleaved */
#define KQ16_TOKENS 4 /* tokens a pass, sharing its weight loads */


static inline __m512i kq16_load(const uint8_t *group_block, int unit) {
    return _mm512_loadu_si512((const void *)(group_block + 64 * unit));
}

/* byte j (0-3) of each int32 lane, then masked */
static inline __m512i kq16_byte(__m512i v, int shift, int mask) {
    return _mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(mask));
}

/* Q4_K's/Q5_K's scale (which 0) or min (1) of sub-block j for the 16 rows, as int32 (get_scale_min_k4:
 * the 12 scale bytes in units s1 .. s3) */
static inline __m512i kq16_scale_min(__m512i s1, __m512i s2, __m512i s3, int j, int which) {
    __m512i lowpart = which ? s2 : s1;
    if (j < 4) return kq16_byte(lowpart, 8 * j, 63);
    int i = j - 4;
    return _mm512_or_si512(kq16_byte(s3, 8 * i + 4 * which, 15), kq16_byte(lowpart, 8 * i + 2, 0x30));
}

/* bit `bit` of each byte of qh moved to bit 4, the rest cleared */
static inline __m512i kq16_bit4(__m512i qh, int bit) {
    __m512i at = bit < 4 ? _mm512_slli_epi16(qh, 4 - bit) : bit > 4 ? _mm512_srli_epi16(qh, bit - 4) : qh;
    return _mm512_and_si512(at, _mm512_set1_epi8(0x10));
}

/* kq_acc_step for 16 rows (lanes): acc + ((xd d) sumi - (xd dmin) summ), Q6_K (no mins) acc + (xd d) sumi */
static inline __m512 kq16_acc_step(__m512 acc, float xd, __m512 d, __m512 dmin, __m512i sumi, __m512i summ, int mins) {
    __m512 x = _mm512_set1_ps(xd);
    __m512 t = _mm512_mul_ps(_mm512_mul_ps(x, d), _mm512_cvtepi32_ps(sumi));
    if (mins) t = _mm512_sub_ps(t, _mm512_mul_ps(_mm512_mul_ps(x, dmin), _mm512_cvtepi32_ps(summ)));
    return _mm512_add_ps(acc, t);
}

static inline __m512i kq16_x4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* 16 interleaved rows (the group at w) of `type` against T tokens (T <= KQ16_TOKENS; type and T constants
 * where inlined): out[t][r] fp32 */
static inline __attribute__((always_inline)) void kq16_dot(const uint8_t *w, int type, int blocks, int T, kq_tokens x,
                                                          float out[KQ16_TOKENS][KQ16]) {
    const int gb = KQ16 * (block_bytes(type) & ~3); /* a group's bytes of units a super-block (64-byte aligned) */
    const uint16_t *tails = (const uint16_t *)(w + (int64_t)blocks * gb); /* Q6_K's d: [blocks][16] */
    const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30);
    __m512 acc[KQ16_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *g = w + (int64_t)b * gb;
        /* Q6_K's units are read out of order (a value takes bits from three of them): the hardware
         * prefetcher lost the stream (15 GB/s against 32 with this, 2048x8192 from DRAM on a Zen 4);
         * the other types read theirs in order and ran no faster with it. */
        if (type == 14)
            for (int l = 0; l < gb; l += 64) __builtin_prefetch(g + 2 * gb + l, 0, 0);
        __m512i sumi[KQ16_TOKENS];
        for (int t = 0; t < T; t++) sumi[t] = _mm512_setzero_si512();
        if (type == 14) { /* ql units 0-31 (16h + 8j + u: ql bytes 64h + 32j + 4u), qh 32-47, scales 48-51, d after */
            for (int h = 0; h < 2; h++)
                for (int half = 0; half < 2; half++) { /* units u of values 128h + 32q + 4u, sub-block 8h + 2q + half */
                    __m512i dot[4][KQ16_TOKENS];
                    for (int q = 0; q < 4; q++)
                        for (int t = 0; t < T; t++) dot[q][t] = _mm512_setzero_si512();
                    for (int u = 4 * half; u < 4 * half + 4; u++) {
                        __m512i la = kq16_load(g, 16 * h + u), lb = kq16_load(g, 16 * h + 8 + u), qh = kq16_load(g, 32 + 8 * h + u);
                        __m512i v[4] = { /* value q: ql's nibble (la low, lb low, la high, lb high), qh's bits 2q, 2q + 1 */
                            _mm512_or_si512(_mm512_and_si512(la, low4), _mm512_and_si512(_mm512_slli_epi16(qh, 4), bits45)),
                            _mm512_or_si512(_mm512_and_si512(lb, low4), _mm512_and_si512(_mm512_slli_epi16(qh, 2), bits45)),
                            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(la, 4), low4), _mm512_and_si512(qh, bits45)),
                            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lb, 4), low4),
                                            _mm512_and_si512(_mm512_srli_epi16(qh, 2), bits45))};
                        for (int q = 0; q < 4; q++)
                            for (int t = 0; t < T; t++)
                                dot[q][t] = _mm512_dpbusd_epi32(dot[q][t], v[q], kq16_x4(x.xq + t * x.k + b * QK_K + 128 * h + 32 * q + 4 * u));
                    }
                    for (int q = 0; q < 4; q++) {
                        int s = 8 * h + 2 * q + half;
                        __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(kq16_load(g, 48 + s / 4), 24 - 8 * (s % 4)), 24);
                        for (int t = 0; t < T; t++) { /* sc_s (q_s . x_s - 32 sum x_s) */
                            __m512i off = _mm512_set1_epi32(32 * x.bs16[t * x.k / 16 + b * 16 + s]);
                            sumi[t] = _mm512_add_epi32(sumi[t], _mm512_mullo_epi32(_mm512_sub_epi32(dot[q][t], off), sc));
                        }
                    }
                }
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tails + KQ16 * b)));
            for (int t = 0; t < T; t++) acc[t] = kq16_acc_step(acc[t], x.xd[t * x.blocks + b], d, d, sumi[t], sumi[t], 0);
            continue;
        }
        /* Q4_K, Q5_K: unit 0 d and dmin, 1-3 the scale bytes, Q5_K's qh 4-11, then qs (8c + u: bytes 32c + 4u) */
        const int qs = type == 12 ? 4 : 12;
        __m512i head = kq16_load(g, 0), s1 = kq16_load(g, 1), s2 = kq16_load(g, 2), s3 = kq16_load(g, 3);
        __m512i summ[KQ16_TOKENS];
        for (int t = 0; t < T; t++) summ[t] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) { /* sub-block 2c in the low nibbles, 2c + 1 in the high */
            __m512i lo[KQ16_TOKENS], hi[KQ16_TOKENS];
            for (int t = 0; t < T; t++) lo[t] = hi[t] = _mm512_setzero_si512();
            for (int u = 0; u < 8; u++) {
                __m512i v = kq16_load(g, qs + 8 * c + u);
                __m512i vl = _mm512_and_si512(v, low4), vh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                if (type == 13) { /* bit 4 of sub-block j's value i: bit j of qh[i] */
                    __m512i qh = kq16_load(g, 4 + u);
                    vl = _mm512_or_si512(vl, kq16_bit4(qh, 2 * c)), vh = _mm512_or_si512(vh, kq16_bit4(qh, 2 * c + 1));
                }
                for (int t = 0; t < T; t++) {
                    const int8_t *xt = x.xq + t * x.k + b * QK_K + 64 * c + 4 * u;
                    lo[t] = _mm512_dpbusd_epi32(lo[t], vl, kq16_x4(xt));
                    hi[t] = _mm512_dpbusd_epi32(hi[t], vh, kq16_x4(xt + 32));
                }
            }
            __m512i sc0 = kq16_scale_min(s1, s2, s3, 2 * c, 0), sc1 = kq16_scale_min(s1, s2, s3, 2 * c + 1, 0);
            __m512i m0 = kq16_scale_min(s1, s2, s3, 2 * c, 1), m1 = kq16_scale_min(s1, s2, s3, 2 * c + 1, 1);
            for (int t = 0; t < T; t++) {
                const int16_t *bs = x.bs32 + t * x.k / 32 + b * 8 + 2 * c;
                sumi[t] = _mm512_add_epi32(sumi[t], _mm512_add_epi32(_mm512_mullo_epi32(lo[t], sc0), _mm512_mullo_epi32(hi[t], sc1)));
                summ[t] = _mm512_add_epi32(summ[t], _mm512_add_epi32(_mm512_mullo_epi32(m0, _mm512_set1_epi32(bs[0])),
                                                                     _mm512_mullo_epi32(m1, _mm512_set1_epi32(bs[1]))));
            }
        }
        /* each lane: d in its low half, dmin in its high */
        __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
        __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
        for (int t = 0; t < T; t++) acc[t] = kq16_acc_step(acc[t], x.xd[t * x.blocks + b], d, dmin, sumi[t], summ[t], 1);
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out[t], acc[t]);
}

/* CALL(T, type) with both as constants (each pair its own unrolled copy), T 1-4, type 12-14 */
#define KQ16_CASE(CALL, n, ty) \
    case (n) * 16 + (ty):      \
        CALL(n, ty);           \
        break;
#define KQ16_CASES(CALL, n) KQ16_CASE(CALL, n, 12) KQ16_CASE(CALL, n, 13) KQ16_CASE(CALL, n, 14)
#define KQ16_CONSTANTS(CALL, T, type)                                                          \
    switch ((T) * 16 + (type)) {                                                               \
        KQ16_CASES(CALL, 1) KQ16_CASES(CALL, 2) KQ16_CASES(CALL, 3) KQ16_CASES(CALL, 4)        \
    }

static void kq16_dot_any(const uint8_t *w, int type, int blocks, int T, kq_tokens x, float out[KQ16_TOKENS][KQ16]) {
#define KQ16_DOT(n, ty) kq16_dot(w, ty, blocks, n, x, out)
    KQ16_CONSTANTS(KQ16_DOT, T, type)
#undef KQ16_DOT
}

/* Row r's super-block b of the interleaved group at w, in the file's layout, into out[block_bytes(type)] */
static void kq16_row_block(const uint8_t *w, int type, int blocks, int b, int r, uint8_t *out) {
    const int bytes = block_bytes(type), units = bytes / 4;
    const uint8_t *g = w + (int64_t)b * KQ16 * 4 * units;
    for (int u = 0; u < units; u++) memcpy(out + 4 * u, g + 64 * u + 4 * r, 4);
    if (bytes % 4) memcpy(out + 4 * units, w + (int64_t)blocks * KQ16 * 4 * units + (b * KQ16 + r) * 2, 2);
}

/* 16 rows' sums for T tokens (out[t][r]) into y's rows t0 .. t0 + T, columns r0 .. r0 + 16: fp32, or bf16 */
static void kq16_write(float out[KQ16_TOKENS][KQ16], int T, void *y, int64_t ldy, int t0, int r0, int y_f32) {
    for (int t = 0; t < T; t++)
        for (int r = 0; r < KQ16; r++) {
            if (y_f32)
                ((float *)y)[(t0 + t) * ldy + r0 + r] = out[t][r];
            else
                ((uint16_t *)y)[(t0 + t) * ldy + r0 + r] = f32_to_bf16(out[t][r]);
        }
}

/* y [rows, ldy] columns 0 .. n16 (a multiple of 16) = the tokens (x, file order) @ the interleaved rows
 * 0 .. n16 of w: each thread its groups in turn, the tokens 4 a pass over each. */
static void kquant_rows16_to(const uint8_t *w, int64_t row_bytes, int type, int blocks, int rows, kq_tokens x,
                             int n16, void *y, int64_t ldy, int y_f32, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int p = 0; p < n16 / KQ16; p++) {
        int r0 = p * KQ16;
        for (int t = 0; t < rows; t += KQ16_TOKENS) {
            int T = rows - t < KQ16_TOKENS ? rows - t : KQ16_TOKENS;
            kq_tokens xt = {x.xq + (int64_t)t * x.k, x.xd + (int64_t)t * x.blocks, x.bs16 + (int64_t)t * x.k / 16,
                            x.bs32 + (int64_t)t * x.k / 32, x.k, x.blocks, 0};
            float out[KQ16_TOKENS][KQ16];
            kq16_dot_any(w + r0 * row_bytes, type, blocks, T, xt, out);
            kq16_write(out, T, y, ldy, t, r0, y_f32);
        }
    }
}
