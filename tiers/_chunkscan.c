/* The NVMe tier's chunk files in C: the restart scan of one top-level fan-out directory
 * (tiers/stores/nvme/index.py), and the record headers of a part of a batch put (pack_headers below).
 *
 * After a crash the index is rebuilt from file names: a million chunks are a
 * million directory entries and a million stat calls.  In Python each cost a
 * tuple, a path string and several ints (~20 bytes a chunk left behind in the
 * heap) and held the GIL between the system calls; here the walk of a top
 * directory's 256 leaves runs without the GIL and hands back one packed
 * 32-byte record a chunk: digest (low, high 64 bits), namespace hash, on-disk
 * size, mtime in seconds.  Temp files and torn files are named for the
 * caller to remove; foreign files are counted and left alone.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <malloc.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

typedef struct { uint64_t lo, hi, ns; uint32_t size, mtime, file, block; } scanned_t; /* 40 bytes; file, block: 0 */

typedef struct { char *data; size_t len, cap; } grow_t;

static int append(grow_t *g, const void *p, size_t n) {
    if (g->len + n > g->cap) {
        size_t cap = g->cap ? g->cap * 2 : 4096;
        while (cap < g->len + n) cap *= 2;
        char *d = realloc(g->data, cap);
        if (!d) return -1;
        g->data = d;
        g->cap = cap;
    }
    memcpy(g->data + g->len, p, n);
    g->len += n;
    return 0;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

static int hex64(const char *s, uint64_t *out) {
    uint64_t v = 0;
    for (int i = 0; i < 16; i++) {
        int d = hexval(s[i]);
        if (d < 0) return -1;
        v = (v << 4) | (uint64_t)d;
    }
    *out = v;
    return 0;
}

/* "<16 hex>-<32 hex>.kv" (tiers/stores/nvme/layout.py file_name) */
static int parse_name(const char *name, uint64_t *ns, uint64_t *hi, uint64_t *lo) {
    if (strlen(name) != 52 || name[16] != '-' || strcmp(name + 49, ".kv") != 0) return -1;
    return hex64(name, ns) || hex64(name + 17, hi) || hex64(name + 33, lo) ? -1 : 0;
}

static int is_temp(const char *name) {
    size_t n = strlen(name);
    return name[0] == '.' && n > 4 && strcmp(name + n - 4, ".tmp") == 0;
}

static int two_hex(const char *name, int *value) {
    if (strlen(name) != 2) return -1;
    int a = hexval(name[0]), b = hexval(name[1]);
    if (a < 0 || b < 0) return -1;
    *value = a * 16 + b;
    return 0;
}

/* Paths as NUL-separated strings (temps, torn) into g. */
static int add_path(grow_t *g, const char *dir, const char *name) {
    return append(g, dir, strlen(dir)) || append(g, "/", 1) || append(g, name, strlen(name) + 1);
}

static PyObject *paths_list(const grow_t *g) {
    PyObject *out = PyList_New(0);
    for (size_t at = 0; out && at < g->len;) {
        size_t n = strlen(g->data + at);
        PyObject *s = PyUnicode_DecodeFSDefaultAndSize(g->data + at, (Py_ssize_t)n);
        if (!s || PyList_Append(out, s) < 0) { Py_XDECREF(s); Py_CLEAR(out); break; }
        Py_DECREF(s);
        at += n + 1;
    }
    return out;
}

/* scan_top(path, top, header_size) -> (records, leaves, temps, torn, foreign)
   records: 40 bytes a chunk; leaves: the leaf numbers found (uint16 each, low byte = top);
   temps and torn: paths for the caller to remove; foreign: files that are not ours (left alone). */
static PyObject *scan_top(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *path_obj;
    int top;
    unsigned long long header_size;
    if (!PyArg_ParseTuple(args, "O&iK", PyUnicode_FSConverter, &path_obj, &top, &header_size)) return NULL;
    const char *root = PyBytes_AS_STRING(path_obj);
    grow_t records = {0}, leaves = {0}, temps = {0}, torn = {0};
    long foreign = 0;
    int failed = 0, err = 0;
    Py_BEGIN_ALLOW_THREADS
    DIR *d = opendir(root);
    if (!d) { failed = 1; err = errno; }
    struct dirent *e;
    while (!failed && (e = readdir(d)) != NULL) {
        int second;
        if (two_hex(e->d_name, &second) < 0) continue;
        char leaf[4096];
        if (snprintf(leaf, sizeof leaf, "%s/%s", root, e->d_name) >= (int)sizeof leaf) continue;
        struct stat st;
        if (lstat(leaf, &st) < 0 || !S_ISDIR(st.st_mode)) continue;
        uint16_t number = (uint16_t)((second << 8) | top); /* the low 16 digest bits that select this leaf */
        if (append(&leaves, &number, sizeof number)) { failed = 1; break; }
        int fd = open(leaf, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0) continue;
        DIR *ld = fdopendir(fd);
        if (!ld) { close(fd); continue; }
        struct dirent *f;
        while ((f = readdir(ld)) != NULL) {
            const char *name = f->d_name;
            if (!strcmp(name, ".") || !strcmp(name, "..")) continue;
            if (is_temp(name)) { if (add_path(&temps, leaf, name)) failed = 1; continue; }
            uint64_t ns, hi, lo;
            if (parse_name(name, &ns, &hi, &lo) < 0) { foreign++; continue; }
            if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue; /* gone meanwhile */
            if (!S_ISREG(st.st_mode) || (unsigned long long)st.st_size > 0xFFFFFFFFull) { foreign++; continue; }
            /* Too short for a header, or moved out of its fan-out directory: never servable. */
            if ((unsigned long long)st.st_size < header_size || (lo & 0xFFFF) != number) {
                if (add_path(&torn, leaf, name)) failed = 1;
                continue;
            }
            scanned_t r = {lo, hi, ns, (uint32_t)st.st_size, (uint32_t)st.st_mtim.tv_sec, 0, 0};
            if (append(&records, &r, sizeof r)) { failed = 1; break; }
        }
        closedir(ld);
    }
    if (d) closedir(d);
    Py_END_ALLOW_THREADS
    Py_DECREF(path_obj);
    PyObject *out = NULL;
    if (failed && err) {
        errno = err;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, root);
    } else if (failed) {
        PyErr_NoMemory();
    } else {
        PyObject *t = paths_list(&temps), *b = t ? paths_list(&torn) : NULL;
        if (b)
            out = Py_BuildValue("(y#y#NNl)", records.data ? records.data : "", (Py_ssize_t)records.len,
                                leaves.data ? leaves.data : "", (Py_ssize_t)leaves.len, t, b, foreign);
        else
            Py_XDECREF(t);
    }
    free(records.data); free(leaves.data); free(temps.data); free(torn.data);
    return out;
}

/* trim(): give the C heap's free pages back to the system (the scan's threads leave their buffers' pages
   in their malloc arenas: ~5 bytes a chunk of resident memory that nothing uses). */
static PyObject *trim(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    int released;
    Py_BEGIN_ALLOW_THREADS
    released = malloc_trim(0);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(released);
}


/* The chunk header (tiers/stores/nvme/chunkfile.py): "<8sHBBIHHIQQQ" at 0, namespace then key at 48, the
   writer's page checksum at 4080, xxh3_64 of bytes 0..4087 at 4088. */
#define HDR_SIZE 4096
#define HDR_NAMES_AT 48
#define HDR_PAGE_SUM_AT (HDR_SIZE - 16)
#define HDR_SUM_AT (HDR_SIZE - 8)

static void put16(unsigned char *p, uint16_t v) { memcpy(p, &v, 2); } /* little-endian hosts only (x86, arm64) */
static void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }

/* pack_headers(blocks, namespace, keys, raw_lens, payload_sums, writer_sums) -> [digest, ...]: the header of
   each raw (uncompressed) page of a part, block k of blocks for keys[k], and each page's key digest
   (xxh3_128 of namespace, NUL, key: tiers/wire/protocol.py key_digest).  The arrays are uint64, one a key.
   ValueError (nothing to trust in blocks) when a namespace and key do not fit a header: the caller refuses
   the file's pages (the protocol's limits on namespaces and keys keep them far below it).  The Python path did ~3 us of struct packing,
   hashing and a dataclass a page; a part of 64 pages is one call. */
static PyObject *pack_headers(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer blocks, ns, raw, sums, writer;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "w*y*O!y*y*y*", &blocks, &ns, &PyList_Type, &keys, &raw, &sums, &writer))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (blocks.len < n * HDR_SIZE || raw.len != n * 8 || sums.len != n * 8 || writer.len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "pack_headers: a 4 KiB block and three uint64 values a key");
        goto done;
    }
    if (ns.len > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "namespace too long for the header");
        goto done;
    }
    out = PyList_New(n);
    if (!out) goto done;
    char name[HDR_PAGE_SUM_AT];
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t key_len;
        const char *key = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(keys, k), &key_len);
        if (!key) goto fail;
        if (HDR_NAMES_AT + ns.len + key_len > HDR_PAGE_SUM_AT || key_len > 0xFFFF) {
            PyErr_SetString(PyExc_ValueError, "namespace and key too long for the header");
            goto fail;
        }
        uint64_t raw_len, payload_sum, writer_sum;
        memcpy(&raw_len, (const char *)raw.buf + 8 * k, 8);
        memcpy(&payload_sum, (const char *)sums.buf + 8 * k, 8);
        memcpy(&writer_sum, (const char *)writer.buf + 8 * k, 8);
        unsigned char *h = (unsigned char *)blocks.buf + k * HDR_SIZE;
        memset(h, 0, HDR_SIZE);
        memcpy(h, "HCKVCHNK", 8);
        put16(h + 8, 1);                     /* format version */
        h[10] = 0;                           /* codec: none */
        h[11] = writer_sum ? 1 : 0;          /* FLAG_PAGE_SUM */
        put32(h + 12, HDR_SIZE);
        put16(h + 16, (uint16_t)ns.len);
        put16(h + 18, (uint16_t)key_len);
        put64(h + 24, raw_len);
        put64(h + 32, raw_len);              /* payload length: raw */
        put64(h + 40, payload_sum);
        memcpy(h + HDR_NAMES_AT, ns.buf, ns.len);
        memcpy(h + HDR_NAMES_AT + ns.len, key, key_len);
        put64(h + HDR_PAGE_SUM_AT, writer_sum);
        put64(h + HDR_SUM_AT, XXH3_64bits(h, HDR_SUM_AT));
        /* the digest: namespace, NUL, key */
        memcpy(name, ns.buf, ns.len);
        name[ns.len] = 0;
        memcpy(name + ns.len + 1, key, key_len);
        XXH128_hash_t d = XXH3_128bits(name, ns.len + 1 + key_len);
        PyObject *hi = PyLong_FromUnsignedLongLong(d.high64), *sixty_four = hi ? PyLong_FromLong(64) : NULL;
        PyObject *shifted = sixty_four ? PyNumber_Lshift(hi, sixty_four) : NULL;
        PyObject *lo = shifted ? PyLong_FromUnsignedLongLong(d.low64) : NULL;
        PyObject *digest = lo ? PyNumber_Or(shifted, lo) : NULL;
        Py_XDECREF(hi); Py_XDECREF(sixty_four); Py_XDECREF(shifted); Py_XDECREF(lo);
        if (!digest) goto fail;
        PyList_SET_ITEM(out, k, digest);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyBuffer_Release(&blocks); PyBuffer_Release(&ns); PyBuffer_Release(&raw); PyBuffer_Release(&sums);
    PyBuffer_Release(&writer);
    return out;
}

static PyMethodDef methods[] = {
    {"trim", trim, METH_NOARGS, "trim() -> True when memory went back to the system (malloc_trim)"},
    {"scan_top", scan_top, METH_VARARGS,
     "scan_top(path, top, header_size) -> (records, leaves, temps, torn, foreign): one top fan-out directory"},
    {"pack_headers", pack_headers, METH_VARARGS,
     "pack_headers(blocks, namespace, keys, raw_lens, payload_sums, writer_sums) -> digests: a part's headers"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "tiers._chunkscan", .m_size = -1,
                                    .m_methods = methods};

PyMODINIT_FUNC PyInit__chunkscan(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "RECORD_BYTES", sizeof(scanned_t)) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
