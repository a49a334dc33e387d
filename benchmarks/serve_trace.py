"""Timestamps of a served request's path, for profile_serve.py: where TTFT and TPOT go.

Loaded in the server's processes (frontend and engine core) through a sitecustomize.py that
profile_serve.py writes (PYTHONPATH), so the engine carries no tracing code. Each process
appends JSON lines to $MINIVLLM_SERVE_TRACE.<pid>, times from time.monotonic() (one clock
for every process on Linux):

- frontend: {"ev": "http", "id", "t"}: the completion handler began (request parsed);
  {"ev": "sent", "id", "t0", "t"}: AsyncLLM.add_request began (t0) and sent it (t);
  {"ev": "first", "id", "t"}: its first token's output reached the output processor.
- engine core: {"ev": "recv", "id", "t"}: the input thread decoded it;
  {"ev": "add", "id", "t"}: the busy loop took it in (between steps);
  {"ev": "step", "t0", "ts", "tx", "t", "tok", "reqs", "new", "first"}: one step: start,
  scheduled, executed, end; tokens and requests scheduled; ids scheduled for the first
  time; ids that got their first token.
"""

from __future__ import annotations

import contextvars
import json
import os
import statistics
import time

_http_start: contextvars.ContextVar[float | None] = contextvars.ContextVar("http", default=None)


def _writer():
    path = f"{os.environ['MINIVLLM_SERVE_TRACE']}.{os.getpid()}"
    f = open(path, "a", buffering=1)

    def write(**record) -> None:
        f.write(json.dumps(record) + "\n")

    return write


def install() -> None:
    """Patch the frontend and engine core classes (imported lazily: either process)."""
    write = _writer()
    _patch_frontend(write)
    _patch_core(write)


def _patch_frontend(write) -> None:
    from minivllm.engine import async_llm, output_processor
    from minivllm.entrypoints.openai import serving_completion

    handler = serving_completion.OpenAIServingCompletion.create_completion

    async def create_completion(self, request, raw_request=None):
        _http_start.set(time.monotonic())
        return await handler(self, request, raw_request)

    serving_completion.OpenAIServingCompletion.create_completion = create_completion

    add = async_llm.AsyncLLM.add_request

    async def add_request(self, request_id, *args, **kwargs):
        t0 = time.monotonic()
        queue = await add(self, request_id, *args, **kwargs)
        write(ev="sent", id=request_id, http=_http_start.get(), t0=t0, t=time.monotonic())
        return queue

    async_llm.AsyncLLM.add_request = add_request

    process = output_processor.OutputProcessor.process_outputs
    seen: set[str] = set()

    def process_outputs(self, outputs):
        now = time.monotonic()
        for out in outputs:
            if out.new_token_ids and out.request_id not in seen:
                seen.add(out.request_id)
                write(ev="first", id=out.request_id, t=now)
        return process(self, outputs)

    output_processor.OutputProcessor.process_outputs = process_outputs


def _patch_core(write) -> None:
    from minivllm.engine import core, core_proc

    add = core.EngineCore.add_request

    def add_request(self, request):
        write(ev="add", id=request.request_id, t=time.monotonic())
        return add(self, request)

    core.EngineCore.add_request = add_request

    def step(self):
        sched = self.scheduler
        if not sched.has_unfinished_requests():
            return step.original(self)
        t0 = time.monotonic()
        so = sched.schedule()
        ts = time.monotonic()
        runner_output = self.executor.execute_model(so)
        tx = time.monotonic()
        outputs = sched.update_from_output(so, runner_output)
        first = [
            o.request_id
            for o in outputs.outputs
            if o.new_token_ids and len(sched_requests_tokens(self, o)) == len(o.new_token_ids)
        ]
        write(
            ev="step",
            t0=t0,
            ts=ts,
            tx=tx,
            t=time.monotonic(),
            tok=so.total_num_scheduled_tokens,
            reqs=len(so.num_scheduled_tokens),
            new=[r.req_id for r in so.scheduled_new_reqs],
            first=first,
        )
        return outputs

    step.original = core.EngineCore.step
    core.EngineCore.step = step

    put_orig = core_proc.EngineCoreProc.__init__

    def init(self, *args, **kwargs):
        put_orig(self, *args, **kwargs)
        queue_put = self.input_queue.put

        def put(item, *a, **k):
            request_type, payload = item
            if getattr(payload, "request_id", None) is not None:
                write(ev="recv", id=payload.request_id, t=time.monotonic())
            return queue_put(item, *a, **k)

        self.input_queue.put = put

    core_proc.EngineCoreProc.__init__ = init


def sched_requests_tokens(engine_core, output) -> list[int]:
    """The output ids the request has so far (all of them if it just finished)."""
    request = engine_core.scheduler.requests.get(output.request_id)
    if request is None:  # finished in this step: a one-token request
        return output.new_token_ids
    return request.output_token_ids


def summarize(prefix: str, client: dict | None = None) -> str:
    """A markdown breakdown of TTFT and of step time from the trace files."""
    folder, base = os.path.split(prefix)
    records = []
    for name in os.listdir(folder or "."):
        if name.startswith(base + "."):
            with open(os.path.join(folder, name)) as f:
                records += [json.loads(line) for line in f]
    by = {}
    for r in records:
        if "id" in r:
            by.setdefault(r["id"], {})[r["ev"]] = r
    steps = sorted((r for r in records if r["ev"] == "step"), key=lambda r: r["t0"])
    sched_step, first_step = {}, {}
    for s in steps:
        for rid in s["new"]:
            sched_step.setdefault(rid, s)
        for rid in s["first"]:
            first_step.setdefault(rid, s)
    parts = {k: [] for k in ("http", "front", "ipc", "wait", "queued", "step", "out", "total")}
    for rid, ev in by.items():
        if not all(k in ev for k in ("sent", "recv", "add", "first")):
            continue
        if rid not in sched_step or rid not in first_step:
            continue
        sent, s0, s1 = ev["sent"], sched_step[rid], first_step[rid]
        http = sent["http"] if sent["http"] is not None else sent["t0"]
        parts["http"].append(sent["t0"] - http)  # handler start -> AsyncLLM.add_request
        parts["front"].append(sent["t"] - sent["t0"])  # tokenize, validate, send
        parts["ipc"].append(ev["recv"]["t"] - sent["t"])
        parts["wait"].append(ev["add"]["t"] - ev["recv"]["t"])  # the step in progress
        parts["queued"].append(s0["t0"] - ev["add"]["t"])  # admitted in a later step?
        parts["step"].append(s1["t"] - s0["t0"])  # its step(s) until the first token
        parts["out"].append(ev["first"]["t"] - s1["t"])  # to the frontend's processor
        parts["total"].append(ev["first"]["t"] - http)
    lines = ["| TTFT part (server side) | median ms | mean ms |", "| --- | ---: | ---: |"]
    names = {
        "http": "HTTP handler start -> AsyncLLM.add_request",
        "front": "tokenize + send to the core",
        "ipc": "ZeroMQ to the core's input thread",
        "wait": "waiting for the step in progress to end",
        "queued": "admitted -> scheduled (later step)",
        "step": "its first step(s), start to end",
        "out": "step end -> frontend output processor",
        "total": "sum (handler start -> first token in the frontend)",
    }
    for key, values in parts.items():
        if values:
            lines.append(
                f"| {names[key]} | {1000 * statistics.median(values):.1f} | "
                f"{1000 * statistics.fmean(values):.1f} |"
            )
    if client:
        lines.append(
            f"| client TTFT (bench serve) | {client['median_ttft_ms']:.1f} | "
            f"{client['mean_ttft_ms']:.1f} |"
        )
    lines.append(f"\n{len(parts['total'])} requests traced.\n")
    if steps:
        busy = [s for s in steps if s["reqs"]]
        gaps = [b["t0"] - a["t"] for a, b in zip(busy, busy[1:])]
        mixed = [s for s in busy if s["new"]]
        pure = [s for s in busy if not s["new"]]
        lines += ["| steps | n | median ms | schedule | execute | update | gap before next |"]
        lines += ["| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for label, group in (("all", busy), ("with a new prompt", mixed), ("decode only", pure)):
            if not group:
                continue

            def med(f, group=group):
                return 1000 * statistics.median([f(s) for s in group])

            lines.append(
                f"| {label} | {len(group)} | {med(lambda s: s['t'] - s['t0']):.1f} | "
                f"{med(lambda s: s['ts'] - s['t0']):.2f} | {med(lambda s: s['tx'] - s['ts']):.1f}"
                f" | {med(lambda s: s['t'] - s['tx']):.2f} | "
                f"{1000 * statistics.median(gaps) if gaps else 0:.2f} |"
            )
        lines.append(
            f"\nmedian tokens per step {statistics.median([s['tok'] for s in busy])}, "
            f"requests per step {statistics.median([s['reqs'] for s in busy])}; "
            f"core busy {sum(s['t'] - s['t0'] for s in busy):.1f} s of "
            f"{busy[-1]['t'] - busy[0]['t0']:.1f} s\n"
        )
    return "\n".join(lines)
