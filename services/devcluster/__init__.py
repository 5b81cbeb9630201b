"""The dev cluster: the whole system on one machine, for trying it, testing it and benchmarking it.

``up`` (``llmgw up`` / ``down`` / ``sim …``) starts a real nats-server, the four
services and one agent per simulated node as separate processes; ``simcluster``
onboards those simulated nodes (certificates, fake sysfs and nvidia-smi, the
sim engine) and injects their faults the real way (SIGKILL, sysfs state files);
``scenario`` runs and measures the seed's failover stories on such a cluster;
``demo`` names the demo deployment both of them use.

Production services (the registry, health monitor, scheduler, gateway and
agent) never import this package: it depends on them, never the other way
round (tests/test_devcluster_apart.py holds that).
"""
