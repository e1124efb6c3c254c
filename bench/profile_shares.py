"""Where a run's server CPU goes, from a py-spy raw profile of the server.

    python bench/profile_shares.py /tmp/server.raw [--ms-per-run 3.4]

Every sample (py-spy `--gil`: a moment the server held the GIL) is given to
ONE layer, the innermost frame that belongs to a named layer: pydantic's and
the json module's work goes to "pydantic" / "json" wherever it was called
from; the socket send under hypercorn's write goes to hypercorn (trio's own
frames count only when nothing above them is named). So the layer shares add
up to 100% and answer "whose code was running".

The stage shares are inclusive instead ("this stage and everything it
called"): the door handlers, the SSE stream writer, the provider link's
reader and writer, the record's writer, the lanes. They overlap (a door
handler awaits the lane's work inside it only across a yield, so in practice
little), and they answer "which part of a run's path was it for".

With `--ms-per-run` (server CPU per run measured in the same run), each share
is also given in ms per run. `e2e.py --profile` prints this table.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

#: (layer, pattern on the frame's file path), innermost match wins; first
#: matching pattern of a frame names its layer.
LAYERS: list[tuple[str, str]] = [
    ("pydantic", r"/pydantic(_core)?/"),
    ("json", r"/json/|/orjson"),
    ("record (SQLite)", r"funduq_trio/broker/record\.py|sqlite3"),
    (
        "link (frames, link machine, socket shell)",
        r"funduq_trio/(protocol/(link|frames)\.py|web/provider_socket\.py)",
    ),
    ("wsproto", r"/wsproto/"),
    ("SSE stream", r"funduq_trio/web/sse\.py"),
    (
        "doors (A2A, AG-UI, reads)",
        r"funduq_trio/(web/(a2a_door|a2a_rest|agui_door|asgi_doors|exchange|reads|door_errors|access)"
        r"\.py|protocol/(a2a/|agui\.py|carriable\.py))",
    ),
    ("broker (lanes, run machine, facade, providers)", r"funduq_trio/broker/"),
    ("funduq other", r"funduq_trio/"),
    ("hypercorn + h11", r"/hypercorn/|/h11/"),
    ("quart + werkzeug + blinker", r"/quart(_trio)?/|/werkzeug/|/blinker/"),
    ("trio (scheduler, sockets, channels)", r"/trio/|/trio_websocket/|/outcome/|/sniffio/"),
]

#: (stage, pattern on a frame's "function (file" text), inclusive.
STAGES: list[tuple[str, str]] = [
    ("A2A door handler", r"\(.*funduq_trio/web/a2a_door\.py"),
    ("AG-UI door handler", r"\(.*funduq_trio/web/agui_door\.py"),
    ("SSE stream writes (web/sse.py and below)", r"\(.*funduq_trio/web/sse\.py"),
    ("provider link (ProviderSocket and below)", r"\(.*funduq_trio/web/provider_socket\.py"),
    ("record writer (Record and below)", r"\(.*funduq_trio/broker/record\.py"),
    ("lanes (Lane and below)", r"\(.*funduq_trio/broker/lanes\.py"),
    (
        "door POSTs served on ASGI (web/asgi_doors.py and below)",
        r"\(.*funduq_trio/web/asgi_doors\.py",
    ),
    ("quart request/response machinery", r"\(.*/quart(_trio)?/"),
    ("hypercorn connection tasks", r"\(.*/hypercorn/"),
]

#: Inclusive stages less what a funduq frame inside them accounts for: what
#: serving a request costs before and after funduq's own handler (the lever
#: of serving the doors as plain ASGI).
OUTSIDE_FUNDUQ: list[tuple[str, str]] = [
    ("quart machinery, no funduq frame below", r"\(.*/quart(_trio)?/"),
]
_FUNDUQ_WEB = re.compile(r"\(/funduq_trio/(web|broker|protocol)/")

#: Inclusive stages less the samples with a frame of another below them:
#: `serve_doors` and `serve_streams` are outer ASGI layers of every
#: connection, the provider links' websockets included, so "door POSTs served
#: on ASGI" and "SSE stream writes" above count the provider link too (13% of
#: a raw run's server CPU: bench/README.md, "The callers' side of a run, the
#: run's start"). These are the callers' side alone.
LESS: list[tuple[str, str, str]] = [
    (
        "callers' requests and streams on ASGI (web/asgi_doors.py and below, no provider link)",
        r"\(.*funduq_trio/web/asgi_doors\.py",
        r"\(.*funduq_trio/web/provider_socket\.py",
    ),
    (
        "SSE streams to callers (web/sse.py and below, no provider link)",
        r"\(.*funduq_trio/web/sse\.py",
        r"\(.*funduq_trio/web/provider_socket\.py",
    ),
]

_FRAME = re.compile(r"^(.*) \((.*):(\d+)\)$")


def read_samples(raw: Path) -> list[tuple[list[str], int]]:
    samples = []
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if stack and count_text.isdigit():
            frames = [
                fr
                for fr in stack.split(";")
                if not fr.startswith("process ") and not fr.startswith("thread ")
            ]
            samples.append((frames, int(count_text)))
    return samples


def layer_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        match = _FRAME.match(frame.strip())
        # py-spy gives paths relative to sys.path ("trio/_core/_run.py"): the
        # leading "/" lets one pattern match both forms.
        path = "/" + (match.group(2) if match else frame)
        for layer, pattern in LAYERS:
            if re.search(pattern, path):
                return layer
    return "other (stdlib, interpreter)"


def shares(raw: Path) -> tuple[int, dict[str, int], dict[str, int]]:
    layers: dict[str, int] = {}
    stages: dict[str, int] = {}
    total = 0
    for frames, count in read_samples(raw):
        total += count
        layer = layer_of(frames)
        layers[layer] = layers.get(layer, 0) + count
        text = ";".join(f.replace(" (", " (/") for f in frames)
        for stage, pattern in STAGES:
            if re.search(pattern, text):
                stages[stage] = stages.get(stage, 0) + count
        for stage, pattern in OUTSIDE_FUNDUQ:
            if re.search(pattern, text) and not _FUNDUQ_WEB.search(text):
                stages[stage] = stages.get(stage, 0) + count
        for stage, pattern, less in LESS:
            if re.search(pattern, text) and not re.search(less, text):
                stages[stage] = stages.get(stage, 0) + count
    return total, layers, stages


def format_shares(raw: Path, ms_per_run: float | None = None) -> str:
    total, layers, stages = shares(raw)
    if not total:
        return "  (no samples)"

    def row(name: str, n: int) -> str:
        text = f"    {n / total * 100:5.1f}%"
        if ms_per_run:
            text += f"  {n / total * ms_per_run:5.2f} ms/run"
        return f"{text}  {name}"

    lines = [f"  {total} samples; by layer (innermost named frame, adds up to 100%):"]
    lines += [row(k, v) for k, v in sorted(layers.items(), key=lambda kv: -kv[1])]
    lines.append("  by stage (inclusive, may overlap):")
    lines += [row(k, v) for k, v in sorted(stages.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--ms-per-run", type=float, default=None)
    args = parser.parse_args()
    print(format_shares(args.raw, args.ms_per_run))


if __name__ == "__main__":
    main()
