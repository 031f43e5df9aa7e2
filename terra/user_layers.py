"""The user's own layer subclasses as layer regions: when their Python may be skipped.

A user's ``call`` that only issues TF ops, reads attributes and calls library layers does
nothing a skipped call would leave out: the graph holds its ops, and Python looks at none of
their values. Such a layer is a region like a library's (``terra.layer_regions``). Its Python
is the user's, though, so what Keras' own code is trusted with is checked here instead:

- **Before its first traced call** (:func:`ineligible`), from the bytecode of each user
  class's ``call`` and the layer's attributes: a ``call`` that assigns an attribute, an item
  or a global (a counter: ``self.calls += 1``), or an attribute the guards could not watch
  (a NumPy array, an object of the user's class: changed in place, the graph would not know),
  keeps the layer's Python running.
- **While a call runs its Python** (traced, or run op by op in co-execution: :class:`Monitor`,
  ``sys.setprofile`` on the loop's thread), every call the user's code makes is looked at:
  into TensorFlow, Keras or Terra (ops, layers, shapes) or a pure builtin (``len``,
  ``isinstance``, ``math``), an append to a list of its own; anything else is a Python side
  effect the graph cannot repeat (``print``, NumPy, ``random``, an append to a list it did
  not make, a tensor's value read with ``.numpy()``, ``float()``, ``if``), and the layer's
  regions are turned off for the run, ``explain()`` naming the line. User functions it calls
  are checked like its ``call``.
- **Every later call** (:class:`Guards`): the globals its code read are the same objects
  (plain values and containers of them: equal), and so are its classes' methods; the
  attributes are watched as a library layer's are (``layer_regions._attributes``), plain
  containers by their contents.

A side effect found only on a later shape's path is found when that shape's call runs op by
op, before any call of it is skipped (``skips.Learned``).
"""

import builtins
import dis
import inspect
import operator
import sys
import types

from terra import boundary, library_regions  # (which imports this module: names read late)
from terra.location import Location

# opcodes whose effect outlives the call: assigning an attribute, an item, a global, a
# variable of an enclosing function
_STORES = {"STORE_ATTR": "assigns the attribute", "DELETE_ATTR": "deletes the attribute",
           "STORE_GLOBAL": "assigns the global", "DELETE_GLOBAL": "deletes the global",
           "STORE_SUBSCR": "assigns an item", "DELETE_SUBSCR": "deletes an item"}
# builtins that read what they are given and change nothing
_PURE = frozenset(id(f) for f in (
    builtins.len, builtins.isinstance, builtins.issubclass, builtins.getattr, builtins.hasattr,
    builtins.callable, builtins.min, builtins.max, builtins.abs, builtins.sum, builtins.any,
    builtins.all, builtins.sorted, builtins.round, builtins.divmod, builtins.pow,
    builtins.iter, builtins.next, builtins.hash))
_PURE_MODULES = ("math", "operator", "_operator")
_READ_METHODS = frozenset({"get", "keys", "values", "items", "index", "count", "copy",
                           "__getitem__", "__contains__", "__len__", "__iter__", "startswith",
                           "endswith", "join", "split", "format", "lower", "upper", "strip",
                           "replace"})
_GROW_METHODS = frozenset({"append", "extend", "insert"})
_MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "update",
                       "setdefault", "popitem", "reverse", "add", "discard", "__iadd__",
                       "__ior__", "__setitem__", "__delitem__"})
_CONTAINERS = (list, tuple, dict, str, set, frozenset, bytes)
# a library's Python the user's code may call: ops, layers, shapes, Terra's own wrappers
_LIBRARIES = frozenset({"tensorflow", "keras", "tf_keras", "terra"})
# a tensor's value read into Python: the value differs every step, the graph cannot say
_VALUE_READS = frozenset({"numpy", "__array__", "__float__", "__int__", "__index__",
                          "__bool__", "__complex__", "item", "tolist", "__format__",
                          "__repr__", "__str__"})
_MISSING = object()
_DEFINITIONS = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)
_stores = {}  # code -> (why, line) or None
_loads = {}  # code -> names of the globals it reads


def is_users(cls) -> bool:
    """Whether the layer class ``cls`` is the user's (defined outside any installed library:
    ``terra.boundary``)."""
    code = getattr(vars(cls).get("call"), "__code__", None)
    module = sys.modules.get(cls.__module__)
    filename = getattr(module, "__file__", None) or (code.co_filename if code else None)
    return filename is not None and not boundary.is_library(filename)  # (not ``object``)


def ineligible(obj, method="call"):
    """Why the user's ``obj`` (a layer; a learning-rate schedule, ``method`` ``__call__``)
    cannot be a region before any call of it ran, or None: its class's ``method`` writes
    Python state, or an attribute holds what no guard can watch. A schedule is called inside
    a library optimizer's update, so the same check decides whether that update may be
    skipped (``terra.library_regions``)."""
    call = getattr(type(obj), method, None)
    code = getattr(call, "__code__", None)
    if code is None:
        return f"{type(obj).__qualname__}.{method} is no Python function"
    if boundary.is_library(code.co_filename):
        pass  # a library's call (a subclass that overrides other methods): watched as it runs
    elif call.__closure__ and code.co_freevars != ("__class__",):
        return f"{type(obj).__qualname__}.{method} reads variables of an enclosing function"
    else:
        found = _store(code)
        if found is not None:
            what, line = found
            return f"its {method} {what} ({code.co_filename}:{line})"
    names = _users_attributes(type(obj))
    for name, value in vars(obj).items():
        if name in names and not _watchable(value):
            return (f"its attribute {name!r} is a {type(value).__qualname__}, whose contents "
                    "no guard watches")
    return None


def _users_attributes(cls):
    """The attribute names the user's classes among ``cls``' bases assign (``self.x = ...``
    in any of their functions): the attributes Keras keeps for itself are watched as for a
    library's layer."""
    names = set()
    for c in cls.__mro__:
        if is_users(c):
            for fn in vars(c).values():
                code = getattr(fn, "__code__", None)
                if code is not None:
                    names.update(ins.argval for ins in dis.get_instructions(code)
                                 if ins.opname == "STORE_ATTR")
    return names


def _watchable(value) -> bool:
    """Whether a guard sees every change of ``value`` that could change the ops: a plain
    value or container of them (by contents), a library's object (as for a library layer:
    by identity, its own attributes where it is a layer), a layer, a tensor or variable."""
    if _plain(value) is not None or value is None:
        return True
    if isinstance(value, (list, tuple, dict)):
        items = value.values() if isinstance(value, dict) else value
        return all(map(_watchable, items))
    if isinstance(value, (types.FunctionType, types.MethodType)):
        return True  # (``layer_regions._ineligible`` decides on functions)
    if hasattr(value, "_flatten_layers") or isinstance(value, inspect.Signature):
        return True  # a layer (guarded itself, as a layer inside the region); immutable
    module = (type(value).__module__ or "").split(".")[0]
    return module in _LIBRARIES or module == "builtins" and callable(value)


def _plain(x):
    """``x`` as a hashable value if it is made of plain values only (``library_regions``'
    lists, tuples and dicts, and sets: tf_keras keeps the names of a call's context
    arguments in one), else None."""
    if isinstance(x, (set, frozenset)):
        return ("set", frozenset(x)) if all(type(v) in library_regions._PLAIN for v in x) \
            else None
    return library_regions._plain(x)


def _store(code):
    """(what, line) of the first instruction of ``code`` that writes state outliving the
    call, or None."""
    if code in _stores:
        return _stores[code]
    found, line, names = None, code.co_firstlineno, []
    free = set(code.co_freevars)
    for ins in dis.get_instructions(code):
        if ins.starts_line is not None:
            line = ins.starts_line
        if ins.opname == "LOAD_GLOBAL":
            names.append(ins.argval)
        if found is not None:
            continue
        if ins.opname in _STORES:
            arg = f" {ins.argval}" if isinstance(ins.argval, str) else ""
            found = (f"{_STORES[ins.opname]}{arg}", line)
        elif ins.opname in ("STORE_DEREF", "DELETE_DEREF") and ins.argval in free:
            found = (f"assigns {ins.argval} of an enclosing function", line)
    _stores[code] = found
    _loads[code] = tuple(dict.fromkeys(names))
    return found


def _users(code) -> bool:
    """Whether ``code`` is the user's own: not a library's, and not code Python generated
    (a named tuple's ``__new__``, a dataclass' ``__init__``: ``<string>``)."""
    name = code.co_filename
    return not name.startswith("<") and not boundary.is_library(name)


class Monitor:
    """Watches the Python of one call of a user's layer (``with monitor: ...``): ``why`` is
    the first side effect seen and where, ``globals`` what the user's code read of its
    modules' globals. Where another tool's profile function is set (a profiler's), nothing
    is watched and the call counts as having a side effect."""

    __slots__ = ("why", "globals", "_before")

    def __init__(self):
        self.why = None
        self.globals = {}  # (id of the module's dict, name) -> (dict, name)

    def __enter__(self):
        self._before = sys.getprofile()
        if self._before is None:
            sys.setprofile(self._event)
        else:  # another tool's (cProfile's is no Python function to pass events on to)
            code = sys._getframe(1).f_code
            self.why = ("another tool's profile function is set, so its Python cannot be "
                        "watched", Location(code.co_filename, code.co_firstlineno,
                                            code.co_name))
        return self

    def __exit__(self, *exc):
        if self._before is None:
            sys.setprofile(None)

    def _event(self, frame, event, arg):
        if self.why is not None:
            return
        try:  # (an exception here would be raised in the user's code)
            if event == "call":
                code = frame.f_code
                if _users(code):
                    self._enter_users(frame, code)
                elif frame.f_back is not None and _users(frame.f_back.f_code):
                    self._library(frame, code)
                elif code is _eager_cond():
                    self._cond(frame)
            elif event == "c_call" and _users(frame.f_code):
                self._builtin(frame, arg)
        except Exception as err:  # noqa: BLE001 - Terra's own failure: the layer runs its Python
            self._seen(frame, f"Terra error {type(err).__name__} while watching it")

    def _enter_users(self, frame, code):
        found = _store(code)
        if found is not None:
            self.why = (f"{found[0]} in {code.co_name}",
                        Location(code.co_filename, found[1], code.co_name))
            return
        module = frame.f_globals
        for name in _loads[code]:
            if name in module:
                value = module[name]
                if not isinstance(value, _DEFINITIONS) and _plain(value) is None and \
                        not _watchable(value):
                    self.why = (f"reads the global {name}, a {type(value).__qualname__} whose "
                                "contents no guard watches",
                                Location(code.co_filename, code.co_firstlineno, code.co_name))
                    return
                self.globals[(id(module), name)] = (module, name)

    def _library(self, frame, code):
        caller = frame.f_back
        module = frame.f_globals.get("__name__") or ""
        if code.co_name in _VALUE_READS:
            self._seen(caller, f"reads a tensor's value ({code.co_name})")
        elif module in ("collections.abc", "_collections_abc") and \
                code.co_name not in _MUTATORS:
            return  # a container protocol's reading method (iterating a tracked list)
        elif module.split(".")[0] not in _LIBRARIES:
            self._seen(caller, f"calls {module}.{code.co_qualname}")

    def _cond(self, frame):
        """TF's eager ``tf.cond`` reads its predicate's value and runs one branch in Python:
        called by the user's code on a tensor, that is a Python branch on a value, which no
        skipped call could take (a Python ``bool`` or number as the predicate is none)."""
        pred = frame.f_locals.get("pred")
        if isinstance(pred, (bool, int, float)) or type(pred).__module__ == "numpy":
            return
        caller = frame.f_back
        for _ in range(8):  # through TF's dispatch and deprecation wrappers
            if caller is None or _users(caller.f_code):
                break
            caller = caller.f_back
        if caller is not None and _users(caller.f_code):
            self._seen(caller, "branches on a tensor's value (eager tf.cond runs one branch "
                       "in Python; tf.where keeps both in the graph)")

    def _builtin(self, frame, fn):
        if id(fn) in _PURE:
            return
        owner = getattr(fn, "__self__", None)
        name = getattr(fn, "__name__", "?")
        if type(owner) is types.ModuleType:
            if owner.__name__ in _PURE_MODULES or \
                    owner.__name__.split(".")[0] in _LIBRARIES and owner.__name__ != "builtins":
                return
        elif type(owner) in _CONTAINERS:
            if name in _READ_METHODS:
                return
            if name in _GROW_METHODS and type(owner) is list and _own(frame, owner):
                return  # a list the call made for itself (``outputs.append(h)``)
        self._seen(frame, f"calls {name}")

    def _seen(self, frame, what):
        code = frame.f_code
        self.why = (what, Location(code.co_filename, frame.f_lineno, code.co_name))


_cond_code = []


def _eager_cond():
    """The code of TF's eager ``tf.cond`` (read once, at the first call event)."""
    if not _cond_code:
        from tensorflow.python.ops import cond
        found = getattr(cond, "_eager_cond_implementation", None)  # (TF's private name)
        _cond_code.append(getattr(found, "__code__", None))
    return _cond_code[0]


def _own(frame, value) -> bool:
    """Whether ``value`` is bound to one of ``frame``'s local variables and is neither one of
    its module's globals nor an attribute of its ``self``: a list the call made (an alias of
    a global or an attribute would show in the guards only after the fact)."""
    local = frame.f_locals
    owner = local.get("self")
    outside = [*frame.f_globals.values(), *getattr(owner, "__dict__", {}).values()]
    return any(v is value for v in local.values()) and not any(v is value for v in outside)


class Guards:
    """What a user's region (a layer's, or an optimizer update calling the user's schedule)
    rests on besides its attributes, read again before each call: the globals its code read,
    its classes' dicts (their methods), and its plain containers by contents. ``layers``:
    the user's objects whose Python the region holds."""

    __slots__ = ("read", "globals", "classes", "containers")

    def __init__(self, layers, read):
        self.read = read  # (id of a module's dict, name) -> (the dict, name)
        self.globals = tuple((d, name, d.get(name, _MISSING), _plain(d.get(name)))
                             for d, name in read.values())
        self.classes = tuple((c.__dict__, tuple(c.__dict__.values())) for c in
                             {c for sub in layers if is_users(type(sub))
                              for c in type(sub).__mro__ if is_users(c)})
        self.containers = tuple((sub, _containers(sub)) for sub in layers
                                if is_users(type(sub)))

    def changed(self):
        """What changed since they were read, or None."""
        for d, name, value, plain in self.globals:
            now = d.get(name, _MISSING)
            if plain is None and now is not value or plain is not None and \
                    (now is not value or type(now) in (list, dict, set)) and _plain(now) != plain:
                return f"the global {name} it reads changed"
        for d, values in self.classes:
            if len(d) != len(values) or not all(map(operator.is_, d.values(), values)):
                return "a method of its class changed"
        for sub, contents in self.containers:
            if _containers(sub) != contents:
                name = getattr(sub, "name", None) or type(sub).__qualname__
                return f"the contents of an attribute of {name!r} changed"
        return None


def _containers(layer):
    """``layer``'s plain lists, tuples and dicts, by contents."""
    return tuple((name, p) for name, value in vars(layer).items()
                 if isinstance(value, (list, tuple, dict, set, frozenset)) and
                 (p := _plain(value)) is not None)

