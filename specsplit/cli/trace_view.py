"""`specsplit trace`: one request's iterations as an SVG timeline plus a text summary.

Reads the JSON-lines span files the services write with `OTEL_TRACES_EXPORTER=file`
(`$SPECSPLIT_TRACE_DIR/<service>.jsonl`). One lane per service, spans as bars (nested spans on
lower rows), and the cross-iteration links — the hop of `spec_token_ids` from iteration N's propose
to iteration N+1's verification — drawn as arcs between consecutive iteration bars.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from html import escape
from pathlib import Path

from specsplit.client.errors import UsageError

LANES = ["client", "coordinator", "verifier", "drafter"]
COLORS = {
    "generate": "#c7d2fe",
    "client generate": "#e0e7ff",
    "iteration": "#fde68a",
    "schedule": "#fca5a5",
    "verify": "#93c5fd",
    "post_step": "#86efac",
    "Verify": "#60a5fa",
    "prepare_inputs": "#a5b4fc",
    "target_forward": "#3b82f6",
    "rejection_sample": "#f472b6",
    "send_hidden_states": "#fdba74",
    "Propose": "#fb923c",
    "mtp_step_0": "#f97316",
    "mtp_steps_1_to_k": "#ea580c",
}
HOPS = [
    "schedule",
    "verify",
    "Verify",
    "prepare_inputs",
    "target_forward",
    "rejection_sample",
    "send_hidden_states",
    "Propose",
    "mtp_step_0",
    "mtp_steps_1_to_k",
    "post_step",
]


def load_spans(paths: list[str]) -> list[dict]:
    """The spans of the files and directories `paths`; UsageError for one that does not read or holds no span."""
    give = "give span files (*.jsonl, `OTEL_TRACES_EXPORTER=file`) or directories holding them"
    spans = []
    for p in paths:
        path = Path(p)
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        for f in files:
            try:
                spans += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            except OSError as err:
                raise UsageError(f"cannot read {f} ({err.strerror}); {give}") from err
            except ValueError as err:  # not JSON lines
                raise UsageError(f"{f} is not a span file ({err}); {give}") from err
    if not spans:
        raise UsageError(f"no spans found in {', '.join(paths)}; {give}")
    return spans


def select_trace(spans: list[dict], request_id: str | None) -> list[dict]:
    roots = [s for s in spans if s["name"] == "generate"]
    if request_id is not None:
        roots = [s for s in roots if s["attributes"].get("specsplit.request_id") == request_id]
        if not roots:
            raise UsageError(f"no request {request_id!r} in the trace files; give --request one of theirs")
    if not roots:
        raise UsageError("no request span ('generate') in the trace files; give the coordinator's span file too")
    root = max(roots, key=lambda s: s["start_ns"])
    return [s for s in spans if s["trace_id"] == root["trace_id"]]


def lane_of(span: dict) -> str:
    name = span["service"].removeprefix("specsplit-")
    return name if name in LANES else "client"


def summary(trace: list[dict]) -> str:
    by_name: dict[str, list[float]] = defaultdict(list)
    for s in trace:
        by_name[s["name"]].append((s["end_ns"] - s["start_ns"]) / 1e6)
    iterations = [s for s in trace if s["name"] == "iteration"]
    drafts = sum(s["attributes"].get("specsplit.drafts_scheduled", 0) for s in iterations)
    accepted = sum(s["attributes"].get("specsplit.accepted", 0) for s in iterations)
    rejected = sum(s["attributes"].get("specsplit.rejected", 0) for s in iterations)
    root = next(s for s in trace if s["name"] == "generate")
    lines = [
        f"request {root['attributes'].get('specsplit.request_id')}: "
        f"{root['attributes'].get('gen_ai.usage.input_tokens')} prompt tokens, "
        f"{root['attributes'].get('gen_ai.usage.output_tokens')} output tokens, "
        f"{(root['end_ns'] - root['start_ns']) / 1e6:.1f} ms",
        f"iterations: {len(iterations)}; drafts {drafts}, accepted {accepted}, rejected {rejected}"
        + (f", acceptance {accepted / drafts:.2f}" if drafts else ""),
        "time per hop (median ms over iterations):",
    ]
    for name in HOPS:
        if by_name.get(name):
            lines.append(f"  {name:<20} {statistics.median(by_name[name]):8.3f}  (n={len(by_name[name])})")
    if by_name.get("verify") and by_name.get("Verify"):
        rpc = statistics.median(by_name["verify"]) - statistics.median(by_name["Verify"])
        lines.append(f"  coordinator→verifier gRPC overhead ≈ {rpc:.3f} ms")
    if by_name.get("send_hidden_states") and by_name.get("Propose"):
        rpc = statistics.median(by_name["send_hidden_states"]) - statistics.median(by_name["Propose"])
        lines.append(f"  verifier→drafter gRPC overhead ≈ {rpc:.3f} ms")
    return "\n".join(lines)


def render_svg(trace: list[dict], width: int = 1400) -> str:
    t0 = min(s["start_ns"] for s in trace)
    t1 = max(s["end_ns"] for s in trace)
    scale = (width - 140) / max(1, t1 - t0)
    by_id = {s["span_id"]: s for s in trace}

    def depth(s: dict) -> int:
        d, p = 0, by_id.get(s["parent_id"])
        while p is not None and lane_of(p) == lane_of(s):
            d, p = d + 1, by_id.get(p["parent_id"])
        return d

    lanes = [lane for lane in LANES if any(lane_of(s) == lane for s in trace)]
    rows = {lane: 1 + max(depth(s) for s in trace if lane_of(s) == lane) for lane in lanes}
    row_h, top = 18, {}
    y = 30
    for lane in lanes:
        top[lane] = y
        y += rows[lane] * row_h + 24
    height = y + 10
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
        'font-size="10">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="8" y="16" font-size="12">specsplit trace {trace[0]["trace_id"][:16]}… '
        f"({(t1 - t0) / 1e6:.1f} ms)</text>",
    ]
    boxes = {}
    for lane in lanes:
        out.append(f'<text x="8" y="{top[lane] + 12}" font-size="11" font-weight="bold">{lane}</text>')
        out.append(f'<line x1="130" x2="{width}" y1="{top[lane] - 4}" y2="{top[lane] - 4}" stroke="#ddd"/>')
    for s in sorted(trace, key=lambda s: s["start_ns"]):
        lane = lane_of(s)
        x = 130 + (s["start_ns"] - t0) * scale
        w = max(1.0, (s["end_ns"] - s["start_ns"]) * scale)
        yy = top[lane] + depth(s) * row_h
        color = "#ef4444" if s["status"] == "ERROR" else COLORS.get(s["name"], "#d1d5db")
        dur = (s["end_ns"] - s["start_ns"]) / 1e6
        out.append(
            f'<rect x="{x:.1f}" y="{yy}" width="{w:.1f}" height="{row_h - 3}" fill="{color}" '
            f'stroke="#555" stroke-width="0.3"><title>{escape(s["name"])} {dur:.3f} ms</title></rect>'
        )
        if w > 7 * len(s["name"]):
            out.append(f'<text x="{x + 2:.1f}" y="{yy + 11}">{escape(s["name"])}</text>')
        boxes[s["span_id"]] = (x, yy, w)
    children: dict[str, list[dict]] = defaultdict(list)
    for s in trace:
        children[s["parent_id"]].append(s)

    def find(span_id: str, name: str) -> dict | None:
        for c in children.get(span_id, []):
            hit = c if c["name"] == name else find(c["span_id"], name)
            if hit is not None:
                return hit
        return None

    out.append(
        '<defs><marker id="arrow" markerWidth="6" markerHeight="6" refX="5" refY="3" orient="auto">'
        '<path d="M0,0 L6,3 L0,6 z" fill="#b45309"/></marker></defs>'
    )
    for s in trace:
        for link in s.get("links", []):
            if link["attributes"].get("specsplit.link") != "previous_iteration":
                continue
            # Drafts proposed in the previous iteration are verified in this one.
            made, used = find(link["span_id"], "Propose"), find(s["span_id"], "Verify")
            if made is None or used is None:
                continue
            x0, y0, w0 = boxes[made["span_id"]]
            x1, y1, _ = boxes[used["span_id"]]
            out.append(
                f'<path d="M {x0 + w0:.1f} {y0} C {x0 + w0 + 20:.1f} {y0 - 30}, {x1 - 20:.1f} {y1 + 30}, '
                f'{x1:.1f} {y1 + row_h - 3}" fill="none" stroke="#b45309" stroke-width="1" '
                'stroke-dasharray="3,2" marker-end="url(#arrow)"><title>spec_token_ids: proposed here, '
                "verified in the next iteration (span link)</title></path>"
            )
    out.append("</svg>")
    return "\n".join(out)


def main(paths: list[str], request_id: str | None, output: str) -> int:
    trace = select_trace(load_spans(paths), request_id)
    Path(output).write_text(render_svg(trace))
    print(summary(trace))
    print(f"picture: {output}")
    return 0
