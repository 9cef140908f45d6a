/* nptrace.classify.correlate_fast: correlate._one compiled (issue #16 item 3).
 *
 * _one makes the Verdict of a one-record incident without an earlier root cause: a storm's
 * every incident. This is the same function: the same Context lookups in the same order
 * (iface_name; service_of, then endpoint_of or service_of; pod_of of the destination, of the
 * source, pod_of_netns; feed_many's evictions read the five attributes of ctx once a call, not
 * once an incident), the same Verdict as correlate._make_verdict builds (its fields set one
 * by one as object.__setattr__ sets them, no dataclass __init__). What is rare goes back to Python:
 * an event with a conntrack entry (_service, _pods), a flow with a NAT mapping (_pods), a hint
 * not filled before (_fill_text; the cache of filled hints is correlate.py's own). correlate.py
 * keeps _one as the reference and the fallback where this module is not built;
 * tests/unit/test_native_paths.py compares the two.
 */
#include "correlate_fast.h"
#include "../slots.h"

#define NFIELDS 15      /* Verdict's */
#define SMALL_KEYS 64   /* event types and hooks are below this (events.EvType, Hook) */

/* events.Event and verdict.Labeled by position */
enum { E_TYPE = 1, E_HOOK = 2, E_IFINDEX = 5, E_NETNS = 6, E_SADDR = 8, E_SPORT = 9,
       E_DADDR = 10, E_DPORT = 11, E_CT = 23, E_NFIELDS = 28 };
enum { L_EV, L_RNAME, L_CAUSE, L_CONF, L_HINT, L_NFIELDS };

static struct {
	PyObject *verdict;              /* verdict.Verdict */
	PyObject *kind, *directions, *hooks;   /* verdict.KIND, correlate._DIRECTIONS, HOOKS */
	PyObject *service, *pods;       /* correlate._service, _pods */
	PyObject *s_drop, *s_brace, *s_pod;
	PyObject *s_iface_name, *s_service_of, *s_endpoint_of, *s_pod_of, *s_pod_of_netns;
	Py_ssize_t field_off[NFIELDS];  /* where Verdict's slots (correlate._VERDICT_FIELDS) are */
	PyObject *hint_uses, *filled, *uses, *fill_text;   /* _fill_hint's caches and helpers */
	Py_ssize_t filled_max;
	PyObject *no_args;              /* () for object.__new__ */
	PyObject *empty_bytes;          /* b"" (rootless) */
	/* KIND, _DIRECTIONS and HOOKS by small int key, as configure found them (they are
	 * constants): an index instead of a dict probe, ~230 instructions each a Verdict */
	PyObject *kind_at[SMALL_KEYS], *dir_at[SMALL_KEYS], *hook_at[SMALL_KEYS];
	int ready;
} S;

/* d[k] for each k < SMALL_KEYS into at[k] (a new reference, NULL where d has no such key) */
static int small_keys(PyObject *d, PyObject **at)
{
	for (int k = 0; k < SMALL_KEYS; k++) {
		PyObject *key = PyLong_FromLong(k), *v;
		if (key == NULL)
			return -1;
		v = PyDict_GetItemWithError(d, key);
		Py_DECREF(key);
		if (v == NULL && PyErr_Occurred())
			return -1;
		Py_XINCREF(v);
		Py_XSETREF(at[k], v);
	}
	return 0;
}

/* at[x] for an int x below SMALL_KEYS (a borrowed reference), else NULL: ask the dict. The
 * int subclasses an Event holds are EvType and Hook, IntEnums: they hash and compare as their
 * value, so the dict would give at[x] too. */
static PyObject *small_get(PyObject *const *at, PyObject *x)
{
	if (!PyLong_Check(x))
		return NULL;
	int of;
	long k = PyLong_AsLongAndOverflow(x, &of);
	return !of && k >= 0 && k < SMALL_KEYS ? at[k] : NULL;
}

static int intern(PyObject **slot, const char *s)
{
	if (*slot == NULL)
		*slot = PyUnicode_InternFromString(s);
	return *slot ? 0 : -1;
}

#define SET(slot, v) do { Py_INCREF(v); Py_XSETREF(S.slot, v); } while (0)

/* configure(Verdict, KIND, DIRECTIONS, HOOKS, _service, _pods, VERDICT_FIELDS, _HINT_USES,
 *           _FILLED, _FILLED_MAX, _uses, _fill_text) */
static PyObject *configure(PyObject *self, PyObject *args)
{
	PyObject *verdict, *kind, *dirs, *hooks, *service, *pods, *fields, *hint_uses, *filled,
		 *uses, *fill_text;
	Py_ssize_t filled_max;
	if (!PyArg_ParseTuple(args, "O!O!O!O!OOO!O!O!nOO", &PyType_Type, &verdict, &PyDict_Type,
			      &kind, &PyDict_Type, &dirs, &PyDict_Type, &hooks, &service, &pods,
			      &PyTuple_Type, &fields, &PyDict_Type, &hint_uses, &PyDict_Type,
			      &filled, &filled_max, &uses, &fill_text))
		return NULL;
	SET(hint_uses, hint_uses);
	SET(filled, filled);
	SET(uses, uses);
	SET(fill_text, fill_text);
	S.filled_max = filled_max;
	if (PyTuple_GET_SIZE(fields) != NFIELDS) {
		PyErr_SetString(PyExc_ValueError, "the Verdict has 15 fields here");
		return NULL;
	}
	for (int i = 0; i < NFIELDS; i++) {
		const char *f = PyUnicode_AsUTF8(PyTuple_GET_ITEM(fields, i));
		if (f == NULL || (S.field_off[i] = slot_offset((PyTypeObject *)verdict, f)) < 0)
			return NULL;
	}
	SET(verdict, verdict);
	SET(kind, kind);
	SET(directions, dirs);
	SET(hooks, hooks);
	if (small_keys(kind, S.kind_at) || small_keys(dirs, S.dir_at)
	    || small_keys(hooks, S.hook_at))
		return NULL;
	SET(service, service);
	SET(pods, pods);
	if (intern(&S.s_drop, "drop") || intern(&S.s_brace, "{") || intern(&S.s_pod, "pod")
	    || intern(&S.s_iface_name, "iface_name")
	    || intern(&S.s_service_of, "service_of") || intern(&S.s_endpoint_of, "endpoint_of")
	    || intern(&S.s_pod_of, "pod_of") || intern(&S.s_pod_of_netns, "pod_of_netns"))
		return NULL;
	S.ready = 1;
	Py_RETURN_NONE;
}

/* fn(a, b) or fn(a), fn being ctx.<name> (fn NULL: read here): a new reference, or NULL with
 * an exception */
static PyObject *ask(PyObject *ctx, PyObject *name, PyObject *fn, PyObject *a, PyObject *b)
{
	fn = fn ? Py_NewRef(fn) : PyObject_GetAttr(ctx, name);
	if (fn == NULL)
		return NULL;
	PyObject *r = b ? PyObject_CallFunctionObjArgs(fn, a, b, NULL)
			: PyObject_CallOneArg(fn, a);
	Py_DECREF(fn);
	return r;
}

int one_lookups_read(PyObject *ctx, struct one_lookups *lk)
{
	*lk = (struct one_lookups){0};
	if (!S.ready) {
		PyErr_SetString(PyExc_RuntimeError, "configure() first");
		return -1;
	}
	if ((lk->iface_name = PyObject_GetAttr(ctx, S.s_iface_name)) == NULL
	    || (lk->service_of = PyObject_GetAttr(ctx, S.s_service_of)) == NULL
	    || (lk->endpoint_of = PyObject_GetAttr(ctx, S.s_endpoint_of)) == NULL
	    || (lk->pod_of = PyObject_GetAttr(ctx, S.s_pod_of)) == NULL
	    || (lk->pod_of_netns = PyObject_GetAttr(ctx, S.s_pod_of_netns)) == NULL) {
		one_lookups_clear(lk);
		return -1;
	}
	return 0;
}

void one_lookups_clear(struct one_lookups *lk)
{
	Py_CLEAR(lk->iface_name);
	Py_CLEAR(lk->service_of);
	Py_CLEAR(lk->endpoint_of);
	Py_CLEAR(lk->pod_of);
	Py_CLEAR(lk->pod_of_netns);
}

/* For `x or <the next lookup>`: 1 keeps x (true), 0 drops it (false: ask the next), -1 error. */
static int keep_if_true(PyObject **x)
{
	int t = PyObject_IsTrue(*x);
	if (t == 0)
		Py_CLEAR(*x);
	return t;
}

/* correlate._fill_hint: _fill_text remembered in _FILLED by the values the hint reads
 * (_HINT_USES, made by _uses); a key that is not hashable is filled every time. */
static PyObject *fill_hint(PyObject *hint, PyObject *ev, PyObject *iface, PyObject *service)
{
	PyObject *uses = PyDict_GetItemWithError(S.hint_uses, hint), *key = NULL, *got = NULL;
	if (uses != NULL) {
		Py_INCREF(uses);
	} else {
		if (PyErr_Occurred())
			return NULL;
		uses = PyObject_CallOneArg(S.uses, hint);
		if (uses == NULL)
			return NULL;
	}
	if (!PyTuple_Check(uses)) {
		PyErr_SetString(PyExc_TypeError, "_uses gave no tuple");
		goto out;
	}
	Py_ssize_t n = PyTuple_GET_SIZE(uses);
	key = PyTuple_New(3 + n);
	if (key == NULL)
		goto out;
	PyTuple_SET_ITEM(key, 0, Py_NewRef(hint));
	PyTuple_SET_ITEM(key, 1, Py_NewRef(iface));
	PyTuple_SET_ITEM(key, 2, Py_NewRef(service));
	for (Py_ssize_t i = 0; i < n; i++) {
		Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(uses, i));
		if (at == -1 && PyErr_Occurred())
			goto out;
		if (at < 0 || at >= PyTuple_GET_SIZE(ev)) {
			PyErr_SetString(PyExc_IndexError, "a hint reads past the Event");
			goto out;
		}
		PyTuple_SET_ITEM(key, 3 + i, Py_NewRef(PyTuple_GET_ITEM(ev, at)));
	}
	got = PyDict_GetItemWithError(S.filled, key);
	if (got != NULL) {
		Py_INCREF(got);
		goto out;
	}
	if (PyErr_Occurred()) {
		if (!PyErr_ExceptionMatches(PyExc_TypeError))
			goto out;
		PyErr_Clear();               /* a replayed lookup's answer that is not hashable */
		got = PyObject_CallFunctionObjArgs(S.fill_text, hint, ev, iface, service, NULL);
		goto out;
	}
	if (PyDict_GET_SIZE(S.filled) >= S.filled_max)
		PyDict_Clear(S.filled);
	got = PyObject_CallFunctionObjArgs(S.fill_text, hint, ev, iface, service, NULL);
	if (got != NULL && PyDict_SetItem(S.filled, key, got) < 0)
		Py_CLEAR(got);
out:
	Py_XDECREF(key);
	Py_DECREF(uses);
	return got;
}

/* primary.ev (borrowed) of a Labeled whose ev is an Event, else NULL with a TypeError */
static PyObject *labeled_event(PyObject *primary)
{
	if (!PyTuple_Check(primary) || PyTuple_GET_SIZE(primary) != L_NFIELDS) {
		PyErr_SetString(PyExc_TypeError, "primary is not a Labeled");
		return NULL;
	}
	PyObject *ev = PyTuple_GET_ITEM(primary, L_EV);
	if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) != E_NFIELDS) {
		PyErr_SetString(PyExc_TypeError, "primary.ev is not an Event");
		return NULL;
	}
	return ev;
}

/* correlate._service(ev, ctx) of an Event (a new reference, or NULL with an exception):
 * without a conntrack entry, service_of(daddr, dport), then endpoint_of(saddr, sport) or that;
 * else service_of(saddr, sport) or None. With one, the Python function. */
static PyObject *event_service(PyObject *ctx, const struct one_lookups *lk, PyObject *ev)
{
	if (PyTuple_GET_ITEM(ev, E_CT) != Py_None)
		return PyObject_CallFunctionObjArgs(S.service, ev, ctx, NULL);
	PyObject *service = ask(ctx, S.s_service_of, lk->service_of,
				PyTuple_GET_ITEM(ev, E_DADDR), PyTuple_GET_ITEM(ev, E_DPORT));
	int t = service ? PyObject_IsTrue(service) : -1;
	if (t < 0)
		goto fail;
	if (t) {
		PyObject *ep = ask(ctx, S.s_endpoint_of, lk->endpoint_of,
				   PyTuple_GET_ITEM(ev, E_SADDR), PyTuple_GET_ITEM(ev, E_SPORT));
		t = ep ? PyObject_IsTrue(ep) : -1;
		if (t < 0) {
			Py_XDECREF(ep);
			goto fail;
		}
		if (t)
			Py_SETREF(service, ep);
		else
			Py_DECREF(ep);
		return service;
	}
	Py_SETREF(service, ask(ctx, S.s_service_of, lk->service_of,
			       PyTuple_GET_ITEM(ev, E_SADDR), PyTuple_GET_ITEM(ev, E_SPORT)));
	t = service ? PyObject_IsTrue(service) : -1;
	if (t < 0)
		goto fail;
	if (!t)
		Py_SETREF(service, Py_NewRef(Py_None));
	return service;
fail:
	Py_XDECREF(service);
	return NULL;
}

/* service(ev, ctx): correlate._service, compiled for an Event without a conntrack entry
 * (_report asks it for each event of an incident that names no Service) */
static PyObject *service(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
	static const struct one_lookups by_name = {0};
	if (!S.ready) {
		PyErr_SetString(PyExc_RuntimeError, "configure() first");
		return NULL;
	}
	if (n != 2) {
		PyErr_Format(PyExc_TypeError, "service takes 2 arguments (%zd given)", n);
		return NULL;
	}
	PyObject *ev = args[0];
	if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) != E_NFIELDS)    /* not an Event */
		return PyObject_CallFunctionObjArgs(S.service, ev, args[1], NULL);
	return event_service(args[1], &by_name, ev);
}

/* _make_verdict: object.__new__(Verdict) (its __init__ is not run), then each slot at its
 * offset, as the member descriptor's __set__ stores it (values in _VERDICT_FIELDS' order): a
 * new instance's slots are NULL, so nothing is released */
static PyObject *new_verdict(PyObject *const *values)
{
	PyTypeObject *vt = (PyTypeObject *)S.verdict;
	if (S.no_args == NULL && (S.no_args = PyTuple_New(0)) == NULL)
		return NULL;
	PyObject *v = PyBaseObject_Type.tp_new(vt, S.no_args, NULL);
	if (v == NULL)
		return NULL;
	for (int i = 0; i < NFIELDS; i++) {
		PyObject **slot = (PyObject **)((char *)v + S.field_off[i]);
		Py_XSETREF(*slot, Py_NewRef(values[i]));
	}
	return v;
}

/* make_verdict(event, kind, direction, hook, reason, cause, confidence, hint, iface, service,
 * labeled, events, ctx, pods=None) -> Verdict: correlate._make_verdict (natmap None), for
 * _report's incidents of several records: one call instead of 15 descriptor calls */
static PyObject *make_verdict(PyObject *self, PyObject *const *args, Py_ssize_t n)
{
	if (!S.ready) {
		PyErr_SetString(PyExc_RuntimeError, "configure() first");
		return NULL;
	}
	if (n != NFIELDS - 2 && n != NFIELDS - 1) {
		PyErr_Format(PyExc_TypeError, "make_verdict takes %d or %d arguments (%zd given)",
			     NFIELDS - 2, NFIELDS - 1, n);
		return NULL;
	}
	PyObject *values[NFIELDS];
	for (Py_ssize_t i = 0; i < NFIELDS; i++)
		values[i] = i < n ? args[i] : Py_None;     /* pods, natmap: None */
	return new_verdict(values);
}

/* one(primary, events, ctx, nat) -> Verdict: correlate._one */
static PyObject *one(PyObject *self, PyObject *args)
{
	PyObject *primary, *events, *ctx, *nat;
	if (!PyArg_ParseTuple(args, "O!OOO", &PyTuple_Type, &primary, &events, &ctx, &nat))
		return NULL;
	return correlate_one(primary, events, ctx, nat, NULL);
}

PyObject *correlate_one(PyObject *primary, PyObject *events, PyObject *ctx, PyObject *nat,
			const struct one_lookups *lk)
{
	static const struct one_lookups by_name = {0};   /* each read from ctx when asked */
	if (lk == NULL)
		lk = &by_name;
	if (!S.ready) {
		PyErr_SetString(PyExc_RuntimeError, "configure() first");
		return NULL;
	}
	PyObject *ev = labeled_event(primary);
	if (ev == NULL)
		return NULL;
	PyObject *iface = NULL, *service = NULL, *hint = NULL, *ordered = NULL, *pods = NULL,
		 *res = NULL, *hook = NULL;
	PyObject *ct = PyTuple_GET_ITEM(ev, E_CT);
	int t = PyObject_IsTrue(PyTuple_GET_ITEM(ev, E_IFINDEX));
	if (t < 0)
		goto out;
	iface = t ? ask(ctx, S.s_iface_name, lk->iface_name, PyTuple_GET_ITEM(ev, E_NETNS),
			PyTuple_GET_ITEM(ev, E_IFINDEX)) : Py_NewRef(Py_None);
	if (iface == NULL)
		goto out;
	service = event_service(ctx, lk, ev);
	if (service == NULL)
		goto out;
	hint = Py_NewRef(PyTuple_GET_ITEM(primary, L_HINT));
	t = PySequence_Contains(hint, S.s_brace);
	if (t < 0)
		goto out;
	if (t) {
		Py_SETREF(hint, fill_hint(hint, ev, iface, service));
		if (hint == NULL)
			goto out;
	}
	ordered = PyTuple_Pack(1, primary);
	if (ordered == NULL)
		goto out;
	if (ct == Py_None && nat == Py_None) {
		/* pod = pod_of(daddr) or pod_of(saddr) or (pod_of_netns(netns) if netns else None) */
		PyObject *pod = ask(ctx, S.s_pod_of, lk->pod_of, PyTuple_GET_ITEM(ev, E_DADDR),
				    NULL);
		if (pod == NULL || (t = keep_if_true(&pod)) < 0)
			goto pod_fail;
		if (!t) {
			pod = ask(ctx, S.s_pod_of, lk->pod_of, PyTuple_GET_ITEM(ev, E_SADDR), NULL);
			if (pod == NULL || (t = keep_if_true(&pod)) < 0)
				goto pod_fail;
		}
		if (!t) {
			PyObject *netns = PyTuple_GET_ITEM(ev, E_NETNS);
			int n = PyObject_IsTrue(netns);
			if (n < 0)
				goto out;
			pod = n ? ask(ctx, S.s_pod_of_netns, lk->pod_of_netns, netns, NULL)
				: Py_NewRef(Py_None);
			if (pod == NULL)
				goto out;
		}
		if (pod != Py_None) {
			pods = PyDict_New();
			if (pods == NULL || PyDict_SetItem(pods, S.s_pod, pod) < 0) {
				Py_DECREF(pod);
				goto out;
			}
		} else {
			pods = Py_NewRef(Py_None);
		}
		Py_DECREF(pod);
		goto pods_done;
pod_fail:
		Py_XDECREF(pod);
		goto out;
	} else {
		pods = PyObject_CallFunctionObjArgs(S.pods, ev, ordered, ctx, nat, NULL);
		if (pods == NULL)
			goto out;
	}
pods_done:;
	/* KIND.get(t, "drop"), _DIRECTIONS.get(t), HOOKS[hook]: the tables' entries for small
	 * keys; the dicts themselves for any other key (a miss there too: the default, or
	 * HOOKS' KeyError) */
	PyObject *typ = PyTuple_GET_ITEM(ev, E_TYPE), *hk = PyTuple_GET_ITEM(ev, E_HOOK);
	PyObject *kind = small_get(S.kind_at, typ);
	if (kind == NULL && (kind = PyDict_GetItemWithError(S.kind, typ)) == NULL) {
		if (PyErr_Occurred())
			goto out;
		kind = S.s_drop;
	}
	PyObject *dir = small_get(S.dir_at, typ);
	if (dir == NULL && (dir = PyDict_GetItemWithError(S.directions, typ)) == NULL) {
		if (PyErr_Occurred())
			goto out;
		dir = Py_None;
	}
	hook = small_get(S.hook_at, hk);
	hook = hook ? Py_NewRef(hook) : PyObject_GetItem(S.hooks, hk);
	if (hook == NULL)
		goto out;
	PyObject *values[NFIELDS] = {
		ev, kind, dir, hook, PyTuple_GET_ITEM(primary, L_RNAME),
		PyTuple_GET_ITEM(primary, L_CAUSE), PyTuple_GET_ITEM(primary, L_CONF), hint, iface,
		service, ordered, events, ctx, pods, nat,
	};
	res = new_verdict(values);
out:
	Py_XDECREF(hook);
	Py_XDECREF(pods);
	Py_XDECREF(ordered);
	Py_XDECREF(hint);
	Py_XDECREF(service);
	Py_XDECREF(iface);
	return res;
}

/* rootless(primary) -> Labeled: correlate._rootless, the root cause a flow keeps for window_ns
 * without its raw record (Event.raw is its last field): primary itself when raw is empty,
 * else a copy of the same types with raw b"". Two tuples made instead of the six of slicing
 * and concatenating (~0.9 us an incident of several records in CPython 3.11). */
static PyObject *rootless(PyObject *self, PyObject *primary)
{
	PyObject *ev = labeled_event(primary);
	if (ev == NULL)
		return NULL;
	int raw = PyObject_IsTrue(PyTuple_GET_ITEM(ev, E_NFIELDS - 1));
	if (raw <= 0)
		return raw < 0 ? NULL : Py_NewRef(primary);
	if (S.empty_bytes == NULL && (S.empty_bytes = PyBytes_FromStringAndSize("", 0)) == NULL)
		return NULL;
	/* tuple.__new__(type(x), items) of a tuple subclass is its tp_alloc and the items */
	PyTypeObject *et = Py_TYPE(ev), *lt = Py_TYPE(primary);
	PyObject *e2 = et->tp_alloc(et, E_NFIELDS);
	if (e2 == NULL)
		return NULL;
	for (Py_ssize_t i = 0; i < E_NFIELDS - 1; i++)
		PyTuple_SET_ITEM(e2, i, Py_NewRef(PyTuple_GET_ITEM(ev, i)));
	PyTuple_SET_ITEM(e2, E_NFIELDS - 1, Py_NewRef(S.empty_bytes));
	PyObject *l2 = lt->tp_alloc(lt, L_NFIELDS);
	if (l2 == NULL) {
		Py_DECREF(e2);
		return NULL;
	}
	PyTuple_SET_ITEM(l2, L_EV, e2);
	for (Py_ssize_t i = 1; i < L_NFIELDS; i++)
		PyTuple_SET_ITEM(l2, i, Py_NewRef(PyTuple_GET_ITEM(primary, i)));
	return l2;
}

static PyMethodDef methods[] = {
	{"rootless", rootless, METH_O, "correlate._rootless(primary)."},
	{"service", (PyCFunction)(void (*)(void))service, METH_FASTCALL,
	 "correlate._service(ev, ctx)."},
	{"make_verdict", (PyCFunction)(void (*)(void))make_verdict, METH_FASTCALL,
	 "correlate._make_verdict(event, ..., ctx, pods=None)."},
	{"configure", configure, METH_VARARGS, "Take correlate's tables and fallbacks."},
	{"one", one, METH_VARARGS, "correlate._one(primary, events, ctx, nat)."},
	{"configure_feed", feed_configure, METH_VARARGS, "Take feed_many's tables and fallbacks."},
	{"feed_many", feed_many, METH_VARARGS, "Classifier.feed_many(clf, events)."},
	{NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
	PyModuleDef_HEAD_INIT, "nptrace.classify.correlate_fast",
	"correlate._one and Classifier.feed_many compiled (nptrace/classify/correlate_fast.c, feed_fast.c).", -1, methods,
};

PyMODINIT_FUNC PyInit_correlate_fast(void)
{
	PyObject *m = PyModule_Create(&module);
	/* the Verdict layout this build stores (native.ENTRY_POINTS: an older build stored 14
	 * fields by name, and its configure would refuse today's 15 slots) */
	if (m != NULL && PyModule_AddIntConstant(m, "verdict_slots", NFIELDS) < 0)
		Py_CLEAR(m);
	return m;
}
