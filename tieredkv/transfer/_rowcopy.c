/* Segment copies for the CPU copy path, with the GIL released.
 *
 * Why native: a block-granular copy is many independent runs of 16-256 KiB. numpy moves them
 * with ordinary stores, which on x86 first read every destination line into the cache (a
 * "read for ownership"), so a scattered copy moves ~1.5x the bytes of the copy itself and
 * lands at 0.65-0.8 of one large memcpy. Non-temporal (streaming) stores write whole lines
 * straight to memory with no read, which is what a KV block copy wants: its destination is
 * not read again soon by this core (a host slot waits for a spill or a later hit; a device
 * block is read by the next forward pass, long after several MiB more have gone by).
 * Releasing the GIL lets the model's thread run while a copy lane copies.
 *
 * copy_blocks computes each run's addresses itself (from per-layer constants and
 * (slot, position, block) triples) and refuses, before copying anything, a run that would
 * leave the device cache or the host pool: a bad id must never become a wild write.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#include <xmmintrin.h>
#define TIEREDKV_STREAMING 1
#else
#define TIEREDKV_STREAMING 0
#endif

/* Below this a run is better copied through the cache: the fixed cost of the aligned head
 * and tail and of the final fence outweighs the saved reads. */
#define STREAM_MIN_BYTES 4096
/* How much of the next run to prefetch while the current one is copied. */
#define PREFETCH_BYTES 2048

#if TIEREDKV_STREAMING
static void stream_copy(char *dst, const char *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    /* Unaligned loads cost the same as aligned ones on current x86 cores; only the stores
     * must be 16-byte aligned, which the head copy above arranged. */
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
}
#endif

typedef struct {
    char *dst;
    const char *src;
    size_t n;
} segment;

/* Fill `out` with the byte runs for `items`, layer-major, merging runs adjacent on both
 * sides. Returns the number of runs, or -1 if any run would leave its region. */
static Py_ssize_t plan_segments(const int64_t *layers, Py_ssize_t num_layers, int64_t host_base,
                                int64_t slot_bytes, const int64_t *items, Py_ssize_t num_items,
                                int to_host, const int64_t *bounds, segment *out)
{
    Py_ssize_t count = 0;
    for (Py_ssize_t l = 0; l < num_layers; l++) {
        const int64_t dev_ptr = layers[4 * l], dev_stride = layers[4 * l + 1];
        const int64_t block_bytes = layers[4 * l + 2], host_offset = layers[4 * l + 3];
        for (Py_ssize_t i = 0; i < num_items; i++) {
            const int64_t slot = items[3 * i], pos = items[3 * i + 1], block = items[3 * i + 2];
            const int64_t dev = dev_ptr + block * dev_stride;
            const int64_t host = host_base + slot * slot_bytes + host_offset + pos * block_bytes;
            if (block < 0 || slot < 0 || pos < 0 || dev < bounds[0] ||
                dev + block_bytes > bounds[1] || host < bounds[2] ||
                host + block_bytes > bounds[3])
                return -1;
            const char *src = (const char *)(uintptr_t)(to_host ? dev : host);
            char *dst = (char *)(uintptr_t)(to_host ? host : dev);
            if (count > 0 && out[count - 1].src + out[count - 1].n == src &&
                out[count - 1].dst + out[count - 1].n == dst) {
                out[count - 1].n += (size_t)block_bytes;
                continue;
            }
            out[count].src = src;
            out[count].dst = dst;
            out[count].n = (size_t)block_bytes;
            count++;
        }
    }
    return count;
}

static int int64_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t group, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len % (group * (Py_ssize_t)sizeof(int64_t)) != 0) {
        PyErr_Format(PyExc_ValueError, "%s must hold a multiple of %zd int64 values", what, group);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_blocks(PyObject *self, PyObject *args)
{
    PyObject *layers_obj, *items_obj;
    long long host_base, slot_bytes, bounds[4];
    int to_host, nontemporal;
    if (!PyArg_ParseTuple(args, "OLLOpp(LLLL)", &layers_obj, &host_base, &slot_bytes, &items_obj,
                          &to_host, &nontemporal, &bounds[0], &bounds[1], &bounds[2], &bounds[3]))
        return NULL;
    Py_buffer layers, items;
    if (int64_buffer(layers_obj, &layers, 4, "layers") < 0)
        return NULL;
    if (int64_buffer(items_obj, &items, 3, "items") < 0) {
        PyBuffer_Release(&layers);
        return NULL;
    }
    const Py_ssize_t num_layers = layers.len / (4 * (Py_ssize_t)sizeof(int64_t));
    const Py_ssize_t num_items = items.len / (3 * (Py_ssize_t)sizeof(int64_t));
    const int64_t limits[4] = {bounds[0], bounds[1], bounds[2], bounds[3]};
    segment *segments = NULL;
    if (num_layers * num_items > 0) {
        segments = PyMem_RawMalloc((size_t)(num_layers * num_items) * sizeof(segment));
        if (segments == NULL) {
            PyBuffer_Release(&layers);
            PyBuffer_Release(&items);
            return PyErr_NoMemory();
        }
    }
    Py_ssize_t count = 0;
    int streamed = 0;
    Py_BEGIN_ALLOW_THREADS
    if (segments != NULL)
        count = plan_segments((const int64_t *)layers.buf, num_layers, host_base, slot_bytes,
                              (const int64_t *)items.buf, num_items, to_host, limits, segments);
    for (Py_ssize_t i = 0; i < count; i++) {
        segment s = segments[i];
#if TIEREDKV_STREAMING
        /* Runs start at random places: the hardware prefetcher only catches on a few lines
         * into each one. Ask for the start of the next run while this one is copied. */
        if (i + 1 < count) {
            const char *next = segments[i + 1].src;
            size_t ahead = segments[i + 1].n < PREFETCH_BYTES ? segments[i + 1].n : PREFETCH_BYTES;
            for (size_t off = 0; off < ahead; off += 64)
                _mm_prefetch(next + off, _MM_HINT_T0);
        }
        if (nontemporal && s.n >= STREAM_MIN_BYTES) {
            stream_copy(s.dst, s.src, s.n);
            streamed = 1;
            continue;
        }
#endif
        memcpy(s.dst, s.src, s.n);
    }
#if TIEREDKV_STREAMING
    /* Streaming stores are weakly ordered: fence so that whoever learns "copy done" after
     * this call (another thread, via a lock or a queue) sees every byte. */
    if (streamed)
        _mm_sfence();
#endif
    (void)streamed;
    Py_END_ALLOW_THREADS
    PyMem_RawFree(segments);
    PyBuffer_Release(&layers);
    PyBuffer_Release(&items);
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "a block or slot address falls outside its region; nothing was copied");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_blocks", copy_blocks, METH_VARARGS,
     "copy_blocks(layers, host_base, slot_bytes, items, to_host, nontemporal, bounds): copy "
     "every layer of each (slot, position, block) item between the device cache and host "
     "slots, merging adjacent runs, without the GIL. layers: int64 [dev_ptr, block_stride, "
     "block_bytes, slot_offset] per layer; bounds: (dev_lo, dev_hi, host_lo, host_hi)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tieredkv.transfer._rowcopy",
    "Native segment copies for tieredkv's CPU copy path.", -1, methods,
};

PyMODINIT_FUNC PyInit__rowcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", TIEREDKV_STREAMING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
