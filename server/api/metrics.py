"""Prometheus metrics for one app, on its own `CollectorRegistry` (several apps, e.g. in
tests, never share counters). Filled from finished `RequestRecord`s; engine gauges and the
cancellation count are read from the engine at scrape time, so /metrics and /health never
disagree (a non-streamed disconnect's record can close before its cancellation lands).
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lockstep.server.api.request_record import RequestRecord

OTHER_ENDPOINT = "other"  # unknown paths share one label value: no unbounded label sets
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
TOKENS_PER_SECOND_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60)
ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PASS_SECONDS_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1)
PASS_KINDS = ("deterministic", "plain")  # a pass with any deterministic row runs canonical forms


class Metrics:
    def __init__(self, endpoints: set[str] = frozenset()):
        self.endpoints = set(endpoints)
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("lockstep_http_requests", "HTTP requests by endpoint", ["endpoint"], registry=r)
        self.errors = Counter("lockstep_http_errors", "HTTP error responses by endpoint and status",
                              ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("lockstep_prompt_tokens", "Prompt tokens processed", registry=r)
        self.completion_tokens = Counter("lockstep_completion_tokens", "Completion tokens generated", registry=r)
        self.ttft = Histogram("lockstep_time_to_first_token_seconds", "Time from request arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.decode_rate = Histogram("lockstep_decode_tokens_per_second", "Per-request decode rate after the "
                                     "first token", buckets=TOKENS_PER_SECOND_BUCKETS, registry=r)
        self.deterministic = Counter("lockstep_deterministic_requests", "Requests served in deterministic mode",
                                     registry=r)
        self.drafted = Counter("lockstep_speculative_drafted_tokens", "Speculative tokens drafted", registry=r)
        self.accepted = Counter("lockstep_speculative_accepted_tokens", "Speculative tokens accepted",
                                registry=r)
        self.inter_token = Histogram("lockstep_inter_token_latency_seconds", "Seconds per token between "
                                     "a request's deltas", buckets=ITL_BUCKETS, registry=r)
        self.queue_time = Histogram("lockstep_queue_time_seconds", "Time from arrival to admission by the "
                                    "engine", buckets=QUEUE_BUCKETS, registry=r)
        self.pass_rows = Histogram("lockstep_forward_pass_rows", "Rows per batched decode pass",
                                   buckets=ROWS_BUCKETS, registry=r)
        self.pass_requests = Histogram("lockstep_forward_pass_requests", "Requests sharing a decode pass",
                                       buckets=ROWS_BUCKETS, registry=r)
        self.pass_seconds = Histogram("lockstep_decode_pass_seconds", "Seconds a decode pass takes on the engine "
                                      "thread (with decoding ahead, the step its requests wait for), by kind",
                                      ["kind"], buckets=PASS_SECONDS_BUCKETS, registry=r)
        for kind in PASS_KINDS:  # both series from the start (a scrape reads 0, not nothing)
            self.pass_seconds.labels(kind)
        self.prefill_requests = Histogram("lockstep_prefill_pass_requests", "Requests whose prompt chunks "
                                          "shared a prefill pass", buckets=ROWS_BUCKETS, registry=r)
        self.queue_depth = Gauge("lockstep_queue_depth", "Requests waiting for a generation slot", registry=r)
        self.active = Gauge("lockstep_active_requests", "Requests being generated", registry=r)

    def watch_engine(self, engine) -> None:
        self.queue_depth.set_function(lambda: engine.counts()["waiting"])
        self.active.set_function(lambda: engine.counts()["active"])
        self.registry.register(_EngineCancellations(engine))
        self.registry.register(_DecodeAhead(engine))
        engine.observers.append(self)

    def watch_pool(self, pool) -> None:
        """Several models (server/api/model_pool.py): the gauges and the cancellation count summed
        over the loaded engines (the unloaded ones' cancellations kept), each engine observed from
        its load on, and each model's state and guarantee."""
        self.queue_depth.set_function(lambda: pool.counts()["waiting"])
        self.active.set_function(lambda: pool.counts()["active"])
        self.registry.register(_EngineCancellations(pool))
        self.registry.register(_DecodeAhead(pool))
        pool.on_load.append(lambda service: service.engine.observers.append(self))
        self.registry.register(_ModelStates(pool))

    def watch_startup(self, startup, guarantee) -> None:
        """Startup phases (`startup()`: /v1/models' startup object, whose phases_s and compile_s
        map phase -> seconds, the proofs' too once they ran) and where the guarantee stands (a
        GuaranteeState)."""
        self.registry.register(_Startup(startup, guarantee))

    def on_pass(self, rows: int, requests: int) -> None:
        """Engine observer: one decode pass ran (called on the engine thread)."""
        self.pass_rows.observe(rows)
        self.pass_requests.observe(requests)

    def on_pass_seconds(self, seconds: float, deterministic: bool) -> None:
        """Engine observer: a decode pass's time, deterministic (canonical forms) or plain."""
        self.pass_seconds.labels(PASS_KINDS[0] if deterministic else PASS_KINDS[1]).observe(seconds)

    def on_prefill(self, rows: int, requests: int) -> None:
        """Engine observer: prompt chunks of several requests shared one pass."""
        self.prefill_requests.observe(requests)

    def on_admit(self, waited_seconds: float) -> None:
        self.queue_time.observe(waited_seconds)

    def __call__(self, record: RequestRecord) -> None:
        """Request sink: count one finished request."""
        endpoint = record.path if record.path in self.endpoints else OTHER_ENDPOINT
        self.requests.labels(endpoint).inc()
        if record.status is not None and record.status >= 400:
            self.errors.labels(endpoint, str(record.status)).inc()
        if record.prompt_tokens is None:
            return  # nothing was generated
        self.prompt_tokens.inc(record.prompt_tokens)
        self.completion_tokens.inc(record.completion_tokens or 0)
        report = record.report
        if record.deterministic or (report is not None and report.deterministic):
            self.deterministic.inc()
        if record.first_token_at is not None:
            self.ttft.observe(record.first_token_at - record.started)
            decoded = (record.completion_tokens or 0) - 1
            elapsed = (record.finished or record.first_token_at) - record.first_token_at
            if decoded > 0 and elapsed > 0:
                self.decode_rate.observe(decoded / elapsed)
        for gap in record.token_gaps:
            self.inter_token.observe(gap)
        if report is not None:
            self.drafted.inc(report.drafted_tokens or 0)
            self.accepted.inc(report.accepted_tokens or 0)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCancellations:
    """`lockstep_cancelled_requests_total`: the engine's own count (or a model pool's, over its
    engines), the one /health reports."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return [CounterMetricFamily("lockstep_cancelled_requests", CANCELLED_HELP)]

    def collect(self):
        yield CounterMetricFamily("lockstep_cancelled_requests", CANCELLED_HELP,
                                  value=self.engine.counts()["cancelled"])


CANCELLED_HELP = "Generations stopped because the client left"


class _DecodeAhead:
    """`lockstep_decode_ahead_passes_total{outcome}`: decode passes built before the pass
    ahead of them reached the host, and of those the ones taken over and dropped (the model
    runner's counts, read at scrape time). Taken ÷ built says how much of a stream's host work
    overlapped the device's."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        family = CounterMetricFamily("lockstep_decode_ahead_passes", "Decode passes built ahead, by what became "
                                     "of them", labels=["outcome"])
        for outcome, count in self.engine.decode_ahead_counts().items():
            family.add_metric([outcome], count)
        yield family


class _Startup:
    """`lockstep_startup_phase_seconds{phase}`, `lockstep_startup_compile_seconds{phase}` (the
    custom kernels' compile time in it) and `lockstep_guarantee_state{state}` (1 for the current
    state), read at every scrape: the proofs may end after serving started."""

    def __init__(self, startup, guarantee):
        self.startup, self.guarantee = startup, guarantee

    def describe(self):
        return []  # collected at scrape time only (values change after registration)

    def collect(self):
        from lockstep.server.engine.guarantee.guarantee_state import STATES

        startup = self.startup()
        for name, key, what in (("lockstep_startup_phase_seconds", "phases_s", "Seconds each startup phase took"),
                                ("lockstep_startup_compile_seconds", "compile_s",
                                 "Custom-kernel compile seconds in each startup phase (summed over threads)")):
            family = GaugeMetricFamily(name, what, labels=["phase"])
            for phase, seconds in startup.get(key, {}).items():
                family.add_metric([phase], seconds)
            yield family
        state = GaugeMetricFamily("lockstep_guarantee_state", "The determinism guarantee's state (1: current)",
                                  labels=["state"])
        for name in STATES:
            state.add_metric([name], 1.0 if self.guarantee.state == name else 0.0)
        yield state


class _ModelStates:
    """`lockstep_model_state{model,state}` (loaded, loading, unloaded) and
    `lockstep_model_guarantee_state{model,state}` (none while unloaded): 1 for the current one."""

    def __init__(self, pool):
        self.pool = pool

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        from lockstep.server.api.model_pool import STATES as MODEL_STATES
        from lockstep.server.engine.guarantee.guarantee_state import STATES

        states = GaugeMetricFamily("lockstep_model_state", "Each model's state (1: current)",
                                   labels=["model", "state"])
        guarantees = GaugeMetricFamily("lockstep_model_guarantee_state", "Each loaded model's determinism "
                                       "guarantee state (1: current)", labels=["model", "state"])
        for model in self.pool.models.values():
            status = self.pool.status(model)
            for name in MODEL_STATES:
                states.add_metric([model.name, name], 1.0 if status["state"] == name else 0.0)
            for name in STATES:
                guarantees.add_metric([model.name, name], 1.0 if status["guarantee"] == name else 0.0)
        yield states
        yield guarantees
