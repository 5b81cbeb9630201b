"""``shared/addresses.py``: what a management name means, and the registry's rule for a node's address claim.

Pure tables, plus the system resolver and the kernel on what this machine
certainly has (loopback) and certainly lacks (an address of another network,
a name under the reserved ``.invalid`` domain, RFC 2606).
"""

from __future__ import annotations

import socket

import pytest

from llmgw.services.agent.config import SupervisorConfig
from llmgw.services.agent.supervisor import ADDR_UNUSABLE, Supervisor
from llmgw.shared import addresses, procnet
from llmgw.shared.addresses import Resolution, claim_problem
from llmgw.shared.schemas import LaunchCommand

NOWHERE = "no-such-node.invalid"
FOREIGN = "10.255.255.7"


def test_an_address_resolves_to_itself_and_a_name_through_the_resolver():
    assert addresses.resolve("127.0.0.1") == ("127.0.0.1",)
    assert addresses.resolve("::ffff:127.0.0.1") == ("127.0.0.1",), "as procnet prints an IPv4-mapped address"
    assert "127.0.0.1" in addresses.resolve("localhost")
    with pytest.raises(addresses.Unresolved, match=f"^{NOWHERE} does not resolve: "):
        addresses.resolve(NOWHERE)


@pytest.mark.parametrize(
    "host, addrs, local, problem",
    [
        ("127.0.0.1", ("127.0.0.1",), ("127.0.0.1",), ""),
        ("127.3.2.1", ("127.3.2.1",), ("127.3.2.1",), ""),  # all of 127/8 is this machine's
        (FOREIGN, (FOREIGN,), (), f"mgmt_addr {FOREIGN} is not an address of this machine"),
        (NOWHERE, (), (), f"mgmt_addr {NOWHERE} does not resolve: "),
    ],
    ids=["loopback", "loopback-net", "foreign", "unresolved"],
)
def test_resolve_mgmt(host, addrs, local, problem):
    got = addresses.resolve_mgmt(host)
    assert (got.name, got.addrs, got.local) == (host, addrs, local)
    assert got.problem.startswith(problem) and bool(got.problem) == bool(problem)
    assert got.bind == (local[0] if local else "")


def test_resolve_mgmt_keeps_the_resolvers_order_and_only_this_machines_addresses(monkeypatch):
    infos = [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (FOREIGN, 0)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0)),  # once per address
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::ffff:127.0.0.2", 0, 0, 0)),
    ]
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: infos)
    got = addresses.resolve_mgmt("node01.example")
    assert got == Resolution("node01.example", (FOREIGN, "127.0.0.1", "127.0.0.2"), ("127.0.0.1", "127.0.0.2"), "")
    assert got.bind == "127.0.0.1" and got.describe() == f"node01.example ({FOREIGN}, 127.0.0.1, 127.0.0.2)"


# The registry's rule. (claim, recorded, the node's own addresses for its claim,
# what the recorded address resolves to at the registry, the node's own problem) -> refusal or ""
IPS = ["10.0.0.7"]
CASES = [
    ("nothing-recorded", ("anything", "", [], (), ""), ""),
    ("same-ip", ("10.0.0.7", "10.0.0.7", IPS, ("10.0.0.7",), ""), ""),
    ("name-to-recorded-ip", ("node07.example", "10.0.0.7", IPS, ("10.0.0.7",), ""), ""),
    ("same-name", ("node07.example", "node07.example", IPS, ("10.0.0.7", "10.0.1.7"), ""), ""),
    ("ip-to-recorded-name", ("10.0.0.7", "node07.example", IPS, ("10.0.0.7",), ""), ""),
    (
        "name-elsewhere",
        ("node07.example", "10.0.0.5", IPS, ("10.0.0.5",), ""),
        "claims mgmt_addr node07.example, which resolves on the node to 10.0.0.7 (its engines listen on 10.0.0.7), but its recorded address is 10.0.0.5",
    ),
    (
        "other-ip",
        ("10.0.0.9", "10.0.0.7", ["10.0.0.9"], ("10.0.0.7",), ""),
        "claims mgmt_addr 10.0.0.9 (where its engines listen) but its recorded address is 10.0.0.7",
    ),
    (
        "recorded-name-elsewhere",
        ("node07.example", "node07.example", IPS, ("10.0.0.5",), ""),
        "claims mgmt_addr node07.example, which resolves on the node to 10.0.0.7 (its engines listen on 10.0.0.7), "
        "but its recorded address is node07.example, which resolves here to 10.0.0.5",
    ),
    (
        "binds-the-other",  # the name reaches the recorded address, but the engines bind its first one
        ("node07.example", "10.0.0.7", ["10.0.1.7", "10.0.0.7"], ("10.0.0.7",), ""),
        "claims mgmt_addr node07.example, which resolves on the node to 10.0.1.7, 10.0.0.7 (its engines listen on 10.0.1.7), but its recorded address is 10.0.0.7",
    ),
    (
        "recorded-name-unresolved-here",
        ("node07.example", "node07.example", IPS, "node07.example does not resolve: Name or service not known", ""),
        "its recorded address node07.example does not resolve at the registry (node07.example does not resolve: Name or service not known), "
        "so clients could not reach it",
    ),
    ("old-agent-same", ("10.0.0.7", "10.0.0.7", [], ("10.0.0.7",), ""), ""),
    ("old-agent-other", ("10.0.0.9", "10.0.0.7", [], ("10.0.0.7",), ""), "claims mgmt_addr 10.0.0.9 but its recorded address is 10.0.0.7"),
    ("node-says-unusable", ("node07.example", "10.0.0.7", [], ("10.0.0.7",), "mgmt_addr node07.example does not resolve: …"), ""),
]


@pytest.mark.parametrize("args, refusal", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_claim_problem(args, refusal):
    assert claim_problem(*args) == refusal


def test_procnet_matches_any_of_several_addresses_never_a_name():
    found = [procnet.Listener("127.0.0.1", 80, 1), procnet.Listener("10.0.0.7", 80, 2), procnet.Listener("0.0.0.0", 81, 3), procnet.Listener("::", 82, 4)]
    assert procnet.answering(found, ("10.0.0.7", "10.0.0.8"), 80) == [found[1]]
    assert procnet.answering(found, "localhost", 80) == [], "the kernel's table holds no names"
    assert procnet.answering(found, ("10.0.0.8",), 81) == [found[2]], "a wildcard covers every address"
    assert procnet.answering(found, ("fd00::7",), 82) == [found[3]]


async def refused(tmp_path, mgmt_addr: str, *, rank: int, leader_addr: str):
    """Launch member ``rank`` on a fresh supervisor at ``mgmt_addr``: its refusal, and that nothing ran."""
    sup = Supervisor(SupervisorConfig(work_dir=str(tmp_path / mgmt_addr)), mgmt_addr=mgmt_addr, mgmt_interface="lo")
    await sup.adopt()
    try:
        cmd = LaunchCommand(
            replica_id="r-g1", generation=1, deployment="r", model="m", engine="sim", rank=rank, nnodes=rank + 1, gpus=[0],
            http_port=30001 if rank == 0 else 0, leader_addr=leader_addr, rendezvous_port=30000,
        )  # fmt: skip
        ack = await sup.launch(cmd, {0})
        assert (ack.ok, ack.code) == (False, ADDR_UNUSABLE)
        assert sup.facts() == [] and not list((tmp_path / mgmt_addr / "engines").iterdir())
        return ack.reason
    finally:
        await sup.close()


@pytest.mark.parametrize(
    "host, why",
    [(NOWHERE, f"mgmt_addr {NOWHERE} does not resolve: "), (FOREIGN, f"mgmt_addr {FOREIGN} is not an address of this machine")],
    ids=["unresolved", "foreign"],
)
async def test_a_supervisor_whose_name_does_not_resolve_starts_nothing(tmp_path, host, why):
    """No false ready: a launch on a node whose mgmt_addr resolves to no address
    of its own is refused before anything starts, saying why."""
    reason = await refused(tmp_path, host, rank=0, leader_addr=host)
    assert reason.startswith(why) and reason.endswith("nothing can be started on this node until it does")


async def test_a_worker_whose_leader_name_does_not_resolve_is_refused(tmp_path):
    reason = await refused(tmp_path, "127.0.0.1", rank=1, leader_addr=NOWHERE)
    assert reason.startswith(f"the leader's address {NOWHERE} does not resolve: ")
