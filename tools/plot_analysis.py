#!/usr/bin/env python3
"""Plots of `kvq analyze response|jacobian --report` JSON files (docs/analysis.md).
Usage: plot_analysis.py report.json out.png
       plot_analysis.py --summary out.png REPORT_DIR... (layer ratios of several models side by side)

response: per-layer mean response R_C and R_P over cells with min/max envelopes (in the manner
of QuantMLA's Figure 2) and the layer ratios r_l = R_P / R_C (median over cells, IQR band).
jacobian: G_P / G_C per layer and cell, the held-out predictor against its two controls, and
JVP gains against finite-perturbation gains."""
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def name_of(d):
    return d["options"]["model"].rstrip("/").split("/")[-1]


def response(d, out):
    cells = d["cells"]
    nl = d["options"]["layers"]
    xs = list(range(nl))
    pl = d["per_layer"]
    mean = lambda key: [sum(c["layers"][l][key] for c in cells) / len(cells) for l in xs]  # noqa: E731
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, mean("r_c"), "o-", label="content R_C")
    a.fill_between(xs, pl["r_c_min"], pl["r_c_max"], alpha=0.25)
    a.plot(xs, mean("r_p"), "s-", label="RoPE R_P")
    a.fill_between(xs, pl["r_p_min"], pl["r_p_max"], alpha=0.25)
    a.set_yscale("log")
    a.set_xlabel("layer")
    a.set_ylabel("R = NMSE_out / NMSE_cache")
    a.set_title(f"response at cache NMSE {d['options']['cache_nmse']:g} ({d['options']['cache']})")
    a.set_xticks(xs)
    a.legend()
    b.plot(xs, pl["ratio_median"], "o-", color="C2", label="median over cells")
    b.fill_between(xs, pl["ratio_q1"], pl["ratio_q3"], color="C2", alpha=0.25, label="IQR")
    for c in cells:
        b.plot(xs, [L["ratio"] for L in c["layers"]], ".", color="grey", alpha=0.6)
    b.axhline(1.0, color="k", lw=0.6)
    b.set_yscale("log")
    b.set_xlabel("layer")
    b.set_ylabel("r_l = R_P / R_C")
    s = d["summary"]
    b.set_title(f"model-level ratio {s['model_ratio_mean']:.2f} [{s['model_ratio_min']:.2f}, {s['model_ratio_max']:.2f}]")
    b.set_xticks(xs)
    b.legend()
    fig.suptitle(name_of(d))
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def jacobian(d, out):
    cells = d["cells"]
    nl = d["options"]["layers"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    for cell in cells:
        lab = f"{cell['text'].split('/')[-1].replace('validation', 'val').replace('.txt', '')} s{cell['seed']}"
        a.plot(range(nl), [L["rope"]["G"] / L["content"]["G"] for L in cell["layers"]], "o-", alpha=0.7, label=lab)
    a.axhline(1.0, color="k", lw=0.6)
    a.set_yscale("log")
    a.set_xlabel("layer")
    a.set_ylabel("G_P / G_C")
    a.set_xticks(range(nl))
    a.legend(fontsize=7)
    a.set_title("gain ratio (quantizer error direction)")
    pts = d["predictor"]["points"]
    test = [p for p in pts if not p["fit"]]
    lo = min(p["log_g"] for p in pts)
    hi = max(p["log_g"] for p in pts)
    for m, mk in zip(d["predictor"]["models"], "o^s"):
        wt = 1.0 if m["name"] != "cache-error-only" else 0.0
        wa = 1.0 if m["name"] == "trace+allocation" else 0.0
        pred = [wt * p["log_t"] + wa * p["log_a"] + m["gamma"] for p in test]
        b.scatter([p["log_g"] for p in test], pred, marker=mk, alpha=0.7, label=f"{m['name']} (RMSE {m['test_rmse']:.3f})")
    b.plot([lo, hi], [lo, hi], "k-", lw=0.6)
    b.set_xlabel("log(G_P / G_C) measured (test half)")
    b.set_ylabel("predicted")
    b.legend(fontsize=7)
    b.set_title("held-out predictor")
    for path, mk in (("content", "o"), ("rope", "s")):
        xs, ys = [], []
        for cell in cells:
            for L in cell["layers"]:
                p = L[path]
                iv = p["interventions"]
                xs += [p["G"], iv["sign"]["jvp_gain"], iv["permutation"]["jvp_gain"], iv["isotropic"]["jvp_gain"]]
                ys += [p["finite_gain"], iv["sign"]["finite_gain"], iv["permutation"]["finite_gain"], iv["isotropic"]["finite_gain"]]
        c.scatter(xs, ys, marker=mk, alpha=0.6, label=path)
    allv = [v for cell in cells for L in cell["layers"] for p in (L["content"], L["rope"]) for v in (p["G"], p["finite_gain"]) if v > 0]
    if allv:
        c.plot([min(allv) / 2, max(allv) * 2], [min(allv) / 2, max(allv) * 2], "k-", lw=0.6)
    c.set_xscale("log")
    c.set_yscale("log")
    c.set_xlabel("JVP gain")
    c.set_ylabel("finite-perturbation gain")
    sp = d["jvp_vs_finite"]["spearman"]
    c.set_title(f"Spearman {sp:.4f} (n={d['jvp_vs_finite']['n']})" if sp is not None and not math.isnan(sp) else "Spearman n/a")
    c.legend()
    fig.suptitle(name_of(d))
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def summary(out, dirs):
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, d in enumerate(dirs):
        r = json.load(open(d.rstrip("/") + "/response.json"))
        name = d.rstrip("/").split("/")[-1]
        nl = r["options"]["layers"]
        pl = r["per_layer"]
        ls = "-" if r["options"]["cache"] == "c4r4" else "--"
        a.plot(range(nl), pl["ratio_median"], "o" + ls, color=f"C{i % 4}", label=name)
        try:
            j = json.load(open(d.rstrip("/") + "/jacobian.json"))
        except OSError:
            continue
        g = [sum(c["layers"][l]["rope"]["G"] / c["layers"][l]["content"]["G"] for c in j["cells"]) / len(j["cells"]) for l in range(nl)]
        b.plot(range(nl), g, "s" + ls, color=f"C{i % 4}", label=name)
    for ax, t in ((a, "response: median layer ratio r_l = R_P / R_C"), (b, "jacobian: mean G_P / G_C")):
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title(t)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    if sys.argv[1] == "--summary":
        summary(sys.argv[2], sys.argv[3:])
        return 0
    d = json.load(open(sys.argv[1]))
    if d.get("analysis") == "response":
        response(d, sys.argv[2])
    elif d.get("analysis") == "jacobian":
        jacobian(d, sys.argv[2])
    else:
        print("plot_analysis.py: not a kvq analyze report", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
