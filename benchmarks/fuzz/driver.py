"""The fuzz loop: generate, run in parallel, report, write and minimize the failures.

A program's identity is its seed plus the generation options (steps, --only, --disable), so
each failure line carries the one command that draws it again. Failures are grouped by symptom
(kind plus the Terra error or first fallback category): one minimized reproduction per
distinct symptom is worth more than many copies of the same bug.
"""

import dataclasses
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .minimize import minimize
from .program import DEFAULT_STEPS, generate, render
from .runner import Result, run


@dataclasses.dataclass
class Options:
    count: int = 40
    seed: int = 0
    steps: int = DEFAULT_STEPS
    jobs: int = 1
    timeout: float = 120.0
    out: str = "fuzz-failures"
    only: list = dataclasses.field(default_factory=list)
    disabled: list = dataclasses.field(default_factory=list)
    min_trials: int = 24
    show: bool = False
    record: str = ""  # a JSON-lines file: one line per program (its draw, verdict, stats)
    resume: bool = False  # skip the seeds ``record`` already holds; count them in the summary

    def command(self, seed: int) -> str:
        """The command that draws program ``seed`` again, with these generation options."""
        parts = [f"python -m benchmarks.fuzz --seed {seed} --count 1"]
        if self.steps != DEFAULT_STEPS:
            parts.append(f"--steps {self.steps}")
        if self.only:
            parts.append(f"--only {','.join(self.only)}")
        if self.disabled:
            parts.append(f"--disable {','.join(self.disabled)}")
        return " ".join(parts)


@dataclasses.dataclass
class Summary:
    results: list

    def count(self, kind: str) -> int:
        return sum(r.kind == kind for r in self.results)

    def line(self) -> str:
        coexecuted = sum(bool(r.verdict.get("coexecuted")) for r in self.results)
        return (f"{len(self.results)} programs, {self.count('mismatch')} mismatches, "
                f"{self.count('crash')} crashes, {self.count('hang')} hangs, "
                f"{coexecuted} co-executed")


def fuzz(options: Options) -> int:
    """Run the campaign; the exit status is 1 if any program failed or was invalid."""
    if options.show:
        print(render(_program(options, options.seed)))
        return 0
    done = _recorded(options) if options.resume else {}
    results = [Result(None, verdict) for verdict in done.values()]
    with ThreadPoolExecutor(max(1, options.jobs)) as pool:
        for result in campaign(options, pool, skip=done):
            results.append(result)
            if result.failed or result.kind == "invalid":
                print(failure_line(result, options), flush=True)
            if options.record:
                with open(options.record, "a") as handle:
                    handle.write(json.dumps(record(result)) + "\n")
            if result.failed:
                out = Path(options.out)
                out.mkdir(parents=True, exist_ok=True)
                (out / f"{result.program.seed}.py").write_text(render(result.program))
        groups = _by_symptom([r for r in results if r.failed and r.program is not None])
        if groups:
            print(f"{len(groups)} distinct symptoms:", flush=True)
        list(pool.map(lambda group: _keep(group, options), groups.items()))
    summary = Summary(results)
    invalid = summary.count("invalid")
    if invalid:
        print(f"{invalid} invalid programs (eager itself failed: a generator bug)")
    print(summary.line(), flush=True)
    return 1 if any(r.failed or r.kind == "invalid" for r in results) else 0


def campaign(options: Options, pool, skip=()):
    """The results of programs ``seed .. seed + count - 1`` but ``skip``, in seed order, as
    they come."""
    seeds = [s for s in range(options.seed, options.seed + options.count) if s not in skip]
    return pool.map(lambda s: run(_program(options, s), options.timeout), seeds)


def _recorded(options: Options) -> dict:
    """seed -> recorded verdict of this campaign's programs already in ``--record`` (drawn with
    the same steps and features): a long campaign can stop and go on (``--resume``)."""
    path = Path(options.record)
    if not path.exists():
        return {}
    seeds = range(options.seed, options.seed + options.count)
    drawn = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if entry["seed"] in seeds and entry["steps"] == options.steps:
            drawn[entry["seed"]] = entry
    return {seed: entry for seed, entry in drawn.items()
            if entry["features"] == _program(options, seed).features}


def _program(options: Options, seed: int):
    return generate(seed, options.steps, options.only, options.disabled, options.command(seed))


def record(result: Result) -> dict:
    program = result.program
    return {"seed": program.seed, "steps": program.steps, "features": program.features,
            "base": dataclasses.asdict(program.base), **result.verdict}


def failure_line(result: Result, options: Options) -> str:
    v = result.verdict
    step = f" step {v['step']}" if v.get("step") is not None else ""
    reason = f" | explain: {v['reason']}" if v.get("reason") else ""
    return (f"seed {result.program.seed}: {v['kind']}{step}: {v['detail'][:300]}{reason} "
            f"| features: {','.join(result.program.features)} "
            f"| repro: {options.command(result.program.seed)}")


def symptom(result: Result) -> tuple:
    """Failures with equal symptoms are probably one bug: the kind, the crash's exception type
    (or the hang's phase), and the category of Terra's first fallback or error."""
    v = result.verdict
    head = v["detail"].split(":")[0] if result.kind != "mismatch" else ""
    category = re.sub(r" at .*", "", v.get("reason", ""))
    return result.kind, head, category


def _by_symptom(failures: list) -> dict:
    groups: dict = {}
    for result in failures:
        groups.setdefault(symptom(result), []).append(result)
    return groups


def _keep(group, options: Options) -> None:
    """Report one symptom and minimize its first (smallest) program."""
    key, results = group
    out = Path(options.out)
    first = min(results, key=lambda r: (len(r.program.snippets), r.program.seed))
    line = f"  {' / '.join(k for k in key if k)}: seeds {[r.program.seed for r in results]}"
    if options.min_trials > 0:
        small = minimize(first, lambda p: run(p, options.timeout), options.min_trials)
        if small is None:
            line += f"; seed {first.program.seed} did not fail the same way again"
        else:
            path = out / f"{first.program.seed}.min.py"
            path.write_text(render(small.program))
            line += (f"; minimized seed {first.program.seed} to {small.program.features} "
                     f"({small.program.steps} steps): {path}")
    print(line, flush=True)
