"""``terra.explain()``: what Terra did in this run and why, as text.

By default a summary a user can read at a glance: the counters and phase, why Terra runs
eagerly if it gave up, the cost ledger, verify mode's checks (``terra.verify``), the host
syncs (the user's lines where Python waited for the graph, costliest first, the first ten: a
value read every step is what most often keeps the two runners from overlapping;
``terra.syncs``), the events grouped by kind and
site with how often each happened (a fallback, a detour, Terra's own failure), and one line
each on the TraceGraph and the graph co-executed now. ``verbose=True`` lists every host-sync
line, gives every event in full and in order, and the TraceGraph itself (the lines in Python
loops with their trip counts, the loop nodes, the switch-cases, one node per line), which is
what a Terra developer debugs with.

It only reads the runtime (``runtime.current()``); nothing here changes it.
"""

from terra import events, pools, runtime
from terra.nodes import NodeKind

_MAX_LOOPS = 8  # lines in Python loops listed in full
_MAX_SYNCS = 10  # host-sync lines in the summary


def explain(verbose: bool = False) -> str:
    """A human-readable report of the run so far, returned as a string (print it). The
    summary by default; ``verbose=True`` adds every event in full and the TraceGraph."""
    rt = runtime.current()
    plain = [f"{n} time(s) a tape ran as a plain tf.GradientTape: {why}"
             for why, n in events.plain_tapes().items()]
    if rt is None:
        return "\n".join(["Terra has not run yet.", *plain])
    s = rt.snapshot_stats()
    lines = [f"Terra: {s.iterations} iterations, {s.traces} traces, {s.fallbacks} fallbacks, "
             f"{s.graph_generations} graph generations, {s.coexecuted} co-executed; "
             f"phase {s.phase}"]
    if rt.unsupported:
        lines.append(f"running eagerly because {rt.unsupported}")
    lines.append(str(rt.lifecycle.ledger))
    checked = rt.verifier.summary()
    if checked is not None:
        lines.append(checked)
    lines.extend(plain)
    if s.coexec_wall > 0:
        lines.append(f"co-executed iterations: {s.coexec_wall:.2f}s wall; CPU {s.python_cpu:.2f}s "
                     f"in the loop's thread, {s.graph_cpu:.2f}s in the others (the graph); "
                     f"{s.snapshots} snapshot(s) of the written variables")
        spinning = pools.status()
        if spinning:
            lines.append(spinning)
    lines.extend(rt.syncs.report(s.graph_idle, limit=None if verbose else _MAX_SYNCS))
    if verbose:
        lines.extend(f"{what}{_at(loc)}: {reason}" for what, reason, loc in rt.events)
        lines.extend(_tracegraph(rt))
    else:
        lines.extend(_grouped_events(rt.events, rt.lifecycle.detoured))
        lines.append(_tracegraph_counts(rt.lifecycle.tracegraph))
    if rt.graph is not None:
        lines.append(str(rt.graph))
    if not verbose:
        lines.append("(explain(verbose=True) adds every event in full and the TraceGraph)")
    return "\n".join(lines)


def _at(loc):
    return f" at {loc.file}:{loc.line}" if loc else ""


def _grouped_events(events, detoured):
    """One line per kind of event and site, in the order each first happened, with the
    first reason's first line and how often it happened; a detour counts the iterations
    that ran eagerly from its site."""
    groups = {}  # (what, " at file:line") -> [first reason, count]
    for what, reason, loc in events:
        group = groups.setdefault((what, _at(loc)), [reason, 0])
        group[1] += 1
    lines = []
    for (what, at), (reason, n) in groups.items():
        if what == "detour":
            n = detoured.get(at.removeprefix(" at ") or "?", n)
            times = f" ({n} iteration{'s' if n != 1 else ''})"
        else:
            times = f" ({n} times)" if n > 1 else ""
        first = reason.splitlines()[0] if reason else ""
        lines.append(f"{what}{at}{times}: {first}")
    return lines


def _tracegraph_counts(g):
    joins = [n for n in g.nodes if len(n.preds) > 1 and n is not g.end]
    return (f"TraceGraph: {len(g.nodes) - 2} nodes, {len(g.branch_points)} branch points, "
            f"{len(joins)} merge-back points, {len(g.loops())} lines in Python loops")


def _tracegraph(rt):
    """The TraceGraph in full: its counts, the lines in Python loops, the loop nodes and the
    switch-cases of the current graph, then one node per line."""
    g = rt.lifecycle.tracegraph
    loops = g.loops()
    lines = [_tracegraph_counts(g) + " (a loop is unrolled, one node per trip; the graph rolls "
             "the trips of one that took several trip counts into a loop node)"]
    lines.extend(f"  loop at {loc.file}:{loc.line} ({loc.func}): ran "
                 f"{'|'.join(map(str, counts))} times per iteration"
                 for loc, counts in loops[:_MAX_LOOPS])
    if len(loops) > _MAX_LOOPS:
        lines.append(f"  ... and {len(loops) - _MAX_LOOPS} more lines in loops")
    if rt.graph is not None:
        lines.extend(f"  loop node {node!r} at {node.location}: {node.body_len} ops a trip, "
                     f"{node.peeled} trips unrolled, then a tf.while_loop (traced "
                     f"{'|'.join(map(str, node.counts))} trips)" for node in rt.graph.loops)
        lines.append("switch-cases (Algorithm 1; {first..last node} via control edges):")
        lines.extend(f"  {i}: {_format_switch_case(sc, channel)}"
                     for i, (sc, channel) in enumerate(rt.graph.switch_cases, 1))
    lines.append(str(g))
    return lines


def _format_switch_case(sc, channel):
    def block(b):
        if not b:
            return "X"
        size = sum(1 + (n.body_len if n.kind is NodeKind.GRAD else 0) for n in b)
        return f"{{{b[0]!r}}}" if size == 1 else f"{{{b[0]!r}..{b[-1]!r} ({size} nodes)}}"

    cases = " | ".join(f"{block(c.block)} via " + ", ".join(f"{u!r}->{v!r}" for u, v in
                                                            c.control_edges) for c in sc.cases)
    kind = "tf.switch_case" if channel is not None else "inline"
    return f"[{kind}] {cases}" + (f"; may end via {len(sc.exits)} edge(s)" if sc.exits else "")
