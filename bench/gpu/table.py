#!/usr/bin/env python3
"""Prints the markdown table of a decode-gqa JSON result (kvq bench decode --json)."""
import json
import sys


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main():
    r = json.load(open(sys.argv[1]))
    host = f" ({r['gpu_uuid']})" if r.get("gpu_uuid") else ""
    print(f"GPU: {r['gpu']}{host}; copy bandwidth {r['copy_gbps']:.0f} GB/s; commit {r['commit']}")
    print(f"peers: {json.dumps(r.get('peers'))}")
    print()
    print("| format | batch | context | us | GB/s | % copy | bytes ratio vs bf16 | x bf16 flash | target | x vLLM Triton (preset) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in r["rows"]:
        if row["format"].startswith("peer:"):
            continue
        comp = row.get("compression_vs_bf16")
        target = None if comp is None or row["format"] == "bf16" else 0.8 * comp
        sf = row["speedup_vs_bf16_flash"]
        mark = "" if target is None or sf is None else (" ok" if sf >= target else " MISS")
        # results since the fourteenth session name the kernel; the generic one is marked
        name = row["format"] + (" (generic kernel)" if row.get("kernel") == "generic" and row["format"] != "bf16" else "")
        print(f"| {name} | {row['batch']} | {row['context']} | {row['us']:.1f} | {fmt(row['gbps'], '.0f')} | "
              f"{fmt(None if row['gbps'] is None else 100 * row['gbps'] / r['copy_gbps'], '.0f')} | {fmt(comp, '.2f')} | "
              f"{fmt(sf, '.2f')}{mark} | {fmt(target, '.2f')} | {fmt(row['speedup_vs_vllm_triton'], '.2f')} ({row.get('vllm_pair') or '-'}) |")
    print()
    print("| peer | batch | context | us |")
    print("|---|---|---|---|")
    for row in r["rows"]:
        if row["format"].startswith("peer:"):
            print(f"| {row['format'][5:]} | {row['batch']} | {row['context']} | {fmt(row['us'], '.1f')} |")
    print()
    print("| store kernel | tokens x heads | us | GB/s | % of copy |")
    print("|---|---|---|---|---|")
    for s in r.get("store", []):
        print(f"| {s['format']} | {s['tokens']} x {s['kv_heads']} | {s['us']:.1f} | {s['gbps']:.0f} | {100 * s['fraction_of_copy']:.0f} |")


if __name__ == "__main__":
    main()
