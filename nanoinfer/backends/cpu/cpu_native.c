/* The CPU's fused layer pieces: what lies between a packed model's matmuls, one call each.
 *
 * On the CPU a torch op costs microseconds whatever its size, and a 135M model's layer is
 * ~60 of them around four matmuls. These functions do the element-wise work of a layer in
 * plain loops over contiguous rows: fp32 activations, bf16 where torch's packed matmuls read
 * or write, an fp32 KV pool. nanoinfer/backends/cpu/cpu_native.py builds and binds them; its reference
 * (the torch ops they replace) is tested against them. Single-threaded but for the block
 * matmuls and a large attention call: at a decode step's sizes a thread hand-off costs more
 * than the work. No row's arithmetic depends on the rows beside it (see paged_attention).
 *
 * One translation unit, split by kernel: the attention (cpu_native_attention.h), the block matmuls of
 * 32-value groups (cpu_native_groups.h) and of K-quant super-blocks (cpu_native_kquants.h) are
 * included below, before the whole-layer call that composes them.
 */
#if defined(__GNUC__) && !defined(__clang__) && !defined(__AVX512F__)
/* A loop with a float compare-and-select (exp_approx's clamp) vectorizes without AVX-512's masks only
 * where GCC may evaluate both sides: no value changes, only the FP exception flags, which nothing reads.
 * AVX2's SwiGLU of 8192 values ran scalar, 45 us a call, 3% of a decode step, on the calling thread alone
 * (22 us with it); the AVX-512 build's masked loops ran slower with it, so it stays off there. */
#pragma GCC optimize("no-trapping-math")
#endif
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

/* nanoinfer.sampling.sampler.greedy_and_finite on fp32 logits [rows, vocab]: per row the first token of the
 * largest logit (torch's argmax: the first NaN if there is one) and whether every logit is finite. Two passes
 * over a row that is still in cache: its max and a sum that turns NaN at any inf or NaN (x - x), both
 * vectorized; then the first token equal to the max (or the first NaN). */
void greedy_rows(const float *logits, int64_t *tokens, uint8_t *finite, int rows, int vocab) {
    for (int r = 0; r < rows; r++) {
        const float *x = logits + (int64_t)r * vocab;
        float best = -INFINITY, spread = 0.0f;
#pragma omp simd reduction(max : best) reduction(+ : spread)
        for (int i = 0; i < vocab; i++) {
            best = x[i] > best ? x[i] : best;
            spread += x[i] - x[i];
        }
        int ok = spread == 0.0f, at = 0;
        if (ok) {
            while (x[at] != best) at++;
        } else {  /* the first NaN, else the first of the max (an inf) */
            int nan = -1, first = -1;
            for (int i = 0; i < vocab && nan < 0; i++) {
                if (x[i] != x[i]) nan = i;
                else if (first < 0 && x[i] == best) first = i;
            }
            at = nan >= 0 ? nan : first < 0 ? 0 : first;
        }
        tokens[r] = at;
        finite[r] = (uint8_t)ok;
    }
}

/* Rows ids[0 .. n) of a grouped table (q [rows, cols] uint8, scale and min [rows, cols / group] fp32) to fp32 out
 * [n, cols]: scale q + min, the product rounded before the sum as quantized.dequantize's torch ops round them
 * (this file is ISO C: no contraction into an fma), so the same bits; an embedding's lookup, ~0.1 ms of a decode
 * step in those ops. Returns -1, or the place in ids of one past the table (nothing written then). */
int64_t group_rows(const uint8_t *q, const float *scale, const float *min, int64_t rows, int cols, int group,
                   const int64_t *ids, int n, float *out) {
    const int groups = cols / group;
    for (int r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= rows) return r; /* (the caller names the id) */
    for (int r = 0; r < n; r++) {
        const uint8_t *qr = q + ids[r] * cols;
        const float *sr = scale + ids[r] * groups, *mr = min + ids[r] * groups;
        float *o = out + (int64_t)r * cols;
        for (int g = 0; g < groups; g++)
            for (int i = g * group; i < (g + 1) * group; i++) o[i] = sr[g] * (float)qr[i] + mr[g];
    }
    return -1;
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

#include "cpu_native_attention.h"

#include "cpu_native_groups.h"

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
    int interleaved;             /* rows in groups of this many (block_ or kquant_interleave_rows), or 0 */
    const struct block_mat *next; /* the rows after these n, in another form (a fused matrix of mixed types), or NULL */
} block_mat;

static int mat_rows(const block_mat *M) { return M ? M->n + mat_rows(M->next) : 0; }

/* The worse of two return codes (-2, a layout this build does not read, over -1, no memory, over 0) */
static int worse(int a, int b) { return a < b ? a : b; }

/* y [rows, mat_rows(M)] bf16 = x [rows, k] @ M.T, each segment of rows in its own form. */
static int mat_matmul(const uint16_t *x, int rows, int k, const block_mat *M, uint16_t *y, int threads) {
    int failed = 0, n = mat_rows(M), col = 0;
    for (; M; col += M->n, M = M->next)
        failed = worse(failed, M->type ? kquant_matmul_to(x, rows, k, M->q, M->type, M->interleaved, M->n, y + col, n,
                                                          0, threads)
                                       : block_matmul_to(x, rows, k, M->q, M->d, M->m, M->bits, M->interleaved, M->n,
                                                         y + col, n, 0, threads));
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
 * [tokens, d / 2]. Returns 0, -1 when there was no memory for the scratch, -2 for a weight in a layout this build
 * does not read. */
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
    failed = worse(failed, mat_matmul(h, T, H, &L->qkv, qkv, S->threads));
    if (L->qkv_bias) { /* (as the pieces add it: to the bf16 output, in fp32) */
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < width; i++) qkv_f[t * width + i] = bf16_to_f32(qkv[t * width + i]) + L->qkv_bias[i];
        rope_write(qkv_f, 0, L->q_norm, L->k_norm, S->eps, cos, sin, S->slots, T, S->heads, S->kv_heads, S->d, k_pool,
                   v_pool, q);
    } else
        rope_write(qkv, 1, L->q_norm, L->k_norm, S->eps, cos, sin, S->slots, T, S->heads, S->kv_heads, S->d, k_pool,
                   v_pool, q);
    failed = worse(failed, paged_attention(q, T, k_pool, v_pool, S->tables, S->table_stride, S->lens, S->query_start,
                                           S->seqs, S->block_size, S->window, S->heads, S->kv_heads, S->d, S->scale,
                                           S->threads, attn));
    for (int64_t i = 0; i < T * qs; i++) attn16[i] = f32_to_bf16(attn[i]);
    failed = worse(failed, mat_matmul(attn16, T, qs, &L->o, o, S->threads));
    add_rms_norm_bf16(x, o, L->mlp_norm, x_out, h, T, H, S->eps);
    failed = worse(failed, mat_matmul(h, T, H, &L->gate_up, gate_up, S->threads));
    silu_mul_bf16(gate_up, act, T, inter);
    failed = worse(failed, mat_matmul(act, T, inter, &L->down, down, S->threads));
    for (int64_t i = 0; i < T * H; i++) x_out[i] += bf16_to_f32(down[i]);
    free(fbuf);
    return failed;
}
