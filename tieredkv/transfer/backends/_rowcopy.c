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
 * leave the device cache, the host pool or its own slot: a bad id must never become a wild
 * write. That holds here by itself, not because the Python caller checked first: every id is
 * range-checked against the counts the caller passes (device blocks, host slots, chunk
 * positions) before it is multiplied, and every address is formed with overflow-checked
 * arithmetic, so a huge id cannot wrap around to a plausible address.
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

/* The table's own sizes, when the caller passes them: every id is range-checked against
 * these before any address is formed from it. */
typedef struct {
    int known;
    int64_t num_blocks, num_slots, chunk_blocks;
} table_counts;

/* What the planner refused, kept until the GIL is held again to raise it. */
enum { PLAN_OK, BAD_BLOCK, BAD_SLOT, BAD_POSITION, BAD_LAYER, OUT_OF_REGION };

typedef struct {
    int why;
    Py_ssize_t item, layer;
    int64_t slot, pos, block;
} plan_error;

/* Checked int64 arithmetic on nonnegative values: -1 for a negative operand or a result that
 * does not fit, and -1 propagates. Addresses are formed only through these, because a huge id
 * must be refused rather than wrapped to a plausible address: (2^52 + 2) * 4096 wraps to
 * 8192, two blocks past the base, well inside the region the bounds describe. */
static int64_t checked_add(int64_t a, int64_t b)
{
    if (a < 0 || b < 0 || a > INT64_MAX - b)
        return -1;
    return a + b;
}

static int64_t checked_mul(int64_t a, int64_t b)
{
    if (a < 0 || b < 0)
        return -1;
#if defined(__GNUC__) || defined(__clang__)
    int64_t r;
    /* One multiply and a flag test: this runs for every (layer, item) pair. */
    return __builtin_mul_overflow(a, b, &r) ? -1 : r;
#else
    if (b != 0 && a > INT64_MAX / b)
        return -1;
    return a * b;
#endif
}

static Py_ssize_t refuse(plan_error *err, int why, Py_ssize_t item, Py_ssize_t layer,
                         const int64_t *triple)
{
    err->why = why;
    err->item = item;
    err->layer = layer;
    if (triple != NULL) {
        err->slot = triple[0];
        err->pos = triple[1];
        err->block = triple[2];
    }
    return -1;
}

/* Fill `out` with the byte runs for `items`, layer-major, merging runs adjacent on both
 * sides. Returns the number of runs, or -1 (with `err` set) if any id is out of range or any
 * run would leave its region; nothing is copied until the whole table has passed. */
static Py_ssize_t plan_segments(const int64_t *layers, Py_ssize_t num_layers, int64_t host_base,
                                int64_t slot_bytes, const int64_t *items, Py_ssize_t num_items,
                                int to_host, const int64_t *bounds, const table_counts *counts,
                                segment *out, plan_error *err)
{
    /* Ids first, each against its own count, before any of them is multiplied: the address
     * checks below catch a run that leaves the device cache or the pool, but not a position
     * past chunk_blocks that lands in the next layer's part of the same slot, nor one in
     * range for the pool but in a slot the caller does not own. */
    for (Py_ssize_t i = 0; i < num_items; i++) {
        const int64_t *t = items + 3 * i;
        const int64_t slot = t[0], pos = t[1], block = t[2];
        if (!counts->known) {
            if (slot < 0 || pos < 0 || block < 0)
                return refuse(err, OUT_OF_REGION, i, -1, t);
            continue;
        }
        if (block < 0 || block >= counts->num_blocks)
            return refuse(err, BAD_BLOCK, i, -1, t);
        if (slot < 0 || slot >= counts->num_slots)
            return refuse(err, BAD_SLOT, i, -1, t);
        if (pos < 0 || pos >= counts->chunk_blocks)
            return refuse(err, BAD_POSITION, i, -1, t);
    }
    Py_ssize_t count = 0;
    for (Py_ssize_t l = 0; l < num_layers; l++) {
        const int64_t dev_ptr = layers[4 * l], dev_stride = layers[4 * l + 1];
        const int64_t block_bytes = layers[4 * l + 2], host_offset = layers[4 * l + 3];
        /* The layer table is the caller's too: a zero or negative size or offset would turn
         * the comparisons below around. */
        if (dev_ptr < 0 || dev_stride < 0 || block_bytes <= 0 || host_offset < 0 ||
            block_bytes > slot_bytes)
            return refuse(err, BAD_LAYER, -1, l, NULL);
        for (Py_ssize_t i = 0; i < num_items; i++) {
            const int64_t *t = items + 3 * i;
            const int64_t slot = t[0], pos = t[1], block = t[2];
            const int64_t dev = checked_add(dev_ptr, checked_mul(block, dev_stride));
            const int64_t in_slot = checked_add(host_offset, checked_mul(pos, block_bytes));
            const int64_t host =
                checked_add(checked_add(host_base, checked_mul(slot, slot_bytes)), in_slot);
            const int64_t dev_end = checked_add(dev, block_bytes);
            const int64_t host_end = checked_add(host, block_bytes);
            /* Besides the regions, a run must stay inside its own slot: the pool's bounds
             * alone would let a bad position write into the neighbouring slot. */
            if (dev_end < 0 || host_end < 0 || in_slot > slot_bytes - block_bytes ||
                dev < bounds[0] || dev_end > bounds[1] || host < bounds[2] ||
                host_end > bounds[3])
                return refuse(err, OUT_OF_REGION, i, l, t);
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

static void raise_refusal(const plan_error *err, const table_counts *counts)
{
    const long long slot = err->slot, pos = err->pos, block = err->block;
    switch (err->why) {
    case BAD_BLOCK:
        PyErr_Format(PyExc_ValueError,
                     "item %zd: device block id %lld out of range 0..%lld; nothing was copied",
                     err->item, block, (long long)counts->num_blocks - 1);
        break;
    case BAD_SLOT:
        PyErr_Format(PyExc_ValueError,
                     "item %zd: host slot %lld out of range 0..%lld; nothing was copied",
                     err->item, slot, (long long)counts->num_slots - 1);
        break;
    case BAD_POSITION:
        PyErr_Format(PyExc_ValueError,
                     "item %zd: position %lld out of range 0..%lld of a chunk; nothing was "
                     "copied",
                     err->item, pos, (long long)counts->chunk_blocks - 1);
        break;
    case BAD_LAYER:
        PyErr_Format(PyExc_ValueError,
                     "layer %zd: [dev_ptr, block_stride, block_bytes, slot_offset] must be "
                     "nonnegative, with 0 < block_bytes <= slot_bytes; nothing was copied",
                     err->layer);
        break;
    default:
        PyErr_Format(PyExc_ValueError,
                     "item %zd (slot %lld, position %lld, block %lld): a block or slot address "
                     "falls outside its region; nothing was copied",
                     err->item, slot, pos, block);
        break;
    }
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
    PyObject *layers_obj, *items_obj, *counts_obj = Py_None;
    long long host_base, slot_bytes, bounds[4];
    int to_host, nontemporal;
    if (!PyArg_ParseTuple(args, "OLLOpp(LLLL)|O", &layers_obj, &host_base, &slot_bytes,
                          &items_obj, &to_host, &nontemporal, &bounds[0], &bounds[1], &bounds[2],
                          &bounds[3], &counts_obj))
        return NULL;
    table_counts counts = {0, 0, 0, 0};
    if (counts_obj != Py_None) {
        long long nb, ns, cb;
        PyObject *seq = PySequence_Tuple(counts_obj);
        if (seq == NULL)
            return NULL;
        const int ok = PyArg_ParseTuple(seq, "LLL;counts must be (num_blocks, num_slots, "
                                             "chunk_blocks)", &nb, &ns, &cb);
        Py_DECREF(seq);
        if (!ok)
            return NULL;
        if (nb < 0 || ns < 0 || cb < 0) {
            PyErr_SetString(PyExc_ValueError, "counts must be nonnegative");
            return NULL;
        }
        counts = (table_counts){1, nb, ns, cb};
    }
    /* Checked here, not per run: every address below is formed from these. */
    if (host_base < 0 || slot_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "host_base must be >= 0 and slot_bytes > 0");
        return NULL;
    }
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
    if (num_layers > 0 && num_items > 0) {
        /* The run table's size is a product of two caller-given lengths, so it is checked
         * like the addresses are. */
        if (num_items > (Py_ssize_t)(PY_SSIZE_T_MAX / sizeof(segment)) / num_layers) {
            PyBuffer_Release(&layers);
            PyBuffer_Release(&items);
            return PyErr_NoMemory();
        }
        segments = PyMem_RawMalloc((size_t)(num_layers * num_items) * sizeof(segment));
        if (segments == NULL) {
            PyBuffer_Release(&layers);
            PyBuffer_Release(&items);
            return PyErr_NoMemory();
        }
    }
    Py_ssize_t count = 0;
    int streamed = 0;
    plan_error err = {PLAN_OK, -1, -1, 0, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    /* Planned even with no layers: a bad id is refused whatever else the table holds. */
    if (num_items > 0)
        count = plan_segments((const int64_t *)layers.buf, num_layers, host_base, slot_bytes,
                              (const int64_t *)items.buf, num_items, to_host, limits, &counts,
                              segments, &err);
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
        raise_refusal(&err, &counts);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_blocks", copy_blocks, METH_VARARGS,
     "copy_blocks(layers, host_base, slot_bytes, items, to_host, nontemporal, bounds, "
     "counts=None): copy every layer of each (slot, position, block) item between the device "
     "cache and host slots, merging adjacent runs, without the GIL. layers: int64 "
     "[dev_ptr, block_stride, block_bytes, slot_offset] per layer; bounds: (dev_lo, dev_hi, "
     "host_lo, host_hi); counts: (num_blocks, num_slots, chunk_blocks), against which every "
     "id is range-checked. Raises ValueError, having copied nothing, if any item is out of "
     "range or any run would leave its region or its slot."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tieredkv.transfer.backends._rowcopy",
    "Native segment copies for tieredkv's CPU copy path.", -1, methods,
};

PyMODINIT_FUNC PyInit__rowcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    /* API_VERSION 2: copy_blocks takes `counts`. The Python side checks it, so that a stale
     * build is reported as one instead of failing on its first copy. */
    if (m != NULL && (PyModule_AddIntConstant(m, "STREAMING", TIEREDKV_STREAMING) < 0 ||
                      PyModule_AddIntConstant(m, "API_VERSION", 2) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
