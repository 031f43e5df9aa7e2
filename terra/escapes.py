"""Which stand-ins outlive their iteration (escapes).

At an iteration's end (or when it is left) the runner sweeps the stand-ins it handed out:
an entry whose stand-in Python has dropped is forgotten, for an entry holds its real value,
which would otherwise live on and look like an escape to the next trace; the others are kept
until Python drops them, and at the end of a matched path given their values (:func:`finish`)
or reported, so that the runtime falls back and the replay gives them theirs. Whether Python
still holds a stand-in is read off its reference count, minus the references Terra holds.

A dropped stand-in that nothing else can tell apart from a fresh copy (no attribute set on it,
no weak reference to it, and no gradient tape alive that may have recorded its id) goes back
to the runner's spares (``StandIns.sources``) instead of being freed: the next op of its spec
hands it out again, under a new entry, for the cost of a list pop instead of a tensor copy.
"""

import functools
import sys
import types
import weakref

from tensorflow.python import pywrap_tfe
from tensorflow.python.framework import errors, ops

_EagerTensor = ops.EagerTensor
_no_tapes = pywrap_tfe.TFE_Py_TapeSetIsEmpty
_weakrefs = weakref.getweakrefcount


def finish(it, tensors, unread, held=None, pool=False):
    """Sweep the ended iteration ``it`` (unless ``held``, what a sweep already returned):
    give the entries Python still holds their values (``unread``: the values its fetch
    channels held that nobody read, by step, visit and output) and return those the graph
    gave none. If none, the iteration is released. ``pool``: as for :func:`sweep`."""
    if held is None:
        held = sweep(it, tensors, pool)
    uncovered = []
    for e in held:  # Python still holds it
        if e.value is None:
            e.value = unread.get((e.step, e.visit, e.out))
            if e.value is None:
                uncovered.append(e)
    if not uncovered:
        it.release(held)
    return uncovered


def sweep(it, tensors, pool=False):
    """Forget the entries of the iteration ``it`` whose stand-ins Python has dropped, from
    the hook table ``tensors``, and (where ``pool``) put those stand-ins back among their
    spec's spares (``StandIns.sources``, whose lists ``it.entries`` names), where they can
    be handed out again. Return the other entries; each is forgotten when Python drops its
    stand-in."""
    held, it.entries = it.entries, []
    # the custom gradients kept for a replay hold stand-ins in their closures: those
    # references are Terra's, not Python's
    ours = _closure_refs(it.customs) if it.customs else None
    pool = pool and _no_tapes()  # a tape may hold the stand-ins' ids
    pop = tensors.pop
    while True:
        # A dropped stand-in can hold others (Keras 3 sets ``_keras_mask`` on tensors):
        # once it is gone they may be dropped too, so sweep until nothing more goes.
        pending, held = held, []
        # every stand-in's references, counted in one pass in C; beyond the list's, the
        # slice's and the count's argument (_BASE_REFS) most have none: dropped. One loop,
        # no call per entry: a step of YOLOv3 sweeps ~500 (0.8 us each as two calls apiece).
        counts = list(map(sys.getrefcount, pending[1::3]))
        for k, count in enumerate(counts):
            i = 3 * k
            e, t, spare = pending[i], pending[i + 1], pending[i + 2]
            if count > _BASE_REFS and count > _BASE_REFS + _terras(e, t, ours):
                held += (e, t, spare)  # Python still holds it
                continue
            pop(t._id, None)
            if pool and spare is not None and e.value is not t and \
                    not (ours and id(t) in ours) and not t.__dict__ and not _weakrefs(t):
                spare.append(t)  # no one can tell it from a fresh copy: handed out again
        if len(held) == len(pending):
            break
        del e, t, spare  # the loop's last: not a reference Python holds in the next pass
    del pending
    for i in range(1, len(held), 3):
        t, spare = held[i], held[i + 1]
        weakref.finalize(t, tensors.pop, t._id, None)
        if pool and spare is not None:
            # Python keeps this stand-in (a loss, each iteration): its spec's spares are one
            # short of what the iteration took. Copy one now, after the graph's waits, where
            # an eager op costs ~2 us, not in the next iteration's lane, where TF's code is
            # out of the caches (~30 us). A copy that fails here is not the user's error:
            # the next op of the spec copies its own.
            try:
                spare.append(t._copy_to_device(t.backing_device))
            except errors.OpError:
                pass
    return held[::3]


def unfetchable(held):
    """Whether an entry Python still holds (``held``: what :func:`sweep` returned) has no
    value and is not returned by the graph: :func:`finish` will find it uncovered, and the
    runtime fall back (the commit point's question, ``terra.commit``)."""
    return any(map(_unreturned, held))


def holds_unfetchable(it):
    """Whether Python holds a stand-in of the iteration ``it`` that has no value and that the
    graph does not return, found without sweeping (the iteration goes on): an entry a
    dropped stand-in still references counts as held."""
    entries = it.entries
    ours = _closure_refs(it.customs) if it.customs else None
    return any(_unreturned(entries[i]) and _python_holds(entries, i, ours)
               for i in range(0, len(entries), 3))


def _unreturned(e):
    return e.value is None and e.step.fetch[e.out] is None


def _python_holds(entries, i, ours):
    """Whether Python holds the stand-in of the entry at ``entries[i]`` (the entry, its
    stand-in and its spares, flat): its references but the list's, this frame's, the count's
    argument, its entry's value and Terra's elsewhere (``ours``, by id). The caller holds
    none of its own."""
    e, t = entries[i], entries[i + 1]
    return sys.getrefcount(t) > _BASE_REFS + _terras(e, t, ours)


def _terras(e, t, ours):
    """Terra's references to the stand-in ``t`` of the entry ``e`` beyond the entry list's:
    the entry's value, and those of ``ours`` (by id)."""
    return (e.value is t) + (ours.get(id(t), 0) if ours else 0)


def _closure_refs(customs):
    """How often each tensor is referenced from the closures of the custom gradients'
    backward functions (id -> count), through functions, cells, methods, partials and plain
    containers; other objects (a Keras layer a method is bound to) are not entered."""
    counts, seen = {}, set()
    stack = [custom.backward for custom in customs]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            children = [*(obj.__closure__ or ()), *(obj.__defaults__ or ())]
        elif isinstance(obj, types.CellType):
            children = [obj.cell_contents] if _has_contents(obj) else []
        elif isinstance(obj, types.MethodType):
            children = [obj.__func__]
        elif isinstance(obj, functools.partial):
            children = [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, (list, tuple)):
            children = obj
        elif isinstance(obj, dict):
            children = obj.values()
        else:
            continue
        for child in children:
            if type(child) is _EagerTensor:
                counts[id(child)] = counts.get(id(child), 0) + 1
            else:
                stack.append(child)
    return counts


def _has_contents(cell):
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


# A tensor referenced only by the iteration's entry list: the list, ``_python_holds``' local
# and getrefcount's argument.
_BASE_REFS = 3
