"""Where Python waited for the graph: the host-sync report of ``terra.explain()``.

Co-execution pays off while the skeleton runs ahead of the graph; every value Python reads
(``.numpy()``, ``float()``, ``if tensor:``, ``print``, an op that must run in Python) makes it
wait until the graph has computed that value, and so does the end of an iteration whose graph
work is not done yet, where the runner waits for the graph to finish it (section 4 of
docs/architecture.md). A loop that
reads its loss every step at one line and its accuracy at another wants to know which of the
two costs it the overlap, so each wait is booked to the user's line that caused it, with the
seconds it took. The user's line is found by walking the stack (``location.user_location``),
only after a wait, never on an op that does not wait: ~3 us a wait in a Keras loop, where the
cheapest read, of a value the graph had already computed, took ~30 us.
"""

import linecache

from terra.location import Location

VALUE = "value read"  # Python read a value the graph computes (fetch channel)
END = "iteration end (the graph finishing it)"  # the path's last op waits for the whole job


class SyncLog:
    """The waits of one runtime, by kind and user line: ``(kind, Location) -> [count,
    seconds]``, shared by the runtime's successive PythonRunners."""

    def __init__(self):
        self.lines = {}

    def add(self, kind, seconds, where: Location | None):
        book = self.lines.get((kind, where))
        if book is None:
            self.lines[(kind, where)] = [1, seconds]
        else:
            book[0] += 1
            book[1] += seconds

    def total(self):
        """(waits, seconds) over every line."""
        return (sum(n for n, _ in self.lines.values()),
                sum(t for _, t in self.lines.values()))

    def by_cost(self):
        """``(kind, where, count, seconds)`` per line, the costliest first."""
        rows = [(kind, where, n, t) for (kind, where), (n, t) in self.lines.items()]
        rows.sort(key=lambda row: -row[3])
        return rows

    def report(self, graph_idle, limit=None):
        """The report's lines: the totals, then one line per user line and kind, costliest
        first (the first ``limit`` of them, if given). ``graph_idle``: seconds the
        GraphRunner waited for Python to start an iteration."""
        n, total = self.total()
        if not n:
            return []
        lines = [f"host syncs: Python waited {_ms(total)} for the graph in {n} waits; the "
                 f"graph waited {_ms(graph_idle)} for Python between iterations"]
        rows = self.by_cost()
        for kind, where, count, seconds in rows[:limit]:
            at = f"{where.file}:{where.line} ({where.func})" if where else "?"
            code = linecache.getline(where.file, where.line).strip() if where else ""
            if len(code) > 60:
                code = code[:57] + "..."
            lines.append(f"  {at} {kind}: {count} waits, {_ms(seconds)} total, "
                         f"{_ms(seconds / count)} mean" + (f"  | {code}" if code else ""))
        if limit is not None and len(rows) > limit:
            lines.append(f"  ... and {len(rows) - limit} more lines (explain(verbose=True))")
        return lines


def _ms(seconds):
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.1f} s"
