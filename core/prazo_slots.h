/* Reading a __slots__ attribute of a pure-Python class straight from its
 * instance, for the hot path (Deadline._ns). The offset comes from the
 * class's member descriptor once, at import; a generic attribute lookup
 * would cost more than the rest of an uncontended admission. */
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

/* Borrowed reference to the slot's value; NULL when the slot is unset. */
static inline PyObject *prazo_slot_value(PyObject *obj, Py_ssize_t offset)
{
    return *(PyObject **)((char *)obj + offset);
}

#endif /* PRAZO_SLOTS_H */
