"""The benchmark charts (PNG, matplotlib), drawn from the JSON the benchmark scripts print.

    cold_start_chart   time to first output per scenario and strategy, one panel per model size
    fingerprint_chart  fingerprint time against model size, log scale, per backend
    ranks_chart        total compile CPU seconds and slowest rank's TTFO, with/without compile_cache

Each function takes the parsed JSON of one benchmark and a path, writes the chart and returns the
path; it raises ``ValueError`` if the JSON holds nothing to draw. ``run_all.py`` calls them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

# (strategy, scenario) as bench_cold_start.py records them -> the label on the x axis. The
# compile_cache scenarios belong to the "regional" strategy only.
COLD_SCENARIOS = (
    ("cold", "cold\n(fresh node)"),
    ("torch warm", "torch warm\n(same node)"),
    ("megacache node", "Mega-Cache\nfresh node"),
    ("cc node", "compile_cache\nfresh node,\nprecompile=True"),
    ("cc plain node", "compile_cache\nfresh node\n(default)"),
)
COLD_STRATEGIES = (
    ("full", "full torch.compile", "#4C72B0"),
    ("accelerate", "accelerate compile_regions", "#DD8452"),
    ("regional", "compile_cache compile_regions", "#55A868"),
)


def _save(fig: Any, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _label_bars(ax: Any, bars: Iterable[Any], fmt: str = "{:.1f}", size: float = 8) -> None:
    for bar in bars:
        height = bar.get_height()
        ax.annotate(fmt.format(height), (bar.get_x() + bar.get_width() / 2, height),
                    xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                    fontsize=size)


def _model_title(data: dict, model: str) -> str:
    arch = data.get("arch", "gpt2")
    layers, _, width = model.partition("x")
    name = {"gpt2": "GPT-2", "llama": "Llama"}.get(arch, arch)
    where = f"{data.get('device', 'cpu')}, {data.get('dtype', 'float32')}"
    return f"{name} {layers} layers × {width} ({where})"


def cold_start_chart(data: dict, path: str, title: str | None = None) -> str:
    """Grouped bars: TTFO per scenario (x) and strategy (colour), one panel per model size."""
    # One forward under no_grad (the training-step rows are in RESULTS.md's table).
    rows = [r for r in data.get("rows", []) if "ttfo_s" in r and r.get("mode", "forward") == "forward"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    if not models:
        raise ValueError("cold start JSON has no rows")
    fig, axes = plt.subplots(1, len(models), figsize=(max(7.5, 6.8 * len(models)), 5.2),
                             squeeze=False)
    width = 0.26
    for ax, model in zip(axes[0], models, strict=True):
        pick = {(r["strategy"], r["scenario"]): r["ttfo_s"] for r in rows if r["model"] == model}
        scenarios = [(s, label) for s, label in COLD_SCENARIOS
                     if any((st, s) in pick for st, _, _ in COLD_STRATEGIES)]
        drawn: set[str] = set()
        top = 0.0
        for x, (scenario, _) in enumerate(scenarios):
            present = [(st, label, colour) for st, label, colour in COLD_STRATEGIES
                       if (st, scenario) in pick]
            for i, (st, label, colour) in enumerate(present):
                offset = (i - (len(present) - 1) / 2) * width
                value = pick[(st, scenario)]
                top = max(top, value)
                bars = ax.bar(x + offset, value, width * 0.95, color=colour,
                              label=label if st not in drawn else None)
                drawn.add(st)
                _label_bars(ax, bars)
        eager = pick.get(("eager", "first call"))
        if eager is not None:
            # In the legend, not on the plot: a label on the line would collide with bars.
            ax.axhline(eager, color="0.35", linestyle="--", linewidth=1,
                       label=f"eager first call ({eager:.2f} s)")
            top = max(top, eager)
        ax.set_xticks(range(len(scenarios)), [label for _, label in scenarios], fontsize=8.5)
        ax.set_xlim(-0.6, len(scenarios) - 0.4)
        ax.set_ylim(0, top * 1.18 if top else 1)
        ax.set_ylabel("time to first output, s")
        ax.set_title(_model_title(data, model), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.legend(fontsize=8, loc="upper right")
    seq = data.get("seq")
    fig.suptitle(title or f"Time to first output of a fresh process (batch 1 × {seq}, no_grad)",
                 fontsize=12)
    machine = data.get("machine")
    if machine:
        fig.text(0.5, -0.01, machine, ha="center", va="top", fontsize=7.5, color="0.4")
    fig.tight_layout()
    return _save(fig, path)


def fingerprint_chart(data: dict, path: str) -> str:
    """Fingerprint time (ms, log) against tensors per model, one line per backend."""
    rows = sorted(data.get("rows", []), key=lambda r: r["tensors"])
    if not rows:
        raise ValueError("fingerprint JSON has no rows")
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    x = [r["tensors"] for r in rows]
    series = (
        ("python_ms", "pure-Python reference", "#C44E52", "o", "-"),
        ("native_ms", "native (C++) backend", "#4C72B0", "s", "-"),
        ("api_ms", "fingerprint_tree() public API (native)", "#55A868", "^", "--"),
    )
    for key, label, colour, marker, style in series:
        if all(key in r for r in rows):
            ax.plot(x, [r[key] for r in rows], marker=marker, linestyle=style, color=colour,
                    label=label)
    ax.set_yscale("log")
    ax.set_xlabel("model size, parameter + buffer tensors")
    ax.set_ylabel("fingerprint_tree time, ms (median, log scale)")
    ax.set_title(f"Fingerprint time against model size (median of {data.get('repeats', '?')})")
    ax.grid(True, which="both", alpha=0.3)
    # Name the models above the top line; a model whose size is close to the previous one's
    # (GPT-2 small next to the 20-layer shape) is named below and right of its point instead.
    previous = None
    for r in rows:
        name = r["model"].replace("llama3-70b-shape/", "70B-shape ")
        top_ms = max(r.get(k, r["native_ms"]) for k, *_ in series)
        if previous is not None and r["tensors"] - previous < 0.08 * x[-1]:
            ax.annotate(name, (r["tensors"], top_ms), xytext=(7, -5), textcoords="offset points",
                        ha="left", va="top", fontsize=7.5, color="0.3")
        else:
            ax.annotate(name, (r["tensors"], top_ms), xytext=(0, 7), textcoords="offset points",
                        ha="center", va="bottom", fontsize=7.5, color="0.3")
            previous = r["tensors"]
    ymin, ymax = ax.get_ylim()
    ax.set_ylim(ymin, ymax * 2.5)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return _save(fig, path)


def _ranks_keys(rows: list[dict]) -> tuple[str, str, str, str]:
    """(label, ranks, cpu, ttfo) keys of bench_ranks.py rows, found by name."""
    keys = list(dict.fromkeys(k for r in rows for k in r))

    def find(*preds: Any) -> str:
        for pred in preds:
            for k in keys:
                if pred(k):
                    return k
        raise ValueError(f"ranks JSON rows have no such key among {keys}")

    label = find(lambda k: k in ("variant", "mode", "strategy", "scenario", "name", "label"),
                 lambda k: k in ("compile_cache", "cache", "cached"))
    ranks = find(lambda k: k in ("ranks", "world_size", "nranks", "num_ranks"))
    cpu = find(lambda k: "cpu" in k and ("total" in k or "sum" in k),
               lambda k: "cpu" in k and "compile" in k, lambda k: "cpu" in k)
    ttfo = find(lambda k: "ttfo" in k and ("slow" in k or "max" in k),
                lambda k: "ttfo" in k)
    return label, ranks, cpu, ttfo


def _ranks_label(value: Any, key: str) -> str:
    if isinstance(value, bool):
        return "with compile_cache" if value else "without compile_cache"
    return str(value)


def ranks_rows(data: dict) -> list[dict]:
    """bench_ranks.py's JSON ({"uncached": {...}, "cached": {...}}) as flat rows; a JSON that
    already has "rows" is returned as it is."""
    if "rows" in data:
        return [r for r in data["rows"] if "error" not in r]
    rows = []
    for variant, cached in (("uncached", False), ("cached", True)):
        part = data.get(variant)
        if isinstance(part, dict) and "total_cpu_s" in part:
            rows.append({"ranks": len(part.get("ranks", [])) or "?", "compile_cache": cached,
                         "total_cpu_s": part["total_cpu_s"],
                         "slowest_ttfo_s": part["slowest_ttfo_s"]})
    return rows


def ranks_chart(data: dict, path: str) -> str:
    """Two panels of grouped bars per rank count: total compile CPU seconds; slowest rank TTFO."""
    rows = ranks_rows(data)
    if not rows:
        raise ValueError("ranks JSON has no rows")
    label_key, ranks_key, cpu_key, ttfo_key = _ranks_keys(rows)
    labels = list(dict.fromkeys(_ranks_label(r[label_key], label_key) for r in rows))
    counts = sorted({r[ranks_key] for r in rows})
    colours = ["#C44E52", "#55A868", "#4C72B0", "#DD8452", "#8172B2"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    width = 0.8 / max(1, len(labels))
    panels = ((cpu_key, "total compile CPU time, s (all ranks)", "Compile work, all ranks"),
              (ttfo_key, "slowest rank's time to first output, s", "Slowest rank TTFO"))
    for ax, (key, ylabel, title) in zip(axes, panels, strict=True):
        top = 0.0
        for i, label in enumerate(labels):
            xs, ys = [], []
            for j, n in enumerate(counts):
                match = [r for r in rows if r[ranks_key] == n
                         and _ranks_label(r[label_key], label_key) == label and key in r]
                if match:
                    xs.append(j + (i - (len(labels) - 1) / 2) * width)
                    ys.append(match[0][key])
            if xs:
                bars = ax.bar(xs, ys, width * 0.95, label=label, color=colours[i % len(colours)])
                _label_bars(ax, bars)
                top = max(top, *ys)
        ax.set_xticks(range(len(counts)), [f"{n} ranks" for n in counts])
        ax.set_ylim(0, top * 1.3 if top else 1)  # room for the legend above the bars
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Many ranks starting at once: with and without compile_cache", fontsize=12)
    if data.get("machine"):
        fig.text(0.5, -0.01, data["machine"], ha="center", va="top", fontsize=7.5, color="0.4")
    fig.tight_layout()
    return _save(fig, path)
