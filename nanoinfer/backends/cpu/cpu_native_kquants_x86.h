/* K-quant dot products on x86 (AVX2, AVX-512 VNNI, AVX-VNNI): the super-blocks dotted as stored, several rows a pass.
 *
 * cpu_native_kquants.h includes this where __AVX2__ is defined; its plain loops (unpack a
 * super-block into bytes, then dot) stay the reference every other build runs, and the tests
 * hold both to kquants.reference_kquant_matmul bit for bit. Unpacking into a buffer had cost
 * more than the dot itself at one token (the kernels streamed 5-9 GB/s of weights against the
 * group kernel's ~30), so here nothing is unpacked to memory:
 *   - a register of 32 stored bytes gives its values by and/shift (Q4_K's nibbles, Q5_K's fifth
 *     bit from qh, Q6_K's two high bits from qh), each vpmaddubsw'd straight against the int8
 *     activations (u8 x s8 pairs into int16: exact, q < 64 and |x| <= 127 keep a pair within
 *     2 * 63 * 127 < 32767);
 *   - the sub-block's scale multiplies those int16 pairs in the widening vpmaddwd (vpdpwssd on
 *     the VNNI tiers, which adds too): each scale broadcast from the row's 8 (16) scales by a
 *     byte shuffle; the 6-bit scales and mins unpacked in a register too (two byte shuffles,
 *     masks and shifts), and four rows' fp16 factors converted in one instruction (scalar
 *     unpacking and conversions had cost a quarter of Q4_K's time);
 *   - the mins' term is one vpmaddwd of the 8 mins against the activations' per-32 sums
 *     (Q6_K's offset of 32 the same with its 16 scales and per-16 sums);
 *   - KQ_ROWS weight rows go together, sharing each activation load, and their horizontal sums
 *     and the fp32 step are done for all of them at once (the rows in lanes): per row, per
 *     super-block in order, acc += (xd d) sumi - (xd dmin) summ, each operation rounded as
 *     the scalar code rounds it (cpu_native.c builds with -std=c11: no contraction to FMA).
 * The super-block's integer sums are exact in any order, so the bits are the reference's.
 */
#include <immintrin.h>

#define KQ_ROWS 4

/* acc + the int16 pairs p times the int16 scales s, summed in pairs into int32 lanes */
static inline __m256i kq_scaled_add(__m256i acc, __m256i p, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, p, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, p, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

/* Byte shuffles that broadcast int16 element j of each 128-bit lane: KQ_PICK[j] for both lanes
 * alike (Q4_K/Q5_K's 8 scales), KQ_PICK2[i] element 2i in the low lane and 2i + 1 in the high
 * one (Q6_K: a load of 32 values spans two sub-blocks of 16). */
static const int8_t KQ_PICK[8][32] __attribute__((aligned(32))) = {
#define P(j) {2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, \
              2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, \
              2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1}
    P(0), P(1), P(2), P(3), P(4), P(5), P(6), P(7)
#undef P
};
static const int8_t KQ_PICK2[4][32] __attribute__((aligned(32))) = {
#define P(a, b) {a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, \
                 b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1}
    P(0, 2), P(4, 6), P(8, 10), P(12, 14)
#undef P
};

static inline __m256i kq_pick(__m256i scales, const int8_t *mask) {
    return _mm256_shuffle_epi8(scales, _mm256_load_si256((const __m256i *)mask));
}

static inline __m256i kq_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* Four rows' int32 lane sums -> one int32 a row: [sum a, sum b, sum c, sum d] */
static inline __m128i kq_hsum4(__m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

static inline __m128i kq_hsum4_128(__m128i a, __m128i b, __m128i c, __m128i d) {
    return _mm_hadd_epi32(_mm_hadd_epi32(a, b), _mm_hadd_epi32(c, d));
}

#ifndef KQ_AHEAD
#define KQ_AHEAD 4
#endif
/* Fetch the super-block KQ_AHEAD blocks past blk in its pass's stream: the same row further on,
 * or past the row's end the row KQ_ROWS on (the next pass's). A pass reads its rows' blocks in
 * turn, KQ_ROWS short streams a matrix of 2048 columns long: too short for the hardware's
 * prefetcher to follow. */
static inline void kq_prefetch(const uint8_t *blk, int b, int blocks, int64_t row_bytes, int bytes) {
    const uint8_t *p = blk + (int64_t)KQ_AHEAD * bytes + (b + KQ_AHEAD < blocks ? 0 : (KQ_ROWS - 1) * row_bytes);
    for (int c = 0; c < bytes; c += 64) __builtin_prefetch(p + c, 0, 3);
}

/* bit j of each byte moved to bit 4, the others cleared (j a constant where inlined) */
static inline __m256i kq_bit_to_4(__m256i v, int j) {
    __m256i at = j < 4 ? _mm256_slli_epi16(v, 4 - j) : j > 4 ? _mm256_srli_epi16(v, j - 4) : v;
    return _mm256_and_si256(at, _mm256_set1_epi8(0x10));
}

/* A Q4_K/Q5_K super-block's first 16 bytes (d, dmin, the 12 scale bytes) -> its 8 scales (low
 * 128 bits, int16) and 8 mins (high): ggml's get_scale_min_k4 in a register. Scales 0-3 and
 * mins 0-3 are scale bytes 0-3 and 4-7 less their top two bits; scales and mins 4-7 are the
 * low and high nibbles of bytes 8-11, with those top bits above them. */
static inline __m256i kq_scales_mins(__m128i head) {
    /* (byte i of the 12 sits at i + 4) */
    const __m128i pick = _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m128i tops = _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11);
    __m128i a = _mm_shuffle_epi8(head, pick), t = _mm_shuffle_epi8(head, tops);
    __m128i low = _mm_and_si128(a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    __m128i nib = _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
    __m128i top = _mm_and_si128(_mm_srli_epi16(t, 2), _mm_set1_epi8(0x30)); /* bits 6-7 to 4-5 */
    return _mm256_cvtepu8_epi16(_mm_or_si128(_mm_or_si128(low, nib), top));
}

/* Four rows' fp16 pairs (each row's dword: d in its low half, dmin in its high) -> d of the
 * four rows in the low 128 bits of fp32, dmin in the high. */
static inline __m256 kq_factors(__m128i r0, __m128i r1, __m128i r2, __m128i r3) {
    __m128i all = _mm_unpacklo_epi64(_mm_unpacklo_epi32(r0, r1), _mm_unpacklo_epi32(r2, r3));
    const __m128i apart = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    return _mm256_cvtph_ps(_mm_shuffle_epi8(all, apart));
}

/* The fp32 step of a super-block for four rows at once (lanes), in the scalar code's order. */
static inline __m128 kq_acc_step(__m128 acc, float xd, __m128 d, __m128 dmin, __m128i sumi, __m128i summ, int mins) {
    __m128 x = _mm_set1_ps(xd);
    __m128 t = _mm_mul_ps(_mm_mul_ps(x, d), _mm_cvtepi32_ps(sumi));
    if (mins) t = _mm_sub_ps(t, _mm_mul_ps(_mm_mul_ps(x, dmin), _mm_cvtepi32_ps(summ)));
    return _mm_add_ps(acc, t);
}

/* Tokens a pass takes together (each weight register unpacked once for all of them): as many as
 * the accumulators (KQ_TOKENS x KQ_ROWS of them) leave registers for — AVX-512's 32, AVX2's 16. */
#if defined(__AVX512VL__)
#define KQ_TOKENS 4
#else
#define KQ_TOKENS 2
#endif

/* R rows (R <= KQ_ROWS) of Q4_K (type 12) or Q5_K (13), each row_bytes apart from w, against T
 * tokens (T <= KQ_TOKENS; R, T and type constants where inlined): out[t * KQ_ROWS + r] = row r's
 * fp32 sum for token t. A token's sums are the one-token kernel's, step for step. */
static inline __attribute__((always_inline)) void kq45_rows(const uint8_t *w, int64_t row_bytes, int R, int T,
                                                           int type, int blocks, kq_tokens x, float *out) {
    const int bytes = type == 12 ? 144 : 176, qs_at = type == 12 ? 16 : 48;
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m128 acc[KQ_TOKENS][KQ_ROWS / 4];
    for (int t = 0; t < KQ_TOKENS; t++)
        for (int g = 0; g < KQ_ROWS / 4; g++) acc[t][g] = _mm_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk[KQ_ROWS];
        __m256i sums[KQ_TOKENS][KQ_ROWS], scales[KQ_ROWS];
        __m128i mins[KQ_TOKENS][KQ_ROWS], head[KQ_ROWS], minv[KQ_ROWS];
        for (int r = 0; r < KQ_ROWS; r++) {
            head[r] = minv[r] = _mm_setzero_si128();
            for (int t = 0; t < KQ_TOKENS; t++) sums[t][r] = _mm256_setzero_si256(), mins[t][r] = _mm_setzero_si128();
            if (r >= R) continue;
            blk[r] = w + r * row_bytes + (int64_t)b * bytes;
            head[r] = _mm_loadu_si128((const __m128i *)blk[r]);
            __m256i sm = kq_scales_mins(head[r]);
            scales[r] = _mm256_permute2x128_si256(sm, sm, 0x00);
            minv[r] = _mm256_extracti128_si256(sm, 1);
            kq_prefetch(blk[r], b, blocks, row_bytes, bytes);
        }
        for (int t = 0; t < T && t < KQ_TOKENS; t++) {
            __m128i bsum = _mm_loadu_si128((const __m128i *)(x.bs32 + t * x.k / 32 + b * 8));
            for (int r = 0; r < R && r < KQ_ROWS; r++) mins[t][r] = _mm_madd_epi16(minv[r], bsum);
        }
        for (int c = 0; c < 4; c++) { /* 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high */
            for (int r = 0; r < R && r < KQ_ROWS; r++) {
                __m256i v = kq_load(blk[r] + qs_at + 32 * c);
                __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                if (type == 13) { /* bit 4 of sub-block j's value i: bit j of qh[i] */
                    __m256i qh = kq_load(blk[r] + 16);
                    lo = _mm256_or_si256(lo, kq_bit_to_4(qh, 2 * c)), hi = _mm256_or_si256(hi, kq_bit_to_4(qh, 2 * c + 1));
                }
                __m256i sl = kq_pick(scales[r], KQ_PICK[2 * c]), sh = kq_pick(scales[r], KQ_PICK[2 * c + 1]);
                for (int t = 0; t < T && t < KQ_TOKENS; t++) {
                    const int8_t *xt = x.xq + t * x.k + b * QK_K + 64 * c;
                    sums[t][r] = kq_scaled_add(sums[t][r], _mm256_maddubs_epi16(lo, kq_load(xt)), sl);
                    sums[t][r] = kq_scaled_add(sums[t][r], _mm256_maddubs_epi16(hi, kq_load(xt + 32)), sh);
                }
            }
        }
        for (int g = 0; 4 * g < R; g++) {
            __m128i *h = head + 4 * g;
            __m256 f = kq_factors(h[0], h[1], h[2], h[3]);
            for (int t = 0; t < T && t < KQ_TOKENS; t++) {
                __m256i *s = sums[t] + 4 * g;
                __m128i *m = mins[t] + 4 * g;
                acc[t][g] = kq_acc_step(acc[t][g], x.xd[t * x.blocks + b], _mm256_castps256_ps128(f),
                                        _mm256_extractf128_ps(f, 1), kq_hsum4(s[0], s[1], s[2], s[3]),
                                        kq_hsum4_128(m[0], m[1], m[2], m[3]), 1);
            }
        }
    }
    for (int t = 0; t < T && t < KQ_TOKENS; t++) {
        float all[KQ_ROWS];
        for (int g = 0; 4 * g < R; g++) _mm_storeu_ps(all + 4 * g, acc[t][g]);
        for (int r = 0; r < R && r < KQ_ROWS; r++) out[t * KQ_ROWS + r] = all[r];
    }
}

/* Q6_K's offset term for one token: 32 sum_s sc_s sum x_s, in 8 int32 lanes (sc16: the 16 scales as int16) */
static inline __m256i kq6_offset(__m256i sc16, const int16_t *bs16) {
    return _mm256_slli_epi32(_mm256_madd_epi16(sc16, kq_load(bs16)), 5);
}

/* Q6_K's fp16 d, as kq_factors takes a row's */
static inline __m128i kq6_d(const uint8_t *blk) {
    uint16_t d;
    memcpy(&d, blk + 208, 2);
    return _mm_cvtsi32_si128(d);
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* Q4_K and Q5_K in 512-bit registers (the AVX-512 tiers): a register of 64 stored bytes holds two
 * sub-blocks' values in its low nibbles (4c and 4c + 2) and two in its high (4c + 1, 4c + 3), so each
 * vpmaddubsw and vpdpwssd does twice the products a 256-bit one does (measured on this tier's Xeon:
 * the pair's products a second double) and each row's unpacking is half the instructions. The
 * activations are laid out to match (kq_interleave: each super-block's sub-blocks of 32 in the order
 * 0 2 1 3 4 6 5 7); the per-32 sums keep theirs. The super-block's int32 sum is the same integer. */
#define KQ45_WIDE 1

static inline __m512i kq_scaled_add512(__m512i acc, __m512i p, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, p, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, s));
#endif
}

/* The byte shuffle that broadcasts scale ja to the low 256 bits and jb to the high (both 128-bit lanes of each) */
static inline __m512i kq_pick_mask512(int ja, int jb) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)KQ_PICK[ja])),
                              _mm256_load_si256((const __m256i *)KQ_PICK[jb]), 1);
}

/* Each super-block's sub-blocks of 32 reordered 0 2 1 3 4 6 5 7, in place (xq of n super-blocks) */
static void kq_interleave(int8_t *xq, int64_t n) {
    for (int64_t b = 0; b < n; b++) {
        int8_t *s = xq + b * QK_K;
        for (int h = 0; h < QK_K; h += 128) { /* swap sub-blocks 1 and 2 of each half */
            int8_t t[32];
            memcpy(t, s + h + 32, 32), memcpy(s + h + 32, s + h + 64, 32), memcpy(s + h + 64, t, 32);
        }
    }
}

/* 16 int32 vectors -> one whose lane i is the sum of v[i]'s lanes (integers: exact in any order) */
static inline __m512i kq_hsum16(const __m512i *v) {
    __m512i u[8], w[4];
    for (int i = 0; i < 8; i++) /* per 128 bits: v[2i]'s and v[2i + 1]'s pairs summed, interleaved */
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128 bits: v[4i .. 4i + 3]'s sums of that quarter */
        w[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(u[2 * i], u[2 * i + 1]), _mm512_unpackhi_epi64(u[2 * i], u[2 * i + 1]));
    __m512i a = _mm512_add_epi32(_mm512_shuffle_i32x4(w[0], w[1], 0x88), _mm512_shuffle_i32x4(w[0], w[1], 0xdd));
    __m512i b = _mm512_add_epi32(_mm512_shuffle_i32x4(w[2], w[3], 0x88), _mm512_shuffle_i32x4(w[2], w[3], 0xdd));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd));
}

/* kq45_rows with 512-bit registers; the activations (x.xq) interleaved by kq_interleave. A super-block's
 * sums of the 4 rows x 4 tokens are reduced together into one register, lane 4r + t, and its fp32 step
 * done for all 16 at once (kq_acc_step's operations, lane by lane). */
static inline __attribute__((always_inline)) void kq45_rows_wide(const uint8_t *w, int64_t row_bytes, int R, int T,
                                                                int type, int blocks, kq_tokens x, float *out) {
    const int bytes = type == 12 ? 144 : 176, qs_at = type == 12 ? 16 : 48;
    const __m512i low4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    const __m512i pick[4] = {kq_pick_mask512(0, 2), kq_pick_mask512(1, 3), kq_pick_mask512(4, 6),
                             kq_pick_mask512(5, 7)};
    /* lane 4r + t: row r's d (f's lane r) and dmin (its lane 4 + r) */
    const __m512i by_row = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i by_row_min = _mm512_add_epi32(by_row, _mm512_set1_epi32(4));
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk[KQ_ROWS];
        __m512i sums[KQ_ROWS * KQ_TOKENS], scales[KQ_ROWS], qh[KQ_ROWS]; /* sums[4r + t] */
        __m128i head[KQ_ROWS], minv[KQ_ROWS];
        for (int i = 0; i < KQ_ROWS * KQ_TOKENS; i++) sums[i] = _mm512_setzero_si512();
        for (int r = 0; r < KQ_ROWS; r++) {
            head[r] = minv[r] = _mm_setzero_si128();
            if (r >= R) continue;
            blk[r] = w + r * row_bytes + (int64_t)b * bytes;
            head[r] = _mm_loadu_si128((const __m128i *)blk[r]);
            __m256i sm = kq_scales_mins(head[r]);
            scales[r] = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sm));
            minv[r] = _mm256_extracti128_si256(sm, 1);
            if (type == 13) { /* qh, and in the high half qh two bits on: bit j there is bit j + 2 */
                __m256i h = kq_load(blk[r] + 16);
                qh[r] = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
            }
            kq_prefetch(blk[r], b, blocks, row_bytes, bytes);
        }
        for (int c = 0; c < 2; c++) { /* 64 bytes: sub-blocks 4c, 4c + 2 in the low nibbles, 4c + 1, 4c + 3 in the high */
            for (int r = 0; r < R && r < KQ_ROWS; r++) {
                __m512i v = _mm512_loadu_si512((const void *)(blk[r] + qs_at + 64 * c));
                __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                if (type == 13) { /* bit 4 of sub-block j's value i: bit j of qh[i] */
                    __m512i a = c == 0 ? _mm512_slli_epi16(qh[r], 4) : qh[r];
                    __m512i h = c == 0 ? _mm512_slli_epi16(qh[r], 3) : _mm512_srli_epi16(qh[r], 1);
                    lo = _mm512_or_si512(lo, _mm512_and_si512(a, bit4)), hi = _mm512_or_si512(hi, _mm512_and_si512(h, bit4));
                }
                __m512i sl = _mm512_shuffle_epi8(scales[r], pick[2 * c]), sh = _mm512_shuffle_epi8(scales[r], pick[2 * c + 1]);
                for (int t = 0; t < T && t < KQ_TOKENS; t++) {
                    const int8_t *xt = x.xq + t * x.k + b * QK_K + 128 * c;
                    __m512i *s = sums + KQ_TOKENS * r + t;
                    *s = kq_scaled_add512(*s, _mm512_maddubs_epi16(lo, _mm512_loadu_si512(xt)), sl);
                    *s = kq_scaled_add512(*s, _mm512_maddubs_epi16(hi, _mm512_loadu_si512(xt + 64)), sh);
                }
            }
        }
        /* the mins' term: row r's 8 mins (quarter r) against each token's per-32 sums, lane 4r + t */
        __m512i mv = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(minv[0]), minv[1], 1)),
            _mm256_inserti128_si256(_mm256_castsi128_si256(minv[2]), minv[3], 1), 1);
        __m512i m[KQ_TOKENS];
        float xd[KQ_TOKENS] = {0};
        for (int t = 0; t < KQ_TOKENS; t++) {
            m[t] = _mm512_setzero_si512();
            if (t >= T) continue;
            __m128i bsum = _mm_loadu_si128((const __m128i *)(x.bs32 + t * x.k / 32 + b * 8));
            m[t] = _mm512_madd_epi16(mv, _mm512_broadcast_i32x4(bsum));
            xd[t] = x.xd[t * x.blocks + b];
        }
        __m512i mx = _mm512_add_epi32(_mm512_unpacklo_epi32(m[0], m[1]), _mm512_unpackhi_epi32(m[0], m[1]));
        __m512i my = _mm512_add_epi32(_mm512_unpacklo_epi32(m[2], m[3]), _mm512_unpackhi_epi32(m[2], m[3]));
        __m512i summ = _mm512_add_epi32(_mm512_unpacklo_epi64(mx, my), _mm512_unpackhi_epi64(mx, my));
        __m512 f = _mm512_castps256_ps512(kq_factors(head[0], head[1], head[2], head[3]));
        __m512 xv = _mm512_broadcast_f32x4(_mm_loadu_ps(xd));
        __m512 t1 = _mm512_mul_ps(_mm512_mul_ps(xv, _mm512_permutexvar_ps(by_row, f)), _mm512_cvtepi32_ps(kq_hsum16(sums)));
        __m512 t2 = _mm512_mul_ps(_mm512_mul_ps(xv, _mm512_permutexvar_ps(by_row_min, f)), _mm512_cvtepi32_ps(summ));
        acc = _mm512_add_ps(acc, _mm512_sub_ps(t1, t2));
    }
    float all[KQ_ROWS * KQ_TOKENS];
    _mm512_storeu_ps(all, acc);
    for (int t = 0; t < T && t < KQ_TOKENS; t++)
        for (int r = 0; r < R && r < KQ_ROWS; r++) out[t * KQ_ROWS + r] = all[KQ_TOKENS * r + t];
}

/* Q6_K (type 14) in 512-bit registers, where a call takes several tokens at once: a register of 64 of a
 * half's ql bytes gives its values 0-63 in its low nibbles and 64-127 in its high, its qh bits from
 * [qh, qh >> 2]; each 128 bits one sub-block of 16, its scale placed by a byte shuffle. The activations are in the
 * file's order. Reduced and stepped as kq45_rows_wide's. */
static inline __attribute__((always_inline)) void kq6_rows_wide(const uint8_t *w, int64_t row_bytes, int R, int T,
                                                               int blocks, kq_tokens x, float *out) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), two = _mm512_set1_epi8(3), bits45 = _mm512_set1_epi8(0x30);
    /* byte shuffles placing, in 128-bit quarter q, int16 scale q (values 0-63 of a half) or 4 + q (64-127) of the
     * half's 8, which every quarter holds */
    const __m512i pick_lo = _mm512_setr_epi32(0x01000100, 0x01000100, 0x01000100, 0x01000100, 0x03020302, 0x03020302,
                                              0x03020302, 0x03020302, 0x05040504, 0x05040504, 0x05040504, 0x05040504,
                                              0x07060706, 0x07060706, 0x07060706, 0x07060706);
    const __m512i pick_hi = _mm512_add_epi8(pick_lo, _mm512_set1_epi8(8));
    const __m512i by_row = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk[KQ_ROWS];
        __m512i sums[KQ_ROWS * KQ_TOKENS], sc[KQ_ROWS][2]; /* sums[4r + t]; each half's 8 scales in every quarter */
        __m128i tail[KQ_ROWS];
        for (int r = 0; r < KQ_ROWS; r++) {
            tail[r] = _mm_setzero_si128();
            for (int t = 0; t < KQ_TOKENS; t++) sums[KQ_TOKENS * r + t] = _mm512_setzero_si512();
            if (r >= R) continue;
            blk[r] = w + r * row_bytes + (int64_t)b * 210;
            __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk[r] + 192)));
            sc[r][0] = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sc16));
            sc[r][1] = _mm512_broadcast_i32x4(_mm256_extracti128_si256(sc16, 1));
            /* -32 sum_s sc_s sum x_s, in lanes the reduction adds up */
            for (int t = 0; t < T && t < KQ_TOKENS; t++)
                sums[KQ_TOKENS * r + t] = _mm512_castsi256_si512(
                    _mm256_sub_epi32(_mm256_setzero_si256(), kq6_offset(sc16, x.bs16 + t * x.k / 16 + b * 16)));
            tail[r] = kq6_d(blk[r]);
            kq_prefetch(blk[r], b, blocks, row_bytes, 210);
        }
        for (int h = 0; h < 2; h++) { /* a half of 128 values: ql[64], qh[32] */
            for (int r = 0; r < R && r < KQ_ROWS; r++) {
                __m512i l = _mm512_loadu_si512((const void *)(blk[r] + 64 * h));
                __m256i hb = kq_load(blk[r] + 128 + 32 * h);
                __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(hb), _mm256_srli_epi16(hb, 2), 1);
                __m512i v01 = _mm512_or_si512(_mm512_and_si512(l, low4), _mm512_slli_epi16(_mm512_and_si512(q, two), 4));
                __m512i v23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low4), _mm512_and_si512(q, bits45));
                __m512i s01 = _mm512_shuffle_epi8(sc[r][h], pick_lo), s23 = _mm512_shuffle_epi8(sc[r][h], pick_hi);
                for (int t = 0; t < T && t < KQ_TOKENS; t++) {
                    const int8_t *xh = x.xq + t * x.k + b * QK_K + 128 * h;
                    __m512i *s = sums + KQ_TOKENS * r + t;
                    *s = kq_scaled_add512(*s, _mm512_maddubs_epi16(v01, _mm512_loadu_si512(xh)), s01);
                    *s = kq_scaled_add512(*s, _mm512_maddubs_epi16(v23, _mm512_loadu_si512(xh + 64)), s23);
                }
            }
        }
        float xd[KQ_TOKENS] = {0};
        for (int t = 0; t < T && t < KQ_TOKENS; t++) xd[t] = x.xd[t * x.blocks + b];
        __m512 d = _mm512_castps256_ps512(kq_factors(tail[0], tail[1], tail[2], tail[3]));
        __m512 t1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(xd)), _mm512_permutexvar_ps(by_row, d)),
                                  _mm512_cvtepi32_ps(kq_hsum16(sums)));
        acc = _mm512_add_ps(acc, t1);
    }
    float all[KQ_ROWS * KQ_TOKENS];
    _mm512_storeu_ps(all, acc);
    for (int t = 0; t < T && t < KQ_TOKENS; t++)
        for (int r = 0; r < R && r < KQ_ROWS; r++) out[t * KQ_ROWS + r] = all[KQ_TOKENS * r + t];
}
#endif

/* The same for Q6_K (type 14): ql[128], qh[64], 16 int8 scales, d; the tokens' int16 per-16 sums
 * (the offset of 32: sumi = sum_s sc_s (q_s . x_s - 32 sum x_s)). */
static inline __attribute__((always_inline)) void kq6_rows(const uint8_t *w, int64_t row_bytes, int R, int T,
                                                          int blocks, kq_tokens x, float *out) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(3), top = _mm256_set1_epi8((char)0xc0);
    __m128 acc[KQ_TOKENS][KQ_ROWS / 4];
    for (int t = 0; t < KQ_TOKENS; t++)
        for (int g = 0; g < KQ_ROWS / 4; g++) acc[t][g] = _mm_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk[KQ_ROWS];
        __m256i sums[KQ_TOKENS][KQ_ROWS];
        __m128i tail[KQ_ROWS];
        for (int r = 0; r < KQ_ROWS; r++) {
            tail[r] = _mm_setzero_si128();
            for (int t = 0; t < KQ_TOKENS; t++) sums[t][r] = _mm256_setzero_si256();
            if (r >= R) continue;
            blk[r] = w + r * row_bytes + (int64_t)b * 210;
            /* -32 sum_s sc_s sum x_s, in the same int32 lanes the dots go to */
            __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk[r] + 192)));
            for (int t = 0; t < T && t < KQ_TOKENS; t++)
                sums[t][r] = _mm256_sub_epi32(sums[t][r], kq6_offset(sc, x.bs16 + t * x.k / 16 + b * 16));
            tail[r] = kq6_d(blk[r]);
            kq_prefetch(blk[r], b, blocks, row_bytes, 210);
        }
        for (int h = 0; h < 2; h++) { /* a half of 128 values: ql[64], qh[32] */
            for (int r = 0; r < R && r < KQ_ROWS; r++) {
                const uint8_t *ql = blk[r] + 64 * h, *qh = blk[r] + 128 + 32 * h;
                __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(blk[r] + 192 + 8 * h)));
                __m256i s = _mm256_permute2x128_si256(sc16, sc16, 0x00); /* its 8 scales in both lanes */
                __m256i l0 = kq_load(ql), l1 = kq_load(ql + 32), hb = kq_load(qh);
                __m256i v0 = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_slli_epi16(_mm256_and_si256(hb, two), 4));
                __m256i v1 = _mm256_or_si256(_mm256_and_si256(l1, low4),
                                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), two), 4));
                __m256i v2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                                             _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
                __m256i v3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                             _mm256_srli_epi16(_mm256_and_si256(hb, top), 2));
                __m256i s0 = kq_pick(s, KQ_PICK2[0]), s1 = kq_pick(s, KQ_PICK2[1]), s2 = kq_pick(s, KQ_PICK2[2]),
                        s3 = kq_pick(s, KQ_PICK2[3]);
                for (int t = 0; t < T && t < KQ_TOKENS; t++) {
                    const int8_t *xh = x.xq + t * x.k + b * QK_K + 128 * h;
                    sums[t][r] = kq_scaled_add(sums[t][r], _mm256_maddubs_epi16(v0, kq_load(xh)), s0);
                    sums[t][r] = kq_scaled_add(sums[t][r], _mm256_maddubs_epi16(v1, kq_load(xh + 32)), s1);
                    sums[t][r] = kq_scaled_add(sums[t][r], _mm256_maddubs_epi16(v2, kq_load(xh + 64)), s2);
                    sums[t][r] = kq_scaled_add(sums[t][r], _mm256_maddubs_epi16(v3, kq_load(xh + 96)), s3);
                }
            }
        }
        for (int g = 0; 4 * g < R; g++) {
            __m128i *tl = tail + 4 * g;
            __m128 d = _mm256_castps256_ps128(kq_factors(tl[0], tl[1], tl[2], tl[3]));
            for (int t = 0; t < T && t < KQ_TOKENS; t++) {
                __m256i *s = sums[t] + 4 * g;
                acc[t][g] = kq_acc_step(acc[t][g], x.xd[t * x.blocks + b], d, d, kq_hsum4(s[0], s[1], s[2], s[3]),
                                        _mm_setzero_si128(), 0);
            }
        }
    }
    for (int t = 0; t < T && t < KQ_TOKENS; t++) {
        float all[KQ_ROWS];
        for (int g = 0; 4 * g < R; g++) _mm_storeu_ps(all + 4 * g, acc[t][g]);
        for (int r = 0; r < R && r < KQ_ROWS; r++) out[t * KQ_ROWS + r] = all[r];
    }
}

/* R rows (1 <= R <= KQ_ROWS) of `type` against T tokens (1 <= T <= KQ_TOKENS): each (R, T) its own
 * unrolled copy. */
#ifdef KQ45_WIDE
/* Whether a call of `rows` tokens runs `type` on the 512-bit dots (its activations interleaved for them): Q5_K
 * always; Q4_K where several tokens share the call, its one-token dot staying the 256-bit one (measured: 287
 * against 339 us for 2048x8192, where the 512-bit one's 16-lane reduction serves one token). */
static inline int kq45_wide(int type, int rows) { return type == 13 || (type == 12 && rows > 1); }
#define KQ45(...) (x.wide ? kq45_rows_wide(__VA_ARGS__) : kq45_rows(__VA_ARGS__))
/* (Q6_K takes its activations in the file's order: the 512-bit dot wherever a pass has several tokens) */
#define KQ6(w, row_bytes, R, T, ...) ((T) > 1 ? kq6_rows_wide(w, row_bytes, R, T, __VA_ARGS__) \
                                              : kq6_rows(w, row_bytes, R, T, __VA_ARGS__))
#else
#define KQ45 kq45_rows
#define KQ6 kq6_rows
#endif
static void kquant_rows_dot(const uint8_t *w, int64_t row_bytes, int R, int T, int type, int blocks, kq_tokens x,
                            float *out) {
#define KQ_CASE(n, m)                                                               \
    case (n) * 8 + (m):                                                             \
        if (type == 14)                                                             \
            KQ6(w, row_bytes, n, m, blocks, x, out);                                \
        else if (type == 12)                                                        \
            KQ45(w, row_bytes, n, m, 12, blocks, x, out);                           \
        else                                                                        \
            KQ45(w, row_bytes, n, m, 13, blocks, x, out);                           \
        return;
#define KQ_CASES(n) KQ_CASE(n, 1) KQ_CASE(n, 2) KQ_CASE(n, 3) KQ_CASE(n, 4)
    switch (R * 8 + T) {
        KQ_CASES(1) KQ_CASES(2) KQ_CASES(3) KQ_CASES(4)
    }
#undef KQ_CASES
#undef KQ_CASE
}
