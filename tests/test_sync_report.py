"""The host-sync report of ``terra.explain()``: each user line where Python waited for the
graph, with how many waits it took; the counts are what the loop itself saw."""

import inspect
import re

import tensorflow as tf
from tiny_models import batch, mlp_task

import terra
from terra import runtime, syncs
from terra.location import Location


def _reading_loop(steps):
    """A loop that reads the loss with ``.numpy()`` at one line and a gradient's norm with
    ``float()`` at another, every step. Returns the number of steps each read was made in
    co-execution (the phase seen right after the read)."""
    data, model, optimizer, loss_fn = mlp_task(steps)
    coexecuted_reads = 0
    for step in range(steps):
        x, y = batch(data, step, 16)
        with terra.TerraGradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        norm = tf.norm(grads[0])
        loss.numpy()  # read: numpy
        float(norm)  # read: float
        coexecuted_reads += terra.stats().phase == "coexecution"
    return coexecuted_reads


def _line_of(marker):
    """The line of ``_reading_loop`` that carries ``marker`` (found, never written down)."""
    source, first = inspect.getsourcelines(_reading_loop)
    (offset,) = [i for i, text in enumerate(source) if text.rstrip().endswith(marker)]
    return first + offset


def test_explain_lists_each_line_python_waited_at_with_its_count():
    terra.reset()
    reads = _reading_loop(10)
    s = terra.stats()
    assert s.coexecuted > 0 and s.fallbacks == 0, terra.explain()
    assert reads >= s.coexecuted  # the reads after the last tape enter co-execute too
    file = inspect.getsourcefile(_reading_loop)
    book = runtime.current().syncs.lines
    # every wait is the user's line's: none is Terra's own code (a lane waits at the path's
    # end, in code Terra compiled)
    assert all(where is None or not where.file.startswith("<") for _, where in book), book
    for marker in ("# read: numpy", "# read: float"):
        line = _line_of(marker)
        (key,) = [k for k in book if k[0] == syncs.VALUE and k[1] is not None
                  and (k[1].file, k[1].line) == (file, line)]
        assert book[key][0] == reads, (marker, book)
        for text in (terra.explain(), terra.explain(verbose=True)):
            (row,) = [r for r in text.splitlines() if f"{file}:{line} " in r]
            assert f"{syncs.VALUE}: {reads} waits" in row, text
    # the waits are listed costliest first, and the header gives the graph's idle time
    text = terra.explain()
    totals = [float(m) for m in re.findall(r"waits, ([0-9.]+) ms total", text)]
    assert len(totals) >= 2 and totals == sorted(totals, reverse=True), text
    assert "the graph waited" in text and "for Python between iterations" in text, text


def test_the_summary_keeps_the_costliest_lines_only():
    log = syncs.SyncLog()
    for k in range(15):
        log.add(syncs.VALUE, 0.001 * (k + 1), Location(__file__, k + 1, "f"))
    short, full = log.report(0.0, limit=10), log.report(0.0)
    assert len(full) == 1 + 15 and len(short) == 1 + 10 + 1, short
    assert f"{__file__}:15 " in short[1] and f"{__file__}:1 " in full[-1]
    assert "5 more lines" in short[-1]
