/* K-quant dots over weights repacked at load (x86, AVX2 and up): 16 rows interleaved per super-block.
 *
 * cpu_native_kquants.h includes this after cpu_native_kquants_x86.h. At one token a
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

/* Where the file's unit u of a `type` super-block is stored in a group (kquants.interleave: Q6_K_UNITS): the
 * file's place but for Q6_K, whose units go in the order kq16_block reads them (scales, then each step's two ql
 * units and its qh unit). */
static inline int kq16_place(int type, int u) {
    if (type != 14) return u;
    if (u >= 48) return u - 48;
    if (u >= 32) return 4 + 3 * (u - 32) + 2; /* qh of half (u - 32) / 8, step (u - 32) % 8 */
    return 4 + 3 * (8 * (u / 16) + u % 8) + (u % 16) / 8;
}

/* The vector the dots run on (cpu_native_vec16.h): all 16 rows in one AVX-512 register, or on AVX2 (and
 * AVX-VNNI) 8 rows in a 256-bit one, each super-block in two halves (half 0: the units' first 32 bytes, rows 0-7;
 * half 1 finds the rest in L1). Halves inside the super-block loop, not outside it: a whole pass of the group per
 * half left the DRAM stream idle through the second (Q4_K from DRAM on a Zen 4, AVX2: ~21 -> ~28 GB/s). */
#include "cpu_native_vec16.h"
#if V16_LANES == 16
#define KQ16_TOKENS 4 /* tokens a pass, sharing its weight loads (AVX-512's 32 registers) */
#else
#define KQ16_TOKENS 2 /* (AVX2's 16 registers) */
#endif

/* byte j (0-3) of each int32 lane, then masked */
static inline kv_i kq16_byte(kv_i v, int shift, int mask) { return kv_and(kv_srli32(v, shift), kv_set1_32(mask)); }

/* Q4_K's/Q5_K's scale (which 0) or min (1) of sub-block j for the rows, as int32 (get_scale_min_k4:
 * the 12 scale bytes in units s1 .. s3) */
static inline kv_i kq16_scale_min(kv_i s1, kv_i s2, kv_i s3, int j, int which) {
    kv_i lowpart = which ? s2 : s1;
    if (j < 4) return kq16_byte(lowpart, 8 * j, 63);
    int i = j - 4;
    return kv_or(kq16_byte(s3, 8 * i + 4 * which, 15), kq16_byte(lowpart, 8 * i + 2, 0x30));
}

/* bit `bit` of each byte of qh moved to bit 4, the rest cleared */
static inline kv_i kq16_bit4(kv_i qh, int bit) {
    kv_i at = bit < 4 ? kv_slli16(qh, 4 - bit) : bit > 4 ? kv_srli16(qh, bit - 4) : qh;
    return kv_and(at, kv_set1_8(0x10));
}

/* kq_acc_step for the rows (lanes): acc + ((xd d) sumi - (xd dmin) summ), Q6_K (no mins) acc + (xd d) sumi */
static inline kv_f kq16_acc_step(kv_f acc, float xd, kv_f d, kv_f dmin, kv_i sumi, kv_i summ, int mins) {
    kv_f x = kv_set1_ps(xd);
    kv_f t = kv_mul_ps(kv_mul_ps(x, d), kv_cvt(sumi));
    if (mins) t = kv_sub_ps(t, kv_mul_ps(kv_mul_ps(x, dmin), kv_cvt(summ)));
    return kv_add_ps(acc, t);
}

static inline kv_i kq16_x4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return kv_set1_32(v);
}

/* One super-block (at g; Q6_K's 16 d at tail) of the 16 interleaved rows, the lanes of `half`, against T tokens
 * (their super-block b): acc[t] += its sums, kq_acc_step's fp32 step. type and T constants where inlined. */
static inline __attribute__((always_inline)) void kq16_block(const uint8_t *g, const uint16_t *tail, int type, int b,
                                                            int half, int T, kq_tokens x, kv_f acc[KQ16_TOKENS]) {
    const kv_i low4 = kv_set1_8(0x0f), bits45 = kv_set1_8(0x30);
    kv_i sumi[KQ16_TOKENS];
    for (int t = 0; t < T; t++) sumi[t] = kv_zero();
    if (type == 14) { /* file units: ql 0-31 (16h + 8j + u: ql bytes 64h + 32j + 4u), qh 32-47, scales 48-51; stored
                       * in the order read here (kq16_place), d after */
        /* (In the file's order a value's three units sat in three places: the hardware prefetcher lost the stream,
         * 11.5 GB/s from DRAM on a Zen 4, and asking for each super-block's lines by software prefetch got ~28-30.
         * Stored in reading order, one stream: 5-18% faster still, with no prefetch.) */
        for (int h = 0; h < 2; h++)
            for (int hs = 0; hs < 2; hs++) { /* units u of values 128h + 32q + 4u, sub-block 8h + 2q + hs */
                kv_i dot[4][KQ16_TOKENS];
                for (int q = 0; q < 4; q++)
                    for (int t = 0; t < T; t++) dot[q][t] = kv_zero();
                for (int u = 4 * hs; u < 4 * hs + 4; u++) {
                    const int at = 4 + 3 * (8 * h + u); /* (kq16_place's, written out: a call here ran 5-13% slower) */
                    kv_i la = kv_load(g, at, half), lb = kv_load(g, at + 1, half), qh = kv_load(g, at + 2, half);
                    /* value q: ql's nibble (la low, lb low, la high, lb high), qh's bits 2q, 2q + 1 */
                    kv_i v[4] = {
                        kv_or(kv_and(la, low4), kv_and(kv_slli16(qh, 4), bits45)),
                        kv_or(kv_and(lb, low4), kv_and(kv_slli16(qh, 2), bits45)),
                        kv_or(kv_and(kv_srli16(la, 4), low4), kv_and(qh, bits45)),
                        kv_or(kv_and(kv_srli16(lb, 4), low4), kv_and(kv_srli16(qh, 2), bits45))};
                    for (int q = 0; q < 4; q++)
                        for (int t = 0; t < T; t++)
                            dot[q][t] = kv_dpbusd(dot[q][t], v[q],
                                                  kq16_x4(x.xq + t * x.k + b * QK_K + 128 * h + 32 * q + 4 * u));
                }
                for (int q = 0; q < 4; q++) {
                    int s = 8 * h + 2 * q + hs;
                    /* (unit 48 + s / 4 at kq16_place's s / 4) */
                    kv_i sc = kv_srai32(kv_slli32(kv_load(g, s / 4, half), 24 - 8 * (s % 4)), 24);
                    for (int t = 0; t < T; t++) { /* sc_s (q_s . x_s - 32 sum x_s) */
                        kv_i off = kv_set1_32(32 * x.bs16[t * x.k / 16 + b * 16 + s]);
                        sumi[t] = kv_add(sumi[t], kv_mullo(kv_sub(dot[q][t], off), sc));
                    }
                }
            }
        kv_f d = kv_load_f16(tail, half);
        for (int t = 0; t < T; t++)
            acc[t] = kq16_acc_step(acc[t], x.xd[t * x.blocks + b], d, d, sumi[t], sumi[t], 0);
        return;
    }
    /* Q4_K, Q5_K: unit 0 d and dmin, 1-3 the scale bytes, Q5_K's qh 4-11, then qs (8c + u: bytes 32c + 4u) */
    const int qs = type == 12 ? 4 : 12;
    kv_i head = kv_load(g, 0, half), s1 = kv_load(g, 1, half), s2 = kv_load(g, 2, half), s3 = kv_load(g, 3, half);
    kv_i summ[KQ16_TOKENS];
    for (int t = 0; t < T; t++) summ[t] = kv_zero();
    for (int c = 0; c < 4; c++) { /* sub-block 2c in the low nibbles, 2c + 1 in the high */
        kv_i lo[KQ16_TOKENS], hi[KQ16_TOKENS];
        for (int t = 0; t < T; t++) lo[t] = hi[t] = kv_zero();
#ifdef KV_PAIRS16
        kv_i lo16[KQ16_TOKENS], hi16[KQ16_TOKENS];
        for (int t = 0; t < T; t++) lo16[t] = hi16[t] = kv_zero();
#endif
        for (int u = 0; u < 8; u++) {
            kv_i v = kv_load(g, qs + 8 * c + u, half);
            kv_i vl = kv_and(v, low4), vh = kv_and(kv_srli16(v, 4), low4);
            if (type == 13) { /* bit 4 of sub-block j's value i: bit j of qh[i] */
                kv_i qh = kv_load(g, 4 + u, half);
                vl = kv_or(vl, kq16_bit4(qh, 2 * c)), vh = kv_or(vh, kq16_bit4(qh, 2 * c + 1));
            }
            for (int t = 0; t < T; t++) {
                const int8_t *xt = x.xq + t * x.k + b * QK_K + 64 * c + 4 * u;
#ifdef KV_PAIRS16
                lo16[t] = _mm256_add_epi16(lo16[t], _mm256_maddubs_epi16(vl, kq16_x4(xt)));
                hi16[t] = _mm256_add_epi16(hi16[t], _mm256_maddubs_epi16(vh, kq16_x4(xt + 32)));
                if (u % 4 == 3) {
                    const kv_i ones = _mm256_set1_epi16(1);
                    lo[t] = kv_add(lo[t], _mm256_madd_epi16(lo16[t], ones)), lo16[t] = kv_zero();
                    hi[t] = kv_add(hi[t], _mm256_madd_epi16(hi16[t], ones)), hi16[t] = kv_zero();
                }
#else
                lo[t] = kv_dpbusd(lo[t], vl, kq16_x4(xt));
                hi[t] = kv_dpbusd(hi[t], vh, kq16_x4(xt + 32));
#endif
            }
        }
        kv_i sc0 = kq16_scale_min(s1, s2, s3, 2 * c, 0), sc1 = kq16_scale_min(s1, s2, s3, 2 * c + 1, 0);
        kv_i m0 = kq16_scale_min(s1, s2, s3, 2 * c, 1), m1 = kq16_scale_min(s1, s2, s3, 2 * c + 1, 1);
        for (int t = 0; t < T; t++) {
            const int16_t *bs = x.bs32 + t * x.k / 32 + b * 8 + 2 * c;
            sumi[t] = kv_add(sumi[t], kv_add(kv_mullo(lo[t], sc0), kv_mullo(hi[t], sc1)));
            summ[t] = kv_add(summ[t], kv_add(kv_mullo(m0, kv_set1_32(bs[0])), kv_mullo(m1, kv_set1_32(bs[1]))));
        }
    }
    kv_f d = kv_half_f16(head, 0), dmin = kv_half_f16(head, 1); /* (a lane: d in its low half, dmin its high) */
    for (int t = 0; t < T; t++)
        acc[t] = kq16_acc_step(acc[t], x.xd[t * x.blocks + b], d, dmin, sumi[t], summ[t], 1);
}

/* 16 interleaved rows (the group at w) of `type` against T tokens (T <= KQ16_TOKENS; type and T constants
 * where inlined): out[t][r] fp32. Super-block by super-block, each one's 16 / V16_LANES halves in turn: a whole pass
 * of the group per half (AVX2: 2) left the DRAM stream idle through the second (Q4_K from DRAM, AVX2, Zen 4: ~21 ->
 * ~28 GB/s); a half's second read of the super-block finds it in L1. */
static inline __attribute__((always_inline)) void kq16_dot(const uint8_t *w, int type, int blocks, int T, kq_tokens x,
                                                          float out[KQ16_TOKENS][KQ16]) {
    const int gb = KQ16 * (block_bytes(type) & ~3); /* a group's bytes of units a super-block (64-byte aligned) */
    const uint16_t *tails = (const uint16_t *)(w + (int64_t)blocks * gb); /* Q6_K's d: [blocks][16] */
    kv_f acc[KQ16 / V16_LANES][KQ16_TOKENS];
    for (int half = 0; half < KQ16 / V16_LANES; half++)
        for (int t = 0; t < T; t++) acc[half][t] = kv_zero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *g = w + (int64_t)b * gb;
        for (int half = 0; half < KQ16 / V16_LANES; half++)
            kq16_block(g, tails + KQ16 * b, type, b, half, T, x, acc[half]);
    }
    for (int half = 0; half < KQ16 / V16_LANES; half++)
        for (int t = 0; t < T; t++) kv_store_ps(out[t] + V16_LANES * half, acc[half][t]);
}

/* CALL(T, type) with both as constants (each pair its own unrolled copy), T 1-4, type 12-14 */
#define KQ16_CASE(CALL, n, ty) \
    case (n) * 16 + (ty):      \
        CALL(n, ty);           \
        break;
#define KQ16_CASES(CALL, n) KQ16_CASE(CALL, n, 12) KQ16_CASE(CALL, n, 13) KQ16_CASE(CALL, n, 14)
#define KQ16_CONSTANTS(CALL, T, type)                                                          \
    switch ((T) * 16 + (type)) {                                                               \
        KQ16_CASES(CALL, 1) KQ16_CASES(CALL, 2) KQ16_MORE(CALL)                                \
    }
#if KQ16_TOKENS == 4
#define KQ16_MORE(CALL) KQ16_CASES(CALL, 3) KQ16_CASES(CALL, 4)
#else
#define KQ16_MORE(CALL)
#endif

static void kq16_dot_any(const uint8_t *w, int type, int blocks, int T, kq_tokens x, float out[KQ16_TOKENS][KQ16]) {
#define KQ16_DOT(n, ty) kq16_dot(w, ty, blocks, n, x, out)
    KQ16_CONSTANTS(KQ16_DOT, T, type)
#undef KQ16_DOT
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
#ifndef KQ16_SCHED
/* Chunks to whichever thread is free, shrinking toward the end (OpenMP's guided: about the groups left over the
 * threads, at least 4 groups): each thread's stream stays sequential over long runs, and the matmul's last chunks
 * are small, so neither thread waits long for the other. Static halves had the threads waiting ~14% of a decode step
 * for each other; fixed chunks of 32 groups (512 rows) left a 1B model's K and V projections (32 groups) to one
 * thread, and the down projection's 4 chunks to whichever finished last. Q4_K_M decode on a 2-core Zen 4, in one
 * process against the fixed chunks: +6% and +10% (medians of 8 and 10 rounds, bench/RESULTS.md). */
#define KQ16_SCHED guided, 4
#endif
#pragma omp parallel for schedule(KQ16_SCHED) num_threads(threads)
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
