"""The table of scripts/bench_peers.py: looplib's ratios to each peer (tokens/s, or pairs/s for
the dpo workload, and peak memory) and peers.md / peers.json."""
from __future__ import annotations

import json
from pathlib import Path

from spec import WORKLOADS


def ratios(rows: list[dict]) -> dict:
    """looplib's tokens/s and peak memory as multiples of each peer's, per workload (ok rows only)."""
    out = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        ours = next((r for r in rows if r["workload"] == workload and r["framework"] == "looplib"
                     and r["status"] == "ok"), None)
        if ours is None:
            continue
        out[workload] = {r["framework"]: {"speed_x": rate(ours) / rate(r),
                                          "memory_x": ours["peak_mem_mb"] / r["peak_mem_mb"]}
                         for r in rows if r["workload"] == workload and r["framework"] != "looplib"
                         and r["status"] == "ok"}
        record = WORKLOADS[workload].get("record")
        if record and not rows_tiny(rows):
            out[workload]["record"] = {"name": record[0], "tokens_per_s": record[1],
                                       "speed_x": ours["tokens_per_s"] / record[1]}
    return out


def rate(row: dict) -> float:
    """tokens/s, or pairs/s for the dpo workload's rows."""
    return row.get("pairs_per_s") or row["tokens_per_s"]


def rows_tiny(rows):
    return any(r.get("tiny") for r in rows)


def fmt(x, spec=",.0f"):
    return "-" if x is None else format(x, spec)


def markdown(data: dict) -> str:
    lines = [f"# looplib beside its peers ({data['device']})", "", f"`{data['command']}`, {data['date']}", "",
             "tokens/s: the global batch's input tokens over the median step after the warm-up steps (dpo: pairs/s, the "
             "global batch's pairs); peak MB: the "
             "allocator's peak (torch.cuda.max_memory_allocated; on a CPU the process's peak RSS); looplib x: "
             "looplib's figure over the row's.", ""]
    for workload in dict.fromkeys(r["workload"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["workload"] == workload]
        w = data["ratios"].get(workload, {})
        unit = "pairs/s" if any(r.get("pairs_per_s") for r in rows) else "tokens/s"
        lines += [f"### {rows[0].get('title', workload)}", "",
                  f"| framework | status | {unit} | looplib x | peak MB | looplib memory x | loss at last step | settings |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            x = w.get(r["framework"], {})
            status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
            lines.append(f"| {r['framework']} | {status} | {fmt(r.get('pairs_per_s') or r['tokens_per_s'], ',.1f' if unit == 'pairs/s' else ',.0f')} | {fmt(x.get('speed_x'), '.2f')} | "
                         f"{fmt(r['peak_mem_mb'])} | {fmt(x.get('memory_x'), '.2f')} | {fmt(r['loss'], '.4f')} | "
                         f"{r['settings']} |")
        record = w.get("record")
        if record:
            lines.append(f"| {record['name']} | record | {record['tokens_per_s']:,} | {record['speed_x']:.2f} | - | - | - "
                         "| llm.c's 140 ms per 524,288-token step on 8 H100s |")
        lines.append("")
    return "\n".join(lines)


def write(out: Path, data: dict) -> None:
    data["ratios"] = ratios(data["rows"])
    (out / "peers.json").write_text(json.dumps(data, indent=2))
    (out / "peers.md").write_text(markdown(data))
