"""Render a summary: text table (stdout), Markdown, JSON and a speed-up bar chart (PNG)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks.modes import MODES


def revision() -> str:
    """The checkout's short commit, to date a saved run ("?" outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def _num(value, fmt="{:.2f}", none="-"):
    return none if value is None else fmt.format(value)


def _ratio(row, key):
    v = row.get(key)
    if v is None:
        return "-"
    return f"x{v:.2f}"


def _percent(row, key):
    v = row.get(key)
    return "-" if v is None else f"{100 * v:.0f}%"


def _losses(row):
    if row["status"] == "ok":
        if row["mode"] == "eager":
            return "reference"
        if MODES[row["mode"]].floor:
            return "n/a (floor" + _divergence(row.get("floor_stats") or {}) + ")"
        n = row.get("compared_steps")
        return f"match (first {n} step{'s' * (n > 1)})" if n else "match"
    return f"{row['status']}: {row['detail']}"


COLUMNS = [
    ("program", lambda r: r["program"]),
    ("mode", lambda r: r["mode"]),
    ("steps/s", lambda r: _num(r["median_steps_per_s"])),
    ("+-%", lambda r: _num(r["spread_pct"], "{:.0f}")),
    ("x eager", lambda r: _ratio(r, "median_speedup")),
    ("x AutoGraph", lambda r: _ratio(r, "median_vs_autograph")),
    ("% floor", lambda r: _percent(r, "median_vs_floor")),
    ("traces", lambda r: _num(r.get("traces"), "{:g}")),
    ("fallbacks", lambda r: _num(r.get("fallbacks"), "{:g}")),
    ("coexec", lambda r: _num(r.get("coexecuted"), "{:g}")),
    ("warm-up s", lambda r: _num(r.get("warmup_s"), "{:.1f}")),
    ("start-up", lambda r: _num(r.get("startup_steps"), "{:.0f}")),
    ("peak MB", lambda r: _num(r.get("peak_rss_mb"), "{:.0f}")),
    ("losses vs eager", _losses),
]


def text_table(rows, width=60) -> str:
    cells = [[name for name, _ in COLUMNS]]
    cells += [[fn(r) for _, fn in COLUMNS] for r in rows]
    cells = [row[:-1] + [row[-1] if len(row[-1]) <= width else row[-1][:width - 3] + "..."]
             for row in cells]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows) -> str:
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fn(r).replace("|", "\\|") for _, fn in COLUMNS) + " |")
    return "\n".join(lines)


def stats_table(rows) -> str | None:
    """Markdown table of Terra's stats over the timed steps, if any Terra mode ran."""
    terra_rows = [r for r in rows if r.get("terra_timed")]
    if not terra_rows:
        return None
    keys = []
    for r in terra_rows:
        keys += [k for k in r["terra_timed"] if k not in keys]

    def cell(value):
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| program | mode | " + " | ".join(keys) + " |",
             "|---|---|" + "|".join("---" for _ in keys) + "|"]
    for r in terra_rows:
        s = r["terra_timed"]
        lines.append(f"| {r['program']} | {r['mode']} | "
                     + " | ".join(cell(s.get(k, "-")) for k in keys) + " |")
    return "\n".join(lines)


def _divergence(stats) -> str:
    if not stats.get("diverged_steps"):
        return ""
    return (f"; {stats['diverged_steps']:g} of {stats['replayed_steps']:g} steps diverged, "
            f"{stats['real_ops']:g} ops run for real")


def floor_table(rows) -> str | None:
    """Markdown table, one row per program that has a floor: ms per step of the floor and of
    every other mode, with the share of the floor's speed each reaches."""
    floors = [r for r in rows if MODES[r["mode"]].floor and r.get("median_steps_per_s")]
    if not floors:
        return None
    others = [m for m in dict.fromkeys(r["mode"] for r in rows) if not MODES[m].floor]
    by_key = {(r["program"], r["mode"]): r for r in rows}

    def ms(row):
        sps = row and row.get("median_steps_per_s")
        return f"{1000 / sps:.2f}" if sps else "-"

    lines = ["| program | floor ms | " + " | ".join(f"{m} ms (% floor)" for m in others)
             + " | ops/step | diverged steps | ops run for real |",
             "|---|---|" + "---|" * len(others) + "---|---|---|"]
    for f in floors:
        s = f.get("floor_stats") or {}
        cells = [f"{ms(by_key.get((f['program'], m)))} "
                 f"({_percent(by_key.get((f['program'], m)) or {}, 'median_vs_floor')})"
                 for m in others]
        lines.append(f"| {f['program']} | {ms(f)} | " + " | ".join(cells) + " | "
                     + " | ".join(_num(s.get(k), "{:g}") for k in
                                  ("ops_per_step", "diverged_steps", "real_ops")) + " |")
    return "\n".join(lines)


def markdown(rows, meta) -> str:
    counts = ", ".join(f"{p} {meta['warmup'][p]}/{meta['steps'][p]}" for p in meta["programs"])
    out = [
        "# Benchmark results", "",
        f"`{meta['command']}`", "",
        f"{meta['date']} · {meta['machine']} · TensorFlow {meta['tensorflow']} · "
        f"Keras {meta['keras']} · Python {meta['python']}", "",
        f"Config `{meta['config']}`, paired repeats: {meta['repeats']}, warm-up/timed steps per "
        f"program: {counts}. "
        "steps/s is the median over repeats and +-% half its range; ratios are medians of "
        "per-repeat ratios. The losses of every step (warm-up and timed; only the first steps "
        "where the last column says so) are compared with eager's of the same repeat: "
        f"rtol {meta['rtol']:g} (XLA modes {meta.get('xla_rtol', meta['rtol']):g}: fused "
        f"kernels round differently), atol {meta['atol']:g}.", "",
        markdown_table(rows),
    ]
    stats = stats_table(rows)
    if stats:
        out += ["", "## Terra during the timed steps", "",
                "Medians over repeats. Counters are what happened during the timed steps; "
                "times (the runners' breakdown, Fig. 3.11) are in ms per timed step; phase is "
                "the phase at the end.", "", stats]
    floor = floor_table(rows)
    if floor:
        out += ["", "## Floor", "",
                "The floor answers every op of the timed steps from the last warm-up step "
                "(`benchmarks/floor.py`): the Python the program imposes at zero kernel time, "
                "`tape.gradient` and a library optimizer's update answered whole. % floor is "
                "a mode's speed over the floor's, per repeat (median): how much of the "
                "possible speed it reaches. A diverged step took another op path than the "
                "recorded one; its ops from there ran for real, so the floor is then not "
                "one.", "", floor]
    failures = [r for r in rows if r["status"] != "ok"]
    if failures:
        out += ["", "## Failures and mismatches", ""]
        out += [f"- **{r['program']} / {r['mode']}** {r['status']}: {r['detail']}"
                for r in failures]
    return "\n".join(out) + "\n"


def bar_chart(rows, programs, modes, path: Path) -> None:
    """Speed-up over eager per program and mode, like the paper's Fig. 3.10."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    shown = [m for m in modes if m != "eager" and not MODES[m].floor]  # the floor: its table
    if not shown:
        return
    by_key = {(r["program"], r["mode"]): r for r in rows}
    n = len(shown)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(programs) * max(1, n / 2.5)), 4))
    top = max([1.0] + [v for r in rows if r["mode"] in shown for v in r["speedup"] if v])
    for j, mode in enumerate(shown):
        for i, program in enumerate(programs):
            r = by_key.get((program, mode))
            x = i + (j - (n - 1) / 2) * width
            if r is None or r["status"] == "FAIL" or r["median_speedup"] is None:
                ax.text(x, 0.02 * top, "X", ha="center", va="bottom", color=f"C{j}",
                        fontweight="bold")
                continue
            ratios = [v for v in r["speedup"] if v is not None]
            y = r["median_speedup"]
            wrong = r["status"] not in ("ok", "UNCHECKED")
            ax.bar(x, y, width, yerr=[[y - min(ratios)], [max(ratios) - y]], capsize=2,
                   color=f"C{j}", hatch="//" if wrong else None, edgecolor="white" if wrong
                   else None)
            text = f"{y:.2f}" + (" W" if r["status"] == "WRONG" else " ?" if wrong else "")
            ax.text(x, max(ratios) + 0.01 * top, text, ha="center", va="bottom",
                    fontsize="x-small", rotation=90 if n > 2 else 0)
    ax.axhline(1.0, color="black", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(programs)))
    ax.set_xticklabels(programs, rotation=30 if len(programs) > 4 else 0, ha="right"
                       if len(programs) > 4 else "center")
    ax.set_ylabel("training speed-up over eager")
    ax.set_ylim(0, top * 1.2)
    ax.set_title("X = fails, W = losses differ from eager")
    handles = [Patch(color=f"C{j}", label=MODES[m].label) for j, m in enumerate(shown)]
    ax.legend(handles=handles, fontsize="small", ncol=min(n, 3))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(rows, runs, meta, out: Path, programs, modes) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = dict(json=out / "results.json", markdown=out / "results.md",
                 chart=out / "speedup.png")
    paths["json"].write_text(json.dumps(dict(meta=meta, summary=rows, runs=runs), indent=1))
    paths["markdown"].write_text(markdown(rows, meta))
    bar_chart(rows, programs, modes, paths["chart"])
    return paths
