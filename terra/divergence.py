"""Why co-execution leaves the graph: the typed reasons the PythonRunner and the tapes raise,
and the one handler that turns each into a fallback (``Runtime.handle``)."""


class Divergence(Exception):
    """The iteration left the path the graph was built for: the runtime's one handler
    (``Runtime.handle``) turns it into a fallback. ``category`` is what ``terra.explain()``
    groups fallbacks by: new op, attribute change, new producer, value change, shape change,
    new fetch point, unsupported, user exception, early end, terra error (and new loop count,
    which the runtime tells apart with :meth:`PythonRunner.loop_trips_differ`). The handler
    fills in ``site``, the user's line where Python was. ``ran``: the op that diverged
    already ran (its ``result`` is what Python gets)."""

    ran = False
    result = None

    def __init__(self, reason: str, category: str = "new op"):
        super().__init__(reason)
        self.reason = reason
        self.category = category
        self.site = None


class RegionMissed(Divergence):
    """No gradient region of the call ``call`` (a key) was recorded for this iteration's
    forward pass, or for its shapes: a call that keeps missing gets one region for every
    path (``regions.fold``, ``Config.fold_after``)."""

    def __init__(self, reason: str, call, category: str):
        super().__init__(reason, category)
        self.call = call


class OffPath(Divergence):
    """An op the path does not have next, raised before anything of it was matched (no Case
    Select fed, nothing logged), so at a branch point too the iteration may end there
    (``PythonRunner.may_end_before``)."""


class PathEnded(OffPath):
    """An op arrived after the whole recorded path had been matched: the loop is over, or
    this iteration does more than the traced ones did after their last recorded op."""


class RaisedInPython(Divergence):
    """An op that Python runs for real (an iterator's ``get_next``) raised TF's error, as
    eager raises it there (``OutOfRangeError`` at the end of a dataset, which Keras and
    ``for x in dataset`` take as the epoch's end). The op ran once and must not run again:
    the runtime ends the iteration there or falls back, then raises ``error``
    (``Runtime.handle``)."""

    def __init__(self, error):
        super().__init__(f"{type(error).__name__} raised by an op run in Python: {error}",
                         "user exception")
        self.error = error


class RanThenDiverged(Divergence):
    """A Python-run op ran for real and its outputs do not fit the graph: fall back, then
    hand Python this ``result`` (running the op again would repeat its side effects)."""

    ran = True

    def __init__(self, reason: str, result, category: str = "shape change"):
        super().__init__(reason, category)
        self.result = result


class IterationAborted(RuntimeError):
    """A value was asked of an iteration whose graph work was discarded."""


class GraphFailed(Exception):
    """The graph raised while running an iteration; carries the job. ``at_end``: noticed
    when Python had issued every op of the iteration (so the failing op is among them)."""

    def __init__(self, job):
        super().__init__(str(job.error))
        self.job = job
        self.at_end = False
        self.ran = False  # the step being matched is in the log: the replay runs it
        self.result = None  # then, what Python gets for it

    def user_error(self):
        """The graph's error as the user is to see it, where no replay reproduces it: TF's
        own error type and message, saying it came from the graph Terra ran."""
        err = self.job.error
        if not hasattr(err, "message"):
            return err
        return type(err)(getattr(err, "node_def", None), getattr(err, "op", None),
                         f"{err.message} (raised by the graph Terra ran for your loop)")
