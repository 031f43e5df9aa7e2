"""Library regions: an optimizer update the skeleton skips, like a ``tape.gradient`` call.

In co-execution every TF op the user's Python issues costs the skeleton its Python, and the
optimizer update is most of them: Keras' ``apply`` loops over the variables in Python, a few
dozen ops each, every step, although the graph already holds all those ops and Python never
looks at their values. A call into the update of a library's own optimizer is therefore
recorded between two tape marks, ``call`` (its tensor arguments as inputs) and ``return``;
where the plan runs the ops between them straight through (no branch point, nothing Python
feeds, fetches or runs, ``path.skippable``), the PythonRunner matches the ``call`` mark and
moves past the region without running the method at all (``PythonRunner.library_call``).

Skipping Python is only right if the Python would have issued the same ops with the same
constants, so a region is guarded like a compiler guards a specialization:

- the optimizer's class is the library's own (``REGIONS``): a user subclass, whose Python
  may do anything, and a wrapper such as Keras' ``LossScaleOptimizer`` keep the per-op path;
- a learning-rate schedule of the user's is Python the update runs every step, so it is held
  to the rule for the user's layers (``terra.user_layers``): its ``__call__`` writes no
  state (a static check of its bytecode), its Python, watched whenever it runs (traced or
  per-op), makes no call with a side effect (``print``, NumPy, a tensor's value read), and the
  globals and methods it read are the same before every later call; otherwise the per-op
  path, with an ``explain()`` line naming the line and why;
- the tensors passed in are the same producers as in the traces (the ``call`` mark's inputs
  are validated like an op's: gradients of this iteration, the same variables);
- the optimizer's Python attributes (numbers, strings, and the identity of every other
  attribute, the schedule's too) are what they were when the region was traced: they are
  in the mark's attrs, so a changed one is a divergence, like a changed op attribute;
- the method changes none of them itself: a call after the first (which builds the slots)
  that leaves the attributes otherwise, or attributes changed from outside between two calls
  (a learning rate set as a Python float each epoch), turns regions off for that optimizer for
  the rest of the run, with an ``explain()`` note; its updates then take the per-op path,
  whose every op is checked.

What the region returned must need nothing from the graph: ``None``, or the optimizer's
iteration counter (a variable; tf_keras returns its ``assign_add``).
"""

import dataclasses
import functools
import operator
import sys
import threading
import types
import weakref
from collections.abc import Iterator

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context
from tensorflow.python.framework import ops
from tensorflow.python.util import nest

from terra import runtime, user_layers
from terra.location import user_location
from terra.marks import handle_or_self

_EagerTensor = ops.EagerTensor
_PLAIN = (int, float, bool, str, bytes, complex, type(None))
_CONTAINERS = (list, tuple, dict, set)


@dataclasses.dataclass(frozen=True)
class Region:
    """A library's optimizer update: ``module``.``cls``.``method`` is wrapped; instances of
    classes defined in modules under ``family`` (and not ``excluded``) are eligible;
    ``returns(optimizer)`` is what a skipped call hands back."""

    module: str
    cls: str
    method: str
    family: str
    excluded: tuple = ()
    returns: object = None


def _iterations(optimizer):
    return optimizer.iterations


REGIONS = (
    Region("keras.src.optimizers.base_optimizer", "BaseOptimizer", "apply",
           "keras.src.optimizers.", ("keras.src.optimizers.loss_scale_optimizer",)),
    Region("tf_keras.src.optimizers.optimizer", "Optimizer", "apply_gradients",
           "tf_keras.src.optimizers.", ("tf_keras.src.optimizers.legacy",
                                        "tf_keras.src.mixed_precision"), _iterations),
) + tuple(Region(f"sonnet.src.optimizers.{m}", c, "apply", "sonnet.src.optimizers.")
          for m, c in (("adam", "Adam"), ("sgd", "SGD"), ("momentum", "Momentum"),
                       ("rmsprop", "RMSProp")))

_installed = set()  # (module, class, method) wrapped already


def install():
    """Wrap the update method of every library in ``REGIONS`` that is imported already."""
    for region in REGIONS:
        key = (region.module, region.cls, region.method)
        module = sys.modules.get(region.module)
        if key in _installed or module is None:
            continue
        cls = getattr(module, region.cls, None)
        original = getattr(cls, region.method, None)
        if original is None:
            continue
        _installed.add(key)
        setattr(cls, region.method, _wrap(original, region))


def _wrap(original, region):
    @functools.wraps(original)
    def update(self, *args, **kwargs):
        rt = runtime.current()
        if rt is None or rt.phase not in ("tracing", "coexecution") or rt.regions.depth or \
                not context.executing_eagerly() or rt.update_owner != threading.get_ident():
            return original(self, *args, **kwargs)
        rt.regions.depth += 1
        try:
            return rt.regions.call(rt, region, original, self, args, kwargs)
        finally:
            rt.regions.depth -= 1
    return update


class _State:
    """What one runtime knows of one optimizer: its attributes after its last call, and why
    its regions are off (None while on)."""

    __slots__ = ("last", "off", "schedule", "guards")

    def __init__(self):
        self.last = None
        self.off = None
        self.schedule = None  # the user's learning-rate schedule, watched as it runs
        self.guards = None  # user_layers.Guards of the schedule, after a call ran


class LibraryRegions:
    """The regions of one runtime: the state per optimizer, and how many calls co-execution
    skipped."""

    def __init__(self, note):
        self.note = note  # EventLog.note
        self.offs = 0  # regions turned off: traces before one recorded it as a region
        self.depth = 0  # inside a region: a nested update is part of it
        self.skipped = 0
        self._states = weakref.WeakKeyDictionary()

    def call(self, rt, region, original, opt, args, kwargs):
        # an iterator (tf_keras takes ``zip(grads, variables)``) is read once, here
        args = tuple(list(a) if isinstance(a, Iterator) else a for a in args)
        try:
            guard = self._guard(region, opt, args, kwargs)
        except Exception as err:  # noqa: BLE001 - Terra's own failure: the update runs eagerly
            rt.fail_safe(err)
            state = self._states.get(opt)
            if state is not None:
                state.off = f"Terra error {type(err).__name__}"
            guard = None
        if guard is None:
            return original(opt, *args, **kwargs)
        state, before, attrs, tensors = guard
        monitor = user_layers.Monitor() if state.schedule is not None else None
        if rt.phase == "coexecution" and rt.runner.it is not None:
            stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped()
            # True: skipped (or run by the replay of a fallback); False: the per-op path
            if rt.marks.coexec(lambda: rt.runner.library_call(attrs, tensors, stopped)):
                self.skipped += 1
                return region.returns(opt) if region.returns else None
        if rt.phase == "tracing":  # after a fallback, the replay's values for stand-ins
            rt.recorder.mark("call", attrs, [rt.tracing_door.real(t) for t in tensors])
        if monitor is None:
            result = original(opt, *args, **kwargs)
        else:  # the user's schedule runs inside: its Python is watched
            with monitor:
                result = original(opt, *args, **kwargs)
        try:
            self._after(opt, state, before, monitor)
        except Exception as err:  # noqa: BLE001 - as above
            rt.fail_safe(err)
        self._return(rt, attrs)
        return result

    def _guard(self, region, opt, args, kwargs):
        """Before the update: None if it is no region (and why, noted once), else what the
        region is matched and recorded by: (state, attributes, the marks' attrs, tensors)."""
        state = self._states.get(opt)
        if state is None:
            state = self._states[opt] = _State()
        if state.off is None and state.last is None:  # its first call: is it a region?
            why = _ineligible(opt, region)
            if why is not None:
                self._off(opt, state, why)
            state.schedule = users_schedule(opt, region)
        before = attributes(opt)
        if state.off is None and state.last is not None and before != state.last:
            self._off(opt, state, "its Python attributes changed between two calls: "
                      + changed_names(state.last, before))
        why = state.guards.changed() if state.guards is not None and state.off is None \
            else None
        if why is not None:
            self._off(opt, state, f"its learning-rate schedule {_name_of(state.schedule)}: "
                      + why)
        tensors, leaves = flatten_call(args, kwargs)
        if state.off is None and leaves is None:
            self._off(opt, state, "an argument is neither a tensor, a variable nor a number")
        if state.off is not None:
            state.last = before
            return None
        return state, before, (f"{region.cls}.{region.method}", leaves, hash(before)), tensors

    def _after(self, opt, state, before, monitor=None):
        """The update ran: one that changed the optimizer's attributes (after the first call,
        which builds its slots) or whose user's schedule had a Python side effect
        (``monitor``) turns its regions off."""
        after = attributes(opt)
        if monitor is not None and monitor.why is not None:
            what, where = monitor.why
            self._off(opt, state, f"its learning-rate schedule {_name_of(state.schedule)} "
                      f"has a Python side effect: {what} at {where.file}:{where.line}")
        elif state.last is not None and after != before:
            self._off(opt, state, "the update changed its Python attributes: "
                      + changed_names(before, after))
        elif monitor is not None:  # what its next calls are guarded by, this call's reads too
            read = dict(state.guards.read) if state.guards is not None else {}
            read.update(monitor.globals)
            state.guards = user_layers.Guards((state.schedule,), read)
        state.last = after

    def _return(self, rt, attrs):
        """The region's end: matched in co-execution (the per-op path), recorded in a trace."""
        if rt.phase == "coexecution" and rt.runner.it is not None and \
                rt.marks.coexec(lambda: rt.runner.mark("return", attrs, (), None)):
            return
        if rt.phase == "tracing":
            rt.recorder.mark("return", attrs)

    def _off(self, opt, state, why):
        state.off = why
        self.offs += 1
        self.note("library region off", f"{type(opt).__name__}: {why}; its updates take "
                  "the per-op path", user_location())


def _ineligible(opt, region):
    """Why ``opt``'s updates cannot be a region, or None."""
    cls = type(opt)
    module = cls.__module__
    if not module.startswith(region.family) or module.startswith(region.excluded):
        library = region.family.split(".")[0]
        return f"{cls.__module__}.{cls.__qualname__} is not {library}'s own class"
    schedule = getattr(opt, "_learning_rate", None)
    if callable(schedule) and not hasattr(schedule, "handle") and \
            not type(schedule).__module__.startswith(region.family):
        if users_schedule(opt, region) is None:
            return f"its learning-rate schedule {_name_of(schedule)} is not the library's"
        why = user_layers.ineligible(schedule, "__call__")
        if why is not None:
            return f"its learning-rate schedule {_name_of(schedule)}: {why}"
    return None


def users_schedule(opt, region):
    """``opt``'s learning-rate schedule if it is an object of the user's own class (defined
    outside any installed library, ``terra.boundary``), else None. A function of the user's
    (a lambda) has no class to check and keeps the per-op path."""
    schedule = getattr(opt, "_learning_rate", None)
    if not callable(schedule) or hasattr(schedule, "handle") or \
            isinstance(schedule, (type, types.FunctionType, types.MethodType)) or \
            type(schedule).__module__.startswith(region.family) or \
            not user_layers.is_users(type(schedule)):
        return None
    return schedule


def _name_of(schedule):
    return type(schedule).__qualname__


# What TF's checkpointing keeps on every trackable object (``Trackable``'s ``_self_*``: the
# update uid a save or restore bumps; tf_keras' optimizer's view of its children, made at the
# first save): no op reads them, and a checkpoint saved between two steps changes them.
_BOOKKEEPING = ("_self_", "_coalesced_children")


def attributes(obj, nested=True, watch=None):
    """The Python attributes of ``obj`` a region's ops may depend on: plain values by value,
    containers by identity and length, anything else by identity (a schedule of the library's
    also by its own attributes), checkpoint bookkeeping aside. ``watch`` (a :class:`Watch`)
    is told what was read."""
    d = vars(obj)
    if watch is not None:
        watch.bindings.append((d, tuple(d), tuple(d.values())))
    parts = []
    for name, value in d.items():
        if name.startswith(_BOOKKEEPING):
            continue
        kind = type(value)
        if kind in _PLAIN:
            parts.append((name, value))
        elif _spec(value):
            parts.append((name, _by_value(value)))
        elif isinstance(value, (list, tuple)) and value and all(map(_spec, value)):
            parts.append((name, tuple(map(_by_value, value))))
        elif isinstance(value, _CONTAINERS):  # Keras' TrackedList and TrackedDict too
            parts.append((name, id(value), len(value)))
            if watch is not None:
                watch.sized.append((value, len(value)))
        elif nested and callable(value) and hasattr(value, "get_config") and \
                hasattr(value, "__dict__"):
            parts.append((name, id(value), attributes(value, False, watch)))
        else:
            parts.append((name, id(value)))
    # by name: an attribute a call deletes and sets again (Keras' tracking does) moves to the
    # end of the object's dict, and is no change
    return tuple(sorted(parts, key=_name))


def _name(part):
    return part[0]


def _spec(value) -> bool:
    """Whether ``value`` is a description rather than a part of the computation: an object
    with a config that is not callable and holds plain values only (an ``InputSpec``, a
    dtype policy; not an optimizer, which holds variables). A layer may make new ones at
    every call with the same contents (tf_keras' RNN sets ``state_spec`` anew from its
    initial state's shapes): they are compared by their contents, not identity."""
    return not callable(value) and hasattr(value, "get_config") and \
        hasattr(value, "__dict__") and _plain(vars(value)) is not None


def _by_value(spec):
    return type(spec), _plain(vars(spec))


def _plain(x):
    """``x`` as a hashable value if it is made of plain values only (lists, tuples and dicts
    of them), else None. Reads no tensor: a guard must issue no op."""
    if type(x) in _PLAIN:
        return (x,)
    if isinstance(x, (list, tuple)):
        parts = tuple(map(_plain, x))
        return None if None in parts else (type(x).__name__, parts)
    if isinstance(x, dict):
        parts = tuple((k, _plain(v)) for k, v in x.items())
        if any(v is None or type(k) not in _PLAIN for k, v in parts):
            return None
        return "dict", tuple(sorted(parts, key=repr))
    return None


class Watch:
    """A quick test that :func:`attributes` would give what it gave: the dicts it read bind
    the same names to the very same objects (held here, so that no ``id`` is reused) and the
    containers among them have the same lengths. Where that holds, every part is the same:
    a plain value is the same object, anything else the same identity. Where it does not,
    the attributes may still be equal (a float bound anew to the same value): compute them
    again. A layer's guard reads them at every call; this test costs a fraction of that."""

    __slots__ = ("bindings", "sized")

    def __init__(self):
        self.bindings = []  # (dict, its names, its values)
        self.sized = []  # (container, its length)

    def unchanged(self) -> bool:
        for d, names, values in self.bindings:
            if len(d) != len(names) or not all(map(operator.is_, d.values(), values)) or \
                    tuple(d) != names:
                return False
        return all(len(c) == n for c, n in self.sized)


def changed_names(old, new):
    names = [n[0] for n in set(new) - set(old)] + [o[0] for o in set(old) - set(new)]
    return ", ".join(sorted(set(names))) or "their order"


def flatten_call(args, kwargs):
    """The call's tensors (a variable as its handle), the mark's inputs, and the structure
    a skipped call must have had (``"t"`` for a tensor, any other leaf by value); None for
    the structure if a leaf is something else."""
    tensors, leaves = [], []
    for x in nest.flatten((args, kwargs), expand_composites=True):
        x = handle_or_self(x)
        if type(x) is _EagerTensor:
            tensors.append(x)
            leaves.append("t")
        elif type(x) in _PLAIN:
            leaves.append(x)
        else:  # not checkable: the same object or another, the graph would not know
            return tensors, None
    return tensors, tuple(leaves)
