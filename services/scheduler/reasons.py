"""Why a node cannot take a member of a replica: stable constants.

They travel to operators (``llmgw ctl explain``, the console, a pending
replica's ``reason``), so they are words a person can search for, and they
never change meaning once released (Kubernetes' ``ErrReason…``).
"""

NO_RECORD = "no_record"  # a lease but no node record: the registry has not seen its inventory
NO_MGMT_ADDR = "no_mgmt_addr"  # nowhere for peers or the gateway to reach it
ADDR_PROBLEM = "addr_problem"  # its mgmt_addr does not resolve to an address of the node, or not to the recorded one
NO_LEASE = "no_lease"  # a record but no lease: the health monitor has not heard it yet
LEASE_NOT_READY = "lease_not_ready"  # suspect or lost
PEER_LOST_SUSPECT = "peer_lost_suspect"  # a peer reported it lost; no heartbeat heard since
QUARANTINED = "quarantined"  # two agents answer for the node's identity
CORDONED = "cordoned"
DRAINING = "draining"
NO_FABRIC = "no_fabric"  # multi-node replica, node sits on no fabric
FABRIC_UNUSABLE = "fabric_unusable"  # multi-node replica, no configured HCA is ACTIVE
NOT_ENOUGH_GPUS = "not_enough_gpus"  # the node has fewer GPUs than a member needs, even empty
NOT_ENOUGH_FREE_GPUS = "not_enough_free_gpus"
NO_FREE_PORTS = "no_free_ports"  # the node's port range is used up
FABRIC_TOO_SMALL = "fabric_too_small"  # node fits, but its fabric has too few nodes that fit
NO_NODES = "no_nodes"  # the cluster has no node at all
GPU_UNHEALTHY = "gpu_unhealthy"  # enough free GPUs only counting ones the agent reports unhealthy (XID, ECC, lost)
GPU_FOREIGN = "gpu_foreign"  # enough free GPUs only counting ones held by processes llmgw did not start
