"""The graph's lifecycle: from the traces the runtime hands over to the graph it co-executes,
and whether building one (again) pays.

The runtime owns the phases; this owns what they are decided from: the TraceGraph every trace
is merged into, the cost ledger (``terra.budget``), the gradient calls whose regions keep
missing (``terra.regions``), the sites a detour ran eagerly from, and a graph being
instantiated in the background (``terra.background``). Its answers go back to the runtime as
return values (a graph to install, whether to generate or wait) or as :class:`GiveUp`; it
never changes the runtime's state itself, so a phase is set in one place.
"""

import time

from terra import background, budget, functions, interception, precompile, profiling
from terra.census import PathCensus
from terra.config import config
from terra.graph_builder import generate
from terra.nodes import NodeKind, relax_feeds
from terra.tracegraph import TraceGraph

_EAGER_PHASES = ("warmup", "eager", "waiting")  # iterations that ran plainly: eager's time


class GiveUp(Exception):
    """Co-execution cannot work or cannot pay here: the runtime runs eagerly from now on, and
    ``explain()`` gives this reason."""


class Pause(GiveUp):
    """Co-execution does not pay now (``Ledger.verdict``): the runtime runs eagerly, and
    traces again once the budget affords another graph (``waiting``)."""


class GraphLifecycle:
    """The TraceGraph, the ledger and the decisions taken from them, for one runtime.

    ``stats`` is the runtime's :class:`~terra.runtime.Stats`, read only: the counters the
    decisions weigh. ``note(what, reason, where=None)`` records an event for ``explain()``."""

    def __init__(self, stats, note):
        self.tracegraph = TraceGraph()
        self.ledger = budget.Ledger(budget=config.budget, min_saving=config.min_saving)
        # gradient calls (by key) -> iterations, after the first graph was built, that none
        # of their regions was recorded for (a fallback at the call, or a trace that added a
        # region): past config.fold_after, one region serves every path (terra.regions)
        self.region_misses = {}
        self.detoured = {}  # user file:line -> iterations that ran eagerly from there
        self._recurring = False  # the last fallback's site took a detour before it
        self._missed = None  # the call this iteration fell back at, counted already
        self._generation_time = 0.0  # of the iteration that is ending
        self._pending = None  # a background.Instantiation under way
        self._starts_at = 0  # the iteration its graph co-executes from (background.py)
        # per graph with XLA functions: (compiled before use, functions, seconds it took)
        self.compiled = []
        self._noted_first_wait = False  # explain() says why the first graph waits
        # what a graph of the TraceGraph would cost, or before a trace was merged, of the
        # last trace: its nodes and those of the tf.functions it calls, and its nodes in
        # gradient regions (set at each merge, the only time the TraceGraph changes)
        self._size = (0, 0)
        self.merged = False  # whether a trace was merged into the TraceGraph
        self.census = PathCensus()  # the paths the merged traces took (terra.census)
        self._exploring = None  # ops recorded since traces were covered, unsettled
        self._built_from = None  # how many paths the last graph was built from
        self._recording = 0.0  # seconds the ending iteration's recorder took
        self._stats = stats
        self._note = note

    def begin_iteration(self):
        self._missed = None

    def book(self, began, judge, cpu_began=None):
        """Enter the iteration that just ended in the cost ledger, less the time generating
        a graph took in it. ``began``: ``(phase, start time, site it fell back at or False)``,
        or None if none began; ``cpu_began``: the process's CPU time then, which is what the
        ledger books (``terra.budget``: other processes on the cores do not move it). With
        ``judge`` (Terra was tracing or co-executing), raise :class:`Pause` if Terra is not
        earning back what it costs."""
        if began is not None and cpu_began is not None:
            phase, _, fell = began
            kind = ("fell back" if fell else "eager" if phase in _EAGER_PHASES else
                    "instantiating" if phase == "instantiating" else
                    "traced" if phase == "tracing" else "coexecuted")
            # a traced iteration is an eager one plus recording: its callback's share is not
            # eager's time (the ledger takes traced iterations for a bound of eager's)
            extra = self._generation_time + (self._recording if kind == "traced" else 0.0)
            self.ledger.iteration(kind, time.process_time() - cpu_began - extra,
                                  site=fell if fell else None)
        self._generation_time = self._recording = 0.0
        verdict = self.ledger.verdict() if judge else None
        if verdict is not None:
            self.ledger.pause()
            raise Pause(verdict)

    # -- traces ---------------------------------------------------------------------------
    @profiling.traced("terra_merge")
    def merge(self, rec, recorded_otherwise=False):
        """Merge a finished trace into the TraceGraph. Returns whether the TraceGraph already
        covered it and the paths look settled (time to generate: ``_settled``), or None if
        the trace is not merged (dropped, aborted, creating state, empty or too long);
        False, unmerged, for a first trace whose graph would wait
        (``waits_for_first_graph``). ``recorded_otherwise``: a region was turned off while
        it was recorded (its calls are recorded op by op from now on), so it and the traces
        before are no samples of the paths to come (``terra.census``). Raises
        :class:`GiveUp` when a gradient region cannot be skipped by Python, or when merging
        fails (the TraceGraph may be half-merged)."""
        if rec.broken is not None:
            self._note("Terra error while tracing (trace dropped)", rec.broken)
            return None
        if rec.unservable is not None:
            raise GiveUp(rec.unservable)
        if rec.creates_state or rec.aborted or not rec.records:
            return None
        self.ledger.profile(*rec.profile())
        self._recording = rec.seconds
        if not rec.skippable:
            why = "a gradient region contains ops that must run in Python"
            if rec.unskippable is not None:
                op, head = rec.unskippable
                why += (f": {op.op_type} (stateful, not a variable op) in the gradient called "
                        f"at {head.location.file}:{head.location.line}")
            else:
                why += ": a gradient that is not computed inside its region"
            raise GiveUp(why)
        if len(rec.records) > config.max_trace_ops:
            return None
        if not self.merged:
            self._size = _cost_size(
                rec.records, lambda r: r.body_len if r.kind is NodeKind.GRAD else 0)
            if self.waits_for_first_graph():
                return False  # not merged either: a graph that waits needs no TraceGraph yet
        if recorded_otherwise and not self._stats.graph_generations:
            # the traces before recorded a region that is none now: before any graph, they
            # would only leave the graph a path no iteration takes again (a fallback there)
            self.tracegraph = TraceGraph()
        regions_before = self.tracegraph.regions() if self._stats.graph_generations else None
        self.merged = True
        try:
            covered, path = self.tracegraph.merge(rec.records, any_path=self.folded())
        except Exception as err:  # noqa: BLE001 - the TraceGraph may be half-merged: stop
            if config.strict:
                raise
            raise GiveUp(f"Terra error while merging a trace: {type(err).__name__}: "
                         f"{err}") from None
        self._size = _cost_size(self.tracegraph.nodes, lambda n: n.in_body)
        self.census.add(path)
        if recorded_otherwise:
            self.census.restart()
        if regions_before is not None:
            self._count_region_misses(regions_before)
        if config.check:
            self.tracegraph.lint()
        return covered and self._settled(len(rec.records))

    def _settled(self, recorded) -> bool:
        """After a covered trace: whether the program's paths look settled enough to build
        the graph (``terra.census``: a new path's chance at most ``config.new_path_risk``).
        Else trace on, unless tracing on has already cost (``recorded`` ops this trace) what
        building the graph would: a wrong guess then costs at most twice the best one. Both
        costs are predicted from counts (``Ledger.tracing_on_costs``: ops recorded, nodes to
        build), not timed: the same program traces as long on a busy machine as on an idle
        one.

        Asked of the first graph, and of a graph built again where the last was built from
        two or more paths: the program draws its paths. A graph of one path that met
        another took a late path (a one-off, a periodic event): built again at once, as it
        serves both; if yet another comes, the program draws, and the census decides. After
        the first graph, tracing on is spending the budget must afford, as a rebuild beyond
        the free ones (``Ledger.affordable``); where it does not, the graph is built again
        or the runtime waits, as ``should_generate`` says."""
        if self._built_from is not None and not self._draws() or \
                self._stats.graph_generations and not self.ledger.affordable():
            return True  # (should_generate says whether to build or wait)
        chance = self.census.new_path_chance(self.tracegraph.trips, self._stats.coexecuted)
        if chance <= config.new_path_risk:
            return True
        if self._exploring is None:
            self._exploring = 0.0
            self._note("tracing on", f"the trace was covered, but the chance of a new path "
                       f"is ~{chance:.0%} ({len(self.census)} traces and "
                       f"{self._stats.coexecuted} co-executed iterations, terra.census): "
                       "tracing on before building the graph")
        self._exploring += recorded
        if not self.ledger.tracing_on_costs(self._exploring, *self._size):
            return False
        self._note("building", f"new paths may still come ({chance:.0%}), but tracing on has "
                   f"recorded {self._exploring} ops, what building the graph of "
                   f"{self._size[0]} nodes would cost (Ledger.tracing_on_costs)")
        return True

    def should_generate(self, fallbacks_in_a_row) -> bool:
        """After a trace the TraceGraph covered: whether to generate the graph now. Raises
        :class:`GiveUp` when fallbacks keep coming (``config.max_fallbacks_in_a_row``);
        False, noted, when building the graph again would cost more than the budget affords
        now, or when the first graph is predicted to save next to nothing and its estimated
        cost does not fit the budget yet (``Ledger.first_graph``): the runtime then waits,
        eagerly."""
        limit, s = config.max_fallbacks_in_a_row, self._stats
        if fallbacks_in_a_row >= limit:
            raise GiveUp(f"{fallbacks_in_a_row} fallbacks in a row: every graph was left "
                         "before one iteration completed in it (see the fallbacks)")
        if s.fallbacks >= limit and s.fallbacks > s.coexecuted:
            raise GiveUp(f"{s.fallbacks} fallbacks and only {s.coexecuted} co-executed "
                         "iterations: new paths keep coming (see the fallbacks)")
        if s.graph_generations and not self._rebuild_allowed():
            self._note("waiting", "building the graph again would cost more than the budget "
                       "affords now: running eagerly until it does (see the cost ledger)")
            return False
        return not self.waits_for_first_graph()

    def waits_for_first_graph(self) -> bool:
        """Before the first graph: whether the traces so far predict it would not pay yet
        (``Ledger.first_graph``), noted once (the reason is the same every time). Asked
        after the first trace too: a graph it predicts to wait is not traced again."""
        if self._stats.graph_generations:
            return False
        why = self.ledger.first_graph(*self._size)
        if why is not None and not self._noted_first_wait:
            self._note("waiting", why)
            self._noted_first_wait = True
        return why is not None

    def may_build(self) -> bool:
        """While waiting: whether the run is now long enough for the budget to afford
        building the graph (the first: its estimated cost; a later one: the last
        generation's), so tracing starts again."""
        if self._stats.graph_generations:
            return self.ledger.affordable()
        return self.ledger.first_graph(*self._size) is None

    def _rebuild_allowed(self) -> bool:
        """Whether to build the graph again now (``Ledger.rebuild_allowed``). A graph built
        from two or more paths gets no free rebuild: its program draws its paths, and a
        path it had not drawn yet is a detour until the budget affords the graph again;
        unless the last fallback's site had taken a detour before, with co-executed
        iterations in between: a path that comes back (a generator's step after its
        critic's, every few iterations) is one of the program's own, which the graph should
        serve rather than detour around forever. (Fallbacks in a row mean the path changed.)"""
        free = 0 if self._draws() and not self._recurring else config.free_rebuilds
        return self.ledger.rebuild_allowed(self._stats.graph_generations - 1, free)

    def _draws(self) -> bool:
        """Whether the graph in place was built from two or more paths: the program draws
        its paths (``terra.census``)."""
        return (self._built_from or 0) >= 2

    # -- graphs ---------------------------------------------------------------------------
    @profiling.traced("terra_generate")
    def generate(self):
        """The graph of the TraceGraph, to install now; or None while TF instantiates it in
        another thread (``config.background``: :meth:`instantiated` hands it over). A graph
        with XLA functions is installed at once, compiled (``terra.precompile``): the loop
        waits for that, as for generation. Raises :class:`GiveUp` if it cannot be generated
        (the program stays eager)."""
        t0 = time.thread_time()  # generation is the loop thread's (terra.background)
        self._exploring = None
        self._recurring = False
        self._built_from = self.census.paths(self.tracegraph.trips)
        try:
            relax_feeds(self.tracegraph.nodes)  # before the graph and its validation read them
            with interception.paused():
                graph = generate(self.tracegraph, xla=config.xla, exact=config.exact,
                                 fold=self.folded())
        except Exception as e:  # noqa: BLE001 - an ungeneratable graph means: stay eager
            raise GiveUp(f"graph generation failed: {type(e).__name__}: {e}") from None
        finally:
            took = time.thread_time() - t0
            self._generation_time += took
            self.ledger.generation(took)
        if graph.xla_segments:
            self._compile(graph)
            return graph
        if config.background:  # the next iteration runs eagerly while TF instantiates it
            self._pending = background.Instantiation(graph, self._stats.iterations)
            self._starts_at = self._stats.iterations + 2  # the one after (terra.background)
            return None
        return graph

    def _compile(self, graph):
        """Instantiate ``graph`` and compile its XLA functions before it co-executes; the
        time is the graph's cost, as generation's. If that fails, the graph's first call
        fails the same way, which the GraphRunner handles."""
        t0, wall = time.process_time(), time.perf_counter()  # XLA compiles in threads
        try:
            compiled = precompile.compile_before_use(graph)
        except Exception as e:  # noqa: BLE001 - noted; the graph's first call will tell
            if config.strict:
                raise
            self._note("Terra error (compiling the graph)", f"{type(e).__name__}: {e}")
            compiled = 0
        took, wall = time.process_time() - t0, time.perf_counter() - wall
        self._generation_time += took
        self.ledger.generation(took)
        self.compiled.append((compiled, len(graph.xla_segments), wall))
        self._note("graph compiled", f"{compiled} of the {len(graph.xla_segments)} XLA "
                   f"functions of its body compiled, and the graph instantiated, in "
                   f"{wall:.2f}s before it co-executes (the rest, and those of switch-case "
                   "branches, compile at their first call)")

    def instantiated(self):
        """The graph instantiated in the background, at the iteration generation set for it
        (else None): the runtime co-executes it from this iteration on, waiting here for TF
        if it is not done yet (``terra.background``: a fixed iteration, whatever the load).
        If instantiation failed, the graph's first call fails the same way, which the
        GraphRunner handles. Raises :class:`GiveUp` if TF is not done within
        ``config.timeout``."""
        if self._pending is None or self._stats.iterations < self._starts_at:
            return None
        pending, self._pending = self._pending, None
        wall, cpu = time.perf_counter(), time.process_time()
        done = pending.wait(config.timeout)
        waited = time.perf_counter() - wall
        self.ledger.spend(time.process_time() - cpu)  # TF's work the loop waited for
        if not done:
            raise GiveUp(f"TF did not finish instantiating the graph within {config.timeout:.0f}s "
                         "(TERRA_TIMEOUT)")
        try:
            pending.result()
        except Exception as e:  # noqa: BLE001 - noted; the graph's first call will tell
            if config.strict:
                raise
            self._note("Terra error (instantiating the graph)", f"{type(e).__name__}: {e}")
        first, last = pending.iteration + 1, self._stats.iterations - 1
        ran = (f"iteration {first}" if last == first else f"iterations {first}-{last}")
        self._note("graph instantiated", f"in the background in {pending.seconds:.2f}s, while "
                   f"{ran} ran eagerly"
                   + (f"; the loop then waited {waited:.2f}s" if waited >= 0.005 else ""))
        return pending.graph

    def shutdown(self):
        """Wait for a background instantiation: its graph is not used, but its thread is not
        left running."""
        if self._pending is not None:
            self._pending.wait(config.timeout)

    # -- fallbacks ------------------------------------------------------------------------
    def keeps_graph(self, fallbacks_in_a_row, where) -> bool:
        """Whether a fallback at a divergence keeps the graph: the iteration goes on eagerly
        from there, untraced, and the next one co-executes again (a detour). Taken where
        building the graph again for the new path would not pay (past the free rebuilds,
        over the budget) and the previous iteration co-executed, so the graph still serves
        the program: a site that keeps failing then costs the iterations that reach it, not
        the whole run. Two in a row mean the path has changed: that fallback traces, as any
        other; unless the graph was built from two or more paths (``terra.census``), whose
        program draws its paths: misses in a row are then chance, and the graph is kept for
        all but the last before ``config.max_fallbacks_in_a_row`` (which gives up): that
        one traces and waits for the budget, as the second of a graph of one path does."""
        in_a_row = config.max_fallbacks_in_a_row - 1 if self._draws() else 2
        self._recurring = fallbacks_in_a_row == 1 and self.detoured.get(_at(where), 0) > 0
        return (fallbacks_in_a_row < in_a_row and self._stats.graph_generations > 0
                and not self._rebuild_allowed())

    def note_detour(self, where):
        at = _at(where)
        first = at not in self.detoured
        self.detoured[at] = self.detoured.get(at, 0) + 1
        if first:
            self._note("detour", "a new path where building the graph again would cost more "
                       "than the budget affords: this iteration runs eagerly from here, the "
                       "graph is kept for the next (see the cost ledger)", where)

    def fell_back_at(self, call):
        """The iteration fell back at gradient call ``call``: none of its regions served."""
        self._missed = call
        self._region_missed(call)

    # -- gradient regions -----------------------------------------------------------------
    def folded(self):
        """The gradient calls whose regions the graph makes one (``terra.regions``)."""
        return {key for key, n in self.region_misses.items() if n >= config.fold_after}

    def _count_region_misses(self, before):
        """Count the iteration as a miss of each gradient call (of a graph already built)
        its trace added a region to, unless it fell back at that call (counted then)."""
        missed, self._missed = self._missed, None
        for key, n in self.tracegraph.regions().items():
            if n > before.get(key, 0) and before.get(key) and key != missed:
                self._region_missed(key)

    def _region_missed(self, key):
        misses = self.region_misses[key] = self.region_misses.get(key, 0) + 1
        if misses == config.fold_after:
            self._note("one gradient region for every forward path", f"{misses} iterations "
                       "after the graph was built took forward paths or shapes no region of "
                       "this gradient call was recorded for: the next graph takes TF's "
                       "gradient through the switch-cases there (terra.regions)",
                       self.tracegraph.region_location(key))


def _at(where) -> str:
    """A user's location as the detours are counted by: file:line."""
    return f"{where.file}:{where.line}" if where else "?"


def _cost_size(items, in_region):
    """(nodes, nodes in gradient regions) a graph of ``items`` (trace records or TraceGraph
    nodes) costs to build: the bodies of the ``tf.function``s they call count too (TF
    instantiates them at the graph's first call that reaches them); ``in_region(item)``:
    how many gradient-region nodes the item stands for."""
    items = list(items)
    called = functions.called(i.op_type for i in items if i.kind is NodeKind.OP)
    return len(items) + called, sum(in_region(i) for i in items)
