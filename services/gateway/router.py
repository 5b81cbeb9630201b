"""Which replica serves a request: pure bookkeeping, no I/O, no clock of its own.

The service feeds it replica and deployment records as its KV watches see them;
the proxy asks ``pick`` for a backend and reports how the attempt went. Keeping
this free of sockets and NATS lets its rules be read in one place:

* only a *ready* replica (``ROUTABLE_REPLICA``) with an endpoint is
  routable — the endpoint is the leader's, since only a replica's leader
  listens; a ``degraded`` one takes no new request;
* among those of the requested model, with ``routing="least-outstanding"``
  the one with the fewest requests in flight through this gateway wins; ties
  rotate, so an idle pool still spreads. With ``routing="prefix"`` the owner
  of the prompt's prefix wins (rendezvous hashing over the replica ids, the
  same in every gateway) unless it holds more than its share of the requests
  in flight (bounded loads); see prefix.py. A retry (``exclude``), or a body
  with no prompt to go by, falls back to the least loaded. Each decision is
  counted by reason in ``decisions`` (read by the metrics when scraped);
* ``failures_before_cooldown`` failures in a row take a replica out of rotation
  for ``cooldown`` seconds; one success resets the count. Some failures are
  verdicts on their own (``eject``): a refused connection, an endpoint that
  cannot be parsed, a replica that sent no byte for ``stall_after`` — those
  take it out at once, before the control plane has noticed anything;
* per replica it keeps what the traffic reports to the agents say: requests in
  flight (``outstanding``), answers completed (cumulative), and — filled in by
  the proxy's sweep — how long the replica has been silent (``silent_for``);
* a model no deployment or replica record mentions is unknown (404); a known
  model with nothing routable is unavailable (503, with a Retry-After).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TypeGuard

from llmgw.shared.schemas import DeploymentSpec, Replica
from llmgw.shared.states import ROUTABLE_REPLICA

from . import prefix

ROUTINGS = ("least-outstanding", "prefix")
# Why a replica was chosen (llmgw_gateway_routing_decisions{reason}).
DECISIONS = ("prefix", "load-bound-overflow", "least-outstanding", "retry")


class UnknownModel(Exception):
    def __init__(self, model: str):
        super().__init__(f"the model '{model}' does not exist")
        self.model = model


class NoReadyReplica(Exception):
    def __init__(self, model: str, why: str, retry_after: float):
        super().__init__(f"no replica of '{model}' can take requests now: {why}")
        self.model = model
        self.retry_after = retry_after


@dataclass(eq=False)
class Backend:
    """A ready replica as the gateway sees it. Identity matters (``eq=False``):
    in-flight requests hold the object and release it, even after the record
    left the ready state."""

    id: str
    model: str
    endpoint: str
    outstanding: int = 0
    failures: int = 0  # consecutive
    cool_until: float = 0.0
    routable: bool = True
    head: bytes = b""  # the header line naming this replica in answers, encoded once
    node: str = ""  # the leader's node: where its agent hears the traffic reports
    engine: str = ""  # what it runs (sim, vllm, ...): how a stream on it is continued elsewhere
    completed: int = 0  # answers read to their end (status < 500), since this gateway started
    # Upstream connections of the requests in flight (upstream.Connection), for the
    # proxy's sweep: it reads their arrival counters and aborts them.
    flights: set = field(default_factory=set)
    silent_for: float = 0.0  # seconds the replica has sent nothing to any stream in flight (the sweep's figure)
    progress_mark: int = 0  # ``completed`` when the sweep last looked
    progress_at: float = 0.0  # when the sweep last saw ``completed`` grow
    ejected: str = ""  # why it is cooling down (a reason for logs and metrics), "" if not

    def __post_init__(self):
        self.head = b"x-llmgw-replica: %s\r\n" % self.id.encode("utf-8", "surrogateescape")
        self.rid_hash = prefix.id_hash(self.id)  # its identity for rendezvous hashing


def routable(rep: Replica | None) -> TypeGuard[Replica]:
    return rep is not None and rep.state in ROUTABLE_REPLICA and rep.endpoint.startswith(("http://", "https://"))


class Router:
    def __init__(
        self,
        *,
        cooldown: float,
        failures_before_cooldown: int,
        retry_after: float,
        clock: Callable[[], float] = time.monotonic,
        routing: str = "least-outstanding",
        load_bound: float = 1.15,
        load_slack: int = 0,
        prefix_chars: int = prefix.MAX_CHARS,
    ):
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {routing!r}")
        if not load_bound >= 1.0:
            raise ValueError(f"load_bound must be at least 1, not {load_bound!r}")
        self.routing = routing
        self.load_bound = load_bound
        self.load_slack = load_slack
        self.prefix_chars = prefix_chars
        self.decisions = dict.fromkeys(DECISIONS, 0)
        self.cooldown = cooldown
        self.failures_before_cooldown = failures_before_cooldown
        self.retry_after = retry_after
        self.clock = clock
        self._backends: dict[str, Backend] = {}  # replica id -> backend (routable or draining)
        self._by_model: dict[str, list[Backend]] = {}  # routable ones only
        self._replica_models: dict[str, str] = {}  # every replica record, any state
        self._deployment_models: dict[str, str] = {}
        # ``completed`` of replicas whose backend was dropped (it left ready with
        # nothing in flight) while its record lives: the count must only grow,
        # since the agents compare it with the last one they heard.
        self._completed: dict[str, int] = {}
        self._turn = 0
        self.cooldowns = 0  # how many times a replica was taken out of rotation

    # -- feeding from the KV watches (KvMirror listener signature) ------------
    def on_replica(self, key: str, old: Replica | None, new: Replica | None) -> None:
        if new is None:
            self._replica_models.pop(key, None)
            self._completed.pop(key, None)
        else:
            self._replica_models[key] = new.model
        b = self._backends.get(key)
        if routable(new):
            if b is None:
                b = self._backends[key] = Backend(key, new.model, new.endpoint.rstrip("/"))
                b.completed = b.progress_mark = self._completed.pop(key, 0)
            elif b.endpoint != new.endpoint.rstrip("/") or b.model != new.model:
                self._unlist(b)
                b.model, b.endpoint = new.model, new.endpoint.rstrip("/")
                b.failures, b.cool_until = 0, 0.0  # a new leader deserves a fresh start
            b.node = new.members[0].node_id if new.members else ""
            b.engine = new.engine
            if not b.routable or b not in self._by_model.get(b.model, ()):
                b.routable = True
                self._by_model.setdefault(b.model, []).append(b)
        elif b is not None:
            self._unlist(b)
            b.routable = False
            if b.outstanding == 0:
                self._drop(b)

    def on_deployment(self, key: str, old: DeploymentSpec | None, new: DeploymentSpec | None) -> None:
        if new is None:
            self._deployment_models.pop(key, None)
        else:
            self._deployment_models[key] = new.model

    def _unlist(self, b: Backend) -> None:
        pool = self._by_model.get(b.model)
        if pool and b in pool:
            pool.remove(b)
            if not pool:
                del self._by_model[b.model]

    # -- questions -------------------------------------------------------------
    def models(self) -> list[str]:
        """Models with at least one ready replica (cooling ones included: they are ready, just rested)."""
        return sorted(self._by_model)

    def known(self, model: str) -> bool:
        return model in self._by_model or model in self._replica_models.values() or model in self._deployment_models.values()

    def backends(self) -> Iterable[Backend]:
        return self._backends.values()

    def has_record(self, replica_id: str) -> bool:
        return replica_id in self._replica_models

    def backend(self, replica_id: str) -> Backend | None:
        """The replica's backend while it is routable or has requests in flight."""
        return self._backends.get(replica_id)

    # -- routing ---------------------------------------------------------------
    def pick(self, model: str, exclude: Collection[Backend] = (), body: bytes = b"", fields: prefix.Fields | None = None) -> Backend:
        """A routable backend of ``model`` (none of ``exclude``: those a request tried) for a request with ``body``
        (or its ``fields``, decoded already: the body is then not read again), now
        counted as busy: the prefix owner within its bounded load (``routing="prefix"``),
        else the least loaded."""
        pool = self._by_model.get(model)
        if not pool:
            if not self.known(model):
                raise UnknownModel(model)
            raise NoReadyReplica(model, "none is ready", self.retry_after)
        now = self.clock()
        candidates = [b for b in pool if b.cool_until <= now and b not in exclude]
        if not candidates:
            cooling = [b.cool_until for b in pool if b.cool_until > now and b not in exclude]
            if cooling:
                raise NoReadyReplica(model, "every ready replica is cooling down after repeated failures", max(1.0, min(cooling) - now))
            raise NoReadyReplica(model, "no other replica is ready", self.retry_after)
        if self.routing == "prefix" and not exclude and (fields is not None or body):
            if fields is not None:
                key = prefix.key_of(fields, self.prefix_chars)
            else:
                key = prefix.prefix_key(body, max_chars=self.prefix_chars)
            if key is not None:
                loads = [b.outstanding for b in candidates]
                i, owner = prefix.choose(key, [b.rid_hash for b in candidates], loads, self.load_bound, slack=self.load_slack)
                best = candidates[i]
                self.decisions["prefix" if owner else "load-bound-overflow"] += 1
                best.outstanding += 1
                return best
        self.decisions["retry" if exclude else "least-outstanding"] += 1
        least = min(b.outstanding for b in candidates)
        ties = [b for b in candidates if b.outstanding == least]
        # Take turns among equals, so an idle pool alternates instead of
        # sending every lone request to the first replica listed.
        best = ties[self._turn % len(ties)]
        self._turn += 1
        best.outstanding += 1
        return best

    def release(self, b: Backend) -> None:
        b.outstanding -= 1
        if not b.routable and b.outstanding == 0 and self._backends.get(b.id) is b:
            self._drop(b)

    def _drop(self, b: Backend) -> None:
        del self._backends[b.id]
        if b.id in self._replica_models:  # the record lives on (degraded, say): keep its count
            self._completed[b.id] = b.completed

    def succeeded(self, b: Backend) -> None:
        b.failures = 0
        b.completed += 1

    def failed(self, b: Backend) -> bool:
        """Count a failure; True when this one sent the replica into cool-down."""
        b.failures += 1
        if b.failures >= self.failures_before_cooldown:
            return self.eject(b, "failures")
        return False

    def eject(self, b: Backend, reason: str) -> bool:
        """Out of rotation for ``cooldown`` now, whatever the count; True unless it
        was cooling down already (then its cool-down is not extended)."""
        b.failures = 0
        if b.cool_until > self.clock():
            return False
        b.cool_until = self.clock() + self.cooldown
        b.ejected = reason
        self.cooldowns += 1
        return True

    def cooling(self, b: Backend) -> bool:
        return b.cool_until > self.clock()
