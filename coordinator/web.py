"""The operator's view over HTTP: Prometheus metrics and the live fleet page.

Both are event sinks of the round engine (``serve(..., observers=[...])``) served by a small
threaded HTTP server of the standard library on their own thread, so a slow scrape or
browser never holds up a round. Like the embedded broker they listen on loopback only,
unless the operator gives a token (a request then needs ``Authorization: Bearer TOKEN`` or
``?token=TOKEN``) *and* either a TLS certificate (HTTPS) or the flag that says the token may
cross the network in clear (``insecure``).

- ``/metrics`` (:class:`MetricsExporter`): the names are documented in docs/operations.md
  and used by the shipped Grafana dashboard (``coordinator/static/grafana-dashboard.json``).
- ``/`` and ``/api/state`` (:class:`FleetPage`): one static page (``coordinator/static/
  index.html``, no build step) that polls the run's state once a second. The state comes
  from the run's files (metrics.jsonl, state.json, the run lock), with the live registry
  laid over them while a coordinator serves, so ``sfl-coord dashboard runs/<run>`` shows a
  running or finished run the same way.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import ssl
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import parse_qs, urlparse

from coordinator import state as ckpt
from coordinator.run_lock import holder
from sfl_core.extras import import_optional

log = logging.getLogger("sfl.coord.web")

CONTENT_TYPE_PROM = "text/plain; version=0.0.4; charset=utf-8"


class WebError(ValueError):
    """An address that cannot be served (taken, malformed, beyond loopback without a token)."""


@dataclass(frozen=True)
class WebAccess:
    """Who may reach the page and the metrics: ``token`` (a credential), ``tls`` (certificate
    and key files: HTTPS), ``insecure`` (beyond loopback without TLS, said explicitly)."""

    token: Optional[str] = None
    tls: Optional[tuple[str, str]] = None
    insecure: bool = False
    flags: tuple[str, str, str, str] = ("--dashboard-token or SFL_DASHBOARD_TOKEN", "--web-tls-cert",
                                        "--web-tls-key", "--insecure-web")
    """The command's names for the token, certificate, key and insecure switch (for its refusals)."""


def parse_address(text: str, what: str, access: WebAccess = WebAccess()) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise WebError(f"{what} {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8080")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    token, cert, key, insecure = access.flags
    if not loopback and not access.token:
        raise WebError(f"{what} {text}: beyond loopback only with a token ({token}): the page and the metrics "
                       f"name the fleet's devices")
    if not loopback and not access.tls and not access.insecure:
        raise WebError(f"{what} {text}: beyond loopback only over HTTPS ({cert} and {key}), or with {insecure} "
                       f"(the token and the fleet's data then cross the network in clear)")
    return host, int(port)


class _Server:
    """A threaded HTTP server on its own daemon thread, routes to handlers returning
    (status, content type, body)."""

    def __init__(self, host: str, port: int, routes: dict[str, Callable[[dict], tuple[int, str, bytes]]],
                 access: WebAccess, what: str):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the standard library's name
                url = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                if owner.token and not owner.authorised(self.headers.get("Authorization", ""), query):
                    self._send(401, "text/plain", b"token required\n")
                    return
                route = routes.get(url.path)
                if route is None:
                    self._send(404, "text/plain", b"not found\n")
                    return
                try:
                    self._send(*route(query))
                except Exception as exc:  # noqa: BLE001 - one bad request must not stop the server
                    log.warning("%s %s failed: %s", what, url.path, exc)
                    self._send(500, "text/plain", b"internal error\n")

            def _send(self, status: int, ctype: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("%s: " + fmt, what, *args)

        self.token = access.token
        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise WebError(f"{what} {host}:{port}: cannot listen ({exc.strerror})") from None
        if access.tls:
            try:
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                context.load_cert_chain(*access.tls)
            except (OSError, ssl.SSLError) as exc:
                self.httpd.server_close()
                raise WebError(f"{what}: cannot use the TLS certificate {access.tls[0]} and key {access.tls[1]} "
                               f"({exc})") from None
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name=what, daemon=True)
        self.thread.start()

    def authorised(self, header: str, query: dict[str, str]) -> bool:
        assert self.token is not None
        given = header[7:] if header.startswith("Bearer ") else query.get("token", "")
        return hmac.compare_digest(given.encode(), self.token.encode())

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Served:
    """An engine observer with its own HTTP server (``serve`` starts it, ``finish`` stops it)."""

    _server: Optional[_Server] = None
    engine: Any = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.port

    def attach(self, engine: Any) -> None:
        self.engine = engine

    def finish(self, finished: bool) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


# ================================================================ Prometheus

class MetricsExporter(_Served):
    """The run's Prometheus metrics, updated from engine events (names in docs/operations.md)."""

    def __init__(self, run_id: str, rounds: int):
        prometheus = import_optional("prometheus_client", "--metrics", WebError)
        CollectorRegistry, Counter, Gauge, Histogram = (prometheus.CollectorRegistry, prometheus.Counter,
                                                        prometheus.Gauge, prometheus.Histogram)

        self.registry = CollectorRegistry()
        r = self.registry
        self.info = Gauge("sfl_run_info", "The run served (value 1).", ["run"], registry=r)
        self.info.labels(run_id).set(1)
        self.rounds_planned = Gauge("sfl_rounds_planned", "Rounds the run config asks for.", registry=r)
        self.rounds_planned.set(rounds)
        self.round = Gauge("sfl_round", "Last completed round.", registry=r)
        self.rounds = Counter("sfl_rounds_completed", "Rounds completed by this process.", registry=r)
        self.voids = Counter("sfl_rounds_void", "Rounds planned again because too few agents completed them.",
                             registry=r)
        self.accuracy = Gauge("sfl_accuracy", "Test accuracy of the global model after the last round.", registry=r)
        self.test_loss = Gauge("sfl_test_loss", "Test loss of the global model after the last round.", registry=r)
        self.train_loss = Gauge("sfl_train_loss", "Mean training loss of the last round.", registry=r)
        self.federated_accuracy = Gauge("sfl_federated_accuracy", "Accuracy of the global model on the devices' "
                                        "held-out splits (count-weighted), last federated evaluation.", registry=r)
        self.federated_loss = Gauge("sfl_federated_loss", "Loss of the global model on the devices' held-out "
                                    "splits (count-weighted), last federated evaluation.", registry=r)
        self.round_s = Histogram("sfl_round_duration_seconds", "Measured round time.", registry=r,
                                 buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800))
        self.step_s = Histogram("sfl_step_duration_seconds", "Time of one merged server step, from the previous "
                                "step's end (waiting for the agents included).", registry=r,
                                buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
        self.last_round_s = Gauge("sfl_round_seconds", "Measured time of the last round.", registry=r)
        self.predicted_s = Gauge("sfl_predicted_round_seconds", "The planner's predicted time of the last round "
                                 "(strategy auto).", registry=r)
        self.bytes_up = Counter("sfl_bytes_up", "Bytes received from agents.", registry=r)
        self.bytes_down = Counter("sfl_bytes_down", "Bytes sent to agents.", registry=r)
        self.registered = Gauge("sfl_agents_registered", "Agents in the registry.", registry=r)
        self.online = Gauge("sfl_agents_online", "Agents online (status online, heard from recently).", registry=r)
        self.selected = Gauge("sfl_agents_selected", "Agents selected for the current round.", registry=r)
        self.rejected = Counter("sfl_rejected_messages", "Messages rejected, by reason.", ["reason"], registry=r)
        self.resent = Counter("sfl_resent", "Times an agent waited for a message lost on the way and was sent "
                              "it again (with steps in flight, every step it had in flight).", registry=r)
        self.stragglers = Counter("sfl_stragglers", "Agents dropped from a round for being late: at the round's "
                                  "deadline (late) or busy without answering (busy).", ["kind"], registry=r)
        self.agent_round_s = Gauge("sfl_agent_last_round_seconds", "Each agent's time in the last round it "
                                   "completed.", ["agent"], registry=r)
        self.assignment = Gauge("sfl_agent_assignment_info", "Each agent's last assignment (value 1).",
                                ["agent", "profile", "split", "width", "codec", "batch", "window"], registry=r)
        self._assigned: dict[str, tuple[str, ...]] = {}
        self._step_at = time.monotonic()

    def serve(self, host: str, port: int, access: WebAccess = WebAccess()) -> "MetricsExporter":
        from prometheus_client import generate_latest  # imported once the exporter exists

        self._server = _Server(host, port, {"/metrics": lambda q: (200, CONTENT_TYPE_PROM,
                                                                   generate_latest(self.registry))},
                               access, "--metrics")
        return self

    def attach(self, engine: Any) -> None:
        super().attach(engine)
        self._fleet()

    def _fleet(self) -> None:
        if self.engine is not None:
            self.registered.set(len(self.engine.registry.agents))
            self.online.set(len(self.engine.session.online()))

    def __call__(self, event: str, data: dict[str, Any]) -> None:
        if event in ("registered", "status", "agent_dropped", "waiting"):
            self._fleet()
        elif event == "round_start":
            self.selected.set(len(data["agents"]))
            self._step_at = time.monotonic()
        elif event == "step":
            now = time.monotonic()
            self.step_s.observe(now - self._step_at)
            self._step_at = now
        elif event == "round_void":
            self.voids.inc()
        elif event == "round_end":
            self._round(data)

    def _round(self, rec: dict[str, Any]) -> None:
        self.round.set(rec["round"])
        self.rounds.inc()
        if rec.get("accuracy") is not None:   # None: the server holds no validation data
            self.accuracy.set(rec["accuracy"])
            self.test_loss.set(rec["test_loss"])
        fed = rec.get("federated") or {}
        if fed.get("accuracy") is not None:
            self.federated_accuracy.set(fed["accuracy"])
            self.federated_loss.set(fed["loss"])
        if rec.get("train_loss") is not None:
            self.train_loss.set(rec["train_loss"])
        self.round_s.observe(rec["round_time_s"])
        self.last_round_s.set(rec["round_time_s"])
        predicted = (rec.get("auto") or {}).get("predicted_round_s")
        if predicted is not None:
            self.predicted_s.set(predicted)
        self.bytes_up.inc(rec["bytes_up"])
        self.bytes_down.inc(rec["bytes_down"])
        for reason, n in (rec.get("rejected") or {}).items():
            self.rejected.labels(reason).inc(n)
        self.resent.inc(rec.get("resent", 0))
        for kind in ("late", "busy"):
            self.stragglers.labels(kind).inc(len((rec.get("stragglers") or {}).get(kind, ())))
        profiles = {a: i.profile.name for a, i in self.engine.registry.agents.items()} if self.engine else {}
        for a, row in rec["agents"].items():
            self.agent_round_s.labels(a).set(row["time_s"])
            labels = (a, profiles.get(a, "?"), "whole" if row.get("whole_model") else str(row["split"]),
                      str(row.get("width", 0)), row["codec"], str(row["batch_size"]), str(row.get("window", 1)))
            old = self._assigned.get(a)
            if old is not None and old != labels:
                self.assignment.remove(*old)
            self._assigned[a] = labels
            self.assignment.labels(*labels).set(1)
        known = set(self.engine.registry.agents) if self.engine else set(self._assigned)
        for a in [a for a in self._assigned if a not in known]:   # pruned agents leave the labels
            self.assignment.remove(*self._assigned.pop(a))
            self.agent_round_s.remove(a)
        self._fleet()


def start_metrics(address: str, cfg: Any, access: WebAccess = WebAccess()) -> MetricsExporter:
    host, port = parse_address(address, "--metrics", access)
    return MetricsExporter(cfg.run_id, cfg.rounds).serve(host, port, access)


# ================================================================ the live fleet page

def _static(name: str) -> bytes:
    return (Path(__file__).parent / "static" / name).read_bytes()


class FleetPage(_Served):
    """``/`` (the page) and ``/api/state`` (what it draws) for one run directory."""

    def __init__(self, out_dir: Path, run_id: Optional[str] = None, rounds: Optional[int] = None):
        self.out_dir = Path(out_dir)
        self.run_id = run_id
        self.rounds = rounds
        self.status = "waiting for agents"

    def serve(self, host: str, port: int, access: WebAccess = WebAccess()) -> "FleetPage":
        page = _static("index.html")
        self._server = _Server(host, port, {
            "/": lambda q: (200, "text/html; charset=utf-8", page),
            "/api/state": lambda q: (200, "application/json", json.dumps(self.state()).encode()),
        }, access, "--dashboard")
        return self

    def finish(self, finished: bool) -> None:
        self.engine = None
        super().finish(finished)

    def __call__(self, event: str, data: dict[str, Any]) -> None:
        if event == "waiting":
            self.status = f"waiting for agents ({data['registered']}/{data['needed']})"
        elif event == "round_start":
            self.status = f"round {data['round']}: training"
        elif event == "step":
            self.status = f"round {data['round']}: step {data['step']} of {data['of']}"
        elif event == "round_void":
            self.status = f"round {data['round']} did not count ({data['reason']}): planning it again"
        elif event == "round_end":
            self.status = f"round {data['round']} done"

    # ---------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        try:
            history = ckpt.read_metrics(self.out_dir)
        except ckpt.CheckpointError as exc:
            history, problem = [], str(exc)
        else:
            problem = None  # type: ignore[assignment]
        saved = _read_json(self.out_dir / ckpt.STATE_FILE) or {}
        engine = self.engine
        owner = None
        if engine is not None:
            status = self.status
        else:
            owner = holder(self.out_dir)
            last = history[-1]["round"] if history else 0
            total = self.rounds or saved.get("rounds")
            if owner is not None:
                status = f"running (pid {owner.get('pid', '?')}), round {last} done"
            elif total and last >= total:
                status = f"finished after round {last}"
            else:
                status = f"stopped after round {last}" if history else "not started"
        return {
            "run": self.run_id or saved.get("run") or self.out_dir.name,
            "model": saved.get("model"), "strategy": saved.get("strategy"),
            "rounds_planned": self.rounds, "status": status, "problem": problem,
            "updated": time.strftime("%H:%M:%S"),
            "rounds": [_round_row(m) for m in history],
            "fleet": self._fleet(history, saved, live=engine is not None or owner is not None),
        }

    def _fleet(self, history: list[dict[str, Any]], saved: dict[str, Any], live: bool) -> list[dict[str, Any]]:
        """One row per agent. ``online`` is None where no coordinator holds the run: its files say
        only what was true when it stopped."""
        last_row: dict[str, dict[str, Any]] = {}
        flagged: dict[str, str] = {}   # what a defense (robust:) last did to an agent, in the rounds it took part
        for rec in history:
            for a, row in (rec.get("agents") or {}).items():
                last_row[a] = {**row, "round": rec["round"]}
                flagged.pop(a, None)
            rb = rec.get("robust") or {}
            for a, claimed in (rb.get("capped") or {}).items():
                flagged[a] = f"round {rec['round']}: weight capped (claimed {claimed:g})"
            for a, size in (rb.get("clipped") or {}).items():
                flagged[a] = f"round {rec['round']}: update left out ({size:.3g}x the typical change)"
            for a, size in (rb.get("clipped_by_peers") or {}).items():
                flagged[a] = f"round {rec['round']}: update left out ({size:.3g}x its peers' typical change)"
            for a, size in (rb.get("replaced") or {}).items():
                flagged[a] = f"round {rec['round']}: update left out (weights replaced: {size:.3g}x their size)"
            for a, why in (rb.get("refused") or {}).items():
                flagged[a] = f"round {rec['round']}: refused ({why})"
            for a in rb.get("outliers") or []:
                flagged[a] = f"round {rec['round']}: left out (an outlier)"
            for a, scale in (rb.get("activation_scale") or {}).items():
                flagged[a] = f"round {rec['round']}: rows left out (activations {scale:.3g}x their cut's median)"
            for a, excess in (rb.get("label_mismatch") or {}).items():
                flagged[a] = f"round {rec['round']}: rows left out (labels disagree with its inputs, +{excess:.2f})"
            for a, z in (rb.get("mix_refuted") or {}).items():
                why = f"{z:g} standard deviations" if isinstance(z, (int, float)) else z
                flagged[a] = f"round {rec['round']}: its registered mix of classes refuted by its labels ({why})"
        engine = self.engine
        if engine is not None:
            online = set(engine.session.online())
            known = {a: {"profile": i.profile.name, "online": a in online, "rounds": i.rounds,
                         "bytes_up": i.bytes_up, "bytes_down": i.bytes_down, "privacy": i.privacy,
                         "quarantined": i.quarantined}
                     for a, i in list(engine.registry.agents.items())}
        else:
            known = {a: {"profile": (d.get("profile") or {}).get("name", "?"),
                         "online": bool(d.get("online")) if live else None,
                         "rounds": d.get("rounds", 0), "bytes_up": d.get("bytes_up", 0),
                         "bytes_down": d.get("bytes_down", 0), "privacy": d.get("privacy") or {},
                         "quarantined": d.get("quarantined") or ""}
                     for a, d in (saved.get("registry") or {}).items()}
        for a in last_row:
            known.setdefault(a, {"profile": "?", "online": False if live else None, "rounds": 0, "bytes_up": 0, "bytes_down": 0,
                                 "privacy": {}, "quarantined": ""})
        rows = []
        for a, k in sorted(known.items()):
            r = last_row.get(a, {})
            rows.append({"agent": a, **k, "privacy": r.get("privacy") or k["privacy"],
                         "split": ("whole" if r.get("whole_model") else r.get("split")) if r else None,
                         "width": r.get("width"), "codec": r.get("codec"), "batch": r.get("batch_size"),
                         "window": r.get("window", 1) if r and not r.get("whole_model") else None,
                         "last_round": r.get("round"), "last_round_s": r.get("time_s"),
                         "flagged": flagged.get(a, "")})
        return rows


def _round_row(m: dict[str, Any]) -> dict[str, Any]:
    auto = m.get("auto") or {}
    return {"round": m["round"], "accuracy": m.get("accuracy"), "test_loss": m.get("test_loss"),
            "federated_accuracy": (m.get("federated") or {}).get("accuracy"),
            "train_loss": m.get("train_loss"), "elapsed_s": m.get("elapsed_s"),
            "round_s": m.get("round_time_s"), "predicted_s": auto.get("predicted_round_s"),
            "completed": len(m.get("completed") or []), "bytes": (m.get("bytes_up") or 0) + (m.get("bytes_down") or 0)}


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def start_dashboard(address: str, out_dir: Path, cfg: Any = None, access: WebAccess = WebAccess()) -> FleetPage:
    host, port = parse_address(address, "--dashboard", access)
    return FleetPage(out_dir, cfg.run_id if cfg else None, cfg.rounds if cfg else None).serve(host, port, access)
