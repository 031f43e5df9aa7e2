"""Lanes: the PythonRunner's precompiled way through an op it has matched before.

Once an op has been matched at a step by the general path (``PythonRunner.fast``: ``_expect``,
``Validation.check_attrs`` and ``inputs``, ``StandIns.specs`` and ``make``, ``_move``), later
iterations mostly issue the very same op there again. A :class:`Lane`, built from the plan
for the edge into that step, answers it with what the general path does in its common case,
and nothing else: the op type and the raw attr tuple already validated, each input checked
by a test precomputed from its slot (a stand-in of this iteration from the one producer, a
constant's memo, identity or bytes, a variable's or capture's identity, a fed tensor's dtype
and shape, put in its channel once all passed), stand-ins taken
from the spares or copied from the step's dummies, the step logged and passed (at the
path's end, the graph waited for). Anything else, from a Python value never validated
before to a shape never seen, is a :data:`MISS`: nothing was done yet (but noting a
constant tensor found to hold its slot's value), and the general path handles the op, with
its checks and its messages. So a lane changes how fast an op is matched, never whether it
matches.

A lane's ``follow`` is straight-line Python written for its step (:func:`_source`): one
check per input in order, no loop over check descriptors and no dispatch on their kinds,
the step's constants bound as its defaults. Lanes of one form (input kinds, outputs, packing)
share one compiled factory, so a program compiles a handful, however many ops it has;
``Lane.source`` is the code a lane runs, to read.

A lane of a common form (inputs from stand-ins, constants or the same tensor, none fed or
read again; not the path's end: :func:`_twin`) also gets a native twin in ``terra._native``,
which the C door (``doors.CoexecDoor``) runs for it: the same checks in the same order and
the same stand-ins, entries and record, or, before anything was done, a deferral to this
lane. The twin answers only where this lane would answer without writing a memo; the rest
(a Python value never seen, an array, a shape never seen) is this lane's.

Lanes are the runner's own table, like its other memos: the plan is only read.
"""

import re

import numpy as np
from tensorflow.python.framework import ops

from terra import hooks, interception
from terra.boundary import GENERATED
from terra.config import config
from terra.divergence import GraphFailed
from terra.fallback import LoggedOp
from terra.fast_path import flatten, pack_fast
from terra.interception import plain_scalars, value_key
from terra.nodes import NodeKind, SlotKind
from terra.standins import Entry
from terra.trace_queries import signature_part
from terra.validation import shape_ok

try:
    from terra import _native as native
except ImportError:  # not built (no C compiler at install): the lanes run in Python alone
    native = None

MISS = object()  # "take the general path": the lane did nothing

# How one input is checked: the kinds of a lane's form.
_NODE = "node"  # a stand-in of this iteration from the one producer's output
_CONST = "const"  # the slot's constant: a Python value or a tensor, by value
_SAME_TENSOR = "same"  # that very tensor (a variable's handle, a capture)
_FED = "fed"  # a tensor of the slot's dtype and shape, put in its channel


class Lane:
    """The edge into ``step`` from a step with no other successor: ``follow(args)`` matches
    a fast-path call there (the op's results, or :data:`MISS`); ``source`` is the code of
    its form, whose names ``follow`` binds to this step's values; ``native`` its twin in
    ``terra._native``, or None."""

    __slots__ = ("step", "op_type", "follow", "source", "native")

    def __init__(self, step, follow, source, native=None):
        self.step = step
        self.op_type = step.op_type
        self.follow = follow
        self.source = source
        self.native = native


def build(runner, cur, step, info, attrs, plan):
    """The lane from ``cur`` into ``step``, whose op was just matched by the general path
    with the raw ``attrs`` (validated and remembered); False where the general path is the
    only one: a branch point or a Case Select to feed on the edge, a step Python runs or
    computes (a local one) or whose outputs are fetched, inputs a lane cannot check (read
    again from another op's, joined, from a loop's body). At the path's end the lane waits
    for the graph as ``PythonRunner._move`` does."""
    if cur.next != [step] or cur.puts is not None or step.kind is not NodeKind.OP or \
            step.python or step.local is not None or step.dynamic or step.value_shaped or \
            runner.checks.fast_attrs.get(step) != attrs:
        return False
    kinds, bound = [], {}
    for i, slot in enumerate(step.slots):
        kind = slot.kind
        fed = (step.node, i) if (step.node, i) in runner.reread else None
        if kind is SlotKind.NODE and len(slot.alts) == 1 and \
                not runner.step_of[slot.alts[0][0]].looped:
            producer = runner.step_of[slot.alts[0][0]]
            # a producer of one output: its step says which output, too
            kinds.append((_NODE, False, len(producer.out_specs) == 1))
            bound[f"P{i}"], bound[f"K{i}"] = producer, slot.alts[0][1]
        elif kind is SlotKind.CONST:
            numeric = slot.value is not None and slot.value.dtype.kind in "biufc"
            kinds.append((_CONST, fed is not None, numeric))
            # a Python literal is the same object at every call, so its identity is enough
            # once its value was found among the slot's (a list or an array may have changed):
            # [the last immutable value matched, the last array's (dtype, shape, bytes), the
            # last list or tuple of scalars' type, copy and element types]
            bound[f"LAST{i}"] = [MISS, None, None, None, None]
            bound[f"SID{i}"], bound[f"DT{i}"], bound[f"FED{i}"] = id(slot), slot.dtype, fed
            bound[f"SHAPE{i}"] = slot.value.shape if slot.value is not None else None
            bound[f"BYTES{i}"] = slot.value_bytes
            # Python values converted to it (interception.converted's keys -> their type: 1
            # and 1.0 are one key), and the id of the tensor of its value validated last
            bound[f"CONVERTS{i}"], bound[f"CID{i}"] = {}, [None]
        elif kind is SlotKind.VAR or kind is SlotKind.CAPTURE:
            fed = fed if kind is SlotKind.CAPTURE else None
            kinds.append((_SAME_TENSOR, fed is not None, False))
            bound[f"ID{i}"], bound[f"FED{i}"] = slot.tensor._id, fed
        elif kind is SlotKind.FEED:  # a tensor of the slot's dtype and (relaxed) shape
            shape, channel = slot.shape, step.feed[i]
            fits = "any" if shape is None else "exact" if None not in shape else "relaxed"
            kinds.append((_FED, fed is not None, (fits, channel is not None)))
            bound[f"FS{i}"], bound[f"DT{i}"] = shape, slot.dtype
            bound[f"FED{i}"], bound[f"CH{i}"] = fed, channel
        else:
            return False
    sources = None
    if not step.check_shapes:
        sources = _sources(runner.standins.sources, step.out_specs)  # made by the general path
        if sources is None:
            return False
    form = (info.n_inputs, _spread(info, len(step.slots)), not attrs, tuple(kinds),
            len(step.out_specs), sources is None, plan == "one", step.has_fetch,
            step in runner.seq_read, config.check, step.next == [None])
    factory, source = _factory(form)
    outs = {f"SRC{k}": s for k, s in enumerate(sources or ())}
    by_shapes = {}  # varying input shapes -> the stand-ins' sources (fixed answers)
    follow = factory(runner=runner, STEP=step, INFO=info, ATTRS=attrs, PLAN=plan,
                     by_shapes=by_shapes, **bound, **outs)
    return Lane(step, follow, source,
                _twin(runner, step, form, attrs, plan, bound, by_shapes, sources))


def _twin(runner, step, form, attrs, plan, bound, by_shapes, sources):
    """The native twin of the lane of ``form`` into ``step``, from the values its Python
    code is bound to (the same memo objects, which either may write), or None: a form the
    C door does not know (an input fed or read again, several lists, the path's end), or
    ``TERRA_NATIVE=0``, or no ``terra._native``."""
    n, spread, _, kinds, n_out, shaped, _, fetch, noted, check, end = form
    if native is None or not config.native or runner.tensors is not hooks.tensors or \
            spread == "flatten" or end or len(kinds) > _MAX or n_out > _MAX or \
            any(reread or kind == _FED for kind, reread, _ in kinds):
        return None
    inputs = []
    for i, (kind, _, flag) in enumerate(kinds):
        if kind == _NODE:  # (0, producer of one output, its step, which output)
            inputs.append((0, int(flag), bound[f"P{i}"], bound[f"K{i}"]))
        elif kind == _CONST:  # (1, 0, the lane's memos of the constant)
            inputs.append((1, 0, *(bound[f"{v}{i}"] for v in ("LAST", "DT", "CONVERTS", "CID"))))
        else:  # (2, 0, the tensor's id)
            inputs.append((2, 0, bound[f"ID{i}"]))
    return native.Lane(runner, step, tuple(attrs) if attrs else None, n, spread, inputs,
                       by_shapes if shaped else None, None if shaped else tuple(sources),
                       tuple(step.static[:n_out]), plan,
                       runner.standins.device, runner.seqs if noted else None,
                       runner.visits if fetch else None, check)


_MAX = 8  # MAX_INPUTS and MAX_OUTPUTS of terra/_native.h
if native is not None:
    native.setup(ops.EagerTensor, Entry, Lane, LoggedOp, hooks.tensors, interception.converted,
                 interception.tapes_stopped, pack_fast)


def _spread(info, n_flat):
    """How the op's arguments spread into its ``n_flat`` inputs: None (one each), ``(j, m)``
    (argument ``j``, the one list-valued, is a list or tuple of ``m``), or ``"flatten"``
    (several lists: ``fast_path.flatten`` finds out)."""
    lists = [j for j, listed in enumerate(info.list_inputs) if listed]
    if not lists:
        return None
    if len(lists) > 1:
        return "flatten"
    return lists[0], n_flat - (info.n_inputs - 1)


_factories = {}  # a lane's form -> (its factory, its source)


def _factory(form):
    """The compiled factory of lanes of ``form``, and its source."""
    made = _factories.get(form)
    if made is None:
        source = _source(form)
        scope = dict(_GLOBALS)
        name = f"{GENERATED}lane {len(_factories)}>"  # Terra's own frames (terra.boundary)
        exec(compile(source, name, "exec"), scope)  # noqa: S102
        made = _factories[form] = (scope["make"], source)
    return made


def _sources(sources, specs):
    """Per spec, its dummy, spares (``sources``: ``StandIns.sources``) and shape; None if
    one is missing (a lane's for a shape never seen: the general path makes them)."""
    found = [sources.get(spec) for spec in specs]
    return None if None in found else [(*f, spec[0]) for f, spec in zip(found, specs)]


_MADE = ("tensors", "seqs", "visits", "const_ids", "known", "device", "inferred",  # ``make``'s
         "sources_of", "static")

_GLOBALS = {
    "MISS": MISS, "ET": ops.EagerTensor, "Entry": Entry, "alloc": object.__new__,
    "LoggedOp": LoggedOp, "new": tuple.__new__,
    "IMMUTABLE": (int, float, bool, tuple), "ndarray": np.ndarray, "value_key": value_key,
    "flatten": flatten, "pack_fast": pack_fast, "stopped": interception.tapes_stopped,
    "np_shape": np.shape, "converted": interception.converted, "shape_ok": shape_ok,
    "signature_part": signature_part, "GraphFailed": GraphFailed, "sources_for": _sources,
    "SEQUENCES": (tuple, list), "plain_scalars": plain_scalars,
}


def _source(form):
    """The source of the factory of lanes of ``form``: ``make(runner, STEP, ...)`` returns
    ``follow(args)``, which does, for one step, what the general path does in its common
    case (see the module's docstring): the checks of each input (:func:`_input_check`), then
    the stand-ins, the log record and the move (:func:`_outputs`), or :data:`MISS` before
    anything was done."""
    n, spread, bare, kinds, n_out, shaped, one, fetch, noted, check, end = form
    names = [f"P{i}, K{i}" if k[0] == _NODE else
             f"LAST{i}, SID{i}, DT{i}, FED{i}, SHAPE{i}, BYTES{i}, CONVERTS{i}, CID{i}"
             if k[0] == _CONST else
             f"FS{i}, DT{i}, FED{i}, CH{i}" if k[0] == _FED else
             f"ID{i}, FED{i}" for i, k in enumerate(kinds)]
    params = ", ".join(["runner", "STEP", "INFO", "ATTRS", "PLAN", "by_shapes", *names,
                        *[f"SRC{k}" for k in range(0 if shaped else n_out)]])
    flat = ", ".join(f"a{i}" for i in range(len(kinds))) + ("," if len(kinds) == 1 else "")
    code = [  # with no attrs, a shorter call would pass the attrs' test
        f"        if len(args) != {n}:" if bare else f"        if args[{n}:] != ATTRS:",
        "            return MISS"]
    if spread == "flatten":
        code += [f"        flat = flatten(INFO, args[:{n}])",
                 f"        if len(flat) != {len(kinds)}:",
                 "            return MISS",
                 f"        {flat} = flat"]
    elif spread is None:
        code += [f"        a{i} = args[{i}]" for i in range(n)]
    else:  # the list argument's items, then the arguments after it, one input each
        j, m = spread
        code += [f"        a{i} = args[{i}]" for i in range(j)]
        code += [f"        items = args[{j}]",
                 "        if type(items) is not list and type(items) is not tuple or "
                 f"len(items) != {m}:",
                 "            return MISS"]
        code += [f"        a{j + t} = items[{t}]" for t in range(m)]
        code += [f"        a{j + m + t} = args[{j + 1 + t}]" for t in range(n - j - 1)]
    code.append("        it = runner.it")
    for i, kind in enumerate(kinds):
        code += _input_check(i, *kind)
    if shaped:  # output shapes follow the input shapes: looked up, or the general path
        code += _shaped(kinds, n_out, check)
    code.append("        # matched: from here on, what the general path does once checks passed")
    for i, (kind, reread, flag) in enumerate(kinds):
        if reread:  # for the slots reading the input again
            line = f"it.fed[FED{i}] = a{i}._id"
            if kind == _CONST:  # a Python value is converted anew: nothing to read again
                code += [f"        if type(a{i}) is ET:", f"            {line}"]
            else:
                code.append(f"        {line}")
        if kind == _FED and flag[1]:  # into its channel, noted in the signature if asked
            code += [f"        CH{i}.put(a{i})",
                     "        if it.signature is not None:",
                     f"            it.signature.append(signature_part(a{i}, STEP.op_type, {i}))"]
    logged = [f"e{i}" if k[0] == _NODE else f"a{i}" for i, k in enumerate(kinds)]
    code += _outputs(n_out, shaped, one, fetch, noted, end, logged)
    # Every name the body reads is bound as a default: read from the call's own frame, not
    # through a closure's cells or the globals (a lane's values sit together in one tuple,
    # the fewer of the cache lines the user's Python evicts between two ops: -10% an op).
    read = set(re.findall(r"[A-Za-z_]\w*", "\n".join(code)))
    made = (*params.split(", "), *_MADE, *(f"{v}{k}" for k in range(n_out)
                                          for v in ("VALUE", "DUMMY", "SPARE", "SHAPE_OUT")))
    bound = [v for v in (*made, *_GLOBALS) if v in read]
    return "\n".join([
        f"def make({params}):",
        "    tensors, memo, seqs, visits = runner.tensors, runner.checks, runner.seqs, "
        "runner.visits",
        "    const_ids, known, device = memo.const_ids, memo.known, runner.standins.device",
        "    inferred, sources_of = runner.standins.inferred, runner.standins.sources",
        "    static = STEP.static",
        # per output, its value known at build time, and (not shaped) its dummy and spares
        *[f"    VALUE{k} = static[{k}]" for k in range(n_out)],
        *[f"    DUMMY{k}, SPARE{k}, SHAPE_OUT{k} = SRC{k}" for k in range(0 if shaped else n_out)],
        "",
        f"    def follow(args, {', '.join(f'{v}={v}' for v in bound)}):",
        *code, "", "    return follow", ""])


def _input_check(i, kind, reread, flag):
    """The lines that check input ``i`` (``a{i}``) of a lane, returning :data:`MISS` where
    the general path must decide; an input from a node leaves its entry in ``e{i}``.
    ``flag``: a constant's value is numeric; a node's producer has one output."""
    a = f"a{i}"
    if kind == _NODE:  # the producer's step (``step_of`` has one per node) and output
        out = "" if flag else f" or e{i}.out != K{i}"
        return [f"        if type({a}) is not ET:",
                "            return MISS",
                f"        e{i} = tensors.get({a}._id)",
                f"        if e{i} is None or e{i}.iteration is not it or "
                f"e{i}.step is not P{i}{out}:",
                "            return MISS"]
    if kind == _FED:  # what validation._feed checks, before it puts the tensor
        fits, _ = flag
        code = [f"        if type({a}) is not ET or {a}._id in tensors or "
                f"{a}._datatype_enum() != DT{i}:",
                "            return MISS"]
        if fits == "exact":
            code += [f"        if {a}._shape_tuple() != FS{i}:", "            return MISS"]
        elif fits == "relaxed":
            code += [f"        if not shape_ok({a}._shape_tuple(), FS{i}):",
                     "            return MISS"]
        return code
    if kind == _SAME_TENSOR:
        return [f"        if type({a}) is not ET or {a}._id != ID{i} or {a}._id in tensors:",
                "            return MISS"]
    # a constant: a tensor of the slot's value (the one validated last, by its id), or a
    # Python value validated before (the same immutable object or array as last time)
    compare = (f"v.shape != SHAPE{i} or not v.flags.c_contiguous or "
               f"v.data.cast('B') != BYTES{i}") if flag else \
        f"v.shape != SHAPE{i} or v.tobytes() != BYTES{i}"
    return [f"        if type({a}) is ET:",
            f"            if {a}._id in tensors:  # a stand-in where a value is read",
            "                return MISS",
            # a Python value converted to it (a fresh tensor each call): a scalar, list,
            # tuple or array (by its key) known to give the value in the slot's dtype: no
            # read-back
            f"            src = converted.get({a}._id)",
            f"            if src is None or CONVERTS{i}.get(src) is not type(src) or "
            f"{a}._datatype_enum() != DT{i}:",
            f"                if {a}._id != CID{i}[0]:",
            f"                    if {a}._datatype_enum() != DT{i}:",
            "                        return MISS",
            f"                    v = {a}._numpy_internal()  # bytes: -0.0, NaNs differ",
            f"                    if {compare}:",
            "                        return MISS",
            # known from now on (1 and 1.0 differ; a float zero is noted by the sign TF's
            # cache of converted scalars holds for it, "+0.0" or "-0.0"); not a zero of
            # another dtype, which that cache may hold with the other sign (each such
            # tensor is checked)
            "                    if src is not None and (src or type(src) is not float):",
            f"                        CONVERTS{i}[src] = type(src)",
            f"                    CID{i}[0] = const_ids[SID{i}] = {a}._id  # it has the value",
            # a float computed anew each call (``float(n)``) equal to the last one, not zero
            # (-0.0 == 0.0) and not NaN: the same constant, without its value's key
            f"        elif {a} is not LAST{i}[0] and not (type({a}) is float and "
            f"type(LAST{i}[0]) is float and {a} == LAST{i}[0] and {a}):",
            f"            if type({a}) is ndarray and LAST{i}[1] is not None:",
            f"                dtype, shape, data = LAST{i}[1]",
            f"                ok = {a}.dtype is dtype and {a}.shape == shape and "
            f"{a}.tobytes() == data",
            # a shape or split sizes made anew at each call, equal to the last one matched
            # element by element and type by type (True == 1 == 1.0): the same key
            f"            elif type({a}) is LAST{i}[2] and tuple(map(type, {a})) == LAST{i}[4]:",
            f"                ok = {a} == LAST{i}[3]",
            "            else:",
            "                ok = False",
            "            if not ok:",
            f"                key = value_key({a})",
            f"                if key not in known.get(SID{i}, ()):",
            "                    return MISS",
            f"                if type({a}) in IMMUTABLE:",
            f"                    LAST{i}[0] = {a}",
            f"                elif type({a}) is ndarray:",
            f"                    LAST{i}[1] = ({a}.dtype, key[1], key[2])",
            f"                if type({a}) in SEQUENCES and plain_scalars({a}):",
            f"                    LAST{i}[2:] = type({a}), type({a})({a}), tuple(map(type, {a}))"]


def _shaped(kinds, n_out, check):
    """The lines that find a shaped lane's ``sources`` (per output: dummy, spares, shape;
    one output: its triple) for the input shapes, in the lane's memo ``by_shapes``, else as
    the general path finds its specs (a trace's, or the shape function's, inferred before),
    or :data:`MISS`. The memo's key has only the shapes that can change once the checks
    passed: a stand-in's, read from its entry (asking the tensor costs a cache miss in TF's
    handle), and a fed tensor's of a relaxed shape; a constant's is its value's. Under
    ``TERRA_CHECK`` an entry's shape is checked against its tensor's."""
    varying = [f"e{i}.shape" if kind == _NODE else f"a{i}._shape_tuple()"
               for i, (kind, _, flag) in enumerate(kinds)
               if kind == _NODE or kind == _FED and flag[0] != "exact"]
    key = varying[0] if len(varying) == 1 else f"({', '.join(varying)},)" if varying else "None"
    shapes = "".join(f"e{i}.shape, " if k[0] == _NODE else f"a{i}._shape_tuple(), "
                     if k[0] != _CONST else
                     f"a{i}._shape_tuple() if type(a{i}) is ET else np_shape(a{i}), "
                     for i, k in enumerate(kinds))
    nodes = [i for i, (kind, _, _) in enumerate(kinds) if kind == _NODE]
    checked = [f"        if ({''.join(f'e{i}.shape, ' for i in nodes)}) != "
               f"({''.join(f'a{i}._shape_tuple(), ' for i in nodes)}):",
               "            raise AssertionError('an entry has another shape than its tensor')"]
    return [*(checked if check and nodes else []),
            f"        sources = by_shapes.get({key})  # this lane's answer for these shapes",
            "        if sources is None:",
            f"            shapes = ({shapes.rstrip()})",
            "            specs = STEP.node.sigs.get(shapes)  # a trace had these shapes",
            "            if specs is None:",
            "                specs = inferred.get((STEP, shapes))  # from the shape function",
            "                if specs is None:",
            "                    return MISS",
            "            sources = sources_for(sources_of, specs)",
            "            if sources is None:",
            "                return MISS",
            *(["            sources = sources[0]  # one output: its triple"] if n_out == 1 else []),
            f"            by_shapes[{key}] = sources"]


def _outputs(n_out, shaped, one, fetch, noted, end, logged):
    """The lines after a lane's checks: the stand-ins and their entries (fields set inline,
    output by output), the log record of the op with its ``logged`` inputs (names), the move
    (the step's pass ``noted`` where it is ever asked for: ``PythonRunner.seq_read``; at the
    path's ``end``, the wait for the graph), the results. An op of one output is logged as
    its entry; others as a ``LoggedOp``."""
    code = ["        seq = runner.seq"]
    # a step's position in its fetch channels; 0 where it has none (PythonRunner._visit)
    visit = "visit" if fetch else "0"
    if fetch:
        code.append("        visit = visits.get(STEP, 0)")
    inputs = "".join(f"{name}, " for name in logged)
    handed = ""
    for k in range(n_out):
        if shaped:  # looked up: per output its dummy, spares and shape
            dummy, spare, shape = f"dummy{k}", f"spare{k}", f"shape{k}"
            code.append(f"        {dummy}, {spare}, {shape} = sources"
                        + ("" if n_out == 1 else f"[{k}]"))
        else:
            dummy, spare, shape = f"DUMMY{k}", f"SPARE{k}", f"SHAPE_OUT{k}"
        fields = {"runner": "runner", "iteration": "it", "step": "STEP", "out": str(k),
                  "value": f"VALUE{k}", "visit": visit, "seq": "seq", "shape": shape}
        if n_out == 1:  # the entry is the op's record too
            fields.update(stopped="stopped[0]", inputs=f"({inputs})")
        code += [f"        s{k} = {spare}.pop() if {spare} else {dummy}._copy_to_device(device)",
                 f"        out{k} = alloc(Entry)"]
        code += [f"        out{k}.{name} = {fields[name]}" for name in Entry.__slots__
                 if name in fields]
        code.append(f"        tensors[s{k}._id] = out{k}")
        handed += f"out{k}, s{k}, {spare}, "
    entries = "".join(f"out{k}, " for k in range(n_out))
    # LoggedOp's flat layout, written out: one tuple, no lists
    record = "out0" if n_out == 1 else \
        f"new(LoggedOp, (STEP, stopped[0], {n_out}, {entries}{inputs}))"
    code += ["        handed = it.entries",
             f"        handed += ({handed.rstrip()})",
             f"        it.log.append({record})"]
    outs = "[" + ", ".join(f"s{k}" for k in range(n_out)) + "]"
    code.append("        runner.cur = STEP  # and passed, as PythonRunner._move passes it")
    if noted:
        code.append("        seqs[STEP] = seq")
    code.append("        runner.seq = seq + 1")
    if fetch:
        code.append("        runner._visit(STEP)")
    code.append("        result = s0" if one else f"        result = pack_fast(PLAN, {outs})")
    if end:  # as PythonRunner._logged_move: a graph failing here ran the op in the replay
        code += ["        try:",
                 "            runner._take(STEP, 0)",
                 "            runner._path_end()",
                 "        except GraphFailed as failed:",
                 "            failed.ran, failed.result = True, result",
                 "            raise"]
    code.append("        return result")
    return code
