"""The cost ledger: what Terra spent on a program and what it earned back.

Tracing runs the iteration eagerly *and* records it, generation builds a graph, a fallback
restores and replays: all paid over what eager would have taken. Co-executed iterations earn
it back. A program whose paths never settle (a new one every few steps) would pay forever
and never earn, ending slower than eager. The ledger compares every iteration
with eager's time for one (the median of the iterations that ran plainly, the warm-up one at
least) and says when to stop: Terra has spent more than its budget (a fraction of the eager
time of the run so far) and its last co-executed iterations were not faster than eager, so it
would never earn it back. (A program that never gets to co-execute is stopped by the
fallback limits, ``Config.max_fallbacks_in_a_row``.)

Every figure is the process's CPU time, not wall time, and every decision is taken from CPU
time or from counts, so that the same program decides the same way on an idle machine and
on a busy one: another process taking the cores stretches an iteration's wall time (two of
them on 2 cores, two to three times), not the CPU time the iteration used. CPU time moves
too (a busy machine's caches, more switches between threads: an eager step of a small MLP
took 17 ms of CPU alone and 24 ms beside two busy processes and three other runs on 2 cores),
less, and alike for every kind of iteration under the same load; a judgement of one kind
against another keeps a margin (:attr:`Ledger.NOISE`). Where a decision needs a cost before
it was paid (how long tracing on may go) it is predicted from counts: ops recorded, nodes to
build.

The first graph is built at once unless the traces predict it would not pay for itself soon:
a traced iteration tells how long its TF ops took to run (what co-execution moves to the graph
thread) and how many ops the skeleton would issue (outside gradient and library regions), and
the TraceGraph how many nodes the graph would have, so the saving per iteration and the
graph's cost are estimated before paying for the graph (:meth:`Ledger.first_graph`). The
skeleton's cost per op and generation's per node are constants measured on the corpus, in
seconds on the machine they were measured on, scaled by this interpreter's speed
(:func:`python_unit`, a fixed piece of Python timed once): not by the recorder's own speed,
which changes whenever recording gets cheaper. A first graph whose predicted saving is under
``Config.min_saving`` (5%) of an iteration, or would take more than ``MAX_PAYBACK``
iterations to pay for the graph, waits: the program runs eagerly (``waiting``) until the
budget of the run affords the graph's estimated cost, so a wrong estimate costs at most the
budget. The first trace already tells: a graph it predicts to wait is neither traced a second
time nor merged (a trace costs one to three eager iterations of a small step). Over a short
run such a program stays at eager's speed, over a long one it gets its graph.

Nothing tells in advance whether a program will settle, and the next graphs are built if the
last one was cheap (``Config.free_rebuilds``, each costing at most 20 eager iterations: a late
path or two is common). Past those, a graph built again after a fallback is an investment the
ledger must afford: a program whose paths keep coming would otherwise pay a generation at
every new one (seconds for a large graph, hundreds of eager steps). Until the ledger's debt
plus the last generation's cost fits in the budget of the run so far, the runtime runs
iterations eagerly (``waiting``), which costs nothing over eager, and traces again once it
does: over a long run the graph is rebuilt, over a short one Terra stays within its budget. A
fallback the ledger would not rebuild for, right after a co-executed iteration, keeps the
graph instead (a detour: that iteration goes on eagerly, the next co-executes); a second in a
row means the path changed, and waits.
"""

import dataclasses
import functools
import statistics
import time

# python_unit() on the machine the cost constants were measured on (a 2-core x86 CPU,
# CPython 3.11)
REFERENCE_UNIT = 0.136e-6


class _Probe:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _work(n):
    table = {}
    for i in range(n):
        probe = _Probe((i, i + 1))
        table[i] = probe
        table.get(i - 1)
        probe.value[0]  # noqa: B018 - an index, as the work Terra does per op


@functools.cache
def python_unit() -> float:
    """Seconds this interpreter takes for a fixed piece of the kind of work Terra does per op
    and per node (calls, an object, dict and attribute lookups, a small tuple): the best of
    seven runs of ~30 us, measured once."""
    best = float("inf")
    for _ in range(7):
        began = time.perf_counter()
        _work(200)
        best = min(best, time.perf_counter() - began)
    return best / 200


@dataclasses.dataclass
class Ledger:
    """Seconds per kind of iteration. ``spent``: over eager (tracing, generation, fallbacks);
    ``saved``: what co-executed iterations took less than eager (negative if more)."""

    budget: float = 0.05  # of the run's eager time, Terra may spend without earning it back
    window: int = 5  # co-executed iterations that tell whether co-execution is faster
    eager: list = dataclasses.field(default_factory=list)
    traced: list = dataclasses.field(default_factory=list)
    coexecuted: list = dataclasses.field(default_factory=list)
    # iterations that began in the graph: co-executed, or fell back (a detour among them)
    in_graph: list = dataclasses.field(default_factory=list)
    judged_from: int = 0  # co-executed iterations before the last pause (:meth:`pause`)
    pauses: int = 0
    spent: float = 0.0
    saved: float = 0.0
    iterations: int = 0
    last_generation: float = 0.0
    # fallback site (the user's file:line) -> [fallbacks, seconds over eager they cost: the
    # iteration that fell back and the graph built again after it]
    sites: dict = dataclasses.field(default_factory=dict)
    _rebuild_for: str | None = None  # the site whose fallback the next generation follows
    # per traced iteration: seconds in TF's eager execution of its ops (recording excluded)
    # and the ops the skeleton would issue
    kernels: list = dataclasses.field(default_factory=list)
    ops: list = dataclasses.field(default_factory=list)
    min_saving: float = 0.05  # of an iteration: a first graph predicted to save less waits
    # this interpreter's speed against the machine the constants below were measured on
    scale: float = dataclasses.field(default_factory=lambda: python_unit() / REFERENCE_UNIT)

    # What co-execution costs the loop's thread per op it issues (the skeleton's matching,
    # stand-ins, feeds and fetches, and the graph thread's share of 2 cores), in seconds:
    # 4-18 us measured on the corpus (a co-executed step's time against an eager one's, less
    # the TF ops' time, per op), 15 in the middle of most.
    SKELETON_PER_OP = 15e-6
    # Building a graph, per node, in seconds: a node the generator emits ~210 us (TF's graph
    # building in Python: op creation, automatic control dependencies), a node of a gradient
    # region ~50 us (TF's own gradient builds those); a quarter more for the instantiation
    # beside the eager iterations. Fitted on ten corpus programs to 10-25%.
    BUILD_PER_NODE = 260e-6
    BUILD_PER_REGION_NODE = 60e-6
    # A first graph predicted to pay for itself later than this (in iterations) waits: built
    # at the third iteration and instantiated over the next few, it must have paid back well
    # before the 30th for a 30-step run to end within 5% of eager. On the corpus: Sonnet's
    # MLP 13, GPflow's GPR 12-15 and SVGP ~20, TFP's BNN ~15 and MAF ~21 iterations;
    # TF-Agents' DQN ~25 (paid back in ~17, but for the detour or second graph of its target
    # network's sync every 5 steps, which 40 steps do not earn back) and Sonnet's LSTM ~38
    # (paid back in ~14: its skeleton is cheaper than most) wait, and get their graph once
    # the budget of a longer run affords it.
    MAX_PAYBACK = 20
    # How much slower than eager's (in CPU time) the graph's iterations may measure and still
    # count as faster (:meth:`faster`): about what a busy machine adds to the CPU time of a
    # step (above), should the load change between the eager iterations and the graph's.
    NOISE = 0.25
    # Recording an op while tracing, in seconds (the recorder's callback, on the reference
    # machine: 16-20 us an op measured on DCGAN, BERT-QA, Faster R-CNN and two control-flow
    # programs with this interpreter 1.45 times slower).
    RECORD_PER_OP = 13e-6

    def reference(self):
        """Eager's time for one iteration, or None before one ran plainly. A traced
        iteration is an eager one plus recording, so it bounds eager's time too: the warm-up
        iteration alone (a Keras model's first call builds it) can be tens of times longer."""
        if not self.eager:
            return None
        ref = statistics.median(self.eager)
        return min(ref, min(self.traced)) if self.traced else ref

    def iteration(self, kind: str, seconds: float, site: str | None = None):
        """Book one finished iteration of ``seconds`` (the process's CPU time): ``eager``
        (warm-up or given up), ``traced``, ``instantiating`` (eager while TF instantiates
        the graph in the background: what it took over eager is TF's work), ``coexecuted``
        or ``fell back`` (at ``site``)."""
        self.iterations += 1
        if site is not None:
            ref = self.reference() or 0.0
            entry = self.sites.setdefault(site, [0, 0.0])
            entry[0] += 1
            entry[1] += max(0.0, seconds - ref)
            self._rebuild_for = site
        if kind == "eager":
            self.eager.append(seconds)
            return
        if kind == "traced":
            self.traced.append(seconds)
        ref = self.reference()
        if ref is None:
            return
        if kind in ("coexecuted", "fell back"):
            self.in_graph.append(seconds)
        if kind == "coexecuted":
            self.coexecuted.append(seconds)
            self.saved += ref - seconds
        else:
            self.spent += max(0.0, seconds - ref)

    def profile(self, kernels: float, ops: int):
        """A traced iteration's make-up: ``kernels`` seconds in TF's execution of its ops,
        ``ops`` of which the skeleton would issue."""
        if ops:
            self.kernels.append(kernels)
            self.ops.append(ops)

    def saving(self) -> float | None:
        """Seconds per iteration co-execution would save, predicted from the traces: the
        TF ops' time leaves the loop's thread, the skeleton's per-op Python comes in."""
        if not self.kernels:
            return None
        return min(self.kernels) - self._skeleton()

    def _skeleton(self) -> float:
        return self.SKELETON_PER_OP * self.scale * statistics.median(self.ops)

    def build_cost(self, nodes: int, region_nodes: int = 0) -> float:
        """Seconds building and instantiating a graph of ``nodes`` nodes (``region_nodes``
        of them in gradient regions) would cost."""
        if self.last_generation:
            return 2 * self.last_generation
        return self.scale * (self.BUILD_PER_NODE * (nodes - region_nodes)
                             + self.BUILD_PER_REGION_NODE * region_nodes)

    def tracing_on_costs(self, recorded: int, nodes: int, region_nodes: int = 0) -> bool:
        """Whether ``recorded`` ops traced since the traces were covered have cost what
        building a graph of ``nodes`` nodes (``region_nodes`` in gradient regions) would, both
        predicted from counts (the constants above, both in this interpreter's speed): the
        census's limit on tracing on (``GraphLifecycle._settled``), the same on any load."""
        build = self.BUILD_PER_NODE * (nodes - region_nodes) + \
            self.BUILD_PER_REGION_NODE * region_nodes
        return self.RECORD_PER_OP * recorded >= build

    def first_graph(self, nodes: int, region_nodes: int = 0) -> str | None:
        """None if the first graph (of ``nodes`` nodes, ``region_nodes`` in gradient
        regions) is to be built now: its predicted saving is at least ``min_saving`` of an
        iteration and pays for the graph within ``MAX_PAYBACK`` iterations, or its cost fits
        the budget of the run so far; else why not (for ``explain()``)."""
        saving, ref = self.saving(), self.reference()
        if saving is None or ref is None or self.min_saving == float("-inf"):
            return None
        cost = self.build_cost(nodes, region_nodes)
        if saving >= self.min_saving * ref and cost <= self.MAX_PAYBACK * saving:
            return None
        if self.budget == float("inf") or \
                self.spent - self.saved + cost <= self.budget * ref * self.iterations:
            return None
        ms, ops = min(self.kernels) * 1e3, statistics.median(self.ops)
        after = (self.spent - self.saved + cost) / (self.budget * ref)
        return (f"co-execution would save ~{max(saving, 0.0) * 1e3:.1f} ms of a ~{ref * 1e3:.1f} "
                f"ms iteration (its TF ops take ~{ms:.1f} ms; the skeleton would spend "
                f"~{self._skeleton() * 1e3:.1f} ms on its {ops:.0f} ops), too little to pay for "
                f"the graph (~{cost:.2f}s) within {self.MAX_PAYBACK} iterations: running "
                f"eagerly, and building it once the budget affords it (after ~{after:.0f} "
                "iterations)")

    def spend(self, seconds: float):
        """Seconds Terra spent between iterations (the loop waiting for TF to finish
        instantiating a graph: ``terra.lifecycle``)."""
        self.spent += seconds

    def generation(self, seconds: float):
        self.spent += seconds
        self.last_generation = seconds
        if self._rebuild_for is not None:
            self.sites[self._rebuild_for][1] += seconds
            self._rebuild_for = None

    def rebuild_allowed(self, rebuilds: int, free: int, cheap_steps: float = 20.0) -> bool:
        """Whether to build the graph again now, after ``rebuilds`` rebuilds: the first
        ``free`` are, if the last generation cost at most ``cheap_steps`` eager iterations (a
        late path or two is common, and settles); any other must be affordable."""
        ref = self.reference()
        cheap = ref is None or self.last_generation <= cheap_steps * ref
        return rebuilds < free and cheap or self.affordable()

    def affordable(self) -> bool:
        """Whether building the graph again (about what the last generation took) keeps
        what Terra spent and did not earn back within the budget of the run so far."""
        ref = self.reference()
        if ref is None or self.budget == float("inf"):
            return True
        debt = self.spent - self.saved + self.last_generation
        return debt <= self.budget * ref * self.iterations

    def faster(self) -> bool:
        """Whether recent iterations run in the graph beat eager's: the median of the last
        ``window`` (the graph's own time over several iterations, not one) below eager's
        time for one, give or take ``NOISE``. The figures are CPU time, which other
        processes on the cores move far less than wall time; within ``NOISE`` of eager's the
        graph counts as faster, so that what a busy minute moves is no evidence against it:
        leaving the graph (a pause) takes it clearly slower, coming back takes the budget
        (:meth:`pause`). Iterations that fell back count too: a graph kept while one site
        keeps failing (a detour) must earn more in the iterations it serves than the detours
        cost."""
        ref = self.reference()
        recent = self.in_graph[-self.window:]
        if ref is None or not recent:
            return False
        return statistics.median(recent) < ref * (1.0 + self.NOISE)

    def verdict(self):
        """Why Terra should stop and run eagerly, or None to go on."""
        ref = self.reference()
        if ref is None:
            return None
        allowed = self.budget * ref * self.iterations
        net = self.spent - self.saved
        # co-execution had its chance (since the last pause)
        judged = len(self.coexecuted) - self.judged_from >= self.window
        if net > allowed and judged and not self.faster():
            return (f"Terra spent {self.spent:.2f}s over eager (tracing, graph generation, "
                    f"fallbacks) and earned {self.saved:.2f}s back in {self.iterations} "
                    f"iterations of ~{ref * 1e3:.1f} ms; its co-executed iterations are not "
                    "faster than eager, so it would not earn the rest back")
        return None

    def pause(self):
        """After a :meth:`verdict`: Terra runs eagerly, and tries again once the run is long
        enough for the budget to afford another graph (:meth:`affordable`), judged on the
        iterations of that attempt alone. A slow minute costs a pause, not the run."""
        self.pauses += 1
        self.judged_from = len(self.coexecuted)
        self.in_graph.clear()

    def __str__(self):
        ref = self.reference()
        eager = f"~{ref * 1e3:.1f} ms" if ref is not None else "unknown"
        lines = [f"cost ledger (CPU time): eager iteration {eager}; spent {self.spent:.2f}s "
                 f"over eager, earned back {self.saved:.2f}s"]
        for site, (n, cost) in sorted(self.sites.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  fallbacks at {site}: {n}, cost {cost:.2f}s (the iterations and "
                         "the graphs built again after them)")
        return "\n".join(lines)
