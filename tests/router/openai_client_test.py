#!/usr/bin/env python3
"""The OpenAI HTTP API with the official `openai` Python client (issue 17, acceptance 1).

Starts the real service on the tiny checkpoint (hmoe-weightd, hmoe-decode-worker, hmoe-router
with --http-listen) and checks, through openai.OpenAI:
  1. models.list() lists the model;
  2. chat.completions.create without and with streaming (greedy: the streamed deltas add up to
     the non-streamed answer; usage through stream_options.include_usage);
  3. completions.create, streaming too;
  4. greedy output through HTTP equals the gRPC API's (`hmoe generate --prompt-ids`) for the same
     rendered prompt (tokenized with hmoe-tokenize, special tokens included);
  5. a thinking template (--chat-template, the generation prompt opens <think>): the answer comes
     as reasoning_content (the random-weight model never closes the thought), streamed as
     reasoning_content deltas; it equals the gRPC text for that prompt too;
  6. errors surface as the client's exception classes (BadRequestError, NotFoundError);
  8. a stream dropped after 2 tokens of 900 ends cancelled and frees its decode slot and KV
     blocks on the real decode worker (its heartbeat gauges in /metrics go back to 0 running, 0
     KV blocks used) and the router's in-flight count goes back to 0;
  7. /metrics, scraped while 8 streams run and after, parses with prometheus-client's text parser
     and shows non-zero histograms (TTFT, TPOT, end-to-end, queue) and counters.

The client comes from a venv in the build tree (pinned: openai_client_requirements.txt), created on
demand. When pip cannot install it the test is skipped (exit 77) with the reason, except under CI
(CI=true), where that is a failure.

usage: openai_client_test.py --bin-dir BUILD --work-dir DIR --venv DIR --requirements FILE
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

SKIP = 77


def ensure_venv(args):
    """Re-executes this script under the venv's python (tests/python/hmoe_venv.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import hmoe_venv
    hmoe_venv.ensure_venv(args.venv, args.requirements, "the openai package", "HMOE_OPENAI_TEST_IN_VENV")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """weightd + decode worker + router as child processes."""

    def __init__(self, bins, model, work, router_flags):
        self.procs = []
        self.work = work
        run = os.path.join(work, "run")
        os.makedirs(run, mode=0o700, exist_ok=True)
        os.chmod(run, 0o700)
        instance = "openai-test-%d" % os.getpid()
        env = dict(os.environ, HMOE_RUNTIME_DIR=run)
        self.spawn("weightd", [bins["weightd"], "--model", model, "--instance", instance,
                               "--socket", run + "/weightd.sock", "--hugepages", "off",
                               "--numa", "off", "--remove-on-exit"], env)
        self.wait_log("weightd", "SERVING instance", 120)
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.spawn("router", [bins["router"], "--listen=127.0.0.1:%d" % self.grpc_port,
                              "--model=" + model, "--registry-socket=" + run + "/router.sock",
                              "--http-listen=127.0.0.1:%d" % self.http_port,
                              "--drain-seconds=5"] + router_flags, env)
        self.wait_log("router", "SERVING on port", 60)
        self.spawn("decode", [bins["decode"], "--weightd-instance", instance, "--socket",
                              run + "/decode.sock", "--router", "unix:" + run + "/router.sock",
                              "--worker-id", "decode-0", "--threads", "1",
                              "--pin-threads=false", "--heartbeat-ms", "100", "--kv-blocks",
                              "256", "--kv-block-tokens", "16", "--drain-seconds", "5"], env)
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/health" % self.http_port) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            for n, p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError("%s exited (%d):\n%s" % (n, p.returncode, self.logs()))
            if time.time() > deadline:
                raise RuntimeError("the service did not become healthy:\n" + self.logs())
            time.sleep(0.2)

    def spawn(self, name, argv, env):
        log = open(os.path.join(self.work, name + ".log"), "w")
        self.procs.append((name, subprocess.Popen(argv, stdout=log, stderr=log, env=env)))

    def log(self, name):
        return open(os.path.join(self.work, name + ".log"), errors="replace").read()

    def logs(self):
        return "\n".join("--- %s\n%s" % (n, self.log(n)[-3000:]) for n, _ in self.procs)

    def wait_log(self, name, text, timeout):
        deadline = time.time() + timeout
        while text not in self.log(name):
            for n, p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError("%s exited (%d):\n%s" % (n, p.returncode, self.logs()))
            if time.time() > deadline:
                raise RuntimeError("no '%s' from %s:\n%s" % (text, name, self.logs()))
            time.sleep(0.1)

    def stop(self):
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for _, p in reversed(self.procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def check_metrics(stack, client, kw, check):
    """Scrapes /metrics during a load of 8 concurrent streams and after; both must parse."""
    import threading
    from prometheus_client.parser import text_string_to_metric_families

    url = "http://127.0.0.1:%d/metrics" % stack.http_port
    errors = []

    def stream():
        try:
            for _ in client.chat.completions.create(stream=True, **dict(kw, max_tokens=24)):
                pass
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=stream) for _ in range(8)]
    for t in threads:
        t.start()
    during = urllib.request.urlopen(url).read().decode()
    for t in threads:
        t.join()
    after = urllib.request.urlopen(url).read().decode()
    check(not errors, "metrics load: 8 concurrent streams completed %s" % errors)
    parsed = {}
    try:
        list(text_string_to_metric_families(during))
        for family in text_string_to_metric_families(after):
            for s in family.samples:
                parsed[(s.name, tuple(sorted(s.labels.items())))] = s.value
        check(True, "/metrics parses with prometheus-client (during and after the load)")
    except Exception as e:
        check(False, "/metrics parses with prometheus-client: %r" % e)
        return
    for h in ["hmoe_time_to_first_token_seconds", "hmoe_time_per_output_token_seconds",
              "hmoe_request_duration_seconds", "hmoe_queue_time_seconds"]:
        count = parsed.get((h + "_count", ()), 0)
        inf = parsed.get((h + "_bucket", (("le", "+Inf"),)), 0)
        check(count >= 8 and inf == count and parsed.get((h + "_sum", ()), 0) > 0,
              "%s: count %s, +Inf bucket %s, sum > 0" % (h, count, inf))
    ok = parsed.get(("hmoe_requests_total", (("outcome", "ok"), ("path", "chunked"))), 0)
    check(ok >= 8, "hmoe_requests_total{outcome=ok,path=chunked} = %s >= 8" % ok)
    check(parsed.get(("hmoe_generation_tokens_total", ()), 0) >= 8 * 24,
          "hmoe_generation_tokens_total counts the streams' tokens")
    check(parsed.get(("hmoe_worker_up", (("kind", "decode"), ("worker", "decode-0"))), 0) == 1,
          "hmoe_worker_up{worker=decode-0} = 1")


def scrape(stack):
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % stack.http_port).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def check_disconnect(stack, check):
    """Drops a long stream after 2 content chunks; the worker's slot and KV blocks come back."""
    worker = (("kind", "decode"), ("worker", "decode-0"))
    body = json.dumps({"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 900,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", stack.http_port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    data = b""
    while data.count(b"data: {") < 2:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    check(data.count(b"data: {") >= 2, "disconnect: 2 tokens streamed before the drop")
    sock.close()
    freed = False
    for _ in range(200):
        m = scrape(stack)
        if (m.get(("hmoe_worker_running_requests", worker), -1) == 0 and
                m.get(("hmoe_worker_kv_blocks_used", worker), -1) == 0 and
                m.get(("hmoe_requests_inflight", ()), -1) == 0):
            freed = True
            break
        time.sleep(0.05)
    check(freed, "disconnect: slot and KV blocks freed, router in-flight 0")
    # Cancelled, not finished: the drop cut the 900-token generation short.
    cancelled = sum(v for (name, labels), v in m.items()
                    if name == "hmoe_requests_total" and ("outcome", "cancelled") in labels)
    check(cancelled == 1, "disconnect: the request ended cancelled (%s)" % cancelled)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin-dir", required=True, help="the build tree")
    p.add_argument("--work-dir", required=True)
    p.add_argument("--venv", required=True)
    p.add_argument("--requirements", required=True)
    args = p.parse_args()
    ensure_venv(args)
    import openai

    b = os.path.abspath(args.bin_dir)
    args.work_dir = os.path.abspath(args.work_dir)
    bins = {"weightd": b + "/weightd/hmoe-weightd", "decode": b + "/decode_worker/hmoe-decode-worker",
            "router": b + "/router/hmoe-router", "hmoe": b + "/tools/hmoe",
            "tokenize": b + "/tools/hmoe-tokenize", "make_model": b + "/tools/hmoe-make-model"}
    shutil.rmtree(args.work_dir, ignore_errors=True)
    os.makedirs(args.work_dir)
    model = os.path.join(args.work_dir, "tiny")
    subprocess.run([bins["make_model"], "--preset", "tiny", "--out", model], check=True,
                   capture_output=True)
    thinking = os.path.join(args.work_dir, "thinking.jinja")
    with open(thinking, "w") as f:
        f.write("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                "<｜User｜>{{ m['content'] }}{% else %}<｜Assistant｜>{{ m['content'] }}"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n"
                "{% endif %}")
    bos = "<｜begin▁of▁sentence｜>"

    failures = []

    def check(cond, what):
        print(("ok    " if cond else "FAIL  ") + what)
        if not cond:
            failures.append(what)

    def grpc_text(stack, rendered, max_new):
        ids = subprocess.run([bins["tokenize"], "--model", model], input=json.dumps(rendered) + "\n",
                             capture_output=True, text=True, check=True).stdout.split()
        r = subprocess.run([bins["hmoe"], "generate", "--addr", "127.0.0.1:%d" % stack.grpc_port,
                            "--prompt-ids", ",".join(ids), "--max-new-tokens", str(max_new),
                            "--ignore-eos"], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError("hmoe generate failed: " + r.stderr)
        return r.stdout[:-1] if r.stdout.endswith("\n") else r.stdout

    for template in ["model", "thinking"]:
        work = os.path.join(args.work_dir, template)
        os.makedirs(work)
        flags = ["--chat-template=" + thinking] if template == "thinking" else []
        stack = Stack(bins, model, work, flags)
        try:
            client = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % stack.http_port,
                                   api_key="unused", max_retries=0)
            messages = [{"role": "user", "content": "Tell me about the fox."}]
            kw = dict(model="tiny", messages=messages, max_tokens=12, temperature=0,
                      extra_body={"ignore_eos": True})
            if template == "model":
                models = client.models.list()
                check([m.id for m in models.data] == ["tiny"], "models.list() lists 'tiny'")

                chat = client.chat.completions.create(**kw)
                text = chat.choices[0].message.content
                check(isinstance(text, str) and len(text) > 0, "chat: non-empty content")
                check(chat.choices[0].finish_reason == "length", "chat: finish_reason length")
                check(chat.usage.completion_tokens == 12, "chat: usage.completion_tokens 12")
                rendered = bos + "<｜User｜>" + messages[0]["content"] + "<｜Assistant｜>"
                check(text == grpc_text(stack, rendered, 12),
                      "chat: greedy HTTP output equals gRPC's for the rendered prompt")

                stream = client.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kw)
                parts, usage, finish = [], None, None
                for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    for c in chunk.choices:
                        if c.delta.content:
                            parts.append(c.delta.content)
                        if c.finish_reason:
                            finish = c.finish_reason
                check("".join(parts) == text, "chat stream: the deltas add up to the answer")
                check(finish == "length", "chat stream: finish_reason length")
                check(usage is not None and usage.completion_tokens == 12,
                      "chat stream: include_usage chunk")

                comp = client.completions.create(model="tiny", prompt="The quick brown fox",
                                                 max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True})
                check(isinstance(comp.choices[0].text, str) and comp.usage.completion_tokens == 8,
                      "completions: 8 tokens of text")
                streamed = "".join(c.choices[0].text for c in client.completions.create(
                    model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0,
                    stream=True, extra_body={"ignore_eos": True}) if c.choices)
                check(streamed == comp.choices[0].text, "completions stream equals non-stream")

                check_metrics(stack, client, kw, check)
                check_disconnect(stack, check)

                try:
                    client.chat.completions.create(model="tiny", messages=messages, n=2)
                    check(False, "n=2 raises BadRequestError")
                except openai.BadRequestError as e:
                    check(e.status_code == 400 and "n" == e.body.get("param"),
                          "n=2 raises BadRequestError (param n)")
                try:
                    client.chat.completions.create(model="nope", messages=messages)
                    check(False, "unknown model raises NotFoundError")
                except openai.NotFoundError as e:
                    check(e.status_code == 404, "unknown model raises NotFoundError")
            else:
                chat = client.chat.completions.create(**kw)
                msg = chat.choices[0].message
                reasoning = getattr(msg, "reasoning_content", None)
                if reasoning is None and msg.model_extra:
                    reasoning = msg.model_extra.get("reasoning_content")
                rendered = (bos + "<｜User｜>" + messages[0]["content"] +
                            "<｜Assistant｜><think>\n")
                expected = grpc_text(stack, rendered, 12)
                # The model never writes </think>: the whole answer is the thought.
                check(len(expected) > 0 and reasoning == expected and msg.content == "",
                      "thinking template: reasoning_content is the generation, content empty")
                r_parts, c_parts = [], []
                for chunk in client.chat.completions.create(stream=True, **kw):
                    for c in chunk.choices:
                        extra = c.delta.model_extra or {}
                        rc = getattr(c.delta, "reasoning_content", None) or extra.get(
                            "reasoning_content")
                        if rc:
                            r_parts.append(rc)
                        if c.delta.content:
                            c_parts.append(c.delta.content)
                check("".join(r_parts) == expected and not c_parts,
                      "thinking template stream: reasoning_content deltas, no content")
        except Exception as e:  # a crash of the service is a failure with its logs
            failures.append("%s: %r" % (template, e))
            print("FAIL  %s: %r\n%s" % (template, e, stack.logs()))
        finally:
            stack.stop()

    if failures:
        print("%d failure(s)" % len(failures))
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
