/* The transpose of a matrix of 2- or 4-byte elements into another: the native kernel behind
 * ckptconv/io/transpose.py, which validates the arguments and uses torch's copy where this module is not built.
 *
 * torch's CPU transpose of 2-byte elements moves one element at a time within 60 x 60 blocks (~0.45 CPU s/GB against
 * ~0.09 for a memcpy, benchmarks/transpose_floor.py). Here tiles of 8 x 8 2-byte or 4 x 4 4-byte elements are
 * transposed in SSE2 registers (part of x86-64's baseline: no -march flag), 16 x 16 2-byte ones in AVX2 registers where
 * the CPU has them (chosen at import); other architectures (or -DCK_PORTABLE) get the same blocking with a plain C
 * tile, which the compiler may vectorize.
 *
 * transpose(src, dst, rows, cols, src_stride, dst_stride, elem_size): dst[j][i] = src[i][j] for i < rows, j < cols;
 * src and dst are addresses, the strides the distance between rows in elements. The GIL is released while the bytes
 * move (the executor's workers are threads). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(CK_PORTABLE)
#include <emmintrin.h>
#define CK_SSE2 1
#if defined(__GNUC__)  /* gcc and clang: target attributes, __builtin_cpu_supports */
#include <immintrin.h>
#define CK_AVX2 1
static int use_avx2 = 0;  /* set at import where the CPU has AVX2; allow_avx2() switches it */
#endif
#endif

#if defined(_MSC_VER)
#define INLINE static __forceinline
#else
#define INLINE static inline __attribute__((always_inline))
#endif
#ifndef BLOCK
#define BLOCK 128  /* a block's side in elements (tile columns x rows walked before the next column of tiles) */
#endif
#ifndef BLOCK_AVX2
#define BLOCK_AVX2 256  /* the AVX2 kernel's: its 16-row tiles gain from taller blocks (128: 0.16-0.19 s/GB, 256:
                        * 0.14-0.17) */
#endif

/* A tile's transpose: rows of the source ``s`` (``ss`` bytes apart) into rows of the target ``d`` (``ds`` apart). */
typedef void (*tile_fn)(const char *s, char *d, ptrdiff_t ss, ptrdiff_t ds);

/* The 8 x 8 transpose of 2-byte elements in registers: rows a[0..7] in, columns c[0..7] out, by three rounds of
 * interleaving (16-, 32-, 64-bit lanes). V is the register type and P the intrinsics' prefix: _mm_ (SSE2, 128 bits)
 * or _mm256_ (AVX2, whose unpacks run in each 128-bit lane: two 8 x 8 transposes side by side). */
#define INTERLEAVE8(V, P, a, c)                                                                                       \
    do {                                                                                                              \
        V b0 = P##unpacklo_epi16(a[0], a[1]), b1 = P##unpackhi_epi16(a[0], a[1]);                                     \
        V b2 = P##unpacklo_epi16(a[2], a[3]), b3 = P##unpackhi_epi16(a[2], a[3]);                                     \
        V b4 = P##unpacklo_epi16(a[4], a[5]), b5 = P##unpackhi_epi16(a[4], a[5]);                                     \
        V b6 = P##unpacklo_epi16(a[6], a[7]), b7 = P##unpackhi_epi16(a[6], a[7]);                                     \
        V e0 = P##unpacklo_epi32(b0, b2), e1 = P##unpackhi_epi32(b0, b2);                                             \
        V e2 = P##unpacklo_epi32(b1, b3), e3 = P##unpackhi_epi32(b1, b3);                                             \
        V e4 = P##unpacklo_epi32(b4, b6), e5 = P##unpackhi_epi32(b4, b6);                                             \
        V e6 = P##unpacklo_epi32(b5, b7), e7 = P##unpackhi_epi32(b5, b7);                                             \
        c[0] = P##unpacklo_epi64(e0, e4), c[1] = P##unpackhi_epi64(e0, e4);                                           \
        c[2] = P##unpacklo_epi64(e1, e5), c[3] = P##unpackhi_epi64(e1, e5);                                           \
        c[4] = P##unpacklo_epi64(e2, e6), c[5] = P##unpackhi_epi64(e2, e6);                                           \
        c[6] = P##unpacklo_epi64(e3, e7), c[7] = P##unpackhi_epi64(e3, e7);                                           \
    } while (0)

#ifdef CK_SSE2
/* 8 x 8 2-byte elements. */
INLINE void tile2_sse2(const char *s, char *d, ptrdiff_t ss, ptrdiff_t ds) {
    __m128i a[8], c[8];
    for (int r = 0; r < 8; r++) a[r] = _mm_loadu_si128((const __m128i *)(s + r * ss));
    INTERLEAVE8(__m128i, _mm_, a, c);
    for (int k = 0; k < 8; k++) _mm_storeu_si128((__m128i *)(d + k * ds), c[k]);
}

/* 4 x 4 4-byte elements: two rounds (32-, 64-bit lanes). */
INLINE void tile4_sse2(const char *s, char *d, ptrdiff_t ss, ptrdiff_t ds) {
    __m128i a[4];
    for (int r = 0; r < 4; r++) a[r] = _mm_loadu_si128((const __m128i *)(s + r * ss));
    __m128i b0 = _mm_unpacklo_epi32(a[0], a[1]), b1 = _mm_unpackhi_epi32(a[0], a[1]);
    __m128i b2 = _mm_unpacklo_epi32(a[2], a[3]), b3 = _mm_unpackhi_epi32(a[2], a[3]);
    _mm_storeu_si128((__m128i *)(d + 0 * ds), _mm_unpacklo_epi64(b0, b2));
    _mm_storeu_si128((__m128i *)(d + 1 * ds), _mm_unpackhi_epi64(b0, b2));
    _mm_storeu_si128((__m128i *)(d + 2 * ds), _mm_unpacklo_epi64(b1, b3));
    _mm_storeu_si128((__m128i *)(d + 3 * ds), _mm_unpackhi_epi64(b1, b3));
}
#define TILE2 tile2_sse2
#define TILE4 tile4_sse2
#else
INLINE void tile2_plain(const char *s, char *d, ptrdiff_t ss, ptrdiff_t ds) {
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++) memcpy(d + j * ds + 2 * i, s + i * ss + 2 * j, 2);
}

INLINE void tile4_plain(const char *s, char *d, ptrdiff_t ss, ptrdiff_t ds) {
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) memcpy(d + j * ds + 4 * i, s + i * ss + 4 * j, 4);
}
#define TILE2 tile2_plain
#define TILE4 tile4_plain
#endif

#ifdef CK_AVX2
/* 16 x 16 2-byte elements: two 8 x 16 transposes (source rows 0-7, then 8-15) in AVX2 registers, whose unpacks run in
 * each 128-bit lane: register k of each ends as target row k (low lane) and k + 8 (high lane), 8 elements each; the
 * lanes of the two are joined so that every target row gets one 32-byte store. Measured against 8 x 16 tiles with
 * 16-byte stores (Mixtral's expert matrices, bf16, out of cache): 0.20 -> 0.14-0.17 CPU s/GB in 256-element
 * blocks. */
__attribute__((target("avx2"))) INLINE void tile16_avx2(const char *s, char *d, ptrdiff_t ss, ptrdiff_t ds) {
    __m256i a[8], top[8], bottom[8];
    for (int r = 0; r < 8; r++) a[r] = _mm256_loadu_si256((const __m256i *)(s + r * ss));
    INTERLEAVE8(__m256i, _mm256_, a, top);
    for (int r = 0; r < 8; r++) a[r] = _mm256_loadu_si256((const __m256i *)(s + (r + 8) * ss));
    INTERLEAVE8(__m256i, _mm256_, a, bottom);
    for (int k = 0; k < 8; k++) {
        _mm256_storeu_si256((__m256i *)(d + k * ds), _mm256_permute2x128_si256(top[k], bottom[k], 0x20));
        _mm256_storeu_si256((__m256i *)(d + (k + 8) * ds), _mm256_permute2x128_si256(top[k], bottom[k], 0x31));
    }
}

/* 8 x 16 2-byte elements (the rows left past the 16 x 16 tiles): columns j..j+7 in the registers' low lanes,
 * j+8..j+15 in the high ones; register k ends as column k (low lane) and column k + 8 (high lane). */
__attribute__((target("avx2"))) INLINE void tile2x2_avx2(const char *s, char *d, ptrdiff_t ss, ptrdiff_t ds) {
    __m256i a[8], c[8];
    for (int r = 0; r < 8; r++) a[r] = _mm256_loadu_si256((const __m256i *)(s + r * ss));
    INTERLEAVE8(__m256i, _mm256_, a, c);
    for (int k = 0; k < 8; k++) {
        _mm_storeu_si128((__m128i *)(d + k * ds), _mm256_castsi256_si128(c[k]));
        _mm_storeu_si128((__m128i *)(d + (k + 8) * ds), _mm256_extracti128_si256(c[k], 1));
    }
}

/* 16 x 8 2-byte elements (the columns a block has left past its 16 x 16 tiles): two SSE2 tiles, one above the other. */
INLINE void tile16x8_sse2(const char *s, char *d, ptrdiff_t ss, ptrdiff_t ds) {
    tile2_sse2(s, d, ss, ds);
    tile2_sse2(s + 8 * ss, d + 16, ss, ds);
}
#endif

/* Blocks of ``b`` x ``b`` elements, walked along the target's rows; inside a block, tiles of ``tr`` rows x ``tc``
 * columns (or ``half`` of them where only so many are left), a column of tiles at a time, so each target row of the
 * tiles fills whole cache lines one after the other. Expert matrices have row strides of a multiple of 4 KiB, whose
 * rows all fall into one set of the L1 cache: tiles walked along the source's rows instead write a few bytes into
 * each of 64 target rows and evict those lines before they fill (measured ~1.8x slower). What no tile covers, one
 * element at a time. Strides in bytes. Inlined into each caller, with its tiles in the caller's instruction set. */
INLINE void blocked(const char *src, char *dst, ptrdiff_t rows, ptrdiff_t cols, ptrdiff_t ss, ptrdiff_t ds,
                    const ptrdiff_t size, const ptrdiff_t b, const ptrdiff_t tr, const ptrdiff_t tc, tile_fn tile,
                    const ptrdiff_t half, tile_fn tile_half) {
    for (ptrdiff_t j0 = 0; j0 < cols; j0 += b) {
        const ptrdiff_t j1 = j0 + b < cols ? j0 + b : cols, jt = j0 + (j1 - j0) / half * half;
        for (ptrdiff_t i0 = 0; i0 < rows; i0 += b) {
            const ptrdiff_t i1 = i0 + b < rows ? i0 + b : rows, it = i0 + (i1 - i0) / tr * tr;
            ptrdiff_t j = j0;
            for (; j + tc <= jt; j += tc)
                for (ptrdiff_t i = i0; i < it; i += tr) tile(src + i * ss + j * size, dst + j * ds + i * size, ss, ds);
            for (; j < jt; j += half)
                for (ptrdiff_t i = i0; i < it; i += tr)
                    tile_half(src + i * ss + j * size, dst + j * ds + i * size, ss, ds);
            for (ptrdiff_t i = i0; i < i1; i++)  /* the block's columns past its tiles, then its rows past them */
                for (j = i < it ? jt : j0; j < j1; j++) memcpy(dst + j * ds + i * size, src + i * ss + j * size, size);
        }
    }
}

static void transpose2(const char *src, char *dst, ptrdiff_t rows, ptrdiff_t cols, ptrdiff_t ss, ptrdiff_t ds) {
    blocked(src, dst, rows, cols, ss, ds, 2, BLOCK, 8, 8, TILE2, 8, TILE2);
}

static void transpose4(const char *src, char *dst, ptrdiff_t rows, ptrdiff_t cols, ptrdiff_t ss, ptrdiff_t ds) {
    blocked(src, dst, rows, cols, ss, ds, 4, BLOCK, 4, 4, TILE4, 4, TILE4);
}

#ifdef CK_AVX2
__attribute__((target("avx2"))) static void transpose2_avx2(const char *src, char *dst, ptrdiff_t rows, ptrdiff_t cols,
                                                            ptrdiff_t ss, ptrdiff_t ds) {
    /* the rows in 16-row tiles, then those left (fewer than 16: the engine's chunks of rows come in any number) in
     * 8-row tiles, so that only fewer than 8 go one element at a time */
    const ptrdiff_t tall = rows / 16 * 16;
    blocked(src, dst, tall, cols, ss, ds, 2, BLOCK_AVX2, 16, 16, tile16_avx2, 8, tile16x8_sse2);
    if (tall < rows)
        blocked(src + tall * ss, dst + tall * 2, rows - tall, cols, ss, ds, 2, BLOCK, 8, 16, tile2x2_avx2, 8,
                tile2_sse2);
}
#endif

static PyObject *transpose(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    Py_ssize_t rows, cols, ss, ds, size;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKnnnnn", &src, &dst, &rows, &cols, &ss, &ds, &size)) return NULL;
    if (rows < 0 || cols < 0 || (rows > 1 && ss < cols) || (cols > 1 && ds < rows) || (size != 2 && size != 4)) {
        PyErr_Format(PyExc_ValueError, "transpose: rows %zd, cols %zd, strides %zd/%zd, element size %zd", rows, cols,
                     ss, ds, size);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    const char *from = (const char *)(uintptr_t)src;
    char *to = (char *)(uintptr_t)dst;
    if (size == 4)
        transpose4(from, to, rows, cols, ss * 4, ds * 4);
#ifdef CK_AVX2
    else if (use_avx2)
        transpose2_avx2(from, to, rows, cols, ss * 2, ds * 2);
#endif
    else
        transpose2(from, to, rows, cols, ss * 2, ds * 2);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *kernel(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
#ifdef CK_AVX2
    if (use_avx2) return PyUnicode_FromString("avx2");
#endif
#ifdef CK_SSE2
    return PyUnicode_FromString("sse2");
#else
    return PyUnicode_FromString("portable");
#endif
}

/* The AVX2 tiles switched off (False) or back on where the CPU has them (True): the tests run both kernels. */
static PyObject *allow_avx2(PyObject *self, PyObject *flag) {
    int on = PyObject_IsTrue(flag);
    (void)self;
    if (on < 0) return NULL;
#ifdef CK_AVX2
    use_avx2 = on && __builtin_cpu_supports("avx2");
#endif
    return kernel(NULL, NULL);
}

static PyMethodDef methods[] = {
    {"transpose", transpose, METH_VARARGS,
     "transpose(src, dst, rows, cols, src_stride, dst_stride, elem_size): dst[j][i] = src[i][j] (addresses; strides "
     "in elements)"},
    {"kernel", kernel, METH_NOARGS, "the instruction set the 2-byte transpose uses: avx2, sse2 or portable"},
    {"allow_avx2", allow_avx2, METH_O, "allow_avx2(flag): AVX2 tiles off or (where the CPU has them) on; the kernel"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_transpose", "ckptconv's native transpose kernel", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__transpose(void) {
#ifdef CK_AVX2
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    return PyModule_Create(&module);
}
