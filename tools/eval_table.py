#!/usr/bin/env python3
"""Markdown tables from `kvq eval --report` JSON files (one per model run), for README.md and
bench/results/quality-DATE.md. Usage: eval_table.py report.json [report.json ...]"""
import json
import sys


def main() -> int:
    for path in sys.argv[1:]:
        data = json.load(open(path))
        for m in data["models"]:
            name = m["model"].rstrip("/").split("/")[-1]
            lens = sorted({int(k) for r in m["rows"] for k in r["needle_accuracy"]})
            print(f"**{name}** ({m['architecture']}): {m['windows']} windows of {data['ctx']} tokens "
                  f"({m['predictions']} predictions), bf16 ppl {m['bf16_ppl']:.4f}"
                  + (f", {m['needle_samples']} needle samples per length" if lens else "") + "\n")
            head = ["cache", "bits/value", "bytes/token", "x bf16", "ppl", "delta-ppl", "KL", "top-1"]
            head += [f"needle {n} (diff)" for n in lens]
            print("| " + " | ".join(head) + " |")
            print("|:--|" + "--:|" * (len(head) - 1))
            for r in m["rows"]:
                row = [r["cache"], f"{r['bits_per_value']:.3f}", f"{r['bytes_per_token']:.0f}", f"{r['compression']:.2f}",
                       f"{r['ppl']:.4f}", f"{r['delta_ppl_pct']:+.3f}%", f"{r['kl']:.5f}", f"{100 * r['top1']:.2f}%"]
                for n in lens:
                    a = r["needle_accuracy"].get(str(n))
                    d = r["needle_disagreements_vs_bf16"].get(str(n))
                    row.append("-" if a is None else f"{a:.3f} ({d})")
                print("| " + " | ".join(row) + " |")
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
