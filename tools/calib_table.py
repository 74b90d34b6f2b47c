#!/usr/bin/env python3
"""The calibration comparison table (issue: QuantMLA calibration, item 8) from `kvq eval --json`
outputs and the calibrated models' kvq_calibration.json files.

usage: calib_table.py EVAL_DIR CALIB_DIR
EVAL_DIR holds rtn.json (the original model: bf16, cXrY, cXrY@paper), METHOD-CACHE.json (the
calibrated model with --baseline-model = the original) and needle200-CACHE.json or needle-CACHE.json (needle runs, cXrY and cXrY@paper);
CALIB_DIR holds METHOD-CACHE/kvq_calibration.json. Prints markdown.
"""
import json
import os
import sys

METHODS = [("rtn", "RTN"), ("smoothquant", "SmoothQuant-dagger"), ("quarot", "QuaRot-dagger"), ("quantmla", "QuantMLA")]
CACHES = ["c4r4", "c2r4"]


def rows_of(path):
    try:
        data = json.load(open(path))
    except (OSError, ValueError):  # missing, or a run still writing it
        return {}
    out = {}
    for m in data["models"]:
        name = m["model"].rstrip("/").split("/")[-1]
        for r in m["rows"]:
            out[(name, r["cache"])] = (m, r)
    return out


def main():
    ev, cal = sys.argv[1], sys.argv[2]
    rtn = rows_of(os.path.join(ev, "rtn.json"))
    bf = next((m for (n, c), (m, r) in rtn.items()), None)
    if bf:
        print(f"bf16 (original model): ppl {bf['bf16_ppl']:.4f} over {bf['windows']} windows ({bf['predictions']} predictions)\n")
    print("| cache | protection | method | bytes/token | ppl | delta-ppl | KL | top-1 | content obj. (mean over layers) | RoPE obj. (mean) |")
    print("|:--|:--|:--|--:|--:|--:|--:|--:|--:|--:|")
    for c in CACHES:
        for prot in ["", "@paper"]:
            for key, label in METHODS:
                if key == "rtn":
                    hit = rtn.get(("tiny-mla", c + prot))
                    objs = None
                else:
                    hit = rows_of(os.path.join(ev, f"{key}-{c}.json")).get((f"{key}-{c}", c + prot))
                    p = os.path.join(cal, f"{key}-{c}", "kvq_calibration.json")
                    objs = json.load(open(p))["layers"] if os.path.exists(p) else None
                if not hit:
                    print(f"| {c} | {prot or 'none'} | {label} | - | - | - | - | - | - | - |")
                    continue
                m, r = hit
                if objs:
                    co = sum(l["content"]["best"] for l in objs) / len(objs)
                    ro = sum(l["rope"]["best"] for l in objs) / len(objs)
                else:
                    # RTN: the objectives of the plain cache, recorded by every calibration of this cache
                    p = os.path.join(cal, f"quantmla-{c}", "kvq_calibration.json")
                    if os.path.exists(p):
                        L = json.load(open(p))["layers"]
                        co = sum(l["content"]["rtn"] for l in L) / len(L)
                        ro = sum(l["rope"]["rtn"] for l in L) / len(L)
                    else:
                        co = ro = float("nan")
                print(f"| {c} | {prot or 'none'} | {label} | {r['bytes_per_token']:.0f} | {r['ppl']:.4f} | "
                      f"{r['delta_ppl_pct']:+.3f}% | {r['kl']:.5f} | {100 * r['top1']:.2f}% | {co:.5f} | {ro:.5f} |")
    # needle: needle200-CACHE.json (200 samples, both protections) where present, else needle-CACHE.json
    for c in CACHES:
        nd = rows_of(os.path.join(ev, f"needle200-{c}.json")) or rows_of(os.path.join(ev, f"needle-{c}.json"))
        if not nd:
            continue
        m0 = next(iter(nd.values()))[0]
        lens = sorted(int(k) for k in m0["bf16_needle_accuracy"])
        for prot in ["", "@paper"]:
            if not any(cc == c + prot for (_, cc) in nd):
                continue
            print(f"\nNeedle, {c}, protection {'paper' if prot else 'none'}, {m0['needle_samples']} paired samples per "
                  "length (bf16 of the original model: "
                  + ", ".join(f"{m0['bf16_needle_accuracy'][str(n)]:.3f} at {n}" for n in lens) + ")\n")
            print("| method | " + " | ".join(f"acc {n} (diff vs bf16)" for n in lens) + " | mean acc | total diff |")
            print("|:--|" + "--:|" * (len(lens) + 2))
            for key, label in METHODS:
                name = "tiny-mla" if key == "rtn" else f"{key}-{c}"
                hit = nd.get((name, c + prot))
                if not hit:
                    continue
                r = hit[1]
                acc = [r["needle_accuracy"][str(n)] for n in lens]
                dif = [r["needle_disagreements_vs_bf16"][str(n)] for n in lens]
                print(f"| {label} | " + " | ".join(f"{a:.3f} ({d})" for a, d in zip(acc, dif))
                      + f" | {sum(acc) / len(acc):.3f} | {sum(dif)} |")
    # per-layer objectives
    print("\nHeld-out path objectives per layer (RTN -> after the method):\n")
    print("| cache | method | layer | content RTN | content | RoPE RTN | RoPE | alpha (content, RoPE) |")
    print("|:--|:--|--:|--:|--:|--:|--:|:--|")
    for c in CACHES:
        for key, label in METHODS[1:]:
            p = os.path.join(cal, f"{key}-{c}", "kvq_calibration.json")
            if not os.path.exists(p):
                continue
            for l in json.load(open(p))["layers"]:
                a = (l["content"].get("alpha"), l["rope"].get("alpha"))
                al = "-" if a == (None, None) else f"{a[0]}, {a[1]}"
                print(f"| {c} | {label} | {l['layer']} | {l['content']['rtn']:.5f} | {l['content']['best']:.5f} | "
                      f"{l['rope']['rtn']:.5f} | {l['rope']['best']:.5f} | {al} |")


if __name__ == "__main__":
    main()
