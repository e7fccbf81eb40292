/* The NVMe tier's restart scan of one top-level fan-out directory, in C (tiers/stores/nvme/index.py).
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

static PyMethodDef methods[] = {
    {"trim", trim, METH_NOARGS, "trim() -> True when memory went back to the system (malloc_trim)"},
    {"scan_top", scan_top, METH_VARARGS,
     "scan_top(path, top, header_size) -> (records, leaves, temps, torn, foreign): one top fan-out directory"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "tiers._chunkscan", .m_size = -1,
                                    .m_methods = methods};

PyMODINIT_FUNC PyInit__chunkscan(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "RECORD_BYTES", sizeof(scanned_t)) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
