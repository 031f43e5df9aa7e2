"""The paths the traces took, and the chance that the next iteration needs one never seen.

A trace the TraceGraph covers says the graph would serve *that* iteration, not that the
program's paths have settled. A program that draws its path at random (SDPoint picks its
down-sampling block and ratio with Python's ``random``: five paths) is covered by its third
trace with two of the five seen; its graph then falls back at the first other one, and each
rebuild (hundreds of milliseconds of graph building) finds one more path. Tracing on costs a
fraction of an eager iteration; a graph built too early costs a fallback and a generation.

The chance is estimated by leaving each trace out: would the others have covered it? A trace
that went along an edge of the TraceGraph no other trace went along would not have been
(Good and Turing's estimate of unseen species, with edges for species: the graph serves any
combination of edges it holds, as its switch-cases are taken one by one). So the estimate is
the share of the counted iterations that took such an edge. The iterations a graph
co-executed count too, as iterations on known edges: a program whose traces repeat a few
paths gets a small chance quickly, and so does one that met one rare path after many
co-executed iterations; one that met several new edges once each, among few iterations,
still has a large one. Two things do not make another path: a loop's unrolled trips count as
its first trip (another trip count is the same loop, rolled into one by the generator), and
gradient regions are left out (the forward path decides them, or one region serves every
path, ``terra.regions``).
"""

import collections

from terra.nodes import NodeKind


class PathCensus:
    """The paths of the last ``window`` traces (TraceGraph nodes, region nodes left out).
    Those recorded before :meth:`restart` still tell which edges were taken, but are no
    samples: not counted, nor asked whether another trace covers them."""

    def __init__(self, window: int = 64):
        self._paths = collections.deque(maxlen=window)
        # per path, its signature as the loops known when it was computed read it (None: not
        # computed yet); all are computed again when a trace finds more loop trips
        self._signatures = collections.deque(maxlen=window)
        self._samples = 0  # how many of the last paths are samples
        self._trips_seen = 0

    def add(self, path):
        self._paths.append(tuple(n for n in path if not n.in_body and n.kind is not NodeKind.GRAD))
        self._signatures.append(None)
        self._samples = min(self._samples + 1, len(self._paths))

    def restart(self):
        """The paths counted so far are no samples of those to come (Terra records the
        program otherwise from now on)."""
        self._samples = 0

    def __len__(self):
        return self._samples

    def paths(self, trips) -> int:
        """How many different paths (sets of edges) the sampled traces took."""
        return len(set(self._sampled(self._signed(trips))))

    def new_path_chance(self, trips, served: int = 0) -> float:
        """The leave-one-out estimate that the next iteration goes along an edge none of the
        counted iterations did: how many sampled traces went along an edge no other trace
        did, over the samples and the ``served`` iterations a graph co-executed (each went
        along edges the traces had). ``trips``: ``TraceGraph.trips`` (a loop's first trip's
        nodes -> its trips' nodes)."""
        if not self._samples:
            return 1.0
        signatures = self._signed(trips)
        uses = collections.Counter(edge for edges in signatures for edge in edges)
        samples = self._sampled(signatures)
        alone = sum(1 for edges in samples if any(uses[e] == 1 for e in edges))
        return alone / (len(samples) + served)

    def _sampled(self, signatures):
        return list(signatures)[len(signatures) - self._samples:]

    def _signed(self, trips):
        """Every path's edges, a loop's trips read as its first (computed again for all
        when loops have more trips known than when they were computed)."""
        known = sum(len(by_trip) for by_trip in trips.values())
        first_trip = {}
        for first, by_trip in trips.items():
            for chain in by_trip.values():
                first_trip.update(zip(chain, first))
        for i, (path, signature) in enumerate(zip(self._paths, self._signatures)):
            if signature is None or known != self._trips_seen:
                nodes = [None, *(first_trip.get(n, n) for n in path), None]  # start, end
                self._signatures[i] = frozenset(zip(nodes, nodes[1:]))
        self._trips_seen = known
        return self._signatures
