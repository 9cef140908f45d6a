/* Where a class's __slots__ field lives in its instances: the helpers read and write Flow's
 * and Verdict's fields at these offsets instead of through attribute lookups (shared by
 * classify/correlate_fast.c, classify/feed_fast.c and sinks/jsonl_fast.c). */
#ifndef NPTRACE_SLOTS_H
#define NPTRACE_SLOTS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* The offset of type's slot `name` (an object slot: its member descriptor, T_OBJECT_EX), or
 * -1 with TypeError when type has no such slot. */
static inline Py_ssize_t slot_offset(PyTypeObject *type, const char *name)
{
	PyObject *d = PyDict_GetItemString(type->tp_dict, name);
	if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type)
	    || ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
		PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", type->tp_name, name);
		return -1;
	}
	return ((PyMemberDescrObject *)d)->d_member->offset;
}
#endif
