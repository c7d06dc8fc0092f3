"""Ray Serve's autoscaler scaling inference-lab's own model server.

Project 15's `scale-bench` runs this as the peer of its KPA autoscaler:
the same `p15_platform server` binary, one child process per Ray Serve
replica, behind Ray Serve's HTTP proxy, with Ray Serve's autoscaler
deciding how many replicas run. A replica is thin: its constructor
starts the server on a free port and returns once the server's /health
answers 200 (so Ray counts the weights' load as the replica's start),
and each request is passed through to it, streamed back byte for byte.
Ray counts a request as ongoing until its stream ends, so its autoscaling
metric (ongoing requests per replica) is the same concurrency our KPA
scales on.

    .venv-ray/bin/python scripts/ray_serve_peer.py --exe target/release/p15_platform \
        --port 8300 --config default

`--config default` leaves every autoscaling field at Ray Serve's
documented default but the replica bounds and the target (upscale delay
30 s, downscale delay 600 s, look-back 30 s, metrics pushed every 10 s);
`--config ours` maps our windows onto Ray's fields: look-back = the panic
window, upscale delay 0 (KPA's panic mode acts at once), downscale delay
= the stable window, metrics every second (KPA samples each second).

It prints one JSON line when the first replica serves ({"ready": true}),
then every half second the replicas by state ({"t": ..., "states": {...}});
it stops (Serve and Ray shut down, the children with them) on SIGTERM or
when its stdin closes. Set up: bash scripts/setup_ray_venv.sh
"""

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exe", required=True, help="the p15_platform binary")
    ap.add_argument("--port", type=int, required=True, help="Ray Serve's HTTP proxy port")
    ap.add_argument("--config", choices=["default", "ours"], default="default")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weights", default="native")
    ap.add_argument("--name", default="bench", help="the served model name")
    ap.add_argument("--min", type=int, default=1)
    ap.add_argument("--max", type=int, default=4)
    ap.add_argument("--target", type=float, default=2.0, help="ongoing requests per replica")
    ap.add_argument("--panic-window-s", type=float, default=4.0)
    ap.add_argument("--stable-window-s", type=float, default=20.0)
    ap.add_argument("--max-ongoing", type=int, default=64,
                    help="requests a replica takes at once (our router has no such cap)")
    return ap.parse_args()


ARGS = parse()
if ARGS.config == "ours":
    # Read by Serve's controller and replicas, which inherit this environment.
    os.environ["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "1"
    os.environ["RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "1"

import aiohttp  # noqa: E402  (after the environment is set)
import ray  # noqa: E402
from ray import serve  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import Response, StreamingResponse  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent():
    # prctl(PR_SET_PDEATHSIG, SIGKILL): the server dies with its replica.
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)


def spawn_kept(args):
    """Start `args` from a thread that lives as long as the child.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child ends,
    not its process: started from the thread that runs a replica's
    constructor (which Ray may let go once the replica is up), the server
    was killed seconds after serving its first request (a replica whose
    every request then failed to connect). A keeper thread that waits on
    the child ends only with it, or with the replica's process."""
    box = {}
    started = threading.Event()

    def keeper():
        try:
            box["proc"] = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
        except Exception as e:  # reported to the constructor
            box["error"] = e
        started.set()
        if "proc" in box:
            box["proc"].wait()

    threading.Thread(target=keeper, daemon=True).start()
    started.wait()
    if "error" in box:
        raise box["error"]
    return box["proc"]


@serve.deployment
class Replica:
    def __init__(self, exe, model, weights, name):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = spawn_kept(
            [exe, "server", "--model", model, "--weights", weights,
             "--host", "127.0.0.1", "--port", str(self.port),
             "--served-model-name", name, "--shutdown-grace-s", "30"])
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("the server was not healthy within 300 s")
            time.sleep(0.1)
        self.http = None

    async def __call__(self, request: Request):
        if self.http is None:
            self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        body = await request.body()
        resp = await self.http.post(self.url + request.url.path, data=body,
                                    headers={"content-type": "application/json"})
        kind = resp.headers.get("content-type", "application/json")
        if not kind.startswith("text/event-stream"):
            data = await resp.read()
            resp.release()
            return Response(data, status_code=resp.status, media_type=kind)

        async def chunks():
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            finally:
                resp.release()

        return StreamingResponse(chunks(), status_code=resp.status, media_type=kind)

    def __del__(self):
        # Serve drains a replica (waits for its ongoing requests) before this.
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def autoscaling(a):
    cfg = {"min_replicas": a.min, "max_replicas": a.max, "target_ongoing_requests": a.target}
    if a.config == "ours":
        cfg.update(look_back_period_s=a.panic_window_s, upscale_delay_s=0.0,
                   downscale_delay_s=a.stable_window_s, metrics_interval_s=1.0)
    return cfg


def main():
    a = ARGS
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def stdin_closed():
        sys.stdin.read()
        stop.set()

    threading.Thread(target=stdin_closed, daemon=True).start()
    # Logical CPUs only: a replica's server threads are the OS's business,
    # as they are on our node agents (capacity counts servers, not cores).
    ray.init(num_cpus=64, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    app = Replica.options(
        autoscaling_config=autoscaling(a),
        max_ongoing_requests=a.max_ongoing,
        ray_actor_options={"num_cpus": 0},
    ).bind(os.path.abspath(a.exe), a.model, a.weights, a.name)
    serve.run(app, name="bench", route_prefix="/")
    print(json.dumps({"ready": True, "autoscaling": autoscaling(a)}), flush=True)
    t0 = time.time()
    while not stop.is_set():
        try:
            d = serve.status().applications["bench"].deployments["Replica"]
            states = {str(k.value if hasattr(k, "value") else k): v
                      for k, v in d.replica_states.items()}
            print(json.dumps({"t": time.time() - t0, "states": states}), flush=True)
        except Exception as e:  # a status read can fail while Serve is busy
            print(json.dumps({"t": time.time() - t0, "error": str(e)}), flush=True)
        stop.wait(0.5)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
