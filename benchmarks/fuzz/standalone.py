"""The harness every generated program carries: run one mode, or both and judge them.

Its text below the marker is copied verbatim into each generated program, so a program written
to ``fuzz-failures/`` runs alone (``python S.py``: eager and Terra in two child processes, a
report, exit status 1 on a difference); the fuzz driver imports the same functions, so the
file and the driver can never disagree on what counts as a failure. Standard library and numpy
only at import: the parent process never needs TensorFlow.
"""
# --- fuzz harness ---
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

RTOL, ATOL = 1e-4, 1e-6
EVENT = re.compile(r"^(fallback|Terra error|eager|trace not merged|graph error)", re.M)
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)")


def child_env(legacy):
    """The environment of one run: tf_keras programs need TF_USE_LEGACY_KERAS before TF is
    imported; Terra's cost budget is lifted (unless set) so co-execution is exercised even
    where it does not pay on such tiny models, and the graph is instantiated by the first
    co-executed iteration (unless set): instantiated in the background, it is ready some
    iterations later, and a 16-step program whose traces took most of its steps would never
    co-execute (a campaign measured 0 of 24 co-executed that way)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.setdefault("TERRA_BUDGET", "1e9")
    env.setdefault("TERRA_BACKGROUND", "0")
    if legacy:
        env["TF_USE_LEGACY_KERAS"] = "1"
    return env


def run_mode(program, mode, enable, path):
    """Run ``program`` once, eagerly or under Terra, and write what it returned (or raised),
    its log and, for Terra, ``stats()`` and ``explain()`` to ``path`` as JSON."""
    import tensorflow as tf

    tape = tf.GradientTape
    if mode == "terra":
        import terra

        terra.reset()
        if enable:
            terra.enable()
        else:
            tape = terra.TerraGradientTape
    log, result = io.StringIO(), {"mode": mode, "error": None, "values": None}
    start = time.perf_counter()
    try:
        result["values"] = plain(program(tape, log))
    except Exception as error:
        result["error"] = {"type": type(error).__name__, "message": str(error)[:1500],
                           "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = time.perf_counter() - start
    result["log"] = log.getvalue()
    if mode == "terra":
        stats = terra.stats()
        result["stats"] = {k: getattr(stats, k) for k in
                           ("iterations", "traces", "fallbacks", "graph_generations",
                            "coexecuted", "phase")}
        result["explain"] = str(terra.explain())
    with open(path, "w") as handle:
        json.dump(result, handle, allow_nan=True)


def plain(value):
    """Tensors and variables as {"a": flat list, "dtype", "shape"}; containers recursively."""
    if hasattr(value, "numpy") or isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
        return {"a": array.ravel().tolist(), "dtype": array.dtype.str, "shape": list(array.shape)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def run_child(path, mode, legacy, timeout):
    """One mode of the program file in its own process; a timeout is a hang."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "result.json")
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, str(path), "--mode", mode, "--json", out],
                                  env=child_env(legacy), capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            tail = (expired.stderr or b"")[-1500:]
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            result = load(out) or {}
            return dict(result, status="timeout", stderr=tail, written=bool(result))
        result = load(out)
        if result is None or done.returncode != 0:
            return {"status": "died", "returncode": done.returncode,
                    "stderr": done.stderr[-1500:], **(result or {})}
        return dict(result, status="ok", wall=time.perf_counter() - start)


def load(path):
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def judge(eager, terra):
    """The verdict on one program: kind is ok, invalid (eager itself failed), mismatch, crash
    or hang; step is the first step whose loss differs (None if the losses agree)."""
    verdict = {"kind": "ok", "step": None, "detail": "", "reason": "", "coexecuted": False}
    if eager["status"] != "ok" or eager["error"]:
        what = eager.get("error") or {"type": eager["status"], "message": eager.get("stderr")}
        return dict(verdict, kind="invalid", detail=f"eager: {what['type']}: {what['message']}")
    stats = terra.get("stats") or {}
    verdict["stats"] = stats
    verdict["coexecuted"] = stats.get("coexecuted", 0) * 2 >= max(stats.get("iterations", 0), 1)
    verdict["reason"] = first_event(terra.get("explain", ""))
    if terra["status"] == "timeout":
        when = "after the program returned" if terra.get("written") else "during the run"
        return dict(verdict, kind="hang", detail=f"no exit {when}: {last_line(terra['stderr'])}")
    if terra["status"] == "died":
        return dict(verdict, kind="crash",
                    detail=f"exit {terra['returncode']}: {last_line(terra['stderr'])}")
    if terra["error"]:
        error = terra["error"]
        return dict(verdict, kind="crash", detail=f"{error['type']}: {error['message']}")
    difference = compare(eager, terra)
    if difference is not None:
        return dict(verdict, kind="mismatch", step=difference[0], detail=difference[1])
    return verdict


def first_event(explain):
    for line in explain.splitlines():
        if EVENT.match(line):
            return line.strip()[:400]
    return ""


def last_line(text):
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:400] if lines else "(no output)"


def compare(eager, terra):
    """(first differing step or None, what differs), or None when the runs agree: losses
    step by step, then the final variables, the printed log and the other outputs."""
    left, right = dict(eager["values"]), dict(terra["values"])
    e_losses, t_losses = left.pop("losses"), right.pop("losses")
    for (e_step, e_value), (t_step, t_value) in zip(e_losses, t_losses):
        if e_step != t_step or not close(e_value, t_value):
            return e_step, (f"loss at step {e_step}: eager {number(e_value)}, "
                            f"Terra (step {t_step}) {number(t_value)}")
    if len(e_losses) != len(t_losses):
        step = (e_losses[len(t_losses)] if len(e_losses) > len(t_losses) else
                t_losses[len(e_losses)])[0]
        return step, f"eager logged {len(e_losses)} losses, Terra {len(t_losses)}"
    for key in sorted(set(left) | set(right)):
        where = differ(left.get(key), right.get(key), key)
        if where:
            return None, where
    if not same_text(eager["log"], terra["log"]):
        return None, f"printed log: eager {eager['log'][-200:]!r}, Terra {terra['log'][-200:]!r}"
    return None


def close(a, b):
    a, b = as_array(a), as_array(b)
    if a.shape != b.shape:
        return False
    if a.dtype.kind in "fc" or b.dtype.kind in "fc":
        return bool(np.allclose(b, a, rtol=RTOL, atol=ATOL, equal_nan=True))
    return bool(np.array_equal(a, b))


def number(value):
    array = as_array(value)
    return f"{array.item():.7g}" if array.size == 1 else str(array.tolist())


def as_array(value):
    if isinstance(value, dict) and "a" in value:
        return np.array(value["a"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    return np.asarray(value)


def differ(a, b, where):
    """The path of the first difference between two ``plain`` values, or ''."""
    if isinstance(a, dict) and "a" not in a:
        if not isinstance(b, dict) or sorted(a) != sorted(b):
            return f"{where}: keys differ"
        found = (differ(a[k], b[k], f"{where}.{k}") for k in sorted(a))
        return next((w for w in found if w), "")
    if isinstance(a, list) and not (a and not isinstance(a[0], dict | list)):
        if not isinstance(b, list) or len(a) != len(b):
            return f"{where}: lengths differ"
        found = (differ(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
        return next((w for w in found if w), "")
    if isinstance(a, str) or isinstance(b, str):
        return "" if a == b else f"{where}: eager {a!r}, Terra {b!r}"
    if a is None or b is None:
        return "" if a is b else f"{where}: eager {a!r}, Terra {b!r}"
    if close(a, b):
        return ""
    x, y = as_array(a), as_array(b)
    if x.shape != y.shape:
        return f"{where}: shape eager {list(x.shape)}, Terra {list(y.shape)}"
    worst = np.nanmax(np.abs(x.astype(float) - y.astype(float))) if x.size else 0.0
    return f"{where}: max |eager - Terra| = {worst:.3g}"


def same_text(a, b):
    """Printed text: the same words, and numbers equal within the tolerance (whitespace aside:
    numpy pads printed arrays by the width of their numbers)."""
    numbers = [[float(n) for n in NUMBER.findall(text)] for text in (a, b)]
    shape = [re.sub(r"\s+", "", NUMBER.sub("#", text)) for text in (a, b)]
    return shape[0] == shape[1] and len(numbers[0]) == len(numbers[1]) and bool(
        np.allclose(numbers[1], numbers[0], rtol=RTOL, atol=ATOL, equal_nan=True))


def main(program, legacy, enable, timeout=120.0):
    """``--mode eager|terra --json PATH``: one run. No arguments: both, compared, reported."""
    if "--mode" in sys.argv:
        mode, path = sys.argv[sys.argv.index("--mode") + 1], sys.argv[sys.argv.index("--json") + 1]
        run_mode(program, mode, enable, path)
        return
    here = os.path.abspath(sys.argv[0])
    eager = run_child(here, "eager", legacy, timeout)
    terra = run_child(here, "terra", legacy, timeout) if eager["status"] == "ok" else eager
    verdict = judge(eager, terra)
    print(f"{verdict['kind']}: {verdict['detail'] or 'Terra gave eager results'}")
    print(f"terra.stats(): {verdict.get('stats')}")
    if verdict["reason"]:
        print(f"first explain() event: {verdict['reason']}")
    sys.exit(0 if verdict["kind"] == "ok" else 1)
