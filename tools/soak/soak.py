#!/usr/bin/env python3
"""Soak test of `dflash serve`: many streams for minutes, with cancellations and malformed requests.

Starts the binary (or loads a server at --url) and runs --streams workers until --minutes have passed. Each worker
loops: a streamed chat completion (a share cancelled after a few chunks), a whole one, or a malformed request.
Checked: no 5xx at all; every finished completion has exactly max_tokens tokens and finish_reason "length"
(requests set ignore_eos); malformed requests get a 4xx; at the end the engine is idle with every KV page given
back; the server's resident memory after warm-up is recorded each interval. Writes a JSON summary and exits
non-zero when a check fails. Standard library only.

Usage: python3 tools/soak/soak.py --bin target/release/dflash --minutes 10 --streams 64 [--out soak.json]
       [--serve-args "--device cpu --threads 2"]
"""

import argparse
import http.client
import json
import os
import random
import re
import subprocess
import sys
import threading
import time

PROMPTS = [
    "Describe the sea.",
    "Write a haiku about autumn.",
    "List three uses of a paperclip.",
    "Explain what a hash map is.",
    "Tell me a story about a robot.",
]

MALFORMED = [
    b"{not json",
    b'{"messages": "hi"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 9}',
    b'{"messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"messages": []}',
    b"",
]


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.problems = []

    def add(self, key, n=1):
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def problem(self, text):
        with self.lock:
            self.counts["problems"] = self.counts.get("problems", 0) + 1
            if len(self.problems) < 50:
                self.problems.append(text)


def start_server(binary, serve_args):
    args = [binary, "serve", "--host", "127.0.0.1", "--port", "0"] + serve_args.split()
    env = dict(os.environ, NO_COLOR="1", DFLASH_LOG="info")
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)
    log = []
    port = None
    deadline = time.time() + 300
    while port is None:
        line = proc.stderr.readline()
        if not line:
            sys.exit("the server exited before listening:\n" + "".join(log[-20:]))
        log.append(line)
        found = re.search(r"listening on http://[^:]+:(\d+)", line)
        if found:
            port = int(found.group(1))
        if time.time() > deadline:
            sys.exit("the server did not listen within 300 s")
    threading.Thread(target=lambda: [log.append(l) for l in proc.stderr], daemon=True).start()
    return proc, port, log


def request(port, body, timeout=300):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", "/v1/chat/completions", body=data, headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def streamed(port, tally, rng):
    max_tokens = rng.randint(8, 48)
    cancel_after = rng.randint(1, 4) if rng.random() < 0.2 else None
    body = {
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": rng.choice([0, 0.7]),
    }
    conn, resp = request(port, body)
    if resp.status != 200:
        tally.add(f"status {resp.status}")
        if resp.status >= 500:
            tally.problem(f"streamed: {resp.status} {resp.read()[:200]!r}")
        conn.close()
        return
    chunks, finish, usage = 0, None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            break
        event = json.loads(payload)
        if "error" in event:
            tally.problem(f"stream error: {event['error']}")
            break
        for choice in event.get("choices", []):
            finish = choice.get("finish_reason") or finish
        usage = event.get("usage") or usage
        chunks += 1
        if cancel_after is not None and chunks >= cancel_after:
            conn.close()
            tally.add("cancelled")
            return
    conn.close()
    if finish != "length" or usage is None or usage.get("completion_tokens") != max_tokens:
        tally.problem(f"stream ended with {finish!r}, usage {usage} for max_tokens {max_tokens}")
        return
    tally.add("streamed ok")
    tally.add("tokens", max_tokens)


def whole(port, tally, rng):
    max_tokens = rng.randint(8, 48)
    body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": max_tokens, "ignore_eos": True}
    conn, resp = request(port, body)
    data = resp.read()
    conn.close()
    if resp.status != 200:
        tally.add(f"status {resp.status}")
        if resp.status >= 500:
            tally.problem(f"whole: {resp.status} {data[:200]!r}")
        return
    reply = json.loads(data)
    if reply["choices"][0]["finish_reason"] != "length" or reply["usage"]["completion_tokens"] != max_tokens:
        tally.problem(f"whole: {reply['choices'][0]['finish_reason']} {reply['usage']} for max_tokens {max_tokens}")
        return
    tally.add("whole ok")
    tally.add("tokens", max_tokens)


def malformed(port, tally, rng):
    conn, resp = request(port, rng.choice(MALFORMED))
    resp.read()
    conn.close()
    if 400 <= resp.status < 500:
        tally.add("malformed refused")
    else:
        tally.problem(f"a malformed request got {resp.status}")


def worker(port, deadline, tally, seed):
    rng = random.Random(seed)
    while time.time() < deadline:
        kind = rng.random()
        try:
            if kind < 0.7:
                streamed(port, tally, rng)
            elif kind < 0.9:
                whole(port, tally, rng)
            else:
                malformed(port, tally, rng)
        except (OSError, http.client.HTTPException, ValueError) as e:
            tally.problem(f"{type(e).__name__}: {e}")


def metrics(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    values = {}
    for line in text.splitlines():
        if line.startswith("dflash_") and "{" not in line:
            name, _, value = line.partition(" ")
            values[name] = float(value)
    return values


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default="target/release/dflash")
    ap.add_argument("--url-port", type=int, help="load a running server on 127.0.0.1:PORT instead of starting one")
    ap.add_argument("--serve-args", default="--device cpu")
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--interval", type=float, default=30, help="seconds between memory and gauge readings")
    ap.add_argument("--out", default="soak.json")
    a = ap.parse_args()

    proc, log = None, []
    if a.url_port:
        port = a.url_port
    else:
        proc, port, log = start_server(a.bin, a.serve_args)
    tally = Tally()
    started = time.time()
    deadline = started + a.minutes * 60
    workers = [threading.Thread(target=worker, args=(port, deadline, tally, i), daemon=True) for i in range(a.streams)]
    for w in workers:
        w.start()
    readings = []
    while any(w.is_alive() for w in workers):
        time.sleep(min(a.interval, max(0.1, deadline - time.time() + 1)))
        m = metrics(port)
        readings.append({
            "s": round(time.time() - started),
            "rss_mib": rss_mib(proc.pid) if proc else None,
            "running": m.get("dflash_running_sequences"),
            "kv_pages_used": m.get("dflash_kv_pages_used"),
            "tokens": m.get("dflash_generation_tokens_total"),
        })
        print(json.dumps(readings[-1]), flush=True)
    for w in workers:
        w.join()
    # Cancelled streams are noticed at the engine's next step; give it a moment to go idle.
    idle_deadline = time.time() + 60
    final = metrics(port)
    while (final.get("dflash_running_sequences") or final.get("dflash_kv_pages_used")) and time.time() < idle_deadline:
        time.sleep(0.5)
        final = metrics(port)
    if final.get("dflash_kv_pages_used", 0) != 0 or final.get("dflash_running_sequences", 0) != 0:
        tally.problem(f"not idle at the end: {final}")
    warm = [r["rss_mib"] for r in readings if r["rss_mib"] is not None and r["s"] >= 60]
    if len(warm) >= 2 and warm[-1] > 1.25 * warm[0]:
        tally.problem(f"resident memory grew after warm-up: {warm[0]:.0f} -> {warm[-1]:.0f} MiB")
    summary = {
        "minutes": a.minutes,
        "streams": a.streams,
        "counts": tally.counts,
        "problems": tally.problems,
        "rss_mib_after_warmup": {"first": warm[0], "last": warm[-1], "max": max(warm)} if warm else None,
        "final_gauges": {k: final.get(k) for k in ("dflash_running_sequences", "dflash_kv_pages_used")},
        "readings": readings,
    }
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: summary[k] for k in ("counts", "problems", "rss_mib_after_warmup", "final_gauges")}, indent=1))
    if proc:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            tally.problem("the server did not exit within 60 s of SIGTERM")
        if proc.returncode not in (0, None):
            tally.problem(f"the server exited with {proc.returncode}")
    sys.exit(1 if tally.counts.get("problems") else 0)


if __name__ == "__main__":
    main()
