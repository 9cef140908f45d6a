"""The PNG beside the table: one panel per section, drawn from the report JSON. matplotlib
(Debian python3-matplotlib) is optional: without it render() returns the reason, once."""
from __future__ import annotations

from pathlib import Path


def render(doc: dict, path: Path) -> str | None:
    """Draw the chart to `path`; None on success, else why it was skipped."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:      # ImportError, or a broken backend
        return f"matplotlib not importable ({e}); apt-get install python3-matplotlib"
    secs = doc.get("sections", {})
    panels = [(name, fn) for name, fn in (("tc_cost", _tc), ("throughput", _ratio),
                                          ("connrate", _ratio), ("reset_storm", _storm),
                                          ("pipeline", _pipeline), ("startup", _rss))
              if name in secs and secs[name].get("data")]
    if not panels:
        return "no section produced data"
    cols = 3 if len(panels) > 2 else len(panels)
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (name, fn) in zip(axes.flat, panels):
        try:
            fn(ax, secs[name]["data"], name)
        except Exception as e:   # one odd section must not cost the others their panels
            ax.text(0.5, 0.5, f"{name}: {e}", ha="center", va="center", wrap=True)
    meta = doc.get("meta", {})
    fig.suptitle(f"nptrace benchmarks ({meta.get('mode', '?')} mode, kernel "
                 f"{meta.get('kernel', '?')}, {meta.get('cpus', '?')} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def _tc(ax, d, _name):
    labels, ours, empty = [], [], []
    for path, r in d.get("paths", {}).items():
        for hook in ("ingress", "egress"):
            labels.append(f"{path}\n{hook}")
            ours.append(r[hook]["nptrace_ns"] or 0)
            empty.append(r[hook]["empty_ns"] or 0)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], empty, 0.4, label="empty program")
    ax.bar([i + 0.2 for i in x], ours, 0.4, label="nptrace")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ns per packet (sk_buff)")
    ax.set_title("tc run time per packet")
    ax.legend()


def _ratio(ax, d, name):
    ratios = d.get("ratios", [])
    ax.plot(range(1, len(ratios) + 1), [r * 100 for r in ratios], "o-")
    ax.set_xticks(range(1, len(ratios) + 1))
    target = d.get("target", 0)
    ax.axhline(target * 100, color="red", linestyle="--", label=f"target {target:.0%}")
    ax.axhline(100, color="grey", linewidth=0.5)
    ax.set_xlabel("pair (with / without, alternated)")
    ax.set_ylabel("% of the rate without nptrace")
    ax.set_title({"throughput": "bulk TCP throughput", "connrate": "NodePort connections/s"}
                 .get(name, name))
    ax.legend()


def _storm(ax, d, _name):
    tools = [t for t, r in d.get("tools", {}).items() if r.get("cpu_per_100k") is not None]
    ax.bar(tools, [d["tools"][t]["cpu_per_100k"] for t in tools])
    for i, t in enumerate(tools):
        r = d["tools"][t]
        ax.text(i, r["cpu_per_100k"], f"missed {r.get('missed', '?')}", ha="center",
                va="bottom", fontsize=8)
    ax.set_ylabel("CPU s per 100k resets")
    ax.set_title(f"reset storm ({d.get('resets', '?')} resets per tool)")


def _pipeline(ax, d, _name):
    items = [("decoder\nevents/s", d.get("decoder_eps"), d.get("decoder_target")),
             ("pipeline\nresets/s", d.get("pipeline_rps"), d.get("pipeline_target"))]
    items = [i for i in items if i[1]]
    ax.bar([i[0] for i in items], [i[1] for i in items], label="measured")
    ax.scatter([i[0] for i in items], [i[2] for i in items], color="red", marker="_", s=900,
               label="target", zorder=3)
    ax.set_yscale("log")
    ax.set_title("user-space throughput (no kernel)")
    ax.legend()


def _rss(ax, d, _name):
    samples = d.get("samples", [])
    ax.plot([s["t"] for s in samples], [s["rss"] / 2**20 for s in samples], "-")
    ax.axhline(160, color="red", linestyle="--", label="160 MiB target")
    ax.set_xlabel("s since ready")
    ax.set_ylabel("RSS MiB")
    ax.set_title(f"nptrace RSS under flow churn ({d.get('rate', '?')} flows/s)")
    ax.set_ylim(bottom=0)
    ax.legend()
