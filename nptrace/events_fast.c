/* nptrace.events_fast: events.decode_many's common record, compiled (issue #16 item 3).
 *
 * The same Events, in the same order, with the same bad count as the pure-Python loop in
 * nptrace/events.py (which stays the reference, and the fallback where this module is not
 * built; tests/unit/test_native_paths.py compares the two). A record the fast path does not
 * take (not bytes of exactly the record's size, another ABI, a conntrack entry, an outer
 * header, an ASYM_SRC) goes back to Python through `slow(buf)`, which returns the Event or
 * None for a bad record: the rare cases keep one implementation.
 *
 * The layout is not written here: configure() receives each field's (offset, size) from the
 * ctypes mirror (events.RawEvent), which tests/unit/test_layout.py checks against
 * bpf/nptrace_events.h. Integers are read in host order, as the kernel wrote them (events.py
 * reads them little-endian; nptrace runs on little-endian nodes, x86-64 and arm64).
 *
 * Addresses: a 16-byte field becomes its text through inet_ntop, the libc call behind
 * socket.inet_ntop, kept in a bounded cache per family as the Python loop keeps its dicts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <arpa/inet.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#define NFIELDS 36
/* positions in RECORD.unpack's tuple (events.FIELDS) */
enum { F_TS, F_SKB, F_IFINDEX, F_TYPE, F_ABI, F_LOCATION, F_NETNS, F_REASON, F_CTSTATUS,
       F_MARK, F_SADDR, F_DADDR, F_SPORT, F_DPORT, F_FAMILY, F_L4PROTO, F_TCPFLAGS, F_HOOK,
       F_DIR, F_STATE, F_FLAGS, F_AUX, F_VNI = 32, F_SEQ, F_ACKSEQ, F_AUX2 };

#define CACHE_SLOTS 16384          /* open addressing, at most half full */
#define CACHE_MAX 8192             /* events._ADDRS_MAX: emptied when full */

struct addr_slot {
	unsigned char key[16];
	PyObject *text;            /* NULL: empty */
};

struct addr_cache {
	struct addr_slot slot[CACHE_SLOTS];
	Py_ssize_t used;
};

static struct {
	Py_ssize_t off[NFIELDS], size[NFIELDS], record;
	long abi, rare_mask, asym_src, af_inet, af_inet6;
	PyObject *event_type;      /* events.Event */
	PyObject *af_inet_obj;     /* socket.AF_INET: a record's family 0 reads as it */
	PyObject *types[256], *hooks[256], *dirs[256];   /* borrowed from the enums' dicts */
	PyObject *keep;            /* the dicts the tables borrow from, kept alive */
	struct addr_cache v4, v6;
	int ready;
} S;

static uint64_t field(const unsigned char *p, int i)
{
	uint64_t v = 0;
	memcpy(&v, p + S.off[i], (size_t)S.size[i]);   /* little-endian host: the low bytes */
	return v;
}

static void cache_clear(struct addr_cache *c)
{
	for (Py_ssize_t i = 0; i < CACHE_SLOTS; i++)
		Py_CLEAR(c->slot[i].text);
	c->used = 0;
}

static uint64_t hash16(const unsigned char *k)
{
	uint64_t a, b;
	memcpy(&a, k, 8);
	memcpy(&b, k + 8, 8);
	uint64_t h = (a ^ (b * 0x9E3779B97F4A7C15ULL)) * 0xC2B2AE3D27D4EB4FULL;
	return h ^ (h >> 29);
}

/* New reference to the text of a 16-byte address field of `family`. */
static PyObject *addr_text(int family, const unsigned char *raw)
{
	struct addr_cache *c = family == S.af_inet6 ? &S.v6 : &S.v4;
	uint64_t i = hash16(raw) & (CACHE_SLOTS - 1);
	for (;;) {
		struct addr_slot *s = &c->slot[i];
		if (s->text == NULL)
			break;
		if (memcmp(s->key, raw, 16) == 0) {
			Py_INCREF(s->text);
			return s->text;
		}
		i = (i + 1) & (CACHE_SLOTS - 1);
	}
	char buf[INET6_ADDRSTRLEN];
	if (inet_ntop(family == S.af_inet6 ? AF_INET6 : AF_INET, raw, buf, sizeof buf) == NULL)
		return PyErr_SetFromErrno(PyExc_OSError);
	PyObject *text = PyUnicode_FromString(buf);
	if (text == NULL)
		return NULL;
	if (c->used >= CACHE_MAX) {
		cache_clear(c);
		i = hash16(raw) & (CACHE_SLOTS - 1);
	}
	while (c->slot[i].text != NULL)
		i = (i + 1) & (CACHE_SLOTS - 1);
	memcpy(c->slot[i].key, raw, 16);
	Py_INCREF(text);
	c->slot[i].text = text;
	c->used++;
	return text;
}

static int table(PyObject *dict, PyObject **out)
{
	PyObject *k, *v;
	Py_ssize_t pos = 0;
	memset(out, 0, 256 * sizeof *out);
	while (PyDict_Next(dict, &pos, &k, &v)) {
		long i = PyLong_AsLong(k);
		if (i == -1 && PyErr_Occurred())
			return -1;
		if (i >= 0 && i < 256)
			out[i] = v;
	}
	return 0;
}

/* configure(layout, record_size, abi, rare_mask, asym_src, af_inet, af_inet6, Event,
 *           types, hooks, dirs): layout is NFIELDS (offset, size) pairs. */
static PyObject *configure(PyObject *self, PyObject *args)
{
	PyObject *layout, *event_type, *types, *hooks, *dirs;
	Py_ssize_t record;
	long abi, rare, asym, af4, af6;
	if (!PyArg_ParseTuple(args, "O!nlllllO!O!O!O!", &PyTuple_Type, &layout, &record, &abi,
			      &rare, &asym, &af4, &af6, &PyType_Type, &event_type,
			      &PyDict_Type, &types, &PyDict_Type, &hooks, &PyDict_Type, &dirs))
		return NULL;
	if (PyTuple_GET_SIZE(layout) != NFIELDS) {
		PyErr_SetString(PyExc_ValueError, "layout: wrong number of fields");
		return NULL;
	}
	for (int i = 0; i < NFIELDS; i++) {
		Py_ssize_t off, size;
		if (!PyArg_ParseTuple(PyTuple_GET_ITEM(layout, i), "nn", &off, &size))
			return NULL;
		if (off < 0 || size < 1 || off + size > record || (size > 8 && size != 16)) {
			PyErr_SetString(PyExc_ValueError, "layout: field out of the record");
			return NULL;
		}
		S.off[i] = off;
		S.size[i] = size;
	}
	if (S.size[F_SADDR] != 16 || S.size[F_DADDR] != 16) {
		PyErr_SetString(PyExc_ValueError, "layout: addresses are not 16 bytes");
		return NULL;
	}
	if (table(types, S.types) || table(hooks, S.hooks) || table(dirs, S.dirs))
		return NULL;
	PyObject *af_obj = PyTuple_GET_ITEM(args, 5);
	PyObject *keep = PyTuple_Pack(5, types, hooks, dirs, event_type, af_obj);
	if (keep == NULL)
		return NULL;
	Py_XSETREF(S.keep, keep);
	S.event_type = event_type;
	S.af_inet_obj = af_obj;
	S.record = record;
	S.abi = abi;
	S.rare_mask = rare;
	S.asym_src = asym;
	S.af_inet = af4;
	S.af_inet6 = af6;
	cache_clear(&S.v4);
	cache_clear(&S.v6);
	S.ready = 1;
	Py_RETURN_NONE;
}

static PyObject *u64(uint64_t v)
{
	return PyLong_FromUnsignedLongLong(v);
}

/* The Event of a common record, or NULL with an exception set. */
static PyObject *event_of(PyObject *buf, const unsigned char *p, PyObject *typ_e,
			  PyObject *hook_e, PyObject *dir_e, long family, int family_default)
{
	PyTypeObject *tp = (PyTypeObject *)S.event_type;
	PyObject *e = tp->tp_alloc(tp, 28);
	if (e == NULL)
		return NULL;
	PyObject *saddr = addr_text((int)family, p + S.off[F_SADDR]);
	PyObject *daddr = saddr ? addr_text((int)family, p + S.off[F_DADDR]) : NULL;
	if (daddr == NULL) {
		Py_XDECREF(saddr);
		Py_DECREF(e);
		return NULL;
	}
	/* the order of events.Event's fields (decode_many's tuple) */
	PyObject *items[28] = {
		u64(field(p, F_TS)), typ_e, hook_e, dir_e, u64(field(p, F_SKB)),
		u64(field(p, F_IFINDEX)), u64(field(p, F_NETNS)), u64(field(p, F_REASON)), saddr,
		u64(field(p, F_SPORT)), daddr, u64(field(p, F_DPORT)),
		family_default ? Py_NewRef(S.af_inet_obj) : PyLong_FromLong(family),
		u64(field(p, F_L4PROTO)), u64(field(p, F_TCPFLAGS)), u64(field(p, F_STATE)),
		u64(field(p, F_FLAGS)), u64(field(p, F_MARK)), u64(field(p, F_AUX)),
		u64(field(p, F_AUX2)), u64(field(p, F_SEQ)), u64(field(p, F_ACKSEQ)),
		u64(field(p, F_LOCATION)), Py_None, Py_None, Py_None, u64(field(p, F_VNI)), buf,
	};
	Py_INCREF(typ_e);
	Py_INCREF(hook_e);
	Py_INCREF(dir_e);
	Py_INCREF(Py_None);
	Py_INCREF(Py_None);
	Py_INCREF(Py_None);
	Py_INCREF(buf);
	int failed = 0;
	for (int i = 0; i < 28; i++) {
		if (items[i] == NULL)
			failed = 1;
		PyTuple_SET_ITEM(e, i, items[i]);   /* a NULL item is skipped by the dealloc */
	}
	if (failed) {
		Py_DECREF(e);
		return NULL;
	}
	return e;
}

/* decode_many(bufs, slow) -> (events, bad) */
static PyObject *decode_many(PyObject *self, PyObject *args)
{
	PyObject *bufs, *slow;
	if (!PyArg_ParseTuple(args, "OO", &bufs, &slow))
		return NULL;
	if (!S.ready) {
		PyErr_SetString(PyExc_RuntimeError, "configure() first");
		return NULL;
	}
	PyObject *seq = PySequence_Fast(bufs, "decode_many: a sequence of records");
	if (seq == NULL)
		return NULL;
	Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), bad = 0;
	PyObject *out = PyList_New(0);
	if (out == NULL)
		goto fail;
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *buf = PySequence_Fast_GET_ITEM(seq, i), *e = NULL;
		if (PyBytes_CheckExact(buf) && PyBytes_GET_SIZE(buf) == S.record) {
			const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(buf);
			uint64_t typ = field(p, F_TYPE);
			if ((long)field(p, F_ABI) == S.abi && !(field(p, F_FLAGS) & S.rare_mask)
			    && (long)typ != S.asym_src) {
				uint64_t hook = field(p, F_HOOK), dir = field(p, F_DIR);
				PyObject *te = typ < 256 ? S.types[typ] : NULL;
				PyObject *he = hook < 256 ? S.hooks[hook] : NULL;
				PyObject *de = dir < 256 ? S.dirs[dir] : NULL;
				if (te == NULL || he == NULL || de == NULL) {
					bad++;
					continue;
				}
				/* events.py: `family or AF_INET` (the enum member) */
				long family = (long)field(p, F_FAMILY);
				int family_default = family == 0;
				if (family_default)
					family = S.af_inet;
				e = event_of(buf, p, te, he, de, family, family_default);
				if (e == NULL)
					goto fail;
				goto got;
			}
		}
		e = PyObject_CallOneArg(slow, buf);
		if (e == NULL)
			goto fail;
		if (e == Py_None) {
			Py_DECREF(e);
			bad++;
			continue;
		}
got:
		if (PyList_Append(out, e) < 0) {
			Py_DECREF(e);
			goto fail;
		}
		Py_DECREF(e);
	}
	Py_DECREF(seq);
	PyObject *res = Py_BuildValue("(Nn)", out, bad);
	return res;
fail:
	Py_XDECREF(out);
	Py_DECREF(seq);
	return NULL;
}

static PyMethodDef methods[] = {
	{"configure", configure, METH_VARARGS, "Take the record layout and the enum tables."},
	{"decode_many", decode_many, METH_VARARGS, "(events, bad) of a batch of records."},
	{NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
	PyModuleDef_HEAD_INIT, "nptrace.events_fast",
	"events.decode_many's common record, compiled (nptrace/events_fast.c).", -1, methods,
};

PyMODINIT_FUNC PyInit_events_fast(void)
{
	return PyModule_Create(&module);
}
