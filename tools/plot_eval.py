#!/usr/bin/env python3
"""Plot delta-ppl against bytes per token, one point per cache configuration and model, from a
`kvq eval --report` JSON file. Usage: plot_eval.py report.json out.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    data = json.load(open(sys.argv[1]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for m in data["models"]:
        name = m["model"].rstrip("/").split("/")[-1]
        xs = [r["bytes_per_token"] for r in m["rows"]]
        ys = [r["delta_ppl_pct"] for r in m["rows"]]
        ax.scatter(xs, ys, label=name)
        for r, x, y in zip(m["rows"], xs, ys):
            ax.annotate(r["cache"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("cache bytes per token (all layers)")
    ax.set_ylabel("perplexity change vs bf16 (%)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_title("kvq eval: quality against memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
