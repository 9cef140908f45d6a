/* nptrace.sinks.jsonl_fast: jsonl.verdict_line's one-event line, compiled (issue #16 item 3).
 *
 * A storm's every line is a one-event incident; jsonl.py builds it from one template per key
 * (everything the line says but the time and the tuple) and formats seven values into it.
 * This module does the same, character for character, and the same Context lookup
 * (iface_name) in the same place; jsonl.py stays the reference and the fallback where this
 * module is not built (tests/unit/test_native_paths.py compares the two).
 *
 * one_line() returns None, having looked nothing up, for any verdict the template path does
 * not take (conntrack, an outer header, IPv6, pods, a NAT mapping, more than one event, a value
 * of an unexpected type): jsonl.py then writes it. So a session records the same lookups
 * whichever path wrote a line.
 *
 * The float: `repr((ts_ns + offset) / 1e9)`, i.e. the int sum converted to the nearest double
 * (as int / float does), divided, written as float.__repr__ does: jsonl_seconds.c.
 */
#include "jsonl_fast.h"
#include "../slots.h"
#include <string.h>

static struct {
	PyObject *lines;        /* jsonl._LINES: key -> (head, fields, mid, pre, post) */
	PyObject *template_fn;  /* jsonl._one_template(v, e, l, xiface, events, prefix) */
	PyObject *remember;     /* jsonl._remember(cache, key, value) */
	PyObject *esc;          /* json.encoder.encode_basestring_ascii */
	PyObject *no_ctx;       /* jsonl._NO_CTX */
	PyObject *verdict_line; /* jsonl.verdict_line: the other lines */
	PyObject *s_event, *s_labeled, *s_events, *s_ct, *s_outer_saddr, *s_saddr, *s_daddr,
		 *s_sport, *s_dport, *s_ts_ns, *s_netns, *s_ifindex, *s_hook, *s_confidence,
		 *s_pods, *s_natmap, *s_ctx, *s_iface_name, *s_kind, *s_direction, *s_reason,
		 *s_cause, *s_service, *s_iface, *s_hint;
	int ready;
	/* the last line's key and template, and lines' version when it was looked up: a storm's
	 * lines share one key, and an equal key in an unchanged dict finds the same template
	 * (same_key), without hashing 17 values again */
	PyObject *last_key, *last_tpl;
	uint64_t last_version;
} S;

/* Event and Labeled are named tuples: their fields by position (events.Event, verdict.Labeled) */
enum { E_TS = 0, E_HOOK = 2, E_IFINDEX = 5, E_NETNS = 6, E_SADDR = 8, E_SPORT = 9,
       E_DADDR = 10, E_DPORT = 11, E_CT = 23, E_OUTER_SADDR = 24, E_NFIELDS = 28 };
enum { L_EV = 0, L_RNAME = 1, L_CAUSE = 2, L_NFIELDS = 5 };

static int intern(PyObject **slot, const char *s)
{
	*slot = PyUnicode_InternFromString(s);
	return *slot ? 0 : -1;
}

/* configure(lines, template_fn, remember, esc, no_ctx, verdict_line) */
static PyObject *configure(PyObject *self, PyObject *args)
{
	PyObject *lines, *tfn, *rem, *esc, *noctx, *vl;
	if (!PyArg_ParseTuple(args, "O!OOOOO", &PyDict_Type, &lines, &tfn, &rem, &esc, &noctx, &vl))
		return NULL;
	Py_INCREF(lines); Py_XSETREF(S.lines, lines);
	Py_INCREF(tfn); Py_XSETREF(S.template_fn, tfn);
	Py_INCREF(rem); Py_XSETREF(S.remember, rem);
	Py_INCREF(esc); Py_XSETREF(S.esc, esc);
	Py_INCREF(noctx); Py_XSETREF(S.no_ctx, noctx);
	Py_INCREF(vl); Py_XSETREF(S.verdict_line, vl);
	if (!S.s_event && (intern(&S.s_event, "event") || intern(&S.s_labeled, "labeled")
	    || intern(&S.s_events, "events") || intern(&S.s_confidence, "confidence")
	    || intern(&S.s_pods, "pods") || intern(&S.s_natmap, "natmap")
	    || intern(&S.s_ctx, "ctx") || intern(&S.s_iface_name, "iface_name")
	    || intern(&S.s_kind, "kind") || intern(&S.s_direction, "direction")
	    || intern(&S.s_hook, "hook") || intern(&S.s_reason, "reason")
	    || intern(&S.s_cause, "cause") || intern(&S.s_service, "service")
	    || intern(&S.s_iface, "iface") || intern(&S.s_hint, "hint")))
		return NULL;
	Py_CLEAR(S.last_key);
	Py_CLEAR(S.last_tpl);
	S.ready = 1;
	Py_RETURN_NONE;
}

/* Verdict's slots (configure_verdict): a field read at its offset, not through
 * PyObject_GetAttr's type lookup (15 of them a line were ~2k instructions of a storm record) */
#define V_MAX 32
#define V_TABLE 64              /* open addressing by the name's address: V_MAX at most half full */
static struct {
	PyTypeObject *type;
	int n;
	PyObject *name[V_MAX];      /* interned */
	struct { PyObject *name; Py_ssize_t off; } at[V_TABLE];
} V;

static unsigned v_hash(PyObject *name)
{
	return (unsigned)(((uintptr_t)name >> 4) % V_TABLE);
}

static PyObject *configure_verdict(PyObject *self, PyObject *args)
{
	PyObject *type, *names;
	if (!PyArg_ParseTuple(args, "O!O!", &PyType_Type, &type, &PyTuple_Type, &names))
		return NULL;
	if (PyTuple_GET_SIZE(names) > V_MAX) {
		PyErr_SetString(PyExc_ValueError, "more Verdict slots than V_MAX");
		return NULL;
	}
	int n = 0;
	memset(V.at, 0, sizeof V.at);
	for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
		PyObject *f = PyTuple_GET_ITEM(names, i);
		const char *s = PyUnicode_CheckExact(f) ? PyUnicode_AsUTF8(f) : NULL;
		if (s == NULL) {
			if (!PyErr_Occurred())
				PyErr_SetString(PyExc_TypeError, "a Verdict slot name is not a str");
			return NULL;
		}
		Py_ssize_t off = slot_offset((PyTypeObject *)type, s);
		if (off < 0)
			return NULL;
		Py_INCREF(f);
		PyUnicode_InternInPlace(&f);
		Py_XSETREF(V.name[n], f);
		unsigned h = v_hash(f);
		while (V.at[h].name != NULL)
			h = (h + 1) % V_TABLE;
		V.at[h].name = f;
		V.at[h].off = off;
		n++;
	}
	Py_INCREF(type);
	Py_XSETREF(V.type, (PyTypeObject *)type);
	V.n = n;
	Py_RETURN_NONE;
}

/* getattr(v, name), name interned: a Verdict's slot directly (an unset one raises as
 * getattr does), anything else through PyObject_GetAttr */
PyObject *vget(PyObject *v, PyObject *name)
{
	if (Py_IS_TYPE(v, V.type))
		for (unsigned h = v_hash(name); V.at[h].name != NULL; h = (h + 1) % V_TABLE)
			if (V.at[h].name == name) {
				PyObject *x = *(PyObject **)((char *)v + V.at[h].off);
				if (x != NULL)
					return Py_NewRef(x);
				break;
			}
	return PyObject_GetAttr(v, name);
}

/* The ASCII bytes _esc changes: controls, '"', '\\', DEL (one table load a byte: addresses
 * are scanned twice a line) */
static const unsigned char ESCAPED[128] = {
	[0 ... 0x1f] = 1, ['"'] = 1, ['\\'] = 1, [0x7f] = 1,
};

/* An ASCII str that json writes as itself between quotes (an ASCII str's bytes are < 128). */
int plain_ascii(PyObject *s)
{
	if (!PyUnicode_IS_ASCII(s))
		return 0;
	const unsigned char *p = PyUnicode_1BYTE_DATA(s);
	Py_ssize_t n = PyUnicode_GET_LENGTH(s);
	for (Py_ssize_t i = 0; i < n; i++)
		if (ESCAPED[p[i]])
			return 0;
	return 1;
}

void put(struct line *l, const char *text, Py_ssize_t len)
{
	if (l->n == l->cap) {           /* finish() raises: more pieces than the caller planned */
		l->full = 1;
		return;
	}
	l->p[l->n].text = text;
	l->p[l->n].len = len;
	l->p[l->n].obj = NULL;
	l->n++;
	l->len += len;
}

void put_c(struct line *l, const char *text)
{
	put(l, text, (Py_ssize_t)strlen(text));
}

/* A str piece. Every fragment jsonl builds is ASCII (its encoder escapes to ASCII); any other
 * str makes finish() join the pieces as str objects instead of copying bytes. */
int put_s(struct line *l, PyObject *s)
{
	if (!PyUnicode_Check(s)) {
		PyErr_SetString(PyExc_TypeError, "a line fragment is not a str");
		return -1;
	}
	if (PyUnicode_IS_ASCII(s)) {
		put(l, (const char *)PyUnicode_1BYTE_DATA(s), PyUnicode_GET_LENGTH(s));
	} else {
		put(l, NULL, 0);
		l->ascii = 0;
	}
	if (!l->full)
		l->p[l->n - 1].obj = s;
	return 0;
}

int keep(struct line *l, PyObject *o)
{
	if (o == NULL)
		return -1;
	if (l->nown == LINE_OWN) {
		Py_DECREF(o);
		PyErr_SetString(PyExc_OverflowError, "a line keeps more strings than it can");
		return -1;
	}
	l->own[l->nown++] = o;
	return 0;
}

/* A str as json writes it: '"' s '"' for a plain one, else through the escaper. */
int put_esc(struct line *l, PyObject *s, char *quote)
{
	if (plain_ascii(s)) {
		put(l, quote, 1);
		put(l, (const char *)PyUnicode_1BYTE_DATA(s), PyUnicode_GET_LENGTH(s));
		put(l, quote, 1);
		return 0;
	}
	PyObject *e = PyObject_CallOneArg(S.esc, s);
	if (keep(l, e))
		return -1;
	return put_s(l, e);
}

void put_p(struct line *l, const struct piece *p)
{
	put(l, p->text, p->len);
	if (!l->full)
		l->p[l->n - 1].obj = p->obj;
}

/* An exact int as str(int) writes it: into buf when it fits 64 bits, else through str(). */
int decimal(PyObject *x, char *buf, struct piece *out, struct line *l)
{
	int overflow;
	long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
	if (v == -1 && PyErr_Occurred())
		return -1;
	out->obj = NULL;
	if (overflow) {
		PyObject *s = PyObject_Str(x);
		if (keep(l, s))
			return -1;
		out->text = (const char *)PyUnicode_1BYTE_DATA(s);   /* digits: ASCII */
		out->len = PyUnicode_GET_LENGTH(s);
		out->obj = s;
		return 0;
	}
	char tmp[24];
	int n = 0;
	unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
	do {
		tmp[n++] = (char)('0' + u % 10);
		u /= 10;
	} while (u);
	int k = 0;
	if (v < 0)
		buf[k++] = '-';
	while (n)
		buf[k++] = tmp[--n];
	out->text = buf;
	out->len = k;
	return 0;
}

/* _esc(f"{sa}:{sp} > {da}:{dp}"), its pieces in the line: sp and dp already decimal */
int put_detail(struct line *ln, PyObject *sa, const struct piece *sp, PyObject *da,
	       const struct piece *dp, PyObject *spo, PyObject *dpo, char *quote)
{
	if (plain_ascii(sa) && plain_ascii(da)) {
		put(ln, quote, 1);
		put(ln, (const char *)PyUnicode_1BYTE_DATA(sa), PyUnicode_GET_LENGTH(sa));
		put_c(ln, ":");
		put_p(ln, sp);
		put_c(ln, " > ");
		put(ln, (const char *)PyUnicode_1BYTE_DATA(da), PyUnicode_GET_LENGTH(da));
		put_c(ln, ":");
		put_p(ln, dp);
		put(ln, quote, 1);
		return 0;
	}
	PyObject *flow = PyUnicode_FromFormat("%U:%S > %U:%S", sa, spo, da, dpo);
	if (keep(ln, flow))
		return -1;
	return put_esc(ln, flow, quote);
}

PyObject *finish(struct line *l)
{
	PyObject *out = NULL;
	if (l->full) {
		PyErr_SetString(PyExc_OverflowError, "a line of more pieces than planned");
	} else if (l->ascii) {
		out = PyUnicode_New(l->len, 127);
		if (out != NULL) {
			char *d = (char *)PyUnicode_1BYTE_DATA(out);
			for (int i = 0; i < l->n; i++) {
				memcpy(d, l->p[i].text, (size_t)l->p[i].len);
				d += l->p[i].len;
			}
		}
	} else {
		PyObject *parts = PyList_New(l->n);
		for (int i = 0; parts != NULL && i < l->n; i++) {
			PyObject *x = l->p[i].obj ? Py_NewRef(l->p[i].obj)
				: PyUnicode_FromStringAndSize(l->p[i].text, l->p[i].len);
			if (x == NULL)
				Py_CLEAR(parts);
			else
				PyList_SET_ITEM(parts, i, x);
		}
		if (parts != NULL) {
			PyObject *empty = PyUnicode_New(0, 0);
			out = empty ? PyUnicode_Join(empty, parts) : NULL;
			Py_XDECREF(empty);
			Py_DECREF(parts);
		}
	}
	for (int i = 0; i < l->nown; i++)
		Py_DECREF(l->own[i]);
	return out;
}

/* The version of lines, which every change of the dict moves (PEP 509; CPython 3.11's
 * ma_version_tag). Where it is not there, 0: same_key then never holds. */
static uint64_t lines_version(void)
{
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
	return ((PyDictObject *)S.lines)->ma_version_tag;
#else
	return 0;
#endif
}

/* key equal, item by item, to the last line's, and lines unchanged since: the dict would
 * answer S.last_tpl. Only identical items, or equal ones of the exact types whose == is
 * plain (int, float, str), count as equal; anything else is left to the dict. */
static int same_key(PyObject *key)
{
	uint64_t version = lines_version();
	if (S.last_key == NULL || version == 0 || version != S.last_version)
		return 0;
	for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(key); i++) {
		PyObject *a = PyTuple_GET_ITEM(key, i), *b = PyTuple_GET_ITEM(S.last_key, i);
		if (a == b)
			continue;
		PyTypeObject *t = Py_TYPE(a);
		if (t != Py_TYPE(b) || (t != &PyLong_Type && t != &PyFloat_Type && t != &PyUnicode_Type))
			return 0;
		int eq = PyObject_RichCompareBool(a, b, Py_EQ);
		if (eq <= 0) {
			PyErr_Clear();
			return 0;
		}
	}
	return 1;
}

static void last_line(PyObject *key, PyObject *tpl)
{
	Py_INCREF(key);
	Py_XSETREF(S.last_key, key);
	Py_INCREF(tpl);
	Py_XSETREF(S.last_tpl, tpl);
	S.last_version = lines_version();
}

/* The one-event line of verdict v, or None (nothing looked up) when the template path does
 * not apply, or NULL with an exception. */
static PyObject *one(PyObject *v, PyObject *offset, PyObject *prefix)
{
	PyObject *res = NULL, *e = NULL, *labeled = NULL, *events = NULL, *conf = NULL,
		 *pods = NULL, *natmap = NULL, *ctx = NULL, *xiface = NULL, *key = NULL,
		 *tpl = NULL, *ts_ns;
	char *ts = NULL;
	e = vget(v, S.s_event);
	labeled = e ? vget(v, S.s_labeled) : NULL;
	events = labeled ? vget(v, S.s_events) : NULL;
	conf = events ? vget(v, S.s_confidence) : NULL;
	pods = conf ? vget(v, S.s_pods) : NULL;
	natmap = pods ? vget(v, S.s_natmap) : NULL;
	if (natmap == NULL)
		goto out;
	/* verdict_line's conditions for its template path, in its order */
	if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != E_NFIELDS
	    || !PyTuple_Check(labeled) || PyTuple_GET_SIZE(labeled) != 1)
		goto other;
	PyObject *l = PyTuple_GET_ITEM(labeled, 0);
	if (!PyTuple_Check(l) || PyTuple_GET_SIZE(l) != L_NFIELDS || PyTuple_GET_ITEM(l, L_EV) != e)
		goto other;
	if (PyTuple_GET_ITEM(e, E_CT) != Py_None || PyTuple_GET_ITEM(e, E_OUTER_SADDR) != Py_None)
		goto other;
	PyObject *sa = PyTuple_GET_ITEM(e, E_SADDR), *da = PyTuple_GET_ITEM(e, E_DADDR);
	PyObject *sp = PyTuple_GET_ITEM(e, E_SPORT), *dp = PyTuple_GET_ITEM(e, E_DPORT);
	ts_ns = PyTuple_GET_ITEM(e, E_TS);
	PyObject *netns = PyTuple_GET_ITEM(e, E_NETNS), *ifindex = PyTuple_GET_ITEM(e, E_IFINDEX);
	if (!PyUnicode_CheckExact(sa) || !PyUnicode_CheckExact(da) || !PyLong_CheckExact(sp)
	    || !PyLong_CheckExact(dp) || !PyLong_CheckExact(ts_ns) || !PyLong_CheckExact(ifindex)
	    || !PyFloat_CheckExact(conf) || !PyLong_CheckExact(events) || natmap != Py_None
	    || !PyLong_CheckExact(offset))
		goto other;
	if (PyUnicode_FindChar(sa, ':', 0, PyUnicode_GET_LENGTH(sa), 1) != -1)
		goto other;
	int t = PyObject_IsTrue(pods);
	if (t < 0)
		goto out;
	if (t)
		goto other;

	/* the template path: from here on it writes the line */
	ctx = vget(v, S.s_ctx);
	if (ctx == NULL)
		goto out;
	t = PyObject_IsTrue(ctx);
	if (t < 0)
		goto out;
	if (!t) {
		Py_INCREF(S.no_ctx);
		Py_SETREF(ctx, S.no_ctx);
	}
	t = PyObject_IsTrue(ifindex);
	if (t < 0)
		goto out;
	if (t) {
		PyObject *fn = PyObject_GetAttr(ctx, S.s_iface_name);
		if (fn == NULL)
			goto out;
		xiface = PyObject_CallFunctionObjArgs(fn, netns, ifindex, NULL);
		Py_DECREF(fn);
		if (xiface == NULL)
			goto out;
	} else {
		xiface = Py_NewRef(Py_None);
	}
	/* jsonl's key: (prefix, v.kind, v.direction, v.hook, v.reason, v.cause, v.confidence,
	 * v.service, e.netns, v.iface, e.ifindex, v.hint, events, e.hook, l.rname, xiface,
	 * l.cause) */
	PyObject *names[] = {S.s_kind, S.s_direction, S.s_hook, S.s_reason, S.s_cause};
	key = PyTuple_New(17);
	if (key == NULL)
		goto out;
	PyTuple_SET_ITEM(key, 0, Py_NewRef(prefix));
	for (int i = 0; i < 5; i++) {
		PyObject *x = vget(v, names[i]);
		if (x == NULL)
			goto out;
		PyTuple_SET_ITEM(key, 1 + i, x);
	}
	PyTuple_SET_ITEM(key, 6, Py_NewRef(conf));
	PyObject *x;
	if ((x = vget(v, S.s_service)) == NULL)
		goto out;
	PyTuple_SET_ITEM(key, 7, x);
	PyTuple_SET_ITEM(key, 8, Py_NewRef(netns));
	if ((x = vget(v, S.s_iface)) == NULL)
		goto out;
	PyTuple_SET_ITEM(key, 9, x);
	PyTuple_SET_ITEM(key, 10, Py_NewRef(ifindex));
	if ((x = vget(v, S.s_hint)) == NULL)
		goto out;
	PyTuple_SET_ITEM(key, 11, x);
	PyTuple_SET_ITEM(key, 12, Py_NewRef(events));
	PyTuple_SET_ITEM(key, 13, Py_NewRef(PyTuple_GET_ITEM(e, E_HOOK)));
	PyTuple_SET_ITEM(key, 14, Py_NewRef(PyTuple_GET_ITEM(l, L_RNAME)));
	PyTuple_SET_ITEM(key, 15, Py_NewRef(xiface));
	PyTuple_SET_ITEM(key, 16, Py_NewRef(PyTuple_GET_ITEM(l, L_CAUSE)));
	if (same_key(key)) {
		tpl = Py_NewRef(S.last_tpl);
	} else if ((tpl = PyDict_GetItemWithError(S.lines, key)) != NULL) {
		Py_INCREF(tpl);
		last_line(key, tpl);
	} else {
		int hashable = 1;
		if (PyErr_Occurred()) {
			if (!PyErr_ExceptionMatches(PyExc_TypeError))
				goto out;
			PyErr_Clear();          /* a replayed lookup's answer that is not hashable */
			hashable = 0;
		}
		tpl = PyObject_CallFunctionObjArgs(S.template_fn, v, e, l, xiface, events, prefix,
						   NULL);
		if (tpl == NULL)
			goto out;
		if (hashable) {
			PyObject *r = PyObject_CallFunctionObjArgs(S.remember, S.lines, key, tpl, NULL);
			if (r == NULL)
				goto out;
			Py_DECREF(r);
			last_line(key, tpl);
		}
	}
	if (!PyTuple_Check(tpl) || PyTuple_GET_SIZE(tpl) != 5) {
		PyErr_SetString(PyExc_TypeError, "a line template is not 5 fragments");
		goto out;
	}
	ts = epoch_seconds(ts_ns, offset);
	if (ts == NULL)
		goto out;
	char quote[] = "\"";
	struct piece pieces[40];
	struct line ln = {.p = pieces, .cap = 40, .n = 0, .len = 0, .ascii = 1, .nown = 0};
	/* f'{head}{ts}{fields}{_esc(sa)},"sport":{sp},"daddr":{_esc(da)},"dport":{dp}'
	 * f'{mid}{e.ts_ns},"ts":{ts}{pre}{_esc(f"{sa}:{sp} > {da}:{dp}")}{post}' */
	char spb[24], dpb[24], tsb[24];
	struct piece sps, dps, tss;
	if (decimal(sp, spb, &sps, &ln) || decimal(dp, dpb, &dps, &ln)
	    || decimal(ts_ns, tsb, &tss, &ln))
		goto line_fail;
	if (put_s(&ln, PyTuple_GET_ITEM(tpl, 0)))
		goto line_fail;
	put_c(&ln, ts);
	if (put_s(&ln, PyTuple_GET_ITEM(tpl, 1)) || put_esc(&ln, sa, quote))
		goto line_fail;
	put_c(&ln, ",\"sport\":");
	put_p(&ln, &sps);
	put_c(&ln, ",\"daddr\":");
	if (put_esc(&ln, da, quote))
		goto line_fail;
	put_c(&ln, ",\"dport\":");
	put_p(&ln, &dps);
	if (put_s(&ln, PyTuple_GET_ITEM(tpl, 2)))
		goto line_fail;
	put_p(&ln, &tss);
	put_c(&ln, ",\"ts\":");
	put_c(&ln, ts);
	if (put_s(&ln, PyTuple_GET_ITEM(tpl, 3)))
		goto line_fail;
	if (put_detail(&ln, sa, &sps, da, &dps, sp, dp, quote)
	    || put_s(&ln, PyTuple_GET_ITEM(tpl, 4)))
		goto line_fail;
	res = finish(&ln);
	goto out;
line_fail:
	for (int i = 0; i < ln.nown; i++)
		Py_DECREF(ln.own[i]);
	goto out;
other:
	res = Py_NewRef(Py_None);
out:
	if (ts)
		PyMem_Free(ts);
	Py_XDECREF(tpl);
	Py_XDECREF(key);
	Py_XDECREF(xiface);
	Py_XDECREF(ctx);
	Py_XDECREF(natmap);
	Py_XDECREF(pods);
	Py_XDECREF(conf);
	Py_XDECREF(events);
	Py_XDECREF(labeled);
	Py_XDECREF(e);
	return res;
}

/* The (verdict or verdicts, offset, prefix) both entry points take; -1 with an exception
 * for bad arguments or before configure(). */
static int entry_args(PyObject *args, PyObject **first, PyObject **offset, PyObject **prefix)
{
	if (!PyArg_ParseTuple(args, "OOU", first, offset, prefix))
		return -1;
	if (!S.ready) {
		PyErr_SetString(PyExc_RuntimeError, "configure() first");
		return -1;
	}
	return 0;
}

/* one_line(v, offset, prefix) -> str or None */
static PyObject *one_line(PyObject *self, PyObject *args)
{
	PyObject *v, *offset, *prefix;
	if (entry_args(args, &v, &offset, &prefix))
		return NULL;
	return one(v, offset, prefix);
}

/* multi_line(v, offset, prefix) -> str or None: the line of several events (jsonl_multi.c) */
static PyObject *multi_line(PyObject *self, PyObject *args)
{
	PyObject *v, *offset, *prefix;
	if (entry_args(args, &v, &offset, &prefix))
		return NULL;
	return multi(v, offset, prefix);
}

/* lines(verdicts, offset, prefix) -> [str]: verdict_line(v, offset, 1, None, None, prefix) of
 * each (JsonLines.write_many without a collapse). */
static PyObject *lines(PyObject *self, PyObject *args)
{
	PyObject *vs, *offset, *prefix;
	if (entry_args(args, &vs, &offset, &prefix))
		return NULL;
	PyObject *seq = PySequence_Fast(vs, "lines: a sequence of verdicts");
	if (seq == NULL)
		return NULL;
	Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
	PyObject *out = PyList_New(n);
	if (out == NULL)
		goto fail;
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *v = PySequence_Fast_GET_ITEM(seq, i);
		PyObject *s = one(v, offset, prefix);
		if (s == Py_None) {
			Py_DECREF(s);
			s = multi(v, offset, prefix);
		}
		if (s == Py_None) {
			Py_DECREF(s);
			s = PyObject_CallFunction(S.verdict_line, "OOiOOO", v, offset, 1, Py_None,
						  Py_None, prefix);
		}
		if (s == NULL)
			goto fail;
		PyList_SET_ITEM(out, i, s);
	}
	Py_DECREF(seq);
	return out;
fail:
	Py_XDECREF(out);
	Py_DECREF(seq);
	return NULL;
}

static PyMethodDef methods[] = {
	{"configure", configure, METH_VARARGS, "Take jsonl's caches and fallbacks."},
	{"one_line", one_line, METH_VARARGS, "The one-event line of a verdict, or None."},
	{"lines", lines, METH_VARARGS, "verdict_line of each verdict."},
	{"configure_multi", multi_configure, METH_VARARGS, "Take the general path's caches."},
	{"multi_line", multi_line, METH_VARARGS, "The line of several events, or None."},
	{"configure_verdict", configure_verdict, METH_VARARGS, "Take Verdict's slots."},
	{"_seconds_repr", seconds_repr_py, METH_O, "(repr(x), decided without dtoa): for tests."},
	{NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
	PyModuleDef_HEAD_INIT, "nptrace.sinks.jsonl_fast",
	"jsonl.verdict_line compiled: the one-event line, the line of several events "
	"(nptrace/sinks/jsonl_fast.c, jsonl_multi.c, jsonl_seconds.c).", -1, methods,
};

PyMODINIT_FUNC PyInit_jsonl_fast(void)
{
	return PyModule_Create(&module);
}
