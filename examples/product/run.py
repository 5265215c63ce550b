"""The product loop, end to end: serve the policy, record what users do, learn from it, swap it in.

    python examples/product/run.py [--minutes 10] [--clients 8] [--eval-users 128]

One command: starts `trillora serve tiny-moe-chat --record STORE --learn examples/product/learn.toml`,
then runs the demo product (`app.py`, the `openai` SDK only) for simulated users (`users.py`):

1. learner idle: `--clients` training users at once for `--idle-seconds`, sending no feedback, so
   nothing is trained: the latency of serving with recording alone;
2. learning: the same users send thumbs up / down, the server trains a new revision every 32
   rewarded conversations and swaps it in while it serves;
3. every `--eval-every` seconds (and at the start), held-out users (questions of the split the model
   never saw in pretraining, no feedback) measure the success rate of what is served then.

Every request must be answered (the count of failures is in the results). Writes
benchmarks/results/product_loop.json and product_loop.png: success against traffic (conversations
served to training users), with the revisions marked.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from app import Assistant  # noqa: E402
from users import users  # noqa: E402

KEY = "product-demo"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())


def evaluate(url: str, held_out, clients: int) -> float:
    """Held-out users' success rate: each asks once (no feedback)."""
    ok, lock, queue = [], threading.Lock(), list(held_out)

    def worker() -> None:
        assistant = Assistant(url + "/v1", KEY, "tiny-moe-chat")
        while True:
            with lock:
                if not queue:
                    return
                user = queue.pop()
            answer, _, _ = assistant.ask(user.question, user.name)
            with lock:
                ok.append(user.satisfied(answer))

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return sum(ok) / len(ok)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    points = report["evaluations"]
    ax.plot(
        [p["conversations"] for p in points],
        [100 * p["success"] for p in points],
        marker="o",
        label=f"held-out users ({report['eval_users']}), success %",
    )
    ax.plot(
        [r["conversations"] for r in report["revisions"]],
        [2] * len(report["revisions"]),
        "|",
        color="grey",
        markersize=10,
        label=f"a revision published ({len(report['revisions'])})",
    )
    ax.set(
        xlabel="conversations served to training users",
        ylabel="success %",
        ylim=(0, 100),
        title="the product loop: tiny-moe-chat learning from its users' thumbs (2 cores)",
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="learning time, from the first feedback")
    p.add_argument("--idle-seconds", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--eval-users", type=int, default=128)
    p.add_argument("--eval-every", type=float, default=60.0)
    p.add_argument("--learn", default=str(HERE / "learn.toml"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "product_loop.json"))
    args = p.parse_args(argv)

    work, port = Path(tempfile.mkdtemp(prefix="product-")), free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trillora",
            "serve",
            "tiny-moe-chat",
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--record",
            str(work / "traces.db"),
            "--learn",
            args.learn,
            "--state-dir",
            str(work / "state"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    for _ in range(1200):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            if server.poll() is not None:
                raise SystemExit(server.stdout.read()) from None
            time.sleep(0.1)
    held_out, train = users("eval", args.eval_users, seed=0), users("train", 2048, seed=0)
    latencies = {"learner idle": [], "learner on": []}
    failures, served, lock = [0], [0], threading.Lock()
    traffic: list[tuple[float, int]] = []  # (wall time, conversations served to learning users so far)
    phase, stop = {"name": "learner idle"}, threading.Event()

    def client(i: int) -> None:
        assistant = Assistant(url + "/v1", KEY, "tiny-moe-chat")
        for user in itertools.cycle(train[i :: args.clients]):  # users come back with the same needs
            for _ in range(2):  # a wrong answer is asked again once
                if stop.is_set():
                    return
                learning = phase["name"] == "learner on"
                try:
                    answer, trace, seconds = assistant.ask(user.question, user.name)
                    good = user.satisfied(answer)
                    if learning and trace:
                        assistant.feedback(trace, float(good))
                except Exception:  # noqa: BLE001 - counted: every request must be answered
                    with lock:
                        failures[0] += 1
                    continue
                with lock:
                    latencies[phase["name"]] += seconds
                    served[0] += learning
                    traffic.append((time.time(), served[0]))
                if good:
                    break

    print(f"serving on {url}; held-out success at the start ...", flush=True)
    start_success = evaluate(url, held_out, args.clients)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    [t.start() for t in threads]
    time.sleep(args.idle_seconds)
    phase["name"], begun = "learner on", time.monotonic()
    evaluations = [{"seconds": 0.0, "conversations": 0, "revision": 0, "success": start_success}]
    print(f"  start: {100 * start_success:.1f}%", flush=True)
    while time.monotonic() - begun < 60 * args.minutes:
        time.sleep(min(args.eval_every, max(0.0, 60 * args.minutes - (time.monotonic() - begun))))
        revision = get(url + "/v1/revisions")["current"] or 0
        success = evaluate(url, held_out, args.clients)
        evaluations.append(
            {"seconds": time.monotonic() - begun, "conversations": served[0], "revision": revision, "success": success}
        )
        print(
            f"  {evaluations[-1]['seconds']:.0f} s, {served[0]} conversations, revision {revision}: "
            f"{100 * success:.1f}%",
            flush=True,
        )
    stop.set()
    [t.join() for t in threads]
    listing = get(url + "/v1/revisions")
    health = get(url + "/health")
    server.terminate()
    server.wait(60)

    def at(t: float) -> int:  # conversations served by wall-clock time t
        return max((n for when, n in traffic if when <= t), default=0)

    revision = work / "state" / "learner" / f"revision-{listing['current']}"
    history = json.loads((revision / "state.json").read_text())["learner"]["history"]
    report = {
        "command": "python examples/product/run.py " + " ".join(argv or sys.argv[1:]),
        "model": "tiny-moe-chat",
        "clients": args.clients,
        "eval_users": args.eval_users,
        "minutes": args.minutes,
        "learn_config": Path(args.learn).read_text(),
        "evaluations": evaluations,
        "success_start": start_success,
        "success_end": evaluations[-1]["success"],
        "gain_points": 100 * (evaluations[-1]["success"] - start_success),
        "revisions": [
            {
                "revision": r["revision"],
                "conversations": at(r["time"]),
                "traces": r["traces"],
                "reward_mean": r["reward_mean"],
                "is_ratio_mean": r.get("is_ratio_mean"),
                "served_by_max_lag": r["served_by_max_lag"],
            }
            for r in history
        ],
        "revisions_published": listing["current"],
        "learning_failures": listing["failures"],
        "requests_failed": failures[0],
        "recorded": health["recording"]["recorded"],
        "record_failures": health["recording"]["failed"],
        "latency_s": {
            name: {
                "requests": len(v),
                "p50": statistics.median(v) if v else None,
                "p99": statistics.quantiles(v, n=100)[98] if len(v) > 1 else None,
            }
            for name, v in latencies.items()
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(
        f"held-out success {100 * start_success:.1f}% → {100 * report['success_end']:.1f}% "
        f"({report['gain_points']:+.1f} points) over {served[0]} conversations, {listing['current']} revisions; "
        f"{failures[0]} requests failed; latency p50/p99 idle {report['latency_s']['learner idle']['p50']:.3f}/"
        f"{report['latency_s']['learner idle']['p99']:.3f} s, learning {report['latency_s']['learner on']['p50']:.3f}/"
        f"{report['latency_s']['learner on']['p99']:.3f} s; wrote {out}"
    )
    return report


if __name__ == "__main__":
    main()
