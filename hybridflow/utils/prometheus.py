"""A Prometheus exporter for the step metrics (`trainer.prometheus.port`).

Every numeric metric of the latest step is a gauge `hybridflow_<metric>`, its name with every
character outside [a-zA-Z0-9_] replaced by `_` (`timing_s/reshard` -> `hybridflow_timing_s_reshard`,
`reshard/bytes_per_rank` -> `hybridflow_reshard_bytes_per_rank`), plus `hybridflow_step`. The
server (prometheus_client's) listens on loopback unless `trainer.prometheus.host` says otherwise;
`monitoring/grafana_dashboard.json` plots the reshard, stage-timing, throughput and reward gauges.
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Gauge, start_http_server

PREFIX = "hybridflow_"


def metric_name(key: str) -> str:
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class MetricsExporter:
    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.registry = CollectorRegistry()  # its own registry: no process/platform collectors, no clashes
        self.gauges: dict[str, Gauge] = {}
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self.server.server_port  # the bound port (port 0 = any free one)

    def update(self, metrics: dict[str, float], step: int) -> None:
        for key, value in {"step": float(step), **metrics}.items():
            name = metric_name(key)
            if name not in self.gauges:
                self.gauges[name] = Gauge(name, f"hybridflow metric {key}", registry=self.registry)
            self.gauges[name].set(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
