"""Leadership for services that must act alone (scheduler, health monitor).

A KV key per service in ``llmgw_leaders``: the leader creates it and renews it
by compare-and-set on its revision every ``ttl/3``. A standby takes over when
it has seen the key unchanged for ``ttl`` on its *own* monotonic clock — no
comparison of wall clocks between hosts — again by compare-and-set, so exactly
one contender wins. A leader that cannot renew for ``ttl`` stops acting on its
own, before any standby can have taken over.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from prometheus_client import Gauge

from .schemas import LeaderLease, encode, now

log = logging.getLogger("llmgw.leader")
LEADER = Gauge("llmgw_leader", "1 while this instance leads its service (scheduler, health), 0 while it stands by", ["service", "instance"])


class Leadership:
    def __init__(self, kv, service: str, holder: str, ttl: float):
        self.kv = kv
        self.service = service
        self.holder = holder
        self.ttl = ttl
        self.is_leader = False
        self._revision = 0
        self._last_renewed = 0.0  # monotonic
        self.changed = asyncio.Event()
        LEADER.labels(service, holder).set(0)

    def _set(self, leader: bool) -> None:
        if leader != self.is_leader:
            self.is_leader = leader
            LEADER.labels(self.service, self.holder).set(1 if leader else 0)
            log.info("%s: %s %s", self.service, self.holder, "is now the leader" if leader else "is standing by")
            self.changed.set()

    def _value(self, acquired: float) -> bytes:
        return encode(LeaderLease(holder=self.holder, acquired_at=acquired, renewed_at=now()))

    async def _try_acquire(self, seen_rev: int | None) -> bool:
        try:
            if seen_rev is None:
                self._revision = await self.kv.create(self.service, self._value(now()))
            else:
                self._revision = await self.kv.update(self.service, self._value(now()), last=seen_rev)
        except KeyWrongLastSequenceError:
            return False  # another contender got there first
        except Exception as e:  # the bus is away: the next round tries again
            log.debug("%s: acquire failed: %s", self.service, e)
            return False
        self._last_renewed = time.monotonic()
        return True

    async def run(self) -> None:
        """Contend forever; ``is_leader`` says who acts right now."""
        seen_rev: int | None = None
        seen_at = time.monotonic()
        interval = self.ttl / 3
        while True:
            try:
                if self.is_leader:
                    try:
                        self._revision = await self.kv.update(self.service, self._value(now()), last=self._revision)
                        self._last_renewed = time.monotonic()
                    except KeyWrongLastSequenceError:
                        log.warning("%s: leadership taken over by another instance", self.service)
                        self._set(False)
                    except Exception as e:
                        if time.monotonic() - self._last_renewed >= self.ttl:
                            log.warning("%s: cannot renew leadership for %.1fs (%s); stepping down", self.service, self.ttl, e)
                            self._set(False)
                else:
                    try:
                        entry = await self.kv.get(self.service)
                        rev = entry.revision
                    except KeyNotFoundError:
                        rev = None
                    if rev is None:
                        if await self._try_acquire(None):
                            self._set(True)
                    elif rev != seen_rev:
                        seen_rev, seen_at = rev, time.monotonic()
                    elif time.monotonic() - seen_at >= self.ttl:
                        log.info("%s: leader silent for %.1fs; taking over", self.service, self.ttl)
                        if await self._try_acquire(rev):
                            self._set(True)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("%s: leadership check failed: %s", self.service, e)
            await asyncio.sleep(interval)

    async def resign(self) -> None:
        """Hand over at once on a clean shutdown instead of making standbys wait a TTL."""
        if self.is_leader:
            try:
                await self.kv.delete(self.service, last=self._revision)
            except Exception:
                pass
            self._set(False)
