"""Shared pieces of the loopback benchmarks (bench/e2e.py, scale.py, one_thread.py).

- `Server`: `python -m funduq_trio serve` as a child process on 127.0.0.1, port 0,
  a fresh data directory (the SQLite record on disk); its URL is read from
  its log, its memory and CPU from /proc/<pid>.
- `ProviderChild`: an SDK provider (`funduq_trio.provider.Provider` with the
  example echo agent, as `funduq-trio provider` builds it) in a child process,
  which also stamps, on CLOCK_MONOTONIC, when each offer frame arrives, when
  its answer leaves and when the run's `finish` leaves. CLOCK_MONOTONIC is one
  clock for every process on a Linux host, so those stamps compare with the
  callers'. Run as `python bench/harness.py provider ...`.
- `open_link`: a provider-link handshake done by hand (trio-websocket), for
  the raw websocket baseline.
- small helpers: percentiles, /proc readers, CPU accounting.

Loopback only: everything binds or dials 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- numbers ---------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (as bench/inprocess.py); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1e3


# -- /proc -----------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, ... of a process, in KiB."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            if name.startswith("Vm"):
                out[name] = int(rest.split()[0])
    return out


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def runqueue_wait(pid: int) -> float:
    """Seconds the threads of a process have spent runnable but waiting for
    a core, so far (the second field of each /proc/<pid>/task/*/schedstat):
    on a shared host, time no code of the process could help."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as fh:
                total += int(fh.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def host_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole host so far, from /proc/stat."""
    with open("/proc/stat") as fh:
        values = [int(v) for v in fh.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return (user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK


@dataclass
class CpuWatch:
    """CPU seconds used by some processes over a window of wall time, and by
    everything else on the host (other work on a shared host shows here)."""

    pids: dict[str, int]
    began_wall: float = 0.0
    began: dict[str, float] = field(default_factory=dict)
    began_host: tuple[float, float] = (0.0, 0.0)

    def start(self) -> None:
        self.began_wall = time.monotonic()
        self.began = {name: self._cpu(pid) for name, pid in self.pids.items()}
        self.began_host = host_cpu()

    def _cpu(self, pid: int) -> float:
        return self_cpu() if pid == os.getpid() else proc_cpu(pid)

    def shares(self) -> dict[str, float]:
        """name -> CPU used / wall time (1.0 = one core busy all the time),
        plus "other processes" and "steal" host-wide."""
        wall = time.monotonic() - self.began_wall
        out = {name: (self._cpu(pid) - self.began[name]) / wall for name, pid in self.pids.items()}
        busy, steal = host_cpu()
        ours = sum(out.values())
        out["other processes"] = max(0.0, (busy - self.began_host[0]) / wall - ours)
        out["steal"] = (steal - self.began_host[1]) / wall
        return out


def format_shares(shares: dict[str, float]) -> str:
    return ", ".join(f"{name} {share * 100:.0f}%" for name, share in shares.items())


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child: it imports the same funduq_trio as this
    process (its directory first on PYTHONPATH), whatever the child's cwd."""
    import funduq_trio

    root = str(Path(funduq_trio.__file__).resolve().parent.parent)
    paths = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **(extra or {})}


#: Prefix for a child's command line: the child asks the kernel for SIGTERM
#: when its parent (this benchmark) dies (Linux PR_SET_PDEATHSIG, kept across
#: exec), then becomes the real command. A benchmark killed from outside
#: leaves no server or provider behind. (Done in the child itself rather
#: than with preexec_fn, which is unsafe once the parent has threads.)
DIE_WITH_PARENT = [
    sys.executable,
    "-c",
    (
        "import ctypes, os, signal, sys; "
        "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    ),
]


# -- the server --------------------------------------------------------------------


def _wait_in_log(
    proc: subprocess.Popen[bytes],
    log_path: Path,
    pattern: str,
    what: str,
    give_up: Callable[[], Any] | None = None,
    timeout: float = 30.0,
) -> str:
    """Wait until a child's log matches `pattern`; return its first group."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        found = re.search(pattern, text)
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited at start:\n{text}")
        time.sleep(0.05)
    if give_up is not None:
        give_up()
    raise SystemExit(f"{what} printed nothing matching {pattern!r} within {timeout}s")


#: Diagnostics `serve-instrumented` applies when set in the server's environment:
#: FUNDUQ_BENCH_GC=off turns the cyclic GC off once the server has started, a
#: number sets its young pass's threshold instead of the server's own;
#: FUNDUQ_BENCH_CHECKPOINT_SECONDS sets the SQLite record's checkpoint period;
#: FUNDUQ_BENCH_IDLE_LINE sets the line of the collector's idle passes (0: none).
DIAGNOSTIC_ENV = ("FUNDUQ_BENCH_GC", "FUNDUQ_BENCH_CHECKPOINT_SECONDS", "FUNDUQ_BENCH_IDLE_LINE")


class Server:
    """`funduq-trio serve` in a child process with its own data directory."""

    def __init__(
        self,
        data_dir: Path,
        *,
        env: dict[str, str] | None = None,
        flags: list[str] | None = None,
        switch_interval: float | None = None,
        sched_stats: bool = False,
        trace: bool = False,
    ) -> None:
        self.data_dir = data_dir
        self.log_path = data_dir / "server.log"
        data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- the child's, closed in stop()
        self.sched_path = data_dir / "scheduler.json" if sched_stats else None
        self.trace_path = data_dir / "trace.json" if trace else None
        diagnostic = any(k in (env or {}) for k in DIAGNOSTIC_ENV)
        if switch_interval is None and not sched_stats and not trace and not diagnostic:
            launch = [sys.executable, "-m", "funduq_trio"]
        else:
            # Diagnostics: the same CLI, run through harness.py's `serve` with
            # CPython's GIL switch interval changed and/or trio's scheduler counted.
            launch = [
                sys.executable,
                str(Path(__file__).resolve()),
                "serve-instrumented",
                str(switch_interval or 0),
                str(self.sched_path or ""),
                str(self.trace_path or ""),
                "--",
            ]
        self.proc = subprocess.Popen(
            [
                *DIE_WITH_PARENT,
                *launch,
                "serve",
                "--host",
                HOST,
                "--port",
                "0",
                "--data-dir",
                str(data_dir),
                *(flags or []),
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=child_env(env),
            cwd=data_dir,  # not the caller's directory: `-m` would import a checkout there
        )
        self.url = _wait_in_log(
            self.proc,
            self.log_path,
            r"funduq-trio \S* ?serving on (http://\S+)",
            "server",
            self.stop,
        )
        self.ws_url = "ws" + self.url[len("http") :] + "/ws/provider"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def status(self) -> dict[str, int]:
        return proc_status(self.pid)

    def scheduler(self) -> dict[str, Any]:
        """With sched_stats: trio's counters in the server so far (rounds of its
        run loop, task steps and those by task, seconds spent outside the I/O wait)."""
        assert self.sched_path is not None
        self.sched_path.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not self.sched_path.exists():
            if time.monotonic() > deadline:
                raise SystemExit("the server did not write its scheduler counters")
            time.sleep(0.01)
        time.sleep(0.01)
        return json.loads(self.sched_path.read_text())

    def trace(self) -> dict[str, Any]:
        """With trace: the server's `ServerTrace` so far."""
        assert self.trace_path is not None
        self.trace_path.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 30
        while not self.trace_path.exists():
            if time.monotonic() > deadline:
                raise SystemExit("the server did not write its trace")
            time.sleep(0.01)
        return json.loads(self.trace_path.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def errors_in_log(self) -> list[str]:
        """Log lines that look like trouble (tracebacks, errors, warnings)."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [
            line
            for line in lines
            if re.search(r"Traceback|ERROR|Error|WARNING|refused|withdraw", line)
        ]


# -- the provider child --------------------------------------------------------------


class ProviderChild:
    """A stamping SDK provider in a child process (see `provider_main`)."""

    def __init__(
        self,
        ws_url: str,
        workdir: Path,
        index: int,
        *,
        deltas: int,
        max_concurrent: int | None = None,
        use_cli: bool = False,
        unbatched: bool = False,
    ) -> None:
        self.key_file = workdir / f"provider-{index}.key"
        self.stamps_path = workdir / f"provider-{index}.stamps.json"
        self.log_path = workdir / f"provider-{index}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- the child's, closed in stop()
        if use_cli:
            argv = [sys.executable, "-m", "funduq_trio", "provider"]
        else:
            argv = [
                sys.executable,
                str(Path(__file__).resolve()),
                "provider",
                "--stamps",
                str(self.stamps_path),
            ]
        argv += ["--url", ws_url, "--key-file", str(self.key_file), "--echo-deltas", str(deltas)]
        if max_concurrent is not None:
            argv += ["--max-concurrent", str(max_concurrent)]
        if unbatched:
            if use_cli:
                raise ValueError("the unbatched (raw) provider is the bench's own, not the CLI")
            argv += ["--unbatched"]
        self.use_cli = use_cli
        #: The provider's GC passes (start, seconds, generation), once stopped.
        self.gc_passes: list[list[float]] = []
        self.proc = subprocess.Popen(
            [*DIE_WITH_PARENT, *argv],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=child_env(),
        )
        self.fingerprint = _wait_in_log(
            self.proc, self.log_path, r"\(fingerprint ([0-9a-f]{16})\)", "provider"
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> dict[str, dict[str, float]]:
        """Stop it; return its stamps {run_id: {offer, answer, finish}} (CLOCK_MONOTONIC)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT if self.use_cli else signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self.use_cli or not self.stamps_path.exists():
            return {}
        stamps: dict[str, Any] = json.loads(self.stamps_path.read_text())
        self.gc_passes = stamps.pop("__gc__", [])
        return stamps


class StampingConnection:
    """Wraps the SDK's websocket connection; stamps offer/answer/finish frames.
    A substring test comes first so frames that are not stamped cost no parse."""

    def __init__(self, inner: Any, stamps: dict[str, dict[str, float]]) -> None:
        self.inner = inner
        self.stamps = stamps
        self.offer_runs: dict[str, str] = {}

    async def receive(self) -> Any:
        text = await self.inner.receive()
        if isinstance(text, str) and '"kind":"offer"' in text:
            now = time.monotonic()
            message = json.loads(text)
            for frame in message["frames"] if message["kind"] == "batch" else [message]:
                if frame["kind"] == "offer":
                    run_id = frame["run"]["runId"]
                    self.offer_runs[frame["id"]] = run_id
                    self.stamps.setdefault(run_id, {})["offer"] = now
        return text

    async def send(self, text: str) -> None:
        await self.inner.send(text)
        if '"kind":"ok"' not in text and '"kind":"finish"' not in text:
            return
        now = time.monotonic()
        frame = json.loads(text)
        # A batch's frames all left with it.
        for item in frame["frames"] if frame["kind"] == "batch" else [frame]:
            if item["kind"] == "ok":
                run_id = self.offer_runs.pop(item.get("id"), None)
                if run_id is not None:
                    self.stamps[run_id]["answer"] = now
            elif item["kind"] == "finish":
                self.stamps.setdefault(item["runId"], {})["finish"] = now

    async def aclose(self, reason: str = "") -> None:
        await self.inner.aclose(reason)


class UnbatchedConnection:
    """Makes the SDK provider behave like a third-party provider that knows
    nothing of the `batch` extension: funduq's hello loses its `extensions`
    (so the SDK writes one frame per websocket message: every event, every
    `ok`, every `finish` its own frame) and the provider's `connect` lists
    none (so funduq sends it one frame per message too). Neither field is
    part of what the handshake signs."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def receive(self) -> Any:
        text = await self.inner.receive()
        if isinstance(text, str) and '"kind":"hello"' in text:
            message = json.loads(text)
            if message.get("kind") == "hello":
                message.pop("extensions", None)
                text = json.dumps(message, separators=(",", ":"))
        return text

    async def send(self, text: str) -> None:
        if '"kind":"connect"' in text:
            message = json.loads(text)
            if message.get("kind") == "connect":
                message.pop("extensions", None)
                text = json.dumps(message, separators=(",", ":"))
        await self.inner.send(text)

    async def aclose(self, reason: str = "") -> None:
        await self.inner.aclose(reason)


def stamping_connector(stamps: dict[str, dict[str, float]], unbatched: bool = False) -> Any:
    from funduq_trio.provider import websocket_connector

    inner_connect = websocket_connector()

    async def connect(nursery: Any, url: str) -> StampingConnection:
        conn = await inner_connect(nursery, url)
        return StampingConnection(UnbatchedConnection(conn) if unbatched else conn, stamps)

    return connect


def provider_main(argv: list[str]) -> int:
    """The provider child: the example echo provider plus stamps, written on SIGTERM."""
    import trio

    from funduq_trio.identity import Identity
    from funduq_trio.provider import Provider, make_echo

    parser = argparse.ArgumentParser(prog="harness.py provider")
    parser.add_argument("--url", required=True)
    parser.add_argument("--key-file", required=True)
    parser.add_argument("--echo-deltas", type=int, default=8)
    parser.add_argument("--max-concurrent", type=int, default=None)
    parser.add_argument("--stamps", required=True)
    parser.add_argument(
        "--unbatched",
        action="store_true",
        help="one frame per websocket message, like a provider without batches",
    )
    args = parser.parse_args(argv)
    identity = Identity.load_or_create(args.key_file)
    stamps: dict[str, dict[str, float]] = {}
    provider = Provider(
        identity,
        args.url,
        max_concurrent_runs=args.max_concurrent,
        connector=stamping_connector(stamps, args.unbatched),
    )
    provider.add_agent(make_echo(args.echo_deltas), name="echo")
    print(
        f"bench provider: key {identity.public_key_hex} (fingerprint {identity.fingerprint})",
        flush=True,
    )

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(provider.run)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    # Its cyclic GC passes (start, seconds, generation; CLOCK_MONOTONIC): a
    # pause here is inside the server's offer round trip too.
    passes: list[tuple[float, float, int]] = []
    began = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.monotonic()
        else:
            passes.append((began[0], time.monotonic() - began[0], info["generation"]))

    import gc

    gc.callbacks.append(on_gc)
    trio.run(main)
    stamps["__gc__"] = passes  # type: ignore[assignment]
    tmp = args.stamps + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(stamps, fh)
    os.replace(tmp, args.stamps)
    return 0


# -- HTTP helpers (trio + httpx) -------------------------------------------------------


async def wait_online(client: Any, url: str, fingerprints: list[str], timeout: float = 30) -> None:
    """Until GET /agents lists every fingerprint's echo agent online."""
    import trio

    with trio.fail_after(timeout):
        while True:
            agents = (await client.get(f"{url}/agents")).json()["agents"]
            online = {a["fingerprint"] for a in agents if a["online"] and a["name"] == "echo"}
            if set(fingerprints) <= online:
                return
            await trio.sleep(0.05)


def agui_body(thread_id: str, text: str, message_id: str) -> dict[str, Any]:
    return {
        "threadId": thread_id,
        "runId": "caller-run",
        "state": None,
        "messages": [{"id": message_id, "role": "user", "content": text}],
        "tools": [],
        "context": [],
        "forwardedProps": None,
    }


def a2a_send_body(
    request_id: int,
    text: str,
    message_id: str,
    context_id: str | None,
    *,
    return_immediately: bool = False,
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "messageId": message_id,
        "role": "ROLE_USER",
        "parts": [{"text": text}],
    }
    if context_id:
        message["contextId"] = context_id
    params: dict[str, Any] = {"message": message}
    if return_immediately:
        params["configuration"] = {"returnImmediately": True}
    return {"jsonrpc": "2.0", "id": request_id, "method": "SendMessage", "params": params}


A2A_HEADERS = {"A2A-Version": "1.0"}


def caller_client(timeout: float = 120) -> Any:
    """One httpx client with one connection, for one caller loop. (One shared
    client with a pool of 100 connections spends most of the load generator's
    CPU in its pool bookkeeping, which grows with the pool.)"""
    import httpx

    return httpx.AsyncClient(
        timeout=timeout, limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)
    )


class Caller:
    """One caller's connection, as the load uses it: JSON posts, SSE posts and
    GETs. `Caller.open(url, lean=...)` gives httpx (`lean=False`) or the h11
    client below (`lean=True`, a fraction of httpx's CPU: on a 2-core host
    the load generator competes with the server for the same cores)."""

    def __init__(self, url: str, lean: bool) -> None:
        self.url, self.lean = url, lean
        self.client: Any = RawHTTP(url) if lean else caller_client()

    async def __aenter__(self) -> Caller:
        if not self.lean:
            await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.lean:
            await self.client.aclose()
        else:
            await self.client.__aexit__(*exc)

    async def get(self, path: str) -> tuple[int, Any]:
        if self.lean:
            return await self.client.json("GET", path)
        response = await self.client.get(self.url + path)
        return response.status_code, response.json()

    async def post_json(self, path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
        if self.lean:
            return await self.client.json("POST", path, body, headers)
        response = await self.client.post(self.url + path, json=body, headers=headers)
        return response.status_code, response.json()

    async def post_sse(
        self, path: str, body: Any, first: Callable[[], None]
    ) -> tuple[int, list[dict[str, Any]]]:
        """POST, then read the SSE stream to its end; `first()` when the first
        event is read."""
        events: list[dict[str, Any]] = []
        if self.lean:
            status, chunks = await self.client.request("POST", path, json.dumps(body).encode())
            async for event in sse_events(chunks):
                if not events:
                    first()
                events.append(event)
            return status, events
        async with self.client.stream("POST", self.url + path, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    if not events:
                        first()
                    events.append(json.loads(line[6:]))
            return r.status_code, events


async def healthz_baseline(
    url: str, requests: int, concurrency: int, server_pid: int | None = None, *, lean: bool = False
) -> dict[str, Any]:
    """`requests` GET /healthz round trips from `concurrency` loops, each on
    its own connection (as the callers of the load, with the same client)."""
    import trio

    latencies: list[float] = []
    failures = 0

    async def loop(count: int) -> None:
        nonlocal failures
        async with Caller(url, lean) as client:
            await client.get("/healthz")  # connect before the clock starts
            connected.append(1)
            if len(connected) == concurrency:
                all_connected.set()
            await ready.wait()
            for _ in range(count):
                began = time.monotonic()
                status, _ = await client.get("/healthz")
                if status != 200:
                    failures += 1
                latencies.append(time.monotonic() - began)

    connected: list[int] = []
    all_connected, ready = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            nursery.start_soon(loop, requests // concurrency + (i < requests % concurrency))
        await all_connected.wait()
        began = time.monotonic()
        cpu_began = proc_cpu(server_pid) if server_pid else 0.0
        ready.set()
    elapsed = time.monotonic() - began
    cpu_ms = (proc_cpu(server_pid) - cpu_began) / requests * 1e3 if server_pid else float("nan")
    return {
        "per_s": requests / elapsed,
        "seconds": elapsed,
        "p50_ms": ms(latencies, 0.5),
        "p99_ms": ms(latencies, 0.99),
        "failures": failures,
        "server_cpu_ms": cpu_ms,
    }


class RawHTTP:
    """A lean HTTP/1.1 client over one trio TCP stream, parsed by h11 (which
    hypercorn itself uses). For the benchmarks that hold thousands of
    connections, where an httpx client per connection is too heavy and one
    shared pool of thousands is slow: this costs the load generator little."""

    def __init__(self, url: str) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.host, self.port = parts.hostname or HOST, parts.port or 80
        self.stream: Any = None
        self.conn: Any = None

    async def connect(self) -> None:
        import h11
        import trio

        self.stream = await trio.open_tcp_stream(self.host, self.port)
        self.conn = h11.Connection(h11.CLIENT)

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()
            self.stream = None

    async def _send(self, event: Any) -> None:
        data = self.conn.send(event)
        if data:
            await self.stream.send_all(data)

    async def _next(self) -> Any:
        import h11

        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(65536))
                continue
            return event

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> Any:
        """Send a request; returns (status, an async iterator of body chunks).
        Read the body to its end before the next request on this connection."""
        import h11

        if self.conn is None:
            await self.connect()
        elif self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        head = [("host", f"{self.host}:{self.port}"), ("content-length", str(len(body)))]
        if body:
            head.append(("content-type", "application/json"))
        head += list((headers or {}).items())
        await self._send(h11.Request(method=method, target=path, headers=head))
        if body:
            await self._send(h11.Data(data=body))
        await self._send(h11.EndOfMessage())
        response = await self._next()
        if not isinstance(response, h11.Response):
            raise RuntimeError(f"expected a response, got {response!r}")  # noqa: TRY004

        async def chunks() -> Any:
            while True:
                event = await self._next()
                if isinstance(event, h11.Data):
                    yield bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return
                else:
                    raise RuntimeError(f"unexpected {event!r} in a response body")  # noqa: TRY004

        return response.status_code, chunks()

    async def json(
        self, method: str, path: str, payload: Any = None, headers: dict[str, str] | None = None
    ) -> Any:
        body = b"" if payload is None else json.dumps(payload).encode()
        status, chunks = await self.request(method, path, body, headers)
        data = b"".join([c async for c in chunks])
        return status, json.loads(data) if data else None


async def sse_events(chunks: Any) -> Any:
    """The JSON `data:` payloads of an SSE body, one by one."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            frame, buffer = buffer.split(b"\n\n", 1)
            for line in frame.split(b"\n"):
                if line.startswith(b"data: "):
                    yield json.loads(line[6:])


async def open_link(nursery: Any, ws_url: str) -> Any:
    """A provider link with the handshake done by hand (a fresh key each time);
    registers nothing. Returns the trio-websocket connection."""
    import trio_websocket

    from funduq_trio.identity import Identity, new_nonce, provider_connect_payload
    from funduq_trio.protocol import frames as f

    identity = Identity.generate()
    ws = await trio_websocket.connect_websocket_url(nursery, ws_url, message_queue_size=1024)
    hello = json.loads(await ws.get_message())
    nonce = new_nonce()
    proof = identity.sign(provider_connect_payload(hello["funduqKey"], hello["nonce"], nonce))
    await ws.send_message(
        f.encode_frame(
            f.Connect(
                public_key=identity.public_key_hex, nonce=nonce, proof=proof, max_concurrent_runs=0
            )
        )
    )
    reply = json.loads(await ws.get_message())
    if reply["kind"] != "connect.ok":
        raise SystemExit(f"baseline link refused: {reply}")
    return ws


async def websocket_baseline(
    ws_url: str, links: int, window: int, messages: int, server_pid: int | None = None
) -> dict[str, Any]:
    """Round trips over provider links: each `{"kind":"ping","id":...}` is a
    frame of a kind the link does not know but that carries an id, which the
    server's link machine answers `err {id}` and stays up (DESIGN §5). That is
    the server's websocket read, frame decode, outbox and write -- the link's
    own round trip with no broker behind it. `links` connections, `window`
    frames in flight on each."""
    import trio

    latencies: list[float] = []
    sent_at: dict[str, float] = {}
    counts = [messages // links + (i < messages % links) for i in range(links)]

    async def one_link(index: int, count: int) -> None:
        got = 0
        async with trio.open_nursery() as nursery:
            ws = await open_link(nursery, ws_url)
            room = trio.Semaphore(window)
            all_back = trio.Event()

            async def reader() -> None:
                nonlocal got
                while got < count:
                    reply = json.loads(await ws.get_message())
                    if reply.get("kind") != "err" or reply.get("id") not in sent_at:
                        continue
                    latencies.append(time.monotonic() - sent_at.pop(reply["id"]))
                    got += 1
                    room.release()
                all_back.set()

            nursery.start_soon(reader)
            for n in range(count):
                await room.acquire()
                frame_id = f"p{index}-{n}"
                sent_at[frame_id] = time.monotonic()
                await ws.send_message(f'{{"kind":"ping","id":"{frame_id}"}}')
            await all_back.wait()
            await ws.aclose()
            nursery.cancel_scope.cancel()

    began = time.monotonic()
    cpu_began = proc_cpu(server_pid) if server_pid else 0.0
    async with trio.open_nursery() as nursery:
        for i in range(links):
            nursery.start_soon(one_link, i, counts[i])
    elapsed = time.monotonic() - began
    cpu_ms = (proc_cpu(server_pid) - cpu_began) / messages * 1e3 if server_pid else float("nan")
    return {
        "per_s": messages / elapsed,
        "seconds": elapsed,
        "p50_ms": ms(latencies, 0.5),
        "p99_ms": ms(latencies, 0.99),
        "server_cpu_ms": cpu_ms,
    }


# -- py-spy ---------------------------------------------------------------------------


class Profiler:
    """`py-spy record --gil -f raw` attached to a pid until stopped."""

    def __init__(self, pid: int, out: Path, rate: int = 200) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [
                "py-spy",
                "record",
                "--pid",
                str(pid),
                "--gil",
                "--format",
                "raw",
                "--rate",
                str(rate),
                "--output",
                str(out),
                "--nonblocking",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err.decode(errors="replace")


def _short(frame: str) -> str:
    # "fn (path/to/module.py:123)" -> "fn (module.py:123)", keeping package dirs short
    match = re.match(r"(.*) \((.*):(\d+)\)$", frame.strip())
    if not match:
        return frame.strip()
    fn, path, line = match.groups()
    parts = Path(path).parts
    tail = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{fn} ({tail}:{line})"


def summarize_profile(raw: Path, top: int = 20) -> str:
    """Top functions by own samples (the leaf of each stack, line ignored) and
    by inclusive samples, from a py-spy raw (folded) file."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [re.sub(r":\d+\)$", ")", _short(fr)) for fr in stack.split(";")]
        frames = [
            fr for fr in frames if not fr.startswith("process ") and not fr.startswith("thread ")
        ]
        if not frames:
            continue
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for fr in set(frames):
            incl[fr] = incl.get(fr, 0) + count
    if not total:
        return "  (no samples)"
    lines = [f"  {total} samples with the GIL held"]
    lines.append("  own time (leaf frames):")
    for fn, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"    {n / total * 100:5.1f}%  {fn}")
    lines.append("  inclusive time (funduq_trio and the libraries it calls):")
    shown = 0
    for fn, n in sorted(incl.items(), key=lambda kv: -kv[1]):
        if re.match(
            r"(run|_bootstrap|_bootstrap_inner|<module>|main|run_server|unrolled_run|"
            r"run_sync_soon|Thread\.run|WorkerThread\._work|handle_io) ",
            fn,
        ):
            continue
        lines.append(f"    {n / total * 100:5.1f}%  {fn}")
        shown += 1
        if shown >= top:
            break
    return "\n".join(lines)


def describe_build() -> str:
    """Which funduq_trio is being measured: its directory, and its git commit
    when it is a checkout (marked dirty when funduq_trio/ has changes), or a
    REVISION file beside it (for an exported snapshot)."""
    import funduq_trio

    root = Path(funduq_trio.__file__).resolve().parent.parent
    revision = root / "REVISION"
    if revision.exists():
        return f"{root} (snapshot of {revision.read_text().strip()})"
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "funduq_trio"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return str(root)
    if not head:
        return str(root)
    return f"{root} (git {head}{', funduq_trio/ has uncommitted changes' if dirty else ''})"


async def offer_round_trips(client: Any, url: str) -> list[tuple[float, int]]:
    """The server's offer round trip histogram from `GET /metrics`: cumulative
    (upper bound in seconds, count) pairs, +Inf last."""
    text = (await client.get(f"{url}/metrics")).text
    found = re.findall(
        r'^funduq_offer_round_trip_seconds_bucket\{le="([^"]+)"\} (\d+)$', text, re.M
    )
    return [(float(le), int(n)) for le, n in found]


def histogram_quantile(
    before: list[tuple[float, int]], after: list[tuple[float, int]], q: float
) -> tuple[float, int]:
    """(the bucket bound the q-quantile falls under, observations) between two
    readings of one cumulative histogram."""
    diff = [(le, n - m) for (le, n), (_, m) in zip(after, before, strict=True)]
    total = diff[-1][1] if diff else 0
    for le, n in diff:
        if total and n >= q * total:
            return le, total
    return float("inf"), total


def bucket_counts(before: list[tuple[float, int]], after: list[tuple[float, int]]) -> str:
    """The cumulative counts between two readings of one histogram, as
    `bound=count` pairs (seconds; `inf` last): what `parse_bucket_counts` reads."""
    return " ".join(f"{le:g}={n - m}" for (le, n), (_, m) in zip(after, before, strict=True))


def parse_bucket_counts(text: str) -> list[tuple[float, int]]:
    return [(float(le), int(n)) for le, n in (pair.split("=") for pair in text.split())]


def fresh_dir(prefix: str) -> AbstractContextManager[str]:
    """A scratch directory, removed afterwards unless FUNDUQ_BENCH_KEEP is set
    (then the server's log and record stay behind for a post-mortem)."""
    if os.environ.get("FUNDUQ_BENCH_KEEP"):
        kept = tempfile.mkdtemp(prefix=prefix)
        print(f"  keeping {kept}", file=sys.stderr)
        return contextlib.nullcontext(kept)
    return tempfile.TemporaryDirectory(prefix=prefix)


def trio_floor_main(argv: list[str]) -> int:
    """Print the RSS (KiB) one waiting run costs at the least in a task-per-run
    design: per run, a thread task holding a nursery and a lane task waiting
    on its own memory channel inside a deadline, in a fresh trio process."""
    import math

    import trio

    count = int(argv[0])

    async def lane(receive: Any) -> None:
        with trio.move_on_at(math.inf):
            await receive.receive()

    async def thread() -> None:
        send, receive = trio.open_memory_channel[Any](math.inf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lane, receive)
        del send

    async def main() -> None:
        await trio.sleep(0.2)
        before = proc_status(os.getpid())["VmRSS"]
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(thread)
            await trio.sleep(1.0)
            after = proc_status(os.getpid())["VmRSS"]
            print(f"{(after - before) / count:.3f}", flush=True)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return 0


def trio_floor(count: int) -> float:
    """KiB per waiting run of the bare trio skeleton (see trio_floor_main)."""
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "trio-floor", str(count)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return float(out.stdout.strip())


class ServerTrace:
    """Diagnostic: what the server did when, on CLOCK_MONOTONIC (the clock
    the bench and the providers stamp with), so a slow offer can be laid
    next to whatever ran meanwhile. Installed from outside by
    `serve-instrumented` (wrapping a few methods and adding a gc callback
    and a trio Instrument); nothing in funduq_trio is changed. Records:

    - ``gc``: each cyclic GC pass on the loop's thread (start, seconds,
      generation, collected, thread CPU seconds, run-queue seconds);
    - ``commits``: each group commit (start, seconds on the loop, writes,
      the oldest write's wait from queued to durable, thread CPU seconds,
      run-queue seconds: runnable with no core);
    - ``waits``: every write's wait from queued to its batch committed;
    - ``reads``: each read in its worker thread (start, seconds, thread CPU
      seconds; the checkpoints are reads too);
    - ``checkpoints``: each WAL checkpoint (start, seconds, log frames,
      frames copied, thread CPU seconds), in its worker thread;
    - ``offers``: offer id -> [run id, handed to the link, its websocket
      message started, written, answer read, the loop thread's CPU seconds
      and run-queue seconds from handing to answer];
    - ``rounds``: scheduler rounds over ``LONG_ROUND`` (start, wall seconds,
      thread CPU seconds, task steps, the longest step's seconds and task,
      run-queue seconds). Wall - CPU - run queue = blocked (I/O, the GIL).
    """

    LONG_ROUND = 0.002

    def __init__(self) -> None:
        self.gc: list[tuple[float, float, int, int, float, float]] = []
        self.commits: list[tuple[float, float, int, float, float, float]] = []
        self.waits: list[float] = []
        self.checkpoints: list[tuple[float, float, int, int, float]] = []
        self.reads: list[tuple[float, float, float]] = []
        self.offers: dict[str, list[Any]] = {}
        self.rounds: list[tuple[float, float, float, int, float, str, float]] = []
        #: Each message funduq wrote to a provider link: (when, how -- "writer",
        #: or "now"/"now, in part" when written first -- offers in it).
        self.link_messages: list[tuple[float, str, int]] = []
        self._encoded: list[str] = []

    def install(self) -> Any:
        """Wrap what is traced; returns the trio Instrument to run with."""
        import gc
        import threading

        import trio

        from funduq_trio.broker import providers, record, store
        from funduq_trio.web import provider_socket

        now = time.monotonic
        trace = self
        gc_began = [0.0]
        # The loop thread's run-queue wait so far (ns): time it was runnable
        # but had no core. Wall - thread CPU - this = blocked (I/O, the GIL).
        schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)

        def waited() -> float:
            return int(os.pread(schedstat, 100, 0).split()[1]) / 1e9

        gc_cpu = [0.0]

        gc_rq = [0.0]

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if threading.current_thread() is not threading.main_thread():
                return  # a worker thread's (rare): the loop's are what matter
            if phase == "start":
                gc_began[0], gc_cpu[0], gc_rq[0] = now(), time.thread_time(), waited()
            else:
                t = gc_began[0]
                trace.gc.append(
                    (
                        t,
                        now() - t,
                        info["generation"],
                        info["collected"],
                        time.thread_time() - gc_cpu[0],
                        waited() - gc_rq[0],
                    )
                )

        gc.callbacks.append(on_gc)

        write_init = store._Write.__init__

        def queued_write(op: Any, *args: Any, **kwargs: Any) -> None:
            write_init(op, *args, **kwargs)
            op.queued = now()

        store._Write.__init__ = queued_write  # type: ignore[method-assign]

        commit = record.SqliteStore._commit

        async def timed_commit(self: Any, ops: list[Any]) -> None:
            t, cpu, rq = now(), time.thread_time(), waited()
            try:
                await commit(self, ops)
            finally:
                end = now()
                waits = [end - getattr(op, "queued", end) for op in ops]
                trace.waits.extend(waits)
                trace.commits.append(
                    (t, end - t, len(ops), max(waits), time.thread_time() - cpu, waited() - rq)
                )

        record.SqliteStore._commit = timed_commit  # type: ignore[method-assign]

        read_sync = record.SqliteStore._read_sync

        def timed_read(self: Any, fn: Any) -> Any:
            t, cpu = now(), time.thread_time()
            try:
                return read_sync(self, fn)
            finally:
                trace.reads.append((t, now() - t, time.thread_time() - cpu))

        record.SqliteStore._read_sync = timed_read  # type: ignore[method-assign]

        checkpoint = record.SqliteStore._checkpoint

        def timed_checkpoint(conn: Any) -> Any:
            t, cpu = now(), time.thread_time()
            out = checkpoint(conn)
            trace.checkpoints.append((t, now() - t, out[1], out[2], time.thread_time() - cpu))
            return out

        record.SqliteStore._checkpoint = staticmethod(timed_checkpoint)  # type: ignore[assignment]

        send = providers.ProviderSession.send

        def traced_send(self: Any, offer: Any, run: Any) -> None:
            # Stamped before: the link may write the offer within `send`.
            seen = [offer.lane.run_id, now(), None, None, None, time.thread_time(), waited()]
            trace.offers[offer.id] = seen
            try:
                send(self, offer, run)
            finally:
                if offer.id not in self.offers:
                    del trace.offers[offer.id]

        providers.ProviderSession.send = traced_send  # type: ignore[method-assign]

        answer = providers.ProviderSession.answer

        def traced_answer(self: Any, offer_id: str, *args: Any, **kwargs: Any) -> None:
            seen = trace.offers.get(offer_id)
            if seen is not None and seen[4] is None:
                seen[4] = now()
                # The loop thread meanwhile: CPU it spent, time it sat in the
                # run queue (the rest it waited on I/O: the provider's side).
                seen[5] = time.thread_time() - seen[5]
                seen[6] = waited() - seen[6]
            answer(self, offer_id, *args, **kwargs)

        providers.ProviderSession.answer = traced_answer  # type: ignore[method-assign]

        encoded = provider_socket._encoded

        def traced_encoded(frame: Any) -> str | None:
            if getattr(frame, "kind", None) == "offer":
                trace._encoded.append(frame.id)
            return encoded(frame)

        provider_socket._encoded = traced_encoded

        ws_send = provider_socket.AsgiWebsocket.send

        async def traced_ws_send(self: Any, data: Any) -> None:
            # The link's writer encodes a message's frames and sends it with
            # no yield in between: what was encoded since is in this message.
            ids, trace._encoded = trace._encoded, []
            t = now()
            await ws_send(self, data)
            end = now()
            trace.link_messages.append((t, "writer", len(ids)))
            for offer_id in ids:
                seen = trace.offers.get(offer_id)
                if seen is not None:
                    seen[2], seen[3] = t, end

        provider_socket.AsgiWebsocket.send = traced_ws_send  # type: ignore[method-assign]

        ws_send_now = getattr(provider_socket.AsgiWebsocket, "send_now", None)

        def traced_ws_send_now(self: Any, text: str) -> str:
            # A frame written first is encoded just before, from the same step.
            ids, trace._encoded = trace._encoded, []
            t = now()
            sent = ws_send_now(self, text)
            if sent == "busy":  # the writer sends it: stamped there
                trace._encoded = ids
                return sent
            end = now()
            trace.link_messages.append((t, "now" if sent == "sent" else "now, in part", len(ids)))
            for offer_id in ids:
                seen = trace.offers.get(offer_id)
                if seen is not None:
                    seen[2], seen[3] = t, end
            return sent

        if ws_send_now is not None:
            provider_socket.AsgiWebsocket.send_now = traced_ws_send_now  # type: ignore[method-assign]

        class LongRounds(trio.abc.Instrument):
            def __init__(self) -> None:
                self._began: float | None = None
                self._cpu = 0.0
                self._rq = 0.0
                self._steps = 0
                self._longest = (0.0, "")
                self._step_began = 0.0

            def after_io_wait(self, timeout: float) -> None:
                self._began, self._cpu, self._rq = now(), time.thread_time(), waited()
                self._steps, self._longest = 0, (0.0, "")

            def before_io_wait(self, timeout: float) -> None:
                if self._began is None:
                    return
                wall = now() - self._began
                if wall > trace.LONG_ROUND:
                    cpu = time.thread_time() - self._cpu
                    rq = waited() - self._rq
                    trace.rounds.append((self._began, wall, cpu, self._steps, *self._longest, rq))
                self._began = None

            def before_task_step(self, task: Any) -> None:
                self._steps += 1
                self._step_began = now()

            def after_task_step(self, task: Any) -> None:
                spent = now() - self._step_began
                if spent > self._longest[0]:
                    self._longest = (spent, task.name)

        return LongRounds()

    def dump(self, path: str) -> None:
        import gc
        from collections import Counter

        # A full pass now (the load's garbage still in it) and one right after
        # (traversal alone), in thread CPU: what a full pass costs this heap.
        passes = []
        for _ in range(2):
            cpu = time.thread_time()
            collected = gc.collect()
            passes.append((time.thread_time() - cpu, collected))
        old = gc.get_objects(2)
        kinds = Counter(type(o).__qualname__ for o in old).most_common(15)
        del old
        heap = {
            "thresholds": gc.get_threshold(),
            "counts": gc.get_count(),
            "frozen": gc.get_freeze_count(),
            "generation2": sum(n for _, n in kinds),
            "generation2_kinds": kinds,
            "generation2_total": len(gc.get_objects(2)),
            "full_passes": passes,
        }
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(
                {
                    "gc": self.gc,
                    "commits": self.commits,
                    "waits": self.waits,
                    "checkpoints": self.checkpoints,
                    "reads": self.reads,
                    "offers": self.offers,
                    "rounds": self.rounds,
                    "link_messages": self.link_messages,
                    "heap": heap,
                },
                fh,
            )
        os.replace(tmp, path)


#: A funduq id inside a task's name (`thread thread_0123...`).
TASK_ID = re.compile(r"[0-9a-f]{16,}")


def serve_instrumented_main(argv: list[str]) -> int:
    """`harness.py serve-instrumented SWITCH SCHED_PATH TRACE_PATH -- <funduq-trio args>`:
    the funduq-trio CLI, unchanged, with sys.setswitchinterval(SWITCH) when
    SWITCH > 0; when SCHED_PATH is given, a trio Instrument counting the
    run loop's rounds and task steps, written to SCHED_PATH on SIGUSR1; when
    TRACE_PATH is given, a `ServerTrace`, written to TRACE_PATH on SIGUSR2.
    It wraps trio.run from outside; nothing in funduq_trio is touched."""
    import functools

    import trio

    switch, sched_path, trace_path, _, *cli_args = argv
    if float(switch) > 0:
        sys.setswitchinterval(float(switch))
    if os.environ.get("FUNDUQ_BENCH_CHECKPOINT_SECONDS"):
        from funduq_trio.broker import record

        record.CHECKPOINT_SECONDS = float(os.environ["FUNDUQ_BENCH_CHECKPOINT_SECONDS"])
    from funduq_trio import collector  # the server's collector, which these two patch

    if os.environ.get("FUNDUQ_BENCH_GC", "on") != "on":
        import gc

        tune = collector.tune
        setting = os.environ["FUNDUQ_BENCH_GC"]

        def tune_then_override() -> None:
            tune()
            if setting == "off":
                gc.disable()
            else:
                gc.set_threshold(int(setting), *gc.get_threshold()[1:])

        collector.tune = tune_then_override
    if "FUNDUQ_BENCH_IDLE_LINE" in os.environ:
        import functools

        import trio

        line = int(os.environ["FUNDUQ_BENCH_IDLE_LINE"])
        collector.pass_when_idle = (  # type: ignore[assignment]
            functools.partial(collector.pass_when_idle, line=line)
            if line > 0
            else trio.sleep_forever
        )
    instruments: list[Any] = []
    if trace_path:
        trace = ServerTrace()
        instruments.append(trace.install())
        signal.signal(signal.SIGUSR2, lambda signum, frame: trace.dump(trace_path))
    if sched_path:

        class Rounds(trio.abc.Instrument):
            def __init__(self) -> None:
                self.rounds = 0
                self.steps = 0
                self.busy = 0.0
                self.longest_round = 0.0
                self.rounds_over_20ms = 0
                self.longest_step = (0.0, "")  # (seconds, task name)
                self._began: float | None = None
                self._step_began = 0.0
                #: Task steps by task name, ids folded ("thread #"): whose
                #: steps a run's rounds are.
                self.by_task: dict[str, int] = {}

            def after_io_wait(self, timeout: float) -> None:
                self.rounds += 1
                self._began = time.perf_counter()

            def before_io_wait(self, timeout: float) -> None:
                if self._began is not None:
                    spent = time.perf_counter() - self._began
                    self.busy += spent
                    self.longest_round = max(self.longest_round, spent)
                    self.rounds_over_20ms += spent > 0.020
                    self._began = None

            def before_task_step(self, task: Any) -> None:
                self.steps += 1
                self._step_began = time.perf_counter()
                name = TASK_ID.sub("#", task.name)
                self.by_task[name] = self.by_task.get(name, 0) + 1

            def after_task_step(self, task: Any) -> None:
                spent = time.perf_counter() - self._step_began
                if spent > self.longest_step[0]:
                    self.longest_step = (spent, task.name)

        rounds = Rounds()

        def write(signum: int, frame: Any) -> None:
            tmp = sched_path + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(
                    {
                        "rounds": rounds.rounds,
                        "steps": rounds.steps,
                        "busy": rounds.busy,
                        "longest_round": rounds.longest_round,
                        "rounds_over_20ms": rounds.rounds_over_20ms,
                        "longest_step": list(rounds.longest_step),
                        "by_task": rounds.by_task,
                        "at": time.monotonic(),
                    },
                    fh,
                )
            os.replace(tmp, sched_path)

        signal.signal(signal.SIGUSR1, write)
        instruments.append(rounds)
    if instruments:
        trio.run = functools.partial(trio.run, instruments=instruments)  # type: ignore[assignment]
    from funduq_trio.cli import main

    return main(cli_args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve-instrumented"]:
        sys.exit(serve_instrumented_main(sys.argv[2:]))
    if sys.argv[1:2] == ["provider"]:
        sys.exit(provider_main(sys.argv[2:]))
    if sys.argv[1:2] == ["trio-floor"]:
        sys.exit(trio_floor_main(sys.argv[2:]))
    print(__doc__)
