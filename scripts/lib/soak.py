#!/usr/bin/env python3
"""The chaos half of scripts/soak.sh (docs/soak.md): runs against a stack that soak.sh deployed
under supervisord and that serves. Warms it up, snapshots every process, drives `hmoe load` for
the soak's duration while SIGKILLing a random worker every --kill-every-s seconds and restarting
weightd every --weightd-every-s seconds (alternately with SIGTERM through supervisorctl and with
SIGKILL), waits for the stack to be quiet, snapshots again, stops the stack, and prints the table.
Exits 1 when a criterion of issue #16 acceptance 4 fails, 2 when the soak itself could not run.
Standard library only."""

import argparse
import collections
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

EXPECTED = {  # request kind -> statuses that are its expected outcomes (docs/soak.md)
    "short": {"OK", "RESOURCE_EXHAUSTED"},
    "long": {"OK", "RESOURCE_EXHAUSTED"},
    "burst": {"OK", "RESOURCE_EXHAUSTED"},
    "cancel": {"OK", "CANCELLED", "RESOURCE_EXHAUSTED"},
    "deadline": {"OK", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"},
}


# Quiet time before a snapshot: the router hands freed memory back to the system within 5 s of
# going idle (router/main.cc), the workers' last streams close.
SETTLE_S = 7


def now_ms():
    return int(time.time() * 1000)


def say(msg):
    print(f"soak [{time.strftime('%H:%M:%S')}]: {msg}", flush=True)


class Stack:
    def __init__(self, a):
        self.a = a

    def ctl(self, *args, check=False):
        return subprocess.run(["supervisorctl", "-c", self.a.conf, *args], capture_output=True,
                              text=True, check=check)

    def workers(self):
        """worker_id -> (kind, state, incarnation, pid) from the router's GetStatus."""
        r = subprocess.run([self.a.hmoe, "status", "--addr", self.a.addr, "--timeout-s", "2"],
                           capture_output=True, text=True)
        out = {}
        for line in r.stdout.splitlines():
            m = re.match(r"\s+(\S+)\s+(DECODE|PREFILL)\s+(\S+)\s+\S+\s+inc (\d+)", line)
            if m:
                out[m.group(1)] = (m.group(2), m.group(3), int(m.group(4)))
        return out

    def inflight(self):
        r = subprocess.run([self.a.hmoe, "status", "--addr", self.a.addr, "--timeout-s", "2"],
                           capture_output=True, text=True)
        m = re.search(r"requests: (\d+) in flight", r.stdout)
        return int(m.group(1)) if m else -1

    def programs(self):
        """supervisord program -> pid (0 when not running), plus 'supervisord' itself."""
        out = {}
        for line in self.ctl("status").stdout.splitlines():
            m = re.match(r"(\S+)\s+(\S+)\s+(?:pid (\d+))?", line)
            if m:
                out[m.group(1)] = int(m.group(3) or 0)
        try:
            out["supervisord"] = int(open(self.a.run_dir + "/supervisord.pid").read())
        except (OSError, ValueError):
            pass
        return out

    def weightd_serving(self):
        r = subprocess.run([self.a.hmoe, "health", "--addr", f"unix:{self.a.run_dir}/weightd.sock",
                            "--timeout-s", "2"], capture_output=True, text=True)
        return r.returncode == 0


def proc_field(pid, field):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(field + ":"):
                return line.split()[1]
    except OSError:
        return None
    return None


def socket_fds(pid):
    n = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                    n += 1
            except OSError:
                pass
    except OSError:
        return None
    return n


def zombies(parents):
    """Zombie processes whose parent is one of `parents` (the stack's processes)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and proc_field(d, "State") == "Z" and \
                int(proc_field(d, "PPid") or 0) in parents:
            found.append(int(d))
    return found


def shm_files(instance):
    names = set(os.path.basename(p) for p in glob.glob(f"/dev/shm/hmoe.{instance}.*"))
    # KV hand-offs of the prefill workers (prefill_worker/main.cc ExportPrefix: the worker id).
    names |= set(os.path.basename(p) for p in glob.glob("/dev/shm/hmoe-kv-prefill-*"))
    return names


def snapshot(stack, instance):
    progs = stack.programs()
    snap = {}
    for name, pid in sorted(progs.items()):
        rss = proc_field(pid, "VmRSS") if pid else None
        anon = proc_field(pid, "RssAnon") if pid else None
        snap[name] = {"pid": pid, "rss_kb": int(rss) if rss else None,
                      "anon_kb": int(anon) if anon else None,
                      "sockets": socket_fds(pid) if pid else None}
    return snap, shm_files(instance)


def wait_until(pred, timeout_s, step_s=0.1):
    end = time.time() + timeout_s
    while time.time() < end:
        if pred():
            return True
        time.sleep(step_s)
    return pred()


def percentile(values, p):
    if not values:
        return float("nan")
    v = sorted(values)
    k = max(0, min(len(v) - 1, int(-(-p * len(v) // 100)) - 1))  # nearest rank
    return v[k]


def main():
    ap = argparse.ArgumentParser()
    for flag in ("hmoe", "addr", "conf", "run-dir", "log-dir", "instance", "out"):
        ap.add_argument("--" + flag, required=True)
    ap.add_argument("--minutes", type=float, required=True)
    ap.add_argument("--kill-every-s", type=float, default=10)
    ap.add_argument("--weightd-every-s", type=float, default=60)
    ap.add_argument("--warmup-s", type=float, default=30)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--burst-every-s", type=float, default=30)
    ap.add_argument("--burst-size", type=int, default=100)
    ap.add_argument("--recovery-limit-s", type=float, default=5)
    ap.add_argument("--rss-limit-pct", type=float, default=5)
    ap.add_argument("--rss-gate", type=int, default=1,
                    help="0: report RSS growth past the limit without failing")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    stack = Stack(a)
    rng = random.Random(a.seed)
    os.makedirs(a.out, exist_ok=True)
    requests_log = os.path.join(a.out, "requests.tsv")
    events_log = os.path.join(a.out, "events.tsv")
    for f in (requests_log, events_log, os.path.join(a.out, "warmup.tsv")):
        if os.path.exists(f):
            os.remove(f)
    events = open(events_log, "w", buffering=1)

    def load(seconds, log, burst_every_s):
        return subprocess.Popen(
            [a.hmoe, "load", "--addr", a.addr, "--duration-s", str(seconds), "--concurrency",
             str(a.concurrency), "--burst-every-s", str(burst_every_s), "--burst-size",
             str(a.burst_size), "--seed", str(a.seed), "--timeout-s", "120", "--log", log],
            stderr=subprocess.PIPE, text=True)

    kills, recoveries, recovery_s = [], [], []
    down = []  # (from_ms, to_ms) windows while a killed worker was not yet registered again
    weightd = {"restarts": 0, "recovered": 0}
    zombie_seen = set()
    rss_log = open(os.path.join(a.out, "rss.tsv"), "w", buffering=1)

    def phase(duration, log_path, burst_every_s):
        """Load for `duration` s with the faults; returns the load generator's (exit, stderr)."""
        t_begin = time.time()
        gen = load(duration, log_path, burst_every_s)
        next_kill = t_begin + a.kill_every_s
        next_weightd = t_begin + a.weightd_every_s
        next_sample = t_begin
        while gen.poll() is None:
            progs = stack.programs()
            if time.time() >= next_sample:  # RSS of every process every 30 s (docs/soak.md)
                next_sample += 30
                rss_log.write(f"{now_ms()}\t" + "\t".join(
                    f"{n}={proc_field(p, 'VmRSS') if p else '-'}/{proc_field(p, 'RssAnon') if p else '-'}"
                    for n, p in sorted(progs.items()))
                    + "\n")
            parents = set(p for p in progs.values() if p)
            zombie_seen.update(zombies(parents))
            t = time.time()
            if t >= next_weightd and t - t_begin < duration - 5:
                next_weightd += a.weightd_every_s
                how = "SIGTERM" if weightd["restarts"] % 2 == 0 else "SIGKILL"
                weightd["restarts"] += 1
                t0 = now_ms()
                if how == "SIGTERM":
                    stack.ctl("restart", "weightd")
                elif progs.get("weightd"):
                    os.kill(progs["weightd"], signal.SIGKILL)
                ok = wait_until(lambda: stack.programs().get("weightd", 0) not in (0, progs.get(
                    "weightd")) and stack.weightd_serving(), 60)
                weightd["recovered"] += ok
                events.write(f"{t0}\t{now_ms()}\tweightd\t{how}\t{'ok' if ok else 'FAILED'}\n")
                continue
            if t >= next_kill and t - t_begin < duration - 5:
                next_kill += a.kill_every_s
                before = stack.workers()
                live = [w for w, (kind, state, inc) in before.items() if state == "LIVE"]
                if not live:
                    continue
                victim = rng.choice(sorted(live))
                prog = "decode" if before[victim][0] == "DECODE" else victim
                pid = progs.get(prog, 0)
                if not pid:
                    continue
                t0 = now_ms()
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                kills.append(victim)

                def back():
                    w = stack.workers().get(victim)
                    return w is not None and w[1] == "LIVE" and w[2] > before[victim][2]

                ok = wait_until(back, 60, 0.05)
                t1 = now_ms()
                down.append((t0, t1))
                if ok:
                    recoveries.append(victim)
                    recovery_s.append((t1 - t0) / 1000)
                events.write(f"{t0}\t{t1}\t{victim}\tSIGKILL\t{'ok' if ok else 'FAILED'}\n")
                continue
            time.sleep(0.2)

        _, summary = gen.communicate()
        return gen.returncode, summary

    def quiet():
        return wait_until(lambda: stack.inflight() == 0, 180, 0.5)

    initial_shm = shm_files(a.instance)
    # The warm-up is the soak itself, faults included, for --warmup-s: the allocators of the
    # processes that live through the soak (router, supervisord) reach their high-water marks
    # (bursts, retries, reconnections) before the start snapshot.
    say(f"warm-up: {a.warmup_s:.0f} s of the soak's load and faults")
    warm_rc, warm_summary = phase(a.warmup_s, os.path.join(a.out, "warmup.tsv"),
                                 min(a.burst_every_s, a.warmup_s / 2))
    if warm_rc != 0 or not quiet():
        say(f"the warm-up failed (load exit {warm_rc}): {warm_summary}")
        return 2
    time.sleep(SETTLE_S)
    start_snap, start_shm = snapshot(stack, a.instance)
    start_shm |= initial_shm
    say("start: " + json.dumps(start_snap))
    duration = a.minutes * 60
    say(f"soak: {duration:.0f} s of load; a worker SIGKILLed every {a.kill_every_s:.0f} s, "
        f"weightd restarted every {a.weightd_every_s:.0f} s")
    load_rc, load_summary = phase(duration, requests_log, a.burst_every_s)
    say("load finished; waiting for the stack to be quiet")
    quiet()
    time.sleep(SETTLE_S)
    end_snap, end_shm = snapshot(stack, a.instance)
    zombie_end = zombies(set(p["pid"] for p in end_snap.values() if p["pid"]))
    say("end: " + json.dumps(end_snap))

    # Stop the stack and look for what it left behind.
    sup_pid = end_snap.get("supervisord", {}).get("pid", 0)
    stack.ctl("shutdown")
    wait_until(lambda: not sup_pid or not os.path.exists(f"/proc/{sup_pid}"), 120, 0.2)
    left_procs = [p["pid"] for p in end_snap.values()
                  if p["pid"] and os.path.exists(f"/proc/{p['pid']}")
                  and proc_field(p["pid"], "State") != "Z"]
    left_sockets = sorted(os.path.basename(s) for s in glob.glob(a.run_dir + "/*.sock"))
    after_shm = shm_files(a.instance)
    # The weight store stays in /dev/shm by design (the next weightd adopts it): a leak is any
    # other segment, or one that appeared during the soak.
    leaked_shm = sorted((after_shm - start_shm) | (end_shm - start_shm))

    # Requests by outcome, and the ones lost on live workers.
    outcomes = collections.Counter()
    lost = []
    excused = 0
    total = 0
    for line in open(os.path.join(a.out, "warmup.tsv")).readlines() + \
            open(requests_log).readlines():
        f = line.rstrip("\n").split("\t")
        if len(f) < 7:
            continue
        start, end, kind, code = int(f[0]), int(f[1]), f[2], f[3]
        total += 1
        outcomes[(kind, code)] += 1
        if code in EXPECTED.get(kind, set()):
            continue
        if code == "UNAVAILABLE" and any(s <= end and start <= e for s, e in down):
            excused += 1
            continue
        lost.append(line.rstrip("\n"))
    loads = reloads = 0
    adoptions = 0
    for path in sorted(glob.glob(a.log_dir + "/weightd.log*")):
        for line in open(path, errors="replace"):
            loads += "loaded generation" in line
            adoptions += "adopted generation" in line
    reloads = max(0, loads - 1)

    # The table.
    print()
    print(f"== chaos soak: {a.warmup_s:g} s warm-up + {a.minutes:g} min, {total} requests "
          f"(faults from the start), load exit {load_rc}")
    print(f"{'kind':<10}{'status':<22}{'requests':>9}")
    for (kind, code), n in sorted(outcomes.items()):
        mark = "" if code in EXPECTED.get(kind, set()) else \
            ("  (worker down)" if code == "UNAVAILABLE" else "  UNEXPECTED")
        print(f"{kind:<10}{code:<22}{n:>9}{mark}")
    print()
    p50, p99 = percentile(recovery_s, 50), percentile(recovery_s, 99)
    print(f"worker kills (SIGKILL)        {len(kills)} ({', '.join(f'{w} {n}' for w, n in sorted(collections.Counter(kills).items()))})")
    print(f"recoveries                    {len(recoveries)} of {len(kills)}")
    print(f"recovery time p50 / p99 / max {p50:.2f} s / {p99:.2f} s / "
          f"{max(recovery_s) if recovery_s else float('nan'):.2f} s (kill -> registered LIVE again)")
    print(f"weightd restarts              {weightd['restarts']} ({weightd['recovered']} SERVING again); "
          f"store adopted {adoptions} times")
    print(f"weight reloads                {reloads} (loads {loads}, the first one is the start)")
    print(f"UNAVAILABLE while a worker was down  {excused}")
    print(f"requests lost on live workers {len(lost)}")
    for line in lost[:20]:
        print("    " + line)
    print(f"leaked shm segments           {len(leaked_shm)} {' '.join(leaked_shm)}")
    print(f"leftover sockets              {len(left_sockets)} {' '.join(left_sockets)}")
    print(f"leftover processes            {len(left_procs)} {left_procs}")
    print(f"zombies (during / at the end) {len(zombie_seen)} / {len(zombie_end)}")
    print()
    print(f"{'process':<14}{'pid start':>10}{'pid end':>10}{'RSS start':>12}{'RSS end':>12}"
          f"{'growth':>9}{'anon start':>12}{'anon end':>10}{'growth':>9}{'sockets':>10}")
    rss_fail = []
    sock_fail = []
    for name in sorted(set(start_snap) | set(end_snap)):
        s, e = start_snap.get(name, {}), end_snap.get(name, {})
        same = s.get("pid") and s.get("pid") == e.get("pid")
        growth = ""
        if s.get("rss_kb") and e.get("rss_kb"):
            g = 100.0 * (e["rss_kb"] - s["rss_kb"]) / s["rss_kb"]
            growth = f"{g:+.1f}%"
            # The gate takes the larger of the RSS growth and the anonymous memory's growth
            # counted against the start RSS: code pages the kernel drops under memory pressure
            # shrink VmRSS and could hide a heap that grew (docs/soak.md).
            if s.get("anon_kb") and e.get("anon_kb"):
                g = max(g, 100.0 * (e["anon_kb"] - s["anon_kb"]) / s["rss_kb"])
            if same and g >= a.rss_limit_pct:
                rss_fail.append(name)
        anon_growth = ""
        if s.get("anon_kb") and e.get("anon_kb"):
            anon_growth = f"{100.0 * (e['anon_kb'] - s['anon_kb']) / s['anon_kb']:+.1f}%"
        socks = f"{s.get('sockets')}->{e.get('sockets')}"
        # Slack of 2 for connections opening or closing at the snapshot: the router's include the
        # soak's own `hmoe status` polls. A leak of one per worker restart would exceed it.
        if same and s.get("sockets") is not None and e.get("sockets") is not None and \
                e["sockets"] > s["sockets"] + 2:
            sock_fail.append(name)
        fmt = lambda kb: f"{kb / 1024:.1f} MiB" if kb else "-"
        print(f"{name:<14}{s.get('pid') or '-':>10}{e.get('pid') or '-':>10}"
              f"{fmt(s.get('rss_kb')):>12}{fmt(e.get('rss_kb')):>12}{growth:>9}"
              f"{fmt(s.get('anon_kb')):>12}{fmt(e.get('anon_kb')):>10}{anon_growth:>9}{socks:>10}"
              f"{'' if same else '  restarted: not gated'}")
    print()

    failures = []
    if load_rc != 0:
        failures.append(f"the load generator exited {load_rc}: {load_summary.strip()[-300:]}")
    if lost:
        failures.append(f"{len(lost)} requests lost on live workers")
    if reloads:
        failures.append(f"{reloads} weight reloads")
    if len(recoveries) != len(kills):
        failures.append(f"{len(kills) - len(recoveries)} killed workers did not come back in 60 s")
    if weightd["recovered"] != weightd["restarts"]:
        failures.append("weightd did not serve again after a restart")
    if recovery_s and p99 >= a.recovery_limit_s:
        failures.append(f"recovery p99 {p99:.2f} s >= {a.recovery_limit_s} s")
    if not kills:
        failures.append("no worker was killed (the soak is too short for --kill-every-s)")
    if leaked_shm or left_sockets or left_procs or zombie_seen or zombie_end:
        failures.append("leaks (shm segments, sockets, processes or zombies)")
    if sock_fail:
        failures.append(f"open sockets grew by more than 2: {', '.join(sock_fail)}")
    if rss_fail and a.rss_gate:
        failures.append(f"RSS grew by {a.rss_limit_pct}% or more: {', '.join(rss_fail)}")
    elif rss_fail:
        print(f"NOT GATED (HMOE_SOAK_RSS_GATE=0): RSS grew by {a.rss_limit_pct}% or more: "
              f"{', '.join(rss_fail)}")
    for f in failures:
        print("FAIL: " + f)
    print("soak: " + ("FAILED" if failures else "PASSED (every criterion of issue #16 acceptance 4" +
                      (")" if a.rss_gate else " but RSS growth, which was not gated)")))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
