"""Draws a run's curves from its metrics.jsonl into one PNG: reward and accuracy, held-out accuracy and pass@k, KL and
the engine/trainer log-prob gap, entropy, response length, and the time of each phase per step.

    python tools/plot_metrics.py RUN_DIR_OR_METRICS_JSONL [--out curves.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = [
    ("reward", ["reward/mean", "reward/accuracy"]),
    ("held-out", ["val/accuracy", "val/pass@"]),
    # the KL terms (to the reference, between updates, to a teacher), and the engine/trainer log-prob gap of the
    # sampled tokens (every run has it)
    ("KL, rollout gap", ["actor/kl_ref", "actor/approx_kl", "actor/kl_loss", "teacher/reverse_kl",
                         "rollout/logprob_diff"]),
    ("entropy", ["actor/entropy"]),
    ("response length", ["response/length_mean", "response/length_max"]),
    ("seconds per phase", ["timing/"]),
]


def load(path: Path) -> dict[str, tuple[list[int], list[float]]]:
    """series name -> (steps, values); a step logged twice (a resumed run) keeps its last value."""
    records: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if not any(k.startswith("sft/") for k in record):
                records.setdefault(record["step"], {}).update(record)
    series: dict[str, tuple[list[int], list[float]]] = {}
    for step in sorted(records):
        for key, value in records[step].items():
            if key != "step":
                xs, ys = series.setdefault(key, ([], []))
                xs.append(step)
                ys.append(value)
    return series


def plot(series: dict, out: Path, title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    drawn = []
    for ax, (name, prefixes) in zip(axes.flat, PANELS):
        keys = [k for k in sorted(series) if any(k.startswith(p) for p in prefixes) and k != "timing/step_s"]
        for key in keys:
            xs, ys = series[key]
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        drawn += keys
        ax.set_title(name)
        ax.set_xlabel("step")
        if keys:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    return drawn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--out", default=None, help="PNG path (default: <run dir>/curves.png)")
    args = parser.parse_args()
    path = Path(args.run)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        print(f"error: no metrics file at {path}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else path.parent / "curves.png"
    drawn = plot(load(path), out, str(path.parent))
    print(f"wrote {out} ({len(drawn)} series)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
