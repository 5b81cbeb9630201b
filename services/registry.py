"""``llmgw registry``: the single writer of node records (``llmgw_nodes``).

It turns inventories into node records and holds each node's admin state
(active, cordoned, draining), with why and by whom (``admin_reason``,
``admin_by``: an operator, or the scheduler's auto-cordon). The server's permissions already bind a node's
subject to its certificate, so ``llmgw.node.node02.inventory`` can only come
from ``CN=node02,OU=node``; the registry still checks that the payload claims
the same node, because a bug in an agent must not move one node's GPUs onto
another's record. A rejected inventory leaves the previous record in place.

A node's management address is not the node's to choose (a node is not trusted): clients'
prompts go to ``http://<mgmt_addr>:<port>``. The address is recorded when the
node is onboarded (``set-addr``, called by ``llmgw ctl node set-addr``,
``llmgw up`` and ``deploy/onboard-node.sh``) and kept on the record as
``recorded_addr``; an inventory claiming another address is refused whole and
counted, with an event. A node with no recorded address (onboarded before
this) keeps today's behaviour: its inventory's address is taken, with one
warning per registry run, and ``llmgw ctl nodes`` shows it as unverified.
Inventories of a node the health monitor quarantined (two agents answering
for one identity) are refused too: which of the two is the real one is an
operator's call.

Bring-up at scale (10,000 nodes). After a power event or a nats-server restart
every agent re-sends its inventory within seconds: 10,000 inventories at once.
Each is judged when it arrives (identity, claims, bounds: ``_acceptable``,
from memory — no bus round trip), and an acceptable one is *queued*, keyed by
node: a newer inventory of the same node replaces the queued one (the last one
wins; none is lost, since the agent's latest says everything its earlier ones
did). One loop applies what is queued in batches, at most ``BATCH_WRITES``
KV writes in flight at a time. An inventory whose facts equal the stored
record writes nothing — after a nats-server restart that is nearly all of
them. The stored records are known from a watch of ``llmgw_nodes`` (a
``KvMirror``) overlaid with this registry's own writes (which the watch
reports a moment later); every write is a compare-and-set on the revision it
was judged against, so a stale view costs a re-read, never a lost update. A
write the bus refused (while it is away) is kept queued and tried again,
unless a newer inventory of the node arrived meanwhile.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from prometheus_client import Counter, Gauge

from llmgw.shared import addresses, api
from llmgw.shared import buckets as B
from llmgw.shared import subjects as S
from llmgw.shared.errors import LlmgwError
from llmgw.shared.kvmirror import KvMirror, open_bucket
from llmgw.shared.names import host_problem, is_valid_name
from llmgw.shared.pki import subject_dn
from llmgw.shared.schemas import CommandAck, Event, Inventory, Lease, ModelCacheReport, NodeAddrRequest, NodeRecord, NodeRequest, decode_reply, encode, now
from llmgw.shared.states import AdminBy, AdminState, EventKind, EventWhat, LeaseState

from .runtime import ServiceRuntime, run_service

INVENTORIES = Counter("llmgw_registry_inventories_total", "Inventories received, by result", ["result"])
NODES = Gauge("llmgw_registry_nodes", "Node records, by admin state", ["admin"])
ADDR_REFUSED = Counter("llmgw_registry_addr_refused_total", "Inventories refused for claiming an address other than the recorded one")


class UnknownNode(LlmgwError):
    code = "unknown_node"


class BadAdminRequest(LlmgwError):
    code = "bad_request"


MAX_REASON = 500
# KV writes in flight at once when a burst of inventories is applied: enough to
# keep a round trip's worth of writes on the wire, few enough that the server's
# JetStream queue and the events that follow stay small.
BATCH_WRITES = 64
# A batch write the bus refused is tried again after this long (the bus is away).
RETRY_AFTER = 1.0
# How long the registry keeps what a recorded DNS name resolved to.
RESOLVE_TTL = 10.0
# A node whose address claim was refused is asked for its inventory at most this often.
VERIFY_EVERY = 10.0


class Registry(ServiceRuntime):
    role = "registry"

    async def setup(self) -> None:
        self.nodes_kv = self.kv[S.BUCKET_NODES]
        # node -> boot id of the inventory last stored (what the record says)
        self.boots: dict[str, str] = {}
        self.pulling: set[str] = set()
        # nodes warned about (once per run) for having no recorded address;
        # (node, claimed, recorded, boot) already announced as refused (one event, not one per re-send)
        self.unverified_warned: set[str] = set()
        self.refusals_told: set[tuple[str, str, str, str, str]] = set()
        # node -> when it was last asked for its inventory after a refused address claim
        self.verify_asked: dict[str, float] = {}
        # recorded name -> (monotonic time looked up, its addresses or the resolver's error)
        self.resolved_here: dict[str, tuple[float, tuple[str, ...] | str]] = {}
        self.leases: KvMirror | None = None
        # What the bucket holds, from a watch; and what this registry wrote that
        # the watch may not have reported yet: node -> (record, revision).
        self.records: KvMirror[NodeRecord] = KvMirror(self.nodes_kv, B.NODES)
        self.written: dict[str, tuple[NodeRecord, int]] = {}
        self.records.listeners.append(self._on_record)
        # node -> (inventory, counter label) judged acceptable, not yet applied.
        self.queued: dict[str, tuple[Inventory, str]] = {}
        self.queue_ready = asyncio.Event()
        # node -> boot id of the last inventory received (judged or queued): a
        # lease going ready with that boot needs no pull, its inventory is here.
        self.heard_boot: dict[str, str] = {}
        # node -> admin state, and how many nodes are in each (the gauges)
        self.admin: dict[str, AdminState] = {}
        self.admin_counts: dict[AdminState, int] = dict.fromkeys(AdminState, 0)
        await self.records.start(timeout=60)
        self._load_admin()
        self._count()
        await self.nc.subscribe(S.ALL_INVENTORIES, cb=self.on_inventory, queue="llmgw-registry")
        await self.add_api({api.CORDON: self.api_cordon, api.UNCORDON: self.api_uncordon, api.DRAIN: self.api_drain, api.SET_ADDR: self.api_set_addr})
        self.spawn(self._apply_loop())
        self.spawn(self._watch_leases())

    # -- inventories we missed -------------------------------------------------------
    async def _watch_leases(self) -> None:
        """Ask live nodes without a current record for their inventory.

        An agent publishes its inventory when it connects; if the registry was
        not subscribed yet (started after the agents, or restarted), that one
        is gone and the next periodic one is minutes away. A lease going ready
        with a boot id the record does not have is the sign.
        """
        kv = await open_bucket(self.js, S.BUCKET_LEASES, wait=3600, logger=self.log)
        self.leases = KvMirror(kv, B.LEASES)

        def on_lease(node: str, old: Lease | None, new: Lease | None) -> None:
            if new is None or new.state != LeaseState.READY or self.boots.get(node) == new.boot_id:
                return
            if self.heard_boot.get(node) == new.boot_id:
                return  # its inventory came and is queued, being applied, or was refused: asking again changes nothing
            self._pull(node)

        self.leases.listeners.append(on_lease)
        await self.leases.start()

    def _pull(self, node: str) -> None:
        if node in self.pulling or not is_valid_name(node):
            return
        self.pulling.add(node)
        self.spawn(self._pull_one(node))

    async def _pull_one(self, node: str) -> None:
        try:
            reply = await self.nc.request(S.cmd_inventory(node), b"{}", timeout=5)
            inv = decode_reply(reply.data, Inventory)
            if isinstance(inv, CommandAck):  # there, and said no: not "unreachable"
                self.log.warning("%s refused to send its inventory: %s (%s)", node, inv.reason or "no reason given", inv.code or "no code")
                return
            if inv.node_id != node:
                INVENTORIES.labels("inconsistent").inc()
                return
            self.log.info("asked %s for the inventory it sent before we listened", node)
            self.heard_boot[node] = inv.boot_id
            if await self._acceptable(inv, pulled=True):
                self._queue(inv, "pulled")
        except Exception as e:
            self.log.warning("could not get the inventory of %s: %s", node, e or type(e).__name__)
        finally:
            self.pulling.discard(node)

    async def stop(self) -> None:
        for mirror in (getattr(self, "leases", None), getattr(self, "records", None)):
            if mirror is not None:
                await mirror.stop()
        await super().stop()

    # -- inventories -----------------------------------------------------------
    async def on_inventory(self, msg) -> None:
        inv = self.node_message(msg, Inventory, INVENTORIES, "inventory")
        if inv is None:
            return  # the previous record stays
        self.heard_boot[inv.node_id] = inv.boot_id
        try:
            if await self._acceptable(inv):
                self._queue(inv, "accepted")
        except Exception as e:
            INVENTORIES.labels("error").inc()
            self.log.warning("inventory from %s not judged: %s", inv.node_id, e)

    def _queue(self, inv: Inventory, result: str) -> None:
        """Hand ``inv`` to the apply loop; it replaces a queued one of the same node."""
        if inv.node_id in self.queued:
            INVENTORIES.labels("superseded").inc()
        self.queued[inv.node_id] = (inv, result)
        self.queue_ready.set()

    async def _apply_loop(self) -> None:
        """Apply queued inventories in batches, ``BATCH_WRITES`` at a time.

        Everything queued when a batch starts is in it; what arrives meanwhile
        waits for the next, so a node's inventories are applied in order and the
        last one wins. A write the bus refused goes back in the queue (unless a
        newer one of the node took its place) and is tried after ``RETRY_AFTER``.
        """
        while True:
            await self.queue_ready.wait()
            self.queue_ready.clear()
            batch, self.queued = list(self.queued.values()), {}
            failed = 0
            for i in range(0, len(batch), BATCH_WRITES):
                chunk = batch[i : i + BATCH_WRITES]
                results = await asyncio.gather(*(self._apply_inventory(inv) for inv, _ in chunk), return_exceptions=True)
                for (inv, result), outcome in zip(chunk, results, strict=True):
                    if isinstance(outcome, BaseException):
                        failed += 1
                        INVENTORIES.labels("error").inc()
                        self.write_failed(f"node record {inv.node_id}", outcome)
                        self.queued.setdefault(inv.node_id, (inv, result))
                    else:
                        INVENTORIES.labels(result).inc()
            if failed:
                self.log.warning("%d of %d inventories not stored; trying again in %.0fs", failed, len(batch), RETRY_AFTER)
                await asyncio.sleep(RETRY_AFTER)  # the bus is away or refusing: do not spin
                self.queue_ready.set()

    # -- what the bucket holds -------------------------------------------------
    def _record(self, node: str) -> tuple[NodeRecord | None, int]:
        """The node's record and revision as this registry knows them: the watch's
        copy, or its own later write the watch has not reported yet."""
        seen = (self.records.items.get(node), self.records.revisions.get(node, 0))
        mine = self.written.get(node)
        return mine if mine is not None and mine[1] > seen[1] else seen

    def _wrote(self, node: str, record: NodeRecord, revision: int) -> None:
        self.written[node] = (record, revision)

    def _on_record(self, node: str, old: NodeRecord | None, new: NodeRecord | None) -> None:
        mine = self.written.get(node)
        if mine is not None and (new is None or self.records.revisions.get(node, 0) >= mine[1]):
            del self.written[node]  # the watch caught up (or the record was deleted)
        self._count(node, new.admin if new is not None else None)

    async def _read(self, node: str) -> tuple[NodeRecord | None, int]:
        """The node's record straight from the bucket (after a lost compare-and-set)."""
        try:
            entry = await self.nodes_kv.get(node)
        except KeyNotFoundError:
            return None, 0
        return B.NODES.decode(entry.value), entry.revision

    async def _acceptable(self, inv: Inventory, *, pulled: bool = False) -> bool:
        """Whether ``inv`` may become the node's record: sane, not quarantined, and
        at the address recorded for the node. Each refusal is counted and logged;
        an address claim also becomes one event per (claim, agent incarnation)."""
        node = inv.node_id
        if len({g.index for g in inv.gpus}) != len(inv.gpus):
            INVENTORIES.labels("inconsistent").inc()
            self.log.warning("inventory from %s lists a GPU index twice; rejected, previous record kept", node)
            return False
        problem = host_problem(inv.mgmt_addr)
        if problem:
            INVENTORIES.labels("bad_addr").inc()
            self.log.warning("inventory from %s: mgmt_addr %r %s; rejected, previous record kept", node, inv.mgmt_addr, problem)
            return False
        lease = self.leases.items.get(node) if self.leases is not None else None
        if lease is not None and lease.quarantine:
            INVENTORIES.labels("quarantined").inc()
            self.log.warning("inventory from %s (boot %s) ignored: the node is quarantined (%s)", node, inv.boot_id[:8], lease.quarantine)
            return False
        stored, _ = self._record(node)
        recorded = stored.recorded_addr if stored is not None else ""
        why = addresses.claim_problem(inv.mgmt_addr, recorded, inv.mgmt_ips, await self._resolve_here(recorded), inv.addr_problem) if recorded else ""
        if why:
            INVENTORIES.labels("addr_refused").inc()
            ADDR_REFUSED.inc()
            detail = f"{node}'s inventory {why}; refused"
            self.log.warning("%s (boot %s)", detail, inv.boot_id[:8])
            key = (node, inv.mgmt_addr, ",".join(inv.mgmt_ips), recorded, inv.boot_id)
            if key not in self.refusals_told:
                if len(self.refusals_told) > 10_000:
                    self.refusals_told.clear()  # bounded: at worst an event is repeated
                self.refusals_told.add(key)
                await self.events.emit(EventKind.NODE, node, EventWhat.ADDR_REFUSED, detail, claimed=inv.mgmt_addr, recorded=recorded)
            # On the record, so placement skips the node and `ctl explain` says why:
            # engines there bind where the recorded address may not reach.
            await self._set_addr_problem(node, detail)
            if not pulled and time.monotonic() - self.verify_asked.get(node, -VERIFY_EVERY) >= VERIFY_EVERY:
                # Ask the node itself: an impostor's claim (a stolen certificate)
                # is then answered by the real agent, whose good inventory clears
                # the problem; the agent's own bad claim is refused once more (a
                # pulled inventory asks nothing further, and a node is asked at
                # most once per VERIFY_EVERY however often it is refused).
                if len(self.verify_asked) > 10_000:
                    self.verify_asked.clear()
                self.verify_asked[node] = time.monotonic()
                self._pull(node)
            return False
        if not recorded and node not in self.unverified_warned:
            self.unverified_warned.add(node)
            self.log.warning(
                "%s has no recorded address: its inventory's mgmt_addr %s is taken on its word (unverified); record it with 'llmgw ctl node set-addr %s ADDR'",
                node,
                inv.mgmt_addr,
                node,
            )
        return True

    async def _resolve_here(self, host: str) -> tuple[str, ...] | str:
        """What ``host`` resolves to at the registry (an address: itself), or the resolver's error.

        Looked up off the loop and kept for ``RESOLVE_TTL``: a node re-sends its
        inventory every few minutes and after every reconnect, and a herd of
        them must not become a herd of lookups.
        """
        if addresses.is_ip(host):
            return (addresses.normal(host),)
        hit = self.resolved_here.get(host)
        if hit is not None and time.monotonic() - hit[0] < RESOLVE_TTL:
            return hit[1]
        try:
            found: tuple[str, ...] | str = await asyncio.to_thread(addresses.resolve, host)
        except addresses.Unresolved as e:
            found = str(e)
        if len(self.resolved_here) > 10_000:
            self.resolved_here.clear()
        self.resolved_here[host] = (time.monotonic(), found)
        return found

    async def _set_addr_problem(self, node: str, problem: str) -> None:
        """Put why the node's address is refused on its record (placement skips it)."""
        for attempt in range(5):
            old, rev = self._record(node) if attempt == 0 else await self._read(node)
            if old is None or old.addr_problem == problem:
                return
            new = msgspec.structs.replace(old, addr_problem=problem, updated_at=now())
            try:
                new_rev = await self.nodes_kv.update(node, encode(new), last=rev)
            except KeyWrongLastSequenceError:
                continue
            self._wrote(node, new, new_rev)
            return

    async def _apply_inventory(self, inv: Inventory) -> None:
        """Make ``inv`` the node's record, unless the record already says all of it.

        Judged against what this registry knows (no round trip); the write is a
        compare-and-set on that revision, and a lost race re-reads the bucket."""
        node = inv.node_id
        for attempt in range(5):  # CAS loop: an admin change may race an inventory
            old, rev = self._record(node) if attempt == 0 else await self._read(node)
            if (
                old is not None
                and old.recorded_addr
                and addresses.claim_problem(inv.mgmt_addr, old.recorded_addr, inv.mgmt_ips, await self._resolve_here(old.recorded_addr), inv.addr_problem)
            ):
                return  # recorded meanwhile (set-addr raced the inventory): _acceptable refuses it next time
            record = NodeRecord(
                node_id=node,
                identity=subject_dn("node", node),
                hostname=inv.hostname,
                mgmt_addr=old.recorded_addr if old is not None and old.recorded_addr else inv.mgmt_addr,
                mgmt_interface=inv.mgmt_interface,
                boot_id=inv.boot_id,
                gpus=inv.gpus,
                fabrics=inv.fabrics,
                hcas=inv.hcas,
                admin=old.admin if old else AdminState.ACTIVE,
                admin_reason=old.admin_reason if old else "",
                admin_by=old.admin_by if old else AdminBy.UNSET,
                registered_at=old.registered_at if old and old.registered_at else now(),
                updated_at=now(),
                recorded_addr=old.recorded_addr if old else "",
                mgmt_ips=list(inv.mgmt_ips),
                addr_problem=inv.addr_problem,
                model_cache=inv.model_cache,
            )
            if old is not None and _same_facts(old, record):
                self.boots[node] = inv.boot_id
                return  # a re-send (periodic, or after a reconnect): nothing changed, write nothing
            try:
                if rev:
                    new_rev = await self.nodes_kv.update(node, encode(record), last=rev)
                else:
                    new_rev = await self.nodes_kv.create(node, encode(record))
            except KeyWrongLastSequenceError:
                continue  # an admin change or another registry won the race: re-read
            self._wrote(node, record, new_rev)
            self.boots[node] = inv.boot_id
            self._count(node, record.admin)
            if old is None or not old.boot_id:  # never joined (or only onboarded: set-addr)
                await self.events.emit(
                    EventKind.NODE, node, EventWhat.JOINED, f"{len(inv.gpus)} GPUs, fabrics {', '.join(f.name for f in inv.fabrics) or 'none'}"
                )
            elif not _same_facts(old, record, cache=False):
                await self.events.emit(EventKind.NODE, node, EventWhat.INVENTORY, _describe_change(old, record))
            # A node's first record carries what its cache held before: news only from then on.
            for what, detail, data in cache_events(old.model_cache, record.model_cache) if old is not None and old.boot_id else ():
                await self.events.publish(Event(time=now(), kind=EventKind.NODE, subject=node, what=what, detail=detail, data=data))
            if record.addr_problem and record.addr_problem != (old.addr_problem if old else ""):
                await self.events.emit(EventKind.NODE, node, EventWhat.ADDR_PROBLEM, f"{record.addr_problem}; no replica is placed on {node} until it is fixed")
            elif old is not None and old.addr_problem and not record.addr_problem:
                await self.events.emit(
                    EventKind.NODE, node, EventWhat.ADDR_OK, f"mgmt_addr {record.mgmt_addr} usable again ({', '.join(record.mgmt_ips) or 'as recorded'})"
                )
            return
        raise LlmgwError(f"node {node}'s record is changing too fast; its inventory is tried again")

    def _load_admin(self) -> None:
        for key, rec in self.records.items.items():
            self._count(key, rec.admin)
            self.boots[key] = rec.boot_id

    def _count(self, node: str | None = None, admin: AdminState | None = None) -> None:
        """Note ``node``'s admin state (None: it has no record any more) and set the
        gauges. Counted as states change, not summed over every node each time:
        a sum per join is quadratic in the node count at bring-up."""
        if node is not None:
            before = self.admin.pop(node, None)
            if before in self.admin_counts:
                self.admin_counts[before] -= 1
            if admin is not None:
                self.admin[node] = admin
                if admin in self.admin_counts:
                    self.admin_counts[admin] += 1
        for state, n in self.admin_counts.items():
            NODES.labels(state).set(n)

    # -- admin API ---------------------------------------------------------------
    async def _set_admin(self, req: NodeRequest, admin: AdminState, what: EventWhat) -> NodeRecord:
        if not is_valid_name(req.node_id):
            raise BadAdminRequest(f"node_id: {req.node_id!r} is not a node name")
        if len(req.reason) > MAX_REASON:
            raise BadAdminRequest(f"reason: at most {MAX_REASON} characters, got {len(req.reason)}")
        if req.auto and admin != AdminState.CORDONED:
            raise BadAdminRequest("auto: only a cordon can be automatic")
        by = AdminBy.AUTO if req.auto else AdminBy.OPERATOR
        # Uncordon clears the why; the who is kept (it says who made it active).
        reason = req.reason if admin != AdminState.ACTIVE else ""
        for _ in range(5):
            try:
                entry = await self.nodes_kv.get(req.node_id)
            except KeyNotFoundError:
                raise UnknownNode(f"no node {req.node_id!r} in the registry") from None
            rec = B.NODES.decode(entry.value)
            if rec.admin == admin and (req.auto or (rec.admin_by, rec.admin_reason) == (by, reason)):
                return rec  # already so (an auto-cordon never takes over an operator's)
            if req.auto and rec.admin != AdminState.ACTIVE:
                return rec  # an operator's cordon or drain outranks the scheduler's
            new = msgspec.structs.replace(rec, admin=admin, admin_reason=reason, admin_by=by, updated_at=now())
            try:
                self._wrote(req.node_id, new, await self.nodes_kv.update(req.node_id, encode(new), last=entry.revision))
            except KeyWrongLastSequenceError:
                continue
            detail = f"admin state {rec.admin} → {admin}" if rec.admin != admin else f"admin state {admin}"
            detail += f" by {'the scheduler (auto-cordon)' if req.auto else 'an operator'}"
            if reason:
                detail = f"{reason} ({detail})"
            await self.events.emit(EventKind.NODE, req.node_id, what, detail)
            self.log.info("node %s %s: %s", req.node_id, what, detail)
            self._count(req.node_id, admin)
            return new
        raise LlmgwError(f"node {req.node_id} is changing too fast; try again")

    async def api_cordon(self, req: NodeRequest) -> NodeRecord:
        return await self._set_admin(req, AdminState.CORDONED, EventWhat.CORDONED)

    async def api_uncordon(self, req: NodeRequest) -> NodeRecord:
        return await self._set_admin(req, AdminState.ACTIVE, EventWhat.UNCORDONED)

    async def api_drain(self, req: NodeRequest) -> NodeRecord:
        return await self._set_admin(req, AdminState.DRAINING, EventWhat.DRAINING)

    async def api_set_addr(self, req: NodeAddrRequest) -> NodeRecord:
        """Record the management address an operator vouches for (onboarding).

        A node without a record yet gets an onboarding-only record (no boot id,
        no GPUs): its first inventory fills it in. Setting the address a record
        already shows is a no-op, so ``llmgw up`` and the onboarding script may
        repeat it.
        """
        if not is_valid_name(req.node_id):
            raise BadAdminRequest(f"node_id: {req.node_id!r} is not a node name")
        problem = host_problem(req.addr)
        if problem:
            raise BadAdminRequest(f"addr: {req.addr!r} {problem}")
        # A name is recorded only if it resolves here: the gateways send prompts to it.
        here = await self._resolve_here(req.addr)
        if isinstance(here, str):
            raise BadAdminRequest(f"addr: {here} at the registry; record a name that resolves where the control plane runs, or the node's IP address")
        for _ in range(5):
            try:
                entry = await self.nodes_kv.get(req.node_id)
                old, rev = B.NODES.decode(entry.value), entry.revision
            except KeyNotFoundError:
                old, rev = None, 0
            if old is not None and old.recorded_addr == req.addr and old.mgmt_addr == req.addr:
                return old
            if old is None:
                new = NodeRecord(node_id=req.node_id, identity=subject_dn("node", req.node_id), mgmt_addr=req.addr, recorded_addr=req.addr, updated_at=now())
            else:
                # The operator's word is taken; what it means for the agent now
                # running there is said at once (its engines listen on its first
                # address), and its inventory is asked for, to be judged anew.
                problem = ""
                if old.mgmt_ips and old.mgmt_ips[0] not in here:
                    resolving = "" if here == (req.addr,) else f" (resolving here to {', '.join(here)})"
                    problem = f"{req.node_id}'s engines listen on {old.mgmt_ips[0]}, which its recorded address {req.addr}{resolving} does not reach"
                new = msgspec.structs.replace(old, mgmt_addr=req.addr, recorded_addr=req.addr, addr_problem=problem, updated_at=now())
            try:
                if rev:
                    new_rev = await self.nodes_kv.update(req.node_id, encode(new), last=rev)
                else:
                    new_rev = await self.nodes_kv.create(req.node_id, encode(new))
            except KeyWrongLastSequenceError:
                continue
            self._wrote(req.node_id, new, new_rev)
            before = old.recorded_addr or (f"{old.mgmt_addr} (unverified)" if old.mgmt_addr else "none") if old else "none"
            detail = f"management address recorded by an operator: {req.addr} (was {before})"
            self.unverified_warned.discard(req.node_id)
            await self.events.emit(EventKind.NODE, req.node_id, EventWhat.ADDR_RECORDED, detail)
            if new.addr_problem:
                await self.events.emit(EventKind.NODE, req.node_id, EventWhat.ADDR_PROBLEM, new.addr_problem)
            self.log.info("node %s: %s", req.node_id, detail)
            if old is not None and old.boot_id:
                self.heard_boot.pop(req.node_id, None)
                self._pull(req.node_id)
            if old is None:
                self._count(req.node_id, new.admin)
            return new
        raise LlmgwError(f"node {req.node_id} is changing too fast; try again")


def _same_facts(a: NodeRecord, b: NodeRecord, *, cache: bool = True) -> bool:
    keys = ("hostname", "mgmt_addr", "mgmt_interface", "boot_id", "gpus", "fabrics", "hcas", "mgmt_ips", "addr_problem")
    return all(getattr(a, k) == getattr(b, k) for k in keys) and (not cache or a.model_cache == b.model_cache)


def cache_events(old: ModelCacheReport | None, new: ModelCacheReport | None) -> list[tuple[EventWhat, str, dict[str, str]]]:
    """The node events a change of its model cache makes: a copy's progress
    (``staging``, bytes of total), a finished copy (``staged``), a model gone
    (``evicted``), a failed copy (``stage-failed``). A use alone (last use, in
    use) makes none."""
    before = {e.source: e for e in old.entries} if old is not None else {}
    after = {e.source: e for e in new.entries} if new is not None else {}
    out: list[tuple[EventWhat, str, dict[str, str]]] = []
    for source, e in after.items():
        was = before.get(source)
        if e.problem:
            if was is None or was.problem != e.problem:
                out.append((EventWhat.STAGE_FAILED, f"{source}: {e.problem}", {"source": source}))
        elif not e.complete:
            if was is None or was.complete or was.staged_bytes != e.staged_bytes:
                pct = 100 * e.staged_bytes // e.size if e.size else 0
                detail = f"{source}: {e.staged_bytes} of {e.size} bytes copied ({pct}%)"
                out.append((EventWhat.STAGING, detail, {"source": source, "bytes": str(e.staged_bytes), "total": str(e.size)}))
        elif was is None or not was.complete or was.digest != e.digest:
            detail = f"{source}: {e.size} bytes, {e.digest}"
            out.append((EventWhat.STAGED, detail, {"source": source, "digest": e.digest, "size": str(e.size)}))
    for source, was in before.items():
        if was.complete and (source not in after or not after[source].complete):
            detail = f"{source}: {was.size} bytes, last used {time.strftime('%H:%M:%S', time.localtime(was.last_use))}"
            out.append((EventWhat.EVICTED, detail, {"source": source, "size": str(was.size)}))
    return out


def _describe_change(old: NodeRecord, new: NodeRecord) -> str:
    parts = []
    if old.boot_id != new.boot_id:
        parts.append("agent restarted")
    if len(old.gpus) != len(new.gpus):
        parts.append(f"GPUs {len(old.gpus)} → {len(new.gpus)}")
    if [(f.name, f.usable) for f in old.fabrics] != [(f.name, f.usable) for f in new.fabrics]:
        parts.append("fabrics " + ", ".join(f"{f.name}{'' if f.usable else ' (unusable)'}" for f in new.fabrics))
    if old.mgmt_addr != new.mgmt_addr:
        parts.append(f"mgmt_addr {old.mgmt_addr} → {new.mgmt_addr}")
    if old.mgmt_ips != new.mgmt_ips:
        parts.append(f"mgmt_addr resolves to {', '.join(new.mgmt_ips) or 'nothing usable'} (was {', '.join(old.mgmt_ips) or 'unknown'})")
    return "; ".join(parts) or "inventory changed"


def main(args) -> int:
    return run_service(Registry, args)
