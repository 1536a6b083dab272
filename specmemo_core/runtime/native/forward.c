/* The base model's forward for a CPU, over a GGUF's own 4- and 8-bit blocks: a Llama-style
 * decoder (RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP), T tokens at a time
 * at any positions, each attending to the committed context and to the new tokens its mask
 * row names (a tree's ancestors, or a causal chunk's earlier tokens).
 *
 * Why our own: a speculative step verifies several tokens at once, and a forward of T tokens
 * should cost little more than one while the weights stream from memory. Here every weight
 * block is unpacked once per group of up to 8 tokens and multiplied with each token's int8
 * activations (AVX-512 VNNI's u8 x s8 dot products, or AVX2's), so T tokens share one read
 * of the weights.
 *
 * Exactness: each token's arithmetic (its matmul sums, its attention over the slots it sees,
 * in slot order) does not depend on T or on the other tokens of the forward, so a tree's
 * accepted nodes get bit for bit the hidden states plain decoding gives them.
 *
 * Weights (weights.py repacks them once): LANES rows at a time (16 with AVX-512, else 8),
 * w = d * u + m per 32-element block (d and m half floats) with u unsigned (Q4_0's and Q4_1's nibbles, Q8_0's bytes
 * plus 128). For a group of LANES rows and one block, the block's bytes lie as registers of
 * LANES 32-bit lanes, lane l holding 4 consecutive elements of row l: one dot-product
 * instruction then adds 4 products to every row of the group, the whole block's sum stays
 * in 32-bit integers, and the scales are applied once per block (not per 4 elements), with
 * no horizontal sums at the end. Activations are quantized per 32-element block to int8
 * (scale amax / 127), in their own order. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <omp.h>

#define GROUP 8 /* tokens per pass over a matrix's weights */

typedef struct {
    int rows, cols, nibbles;  /* nibbles: 1 for 4-bit u (16 bytes a row's block), 0 for 8-bit (32) */
    const uint8_t *u;         /* [groups][cols / 32][4 or 8][LANES][4]: see the top */
    const uint16_t *d, *m;    /* [groups][cols / 32][LANES] each, IEEE half floats (as GGUF keeps them) */
} QMatrix;

typedef struct {
    const float *attn_norm, *ffn_norm; /* [D] */
    QMatrix q, k, v, o, gate, up, down;
} Layer;

typedef struct {
    int layers, dim, heads, kv_heads, head_dim, ffn, vocab, threads, max_tokens;
    float eps, rope_scale;
    const float *inv_freq;   /* [head_dim / 2] */
    const float *out_norm;   /* [D] */
    QMatrix embed, head;     /* token embedding (read per token) and the LM head */
    Layer *layer;
} Model;

/* One cache's workspace for a forward of up to max_tokens tokens (so forwards on different
 * caches, from different threads, never share a buffer) */
typedef struct {
    float *x, *q, *k, *v, *att, *g;
    float *xn, *scores;            /* per thread: a scratch row, the attention scores of one query */
    int8_t *aq; float *as, *ab;    /* per thread: quantized activations, block scales, scale * block sums */
    int slots;                     /* the cache's slots (scores' length per thread) */
} Work;

/* ---- float vectors ----
 *
 * One vocabulary of float vectors for AVX-512 (16 lanes) and AVX2 (8), so what runs on floats
 * (dot products, attention) is written once; plain C goes through its scalar loops. */
#if defined(__AVX512F__)
#define VW 16
typedef __m512 vf;
typedef __mmask16 vmask;
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
#define vmul _mm512_mul_ps
#define vsub _mm512_sub_ps
#define vmax _mm512_max_ps
#define vsum _mm512_reduce_add_ps
#define vmax_lanes _mm512_reduce_max_ps
static inline vmask vfirst(int n) { return n >= 16 ? (vmask)0xFFFF : n > 0 ? (vmask)((1u << n) - 1) : (vmask)0; }
static inline vf vload_first(vmask k, const float *p) { return _mm512_maskz_loadu_ps(k, p); }
static inline void vstore_first(float *p, vmask k, vf v) { _mm512_mask_storeu_ps(p, k, v); }
static inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  /* p * 2^n, n integral */
static inline vf vzero_where_unseen(vf x, vf e) {  /* e, or 0 where x is -inf (a masked slot) */
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), e);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
typedef __m256 vf;
typedef __m256i vmask;
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
#define vmul _mm256_mul_ps
#define vsub _mm256_sub_ps
#define vmax _mm256_max_ps
static inline float vmax_lanes(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}
static inline float vsum(vf v) {  /* a fixed order: halves, then pairs, then the last two */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
static inline vmask vfirst(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
static inline vf vload_first(vmask k, const float *p) { return _mm256_maskload_ps(p, k); }
static inline void vstore_first(float *p, vmask k, vf v) { _mm256_maskstore_ps(p, k, v); }
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vpow2(vf p, vf n) {  /* 2^n built in the exponent bits (n >= -126 here) */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline vf vzero_where_unseen(vf x, vf e) {
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ), e);
}
#endif

/* a . b over n floats */
static inline float dotf(const float *a, const float *b, int n) {
    float s = 0.f;
    int k = 0;
#ifdef VW
    vf acc = vzero();
    for (; k + VW <= n; k += VW) acc = vfma(vload(a + k), vload(b + k), acc);
    s = vsum(acc);
#endif
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}

/* ---- activations: int8 per 32-element block ---- */

/* x [cols] -> aq [cols] bytes, as [cols/32] block scales, ab [cols/32] scale * the block's sum
 * of ints (for the weights' offset m). */
static void quantize_row(const float *x, int cols, int8_t *aq, float *as, float *ab) {
    for (int b = 0; b < cols / 32; b++) {
        const float *v = x + b * 32;
#if defined(__AVX512F__)
        /* the same numbers as the loop below: max is exact in any order, the ints are rounded
         * to nearest even as lrintf does, and their sum is an integer sum */
        __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        float s = amax / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
        __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
        __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(aq + b * 32), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(aq + b * 32 + 16), _mm512_cvtsepi32_epi8(qhi));
        int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
        float s = amax / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            int q = (int)lrintf(v[i] * inv);
            aq[b * 32 + i] = (int8_t)q;
            sum += q;
        }
#endif
        as[b] = s;
        ab[b] = s * (float)sum;
    }
}

/* an IEEE half float's value (the plain-C path's, and the embedding rows') */
static inline float half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);           /* inf, nan */
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);      /* normal */
    else if (!man) bits = sign;                                         /* zero */
    else {                                                              /* subnormal: normalize */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline int32_t word(const int8_t *x) {  /* 4 activation bytes as one 32-bit lane */
    int32_t v;
    memcpy(&v, x, 4);
    return v;
}

/* ---- the matmul: out[t][r] (+)= row r of W . token t ----
 *
 * Every sum below runs in an order fixed by the shapes alone (intrinsics, or scalar loops
 * the compiler may not reorder), never by how many tokens share a pass: that is what makes a
 * tree's nodes bit-exact to the same tokens decoded one by one. */

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif

/* Group g of w (LANES rows): nb blocks a row, each block's bytes step apart from u (4 registers
 * of nibbles or 8 of bytes, LANES lanes of 4), its scales d and offsets m LANES apart. */
#define GROUP_LAYOUT(w, g)                                                                                \
    int nb = (w)->cols / 32, step = ((w)->nibbles ? 16 : 32) * LANES;                                    \
    const uint8_t *u = (w)->u + (size_t)(g) * nb * step;                                                 \
    const uint16_t *d = (w)->d + (size_t)(g) * nb * LANES, *m = (w)->m + (size_t)(g) * nb * LANES

/* u of row l, element 4 j + k of register j (j >= 4: the high nibbles, elements 16 + ...) of
 * the block at ub */
static inline int weight_at(const uint8_t *ub, int nibbles, int j, int l, int k) {
    return nibbles ? (ub[((j & 3) * LANES + l) * 4 + k] >> (j < 4 ? 0 : 4)) & 0x0F : ub[(j * LANES + l) * 4 + k];
}

/* a group's LANES results v into out (rows past the matrix's last one dropped) */
static inline void store_rows(const QMatrix *w, int g, const float *v, float *out, int accumulate) {
    float *o = out + (size_t)g * LANES;
    for (int l = 0; l < LANES && l < w->rows - g * LANES; l++) o[l] = accumulate ? o[l] + v[l] : v[l];
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define KERNEL "avx512-vnni"
#define GROUP_KERNEL(MT)                                                                                  \
    static void group_##MT(const QMatrix *w, int g, const int8_t *aq, const float *as, const float *ab, \
                           float *out, int ostride, int accumulate) {                                     \
        GROUP_LAYOUT(w, g);                                                                               \
        const __m512i low = _mm512_set1_epi8(0x0F);                                                       \
        __m512 acc[MT];                                                                                   \
        _Pragma("GCC unroll 8") for (int t = 0; t < MT; t++) acc[t] = _mm512_setzero_ps();               \
        for (int b = 0; b < nb; b++) {                                                                    \
            __m512i R[8];                                                                                 \
            const uint8_t *ub = u + (size_t)b * step;                                                     \
            if (w->nibbles) {                                                                             \
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {                                     \
                    __m512i raw = _mm512_loadu_si512((const void *)(ub + j * 64));                        \
                    R[j] = _mm512_and_si512(raw, low);                                                    \
                    R[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);                          \
                }                                                                                         \
            } else {                                                                                      \
                _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) R[j] = _mm512_loadu_si512((const void *)(ub + j * 64)); \
            }                                                                                             \
            __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b * LANES)));            \
            __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + b * LANES)));            \
            _Pragma("GCC unroll 8") for (int t = 0; t < MT; t++) {                                        \
                const int8_t *x = aq + (size_t)t * w->cols + b * 32;                                      \
                __m512i s = _mm512_setzero_si512();                                                       \
                _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) s = _mm512_dpbusd_epi32(s, R[j], _mm512_set1_epi32(word(x + 4 * j))); \
                __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(as[(size_t)t * nb + b]));                 \
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[t]);                           \
                acc[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(ab[(size_t)t * nb + b]), acc[t]);             \
            }                                                                                             \
        }                                                                                                 \
        int valid = w->rows - g * LANES;                                                                  \
        __mmask16 k = valid >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);                \
        for (int t = 0; t < MT; t++) {                                                                    \
            float *o = out + (size_t)t * ostride + (size_t)g * LANES;                                    \
            __m512 v = accumulate ? _mm512_add_ps(_mm512_maskz_loadu_ps(k, o), acc[t]) : acc[t];          \
            _mm512_mask_storeu_ps(o, k, v);                                                               \
        }                                                                                                 \
    }
#elif defined(__AVX2__) && defined(__FMA__)
#if defined(__AVXVNNI__)  /* AVX2 with VNNI's 256-bit dot products (Intel since Alder Lake) */
#define KERNEL "avx2-vnni"
#define OFFSET_SHIFTED 0
static inline __m256i weight_bytes(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
/* the 32-bit lane sums of a block's 8 registers of u (unsigned) . x (signed bytes) */
static inline __m256i block_dot(const __m256i *R, const int8_t *x, int nibbles) {
    (void)nibbles;
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) s = _mm256_dpbusd_avx_epi32(s, R[j], _mm256_set1_epi32(word(x + 4 * j)));
    return s;
}
#else
#define KERNEL "avx2"
/* 8-bit weights (u up to 255, whose byte products would saturate maddubs' 16 bits) are taken
 * as u - 128 through the sign trick, and the block's offset as m + 128 d (OFFSET_SHIFTED) */
#define OFFSET_SHIFTED 1
static inline __m256i weight_bytes(const uint8_t *p) {
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p), _mm256_set1_epi8((char)0x80));
}
static inline __m256i block_dot(const __m256i *R, const int8_t *x, int nibbles) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (nibbles) {  /* 8 products of nibbles and int8 stay within 16 bits: 8 * 2 * 15 * 127 */
        __m256i h = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) h = _mm256_add_epi16(h, _mm256_maddubs_epi16(R[j], _mm256_set1_epi32(word(x + 4 * j))));
        return _mm256_madd_epi16(h, ones);
    }
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        __m256i xj = _mm256_set1_epi32(word(x + 4 * j));
        __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(R[j], R[j]), _mm256_sign_epi8(xj, R[j]));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
    }
    return s;
}
#endif
#define GROUP_KERNEL(MT)                                                                                  \
    static void group_##MT(const QMatrix *w, int g, const int8_t *aq, const float *as, const float *ab, \
                           float *out, int ostride, int accumulate) {                                     \
        GROUP_LAYOUT(w, g);                                                                               \
        const __m256i low = _mm256_set1_epi8(0x0F);                                                       \
        __m256 acc[MT];                                                                                   \
        for (int t = 0; t < MT; t++) acc[t] = _mm256_setzero_ps();                                       \
        for (int b = 0; b < nb; b++) {                                                                    \
            __m256i R[8];                                                                                 \
            const uint8_t *ub = u + (size_t)b * step;                                                     \
            if (w->nibbles) {                                                                             \
                for (int j = 0; j < 4; j++) {                                                             \
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(ub + j * 32));                    \
                    R[j] = _mm256_and_si256(raw, low);                                                    \
                    R[j + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);                          \
                }                                                                                         \
            } else {                                                                                      \
                for (int j = 0; j < 8; j++) R[j] = weight_bytes(ub + j * 32);                             \
            }                                                                                             \
            __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b * LANES)));               \
            __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + b * LANES)));               \
            if (!w->nibbles && OFFSET_SHIFTED) mv = _mm256_fmadd_ps(dv, _mm256_set1_ps(128.f), mv);       \
            for (int t = 0; t < MT; t++) {                                                                \
                const int8_t *x = aq + (size_t)t * w->cols + b * 32;                                      \
                __m256i s = block_dot(R, x, w->nibbles);                                                  \
                __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(as[(size_t)t * nb + b]));                 \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[t]);                           \
                acc[t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(ab[(size_t)t * nb + b]), acc[t]);             \
            }                                                                                             \
        }                                                                                                 \
        for (int t = 0; t < MT; t++) {                                                                    \
            float v[LANES];                                                                               \
            _mm256_storeu_ps(v, acc[t]);                                                                  \
            store_rows(w, g, v, out + (size_t)t * ostride, accumulate);                                   \
        }                                                                                                 \
    }
#else
#define KERNEL "c"
#define GROUP_KERNEL(MT)                                                                                  \
    static void group_##MT(const QMatrix *w, int g, const int8_t *aq, const float *as, const float *ab, \
                           float *out, int ostride, int accumulate) {                                     \
        GROUP_LAYOUT(w, g);                                                                               \
        float acc[MT][LANES];                                                                             \
        memset(acc, 0, sizeof(acc));                                                                      \
        for (int b = 0; b < nb; b++) {                                                                    \
            const uint8_t *ub = u + (size_t)b * step;                                                     \
            for (int t = 0; t < MT; t++) {                                                                \
                const int8_t *x = aq + (size_t)t * w->cols + b * 32;                                      \
                for (int l = 0; l < LANES; l++) {                                                         \
                    int s = 0;                                                                            \
                    for (int j = 0; j < 8; j++)                                                           \
                        for (int k = 0; k < 4; k++) {                                                     \
                            s += weight_at(ub, w->nibbles, j, l, k) * (int)x[4 * j + k];                  \
                        }                                                                                 \
                    float scale = half(d[b * LANES + l]) * as[(size_t)t * nb + b];                        \
                    acc[t][l] += (float)s * scale;                                                        \
                    acc[t][l] += half(m[b * LANES + l]) * ab[(size_t)t * nb + b];                         \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        for (int t = 0; t < MT; t++) store_rows(w, g, acc[t], out + (size_t)t * ostride, accumulate);     \
    }
#endif
GROUP_KERNEL(1) GROUP_KERNEL(2) GROUP_KERNEL(3) GROUP_KERNEL(4) GROUP_KERNEL(5) GROUP_KERNEL(6) GROUP_KERNEL(7)
GROUP_KERNEL(8)
typedef void (*group_fn)(const QMatrix *, int, const int8_t *, const float *, const float *, float *, int, int);
static const group_fn GROUPS[GROUP + 1] = {0, group_1, group_2, group_3, group_4, group_5, group_6, group_7, group_8};

/* The rows [*r0, *r1) this thread computes of w: whole groups of LANES rows. */
static void part_rows(const QMatrix *w, int *r0, int *r1) {
    int th = omp_get_thread_num(), n = omp_get_num_threads();
    int groups = (w->rows + LANES - 1) / LANES;
    *r0 = (int)((long)groups * th / n) * LANES;
    *r1 = (int)((long)groups * (th + 1) / n) * LANES;
    if (*r1 > w->rows) *r1 = w->rows;
}

/* one thread's activations for the T tokens of a forward, quantized (quantize_row) */
typedef struct { int8_t *q; float *s, *b; } Acts;

/* This thread's share (part_rows) of out[t][rows] for the T tokens of a; out rows of stride
 * ostride, added to (accumulate) or written. */
static void matmul_part(const QMatrix *w, int T, Acts a, float *out, int ostride, int accumulate) {
    int r0, r1, nb = w->cols / 32;
    part_rows(w, &r0, &r1);
    for (int t0 = 0; t0 < T; t0 += GROUP) {
        int mt = T - t0 < GROUP ? T - t0 : GROUP;
        for (int g = r0 / LANES; g * LANES < r1; g++)
            GROUPS[mt](w, g, a.q + (size_t)t0 * w->cols, a.s + (size_t)t0 * nb, a.b + (size_t)t0 * nb,
                       out + (size_t)t0 * ostride, ostride, accumulate);
    }
}

/* ---- the rest of a layer ---- */

/* T rows of x (stride cols) quantized into a; every thread quantizes them all into its own
 * buffers (cheaper than waiting for each other) */
static void quantize_rows(const float *x, int T, int cols, Acts a) {
    for (int t = 0; t < T; t++)
        quantize_row(x + (size_t)t * cols, cols, a.q + (size_t)t * cols, a.s + (size_t)t * (cols / 32),
                     a.b + (size_t)t * (cols / 32));
}

/* RMSNorm of T rows of x [T][dim] by weight, quantized into a (row: this thread's scratch [dim]) */
static void norm_rows(const float *x, const float *weight, int T, int dim, float eps, float *row, Acts a) {
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * dim;
        float inv = 1.f / sqrtf(dotf(xt, xt, dim) / (float)dim + eps);
        for (int i = 0; i < dim; i++) row[i] = xt[i] * inv * weight[i];
        quantize_rows(row, 1, dim, (Acts){a.q + (size_t)t * dim, a.s + (size_t)t * (dim / 32), a.b + (size_t)t * (dim / 32)});
    }
}

/* rotary embedding of rows [r0, r1) (r0 even) of a token's q or k at position pos: pairs
 * (2i, 2i + 1) of each head, the GGUF's order */
static void rope_rows(float *v, int r0, int r1, int head_dim, const float *inv_freq, float scale, int pos) {
    for (int r = r0; r + 1 < r1; r += 2) {
        int i = (r % head_dim) / 2;
        float angle = (float)pos * inv_freq[i], c = cosf(angle) * scale, s = sinf(angle) * scale;
        float x0 = v[r], x1 = v[r + 1];
        v[r] = x0 * c - x1 * s;
        v[r + 1] = x0 * s + x1 * c;
    }
}

/* ---- attention ---- */

#ifdef VW
/* e^x for x <= 0, a vector at a time: 2^(x log2 e) as 2^n * 2^f, f in [-1/2, 1/2] by a
 * degree-6 polynomial (~2 ulp); the same function of each lane's value, whatever the lane */
static inline vf vexp(vf x) {
    x = vmax(x, vset1(-87.f));
    vf t = vmul(x, vset1(1.44269504088896341f)), n = vround(t);
    vf f = vmul(vsub(t, n), vset1(0.6931471805599453f));  /* f ln 2 */
    vf p = vset1(1.f / 720.f);
    p = vfma(p, f, vset1(1.f / 120.f));
    p = vfma(p, f, vset1(1.f / 24.f));
    p = vfma(p, f, vset1(1.f / 6.f));
    p = vfma(p, f, vset1(0.5f));
    p = vfma(p, f, vset1(1.f));
    p = vfma(p, f, vset1(1.f));
    return vpow2(p, n);
}
#endif

/* scores[s] = q . k_s * scale for the slots [0, n): kt [hd][cap], the keys transposed. Each
 * slot's score is the same sum (over the head's dimensions, in order) whichever other slots
 * are computed beside it, so a tree's node scores its ancestors as plain decoding does. */
static void score_slots(const float *q, const float *kt, int hd, int cap, int n, float scale, float *scores) {
#ifdef VW
    for (int s0 = 0; s0 < n; s0 += 4 * VW) {  /* 4 chains of VW slots side by side (one chain's latency hidden) */
        vmask k[4];
        vf acc[4];
        for (int c = 0; c < 4; c++) {
            k[c] = vfirst(n - s0 - VW * c);
            acc[c] = vzero();
        }
        for (int i = 0; i < hd; i++) {
            vf qi = vset1(q[i]);
            const float *row = kt + (size_t)i * cap + s0;
            for (int c = 0; c < 4; c++) acc[c] = vfma(qi, vload_first(k[c], row + VW * c), acc[c]);
        }
        for (int c = 0; c < 4; c++) vstore_first(scores + s0 + VW * c, k[c], vmul(acc[c], vset1(scale)));
    }
#else
    for (int s = 0; s < n; s++) {
        float acc = 0.f;
        for (int i = 0; i < hd; i++) acc += q[i] * kt[(size_t)i * cap + s];
        scores[s] = acc * scale;
    }
#endif
}

/* the largest of scores[0, n) (a maximum is exact in any order) */
static float max_slots(const float *scores, int n) {
    float best = -INFINITY;
    int s = 0;
#ifdef VW
    vf m = vset1(-INFINITY);
    for (; s + VW <= n; s += VW) m = vmax(m, vload(scores + s));
    best = vmax_lanes(m);
#endif
    for (; s < n; s++) best = scores[s] > best ? scores[s] : best;
    return best;
}

/* scores[s] = e^(scores[s] - best) for s < n, 0 where a slot is masked (-inf) */
static void exp_slots(float *scores, int n, float best) {
#ifdef VW
    for (int s0 = 0; s0 < n; s0 += VW) {
        vmask k = vfirst(n - s0);
        vf x = vload_first(k, scores + s0);
        vstore_first(scores + s0, k, vzero_where_unseen(x, vexp(vsub(x, vset1(best)))));
    }
#else
    for (int s = 0; s < n; s++) scores[s] = scores[s] == -INFINITY ? 0.f : expf(scores[s] - best);
#endif
}

/* att [hd] = sum over slots of (scores[s] / sum) * v_s, in slot order; vc [cap][kvd] */
static void sum_values(const float *scores, float sum, const float *vc, int kvd, int hd, int n, float *att) {
#ifdef VW
    if (hd % VW == 0 && hd <= 16 * VW) {  /* the output in registers */
        vf acc[16];
        int chunks = hd / VW;
        for (int c = 0; c < chunks; c++) acc[c] = vzero();
        for (int s = 0; s < n; s++) {
            if (scores[s] == 0.f) continue;
            const float *v = vc + (size_t)s * kvd;
            vf w = vset1(scores[s] / sum);
            for (int c = 0; c < chunks; c++) acc[c] = vfma(w, vload(v + VW * c), acc[c]);
        }
        for (int c = 0; c < chunks; c++) vstore(att + VW * c, acc[c]);
        return;
    }
#endif
    for (int i = 0; i < hd; i++) att[i] = 0.f;
    for (int s = 0; s < n; s++) {
        if (scores[s] == 0.f) continue;
        const float *v = vc + (size_t)s * kvd;
        float w = scores[s] / sum;
        for (int i = 0; i < hd; i++) att[i] += w * v[i];
    }
}

/* One query head of token t: softmax over the context's slots [0, length) and the new
 * tokens its mask row allows (slots length + j), in slot order; writes att [head_dim].
 * kt: this layer's and kv head's keys transposed, [head_dim][cap]; vc: values [cap][kvd]. */
static void attend(const Model *M, const float *kt, const float *vc, int cap, int length, int T, int t,
                   const uint8_t *mask, const float *q, int kvh, float *scores, float *att) {
    int hd = M->head_dim, n = length + T;
    float best, sum = 0.f;
    score_slots(q, kt, hd, cap, n, 1.f / sqrtf((float)hd), scores);
    for (int s = length; s < n; s++)
        if (!(mask ? mask[t * T + (s - length)] : (s - length) <= t)) scores[s] = -INFINITY;
    best = max_slots(scores, n);
    exp_slots(scores, n, best);
    for (int s = 0; s < n; s++) sum += scores[s];
    sum_values(scores, sum, vc + (size_t)kvh * hd, M->kv_heads * hd, hd, n, att);
}

static inline float silu(float x) { return x / (1.f + expf(-x)); }

/* ---- the API ---- */

Model *sm_model_new(int layers, int dim, int heads, int kv_heads, int head_dim, int ffn, int vocab,
                    float eps, float rope_scale, const float *inv_freq, const float *out_norm,
                    int threads, int max_tokens) {
    Model *M = calloc(1, sizeof(Model));
    M->layers = layers; M->dim = dim; M->heads = heads; M->kv_heads = kv_heads; M->head_dim = head_dim;
    M->ffn = ffn; M->vocab = vocab; M->eps = eps; M->rope_scale = rope_scale; M->inv_freq = inv_freq;
    M->out_norm = out_norm; M->threads = threads; M->max_tokens = max_tokens;
    M->layer = calloc((size_t)layers, sizeof(Layer));
    return M;
}

Work *sm_work_new(const Model *M, int slots) {
    Work *W = calloc(1, sizeof(Work));
    size_t T = (size_t)M->max_tokens, n = (size_t)M->threads, wide = (size_t)(M->ffn > M->dim ? M->ffn : M->dim);
    size_t hq = (size_t)M->heads * M->head_dim, kvd = (size_t)M->kv_heads * M->head_dim;
    W->slots = slots;
    W->x = malloc(T * M->dim * sizeof(float));
    W->q = malloc(T * hq * sizeof(float));
    W->k = malloc(T * kvd * sizeof(float));
    W->v = malloc(T * kvd * sizeof(float));
    W->att = malloc(T * hq * sizeof(float));
    W->g = malloc(T * 2 * M->ffn * sizeof(float));
    W->xn = malloc(n * wide * sizeof(float));
    W->scores = malloc(n * ((size_t)slots + 64) * sizeof(float));
    W->aq = malloc(n * T * wide);
    W->as = malloc(n * T * (wide / 32) * sizeof(float));
    W->ab = malloc(n * T * (wide / 32) * sizeof(float));
    return W;
}

void sm_work_free(Work *W) {
    if (!W) return;
    free(W->x); free(W->q); free(W->k); free(W->v); free(W->att); free(W->g);
    free(W->xn); free(W->scores); free(W->aq); free(W->as); free(W->ab); free(W);
}

void sm_model_free(Model *M) {
    if (!M) return;
    free(M->layer);
    free(M);
}

/* matrix 0..6: q, k, v, o, gate, up, down; -1: the embedding, -2: the LM head */
void sm_set_matrix(Model *M, int layer, int which, int rows, int cols, int nibbles,
                   const uint8_t *u, const uint16_t *d, const uint16_t *m) {
    Layer *L = &M->layer[layer < 0 ? 0 : layer];
    QMatrix *slot[7] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down};
    QMatrix w = {rows, cols, nibbles, u, d, m};
    *(which == -1 ? &M->embed : which == -2 ? &M->head : slot[which]) = w;
}

/* which kernel this build runs: "avx512-vnni", "avx2" or "c" */
const char *sm_kernel(void) { return KERNEL; }

void sm_set_norms(Model *M, int layer, const float *attn_norm, const float *ffn_norm) {
    M->layer[layer].attn_norm = attn_norm;
    M->layer[layer].ffn_norm = ffn_norm;
}

/* one embedding row, dequantized */
static void embed_row(const QMatrix *w, int token, float *out) {
    int l = token % LANES;
    GROUP_LAYOUT(w, token / LANES);
    for (int b = 0; b < nb; b++)
        for (int j = 0; j < 8; j++)
            for (int k = 0; k < 4; k++) {
                int el = w->nibbles ? (j & 3) * 4 + k + (j < 4 ? 0 : 16) : 4 * j + k;
                out[b * 32 + el] = half(d[b * LANES + l]) * (float)weight_at(u + (size_t)b * step, w->nibbles, j, l, k)
                                   + half(m[b * LANES + l]);
            }
}

/* the lanes (rows per group) this build packs its weights in */
int sm_lanes(void) { return LANES; }

/* What one thread of a forward works with: the forward's tokens and cache, its own buffers. */
typedef struct {
    const Model *M;
    Work *W;
    int T, length, capacity;
    const int32_t *positions;
    const uint8_t *mask;
    Acts a;                /* this thread's quantized activations */
    float *row, *scores;   /* this thread's scratch row and attention scores */
} Pass;

/* A layer's attention, on every thread of the forward: q, k, v of this thread's rows
 * (rotated; k and v into the cache slots length + t), then every token's heads, then
 * x += o(attention). kl [kvd][capacity], vl [capacity][kvd]: this layer's cache. */
static void attention_layer(const Pass *P, const Layer *L, float *kl, float *vl) {
    const Model *M = P->M;
    Work *W = P->W;
    int T = P->T, H = M->heads, hd = M->head_dim, kvd = M->kv_heads * hd, group = H / M->kv_heads, r0, r1;
    norm_rows(W->x, L->attn_norm, T, M->dim, M->eps, P->row, P->a);
    matmul_part(&L->q, T, P->a, W->q, H * hd, 0);
    part_rows(&L->q, &r0, &r1);
    for (int t = 0; t < T; t++) rope_rows(W->q + (size_t)t * H * hd, r0, r1, hd, M->inv_freq, M->rope_scale, P->positions[t]);
    matmul_part(&L->k, T, P->a, W->k, kvd, 0);
    part_rows(&L->k, &r0, &r1);
    for (int t = 0; t < T; t++) {
        float *kt = W->k + (size_t)t * kvd;
        rope_rows(kt, r0, r1, hd, M->inv_freq, M->rope_scale, P->positions[t]);
        for (int r = r0; r < r1; r++) kl[(size_t)r * P->capacity + P->length + t] = kt[r];
    }
    matmul_part(&L->v, T, P->a, W->v, kvd, 0);
    part_rows(&L->v, &r0, &r1);
    for (int t = 0; t < T; t++)
        memcpy(vl + (size_t)(P->length + t) * kvd + r0, W->v + (size_t)t * kvd + r0, (size_t)(r1 - r0) * sizeof(float));
    #pragma omp barrier
    #pragma omp for schedule(static)
    for (int item = 0; item < T * H; item++) {
        int t = item / H, h = item % H;
        attend(M, kl + (size_t)(h / group) * hd * P->capacity, vl, P->capacity, P->length, T, t, P->mask,
               W->q + (size_t)t * H * hd + h * hd, h / group, P->scores, W->att + (size_t)t * H * hd + h * hd);
    }
    quantize_rows(W->att, T, H * hd, P->a);
    matmul_part(&L->o, T, P->a, W->x, M->dim, 1);  /* the residual: x += o(att) */
    #pragma omp barrier
}

/* A layer's MLP, on every thread of the forward: x += down(silu(gate(x)) * up(x)). */
static void mlp_layer(const Pass *P, const Layer *L) {
    const Model *M = P->M;
    Work *W = P->W;
    int T = P->T, F = M->ffn, r0, r1;
    Acts a = P->a;
    norm_rows(W->x, L->ffn_norm, T, M->dim, M->eps, P->row, a);
    matmul_part(&L->gate, T, a, W->g, 2 * F, 0);
    matmul_part(&L->up, T, a, W->g + F, 2 * F, 0);
    part_rows(&L->gate, &r0, &r1);  /* the same rows of up: silu(gate) * up of this thread's rows */
    for (int t = 0; t < T; t++) {
        float *g = W->g + (size_t)t * 2 * F;
        for (int i = r0; i < r1; i++) g[i] = silu(g[i]) * g[F + i];
    }
    #pragma omp barrier
    for (int t = 0; t < T; t++)
        quantize_rows(W->g + (size_t)t * 2 * F, 1, F,
                      (Acts){a.q + (size_t)t * F, a.s + (size_t)t * (F / 32), a.b + (size_t)t * (F / 32)});
    matmul_part(&L->down, T, a, W->x, M->dim, 1);
    #pragma omp barrier
}

/* T tokens at positions, written to cache slots [length, length + T) of every layer's
 * kc ([layers][kv_heads * head_dim][capacity]) and vc ([layers][capacity][kv_heads * head_dim]);
 * mask [T][T] (1: may attend) or NULL for causal; W: the cache's workspace. hidden [T][D]:
 * the final normed states. The LM head scores the n_out rows out_rows into logits
 * [n_out][vocab], and picks [n_out] their argmax (first maximum). */
int sm_forward(const Model *M, Work *W, float *kc, float *vc, int capacity, int length, int T, const int32_t *tokens,
               const int32_t *positions, const uint8_t *mask, float *hidden, int n_out, const int32_t *out_rows,
               float *logits, int64_t *picks) {
    if (T > M->max_tokens || length + T > capacity || capacity > W->slots) return -1;
    int D = M->dim, kvd = M->kv_heads * M->head_dim;
    size_t wide = (size_t)(M->ffn > D ? M->ffn : D), T_max = (size_t)M->max_tokens;
    for (int t = 0; t < T; t++) embed_row(&M->embed, tokens[t], W->x + (size_t)t * D);
    #pragma omp parallel num_threads(M->threads)
    {
        size_t th = (size_t)omp_get_thread_num();
        Pass P = {M, W, T, length, capacity, positions, mask,
                  {W->aq + th * T_max * wide, W->as + th * T_max * (wide / 32), W->ab + th * T_max * (wide / 32)},
                  W->xn + th * wide, W->scores + th * ((size_t)W->slots + 64)};
        for (int l = 0; l < M->layers; l++) {
            attention_layer(&P, &M->layer[l], kc + (size_t)l * kvd * capacity, vc + (size_t)l * capacity * kvd);
            mlp_layer(&P, &M->layer[l]);
        }
        #pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            const float *xr = W->x + (size_t)t * D;
            float inv = 1.f / sqrtf(dotf(xr, xr, D) / (float)D + M->eps);
            for (int i = 0; i < D; i++) hidden[(size_t)t * D + i] = xr[i] * inv * M->out_norm[i];
        }
        for (int i = 0; i < n_out; i++)
            quantize_rows(hidden + (size_t)out_rows[i] * D, 1, D,
                          (Acts){P.a.q + (size_t)i * D, P.a.s + (size_t)i * (D / 32), P.a.b + (size_t)i * (D / 32)});
        if (n_out > 0) matmul_part(&M->head, n_out, P.a, logits, M->vocab, 0);
    }
    for (int i = 0; i < n_out; i++) {
        const float *row = logits + (size_t)i * M->vocab;
        int64_t best = 0;
        for (int j = 1; j < M->vocab; j++) if (row[j] > row[best]) best = j;
        picks[i] = best;
    }
    return 0;
}

/* Keep the accepted path: slots length + nodes[i] -> length + i for i < count, every layer
 * (keys kc [layers][kvd][capacity], values vc [layers][capacity][kvd]). */
void sm_commit(const Model *M, float *kc, float *vc, int capacity, int length, int count, const int64_t *nodes) {
    int kvd = M->kv_heads * M->head_dim;
    for (int l = 0; l < M->layers; l++)
        for (int i = 0; i < count; i++) {
            if (nodes[i] == i) continue;
            size_t src = (size_t)length + nodes[i], dst = (size_t)length + i;
            float *kl = kc + (size_t)l * kvd * capacity, *vl = vc + (size_t)l * capacity * kvd;
            for (int r = 0; r < kvd; r++) kl[(size_t)r * capacity + dst] = kl[(size_t)r * capacity + src];
            memmove(vl + dst * kvd, vl + src * kvd, kvd * sizeof(float));
        }
}
