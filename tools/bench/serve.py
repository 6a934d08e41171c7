"""reference.serve under load, and its own cost per request: a bounded load test on 127.0.0.1.

    python -m tools.bench.serve [--model GGUF] [--clients 64] [--requests 2000] [--queue 16] \\
        [--overhead 100] [--overhead-only] [--png rss.png] [--json report.json]

Starts the server (--queue: its bound), then:
- overhead: --overhead requests one at a time, each also run in this process on the same oracle
  (the same forwards); the server's cost is the HTTP wall time minus the in-process time, its median
  and quartiles reported (the goal: at most 2 ms at the median), beside a bare GET /health's round
  trip, the machine's load average (on a busy machine every wake-up waits for a core) and the CPU
  time per request of the server's event-loop thread (its own work, which waits for no core);
- load: --clients concurrent clients send --requests requests, every endpoint, a tenth malformed
  (bad JSON, wrong types, unknown ids, sampling). Every 200 must be byte-identical (volatile ids and
  times aside) to the single-client answer of the same request, every malformed one a 4xx, and no 5xx
  but the queue's 503s; the server's RSS is sampled after each request, and must stay within 5 % of
  its value at request 200 from there to the end (--png plots it).
Exit status 1 when a check fails, with the figures printed either way.
"""
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from reference import artifacts
from reference.cli import OneLineParser, UsageError, add_json_out, exit_status, flag, int_in, output_file, write_json
from reference.factory import DEFAULT_MODEL
from tools.common import REPO, import_extra

WELL_FORMED = [  # (path, body): the requests whose answers must not change under load
    ("/completion", {"prompt": "initial value. If it", "n_predict": 4, "n_probs": 3, "temperature": 0}),
    ("/completion", {"prompt": [497, 85, 318], "n_predict": 2, "temperature": 0, "return_tokens": True}),
    ("/v1/completions", {"prompt": [[497, 85, 318, 217], [497, 12]], "echo": True, "logprobs": 1, "max_tokens": 1,
                         "temperature": 0}),
    ("/v1/completions", {"prompt": "The `ast` module", "max_tokens": 3, "logprobs": 2, "prompt_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
                              "top_logprobs": 2}),
    ("/generate", {"input_ids": [497, 101, 244], "return_logprob": True, "logprob_start_len": 0,
                   "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}),
    ("/tokenize", {"content": "An invalid content transfer encoding", "with_pieces": True}),
    ("/detokenize", {"tokens": [497, 83, 78, 318]}),
]
MALFORMED = [
    ("/completion", b'{"prompt": [1, 2'),
    ("/completion", {"prompt": {"x": 1}}),
    ("/v1/completions", {"prompt": [1, 123456789]}),
    ("/v1/completions", {"prompt": [1, 2], "temperature": 0.7}),
    ("/generate", {"input_ids": "abc"}),
    ("/v1/chat/completions", {"messages": 5}),
]
VOLATILE = ("id", "created", "e2e_latency")  # of a reply's top level or its meta_info: differ by request
OVERHEAD_GOAL_S = 2e-3  # the server's own cost per request, at the median
WARMUP = 10  # overhead pairs not counted (the first requests fill caches)
RSS_FROM = 200  # the RSS is compared from this request on (the first ones warm caches and allocators)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid):  # -> a process's resident set size
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def stable(body):  # reply bytes -> the reply without its volatile fields (bytes otherwise as sent)
    value = json.loads(body)
    if isinstance(value, dict):
        for key in VOLATILE:
            value.pop(key, None)
            if isinstance(value.get("meta_info"), dict):
                value["meta_info"].pop(key, None)
    return json.dumps(value)


def payload(body):
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def start(model, queue):  # -> (Popen, URL) once /health answers
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "reference.serve", "-m", model, "--port", str(port), "--queue",
                             str(queue)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"reference.serve did not start: {proc.communicate()[1][-500:]}")


def cpu_seconds(pid, tid=None):  # -> a process's (or one of its threads') user + system CPU time so far
    with open(f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def overhead(url, pid, model, n):  # -> the overhead's figures: costs per request, /health round trips, CPU
    """Each of n requests is run twice, alternately: in this process on the same oracle (the same
    forwards), then over HTTP on one kept-alive connection of the standard library's client (the cheapest
    client here: its own cost is not the server's). The first WARMUP pairs are not counted. Besides the
    wall times, the CPU time of the server's event-loop thread over the n requests (the forwards run on
    its other thread): the server's own work, whatever the machine's other jobs do to wall times."""
    import http.client
    import threading
    import urllib.parse

    from reference.serve.oracle import Ask
    from reference.serve.server import build_parser, load_oracle

    oracle, _ = load_oracle(build_parser().parse_args(["-m", model]))
    ids = [497, 85, 318, 217]
    body = payload({"prompt": ids, "n_predict": 2, "n_probs": 3, "temperature": 0})
    address = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=600)

    def ask(method, path, content=None):  # -> seconds for one exchange
        t0 = time.perf_counter()
        connection.request(method, path, content, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        reply.read()
        if reply.status != 200:
            raise RuntimeError(f"{method} {path}: HTTP {reply.status}")
        return time.perf_counter() - t0
    costs = []
    for i in range(n + WARMUP):
        if i == WARMUP:
            loop_cpu = cpu_seconds(pid, pid)  # the main thread runs the event loop
        t0 = time.perf_counter()
        oracle.complete(ids, Ask(2, 3), threading.Event())
        inproc = time.perf_counter() - t0
        cost = ask("POST", "/completion", body) - inproc
        if i >= WARMUP:
            costs.append(cost)
    loop_cpu = cpu_seconds(pid, pid) - loop_cpu
    health = [ask("GET", "/health") for _ in range(n)]
    connection.close()
    return costs, health, loop_cpu / n


async def load(url, pid, clients, n):  # -> (per request (kind index, status, body), RSS after each)
    import httpx

    plan = [(("bad", i % len(MALFORMED)) if i % 10 == 9 else ("good", i % len(WELL_FORMED))) for i in range(n)]
    results, rss, todo = [None] * n, [], iter(range(n))

    async def client(http):
        for i in todo:
            kind, j = plan[i]
            path, body = (MALFORMED if kind == "bad" else WELL_FORMED)[j]
            reply = await http.post(f"{url}{path}", content=payload(body), timeout=600)
            results[i] = (kind, j, reply.status_code, reply.content)
            rss.append(rss_bytes(pid))
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return results, rss


def check(results, singles, rss):  # -> (figures, failures)
    statuses = [r[2] for r in results]
    failures = []
    for kind, j, status, body in results:
        if kind == "good" and status == 200 and stable(body) != singles[j]:
            failures.append(f"{WELL_FORMED[j][0]} #{j}: an answer under load differs from its single-client answer")
        if kind == "bad" and not 400 <= status < 500:
            failures.append(f"malformed {MALFORMED[j][0]} #{j}: HTTP {status}")
        if status >= 500 and status != 503:
            failures.append(f"HTTP {status}")
    base = rss[RSS_FROM - 1] if len(rss) >= RSS_FROM else rss[0]
    drift = max(abs(r - base) for r in rss[RSS_FROM - 1:]) / base if rss else 0.0
    if drift > 0.05:
        failures.append(f"RSS moved {100 * drift:.1f} % from request {RSS_FROM} on (more than 5 %)")
    figures = {"requests": len(results), "ok": statuses.count(200), "queue_full_503": statuses.count(503),
               "4xx": sum(400 <= s < 500 for s in statuses), "other_5xx": sum(s >= 500 and s != 503 for s in statuses),
               "rss_mib_at_200": base / 2 ** 20, "rss_mib_last": rss[-1] / 2 ** 20, "rss_drift_from_200": drift}
    return figures, failures


def plot(rss, path):  # the RSS curve as a PNG
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(range(1, len(rss) + 1), [r / 2 ** 20 for r in rss])
    ax.axvline(RSS_FROM, color="grey", linestyle=":")
    ax.set_xlabel("requests answered")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title("reference.serve under load")
    fig.tight_layout()
    fig.savefig(path)


def overhead_figures(costs, health, cpu):  # -> the overhead's figures in ms, with the machine's load beside them
    q1, median, q3 = statistics.quantiles(costs, n=4)
    return {"overhead_ms_median": 1e3 * median, "overhead_ms_quartiles": [1e3 * q1, 1e3 * q3],
            "overhead_goal_ms": OVERHEAD_GOAL_S * 1e3, "overhead_goal_met": median <= OVERHEAD_GOAL_S,
            "loop_cpu_ms_mean": 1e3 * cpu, "health_ms_median": 1e3 * statistics.median(health),
            "load_average_1min": os.getloadavg()[0]}


def bench(args):  # -> exit status
    artifacts.refuse_overwrite([("--png", args.png), ("--json-out", args.json_out)], [("--model", args.model)], UsageError)
    for module in ("httpx", "fastapi", "uvicorn"):
        import_extra(module, "tools.bench.serve")
    proc, url = start(args.model, args.queue)
    try:
        import httpx
        singles = [stable(httpx.post(f"{url}{p}", content=payload(b), timeout=600).content) for p, b in WELL_FORMED]
        figures = overhead_figures(*overhead(url, proc.pid, args.model, args.overhead))
        if not args.overhead_only:
            t0 = time.perf_counter()
            results, rss = asyncio.run(load(url, proc.pid, args.clients, args.requests))
            figures["load_seconds"] = time.perf_counter() - t0
    finally:
        proc.terminate()
        _, log = proc.communicate(timeout=120)
    failures = []
    if not args.overhead_only:
        load_figures, failures = check(results, singles, rss)
        figures.update(load_figures, clients=args.clients, queue=args.queue)
    figures.update(server_exit=proc.returncode, traceback_in_log="Traceback" in log)
    if proc.returncode != 0 or "Traceback" in log:
        failures.append(f"the server exited {proc.returncode}" + (" with a traceback in its log" if "Traceback" in log
                                                                  else ""))
    if args.png and not args.overhead_only:
        plot(rss, args.png)
    if args.json_out:
        write_json(args.json_out, {**figures, "failures": failures})
    print(json.dumps(figures, indent=1))
    for failure in failures[:20]:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


def main(argv=None):
    p = OneLineParser(prog="python -m tools.bench.serve", description=__doc__)
    flag(p, "model", default=DEFAULT_MODEL, help="the text GGUF the server loads")
    p.add_argument("--clients", type=int_in(1, 1024), default=64)
    p.add_argument("--requests", type=int_in(RSS_FROM, 1 << 20), default=2000)
    p.add_argument("--queue", type=int_in(1, 1 << 20), default=16, help="the server's --queue")
    p.add_argument("--overhead", type=int_in(4, 1 << 20), default=100, help="requests timed one at a time")
    p.add_argument("--overhead-only", action="store_true", help="time the overhead, skip the load test")
    p.add_argument("--png", type=output_file, help="the RSS curve")
    add_json_out(p, "the figures")
    args = p.parse_args(argv)
    return exit_status("tools.bench.serve", lambda: bench(args))


if __name__ == "__main__":
    sys.exit(main())
