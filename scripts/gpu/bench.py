#!/usr/bin/env python3
"""Stdlib-only benchmark clients: llama-bench, the sfcore daemon (NDJSON over a Unix
socket) and llama-server (/completion over HTTP). Each subcommand writes one JSON file;
`report` merges them into results.json and results.md.

  bench.py llama-bench --bin DIR --model M --ngl N --out F [--dry]
  bench.py daemon --socket S --out F [--dry]
  bench.py server --port P --out F [--dry]
  bench.py report --dir D --meta F

The daemon is spoken to with the test kit's NDJSON client (tests/kit/ndjson.py, standard
library only): found in the checkout this file lies in (scripts/gpu/..), or in the kit
folder scripts/gpu/prepare.sh makes, which carries tests/kit beside this file.
"""
import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _root in (_HERE.parent.parent, _HERE):
    if (_root / "tests" / "kit" / "ndjson.py").is_file():
        sys.path.insert(0, str(_root))
        break
from tests.kit.ndjson import exchange  # noqa: E402  (the path above first)

SHORT = "The quick brown fox jumps over the lazy dog. Once upon a time"
PARA = ("In the quiet valley beyond the river, the old mill turned slowly while farmers "
        "carried grain along the dusty road, talking about the weather, the harvest, the "
        "prices at the market and the news from distant cities. ")


_uid = [int(time.time() * 1000) % 900000]
_uid_lock = threading.Lock()


def uid():
    """A distinct leading number per request, so no prompt shares more than BOS with
    what a slot holds (no prefix-cache hit distorts the prompt timings)."""
    with _uid_lock:
        _uid[0] += 7919
        return f"{_uid[0] % 900000 + 100000}"


def write_json(path, data):
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1)


def med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def say(*a):
    print(f"[{time.strftime('%H:%M:%S')}] bench:", *a, flush=True)


OPTIONS = {"runs": None}  # --runs overrides the number of runs (medians) and llama-bench -r


def cfg(dry):
    c = _cfg(dry)
    if OPTIONS["runs"]:
        c["runs"] = c["lb_r"] = OPTIONS["runs"]
    return c


def _cfg(dry):
    if dry:
        return dict(runs=1, n_gen=24, long_target=96, conc=[2], conc_gen=16, ttft_gen=1,
                    lb_p=64, lb_n=16, lb_r=1)
    return dict(runs=3, n_gen=256, long_target=500, conc=[4, 8], conc_gen=256, ttft_gen=1,
                lb_p=512, lb_n=128, lb_r=3)


# ---------------------------------------------------------------- llama-bench
def run_llama_bench(a):
    c = cfg(a.dry)
    out = {}
    for fa in ("auto", "1"):
        cmd = [os.path.join(a.bin, "llama-bench"), "-m", a.model, "-ngl", str(a.ngl),
               "-p", str(c["lb_p"]), "-n", str(c["lb_n"]), "-fa", fa, "-r", str(c["lb_r"]),
               "-o", "json"]
        say(" ".join(cmd))
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, check=False)
        sys.stderr.write(p.stderr[-4000:])
        if p.returncode != 0:
            out[f"fa_{fa}"] = {"error": f"rc={p.returncode}", "stderr": p.stderr[-1000:]}
            continue
        rows = json.loads(p.stdout)
        res = {"cmd": " ".join(cmd), "wall_s": round(time.time() - t0, 1), "reps": c["lb_r"]}
        for r in rows:
            key = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
            res[key + "_tok_s"] = med(r["samples_ts"])
            res[key + "_samples"] = [round(x, 2) for x in r["samples_ts"]]
            res["flash_attn_reported"] = r.get("flash_attn")
            res["gpu_info"] = r.get("gpu_info")
            res["backends"] = r.get("backends")
        out[f"fa_{fa}"] = res
        say(f"llama-bench fa={fa}:", {k: v for k, v in res.items() if k.endswith("tok_s")})
    write_json(a.out, out)


# ---------------------------------------------------------------- daemon client
class Daemon:
    def __init__(self, path, timeout=120):
        self.path, self.timeout = path, timeout

    def call(self, req):
        """One request on its own connection. Returns (done, t_send, t_first, t_end, lines);
        `self.text` holds the reply's text."""
        timed = exchange(self.path, req, self.timeout)
        if timed.final.get("type") == "error":
            raise RuntimeError(f"daemon error: {timed.final}")
        self.text = [timed.text]
        first = timed.arrivals[0] if timed.arrivals else None
        return timed.final, timed.started, first, timed.ended, timed.tokens

    def gen(self, prompt, max_tokens, spec, tag=None):
        req = {"op": "generate", "prompt": prompt, "max_tokens": max_tokens,
               "temperature": 0, "stream": True, "speculative": spec}
        if tag is not None:
            req["id"] = tag
        done, t0, first, end, _lines = self.call(req)
        u, tm = done["usage"], done["timings"]
        n = u["completion_tokens"]
        r = {"completion_tokens": n, "prompt_tokens": u["prompt_tokens"],
             "cached_tokens": u["cached_tokens"], "finish_reason": done["finish_reason"],
             "drafted": u.get("drafted_tokens", 0), "accepted": u.get("accepted_tokens", 0),
             "srv_decode_tok_s": tm["decode_tok_s"], "srv_first_token_ms": tm["first_token_ms"],
             "srv_prompt_ms": tm["prompt_ms"], "srv_total_ms": tm["total_ms"],
             "t0": t0, "t_end": end,
             "client_ttft_ms": (first - t0) * 1000 if first else None,
             "client_total_ms": (end - t0) * 1000, "text": "".join(self.text)}
        if first and n > 1 and end > first:
            r["client_decode_tok_s"] = (n - 1) / (end - first)
        return r

    def tokens(self, text):
        done, *_ = self.call({"op": "tokenize", "text": text, "add_special": True})
        return len(done["tokens"])


# ---------------------------------------------------------------- llama-server client
class Server:
    def __init__(self, port, timeout=120):
        self.port, self.timeout = port, timeout

    def gen(self, prompt, max_tokens, spec=False, tag=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "cache_prompt": True,
                           "temperature": 0, "stream": True})
        t0 = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"server HTTP {resp.status}: {resp.read()[:300]!r}")
        first = None
        n = 0
        final = None
        text = []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            msg = json.loads(line[6:])
            now = time.perf_counter()
            if msg.get("stop"):
                final = msg
                break
            if first is None:
                first = now
            n += 1
            text.append(msg.get("content", ""))
        end = time.perf_counter()
        text.append(final.get("content", "") if final else "")
        conn.close()
        if final is None:
            raise RuntimeError("server stream ended without a final message")
        tm = final.get("timings", {})
        ntok = tm.get("predicted_n", final.get("tokens_predicted", n))
        r = {"completion_tokens": ntok, "prompt_tokens": final.get("tokens_evaluated"),
             "cached_tokens": tm.get("cache_n"), "finish_reason": final.get("stop_type"),
             "srv_decode_tok_s": tm.get("predicted_per_second"),
             "srv_prompt_ms": tm.get("prompt_ms"), "srv_first_token_ms": None,
             "t0": t0, "t_end": end, "stream_chunks": n,
             "client_ttft_ms": (first - t0) * 1000 if first else None,
             "client_total_ms": (end - t0) * 1000, "text": "".join(text)}
        if first and ntok > 1 and end > first:
            r["client_decode_tok_s"] = (ntok - 1) / (end - first)
        return r

    def tokens(self, text):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        conn.request("POST", "/tokenize", json.dumps({"content": text, "add_special": True}),
                     {"Content-Type": "application/json"})
        n = len(json.loads(conn.getresponse().read())["tokens"])
        conn.close()
        return n


def long_prompt(target, count_tokens):
    reps = max(1, target // 40)
    text = PARA * reps
    if count_tokens:
        n = count_tokens(text)
        reps = max(1, round(reps * (target - 8) / n))
        text = PARA * reps
    return text


def single(client, c, spec, prompt_long, label):
    """Single client: decode over n_gen tokens, TTFT short and long; medians of runs."""
    res = {}
    decode = [client.gen(f"{uid()}. {SHORT}", c["n_gen"], spec) for i in range(c["runs"])]
    res["decode_runs"] = [{k: (round(v, 3) if isinstance(v, float) else v)
                           for k, v in r.items() if k not in ("t0", "t_end", "text")}
                          for r in decode]
    res["sample_text"] = decode[0]["text"][:300]
    for k in ("srv_decode_tok_s", "client_decode_tok_s", "completion_tokens"):
        res[k] = med([r.get(k) for r in decode])
    res["client_e2e_tok_s"] = med([r["completion_tokens"] / (r["client_total_ms"] / 1000)
                                   for r in decode])
    for name, base in (("short", SHORT), ("long", prompt_long)):
        rr = [client.gen(f"{uid()}. {base}", c["ttft_gen"], spec)
              for i in range(c["runs"])]
        # max_tokens 1: the client's wall time to the done line is its time to first token
        res[f"ttft_{name}_client_ms"] = med([r["client_total_ms"] for r in rr])
        res[f"ttft_{name}_srv_ms"] = med([r["srv_first_token_ms"] for r in rr])
        res[f"prompt_{name}_srv_ms"] = med([r["srv_prompt_ms"] for r in rr])
        res[f"prompt_{name}_tokens"] = med([r["prompt_tokens"] for r in rr])
        res[f"prompt_{name}_cached"] = med([r["cached_tokens"] for r in rr])
    say(label, {k: v for k, v in res.items() if k not in ("decode_runs", "sample_text")})
    return res


def concurrent(client, c, n_clients, spec, label):
    aggs, per = [], []
    for rep in range(c["runs"]):
        barrier = threading.Barrier(n_clients)
        results = [None] * n_clients
        errors = []

        def work(i, rep=rep, barrier=barrier, results=results, errors=errors):
            try:
                barrier.wait()
                results[i] = client.gen(f"{uid()}. {SHORT}", c["conc_gen"], spec)
            except Exception as exc:
                errors.append(repr(exc))

        th = [threading.Thread(target=work, args=(i,)) for i in range(n_clients)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        if errors:
            raise RuntimeError(f"{label}: {errors[:3]}")
        t0 = min(r["t0"] for r in results)
        t1 = max(r["t_end"] for r in results)
        toks = sum(r["completion_tokens"] for r in results)
        aggs.append(toks / (t1 - t0))
        per.append(statistics.mean(r["srv_decode_tok_s"] or 0 for r in results))
    res = {"clients": n_clients, "agg_tok_s": med(aggs), "agg_runs": [round(x, 1) for x in aggs],
           "mean_per_request_srv_decode_tok_s": med(per),
           "tokens_per_request": c["conc_gen"]}
    say(label, res)
    return res


def bench_side(client, a, side, count_tokens=None):
    c = cfg(a.dry)
    out = {"side": side, "dry": a.dry, "runs": c["runs"]}
    lp = long_prompt(c["long_target"], count_tokens)
    # warm-up (CUDA graphs, allocations)
    out["warm_text"] = client.gen(f"Warm up. {SHORT}", 16, False)["text"]
    client.gen(f"Warm up two. {lp}", 4, False)
    out["single_spec_off"] = single(client, c, False, lp, f"{side}-single-specoff")
    if side == "daemon":
        out["single_spec_on"] = single(client, c, True, lp, f"{side}-single-specon")
    for n in c["conc"]:
        out[f"conc{n}"] = concurrent(client, c, n, False, f"{side}-conc{n}")
    if side == "daemon":
        n = c["conc"][-1]
        out[f"conc{n}_spec_on"] = concurrent(client, c, n, True, f"{side}-conc{n}-specon")
    write_json(a.out, out)


# ---------------------------------------------------------------- readiness
def wait_daemon(a):
    """Poll `health` until ok, then save `info` to --out and print its key facts."""
    d = Daemon(a.socket, 10)
    t_end = time.time() + a.timeout
    last = None
    while time.time() < t_end:
        try:
            h, *_ = d.call({"op": "health"})
            last = h
            if h.get("status") == "ok":
                info, *_ = d.call({"op": "info"})
                write_json(a.out, info)
                m, c = info["model"], info["config"]
                say(f"daemon ready: model {m['name']} arch {m['architecture']} n_params "
                    f"{m['n_params']} n_vocab {m['n_vocab']} size {m['size_bytes']}; gpu_layers "
                    f"{c['gpu_layers']} flash_attn {c['flash_attn']} slots {c['slots']} n_ctx "
                    f"{c['n_ctx']} threads {c['threads']}; versions {info.get('versions')}")
                say("daemon system_info:", info.get("system_info"))
                return 0
        except (OSError, RuntimeError, ValueError) as exc:
            last = repr(exc)
        time.sleep(0.5)
    say("daemon not ready:", last)
    return 1


def wait_server(a):
    t_end = time.time() + a.timeout
    last = None
    while time.time() < t_end:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=5)
            conn.request("GET", "/health")
            r = conn.getresponse()
            body = r.read()
            last = (r.status, body[:200])
            if r.status == 200:
                conn.request("GET", "/props")
                props = json.loads(conn.getresponse().read() or b"{}")
                say("server ready:", {k: props.get(k) for k in ("total_slots", "model_path",
                                                                  "build_info")})
                return 0
        except (OSError, ValueError) as exc:
            last = repr(exc)
        time.sleep(0.5)
    say("server not ready:", last)
    return 1


# ---------------------------------------------------------------- report
def report(a):
    def load(name):
        p = os.path.join(a.dir, name)
        try:
            with open(p) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    lb, dm, sv = load("llama_bench.json"), load("daemon.json"), load("server.json")
    st = load("stress.json")
    meta = load(os.path.basename(a.meta)) if a.meta else None
    res = {"meta": meta, "stress": st, "llama_bench": lb, "daemon": dm, "llama_server": sv,
           "ratios": {}}
    R = res["ratios"]

    def g(d, *ks):
        for k in ks:
            if not isinstance(d, dict) or k not in d:
                return None
            d = d[k]
        return d

    def ratio(name, x, y):
        R[name] = round(x / y, 3) if x and y else None

    tg = g(lb, "fa_auto", f"tg{cfg(bool(g(dm, 'dry')))['lb_n']}_tok_s")
    tg_fa = g(lb, "fa_1", f"tg{cfg(bool(g(dm, 'dry')))['lb_n']}_tok_s")
    d1 = g(dm, "single_spec_off", "srv_decode_tok_s")
    s1 = g(sv, "single_spec_off", "srv_decode_tok_s")
    ratio("daemon_vs_server_decode_single", d1, s1)
    ratio("daemon_vs_server_decode_single_client_side",
          g(dm, "single_spec_off", "client_decode_tok_s"),
          g(sv, "single_spec_off", "client_decode_tok_s"))
    ratio("daemon_vs_llamabench_tg_fa_auto", d1, tg)
    ratio("daemon_vs_llamabench_tg_fa_1", d1, tg_fa)
    ratio("server_vs_llamabench_tg_fa_auto", s1, tg)
    ratio("daemon_spec_on_vs_server_decode_single",
          g(dm, "single_spec_on", "srv_decode_tok_s"), s1)
    for nm in ("short", "long"):
        ratio(f"daemon_vs_server_ttft_{nm}_client",
              g(dm, "single_spec_off", f"ttft_{nm}_client_ms"),
              g(sv, "single_spec_off", f"ttft_{nm}_client_ms"))
    for k in sorted(set((dm or {}).keys()) & set((sv or {}).keys())):
        if k.startswith("conc"):
            ratio(f"daemon_vs_server_{k}_agg", g(dm, k, "agg_tok_s"), g(sv, k, "agg_tok_s"))
    R["same_greedy_text_16_tokens"] = (g(dm, "warm_text") == g(sv, "warm_text")
                                       if dm and sv else None)
    write_json(os.path.join(a.dir, "results.json"), res)

    rows = []

    def row(what, d, s, b=None, unit=""):
        f = lambda v: "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))  # noqa: E731
        rd = f"{d / s:.2f}" if d and s else "-"
        rows.append(f"| {what} | {f(d)} | {f(s)} | {f(b)} | {rd} |")

    so, sn = "single_spec_off", "single_spec_on"
    row("decode tok/s, 1 client (server-side timings)", g(dm, so, "srv_decode_tok_s"),
        g(sv, so, "srv_decode_tok_s"), tg)
    row("decode tok/s, 1 client (client wall, first->last token)",
        g(dm, so, "client_decode_tok_s"), g(sv, so, "client_decode_tok_s"), tg)
    row("decode tok/s, 1 client, daemon speculative on (srv)", g(dm, sn, "srv_decode_tok_s"),
        g(sv, so, "srv_decode_tok_s"), tg)
    for nm in ("short", "long"):
        row(f"first token ms, {nm} prompt ({g(dm, so, f'prompt_{nm}_tokens')} tok), client",
            g(dm, so, f"ttft_{nm}_client_ms"), g(sv, so, f"ttft_{nm}_client_ms"))
        row(f"prompt eval ms, {nm} prompt, server-side", g(dm, so, f"prompt_{nm}_srv_ms"),
            g(sv, so, f"prompt_{nm}_srv_ms"))
    for k in sorted((dm or {}).keys()):
        if k.startswith("conc"):
            spec = " (daemon spec on)" if "spec" in k else ""
            row(f"aggregate tok/s, {g(dm, k, 'clients')} clients{spec}",
                g(dm, k, "agg_tok_s"), g(sv, k.replace("_spec_on", ""), "agg_tok_s"))
    def tok_s(side):
        return json.dumps({k: v for k, v in (g(lb, side) or {}).items() if k.endswith("tok_s")})

    md = ["# sfcore daemon vs llama-server vs llama-bench (random-weight Gemma 3 270M Q4_K_M)", ""]
    if meta:
        md += [f"- {k}: {v}" for k, v in meta.items()]
        md.append("")
    md += stress_lines(st)
    md += [f"llama-bench (median of -r {g(lb, 'fa_auto', 'reps')}): "
           f"fa=auto {tok_s('fa_auto')}, fa=1 {tok_s('fa_1')}", "",
           f"daemon/llama-server: median of {g(dm, 'runs')}/{g(sv, 'runs')} runs per measure; "
           "random weights: greedy output repeats n-grams, so the daemon's speculative "
           "(n-gram) figures are an upper bound", "",
           "| measure (median of runs) | daemon | llama-server | llama-bench tg | daemon/server |",
           "|---|---|---|---|---|", *rows, "", "ratios: " + json.dumps(R)]
    with open(os.path.join(a.dir, "results.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md))


def stress_lines(st):
    """The stress step's verdict for results.md (spec_stress.py's JSON)."""
    if not st:
        return []
    verdict = "PASSED" if st.get("ok") else "FAILED"
    lines = [f"## stress: {verdict}", "",
             f"- {st.get('clients')} concurrent greedy clients, speculation as configured, "
             f"{st.get('seconds')} s, max_tokens {st.get('max_tokens')}, prompt lengths "
             f"{st.get('lengths')}",
             f"- requests {st.get('requests')}, done {st.get('done')}, errors "
             f"{st.get('errors')} {json.dumps(st.get('outcomes'))}; "
             f"{st.get('completion_tokens')} tokens, {st.get('aggregate_tok_s')} tok/s",
             f"- daemon alive after: {st.get('daemon_alive')}, health: {st.get('health_after')}",
             f"- placement: {st.get('placement')}"]
    for length, row in (st.get("by_length") or {}).items():
        lines.append(f"- {length}: {json.dumps(row)}")
    for line in (st.get("daemon_log_fatal") or [])[:8]:
        lines.append(f"- daemon log: `{line}`")
    for failure in (st.get("failures") or [])[:3]:
        lines.append(f"- failure: {json.dumps(failure)}")
    return [*lines, ""]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["llama-bench", "daemon", "server", "report",
                                    "wait-daemon", "wait-server"])
    p.add_argument("--bin")
    p.add_argument("--model")
    p.add_argument("--ngl", default="99")
    p.add_argument("--socket")
    p.add_argument("--port", type=int)
    p.add_argument("--out")
    p.add_argument("--dir")
    p.add_argument("--meta")
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--dry", action="store_true")
    p.add_argument("--runs", type=int)
    a = p.parse_args()
    OPTIONS["runs"] = a.runs
    if a.what == "llama-bench":
        run_llama_bench(a)
    elif a.what == "daemon":
        d = Daemon(a.socket, a.timeout)
        bench_side(d, a, "daemon", d.tokens)
    elif a.what == "server":
        sv = Server(a.port, a.timeout)
        bench_side(sv, a, "server", sv.tokens)
    elif a.what == "wait-daemon":
        sys.exit(wait_daemon(a))
    elif a.what == "wait-server":
        sys.exit(wait_server(a))
    else:
        report(a)


if __name__ == "__main__":
    main()
