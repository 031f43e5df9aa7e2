"""Render a summary: text table (stdout), Markdown, JSON and a speed-up bar chart (PNG)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.modes import MODES

# Counters shown in their own columns; every other numeric Terra stat goes in the stats table.
COUNTERS = ("iterations", "traces", "fallbacks", "graph_generations", "coexecuted")


def _num(value, fmt="{:.2f}", none="-"):
    return none if value is None else fmt.format(value)


def _ratio(row, key):
    v = row.get(key)
    if v is None:
        return "-"
    return f"x{v:.2f}"


def _losses(row):
    if row["status"] == "ok":
        return "ok"
    return f"{row['status']}: {row['detail']}"


COLUMNS = [
    ("program", lambda r: r["program"]),
    ("mode", lambda r: r["mode"]),
    ("steps/s", lambda r: _num(r["median_steps_per_s"])),
    ("+-%", lambda r: _num(r["spread_pct"], "{:.0f}")),
    ("x eager", lambda r: _ratio(r, "median_speedup")),
    ("x AutoGraph", lambda r: _ratio(r, "median_vs_autograph")),
    ("traces", lambda r: _num(r.get("traces"), "{:g}")),
    ("fallbacks", lambda r: _num(r.get("fallbacks"), "{:g}")),
    ("coexec", lambda r: _num(r.get("coexecuted"), "{:g}")),
    ("warm-up s", lambda r: _num(r.get("warmup_s"), "{:.1f}")),
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
    """Markdown table of Terra's other stats (timing breakdown ...), if any run reported some."""
    keys = []
    for r in rows:
        for k in r.get("terra_stats") or {}:
            if k not in COUNTERS and k not in keys and k != "phase":
                keys.append(k)
    terra_rows = [r for r in rows if r.get("terra_stats")]
    if not terra_rows:
        return None
    keys = ["phase"] + keys
    lines = ["| program | mode | " + " | ".join(keys) + " |",
             "|---|---|" + "|".join("---" for _ in keys) + "|"]
    for r in terra_rows:
        s = r["terra_stats"]
        vals = [(f"{s[k]:.4g}" if isinstance(s.get(k), float) else str(s.get(k, "-")))
                for k in keys]
        lines.append(f"| {r['program']} | {r['mode']} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def markdown(rows, meta) -> str:
    counts = ", ".join(f"{p} {meta['warmup'][p]}/{meta['steps'][p]}" for p in meta["programs"])
    out = [
        "# Benchmark results", "",
        f"`{meta['command']}`", "",
        f"{meta['date']} · {meta['machine']} · TensorFlow {meta['tensorflow']} · "
        f"Keras {meta['keras']} · Python {meta['python']}", "",
        f"Config `{meta['config']}`, {meta['repeats']} paired repeats, warm-up/timed steps per "
        f"program: {counts}. "
        "steps/s is the median over repeats and +-% half its range; ratios are medians of "
        "per-repeat ratios. Losses of every step (warm-up and timed) are compared with eager's "
        f"of the same repeat: rtol {meta['rtol']:g}, atol {meta['atol']:g}.", "",
        markdown_table(rows),
    ]
    stats = stats_table(rows)
    if stats:
        out += ["", "## Terra stats (median over repeats, whole run)", "", stats]
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

    shown = [m for m in modes if m != "eager"]
    if not shown:
        return
    by_key = {(r["program"], r["mode"]): r for r in rows}
    n = len(shown)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(programs) * max(1, n / 2.5)), 4))
    top = 1.0
    for j, mode in enumerate(shown):
        xs, ys, lo, hi, marks = [], [], [], [], []
        for i, program in enumerate(programs):
            r = by_key.get((program, mode))
            x = i + (j - (n - 1) / 2) * width
            if r is None or r["status"] == "FAIL" or r["median_speedup"] is None:
                marks.append((x, "X"))
                continue
            ratios = [v for v in r["speedup"] if v is not None]
            y = r["median_speedup"]
            xs.append(x), ys.append(y), lo.append(y - min(ratios)), hi.append(max(ratios) - y)
            top = max(top, max(ratios))
            if r["status"] != "ok":
                marks.append((x, "W" if r["status"] == "WRONG" else "?"))
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=MODES[mode].label,
               color=f"C{j}")
        for x, text in marks:
            ax.text(x, 0.03, text, ha="center", va="bottom", color=f"C{j}", fontweight="bold")
    ax.axhline(1.0, color="black", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(programs)))
    ax.set_xticklabels(programs, rotation=30 if len(programs) > 4 else 0, ha="right"
                       if len(programs) > 4 else "center")
    ax.set_ylabel("training speed-up over eager")
    ax.set_ylim(0, top * 1.1)
    ax.set_title("X = fails, W = losses differ from eager")
    ax.legend(fontsize="small", ncol=min(n, 3))
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
