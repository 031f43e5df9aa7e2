"""Layer regions: a call of a library's Keras layer the skeleton skips, returning stand-ins.

After the optimizer update, the forward pass is where the co-executed Python spends its time:
Keras' ``Layer.__call__`` resolves arguments, masks, dtypes and name scopes, then the layer's
``call`` issues its ops, every step, although the graph holds those ops and Python looks at
none of their values. A call of a layer whose whole Python is Keras' own is therefore
recorded between two marks, like a library region (``terra.library_regions``): ``call``
(its tensor arguments as inputs) and ``return`` (the tensors it returned). Where the plan runs
the ops between them straight through (``path.skippable_layer``), the PythonRunner feeds the
arguments the ops read, moves past the region, and hands Python stand-ins for what the call
returned (``PythonRunner.layer_call``); ``Layer.__call__`` is not run at all.

Skipping Python is right only if it would have issued the same ops, so a call is guarded like
a compiler guards a specialization:

- the layer, and every layer inside it, is an instance of a library's class (Keras 3's or
  tf_keras', ``terra.keras_families``, or a layer library's built on them: where it is
  installed says, ``terra.boundary``; not a subclass the user wrote, not ``Lambda`` or a
  preprocessing layer, whose Python is the user's or reads data), with no activity
  regularizer and no function of the user's among its attributes (an activation given as
  a Python function);
- its tensor arguments are the same producers as in the traces, with the shapes of a
  traced call or of a call of it that co-execution ran op by op (its ops validated with
  those shapes, it returned tensors of shapes Python then knows: a sequence length that
  changes per batch costs one call per length run op by op); its other arguments
  (``training=True``) are equal; so is what Keras passes down (the ``training`` of an outer
  call, the autocast scope, tf_keras' global learning phase: ``Family.scope``);
- the Python attributes of the layer and of each layer inside it (numbers and strings by
  value, anything else by identity: ``Dropout.rate``, a sublayer replaced) are what they
  were when it was traced; a call that changes them itself (other than its first, which
  builds the layer), or attributes changed from outside between two calls, turn its regions
  off for the rest of the run, with an ``explain()`` note;
- what it returned is tensors the region's ops produced, or its own arguments, in lists,
  tuples and dicts, with no Python attribute on them (a Keras mask; a softmax's
  ``_keras_logits``, from which a loss computes on the logits), no loss added on the way.

Calls nested inside a region are part of it; a layer that is no region (the user's own
subclass) runs as usual and its built-in sublayers are regions of their own.
"""

import functools
import itertools
import operator
import sys
import threading
import types
import weakref

from tensorflow.python.eager import context

from terra import boundary, function_regions, interception, runtime, user_layers
from terra.keras_families import FAMILIES
from terra.library_regions import Watch, attributes, changed_names, flatten_call
from terra.location import in_user_loop, user_location
from terra.nodes import FUNCTION_TOKEN, NodeKind
from terra.region_values import argument_reads, decode, encode
from terra.skips import Learn

_installed = []


def install():
    """Wrap ``Layer.__call__`` of each Keras imported already (Keras 3, tf_keras)."""
    for family in FAMILIES:
        cls = family.layer_class()
        if cls is not None and cls not in _installed:
            _installed.append(cls)
            cls.__call__ = _wrap(cls.__call__, family)


def _wrap(original, family):
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        rt = runtime.current()
        if rt is None or rt.phase not in ("tracing", "coexecution") or rt.layers.depth or \
                rt.regions.depth or not context.executing_eagerly() or \
                rt.layer_owner != threading.get_ident():
            return original(self, *args, **kwargs)
        return rt.layers.call(rt, original, self, args, kwargs, family)

    return __call__


class _State:
    """What one runtime knows of one layer: the attributes of it and its sublayers after its
    last call, why its calls are no regions (None while they may be), and a number no other
    layer's state has: a call mark names its layer by it (two Dense layers called alike are
    told apart, and a layer made anew gets a new number where it could get an old ``id``)."""

    __slots__ = ("last", "off", "token", "mixed", "users", "guards")
    _tokens = itertools.count()

    def __init__(self, off):
        self.last = None
        self.off = off
        self.token = next(self._tokens)
        self.mixed = set()  # the user's lines that called it with an argument no tensor
        self.users = False  # it or a layer inside it is the user's (``terra.user_layers``)
        self.guards = None  # user_layers.Guards, after its first call ran


class LayerRegions:
    """The layer regions of one runtime: the state per layer, and how many calls
    co-execution skipped."""

    def __init__(self, note):
        self.note = note  # EventLog.note
        self.offs = 0  # regions turned off: traces before one recorded it as a region
        self.depth = 0  # inside a region: nested layer calls are part of it
        self.skipped = 0
        self.skipped_functions = 0
        self._states = weakref.WeakKeyDictionary()

    def call(self, rt, original, layer, args, kwargs, family):
        # one line calls a layer that is no region: the ops its call issues are located by
        # their call stack, which must be the same in every iteration. A call in a loop's
        # body is none (a loop's trips are rolled into one While only if they are ops
        # alike), unless the loop is over layers and this one is in the trip's layer
        guard = None if in_user_loop(sys._getframe(2), rt.entry, _holds(layer)) else \
            self._region_guard(rt, layer, args, kwargs, family)
        if guard is None:
            return original(layer, *args, **kwargs)
        state, before, attrs, tensors = guard
        monitor = user_layers.Monitor() if state.users else None

        def run():  # the user's Python is watched whenever it runs (traced, or op by op)
            if monitor is None:
                return original(layer, *args, **kwargs)
            with monitor:
                return original(layer, *args, **kwargs)

        def after(err=None):  # the call ran: may a later one be skipped? (``err``: Terra's
            if err is not None:  # own failure on the way: no more regions for the layer)
                state.off = f"Terra error {type(err).__name__}"
                return False
            self._after(layer, state, before, family, monitor)
            return state.off is None

        self.depth += 1
        try:
            return self._region(rt, run, attrs, tensors, after)
        finally:
            self.depth -= 1

    def function(self, rt, original, name, args, kwargs):
        """A call of one of TF's functions (``terra.function_regions``): a region of its own
        where its arguments are tensors and plain values, else run as usual."""
        try:
            if rt.phase == "tracing" and rt.recorder.region_site is not None:
                found = None  # in a gradient region (TF's gradient functions slice): its ops
            else:
                found = function_regions.encode(args, kwargs)
            if found is not None and rt.phase == "coexecution" and rt.runner.it is not None \
                    and not function_regions.marked_here(rt.runner, name):
                found = None  # in a rolled loop's body: its ops alone
        except Exception as err:  # noqa: BLE001 - Terra's own failure: the call runs as usual
            rt.fail_safe(err)
            found = None
        if found is None:
            return original(*args, **kwargs)
        tensors, leaves, ints = found
        self.depth += 1
        try:
            return self._region(rt, lambda: original(*args, **kwargs),
                                (name, FUNCTION_TOKEN, leaves, None), tensors, None, ints)
        finally:
            self.depth -= 1

    def branched(self, tracegraph) -> bool:
        """Turn off the regions of the user's layers whose calls' ops differ between traces
        with equal marks (a dropout inside that runs in training calls only, the traces'
        nodes merged after the marks): such a region is never skipped, and the library
        layers inside it would be regions of their own. Whether one was turned off."""
        users = {state.token: (layer, state) for layer, state in self._states.items()
                 if state.users and state.off is None}
        found = False
        for node in tracegraph.nodes if users else ():
            if node.kind is NodeKind.MARK and node.op_type == "call" and \
                    len(node.attrs) > 1 and node.attrs[1] in users and _branches(node):
                layer, state = users.pop(node.attrs[1])
                self._off(layer, state, "its calls' ops differ between traces (a branch "
                          "inside it), so the layers inside it are regions of their own")
                found = True
        return found

    def _region_guard(self, rt, layer, args, kwargs, family):
        """None if this call is no region, else (state, attributes, attrs, tensors)."""
        state = self._states.get(layer)
        if state is None:
            state = self._states[layer] = _State(None)
            why, state.users = _ineligible(layer, family)
            if why is not None and (state.users or not family.excludes(type(layer))):
                self._off(layer, state, why)  # a library's or the user's layer that could
            state.off = why  # have been a region: say why it runs its Python
        if state.off is not None:
            return None
        try:
            guard = self._guard(layer, state, args, kwargs, family)
        except Exception as err:  # noqa: BLE001 - Terra's own failure: the call runs as usual
            rt.fail_safe(err)
            state.off = f"Terra error {type(err).__name__}"
            return None
        return None if guard is None else (state, *guard)

    def _region(self, rt, run, attrs, tensors, after, ints=None):
        """The region's call: skipped, learned or recorded. ``run()`` runs it; ``after()``
        (None: always true) says whether its later calls may still be skipped, ``after(err)``
        that Terra failed on the way; ``ints``: a function's integer arguments."""
        if rt.phase == "coexecution" and rt.runner.it is not None:
            stopped = interception.tapes_stopped[0]  # as a lane reads it: no call into TF
            at = rt.runner.cur
            try:
                skipped = rt.runner.layer_call(attrs, tensors, stopped, ints)
            except Exception as why:  # noqa: BLE001 - as an op's: a call past the end of the
                # path (a model evaluated after the loop) closes the iteration
                skipped = why.result if rt.handle(why, at) else None
            if type(skipped) is tuple:  # skipped, or run by the replay of a fallback
                if attrs[1] == FUNCTION_TOKEN:
                    self.skipped_functions += 1
                else:
                    self.skipped += 1
                return decode(*skipped, tensors)
            learn = skipped if type(skipped) is Learn else None
        else:
            learn = None
        record = None
        if rt.phase == "tracing":  # after a fallback, the replay's values for stand-ins
            real = [rt.tracing_door.real(t) for t in tensors]
            record = rt.recorder.mark("call", attrs, real)
            begin, customs = len(rt.recorder.records), rt.recorder.custom_gradients
        outputs = run()
        found = None
        try:
            on = after is None or after()
            returned, found = encode(outputs, tensors)
            if record is not None:  # what the traces tell about the region, for the skip
                feeds = argument_reads(rt.recorder, begin, real)
                # a custom gradient's backward function is Python's: no skip replays it
                skip = on and rt.recorder.custom_gradients == customs
                record.attrs = attrs + (found if skip else None, feeds)
        except Exception as err:  # noqa: BLE001 - Terra's own failure: the call ran as usual
            rt.fail_safe(err)
            returned = []
            if after is not None:
                after(err)
            if record is not None:
                record.attrs = attrs + (None, ())
        if self._return(rt, returned, attrs[1] == FUNCTION_TOKEN) and learn is not None and \
                rt.phase == "coexecution":
            rt.runner.learn(learn, found, returned)
        return outputs

    def _guard(self, layer, state, args, kwargs, family):
        """Before a call: None if it is no region (and why, noted once), else the layer's
        attributes, the call mark's attrs and its tensors."""
        if not layer.built:  # its first call builds it: variables made, no region
            return None
        before = _attributes(layer, family, state.last)
        if state.last is not None and before != state.last:
            return self._off(layer, state, "its Python attributes changed between two calls: "
                             + _changed(layer, state.last, before))
        why = state.guards.changed() if state.guards is not None else None
        if why is not None:
            return self._off(layer, state, why)
        tensors, leaves = flatten_call(args, kwargs)
        # a call with an argument that is neither a tensor nor a number (a NumPy batch) runs
        # its Python, and so does every later call of the layer from the same line, whatever
        # its arguments: a line's calls take one path (a tensor there later would be a new
        # path, a fallback); the layer's calls from other lines may still be regions
        if leaves is None or state.mixed and user_location() in state.mixed:
            if leaves is None and not state.mixed:
                self.note("layer call not skipped", f"{type(layer).__name__} {layer.name!r}: "
                          "an argument is neither a tensor nor a number (a NumPy array: "
                          "tf.constant(...) makes it one); its calls from this line run "
                          "their Python", user_location())
            if leaves is None:
                state.mixed.add(user_location())
            return None
        scope = family.scope(layer)
        if scope is None:
            return self._off(layer, state, "it is called inside a stateless scope")
        # the attributes are not in the attrs: any change since the last call turns the
        # regions off, so those of a skipped call are those of the traced ones
        return before, (f"{type(layer).__qualname__}.__call__", state.token, leaves, scope), \
            tensors

    def _after(self, layer, state, before, family, monitor=None):
        """The call ran: one that changed the layer's attributes (after its first call,
        which builds it), added a loss or, the user's, had a Python side effect
        (``monitor``) turns its regions off."""
        after = _attributes(layer, family, before)
        if monitor is not None and monitor.why is not None:
            what, where = monitor.why
            self._off(layer, state, f"its Python has a side effect: {what} at {where.file}:"
                      f"{where.line}")
        elif state.last is not None and after != before:
            self._off(layer, state, "the call changed its Python attributes: "
                      + _changed(layer, before, after))
        elif any(family.losses(sub) for sub in layer._flatten_layers()):
            self._off(layer, state, "its call added a loss")
        elif monitor is not None:  # what its next calls are guarded by, this call's reads too
            read = dict(state.guards.read) if state.guards is not None else {}
            read.update(monitor.globals)
            state.guards = user_layers.Guards(after.layers, read)
        state.last = after

    def _return(self, rt, returned, function):
        """The region's end: matched in co-execution (the per-op path), recorded in a trace.
        A function's ``return`` mark says so (``nodes.function_mark``)."""
        attrs = ("return", FUNCTION_TOKEN) if function else ("return",)
        if rt.phase == "coexecution" and rt.runner.it is not None and \
                rt.marks.coexec(lambda: rt.runner.mark("return", attrs, returned, None)):
            return True
        if rt.phase == "tracing":
            rt.recorder.mark("return", attrs, [rt.tracing_door.real(t) for t in returned])
        return False

    def _off(self, layer, state, why):
        state.off = why
        self.offs += 1
        self.note("layer region off", f"{type(layer).__name__} {layer.name!r}: {why}; its "
                  "calls run their Python", user_location())


def _branches(call) -> bool:
    """Whether the TraceGraph's nodes after ``call`` (a ``call`` mark) branch before the
    next mark."""
    node = call
    while len(node.succs) == 1:
        node = node.succs[0]
        if node.kind is NodeKind.MARK:
            return False
    return True


def _holds(layer):
    """Whether a loop variable's value is ``layer`` or a layer holding it."""
    def holds(value):
        return value is layer or hasattr(value, "_flatten_layers") and \
            any(sub is layer for sub in value._flatten_layers())
    return holds


def _ineligible(layer, family):
    """(why ``layer``'s calls cannot be regions or None, whether it or a layer inside it is
    the user's)."""
    users = False
    for sub in layer._flatten_layers():
        cls = type(sub)
        if cls.__module__.startswith(family.excluded):
            return f"{cls.__module__}.{cls.__qualname__} is not a library's layer class", users
        if user_layers.is_users(cls):
            users = True
            why = user_layers.ineligible(sub)
            if why is not None:
                return f"{sub.name!r}: {why}", users
        elif family.excludes(cls):
            return f"{cls.__module__}.{cls.__qualname__} is not a library's layer class", users
        elif not _library_code(cls.call):
            return f"{cls.__qualname__}.call is not a library's", users
        if getattr(sub, "activity_regularizer", None) is not None:
            return f"{sub.name!r} has an activity regularizer", users
        for name, value in vars(sub).items():
            if isinstance(value, (types.FunctionType, types.MethodType)) and \
                    not _library_code(value) and getattr(value, "__self__", None) is not sub:
                return f"{sub.name!r}.{name} is a function of the user's", users
    return None, users


def _library_code(function) -> bool:
    """Whether ``function``'s Python is a library's (``terra.boundary``); one without
    Python code (a builtin) is."""
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    return code is None or boundary.is_library(code.co_filename)


class _Attributes:
    """The Python attributes of a layer and of every layer inside it (``value``: a tuple of
    parts per layer, :func:`attributes`), with the layers and the :class:`Watch` that tells
    cheaply when they are unchanged."""

    __slots__ = ("value", "layers", "watch")

    def __init__(self, value, layers, watch):
        self.value, self.layers, self.watch = value, layers, watch

    def __eq__(self, other):
        return self.value == other.value

    __hash__ = None


def _attributes(layer, family, seen=None):
    """The Python attributes of ``layer`` and of every layer inside it (but a model's
    training-loop state, which its ``call`` does not read: ``fit`` changes it every epoch).
    ``seen`` (attributes computed before) is returned itself where the same layers and the
    watch show that nothing changed since."""
    layers = tuple(layer._flatten_layers())
    if seen is not None and len(layers) == len(seen.layers) and \
            all(map(operator.is_, layers, seen.layers)) and seen.watch.unchanged():
        return seen
    trainer = family.trainer_state
    watch = Watch()
    value = tuple(tuple(a for a in attributes(sub, watch=watch) if a[0] not in trainer)
                  for sub in layers)
    return _Attributes(value, layers, watch)


def _changed(layer, old, new):
    """Which attributes of which of ``layer``'s layers differ between ``old`` and ``new``."""
    return "; ".join(f"{sub.name}: {changed_names(a, b)}" for sub, a, b in
                     zip(layer._flatten_layers(), old.value, new.value, strict=False)
                     if a != b) or \
        "its layers"
