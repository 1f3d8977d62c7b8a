/* Python objects on the hot path, cheaper than the generic API.
 *
 * Reading a __slots__ attribute of a pure-Python class straight from its
 * instance (Deadline._ns). The offset comes from the class's member
 * descriptor once, at import; a generic attribute lookup would cost more
 * than the rest of an uncontended admission.
 *
 * Returning a monotonic time as an int without allocating one
 * (prazo_reuse_int): acquire() returns its start time, which the caller
 * usually drops at once; allocating and freeing that int was an eighth of
 * an uncontended acquire + release. */
#ifndef PRAZO_SLOTS_H
#define PRAZO_SLOTS_H

#include <Python.h>
#include <structmember.h>

/* The instance offset of a slot, or -1 when `descr` is not a slot's member descriptor. */
static inline Py_ssize_t prazo_slot_offset(PyObject *descr)
{
    if (!Py_IS_TYPE(descr, &PyMemberDescr_Type))
        return -1;
    if (((PyMemberDescrObject *)descr)->d_member->type != T_OBJECT_EX)
        return -1;
    return ((PyMemberDescrObject *)descr)->d_member->offset;
}

/* Borrowed reference to the slot's value; NULL when the slot is unset.
 *
 * Safe without a GIL only for a slot written once, before the object is
 * shared with another thread, and never rebound after: Deadline._ns is set
 * by Deadline's constructors and its API never assigns it again (only code
 * writing the private slot, or calling __init__ a second time, would). A
 * slot another thread may rebind could be freed under this borrowed read on
 * a free-threaded build; do not use this for one. */
static inline PyObject *prazo_slot_value(PyObject *obj, Py_ssize_t offset)
{
    return *(PyObject **)((char *)obj + offset);
}

/* An int equal to `value`: the one in *cache, rewritten in place, when
 * nothing but the cache holds it (reference count 1: nobody can see it
 * change), else a new one, which becomes the cache. Only two-digit ints
 * (2**30 <= value < 2**60, every monotonic time after the first second of
 * uptime) are cached, so the cached object always has room for the value;
 * smaller values may be the interpreter's shared small ints. The int layout
 * read here is CPython 3.11's (ob_size, ob_digit) on a GIL build; anything
 * else always allocates. Call with the GIL held. */
static inline PyObject *prazo_reuse_int(PyObject **cache, int64_t value)
{
    PyObject *fresh;
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30 && !defined(Py_GIL_DISABLED)
    const int cacheable = value >= ((int64_t)1 << 30) && value < ((int64_t)1 << 60);
    PyObject *cached = *cache;
    if (cacheable && cached != NULL && Py_REFCNT(cached) == 1 && Py_SIZE(cached) == 2) {
        ((PyLongObject *)cached)->ob_digit[0] = (digit)(value & PyLong_MASK);
        ((PyLongObject *)cached)->ob_digit[1] = (digit)(value >> PyLong_SHIFT);
        Py_INCREF(cached);
        return cached;
    }
    fresh = PyLong_FromLongLong(value);
    if (fresh != NULL && cacheable && Py_SIZE(fresh) == 2) {
        Py_INCREF(fresh);
        Py_XSETREF(*cache, fresh); /* the old one, if anyone still holds it, is theirs now */
    }
    return fresh;
#else
    (void)cache;
    fresh = PyLong_FromLongLong(value);
    return fresh;
#endif
}

#endif /* PRAZO_SLOTS_H */
