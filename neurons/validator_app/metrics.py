"""The validator's Prometheus metrics, read at scrape time from what the validator already keeps (its
loop and its SQLite database), so that the loop needs no counting code of its own:

    k3_validator_round                                   the round number in progress (or last run)
    k3_validator_rounds_total                            rounds run by this process
    k3_validator_round_duration_seconds                  duration of the last round
    k3_validator_miner_score{uid,hotkey}                 the last round's score S of each miner
    k3_validator_miner_ema{uid,hotkey}                   the EMA the weights come from
    k3_validator_miner_weight{uid,hotkey}                the weight last set on chain
    k3_validator_miner_decode_tokens_per_second{uid,hotkey}, k3_validator_miner_ttft_per_1k_seconds{uid,hotkey}
    k3_validator_failures_total{uid,check}               failed checks and calls, by check (since start)
    k3_validator_audits_total{tier,result}               tier-1 audits and tier-2 canaries: passed, failed,
                                                         no_verdict (since start)
    k3_validator_weight_set_attempts_total{result}       ok or error (since start)
    k3_validator_chain_errors_total{operation}           metagraph reads and set-weights calls that failed
    k3_validator_weights_last_set_timestamp_seconds      unix time of the last successful set-weights

Counters count rows written since this process started (read incrementally, so pruning old rows
never makes them go down).
"""
from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Optional

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from neurons.base.observability import MetricsServer
from neurons.validator_app.status import status_report

log = logging.getLogger("k3.validator")


class _Tally:
    """Counts of new rows of one table, by a key built from each row; rows are read by id order."""

    def __init__(self, conn: sqlite3.Connection, table: str, columns: str, key):
        self.conn, self.table, self.columns, self.key = conn, table, columns, key
        self.counts: dict[tuple, int] = {}
        self.last_id = conn.execute(f"SELECT COALESCE(MAX(id), 0) FROM {table}").fetchone()[0]

    def update(self) -> dict[tuple, int]:
        rows = self.conn.execute(f"SELECT id, {self.columns} FROM {self.table} WHERE id > ? ORDER BY id",
                                 (self.last_id,)).fetchall()
        for row in rows:
            key = self.key(row)
            self.counts[key] = self.counts.get(key, 0) + 1
            self.last_id = row[0]
        return self.counts


def _audit_result(row) -> tuple:
    passed = row[2]
    return (str(row[1]), "no_verdict" if passed is None else ("passed" if passed else "failed"))


class ValidatorCollector:
    def __init__(self, loop):
        self.loop = loop
        db = Path(loop.store.path)
        # A read-only connection of our own: the loop's connection and transactions are left alone.
        self.conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5.0, isolation_level=None)
        self.failures = _Tally(self.conn, "failures", "uid, check_name", lambda r: (str(r[1]), r[2]))
        self.audits = _Tally(self.conn, "audits", "tier, passed", _audit_result)
        self.weights = _Tally(self.conn, "weight_attempts", "ok", lambda r: ("ok" if r[1] else "error",))

    def describe(self):
        return []  # names are known at collect time; registering must not read the database

    def collect(self):
        report = status_report(self.loop.store)
        yield GaugeMetricFamily("k3_validator_round", "The round number in progress (or last run)",
                                value=report["round"])
        rounds = CounterMetricFamily("k3_validator_rounds", "Rounds run by this process")
        rounds.add_metric([], self.loop.rounds_run)
        yield rounds
        last = getattr(self.loop, "last_report", None)
        yield GaugeMetricFamily("k3_validator_round_duration_seconds", "Duration of the last round",
                                value=getattr(last, "duration_s", None) or 0.0)
        per_miner = {
            "score": ("k3_validator_miner_score", "The last round's score S"),
            "ema": ("k3_validator_miner_ema", "EMA of the score (the weights follow EMA squared)"),
            "weight": ("k3_validator_miner_weight", "Weight last set on chain"),
            "decode_tps": ("k3_validator_miner_decode_tokens_per_second", "Measured decode speed"),
            "ttft_per_1k_s": ("k3_validator_miner_ttft_per_1k_seconds", "Measured TTFT per 1000 prompt tokens"),
        }
        for field, (name, text) in per_miner.items():
            family = GaugeMetricFamily(name, text, labels=["uid", "hotkey"])
            for miner in report["miners"]:
                if miner[field] is not None:
                    family.add_metric([str(miner["uid"]), miner["hotkey"] or ""], float(miner[field]))
            yield family
        failures = CounterMetricFamily("k3_validator_failures", "Failed checks and calls by uid and check",
                                       labels=["uid", "check"])
        for (uid, check), count in sorted(self.failures.update().items()):
            failures.add_metric([uid, check], count)
        yield failures
        audits = CounterMetricFamily("k3_validator_audits", "Audits (tier 1) and canaries (tier 2) by verdict",
                                     labels=["tier", "result"])
        counts = self.audits.update()
        for tier in ("1", "2"):
            for result in ("passed", "failed", "no_verdict"):
                audits.add_metric([tier, result], counts.get((tier, result), 0))
        yield audits
        attempts = CounterMetricFamily("k3_validator_weight_set_attempts", "set-weights attempts by result",
                                       labels=["result"])
        counts = self.weights.update()
        for result in ("ok", "error"):
            attempts.add_metric([result], counts.get((result,), 0))
        yield attempts
        chain = CounterMetricFamily("k3_validator_chain_errors", "Chain calls that failed, by operation",
                                    labels=["operation"])
        chain.add_metric(["metagraph"], self.loop.metagraph_failures)
        chain.add_metric(["set_weights"], counts.get(("error",), 0))
        yield chain
        yield GaugeMetricFamily("k3_validator_weights_last_set_timestamp_seconds",
                                "Unix time of the last successful set-weights (0: never)",
                                value=float(report["weights_set_at"] or 0.0))

    def close(self) -> None:
        self.conn.close()


def validator_registry(loop) -> tuple[CollectorRegistry, ValidatorCollector]:
    registry = CollectorRegistry()
    collector = ValidatorCollector(loop)
    registry.register(collector)
    return registry, collector


async def serve_validator_metrics(settings, validator, gateway=None) -> Optional[MetricsServer]:
    """/metrics on 127.0.0.1:--metrics-port: the validator's, its gateway's and its reference engine's.
    A port that cannot be bound is logged and the validator runs on without metrics."""
    if not settings.metrics:
        return None
    registry, collector = validator_registry(validator.loop)

    def registries():
        out = [registry]
        if gateway is not None:
            out.append(gateway.gateway.metrics.registry)
        engine_metrics = getattr(validator.engine, "metrics", None)
        if engine_metrics is not None:
            out.append(engine_metrics.registry)
        return out

    host = settings.metrics_host
    server = MetricsServer(registries, host, settings.metrics_port, on_close=collector.close,
                           component="validator-metrics")
    try:
        port = await server.start()
    except OSError as error:
        log.warning("metrics off: cannot listen on %s:%d (%s)", host, settings.metrics_port, error)
        await server.close()
        return None
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server
