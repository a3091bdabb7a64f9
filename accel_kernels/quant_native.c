/* Block-wise symmetric int8/int4 quantization on the CPU, in plain C (C99).
 *
 * The wire format and its edge cases are defined in quant_layout.py; every function here
 * gives results bit-identical to quant_reference.py. The library is compiled ahead of
 * time by setup.py when zero-core is installed and loaded with ctypes by quant_native.py:
 * it uses no Python or torch headers, allocates nothing but a per-call scratch block, and
 * starts no threads (quant_cpu.py runs chunks of blocks on its worker threads; ctypes
 * releases the GIL during each call).
 *
 * Floating point. Each value goes through the same IEEE float32 operations, in the same
 * order, as in the reference: scale = absmax / qmax (a correctly rounded division),
 * q = round_half_even(x / scale) clamped to [-qmax, qmax], value = q * scale, and the
 * fused kernel's sum is sender 0's value, then + sender 1's, and so on. This holds only
 * if the compiler neither contracts a*b+c into an FMA (-ffp-contract=off, set by
 * setup.py) nor reassociates or flushes subnormals (never build with -ffast-math).
 *
 * Vectorization is left to the compiler, except for the fused kernel at the AVX-512 level
 * (written with intrinsics, see "AVX-512 fused int4"). On x86-64 Linux (glibc) with GCC
 * or Clang the chunk functions are compiled three times (AVX-512F, AVX2, baseline x86-64)
 * and the loader picks the best one for the CPU at load time (function multiversioning),
 * so the build keeps portable flags. IEEE results do not depend on the vector width.
 *
 * The AVX-512 fused kernel requantizes by multiplying with 1 / scale where that provably
 * rounds to the same integer as the division, and divides where it might not (near
 * rounding ties, subnormal scales); the argument is written out where it is done, and
 * tests/test_quant_native.py feeds it values on and beside ties.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__FAST_MATH__)
#error "quant_native.c must not be built with -ffast-math: its results must be bit-identical to the IEEE float32 reference"
#endif
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

/* Bumped whenever a signature below changes; quant_native.py refuses other versions. */
#define ZC_ABI_VERSION 1

/* setup.py passes the SHA-256 of this file, so the loader can tell a stale build. */
#ifndef ZC_SOURCE_SHA256
#define ZC_SOURCE_SHA256 "unknown"
#endif

/* dtype codes and status codes, mirrored in quant_native.py */
#define ZC_F32 0
#define ZC_F16 1
#define ZC_BF16 2

#define ZC_OK 0
#define ZC_EINVAL (-1)
#define ZC_ENOMEM (-2)

#if defined(_WIN32)
#define ZC_EXPORT __declspec(dllexport)
#elif defined(__GNUC__)
#define ZC_EXPORT __attribute__((visibility("default")))
#else
#define ZC_EXPORT
#endif

#if defined(__GNUC__)
#define ZC_INLINE static inline __attribute__((always_inline))
#else
#define ZC_INLINE static inline
#endif

#if defined(_MSC_VER)
#define ZC_RESTRICT __restrict
#else
#define ZC_RESTRICT restrict
#endif

/* Instruction-set levels. On x86-64 with GCC or Clang every kernel is compiled three
 * times: for AVX-512 (F/BW/DQ/VL, about x86-64-v4), for AVX2 (about x86-64-v3) and for the
 * x86-64 baseline; zc_best_level() says which the CPU (and OS) supports and each call
 * names the one to run, so the build keeps portable flags and tests can run every level
 * the machine has. Measured on an AVX-512 CPU, per element and thread: int8 quantize
 * 0.11 ns at level 2, 0.18 ns with AVX-512F alone (no byte/word instructions to narrow
 * to int8), 0.9 ns at baseline. Other compilers and CPUs get one portable build. */
#if (defined(__x86_64__) || defined(__amd64__)) && defined(__GNUC__) && \
    !defined(ZC_NO_LEVELS) && (defined(__clang__) || __GNUC__ >= 8)
#define ZC_LEVELS 3
#define ZC_TARGET_2 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,bmi,bmi2,popcnt")))
#define ZC_TARGET_1 __attribute__((target("avx2,bmi,bmi2,popcnt")))
#else
#define ZC_LEVELS 1
#endif

#define ABS_MASK 0x7fffffffu
#define INF_BITS 0x7f800000u
/* float("nan") as torch writes it into a non-finite block's scale */
#define QNAN_BITS 0x7fc00000u
/* Adding 1.5 * 2^23 to |v| < 2^22 rounds v to an integer, half to even (the default
 * rounding mode), and leaves that integer in the low mantissa bits of the sum. */
#define ROUND_MAGIC 12582912.0f
#define ROUND_MAGIC_BITS 0x4b400000
#define INT4_OFFSET 8
#define INT4_ZERO_BYTE 0x88u /* two nibbles holding q = 0 */

ZC_INLINE uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

ZC_INLINE float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ------------------------------------------------------------ 16-bit float conversions
 * Written without branches so that loops over them vectorize. */

ZC_INLINE float bf16_to_float(uint16_t h) { return float_of((uint32_t)h << 16); }

/* Round to nearest even; NaN stays NaN (quiet, sign kept). */
ZC_INLINE uint16_t float_to_bf16(float f) {
    uint32_t x = bits_of(f);
    uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    uint32_t nan = (x >> 16) | 0x0040u;
    return (uint16_t)((x & ABS_MASK) > INF_BITS ? nan : rounded);
}

/* Exact. */
ZC_INLINE float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7fffu;
    uint32_t normal = (em << 13) + 0x38000000u; /* exponent bias 15 -> 127 */
    uint32_t special = (em << 13) | INF_BITS;  /* inf, NaN with its payload */
    /* zero and subnormals: em units of 2^-24, an exact product in float32 */
    uint32_t tiny = bits_of((float)(int32_t)em * 0x1p-24f);
    uint32_t r = em >= 0x7c00u ? special : normal;
    r = em < 0x0400u ? tiny : r;
    return float_of(r | sign);
}

/* Round to nearest even, overflow to inf, NaN to a quiet NaN (sign kept). */
ZC_INLINE uint16_t float_to_half(float f) {
    uint32_t x = bits_of(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a = x & ABS_MASK;
    /* |f| >= 2^-14 (normal half): round the mantissa at bit 13, then rebias 127 -> 15 */
    uint32_t normal = (a + 0x0fffu + ((a >> 13) & 1u) - 0x38000000u) >> 13;
    /* |f| < 2^-14: in 0.5 + |f| the last mantissa bit is worth 2^-24, the subnormal
     * half's step, so the addition rounds |f| to that step, half to even */
    uint32_t tiny = bits_of(float_of(a) + 0.5f) - 0x3f000000u;
    uint32_t r = a < 0x38800000u ? tiny : normal;
    r = a >= 0x477ff000u ? 0x7c00u : r; /* 65520 and above round to inf */
    r = a > INF_BITS ? 0x7e00u : r;
    return (uint16_t)(r | sign);
}

/* ------------------------------------------------------------ one block */

/* Largest |x| as float bits: for non-negative floats the integer order is the float
 * order, and inf / NaN are exactly the bit patterns >= INF_BITS. */
ZC_INLINE uint32_t absmax_bits(const float *ZC_RESTRICT x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = bits_of(x[i]) & ABS_MASK;
        m = a > m ? a : m;
    }
    return m;
}

/* m, or |v| as float bits if that is larger (see absmax_bits) */
ZC_INLINE uint32_t max_abs_bits(uint32_t m, float v) {
    uint32_t a = bits_of(v) & ABS_MASK;
    return a > m ? a : m;
}

/* round_half_even(v) clamped to [-qmax, qmax], for |v| < 2^22. Here |v| < 191: v is
 * x / s with |x| <= absmax and s = absmax / qmax rounded, at most 2^-150 below the
 * exact quotient even when it is subnormal, and s > 0. */
ZC_INLINE int32_t round_clamp(float v, int32_t qmax) {
    int32_t q = (int32_t)bits_of(v + ROUND_MAGIC) - ROUND_MAGIC_BITS;
    q = q < -qmax ? -qmax : q;
    return q > qmax ? qmax : q;
}

/* The scale of a block whose largest |value| has float bits m. Returns 1 when its values
 * must be quantized with *s, 0 when its payload is all zeros: a block holding NaN or inf
 * (scale NaN), a zero block, or one whose absmax / qmax underflows to 0 (the reference
 * then divides by 1, and round(x) of |x| < 2^-140 is 0). */
ZC_INLINE int block_scale(uint32_t m, int32_t qmax, float *ZC_RESTRICT scale,
                          float *ZC_RESTRICT s) {
    if (m >= INF_BITS) {
        *scale = float_of(QNAN_BITS);
        return 0;
    }
    *s = float_of(m) / (float)qmax;
    *scale = *s;
    return *s > 0.0f;
}

/* Quantize n <= block_size float32 values (one block, the last one maybe partial) whose
 * largest |value| has float bits m. The reference pads a partial block with zeros, which
 * cannot change its absmax. (Multiplying by 1 / s instead of dividing, with a division
 * only for blocks holding a value near a rounding tie, measured slower here.) */
ZC_INLINE void quantize_block(const float *ZC_RESTRICT x, int64_t n, uint32_t m, int bits,
                              uint8_t *ZC_RESTRICT payload, float *ZC_RESTRICT scale) {
    float s;
    if (!block_scale(m, bits == 8 ? 127 : 7, scale, &s)) {
        memset(payload, bits == 8 ? 0 : INT4_ZERO_BYTE, (size_t)(bits == 8 ? n : (n + 1) / 2));
        return;
    }
    if (bits == 8) {
        int8_t *p = (int8_t *)payload;
        for (int64_t i = 0; i < n; i++)
            p[i] = (int8_t)round_clamp(x[i] / s, 127);
    } else {
        const int64_t pairs = n / 2;
        for (int64_t j = 0; j < pairs; j++) {
            int32_t lo = round_clamp(x[2 * j] / s, 7) + INT4_OFFSET;
            int32_t hi = round_clamp(x[2 * j + 1] / s, 7) + INT4_OFFSET;
            payload[j] = (uint8_t)(lo | (hi << 4));
        }
        if (n & 1) /* the unused high nibble of an odd-sized payload holds zero */
            payload[pairs] = (uint8_t)((round_clamp(x[n - 1] / s, 7) + INT4_OFFSET) |
                                       (INT4_OFFSET << 4));
    }
}

/* int4 from values held as even elements lo[j] and odd elements hi[j], j < npairs (the
 * fused kernel's sums), whose largest |value| has float bits m. */
ZC_INLINE void quantize_pairs(const float *ZC_RESTRICT lo, const float *ZC_RESTRICT hi,
                              int64_t npairs, uint32_t m, uint8_t *ZC_RESTRICT payload,
                              float *ZC_RESTRICT scale) {
    float s;
    if (!block_scale(m, 7, scale, &s)) {
        memset(payload, INT4_ZERO_BYTE, (size_t)npairs);
        return;
    }
    for (int64_t j = 0; j < npairs; j++)
        payload[j] = (uint8_t)((round_clamp(lo[j] / s, 7) + INT4_OFFSET) |
                               ((round_clamp(hi[j] / s, 7) + INT4_OFFSET) << 4));
}

/* the value q of element 2j (low nibble) and 2j+1 (high nibble) of an int4 byte */
ZC_INLINE float int4_lo(uint8_t byte) { return (float)((int32_t)(byte & 15u) - INT4_OFFSET); }
ZC_INLINE float int4_hi(uint8_t byte) { return (float)((int32_t)(byte >> 4) - INT4_OFFSET); }

/* dst[i] = q[i] * s for the n values of one block. */
ZC_INLINE void dequantize_block(const uint8_t *ZC_RESTRICT payload, float s, int bits,
                                int64_t n, float *ZC_RESTRICT dst) {
    if (bits == 8) {
        const int8_t *p = (const int8_t *)payload;
        for (int64_t i = 0; i < n; i++)
            dst[i] = (float)p[i] * s;
        return;
    }
    const int64_t pairs = n / 2;
    for (int64_t j = 0; j < pairs; j++) {
        dst[2 * j] = int4_lo(payload[j]) * s;
        dst[2 * j + 1] = int4_hi(payload[j]) * s;
    }
    if (n & 1)
        dst[n - 1] = int4_lo(payload[pairs]) * s;
}

/* ------------------------------------------------------------ the fused kernel's sums
 * Senders are added up to four at a time in one pass over the block (each element's
 * chain stays in a register: sender 0's value, + sender 1's, ...), so k <= 4 senders
 * take one pass over a block-sized buffer in L1 and k = 8 two. Sender i's bytes start
 * at p + i * stride, its scale is sc[i * sstride]. The switch on (g, first) gives the
 * compiler one simple loop per case to vectorize. (Tried and not kept: tiles of 32 sums
 * held across senders, which GCC spilled, 1.6x slower for int8.) The AVX-512 level runs
 * its own version of the fused kernel for most block sizes, see below. */

ZC_INLINE uint32_t add_int8(const int8_t *p, int64_t stride, const float *sc,
                            int64_t sstride, int g, int first, int64_t n,
                            float *ZC_RESTRICT sum) {
    uint32_t m = 0;
    const int8_t *p0 = p, *p1 = p + stride, *p2 = p + 2 * stride, *p3 = p + 3 * stride;
    const float s0 = sc[0], s1 = g > 1 ? sc[sstride] : 0.0f;
    const float s2 = g > 2 ? sc[2 * sstride] : 0.0f, s3 = g > 3 ? sc[3 * sstride] : 0.0f;
    for (int64_t j = 0; j < n; j++) {
        float acc = first ? (float)p0[j] * s0 : sum[j] + (float)p0[j] * s0;
        if (g > 1)
            acc = acc + (float)p1[j] * s1;
        if (g > 2)
            acc = acc + (float)p2[j] * s2;
        if (g > 3)
            acc = acc + (float)p3[j] * s3;
        sum[j] = acc;
        m = max_abs_bits(m, acc);
    }
    return m;
}

/* int4: lo[j] / hi[j] get the even (low nibble) / odd (high nibble) element of byte j */
ZC_INLINE uint32_t add_int4(const uint8_t *p, int64_t stride, const float *sc,
                            int64_t sstride, int g, int first, int64_t pairs,
                            float *ZC_RESTRICT lo, float *ZC_RESTRICT hi) {
    uint32_t m = 0;
    const uint8_t *p0 = p, *p1 = p + stride, *p2 = p + 2 * stride, *p3 = p + 3 * stride;
    const float s0 = sc[0], s1 = g > 1 ? sc[sstride] : 0.0f;
    const float s2 = g > 2 ? sc[2 * sstride] : 0.0f, s3 = g > 3 ? sc[3 * sstride] : 0.0f;
    for (int64_t j = 0; j < pairs; j++) {
        float a = first ? int4_lo(p0[j]) * s0 : lo[j] + int4_lo(p0[j]) * s0;
        float b = first ? int4_hi(p0[j]) * s0 : hi[j] + int4_hi(p0[j]) * s0;
        if (g > 1) {
            a = a + int4_lo(p1[j]) * s1;
            b = b + int4_hi(p1[j]) * s1;
        }
        if (g > 2) {
            a = a + int4_lo(p2[j]) * s2;
            b = b + int4_hi(p2[j]) * s2;
        }
        if (g > 3) {
            a = a + int4_lo(p3[j]) * s3;
            b = b + int4_hi(p3[j]) * s3;
        }
        lo[j] = a;
        hi[j] = b;
        m = max_abs_bits(max_abs_bits(m, a), b);
    }
    return m;
}

#define ZC_ADD_CASES(call)                                                              \
    switch (g * 2 + first) {                                                            \
    case 3: call(1, 1); break;                                                          \
    case 2: call(1, 0); break;                                                          \
    case 5: call(2, 1); break;                                                          \
    case 4: call(2, 0); break;                                                          \
    case 7: call(3, 1); break;                                                          \
    case 6: call(3, 0); break;                                                          \
    case 9: call(4, 1); break;                                                          \
    default: call(4, 0); break;                                                         \
    }

/* sum[j] (int8) or lo[j] / hi[j] (int4, see add_int4) of the k senders' values of one
 * block of n elements; for odd n (int4) the last byte's unused high nibble gets 0, which
 * is what the reference's zero padding quantizes to. */
ZC_INLINE uint32_t sum_block(const uint8_t *p, int64_t stride, const float *sc,
                             int64_t sstride, int64_t k, int bits, int64_t n,
                             float *ZC_RESTRICT lo, float *ZC_RESTRICT hi) {
    const int64_t pairs = n / 2;
    uint32_t m = 0; /* the largest |sum|, from the pass that adds the last senders */
    for (int64_t i = 0; i < k; i += 4) {
        const int g = k - i < 4 ? (int)(k - i) : 4, first = i == 0;
        const uint8_t *pi = p + i * stride;
        const float *si = sc + i * sstride;
        if (bits == 8) {
#define ZC_CALL8(G, F) m = add_int8((const int8_t *)pi, stride, si, sstride, G, F, n, lo)
            ZC_ADD_CASES(ZC_CALL8)
#undef ZC_CALL8
        } else {
#define ZC_CALL4(G, F) m = add_int4(pi, stride, si, sstride, G, F, pairs, lo, hi)
            ZC_ADD_CASES(ZC_CALL4)
#undef ZC_CALL4
        }
    }
    if (bits == 4 && (n & 1)) {
        float a = int4_lo(p[pairs]) * sc[0];
        for (int64_t i = 1; i < k; i++)
            a = a + int4_lo(p[i * stride + pairs]) * sc[i * sstride];
        lo[pairs] = a;
        hi[pairs] = 0.0f;
        m = max_abs_bits(m, a);
    }
    return m;
}

ZC_INLINE void load_block(const void *src, int dtype, int64_t first, int64_t n,
                          float *ZC_RESTRICT dst) {
    const uint16_t *h = (const uint16_t *)src + first;
    if (dtype == ZC_BF16)
        for (int64_t i = 0; i < n; i++)
            dst[i] = bf16_to_float(h[i]);
    else
        for (int64_t i = 0; i < n; i++)
            dst[i] = half_to_float(h[i]);
}

ZC_INLINE void store_block(const float *ZC_RESTRICT src, int64_t n, void *dst, int dtype,
                           int64_t first) {
    uint16_t *h = (uint16_t *)dst + first;
    if (dtype == ZC_BF16)
        for (int64_t i = 0; i < n; i++)
            h[i] = float_to_bf16(src[i]);
    else
        for (int64_t i = 0; i < n; i++)
            h[i] = float_to_half(src[i]);
}

/* ------------------------------------------------------------ batches of blocks
 * A block's quantization waits for its scale: a reduction across the block, then a
 * division (two with the reciprocal below), some 50 cycles of latency. While the
 * out-of-order core holds the waiting instructions it fills up and cannot start on the
 * next block, so each block exposed that latency. The kernels therefore take the
 * absmax (or sums) of a batch of blocks first and quantize the batch after: one wait per
 * batch. Measured on one thread, in cache, block 256: quantize 0.114 -> 0.085 ns per
 * element, the AVX-512 fused int4 kernel below 0.18 -> 0.13. 1024 elements (4 KB of
 * float32 sums, in L1) measured as fast or faster than 512 and 2048 at every size from
 * 64K to 50M elements. */
#define ZC_BATCH_ELEMENTS 1024
ZC_INLINE int64_t batch_blocks(int64_t block_size) {
    return block_size >= ZC_BATCH_ELEMENTS ? 1 : ZC_BATCH_ELEMENTS / block_size;
}

/* ------------------------------------------------------------ AVX-512 fused int4
 * Level 2 only, for full blocks whose size is a multiple of Q4_GROUP (a partial last
 * block takes the code above). Measured (one thread, in cache, k = 4): 0.24 ns per
 * element compiled from the plain loops above, of which the requantize step (division,
 * rounding, clamp, packing) took ~40% and the sums ~57%.
 * Replacing only the division by a multiplication saved 4%: the loops are bound by the
 * number of vector instructions, mostly the sign-extension chains that widen nibbles to
 * float lanes and the narrowing shuffles that pack them again. This path needs about
 * half as many:
 *
 * Sums. A sender's value is (float)(q) * s_i with q one of 16 nibbles, so the 16 possible
 * products are computed once per block and sender (table[i][n] = (n - 8) * s_i, the same
 * IEEE product) and looked up with vpermps, which reads only the low 4 bits of each
 * 32-bit index: a 64-byte row of payload (128 elements) loaded as 16 dwords gives element
 * 8j + p of lane j as its nibble p, i.e. (dword >> 4p) is the index. So a group of 128
 * elements is held as 8 vectors, vector p lane j = element 8j + p ("transposed"), and
 * the 4-bit output of vector p goes back to bits 4p..4p+3 of dword j: packing is shifts
 * and ORs, no shuffle. The senders are added in one pass, sender 0 first, each element's
 * chain in a register: the same additions in the same order as the reference.
 *
 * Requantize. q = round_half_even(fl(x / s)) is computed without the division, which
 * is exact only where proven. Let u = 2^-24 and s normal (the caller divides otherwise:
 * for a subnormal s, 1 / s may overflow to inf; s <= FLT_MAX / 7, so r = fl(1 / s) is
 * normal). Then r = (1/s)(1 + d1), q' = fl(x * r) = (x/s)(1 + d1)(1 + d2) and
 * fl(x / s) = (x/s)(1 + d3) with |di| <= u (a result below 2^-126 has instead an absolute
 * error <= 2^-150 and both round to 0), so |q' - fl(x/s)| <= (3u + u^2)|x/s|: at most 3
 * ulps of q' apart. Every |x| <= absmax and s = fl(absmax / 7) >= (absmax / 7)(1 - u),
 * so |x/s| <= 7 / (1 - u) and E = |q' - fl(x/s)| < 1.3e-6 (2.7 ulps at 4 <= |q'| < 8).
 * The two round to different integers only if a tie k + 1/2 lies between them, i.e.
 * within E of q'. Both are below 7.5 in magnitude, so both round into [-7, 7]: no clamp.
 *
 * One addition finds the integer and the near-ties: t = fl(q' + 776.5) (776.5 = 1.5 * 2^9
 * + 8 + 1/2) lies in [512, 1024), where floats are the multiples of 2^-14, so t - 776.5
 * is q' rounded to a multiple of 2^-14, and bits(t) = bits(512) + (t - 512) * 2^14:
 * bits(t) >> 14 = 0x11108 + floor(t - 776.5 + 1/2), whose low nibble is that integer + 8.
 * The low 14 bits of bits(t) are zero exactly when t - 776.5 is a tie (an integer + 1/2).
 * Ties are multiples of 2^-14, so rounding q' to that grid lands on a tie whenever q' is
 * nearer to it than 2^-15 (and never carries q' past one). Hence a lane whose low 14 bits
 * are not zero has q' at least 2^-15 > E from every tie: no tie between q' and fl(x/s),
 * floor(q' + 1/2) = round_half_even(q') = round_half_even(fl(x/s)), the correct nibble.
 * The flagged band (+-2^-15, 64 ulps at |q'| near 7) is far wider than needed but costs
 * one instruction and catches ~1 in 16384 random lanes; a group holding a flagged lane
 * (exact ties included) is recomputed with the division. x = +-0 gives t = 776.5, nibble
 * 8 (q = 0). Blocks whose sums hold NaN or inf never get here (their scale is NaN and
 * payload zero, decided from the absmax as in quantize_pairs), nor do zero blocks.
 *
 * Measured (one thread, k = 4, block 256): 0.24 -> 0.14 ns per element in cache, 0.22 ->
 * 0.12 at 4M elements. Tried and not kept (no gain measured): loading each row at byte
 * offsets 1-3 to save four of the seven shifts (the loads split cache lines), an FMA for
 * fl(x * r) + 776.5, vrangeps for the absmax (also differs on NaN), two chains of the
 * near-tie mask. */
#if ZC_LEVELS > 1
#include <immintrin.h>

#define Q4_GROUP 128 /* elements per group: one 64-byte row of nibbles per sender */

/* The transposed sums of one block of groups * Q4_GROUP elements into sums[] (group g,
 * vector p at sums + g * Q4_GROUP + 16 * p); returns the largest |sum| as float bits. */
ZC_TARGET_2 static uint32_t sum_int4_512(const uint8_t *p, int64_t stride, const float *sc,
                                         int64_t sstride, int64_t k, int64_t groups,
                                         float *ZC_RESTRICT sums, float *ZC_RESTRICT tables) {
    const __m512 nibble_value = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4,
                                               5, 6, 7);
    for (int64_t i = 0; i < k; i++)
        _mm512_storeu_ps(tables + 16 * i,
                         _mm512_mul_ps(nibble_value, _mm512_set1_ps(sc[i * sstride])));
    const __m512i abs_mask = _mm512_set1_epi32((int)ABS_MASK);
    __m512i amax = _mm512_setzero_si512();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *row = p + 64 * g;
        __m512i d = _mm512_loadu_si512(row);
        __m512 t = _mm512_loadu_ps(tables);
        __m512 a0 = _mm512_permutexvar_ps(d, t);
        __m512 a1 = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), t);
        __m512 a2 = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 8), t);
        __m512 a3 = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 12), t);
        __m512 a4 = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 16), t);
        __m512 a5 = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 20), t);
        __m512 a6 = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 24), t);
        __m512 a7 = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 28), t);
        /* unrolled, so that each sender's rows are read by load instructions of their
         * own: one load reading the k rows in turn (strides of a whole payload) misled
         * the hardware prefetcher, 1.5x slower for int4 at 8M elements */
#pragma GCC unroll 8
        for (int64_t i = 1; i < k; i++) {
            d = _mm512_loadu_si512(row + i * stride);
            t = _mm512_loadu_ps(tables + 16 * i);
            a0 = _mm512_add_ps(a0, _mm512_permutexvar_ps(d, t));
            a1 = _mm512_add_ps(a1, _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), t));
            a2 = _mm512_add_ps(a2, _mm512_permutexvar_ps(_mm512_srli_epi32(d, 8), t));
            a3 = _mm512_add_ps(a3, _mm512_permutexvar_ps(_mm512_srli_epi32(d, 12), t));
            a4 = _mm512_add_ps(a4, _mm512_permutexvar_ps(_mm512_srli_epi32(d, 16), t));
            a5 = _mm512_add_ps(a5, _mm512_permutexvar_ps(_mm512_srli_epi32(d, 20), t));
            a6 = _mm512_add_ps(a6, _mm512_permutexvar_ps(_mm512_srli_epi32(d, 24), t));
            a7 = _mm512_add_ps(a7, _mm512_permutexvar_ps(_mm512_srli_epi32(d, 28), t));
        }
        float *out = sums + Q4_GROUP * g;
#define ZC_KEEP(P, A)                                                                     \
    _mm512_storeu_ps(out + 16 * P, A);                                                    \
    amax = _mm512_max_epu32(amax, _mm512_and_si512(_mm512_castps_si512(A), abs_mask));
        ZC_KEEP(0, a0) ZC_KEEP(1, a1) ZC_KEEP(2, a2) ZC_KEEP(3, a3)
        ZC_KEEP(4, a4) ZC_KEEP(5, a5) ZC_KEEP(6, a6) ZC_KEEP(7, a7)
#undef ZC_KEEP
    }
    return (uint32_t)_mm512_reduce_max_epu32(amax);
}

/* One group's 64 payload bytes from its transposed sums, dividing by s: the exact path,
 * for groups holding a near-tie and for blocks whose scale is subnormal (then |x / s|
 * may exceed 7, hence the clamp, as in round_clamp). */
ZC_TARGET_2 static __m512i requant_int4_group_exact(const float *sums, __m512 s) {
    const __m512 lo = _mm512_set1_ps(-7.0f), hi = _mm512_set1_ps(7.0f);
    /* 1.5 * 2^23 + 8: rounds half to even (the sum's parity is q's) and leaves q + 8 in
     * the low nibble of the sum's bits */
    const __m512 magic = _mm512_set1_ps(ROUND_MAGIC + (float)INT4_OFFSET);
    __m512i word = _mm512_setzero_si512();
    for (int p = 0; p < 8; p++) {
        __m512 q = _mm512_div_ps(_mm512_loadu_ps(sums + 16 * p), s);
        q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
        __m512i b = _mm512_castps_si512(_mm512_add_ps(q, magic));
        word = _mm512_ternarylogic_epi32(word, _mm512_sll_epi32(b, _mm_cvtsi32_si128(4 * p)),
                                         _mm512_set1_epi32(15 << (4 * p)), 0xF8);
    }
    return word;
}

/* The payload of one block from its transposed sums (see the section comment). */
ZC_TARGET_2 static void requant_int4_512(const float *sums, int64_t groups, float s,
                                         uint8_t *ZC_RESTRICT payload) {
    const __m512 vs = _mm512_set1_ps(s);
    if (bits_of(s) < 0x00800000u) { /* subnormal: 1 / s may overflow; divide */
        for (int64_t g = 0; g < groups; g++)
            _mm512_storeu_si512(payload + 64 * g,
                                requant_int4_group_exact(sums + Q4_GROUP * g, vs));
        return;
    }
    const __m512 r = _mm512_set1_ps(1.0f / s), magic = _mm512_set1_ps(776.5f);
    const __m512i frac_bits = _mm512_set1_epi32(0x3fff);
    for (int64_t g = 0; g < groups; g++) {
        const float *x = sums + Q4_GROUP * g;
        __m512i word = _mm512_setzero_si512();
        __mmask16 clear = 0xffff; /* lanes with no near-tie so far */
#define ZC_NIBBLE(P, SHIFT)                                                               \
    {                                                                                     \
        __m512i b = _mm512_castps_si512(                                                  \
            _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * P), r), magic));         \
        clear = _mm512_mask_test_epi32_mask(clear, b, frac_bits);                         \
        word = _mm512_ternarylogic_epi32(word, SHIFT, _mm512_set1_epi32(15 << (4 * P)),   \
                                         0xF8);                                           \
    }
        ZC_NIBBLE(0, _mm512_srli_epi32(b, 14)) ZC_NIBBLE(1, _mm512_srli_epi32(b, 10))
        ZC_NIBBLE(2, _mm512_srli_epi32(b, 6)) ZC_NIBBLE(3, _mm512_srli_epi32(b, 2))
        ZC_NIBBLE(4, _mm512_slli_epi32(b, 2)) ZC_NIBBLE(5, _mm512_slli_epi32(b, 6))
        ZC_NIBBLE(6, _mm512_slli_epi32(b, 10)) ZC_NIBBLE(7, _mm512_slli_epi32(b, 14))
#undef ZC_NIBBLE
        if (clear != 0xffff)
            word = requant_int4_group_exact(x, vs);
        _mm512_storeu_si512(payload + 64 * g, word);
    }
}

/* ------------------------------------------------------------ AVX-512 fused int8
 * The same scheme for int8, in the natural element order: each sender's bytes are
 * widened with vpmovsxbd straight from memory (the compiled loops widened in two steps
 * with extra shuffles), converted, scaled and added, sender 0 first. Requantize: as for
 * int4 with qmax = 127, |x/s| <= 127 / (1 - u), so E = |q' - fl(x/s)| < (3u + u^2) * 127
 * / (1 - u) < 2.3e-5; t = q' + 1536.5 (1.5 * 2^10 + 1/2) lies in [1024, 2048), whose
 * float step is 2^-13, half a step 6.1e-5 > E: bits(t) >> 13 has round(q') as its low
 * byte (two's complement; bits(1024) >> 13 and 1.5 * 2^10 - 1024 end in a zero byte)
 * unless the low 13 bits of bits(t) are zero, which flags a near-tie (1 in 8192 lanes on
 * random data); a vector of 16 holding one is recomputed with the division. Both
 * quotients are below 127.5 in magnitude: no clamp. */
#define Q8_GROUP 64 /* elements per iteration: four vectors */

/* sums[] of one block of groups * Q8_GROUP elements; returns the largest |sum| as float
 * bits. */
ZC_TARGET_2 static uint32_t sum_int8_512(const int8_t *p, int64_t stride, const float *sc,
                                         int64_t sstride, int64_t k, int64_t groups,
                                         float *ZC_RESTRICT sums) {
    const __m512i abs_mask = _mm512_set1_epi32((int)ABS_MASK);
    __m512i amax = _mm512_setzero_si512();
#define ZC_VALUE(ROW, V, S)                                                               \
    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                                \
                      _mm_loadu_si128((const __m128i *)(ROW + 16 * V)))),                 \
                  S)
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *row = p + Q8_GROUP * g;
        __m512 s0 = _mm512_set1_ps(sc[0]);
        __m512 a0 = ZC_VALUE(row, 0, s0), a1 = ZC_VALUE(row, 1, s0);
        __m512 a2 = ZC_VALUE(row, 2, s0), a3 = ZC_VALUE(row, 3, s0);
        /* unrolled, so that each sender's rows are read by load instructions of their
         * own: one load reading the k rows in turn (strides of a whole payload) misled
         * the hardware prefetcher, 2.5x slower for int8 at 4-8M elements */
#pragma GCC unroll 8
        for (int64_t i = 1; i < k; i++) {
            const int8_t *ri = row + i * stride;
            __m512 si = _mm512_set1_ps(sc[i * sstride]);
            a0 = _mm512_add_ps(a0, ZC_VALUE(ri, 0, si));
            a1 = _mm512_add_ps(a1, ZC_VALUE(ri, 1, si));
            a2 = _mm512_add_ps(a2, ZC_VALUE(ri, 2, si));
            a3 = _mm512_add_ps(a3, ZC_VALUE(ri, 3, si));
        }
        float *out = sums + Q8_GROUP * g;
#define ZC_KEEP(V, A)                                                                     \
    _mm512_storeu_ps(out + 16 * V, A);                                                    \
    amax = _mm512_max_epu32(amax, _mm512_and_si512(_mm512_castps_si512(A), abs_mask));
        ZC_KEEP(0, a0) ZC_KEEP(1, a1) ZC_KEEP(2, a2) ZC_KEEP(3, a3)
#undef ZC_KEEP
    }
#undef ZC_VALUE
    return (uint32_t)_mm512_reduce_max_epu32(amax);
}

/* 16 payload bytes from 16 sums, dividing by s (with the clamp of round_clamp). */
ZC_TARGET_2 static __m128i requant_int8_exact(const float *x, __m512 s) {
    __m512 q = _mm512_div_ps(_mm512_loadu_ps(x), s);
    q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
    /* the sum's bits end in q (two's complement) in their low byte */
    return _mm512_cvtepi32_epi8(_mm512_castps_si512(_mm512_add_ps(q, _mm512_set1_ps(ROUND_MAGIC))));
}

/* The payload of one block of n (a multiple of 16) elements from its sums. */
ZC_TARGET_2 static void requant_int8_512(const float *sums, int64_t n, float s,
                                         int8_t *ZC_RESTRICT payload) {
    const __m512 vs = _mm512_set1_ps(s);
    if (bits_of(s) < 0x00800000u) { /* subnormal: 1 / s may overflow; divide */
        for (int64_t j = 0; j < n; j += 16)
            _mm_storeu_si128((__m128i *)(payload + j), requant_int8_exact(sums + j, vs));
        return;
    }
    const __m512 r = _mm512_set1_ps(1.0f / s), magic = _mm512_set1_ps(1536.5f);
    const __m512i frac_bits = _mm512_set1_epi32(0x1fff);
    for (int64_t j = 0; j < n; j += 16) {
        __m512i b = _mm512_castps_si512(
            _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(sums + j), r), magic));
        __m128i q = _mm512_cvtepi32_epi8(_mm512_srli_epi32(b, 13));
        if (_mm512_test_epi32_mask(b, frac_bits) != 0xffff)
            q = requant_int8_exact(sums + j, vs);
        _mm_storeu_si128((__m128i *)(payload + j), q);
    }
}

/* Full blocks [b0, b1) of the fused kernel at AVX-512, in batches (see batch_blocks):
 * int4 for block_size a multiple of Q4_GROUP, int8 for a multiple of Q8_GROUP. scratch
 * holds batch_blocks(block_size) blocks of sums, then (int4) k tables. */
ZC_TARGET_2 static void reduce_full_blocks_512(int bits, const uint8_t *in, int64_t stride,
                                               const float *scales, int64_t sstride,
                                               int64_t k, int64_t block_size, int64_t b0,
                                               int64_t b1, uint8_t *out, float *out_scales,
                                               float *scratch) {
    const int64_t bytes = bits == 8 ? block_size : block_size / 2;
    const int64_t batch = batch_blocks(block_size);
    float *tables = scratch + batch * block_size;
    for (int64_t b = b0; b < b1; b += batch) {
        const int64_t nb = b1 - b < batch ? b1 - b : batch;
        float s[ZC_BATCH_ELEMENTS / Q8_GROUP];
        int live[ZC_BATCH_ELEMENTS / Q8_GROUP];
        for (int64_t j = 0; j < nb; j++) {
            const uint8_t *p = in + (b + j) * bytes;
            float *sums = scratch + j * block_size;
            uint32_t m = bits == 8
                ? sum_int8_512((const int8_t *)p, stride, scales + b + j, sstride, k,
                               block_size / Q8_GROUP, sums)
                : sum_int4_512(p, stride, scales + b + j, sstride, k, block_size / Q4_GROUP,
                               sums, tables);
            live[j] = block_scale(m, bits == 8 ? 127 : 7, out_scales + b + j, &s[j]);
        }
        for (int64_t j = 0; j < nb; j++) {
            uint8_t *q = out + (b + j) * bytes;
            const float *sums = scratch + j * block_size;
            if (!live[j])
                memset(q, bits == 8 ? 0 : INT4_ZERO_BYTE, (size_t)bytes);
            else if (bits == 8)
                requant_int8_512(sums, block_size, s[j], (int8_t *)q);
            else
                requant_int4_512(sums, block_size / Q4_GROUP, s[j], q);
        }
    }
}
#endif

/* ------------------------------------------------------------ argument checks */

static int check_range(int bits, int64_t block_size, int64_t numel, int64_t block_begin,
                       int64_t block_end) {
    if ((bits != 8 && bits != 4) || block_size < 1 || (bits == 4 && (block_size & 1)) ||
        numel < 0)
        return ZC_EINVAL;
    int64_t blocks = numel / block_size + (numel % block_size != 0);
    if (block_begin < 0 || block_end < block_begin || block_end > blocks)
        return ZC_EINVAL;
    return ZC_OK;
}

ZC_INLINE int64_t block_numel(int64_t b, int64_t block_size, int64_t numel) {
    int64_t left = numel - b * block_size;
    return left < block_size ? left : block_size;
}

ZC_INLINE int64_t payload_offset(int64_t element, int bits) {
    return bits == 8 ? element : element / 2;
}

/* ------------------------------------------------------------ chunk kernels */

/* the body of zc_quantize (see there), compiled once per level */
ZC_INLINE int quantize_impl(const void *x, int dtype, int64_t numel, int bits,
                            int64_t block_size, int64_t block_begin, int64_t block_end,
                            void *payload, float *scales) {
    int rc = check_range(bits, block_size, numel, block_begin, block_end);
    if (rc != ZC_OK || (dtype != ZC_F32 && dtype != ZC_F16 && dtype != ZC_BF16))
        return ZC_EINVAL;
    uint8_t *out = (uint8_t *)payload;
    float *tile = NULL;
    if (dtype != ZC_F32) {
        tile = (float *)malloc((size_t)block_size * sizeof(float));
        if (!tile)
            return ZC_ENOMEM;
    }
    if (dtype == ZC_F32) { /* in batches (see batch_blocks) */
        const float *xf = (const float *)x;
        const int64_t batch = batch_blocks(block_size);
        uint32_t m[ZC_BATCH_ELEMENTS];
        for (int64_t b0 = block_begin; b0 < block_end; b0 += batch) {
            const int64_t nb = block_end - b0 < batch ? block_end - b0 : batch;
            for (int64_t j = 0; j < nb; j++)
                m[j] = absmax_bits(xf + (b0 + j) * block_size,
                                   block_numel(b0 + j, block_size, numel));
            for (int64_t j = 0; j < nb; j++) {
                int64_t b = b0 + j, first = b * block_size;
                quantize_block(xf + first, block_numel(b, block_size, numel), m[j], bits,
                               out + payload_offset(first, bits), scales + b);
            }
        }
        return ZC_OK;
    }
    for (int64_t b = block_begin; b < block_end; b++) {
        int64_t first = b * block_size, n = block_numel(b, block_size, numel);
        load_block(x, dtype, first, n, tile);
        quantize_block(tile, n, absmax_bits(tile, n), bits, out + payload_offset(first, bits),
                       scales + b);
    }
    free(tile);
    return ZC_OK;
}

/* the body of zc_dequantize */
ZC_INLINE int dequantize_impl(const void *payload, const float *scales, int bits,
                              int64_t block_size, int64_t numel, int64_t block_begin,
                              int64_t block_end, void *out, int dtype) {
    int rc = check_range(bits, block_size, numel, block_begin, block_end);
    if (rc != ZC_OK || (dtype != ZC_F32 && dtype != ZC_F16 && dtype != ZC_BF16))
        return ZC_EINVAL;
    const uint8_t *in = (const uint8_t *)payload;
    float *tile = NULL;
    if (dtype != ZC_F32) {
        tile = (float *)malloc((size_t)block_size * sizeof(float));
        if (!tile)
            return ZC_ENOMEM;
    }
    for (int64_t b = block_begin; b < block_end; b++) {
        int64_t first = b * block_size, n = block_numel(b, block_size, numel);
        float *dst = dtype == ZC_F32 ? (float *)out + first : tile;
        dequantize_block(in + payload_offset(first, bits), scales[b], bits, n, dst);
        if (dtype != ZC_F32)
            store_block(tile, n, out, dtype, first);
    }
    free(tile);
    return ZC_OK;
}

/* the body of zc_dequantize_reduce_requantize; level 2 takes the AVX-512 int4 path for
 * blocks of a multiple of Q4_GROUP elements */
ZC_INLINE int reduce_impl(
    const void *payloads, int64_t payload_stride, const float *scales, int64_t scale_stride,
    int64_t k, int bits, int64_t block_size, int64_t numel, int64_t block_begin,
    int64_t block_end, void *out_payload, float *out_scales, int level) {
    int rc = check_range(bits, block_size, numel, block_begin, block_end);
    if (rc != ZC_OK || k < 1 || payload_stride < 0 || scale_stride < 0)
        return ZC_EINVAL;
    const uint8_t *in = (const uint8_t *)payloads;
    uint8_t *out = (uint8_t *)out_payload;
    /* per block of a batch (see batch_blocks), int8: its sums; int4: its even sums, then
     * its odd sums (on the AVX-512 path: its transposed sums); then the AVX-512 path's k
     * tables of 16 floats */
    const int64_t batch = batch_blocks(block_size), per_block = block_size + 2;
    float *sum = (float *)malloc(((size_t)(batch * per_block) + 16 * (size_t)k) * sizeof(float));
    if (!sum)
        return ZC_ENOMEM;
    uint32_t m[ZC_BATCH_ELEMENTS];
    for (int64_t b0 = block_begin; b0 < block_end;) {
#if ZC_LEVELS > 1
        if (level == 2 && block_size % (bits == 8 ? Q8_GROUP : Q4_GROUP) == 0 &&
            block_numel(b0, block_size, numel) == block_size) {
            /* this and the following full blocks (a partial last block is left to the
             * code below) */
            int64_t full_end = numel / block_size < block_end ? numel / block_size : block_end;
            reduce_full_blocks_512(bits, in, payload_stride, scales, scale_stride, k,
                                   block_size, b0, full_end, out, out_scales, sum);
            b0 = full_end;
            continue;
        }
#else
        (void)level;
#endif
        const int64_t nb = block_end - b0 < batch ? block_end - b0 : batch;
        for (int64_t j = 0; j < nb; j++) {
            int64_t b = b0 + j, n = block_numel(b, block_size, numel);
            float *lo = sum + j * per_block;
            m[j] = sum_block(in + payload_offset(b * block_size, bits), payload_stride,
                             scales + b, scale_stride, k, bits, n, lo, lo + block_size / 2 + 1);
        }
        for (int64_t j = 0; j < nb; j++) {
            int64_t b = b0 + j, n = block_numel(b, block_size, numel);
            int64_t off = payload_offset(b * block_size, bits);
            float *lo = sum + j * per_block;
            if (bits == 8)
                quantize_block(lo, n, m[j], 8, out + off, out_scales + b);
            else
                quantize_pairs(lo, lo + block_size / 2 + 1, (n + 1) / 2, m[j], out + off,
                               out_scales + b);
        }
        b0 += nb;
    }
    free(sum);
    return ZC_OK;
}

/* ------------------------------------------------------------ levels */

#define ZC_QUANTIZE_BODY                                                                  \
    (const void *x, int dtype, int64_t numel, int bits, int64_t block_size,                \
     int64_t block_begin, int64_t block_end, void *payload, float *scales) {              \
        return quantize_impl(x, dtype, numel, bits, block_size, block_begin, block_end,   \
                             payload, scales);                                            \
    }
#define ZC_DEQUANTIZE_BODY                                                                \
    (const void *payload, const float *scales, int bits, int64_t block_size,               \
     int64_t numel, int64_t block_begin, int64_t block_end, void *out, int dtype) {        \
        return dequantize_impl(payload, scales, bits, block_size, numel, block_begin,      \
                               block_end, out, dtype);                                    \
    }
#define ZC_REDUCE_BODY(level)                                                             \
    (const void *payloads, int64_t payload_stride, const float *scales,                    \
     int64_t scale_stride, int64_t k, int bits, int64_t block_size, int64_t numel,         \
     int64_t block_begin, int64_t block_end, void *out_payload, float *out_scales) {       \
        return reduce_impl(payloads, payload_stride, scales, scale_stride, k, bits,        \
                           block_size, numel, block_begin, block_end, out_payload,         \
                           out_scales, level);                                            \
    }

static int quantize_0 ZC_QUANTIZE_BODY
static int dequantize_0 ZC_DEQUANTIZE_BODY
static int reduce_0 ZC_REDUCE_BODY(0)
#if ZC_LEVELS > 1
ZC_TARGET_1 static int quantize_1 ZC_QUANTIZE_BODY
ZC_TARGET_1 static int dequantize_1 ZC_DEQUANTIZE_BODY
ZC_TARGET_1 static int reduce_1 ZC_REDUCE_BODY(1)
ZC_TARGET_2 static int quantize_2 ZC_QUANTIZE_BODY
ZC_TARGET_2 static int dequantize_2 ZC_DEQUANTIZE_BODY
ZC_TARGET_2 static int reduce_2 ZC_REDUCE_BODY(2)
#endif

/* ------------------------------------------------------------ exported API */

ZC_EXPORT int zc_abi_version(void) { return ZC_ABI_VERSION; }

ZC_EXPORT const char *zc_source_sha256(void) { return ZC_SOURCE_SHA256; }

/* The highest level this CPU and OS support (0 where there is only the portable build),
 * found once when the library is loaded. */
#if ZC_LEVELS > 1
static int best_level;

__attribute__((constructor)) static void find_best_level(void) {
    __builtin_cpu_init(); /* its checks include that the OS saves AVX / AVX-512 registers */
    int level1 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
                 __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
    int level2 = level1 && __builtin_cpu_supports("avx512f") &&
                 __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                 __builtin_cpu_supports("avx512vl");
    best_level = level2 ? 2 : level1 ? 1 : 0;
}
#else
static const int best_level = 0;
#endif

ZC_EXPORT int zc_best_level(void) { return best_level; }

ZC_EXPORT const char *zc_level_name(int level) {
#if ZC_LEVELS > 1
    static const char *names[] = {"x86-64 baseline (SSE2)", "AVX2", "AVX-512"};
    return level >= 0 && level < ZC_LEVELS ? names[level] : "unknown";
#else
    return level == 0 ? "portable C" : "unknown";
#endif
}

/* The kernels take the level to run first; a level above zc_best_level() is refused. */
#if ZC_LEVELS > 1
#define ZC_DISPATCH(level, fn, args)                                                      \
    do {                                                                                  \
        if (level < 0 || level > best_level)                                         \
            return ZC_EINVAL;                                                             \
        return level == 2 ? fn##_2 args : level == 1 ? fn##_1 args : fn##_0 args;         \
    } while (0)
#else
#define ZC_DISPATCH(level, fn, args)                                                      \
    do {                                                                                  \
        return level == 0 ? fn##_0 args : ZC_EINVAL;                                      \
    } while (0)
#endif

/* Quantize blocks [block_begin, block_end) of the flat tensor x (numel elements of
 * dtype ZC_F32 / ZC_F16 / ZC_BF16) into payload (the whole tensor's payload: numel
 * int8 bytes, or ceil(numel / 2) int4 bytes) and scales (one float32 per block). */
ZC_EXPORT int zc_quantize(int level, const void *x, int dtype, int64_t numel, int bits,
                          int64_t block_size, int64_t block_begin, int64_t block_end,
                          void *payload, float *scales) {
    ZC_DISPATCH(level, quantize, (x, dtype, numel, bits, block_size, block_begin, block_end,
                                  payload, scales));
}

/* Dequantize blocks [block_begin, block_end) into out, the whole flat output of numel
 * elements of dtype. */
ZC_EXPORT int zc_dequantize(int level, const void *payload, const float *scales, int bits,
                            int64_t block_size, int64_t numel, int64_t block_begin,
                            int64_t block_end, void *out, int dtype) {
    ZC_DISPATCH(level, dequantize, (payload, scales, bits, block_size, numel, block_begin,
                                    block_end, out, dtype));
}

/* qgZ's middle hop for blocks [block_begin, block_end): the k senders' payloads start
 * payload_stride bytes apart (row i = sender i), their scales scale_stride floats apart;
 * each block's float32 sum (sender 0 first) is quantized into out_payload / out_scales
 * (the whole outputs, as in zc_quantize). */
ZC_EXPORT int zc_dequantize_reduce_requantize(int level, const void *payloads,
                                              int64_t payload_stride, const float *scales,
                                              int64_t scale_stride, int64_t k, int bits,
                                              int64_t block_size, int64_t numel,
                                              int64_t block_begin, int64_t block_end,
                                              void *out_payload, float *out_scales) {
    ZC_DISPATCH(level, reduce, (payloads, payload_stride, scales, scale_stride, k, bits,
                                block_size, numel, block_begin, block_end, out_payload,
                                out_scales));
}
