/* A lock that exists only where the GIL does not.
 *
 * On a default build, C that runs with the GIL held and calls no Python in
 * between makes a check-then-set atomic: no other thread runs Python, so no
 * other thread can be inside the same object's methods. Some hot paths rely
 * on that (FutureCondition's owner and depth: two field writes per
 * uncontended acquire). On a free-threaded build (Py_GIL_DISABLED) threads run
 * those methods truly at once, so the same fields are guarded by a PyMutex:
 * one byte, zero-initialised (tp_alloc zeroes every object), and when it must
 * wait it parks the thread detached from the interpreter, so a stop-the-world
 * pause (the collector) never waits on a parked thread. On a default build
 * the lock compiles to nothing and the GIL's reasoning stands as before.
 *
 * Rule for users: never call into Python (nor block on another lock, nor ask
 * for the GIL) while holding it; hold it for a few field reads and writes. */
#ifndef PRAZO_FREETHREADING_H
#define PRAZO_FREETHREADING_H

#include <Python.h>

#ifdef Py_GIL_DISABLED
#define PRAZO_FREE_THREADED 1
typedef PyMutex prazo_ft_mutex;
static inline void prazo_ft_lock(prazo_ft_mutex *mutex) { PyMutex_Lock(mutex); }
static inline void prazo_ft_unlock(prazo_ft_mutex *mutex) { PyMutex_Unlock(mutex); }
#else
#define PRAZO_FREE_THREADED 0
typedef struct {
    char unused;
} prazo_ft_mutex;
static inline void prazo_ft_lock(prazo_ft_mutex *mutex) { (void)mutex; }
static inline void prazo_ft_unlock(prazo_ft_mutex *mutex) { (void)mutex; }
#endif

#endif /* PRAZO_FREETHREADING_H */
