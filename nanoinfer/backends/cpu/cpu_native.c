/* The CPU's fused layer pieces: what lies between a packed model's matmuls, one call each.
 *
 * On the CPU a torch op costs microseconds whatever its size, and a 135M model's layer is
 * ~60 of them around four matmuls. These functions do the element-wise work of a layer in
 * plain loops over contiguous rows: fp32 activations, bf16 where torch's packed matmuls read
 * or write, an fp32 KV pool. nanoinfer/backends/cpu/cpu_native.py builds and binds them; its reference
 * (the torch ops they replace) is tested against them. Single-threaded but for the block
 * matmuls and a large attention call: at a decode step's sizes a thread hand-off costs more
 * than the work. No row's arithmetic depends on the rows beside it (see paged_attention).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's cast does (NaN stays a quiet NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* e^x to about 1 ulp (Cephes' expf polynomial), in plain arithmetic so loops of it vectorize
 * (libm's expf is a call per element). x is clamped to [-87, 88]: e^-87 stands in for 0. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick (round-to-nearest, no libm call) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f; /* ln 2 in two parts: r exact to fp32 */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}

static float sum_squares(const float *x, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += x[i] * x[i];
    return s;
}

/* out = bf16(w * (x * rsqrt(mean(x^2) + eps))) for each row: the norm before a matmul. */
void rms_norm_bf16(const float *x, const float *w, uint16_t *out, int rows, int dim, float eps) {
    for (int r = 0; r < rows; r++, x += dim, out += dim) {
        float inv = 1.0f / sqrtf(sum_squares(x, dim) / dim + eps);
        for (int i = 0; i < dim; i++) out[i] = f32_to_bf16(w[i] * (x[i] * inv));
    }
}

/* x_out = x + y (y the bf16 output of a matmul); h = bf16 rms_norm(x_out): residual and norm. */
void add_rms_norm_bf16(const float *x, const uint16_t *y, const float *w, float *x_out, uint16_t *h, int rows,
                       int dim, float eps) {
    for (int r = 0; r < rows; r++, x += dim, y += dim, x_out += dim, h += dim) {
        for (int i = 0; i < dim; i++) x_out[i] = x[i] + bf16_to_f32(y[i]);
        float inv = 1.0f / sqrtf(sum_squares(x_out, dim) / dim + eps);
        for (int i = 0; i < dim; i++) h[i] = f32_to_bf16(w[i] * (x_out[i] * inv));
    }
}

/* out = bf16(silu(gate) * up) for gate_up rows [gate (inter) | up (inter)], bf16. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inter) {
    for (int r = 0; r < rows; r++, gate_up += 2 * inter, out += inter) {
#pragma omp simd
        for (int i = 0; i < inter; i++) {
            float g = bf16_to_f32(gate_up[i]);
            out[i] = f32_to_bf16(g / (1.0f + exp_approx(-g)) * bf16_to_f32(gate_up[inter + i]));
        }
    }
}

/* nanoinfer.sampling.draw's counter-based hash, on uint32: (x * c) mod 2^32 is the product's low half. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

/* The same on int64 as draw._mix32 computes it: a row's key mixes in the seed's high half
 * shifted arithmetically, so a negative seed feeds ones into the first shift. */
static int64_t mul32_i64(int64_t x, int64_t c) {
    int64_t lo = c & 0xFFFF, hi = c >> 16;
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & 0xFFFFFFFFLL;
}

static int64_t mix32_i64(int64_t x) {
    x ^= x >> 16;
    x = mul32_i64(x, 0x7FEB352D);
    x ^= x >> 15;
    x = mul32_i64(x, 0x846CA68B);
    return x ^ (x >> 16);
}

#define DRAW_CHUNK 1024

/* nanoinfer.sampling.draw.random_draw on fp32 probs [rows, vocab]: per row the first token of the largest
 * p / -log(u), u the uniform of (seed, step, token) (draw.uniform_noise, bit for bit); a token of
 * probability 0 (or NaN) never wins, so an all-zero row gives token 0. Since -log(u) >= 1 - u, a
 * token whose p / (1 - u) cannot pass the best ratio so far skips its log (the 1e-5 margin
 * covers logf's and the division's roundings): in a model's sharp distribution nearly every
 * token costs only its hash, which vectorizes a chunk at a time. */
void random_draw(const float *probs, const int64_t *seeds, const int64_t *steps, int64_t *out, int rows,
                 int vocab) {
    const int64_t mask = 0xFFFFFFFFLL;
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int r = 0; r < rows; r++) {
        int64_t key = mix32_i64(mix32_i64(seeds[r] & mask) ^ (seeds[r] >> 32));
        uint32_t k = (uint32_t)mix32_i64((key + mul32_i64(steps[r] & mask, 0x9E3779B9)) & mask);
        const float *p = probs + (int64_t)r * vocab;
        float best = -1.0f, u[DRAW_CHUNK];
        int64_t winner = 0;
        for (int c = 0; c < vocab; c += DRAW_CHUNK) {
            int n = vocab - c < DRAW_CHUNK ? vocab - c : DRAW_CHUNK;
#pragma omp simd
            for (int i = 0; i < n; i++) {
                uint32_t bits = mix32(mix32(k ^ mix32((uint32_t)(c + i))) + k);
                u[i] = ((float)(bits >> 9) + 0.5f) * (1.0f / 8388608.0f);
            }
            for (int i = 0; i < n; i++) {
                float pi = p[c + i];
                if (!(pi > 0.0f) || pi * 1.00001f <= best * (1.0f - u[i])) continue;
                float ratio = pi / -logf(u[i]);
                if (ratio > best) {
                    best = ratio;
                    winner = c + i;
                }
            }
        }
        out[r] = winner;
    }
}

/* Per-head RMSNorm (Qwen3's q/k norm) in place. */
static void head_norm(float *x, const float *w, int d, float eps) {
    float inv = 1.0f / sqrtf(sum_squares(x, d) / d + eps);
    for (int i = 0; i < d; i++) x[i] = w[i] * (x[i] * inv);
}

/* Rotate-half RoPE of one head in place: (x1 cos - x2 sin, x2 cos + x1 sin). */
static void rope(float *x, const float *cos, const float *sin, int half) {
    for (int i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/* From qkv rows [tokens, (heads + 2 kv_heads) d], bf16 or fp32 (qkv_bf16 0): q and k
 * normed per head (q_norm, k_norm, or NULL) and rotated by the token's cos/sin
 * [tokens, d / 2]; q to q_out [tokens, heads, d], k and v into the pool's flat slots
 * (k_pool, v_pool [slots, kv_heads, d]) at slots[t], -1 skipping the token. */
void rope_write(const void *qkv, int qkv_bf16, const float *q_norm, const float *k_norm, float eps,
                const float *cos, const float *sin, const int64_t *slots, int tokens, int heads, int kv_heads, int d,
                float *k_pool, float *v_pool, float *q_out) {
    int width = (heads + 2 * kv_heads) * d, half = d / 2;
    float row[width];
    for (int t = 0; t < tokens; t++, q_out += heads * d) {
        if (qkv_bf16)
            for (int i = 0; i < width; i++) row[i] = bf16_to_f32(((const uint16_t *)qkv)[(int64_t)t * width + i]);
        else
            memcpy(row, (const float *)qkv + (int64_t)t * width, sizeof(float) * width);
        for (int h = 0; h < heads + kv_heads; h++) {
            float *x = row + h * d;
            const float *norm = h < heads ? q_norm : k_norm;
            if (norm) head_norm(x, norm, d, eps);
            rope(x, cos + (int64_t)t * half, sin + (int64_t)t * half, half);
        }
        memcpy(q_out, row, sizeof(float) * heads * d);
        if (slots[t] >= 0) {
            memcpy(k_pool + slots[t] * kv_heads * d, row + heads * d, sizeof(float) * kv_heads * d);
            memcpy(v_pool + slots[t] * kv_heads * d, row + (heads + kv_heads) * d, sizeof(float) * kv_heads * d);
        }
    }
}

static inline float dot_n(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* The common head sizes as constants: the loop unrolls into a few vector FMAs and one reduce. */
static inline float dot(const float *a, const float *b, int n) {
    if (n == 64) return dot_n(a, b, 64);
    if (n == 128) return dot_n(a, b, 128);
    return dot_n(a, b, n);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KEYS_AT_ONCE 8
/* scores[i] = scale * (q . k_i) for 8 keys (d a multiple of 8): each key's products summed in
 * an FMA chain per lane over d / 8 steps, then the 8 keys' lanes reduced together (a dot
 * product at a time spends as long on its horizontal sum as on its products). */
static inline void dot8(const float *q, const float *const k[8], int d, float scale, float *scores) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) {
        __m256 x = _mm256_loadu_ps(q + c);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[i] + c), a[i]);
    }
    __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
    _mm256_storeu_ps(scores, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
}

/* o[0 .. W) += sum over j, in order, of p[j] * ig * v_j: W / 8 accumulators kept in registers
 * across the keys (W a constant where it is inlined). */
static inline void weighted_sum(const float *p, float ig, const float *v_pool, const int64_t *s, int64_t keys,
                                int64_t stride, int64_t offset, int W, float *o) {
    __m256 a[8];
    for (int i = 0; i < W / 8; i++) a[i] = _mm256_loadu_ps(o + 8 * i);
    for (int64_t j = 0; j < keys; j++) {
        const float *v = v_pool + s[j] * stride + offset;
        __m256 pj = _mm256_set1_ps(p[j] * ig);
        for (int i = 0; i < W / 8; i++) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * i), a[i]);
    }
    for (int i = 0; i < W / 8; i++) _mm256_storeu_ps(o + 8 * i, a[i]);
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
/* ARM: dot8 and weighted_sum here, and the block matmul's row_dot and quantize_groups_q8 below */
#include "cpu_native_arm.h"
#else
#define KEYS_AT_ONCE 1
#endif

/* Keys a block of rows takes at a time in P V: their values are read once for the block. */
#define KEY_BLOCK 64

/* Rows i < n of one sequence, at consecutive positions: row i of q [n, heads, d] attends to the
 * first c0 + i of the pool slots s (k_pool, v_pool [slots, kv_heads, d]); out like q. Each
 * row's arithmetic is the same whatever n: its scores 8 keys at a time from its first key and
 * the rest one by one, its softmax, P V summed key by key in order. A block only shares the
 * reads of the keys, which a long chunk would otherwise bring from memory once per row. The
 * heads sharing a KV head go together too. scores: scratch of n * (heads / kv_heads) *
 * (c0 + n - 1) floats. */
static void attend(const float *q, int n, int64_t c0, const float *k_pool, const float *v_pool, const int64_t *s,
                   int heads, int kv_heads, int d, float scale, float *scores, float *out) {
    int group = heads / kv_heads, by8 = KEYS_AT_ONCE > 1 && d % 8 == 0;
    int64_t width = c0 + n - 1, hd = (int64_t)heads * d;
    float inv[n * group];
    for (int kvh = 0; kvh < kv_heads; kvh++) {
        const float *qg = q + (int64_t)kvh * group * d;
        float *og = out + (int64_t)kvh * group * d;
        int64_t j = 0;
#if KEYS_AT_ONCE > 1
        for (; by8 && j + KEYS_AT_ONCE <= c0; j += KEYS_AT_ONCE) { /* the key groups every row has */
            const float *k[KEYS_AT_ONCE];
            for (int e = 0; e < KEYS_AT_ONCE; e++) k[e] = k_pool + (s[j + e] * kv_heads + kvh) * d;
            for (int i = 0; i < n; i++)
                for (int g = 0; g < group; g++)
                    dot8(qg + i * hd + g * d, k, d, scale, scores + (int64_t)(i * group + g) * width + j);
        }
#endif
        for (int i = 0; i < n; i++) {
            int64_t keys = c0 + i, jj = j;
            float *sc = scores + (int64_t)i * group * width;
            const float *qi = qg + i * hd;
#if KEYS_AT_ONCE > 1
            for (; by8 && jj + KEYS_AT_ONCE <= keys; jj += KEYS_AT_ONCE) {
                const float *k[KEYS_AT_ONCE];
                for (int e = 0; e < KEYS_AT_ONCE; e++) k[e] = k_pool + (s[jj + e] * kv_heads + kvh) * d;
                for (int g = 0; g < group; g++) dot8(qi + g * d, k, d, scale, sc + g * width + jj);
            }
#endif
            for (; jj < keys; jj++) { /* (the last keys, fewer than KEYS_AT_ONCE) */
                const float *k = k_pool + (s[jj] * kv_heads + kvh) * d;
                for (int g = 0; g < group; g++) sc[g * width + jj] = dot(qi + g * d, k, d) * scale;
            }
            for (int g = 0; g < group; g++) {
                float *row = sc + g * width, m = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : m)
                for (int64_t t = 0; t < keys; t++) m = row[t] > m ? row[t] : m;
#pragma omp simd reduction(+ : total)
                for (int64_t t = 0; t < keys; t++) total += row[t] = exp_approx(row[t] - m);
                inv[i * group + g] = 1.0f / total;
            }
            for (int g = 0; g < group; g++) memset(og + i * hd + g * d, 0, sizeof(float) * d);
        }
#if KEYS_AT_ONCE > 1
        if (by8) {
            for (int64_t jb = 0; jb < width; jb += KEY_BLOCK)
                for (int i = 0; i < n; i++) {
                    int64_t end = c0 + i < jb + KEY_BLOCK ? c0 + i : jb + KEY_BLOCK;
                    for (int g = 0; end > jb && g < group; g++) {
                        const float *p = scores + (int64_t)(i * group + g) * width + jb;
                        float *o = og + i * hd + g * d, ig = inv[i * group + g];
                        int c = 0;
                        for (; c + 64 <= d; c += 64)
                            weighted_sum(p, ig, v_pool, s + jb, end - jb, (int64_t)kv_heads * d,
                                         (int64_t)kvh * d + c, 64, o + c);
                        for (; c < d; c += 8)
                            weighted_sum(p, ig, v_pool, s + jb, end - jb, (int64_t)kv_heads * d,
                                         (int64_t)kvh * d + c, 8, o + c);
                    }
                }
            continue;
        }
#endif
        for (int i = 0; i < n; i++)
            for (int64_t t = 0; t < c0 + i; t++) {
                const float *v = v_pool + (s[t] * kv_heads + kvh) * d;
                for (int g = 0; g < group; g++) {
                    float p = scores[(int64_t)(i * group + g) * width + t] * inv[i * group + g];
                    float *o = og + i * hd + g * d;
#pragma omp simd
                    for (int c = 0; c < d; c++) o[c] += p * v[c];
                }
            }
    }
}

/* Attention work (multiply-adds) below which a call stays on one thread: a thread hand-off
 * costs more than a decode step's few rows. */
#define ATTENTION_PARALLEL_WORK (1 << 18)
/* Rows of a chunk attended together (`attend`): enough to share the keys' reads, few enough to
 * spread a chunk over the threads. */
#define ROW_BLOCK 16

/* Every query row of a step, each by `attend` over its own keys: sequence s owns rows
 * query_start[s] .. query_start[s + 1], its newest tokens, the last at position lens[s] - 1;
 * the row at position p sees positions [max(0, p + 1 - window), p] (window 0: [0, p]),
 * found through block table s (int32, rows table_stride apart). A row's arithmetic depends on
 * its query and its keys only, never on the rows beside it or the thread that takes it, so a
 * token comes out bit for bit the same in a prefill chunk of any size, a decode step or a
 * verification row: the int8 rounding of the matmuls after it sees the same inputs. Rows go
 * to `threads` threads when the work is large (a prefill chunk). q and out hold `tokens` rows;
 * those past the last sequence's (padding) come out zero. Returns 0, or -1 when there
 * was no memory for the scratch (the slots of every context, and each thread's scores). */
int paged_attention(const float *q, int tokens, const float *k_pool, const float *v_pool, const int32_t *tables,
                    int64_t table_stride, const int32_t *lens, const int32_t *query_start, int seqs, int block_size,
                    int window, int heads, int kv_heads, int d, float scale, int threads, float *out) {
    int64_t total = 0, max_keys = 0, work = 0;
    int rows = query_start[seqs] - query_start[0];
    for (int s = 0; s < seqs; s++) {
        int64_t len = lens[s], n = query_start[s + 1] - query_start[s];
        int64_t keys = window > 0 && len > window ? window : len;
        total += len;
        max_keys = keys > max_keys ? keys : max_keys;
        work += n * keys;
    }
    if (tokens > query_start[seqs]) memset(out + (int64_t)query_start[seqs] * heads * d, 0,
                                           sizeof(float) * (tokens - query_start[seqs]) * heads * d);
    if (rows <= 0) return 0;
    /* work items: up to ROW_BLOCK consecutive rows of a sequence that see the same first key
     * (without a window: all of a chunk's), or single rows */
    int64_t *slots = malloc(sizeof(int64_t) * (total + 1)), *base = malloc(sizeof(int64_t) * seqs);
    int *item_seq = malloc(sizeof(int) * rows), *item_row = malloc(sizeof(int) * rows), items = 0;
    int failed = !slots || !base || !item_seq || !item_row;
    if (!failed)
        for (int64_t s = 0, offset = 0; s < seqs; offset += lens[s], s++) { /* each context's slots once */
            const int32_t *table = tables + s * table_stride;
            base[s] = offset;
            for (int64_t p = 0; p < lens[s]; p++)
                slots[offset + p] = (int64_t)table[p / block_size] * block_size + p % block_size;
            for (int r = query_start[s]; r < query_start[s + 1]; r += window > 0 ? 1 : ROW_BLOCK)
                item_seq[items] = s, item_row[items++] = r;
        }
    int group = heads / kv_heads, parallel = threads > 1 && work * heads * d > ATTENTION_PARALLEL_WORK;
    int block = window > 0 ? 1 : ROW_BLOCK;
    if (!failed) {
#pragma omp parallel num_threads(parallel ? threads : 1) if (parallel)
        {
            float *scores = malloc(sizeof(float) * block * group * (max_keys + block));
            if (!scores) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < items; i++) {
                if (!scores) continue;
                int s = item_seq[i], row = item_row[i];
                int n = query_start[s + 1] - row < block ? query_start[s + 1] - row : block;
                int64_t p = lens[s] - (query_start[s + 1] - row); /* the first row's position */
                int64_t lo = window > 0 && p + 1 > window ? p + 1 - window : 0;
                attend(q + (int64_t)row * heads * d, n, p + 1 - lo, k_pool, v_pool, slots + base[s] + lo, heads,
                       kv_heads, d, scale, scores, out + (int64_t)row * heads * d);
            }
            free(scores);
        }
    }
    free(slots), free(base), free(item_seq), free(item_row);
    return failed ? -1 : 0;
}

/* ---- Block matmuls with int8 activations: llama.cpp's method for 4- and 8-bit groups ----
 *
 * torch's packed int4 kernel multiplies in fp32 and is bound by the cores' FMA rate, not by
 * memory. Here each group of 32 activations is rounded to int8 with its own scale (ggml's
 * Q8_0), and products of the weights' unsigned integers with them are integer instructions
 * (vpdpbusd: u8 x s8 summed in fours into int32; on plain AVX2 vpmaddubsw + vpmaddwd):
 *   sum_i (d q_i + m) (dx qx_i) = d dx sum_i q_i qx_i + m (dx sum_i qx_i).
 *
 * Layout (quantized.BlockWeight writes it): a weight row [k] is chunks of G groups of 32,
 * G = 8 while 8 are left, then 4, 2, 1 as the rest needs. In a chunk, value 4 s + i of group
 * j (step s of 8, i of 4) sits at byte 4 (G s + j) + i (8 bits); for 4 bits, the chunk's
 * 16 G bytes hold the first half of that order in their low nibbles and the second half in
 * their high ones. So each 32-byte load (or nibble half of one) is four values of each of
 * the chunk's groups: int32 lane l sums group l % G, and a chunk ends as one vector scaled by
 * its groups' scales (repeated 8 / G times) in one multiply-add, no horizontal sums. The
 * activations are quantized into the same order (that of 8 bits). Scale d and min m are
 * fp16 [n, k / 32]. */
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define BLOCK_DOT 1

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_ISA 3
static inline __m256i dot_acc(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(acc, w, x); }
#elif defined(__AVXVNNI__)
#define DOT_ISA 2
static inline __m256i dot_acc(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
#else
#define DOT_ISA 1
/* (u8 x s8 pairs summed to int16 saturate past 32767: exact for weights below 2^7) */
static inline __m256i dot_acc(__m256i acc, __m256i w, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
#endif

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 8-bit weights as dot_acc takes them: whole bytes, or on plain AVX2 16 high + low nibbles */
static inline __m256i dot_acc8(__m256i acc, __m256i w, __m256i x) {
#if DOT_ISA == 1
    __m256i low = _mm256_set1_epi8(0x0f);
    __m256i hi = dot_acc(_mm256_setzero_si256(), _mm256_and_si256(_mm256_srli_epi16(w, 4), low), x);
    return dot_acc(_mm256_add_epi32(acc, _mm256_slli_epi32(hi, 4)), _mm256_and_si256(w, low), x);
#else
    return dot_acc(acc, w, x);
#endif
}

/* A chunk's lane sums (G a constant where it is inlined); two chains so the adds overlap. */
static inline __m256i chunk_dot(const uint8_t *q, const int8_t *x, int bits, int G) {
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256(), low = _mm256_set1_epi8(0x0f);
    if (bits == 8)
        for (int l = 0; l < G; l += 2) {
            a = dot_acc8(a, load32(q + 32 * l), load32(x + 32 * l));
            if (l + 1 < G) b = dot_acc8(b, load32(q + 32 * l + 32), load32(x + 32 * l + 32));
        }
    else if (G == 1) { /* 16 bytes: both nibble halves in one vector */
        __m128i v = _mm_loadu_si128((const __m128i *)q), low4 = _mm_set1_epi8(0x0f);
        a = dot_acc(a, _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4)), load32(x));
    } else if (DOT_ISA == 1) {
        /* Plain AVX2: the u8 x s8 pair sums stay int16 over the chunk and widen once (one
         * vpmaddwd a chunk, not one a load). Exact: an int16 lane sums at most 8 pairs of
         * 15 x 127 (the activations' int8 stay within +-127), 30480 < 32767. */
        for (int l = 0; l < G / 2; l++) {
            __m256i w = load32(q + 32 * l);
            a = _mm256_add_epi16(a, _mm256_maddubs_epi16(_mm256_and_si256(w, low), load32(x + 32 * l)));
            b = _mm256_add_epi16(b, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), low),
                                                         load32(x + 16 * G + 32 * l)));
        }
        return _mm256_madd_epi16(_mm256_add_epi16(a, b), _mm256_set1_epi16(1));
    } else
        for (int l = 0; l < G / 2; l++) {
            __m256i w = load32(q + 32 * l);
            a = dot_acc(a, _mm256_and_si256(w, low), load32(x + 32 * l));
            b = dot_acc(b, _mm256_and_si256(_mm256_srli_epi16(w, 4), low), load32(x + 16 * G + 32 * l));
        }
    return _mm256_add_epi32(a, b);
}

/* d[j] * xd[j] for the chunk's G groups, lane l holding group l % G's. */
static inline __m256 chunk_scales(const uint16_t *d, const float *xd, int G) {
    if (G == 8) return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d)), _mm256_loadu_ps(xd));
    if (G == 1) return _mm256_set1_ps(_cvtsh_ss(d[0]) * xd[0]);
    float s[4];
    for (int j = 0; j < G; j++) s[j] = _cvtsh_ss(d[j]) * xd[j];
    if (G == 4) return _mm256_set_m128(_mm_loadu_ps(s), _mm_loadu_ps(s));
    return _mm256_setr_ps(s[0], s[1], s[0], s[1], s[0], s[1], s[0], s[1]);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The tail of a row's dot past its whole chunks of 8 groups (g of them done), and its sum. */
static inline float row_dot_finish(__m256 acc, __m256 mins, const uint8_t *q, const uint16_t *d, const uint16_t *m,
                                   const int8_t *xq, const float *xd, const float *xs, int g, int groups, int bits) {
    float rest = 0.0f;
    for (int G = 4; G >= 1; G /= 2) /* unrolled by the compiler: each G a constant */
        if ((groups - g) & G) {
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(chunk_dot(q, xq, bits, G)), chunk_scales(d + g, xd + g, G), acc);
            for (int j = g; j < g + G; j++) rest += _cvtsh_ss(m[j]) * xs[j];
            g += G, q += 4 * bits * G, xq += 32 * G;
        }
    return hsum8(_mm256_add_ps(acc, mins)) + rest;
}

/* Tokens a row's chunk is unpacked once for (block_matmul_to's prefill): as many as the registers hold
 * (its 8 weight registers and two accumulators a token) — AVX-512's 32, AVX2's 16. */
#if defined(__AVX512VL__)
#define ROW_TOKENS 4
#else
#define ROW_TOKENS 2
#endif

/* A chunk of 8 groups' weights as chunk_dot loads them: 4-bit, the low nibbles' 4 registers then the high's;
 * 8-bit, its 8 loads. */
static inline void chunk_weights(const uint8_t *q, int bits, __m256i w[8]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int l = 0; l < (bits == 8 ? 8 : 4); l++) {
        __m256i v = load32(q + 32 * l);
        if (bits == 8)
            w[l] = v;
        else
            w[l] = _mm256_and_si256(v, low), w[4 + l] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
}

/* chunk_dot(q, x, bits, 8) from its weights unpacked by chunk_weights: the same lane sums. */
static inline __m256i chunk_dot_w(const __m256i w[8], const int8_t *x, int bits) {
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    if (bits == 8)
        for (int l = 0; l < 8; l += 2) {
            a = dot_acc8(a, w[l], load32(x + 32 * l));
            b = dot_acc8(b, w[l + 1], load32(x + 32 * l + 32));
        }
    else if (DOT_ISA == 1) {
        for (int l = 0; l < 4; l++) {
            a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w[l], load32(x + 32 * l)));
            b = _mm256_add_epi16(b, _mm256_maddubs_epi16(w[4 + l], load32(x + 128 + 32 * l)));
        }
        return _mm256_madd_epi16(_mm256_add_epi16(a, b), _mm256_set1_epi16(1));
    } else
        for (int l = 0; l < 4; l++) {
            a = dot_acc(a, w[l], load32(x + 32 * l));
            b = dot_acc(b, w[4 + l], load32(x + 128 + 32 * l));
        }
    return _mm256_add_epi32(a, b);
}

#if DOT_ISA == 3 && defined(__AVX512BW__)
/* A 4-bit chunk's weights in 512-bit registers (AVX-512 VNNI): w[0], w[1] the low nibbles of its 64-byte halves,
 * w[2], w[3] the high ones; its dot in 4 vpdpbusd, not 8. Lane i of the low 256 bits and lane i of the high sum
 * what lane i of chunk_dot's 256-bit sums holds (the products of its loads 2j and 2j + 1): folded, the same
 * integers. */
#define CHUNK_WIDE 1
static inline void chunk_weights4_wide(const uint8_t *q, __m512i w[4]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < 2; j++) {
        __m512i v = _mm512_loadu_si512((const void *)(q + 64 * j));
        w[j] = _mm512_and_si512(v, low), w[2 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
}

static inline __m256i chunk_dot4_wide(const __m512i w[4], const int8_t *x) {
    __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_loadu_si512((const void *)x));
    __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[2], _mm512_loadu_si512((const void *)(x + 128)));
    a = _mm512_dpbusd_epi32(a, w[1], _mm512_loadu_si512((const void *)(x + 64)));
    b = _mm512_dpbusd_epi32(b, w[3], _mm512_loadu_si512((const void *)(x + 192)));
    __m512i s = _mm512_add_epi32(a, b);
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}
#endif

/* One weight row against T tokens (T <= ROW_TOKENS, a constant where inlined; token t's rows at xq + t k,
 * xd + t groups, xs + t groups): each chunk's weights unpacked once for all of them, each token's operations those
 * of a one-token call (T = 1), in its order: the same bits as one token at a time. */
static inline __attribute__((always_inline)) void row_dot_tokens(const uint8_t *q, const uint16_t *d,
                                                                 const uint16_t *m, const int8_t *xq, const float *xd,
                                                                 const float *xs, int groups, int bits, int64_t k,
                                                                 int T, float *out) {
    __m256 acc[ROW_TOKENS], mins[ROW_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = mins[t] = _mm256_setzero_ps();
    int g = 0;
    const uint8_t *qc = q;
    for (; g + 8 <= groups; g += 8, qc += 32 * bits) {
        __m256i w[8];
#ifdef CHUNK_WIDE
        __m512i wide[4];
        if (bits == 4)
            chunk_weights4_wide(qc, wide);
        else
#endif
            chunk_weights(qc, bits, w);
        __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + g)));
        __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + g)));
        for (int t = 0; t < T; t++) {
#ifdef CHUNK_WIDE
            __m256i sums = bits == 4 ? chunk_dot4_wide(wide, xq + t * k + 32 * g) : chunk_dot_w(w, xq + t * k + 32 * g, bits);
#else
            __m256i sums = chunk_dot_w(w, xq + t * k + 32 * g, bits);
#endif
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dv, _mm256_loadu_ps(xd + t * groups + g)),
                                     acc[t]);
            mins[t] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + t * groups + g), mins[t]);
        }
    }
    for (int t = 0; t < T; t++)
        out[t] = row_dot_finish(acc[t], mins[t], qc, d, m, xq + t * k + 32 * g, xd + t * groups, xs + t * groups, g,
                                groups, bits);
}

static void row_dot_some(const uint8_t *q, const uint16_t *d, const uint16_t *m, const int8_t *xq, const float *xd,
                         const float *xs, int groups, int bits, int64_t k, int T, float *out) {
    switch (T) { /* (each T its own unrolled copy) */
    case 1: row_dot_tokens(q, d, m, xq, xd, xs, groups, bits, k, 1, out); return;
    case 2: row_dot_tokens(q, d, m, xq, xd, xs, groups, bits, k, 2, out); return;
#if ROW_TOKENS > 2
    case 3: row_dot_tokens(q, d, m, xq, xd, xs, groups, bits, k, 3, out); return;
    case 4: row_dot_tokens(q, d, m, xq, xd, xs, groups, bits, k, 4, out); return;
#endif
    }
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
/* row_dot, BLOCK_DOT and DOT_ISA (4 neon, 5 neon-dotprod, 6 neon-i8mm): cpu_native_arm.h, included above;
 * block_matmul_to calls its row_dot a token at a time (row_dot_some below) */
#else
#define BLOCK_DOT 0
#define DOT_ISA 0
#endif

#if BLOCK_DOT && !defined(ROW_TOKENS)
/* (a build whose row_dot takes one token at a time: ARM's) */
#define ROW_TOKENS 1
static void row_dot_some(const uint8_t *q, const uint16_t *d, const uint16_t *m, const int8_t *xq, const float *xd,
                         const float *xs, int groups, int bits, int64_t k, int T, float *out) {
    (void)k, (void)T;
    out[0] = row_dot(q, d, m, xq, xd, xs, groups, bits);
}
#endif

#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8
#endif

/* Which group dot product this build has: 3 AVX-512 VNNI, 2 AVX-VNNI, 1 AVX2, 6 NEON i8mm,
 * 5 NEON dotprod, 4 NEON, 0 none (block_matmul is then not to be called). */
int block_dot_isa(void) { return DOT_ISA; }

/* The same, as a user reads it (`nanoinfer env`, the log line at start). */
const char *block_dot_name(void) {
    switch (DOT_ISA) {
    case 3: return "avx512-vnni";
    case 2: return "avx-vnni";
    case 1: return "avx2";
    case 4: return "neon";
    case 5: return "neon-dotprod";
    case 6: return "neon-i8mm";
    default: return "none";
    }
}

/* x [rows, k] bf16 to ggml's Q8_0 per group of 32, in the chunk order above: xq = round(x / dx)
 * with dx = max|x| / 127; xd = dx and xs = dx * sum(xq) (what the weights' mins multiply)
 * [rows, k / 32]. */
#if !(defined(__aarch64__) && defined(__ARM_NEON)) /* (ARM's, the same bits: cpu_native_arm.h) */
void quantize_groups_q8(const uint16_t *x, int rows, int k, int8_t *xq, float *xd, float *xs) {
    int groups = k / 32;
    for (int64_t r = 0; r < rows; r++)
        for (int start = 0, G = 8; start < groups; start += G) {
            while (start + G > groups) G /= 2;
            for (int j = 0; j < G; j++) {
                int g = start + j;
                const uint16_t *xg = x + r * k + g * 32;
                float v[32], amax = 0.0f;
                for (int i = 0; i < 32; i++) {
                    v[i] = bf16_to_f32(xg[i]);
                    amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
                }
                float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
                int sum = 0;
                int8_t *chunk = xq + r * k + start * 32;
                for (int i = 0; i < 32; i++) {
                    int qi = (int)nearbyintf(v[i] * inv);
                    chunk[4 * (G * (i / 4) + j) + i % 4] = (int8_t)qi;
                    sum += qi;
                }
                xd[r * groups + g] = amax / 127.0f;
                xs[r * groups + g] = amax / 127.0f * (float)sum;
            }
        }
}
#endif

/* y [rows, n] = x [rows, k] bf16 @ w.T, w [n, k] as above: bf16, or fp32 where y_f32 (a
 * tensor-parallel rank's partial sum, rounded only once the ranks' parts are added). Returns
 * 0, or -1 when there was no memory for the quantized x (rows * k * 5 / 4 bytes). */
static int block_matmul_to(const uint16_t *x, int rows, int k, const uint8_t *q, const uint16_t *d, const uint16_t *m,
                           int bits, int n, void *y, int64_t ldy, int y_f32, int threads) {
#if BLOCK_DOT
    int groups = k / 32;
    int64_t row_bytes = (int64_t)k * bits / 8;
    int8_t *xq = malloc((size_t)rows * k * 5 / 4);
    if (!xq) return -1;
    float *xd = (float *)(xq + (int64_t)rows * k), *xs = xd + (int64_t)rows * groups;
    quantize_groups_q8(x, rows, k, xq, xd, xs);
    /* Tokens in tiles whose activations stay in L2 (~256 KiB) while every row runs over them (each tile reads
     * the weights once), ROW_TOKENS of them sharing each unpacked chunk of a row. */
    int tile = (int)(262144 / k) > ROW_TOKENS ? (int)(262144 / k) : ROW_TOKENS;
    for (int t0 = 0; t0 < rows; t0 += tile) {
        int t1 = t0 + tile < rows ? t0 + tile : rows;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int r = 0; r < n; r++) {
            /* a few rows ahead: the hardware prefetcher alone left a core's stream at ~60% of its bandwidth */
            const uint8_t *ahead = q + (int64_t)(r + PREFETCH_ROWS < n ? r + PREFETCH_ROWS : r) * row_bytes;
            for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 3);
            for (int t = t0; t < t1; t += ROW_TOKENS) {
                int T = t1 - t < ROW_TOKENS ? t1 - t : ROW_TOKENS;
                float v[ROW_TOKENS];
                row_dot_some(q + r * row_bytes, d + (int64_t)r * groups, m + (int64_t)r * groups, xq + (int64_t)t * k,
                             xd + (int64_t)t * groups, xs + (int64_t)t * groups, groups, bits, k, T, v);
                for (int u = 0; u < T; u++) {
                    if (y_f32)
                        ((float *)y)[(int64_t)(t + u) * ldy + r] = v[u];
                    else
                        ((uint16_t *)y)[(int64_t)(t + u) * ldy + r] = f32_to_bf16(v[u]);
                }
            }
        }
    }
    free(xq);
#endif
    return 0;
}

/* block_matmul_to over y [rows, n] (what cpu_native.py binds) */
int block_matmul(const uint16_t *x, int rows, int k, const uint8_t *q, const uint16_t *d, const uint16_t *m, int bits,
                 int n, void *y, int y_f32, int threads) {
    return block_matmul_to(x, rows, k, q, d, m, bits, n, y, n, y_f32, threads);
}

#include "cpu_native_kquants.h"

/* ---- A whole layer in one call ----
 *
 * The pieces above, composed as cpu_layers.py composes them one call each (the same functions,
 * so the same bits): on a decode step the calls' Python and ctypes overhead had cost about as
 * long as the matmuls. The weights' pointers are set up once per layer (block_layer), the
 * step's tables once per step (block_step); both are cpu_native.py's ctypes Structures. */
typedef struct block_mat {
    const uint8_t *q;
    const uint16_t *d, *m;
    int bits, n;
    int type;                    /* 0: groups of 32 (q, d, m, bits); 12, 13, 14: K-quant rows (q), ggml's type id */
    const struct block_mat *next; /* the rows after these n, in another form (a fused matrix of mixed types), or NULL */
} block_mat;

static int mat_rows(const block_mat *M) { return M ? M->n + mat_rows(M->next) : 0; }

/* y [rows, mat_rows(M)] bf16 = x [rows, k] @ M.T, each segment of rows in its own form. */
static int mat_matmul(const uint16_t *x, int rows, int k, const block_mat *M, uint16_t *y, int threads) {
    int failed = 0, n = mat_rows(M), col = 0;
    for (; M; col += M->n, M = M->next)
        failed |= M->type ? kquant_matmul_to(x, rows, k, M->q, M->type, M->n, y + col, n, 0, threads)
                          : block_matmul_to(x, rows, k, M->q, M->d, M->m, M->bits, M->n, y + col, n, 0, threads);
    return failed;
}

typedef struct {
    block_mat qkv, o, gate_up, down;
    const float *attn_norm, *mlp_norm, *q_norm, *k_norm, *qkv_bias; /* the last three may be NULL */
} block_layer;

typedef struct {
    int tokens, hidden, heads, kv_heads, d, seqs, block_size, window, threads;
    float eps, scale;
    const int64_t *slots;
    const int32_t *tables, *lens, *query_start;
    int64_t table_stride;
} block_step;

/* x_out [tokens, hidden] = the layer applied to x [tokens, hidden] (x_out may be x), writing
 * this step's keys and values into the pools (k_pool, v_pool [slots, kv_heads, d]); cos, sin
 * [tokens, d / 2]. Returns 0, or -1 when there was no memory for the scratch. */
int block_layer_forward(const block_layer *L, const block_step *S, const float *cos, const float *sin,
                        float *k_pool, float *v_pool, const float *x, float *x_out) {
    int64_t T = S->tokens, H = S->hidden, qs = (int64_t)S->heads * S->d;
    int64_t width = qs + 2 * (int64_t)S->kv_heads * S->d, inter = mat_rows(&L->gate_up) / 2;
    int64_t u16 = T * (H + width + qs + H + 2 * inter + inter + H), f32 = T * (2 * qs + (L->qkv_bias ? width : 0));
    float *fbuf = malloc(sizeof(float) * f32 + sizeof(uint16_t) * u16);
    if (!fbuf) return -1;
    float *q = fbuf, *attn = q + T * qs, *qkv_f = attn + T * qs;
    uint16_t *h = (uint16_t *)(fbuf + f32), *qkv = h + T * H, *attn16 = qkv + T * width, *o = attn16 + T * qs;
    uint16_t *gate_up = o + T * H, *act = gate_up + T * 2 * inter, *down = act + T * inter;
    int failed = 0;
    rms_norm_bf16(x, L->attn_norm, h, T, H, S->eps);
    failed |= mat_matmul(h, T, H, &L->qkv, qkv, S->threads);
    if (L->qkv_bias) { /* (as the pieces add it: to the bf16 output, in fp32) */
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < width; i++) qkv_f[t * width + i] = bf16_to_f32(qkv[t * width + i]) + L->qkv_bias[i];
        rope_write(qkv_f, 0, L->q_norm, L->k_norm, S->eps, cos, sin, S->slots, T, S->heads, S->kv_heads, S->d, k_pool,
                   v_pool, q);
    } else
        rope_write(qkv, 1, L->q_norm, L->k_norm, S->eps, cos, sin, S->slots, T, S->heads, S->kv_heads, S->d, k_pool,
                   v_pool, q);
    failed |= paged_attention(q, T, k_pool, v_pool, S->tables, S->table_stride, S->lens, S->query_start, S->seqs,
                              S->block_size, S->window, S->heads, S->kv_heads, S->d, S->scale, S->threads, attn);
    for (int64_t i = 0; i < T * qs; i++) attn16[i] = f32_to_bf16(attn[i]);
    failed |= mat_matmul(attn16, T, qs, &L->o, o, S->threads);
    add_rms_norm_bf16(x, o, L->mlp_norm, x_out, h, T, H, S->eps);
    failed |= mat_matmul(h, T, H, &L->gate_up, gate_up, S->threads);
    silu_mul_bf16(gate_up, act, T, inter);
    failed |= mat_matmul(act, T, inter, &L->down, down, S->threads);
    for (int64_t i = 0; i < T * H; i++) x_out[i] += bf16_to_f32(down[i]);
    free(fbuf);
    return failed ? -1 : 0;
}
