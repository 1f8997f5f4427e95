"""What `pagedllm tune` reads and writes: the SLO string, the measured points, the choice of
the best one, and its outputs (the `--config` YAML, the markdown report, the frontier PNG).

SLO grammar: comma-separated terms `METRIC_STAT<=LIMIT`, METRIC one of ttft, tpot, itl,
e2el (`bench serve`'s, `benchmarks/metrics.py`), STAT `mean`, `median` or `pNN` (p50, p99,
p99.9), LIMIT a number with `ms` (default) or `s`; `<` means the same as `<=`. Example:
`ttft_p99<=500ms,tpot_p99<=50ms`.

A point (one configuration at one request rate) meets the SLO when every request succeeded
and every term's statistic is within its limit. Its goodput is vLLM's: requests that meet
each TTFT / TPOT / E2EL limit on their own, per second. The best point is the one meeting the
SLO with the highest goodput (ties: the lower request rate).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedllm.benchmarks.metrics import GOODPUT_METRICS, PERCENTILE_METRICS, percentile_label

_TERM = re.compile(r"^\s*([a-z0-9]+)_([a-z0-9.]+)\s*(<=|<)\s*([0-9.eE+-]+)\s*([a-z]*)\s*$")
_UNITS_MS = {"": 1.0, "ms": 1.0, "s": 1000.0}
KNOBS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "long_prefill_token_threshold",
)


@dataclass(frozen=True)
class SLOTerm:
    metric: str  # ttft | tpot | itl | e2el
    stat: str  # mean | median | p<percentile>
    limit_ms: float

    @property
    def key(self) -> str:
        """The statistic's name in a point's `stats` (and in bench serve's JSON)."""
        return f"{self.stat}_{self.metric}_ms"

    @property
    def percentile(self) -> float | None:
        return float(self.stat[1:]) if self.stat.startswith("p") else None

    def __str__(self) -> str:
        return f"{self.metric}_{self.stat}<={self.limit_ms:g}ms"


def parse_slo(text: str) -> list[SLOTerm]:
    """`"ttft_p99<=500ms,tpot_p99<=50ms"` -> terms; a malformed term is a ValueError
    naming it."""
    terms = []
    for raw in text.split(","):
        if not raw.strip():
            continue
        m = _TERM.match(raw.lower())
        if m is None:
            raise ValueError(
                f"--slo term {raw.strip()!r} is not METRIC_STAT<=LIMIT (e.g. ttft_p99<=500ms)"
            )
        metric, stat, _, value, unit = m.groups()
        if metric not in PERCENTILE_METRICS:
            raise ValueError(
                f"--slo term {raw.strip()!r}: unknown metric {metric!r}; choose from "
                f"{list(PERCENTILE_METRICS)}"
            )
        if stat not in ("mean", "median") and not re.fullmatch(r"p\d+(\.\d+)?", stat):
            raise ValueError(
                f"--slo term {raw.strip()!r}: unknown statistic {stat!r}; use mean, median "
                "or pNN (p50, p99, p99.9)"
            )
        if stat.startswith("p") and not 0 < float(stat[1:]) <= 100:
            raise ValueError(f"--slo term {raw.strip()!r}: the percentile is outside (0, 100]")
        if unit not in _UNITS_MS:
            raise ValueError(f"--slo term {raw.strip()!r}: unknown unit {unit!r}; use ms or s")
        try:
            limit = float(value) * _UNITS_MS[unit]
        except ValueError:
            raise ValueError(f"--slo term {raw.strip()!r}: {value!r} is not a number") from None
        if not limit > 0:
            raise ValueError(f"--slo term {raw.strip()!r}: the limit must be positive")
        if stat.startswith("p"):  # canonical label: p99.0 -> p99
            stat = "p" + percentile_label(float(stat[1:]))
        terms.append(SLOTerm(metric, stat, limit))
    if not terms:
        raise ValueError("--slo is empty; e.g. --slo 'ttft_p99<=500ms,tpot_p99<=50ms'")
    return terms


def goodput_limits(terms: list[SLOTerm]) -> dict[str, float]:
    """Per-request limits for vLLM's goodput: the tightest limit of each TTFT / TPOT / E2EL."""
    limits: dict[str, float] = {}
    for t in terms:
        if t.metric in GOODPUT_METRICS:
            limits[t.metric] = min(limits.get(t.metric, t.limit_ms), t.limit_ms)
    return limits


def config_label(config: dict[str, Any]) -> str:
    """`seqs=32 tokens=2048 chunked=on lpt=0`: a configuration in one short line."""
    chunked = "on" if config["enable_chunked_prefill"] else "off"
    return (
        f"seqs={config['max_num_seqs']} tokens={config['max_num_batched_tokens']} "
        f"chunked={chunked} lpt={config['long_prefill_token_threshold']}"
    )


@dataclass
class Point:
    """One configuration measured at one request rate."""

    config: dict[str, Any]
    request_rate: float
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    goodput: float
    output_throughput: float
    stats: dict[str, float] = field(default_factory=dict)  # SLOTerm.key -> ms

    def violations(self, terms: list[SLOTerm]) -> list[str]:
        """The terms this point misses (and failed requests), as text; [] when it meets all."""
        out = [f"{self.failed} failed request(s)"] if self.failed else []
        out += [
            f"{t.metric}_{t.stat}={self.stats[t.key]:.1f}ms > {t.limit_ms:g}ms"
            for t in terms
            if self.stats[t.key] > t.limit_ms
        ]
        return out

    def meets(self, terms: list[SLOTerm]) -> bool:
        return not self.violations(terms)


def best_point(points: list[Point], terms: list[SLOTerm]) -> Point | None:
    """The point meeting the SLO with the highest goodput (ties: lower rate); None if none."""
    meeting = [p for p in points if p.meets(terms)]
    if not meeting:
        return None
    return max(meeting, key=lambda p: (p.goodput, -p.request_rate))


def config_yaml(model: str, config: dict[str, Any], serve_flags: dict[str, Any]) -> str:
    """A `pagedllm serve --config` file: the model, the fixed serve flags, the chosen knobs."""
    import yaml

    body = {"model": model, **serve_flags, **config}
    header = "# Written by `pagedllm tune`: pagedllm serve --config THIS_FILE\n"
    return header + yaml.safe_dump(body, sort_keys=False)


def flags_to_config(flags: list[str]) -> dict[str, Any]:
    """`["--dtype", "float32", "--no-enable-x", "--y"]` -> `{"dtype": "float32",
    "enable_x": False, "y": True}` (for the YAML; numbers become numbers)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(flags):
        flag = flags[i]
        if not flag.startswith("--"):
            raise ValueError(f"--serve-args: {flag!r} does not follow a --flag")
        name = flag[2:]
        if "=" in name:
            name, value = name.split("=", 1)
            out[name.replace("-", "_")] = _scalar(value)
            i += 1
            continue
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out[name.replace("-", "_")] = _scalar(flags[i + 1])
            i += 2
            continue
        if name.startswith("no-"):
            out[name[3:].replace("-", "_")] = False
        else:
            out[name.replace("-", "_")] = True
        i += 1
    return out


def _scalar(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def plot_frontier(
    points: list[Point], terms: list[SLOTerm], best: Point | None, path: str
) -> dict[str, list[tuple[float, float]]]:
    """Draw every configuration's latency-throughput curve (output tokens/s vs each SLO
    term's statistic, one panel per term) into a PNG; returns what it drew, by
    configuration: its (throughput, first term's ms) points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_config: dict[str, list[Point]] = {}
    for p in points:
        by_config.setdefault(config_label(p.config), []).append(p)
    fig, axes = plt.subplots(1, len(terms), figsize=(6.5 * len(terms), 5), squeeze=False)
    drawn: dict[str, list[tuple[float, float]]] = {}
    for ax, term in zip(axes[0], terms):
        for label, pts in by_config.items():
            pts = sorted(pts, key=lambda p: p.request_rate)
            xs = [p.output_throughput for p in pts]
            ys = [p.stats[term.key] for p in pts]
            (line,) = ax.plot(xs, ys, marker="o", label=label)
            ok = [p.meets(terms) for p in pts]
            ax.scatter(
                [x for x, good in zip(xs, ok) if good],
                [y for y, good in zip(ys, ok) if good],
                s=80,
                facecolors="none",
                edgecolors=line.get_color(),
            )
            if term is terms[0]:
                drawn[label] = list(zip(xs, ys))
        ax.axhline(term.limit_ms, color="red", linestyle="--", label=f"SLO {term}")
        if best is not None:
            ax.scatter(
                [best.output_throughput],
                [best.stats[term.key]],
                marker="*",
                s=400,
                facecolors="none",
                edgecolors="black",
                zorder=5,
                label="best",
            )
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{term.metric.upper()} {term.stat} (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle("pagedllm tune: latency vs throughput (circled: meets the SLO)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def markdown_report(
    command: str,
    terms: list[SLOTerm],
    points: list[Point],
    best: Point | None,
    tried: list[dict[str, Any]],
    untried: list[dict[str, Any]],
    stop_reason: str,
    elapsed_s: float,
    budget_s: float,
) -> str:
    slo = ", ".join(str(t) for t in terms)
    lines = ["# pagedllm tune report", "", f"- command: `{command}`", f"- SLO: `{slo}`"]
    lines.append(f"- time: {elapsed_s:.0f} s of a {budget_s:.0f} s budget ({stop_reason})")
    lines.append(f"- configurations tried: {len(tried)}; not tried: {len(untried)}")
    lines.append("")
    if best is None:
        lines += [
            "## Result: no configuration met the SLO",
            "",
            "No configuration met the SLO at any request rate tried. Loosen the SLO, try "
            "lower request rates (`--request-rates`), or other knob values.",
        ]
    else:
        lines += [
            "## Result: best configuration",
            "",
            f"`{config_label(best.config)}` at {best.request_rate:g} req/s: goodput "
            f"{best.goodput:.2f} req/s, {best.output_throughput:.1f} output tok/s, "
            + ", ".join(f"{t.metric}_{t.stat} {best.stats[t.key]:.1f} ms" for t in terms)
            + ". Written to `best_config.yaml` (`pagedllm serve --config best_config.yaml`).",
        ]
    lines += ["", "![latency-throughput frontier](frontier.png)", "", "## Every point", ""]
    header = ["configuration", "rate req/s", "req/s", "goodput req/s", "output tok/s"]
    header += [f"{t.metric}_{t.stat} ms" for t in terms] + ["meets SLO"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for p in points:
        why = p.violations(terms)
        row = [config_label(p.config), f"{p.request_rate:g}", f"{p.request_throughput:.2f}"]
        row += [f"{p.goodput:.2f}", f"{p.output_throughput:.1f}"]
        row += [f"{p.stats[t.key]:.1f}" for t in terms]
        row.append("yes" if not why else "no: " + "; ".join(why))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Configurations", ""]
    for c in tried:
        n = sum(p.config == c for p in points)
        lines.append(f"- tried: `{config_label(c)}` ({n} point(s))")
    for c in untried:
        lines.append(f"- not tried ({stop_reason}): `{config_label(c)}`")
    return "\n".join(lines) + "\n"


def results_json(
    terms: list[SLOTerm],
    points: list[Point],
    best: Point | None,
    plotted: dict[str, list[tuple[float, float]]],
    stop_reason: str,
) -> str:
    return json.dumps(
        {
            "slo": [asdict(t) for t in terms],
            "points": [asdict(p) for p in points],
            "best": asdict(best) if best is not None else None,
            "plotted": plotted,
            "stop_reason": stop_reason,
        },
        indent=2,
    )
