"""What happened in a run, kept for ``explain()`` and told to the ``terra`` logger as it
happens: fallbacks, detours, Terra's own failures, the reason it stopped, graphs instantiated
(an :class:`EventLog` per runtime); and the tapes that acted as plain ``tf.GradientTape``s,
which may never build a runtime (kept for the process until ``terra.reset()``).

Its own module so that the runtime and its graph lifecycle both note events without calling
back into each other, and ``explain()`` reads them from one place.
"""

import logging

from terra.config import config

log = logging.getLogger("terra")
_WARN = ("fallback", "eager", "Terra error", "graph error")  # events worth a warning
_plain_tapes: dict = {}  # why a tape acted as a plain GradientTape -> how many times


def note_plain_tape(why):
    """A Terra tape acts as a plain GradientTape; ``explain()`` says why and how often."""
    _plain_tapes[why] = _plain_tapes.get(why, 0) + 1


def plain_tapes() -> dict:
    """Why Terra tapes acted as plain GradientTapes -> how many times, since the last reset."""
    return dict(_plain_tapes)


def plain_tape_count() -> int:
    """How many tape enters acted as plain GradientTapes since the last reset."""
    return sum(_plain_tapes.values())


def forget_plain_tapes():
    _plain_tapes.clear()


class EventLog:
    """The events of one runtime, in order: ``(what, reason, where)``, where ``where`` is the
    user's location or None."""

    def __init__(self):
        self.events = []
        self._logged = set()  # (kind of event, site) already logged as a warning
        if config.verbosity > 0 and not log.handlers:
            log.addHandler(logging.StreamHandler())
            log.setLevel(logging.INFO)

    def __iter__(self):
        return iter(self.events)

    def note(self, what, reason, where=None):
        """An event for ``explain()``, and a log record (logger ``terra``): the first of its
        kind at a site is a warning (Terra stopped, a fallback, its own failure), the rest
        are for ``TERRA_VERBOSITY`` 1 and up; informational events are always below."""
        self.events.append((what, reason, where))
        at = f" at {where.file}:{where.line}" if where else ""
        key = (what.split(" [")[0], at)
        first = key not in self._logged
        self._logged.add(key)
        level = logging.WARNING if first and what.startswith(_WARN) else logging.INFO
        log.log(level, "Terra %s%s: %s", what, at, reason.splitlines()[0] if reason else "")
