"""Every Terra switch, read in one place.

Each switch has an environment variable (read when Terra is imported) and a keyword
of :func:`terra.configure`. Keeping them here means a test or a benchmark can flip a mode
without knowing which module consults it.
"""

import dataclasses
import os


def _env_flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def _names(value) -> tuple:
    """A list of module names or paths: a comma-separated string or any iterable."""
    if isinstance(value, str):
        value = value.split(",")
    return tuple(n.strip() for n in value if n.strip())


_ACTIONS = ("raise", "warn")


def _action(value):
    """A valid ``verify_action``: checked when set, not when a difference is found."""
    if value not in _ACTIONS:
        raise ValueError(f"verify_action must be one of {_ACTIONS}, not {value!r}")
    return value


@dataclasses.dataclass
class Config:
    """Terra's switches.

    Attributes:
      disable: ``TerraGradientTape`` behaves exactly like ``tf.GradientTape`` (``TERRA_DISABLE``).
      xla: compile the pure-compute parts of the symbolic graph with XLA (``TERRA_XLA``).
      exact: (``TERRA_EXACT``, on by default) the graph computes every value with eager's
        rounding: Grappler's rewrites that regroup arithmetic or fuse ops into oneDNN kernels
        are off, and so is oneDNN's merge of a bias gradient into its convolution's. Off,
        the graph gets the rewrites ``tf.function`` gets, and its numbers may differ from
        eager's in the last bits (which training can amplify).
      background: (``TERRA_BACKGROUND``, on by default) TF instantiates a new graph in a
        background thread while the loop runs on eagerly; co-execution starts at the first
        iteration after that (``terra.background``). Off, the first co-executed iteration
        waits for it, and co-execution starts right after the last trace (which tests that
        inject a fault into a given co-executed step rely on).
      lazy: serialize the two runners: the graph of an iteration starts only when Python
        needs one of its values or the iteration ends (``TERRA_LAZY``; the paper's LazyEval).
      strict: Terra's own failures raise instead of turning into eager execution
        (``TERRA_STRICT``; for Terra's tests).
      check: run ``TraceGraph.lint()`` after every merge and every generation pass that
        transforms the TraceGraph (``TERRA_CHECK``; on in the tests).
      timeout: seconds any wait between the runners may take before it raises
        (``TERRA_TIMEOUT``).
      freeze_gc: (``TERRA_FREEZE_GC``) when a trace starts, freeze every object the garbage
        collector tracks (``gc.freeze``), and after generating a graph, collect the young
        garbage and freeze the rest. A full collection walks everything TensorFlow, Keras
        and the model created (0.2 s over ~400k objects on a small CPU): a trace allocates
        enough long-lived objects to set one off (measured: 0.23 s inside the second trace
        of a TFP program whose eager step takes 33 ms), and co-execution's ~1000 short-lived
        objects per iteration set one off every few dozen steps. Freezing is cheap; a full
        collection before it would cost as much as the one it avoids, and found 0-20 garbage
        objects at that point in the corpus programs. Frozen objects are still freed by
        reference counting; cyclic garbage among them waits for ``terra.reset()``, which
        unfreezes.
      warmup: iterations run eagerly before tracing starts; Keras creates optimizer slot
        variables during the first step, so that step is never traced.
      max_trace_ops: a trace longer than this is abandoned and the iteration runs eagerly
        (ops after the training loop belong to the last iteration; this bounds their cost).
      budget: (``TERRA_BUDGET``) the seconds Terra may spend over eager (tracing,
        generation, fallbacks) without earning them back, as a fraction of the run's eager
        time; past it, and with
        co-executed iterations no faster than eager, Terra runs eagerly (``terra.budget``).
      min_saving: (``TERRA_MIN_SAVING``) a first graph whose saving the traces predict
        under this fraction of an iteration is not built until the budget affords its
        estimated cost (``terra.budget``); ``-inf`` builds it at once whatever it predicts.
      new_path_risk: (``TERRA_NEW_PATH_RISK``) a graph is built once a trace is covered and
        the chance that the next iteration takes a path no trace took, estimated from how
        many traces took a path no other did (``terra.census``), is at most this; else
        tracing goes on, for at most what building the graph would cost. 1.0 builds at the
        first covered trace.
      verbosity: (``TERRA_VERBOSITY``, like ``AUTOGRAPH_VERBOSITY``) what the ``terra`` logger
        prints to stderr: 0, a warning the first time a site falls back and when Terra runs
        eagerly for good or fails itself; 1, every event ``explain()`` lists, as it happens.
        Standard ``logging`` configuration of the ``terra`` logger works as usual.
      free_rebuilds: (``TERRA_FREE_REBUILDS``) graphs built again after a fallback without
        asking the budget, if the last generation took at most 20 eager iterations: a program
        with a late path or two (a target network synced every few steps, one new shape)
        settles after one or two; one whose paths keep coming, or whose graph is costly to
        build, takes detours (the iteration that took the new path runs eagerly, the graph
        is kept) or waits, running eagerly, until the budget affords the next
        (``terra.budget``).
      fold_after: once this many iterations after a graph was built took a forward path (a
        combination of branches) or shapes none of a gradient call's regions was recorded for
        (each costs a fallback or a longer trace), the call's regions become one, TF's
        gradient through the switch-cases, which serves every combination and shape
        (``terra.regions``). Its rounding may
        differ from the tape's in the last bit where a value has three or more consumers
        (the sum's order), so a call that does not keep meeting new paths keeps the regions
        the tape recorded, which are bit-exact.
      max_fallbacks_in_a_row: after this many fallbacks without a co-executed iteration in
        between, or this many in all once they outnumber the co-executed iterations, stop
        generating graphs and run eagerly (``explain()`` says why): a program that takes a
        new path every step (a loop growing by one trip per step, a data-dependent shape)
        would otherwise trace, generate and fall back forever, slower than eager.
      verify: (``TERRA_VERIFY``) verify mode: every ``verify``-th co-executed iteration is
        run again eagerly from the variables it started with and compared with what the
        graph computed (``terra.verify``); 0, off. A long run can then show, at a cost it
        chooses, that Terra still gives eager's numbers.
      verify_rtol, verify_atol: (``TERRA_VERIFY_RTOL``, ``TERRA_VERIFY_ATOL``) how far a
        floating-point value may be from eager's, as ``numpy.isclose`` reads them (eager's
        value is the reference). Not zero by default: a symbolic gradient or a While sums
        in another order than the tape (1e-7 relative), and XLA or ``exact`` off round
        otherwise; integers, booleans and strings must be equal.
      verify_action: (``TERRA_VERIFY_ACTION``) what a difference does: ``"raise"``
        (``terra.DivergenceError`` at the next tape enter or op) or ``"warn"`` (a
        ``terra.DivergenceWarning``, and the run goes on). Either way Terra runs eagerly
        from there, from eager's variables.
      commit: (``TERRA_COMMIT``) graphs whose writes all come at the path's end wait for
        Python's word before writing, so an iteration that can no longer fall back needs no
        snapshot of the written variables (``terra.commit``); off, every job snapshots.
      native: (``TERRA_NATIVE``, on by default) the co-execution door and the lanes of its
        common forms run in C (``terra._native``, built at install where a C compiler is;
        ``terra.lanes``). Off, or where it was not built, the same lanes run in Python:
        the same ops answered the same way, each a few microseconds slower. Read when the
        runtime makes its co-execution door and when a lane is built.
      user_code, library_code: (``TERRA_USER_CODE``, ``TERRA_LIBRARY_CODE``: comma-separated)
        module names or paths whose code is the user's although installed (a framework of
        the user's in site-packages), or a library's although not installed (a library
        developed beside the program): where Terra draws the line between the user's code
        and libraries (``terra.boundary``). Set before the training loop starts.
    """

    disable: bool = False
    xla: bool = False
    exact: bool = True
    background: bool = True
    lazy: bool = False
    check: bool = False
    strict: bool = False
    freeze_gc: bool = True
    timeout: float = 120.0
    warmup: int = 1
    max_trace_ops: int = 200_000
    max_fallbacks_in_a_row: int = 4
    fold_after: int = 2
    budget: float = 0.05
    free_rebuilds: int = 2
    min_saving: float = 0.05
    new_path_risk: float = 0.2
    verbosity: int = 0
    verify: int = 0
    verify_rtol: float = 1e-5
    verify_atol: float = 1e-6
    verify_action: str = "raise"
    commit: bool = True
    native: bool = True
    user_code: tuple = ()
    library_code: tuple = ()

    @classmethod
    def from_env(cls) -> "Config":
        return cls(
            disable=_env_flag("TERRA_DISABLE"),
            xla=_env_flag("TERRA_XLA"),
            exact=_env_flag("TERRA_EXACT", default=True),
            background=_env_flag("TERRA_BACKGROUND", default=True),
            lazy=_env_flag("TERRA_LAZY"),
            check=_env_flag("TERRA_CHECK"),
            strict=_env_flag("TERRA_STRICT"),
            freeze_gc=_env_flag("TERRA_FREEZE_GC", default=True),
            timeout=float(os.environ.get("TERRA_TIMEOUT", "120")),
            budget=float(os.environ.get("TERRA_BUDGET", "0.05")),
            free_rebuilds=int(os.environ.get("TERRA_FREE_REBUILDS", "2")),
            min_saving=float(os.environ.get("TERRA_MIN_SAVING", "0.05")),
            new_path_risk=float(os.environ.get("TERRA_NEW_PATH_RISK", "0.2")),
            verbosity=int(os.environ.get("TERRA_VERBOSITY", "0")),
            verify=int(os.environ.get("TERRA_VERIFY", "0")),
            verify_rtol=float(os.environ.get("TERRA_VERIFY_RTOL", "1e-5")),
            verify_atol=float(os.environ.get("TERRA_VERIFY_ATOL", "1e-6")),
            verify_action=_action(os.environ.get("TERRA_VERIFY_ACTION", "raise")),
            commit=_env_flag("TERRA_COMMIT", default=True),
            native=_env_flag("TERRA_NATIVE", default=True),
            user_code=_names(os.environ.get("TERRA_USER_CODE", "")),
            library_code=_names(os.environ.get("TERRA_LIBRARY_CODE", "")),
        )


config = Config.from_env()


def configure(**switches):
    """Set switches (see :class:`Config`), e.g. ``configure(lazy=True)``."""
    for name, value in switches.items():
        if not hasattr(config, name):
            raise TypeError(f"unknown Terra switch {name!r}")
        if name == "verify_action":
            value = _action(value)
        elif name in ("user_code", "library_code"):
            value = _names(value)
        setattr(config, name, value)
    if switches.keys() & {"user_code", "library_code"}:
        from terra import boundary

        boundary.forget()
