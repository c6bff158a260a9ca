#!/usr/bin/python3
"""Plots of `hmoe bench` JSON documents (schema hmoe-bench/1, docs/bench.md) as PNGs.

  scripts/plot_bench.py scenarios OUT.png A.json [B.json ...]
      Fig. 18 of the paper: P TTFT, D TPOT and total latency per scenario, normalized to 1P / 1D,
      one bar group per scenario and one bar per document (its "label"); absolute values on top.
  scripts/plot_bench.py ttft OUT.png LOAD.json [...]
      TTFT against prompt length, one series per path (chunked, slp, dslp), measured requests.
  scripts/plot_bench.py goodput OUT.png LOAD.json [...]
      Goodput and throughput against the request rate of each load run (one point per document).

Needs Debian's python3-matplotlib (scripts/setup-deps.sh); run it with /usr/bin/python3.
"""
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    with open(path) as f:
        doc = json.load(f)
    if doc.get("schema") != "hmoe-bench/1":
        sys.exit(f"{path}: not an hmoe-bench/1 document")
    return doc


def label(doc, path):
    return doc.get("label") or path


def fmt(x, unit):
    if x is None:
        return ""
    return f"{x * 1e3:.0f} ms" if unit == "ms" else f"{x:.1f} s"


def scenarios(out, paths):
    docs = [load(p) for p in paths]
    for p, d in zip(paths, docs):
        if d.get("mode") != "scenarios":
            sys.exit(f"{p}: not a --scenario run")
    names = [r["name"] for r in docs[0]["scenarios"]["results"]]
    panels = [("P TTFT / 1P", "norm_p_ttft", "mean_p_ttft_s", "s"),
              ("D TPOT / 1D", "norm_d_tpot", "mean_d_tpot_s", "ms"),
              ("total latency / 1P", "norm_total", "mean_total_s", "s")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(docs)
    for ax, (title, norm, absolute, unit) in zip(axes, panels):
        for k, (p, d) in enumerate(zip(paths, docs)):
            by_name = {r["name"]: r for r in d["scenarios"]["results"]}
            xs, ys, texts = [], [], []
            for i, n in enumerate(names):
                r = by_name.get(n)
                if r is None or r[norm] is None:
                    continue
                xs.append(i + (k - (len(docs) - 1) / 2) * width)
                ys.append(r[norm])
                texts.append(fmt(r[absolute], unit))
            bars = ax.bar(xs, ys, width, label=label(d, p))
            for b, t in zip(bars, texts):
                ax.text(b.get_x() + b.get_width() / 2, b.get_height(), t, ha="center",
                        va="bottom", fontsize=7, rotation=90)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names)
        ax.set_title(title)
        ax.axhline(1.0, color="gray", linewidth=0.5)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def ttft(out, paths):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    for p in paths:
        for r in load(p)["requests"]:
            if r["warmup"] or r["status"] != "OK" or r["ttft_s"] is None:
                continue
            series.setdefault(r["path"] or "?", []).append((r["prompt_tokens"], r["ttft_s"]))
    for path, pts in sorted(series.items()):
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=path, markersize=4)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s, client)")
    ax.set_title("TTFT against prompt length per path")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def goodput(out, paths):
    pts = []
    for p in paths:
        d = load(p)
        if d.get("mode") != "load":
            sys.exit(f"{p}: not a load run")
        s = d["summary"]
        pts.append((d["config"]["rate"], s["goodput"], s["request_throughput"],
                    s["slo_attainment"]))
    pts.sort()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label="throughput (req/s)")
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "s-", label="goodput (req/s within SLOs)")
    lim = max(p[0] for p in pts) * 1.05
    ax.plot([0, lim], [0, lim], ":", color="gray", label="offered load")
    for r, g, _, a in pts:
        if g is not None and a is not None and not math.isnan(a):
            ax.annotate(f"{a * 100:.0f} %", (r, g), textcoords="offset points", xytext=(4, -12),
                        fontsize=7)
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("req/s")
    ax.set_title("Goodput against request rate (labels: SLO attainment)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    if len(sys.argv) < 4 or sys.argv[1] not in ("scenarios", "ttft", "goodput"):
        sys.exit(__doc__)
    {"scenarios": scenarios, "ttft": ttft, "goodput": goodput}[sys.argv[1]](sys.argv[2],
                                                                           sys.argv[3:])
    print(f"wrote {sys.argv[2]}")


if __name__ == "__main__":
    main()
