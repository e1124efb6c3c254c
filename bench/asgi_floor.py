"""What a `GET /healthz` costs the server without funduq: funduq's own front
(`funduq_trio/front`) with a plain ASGI app, hypercorn with the same app, and
hypercorn with a one-route quart-trio app, each in a child process.

    python bench/asgi_floor.py                      # 5,000 requests from 100 callers each
    python bench/asgi_floor.py --client httpx

The differences are what hypercorn's request handling and quart's request
machinery cost per request over funduq's front (bench/README.md).
The same client, concurrency and request count as e2e.py's healthz baseline,
so its "server CPU per healthz" compares with these. Loopback only; the
children die with the bench.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import harness as h
import trio

BODY = b'{"status":"ok"}'


async def bare_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A plain ASGI app: every HTTP request answers 200 with a small JSON body."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(BODY)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": BODY})


def quart_app() -> Any:
    from quart import jsonify
    from quart_trio import QuartTrio

    app = QuartTrio("asgi_floor")

    @app.get("/healthz")
    async def healthz() -> Any:
        return jsonify({"status": "ok"})

    return app


def serve_main(kind: str) -> int:
    """The child: serve `kind` on 127.0.0.1, port 0, print the URL."""
    app = quart_app() if kind == "quart" else bare_app

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            if kind == "front":
                from funduq_trio.config import Settings
                from funduq_trio.front import serve_asgi
                from funduq_trio.server import front_limits, listen_socket

                settings = Settings(host=h.HOST, port=0)
                listening = listen_socket(settings)
                await nursery.start(serve_asgi, app, listening, front_limits(settings))
                url = f"http://{h.HOST}:{listening.getsockname()[1]}"
            else:
                import hypercorn.trio
                from hypercorn.config import Config

                config = Config()
                config.bind = [f"{h.HOST}:0"]
                config.accesslog = None
                config.keep_alive_timeout = 5.0  # as funduq's own (server.KEEP_ALIVE_SECONDS)
                url = (await nursery.start(hypercorn.trio.serve, app, config))[0]
            print(f"asgi floor serving on {url}", flush=True)

    trio.run(main)
    return 0


KINDS = (
    ("front", "funduq's front + plain ASGI app"),
    ("bare", "hypercorn + plain ASGI app"),
    ("quart", "hypercorn + quart-trio, one route"),
)


class Child:
    def __init__(self, kind: str, workdir: Path) -> None:
        self.log_path = workdir / f"{kind}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(
            [*h.DIE_WITH_PARENT, sys.executable, str(Path(__file__).resolve()), "serve", kind],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=h.child_env(),
            cwd=workdir,
        )
        self.url = h._wait_in_log(self.proc, self.log_path, r"serving on (http://\S+)", kind)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--client", choices=["httpx", "lean"], default="httpx")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternate the two servers this many times"
    )
    args = parser.parse_args()
    figures: dict[str, list[dict[str, Any]]] = {kind: [] for kind, _ in KINDS}
    with h.fresh_dir("funduq-asgi-floor-") as tmp:
        for _ in range(args.rounds):
            for kind, _ in KINDS:
                child = Child(kind, Path(tmp))
                try:
                    figures[kind].append(
                        trio.run(
                            lambda url=child.url, pid=child.proc.pid: h.healthz_baseline(
                                url,
                                args.requests,
                                args.concurrency,
                                pid,
                                lean=args.client == "lean",
                            )
                        )
                    )
                finally:
                    child.stop()
    print(
        f"GET /healthz, {args.requests} requests from {args.concurrency} callers "
        f"({args.client} client), {args.rounds} rounds"
    )
    for kind, label in KINDS:
        cpu = ", ".join(f"{f['server_cpu_ms']:.3f}" for f in figures[kind])
        rate = ", ".join(f"{f['per_s']:.0f}" for f in figures[kind])
        print(f"  {label:36s} server CPU per request {cpu} ms; {rate} req/s")
    for front, bare, quart in zip(figures["front"], figures["bare"], figures["quart"], strict=True):
        print(
            f"  hypercorn over the front: +{bare['server_cpu_ms'] - front['server_cpu_ms']:.3f} ms "
            f"a request ({bare['server_cpu_ms'] / front['server_cpu_ms']:.1f}x); quart over "
            f"hypercorn: +{quart['server_cpu_ms'] - bare['server_cpu_ms']:.3f} ms"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        sys.exit(serve_main(sys.argv[2]))
    main()
