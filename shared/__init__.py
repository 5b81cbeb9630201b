"""What every llmgw process shares. One line per module: what it is for.

Names and words (defined once; nothing else spells one)
    subjects     every NATS subject, bucket and stream name
    schemas      every message on the bus and every value in a KV bucket (msgspec)
    api          every service endpoint and agent command: subject, request, reply, callers
    buckets      every KV bucket and stream: name, schema, writers (the first owns it)
    states       replica and engine states and the named sets every reader uses
    names        node ids, roles, hosts and HCA names: what a valid one is
    errors       one exception base, a few families, precise leaves

Configuration (read once at start, checked whole, refused in the file's words)
    config       the services' and operators' YAML files, and what they name
    structconf   YAML into msgspec structs; refusals naming file and key path
    durations    500ms, 5s, 1m, 1h30m as people write them
    tls          TLS files: the bus client's CA/cert/key, the gateway's HTTPS pair
    apikeys      the gateway's API key file (SHA-256 digests of bearer tokens)
    specs        a deployment as an operator writes it, and its checks

The bus
    bus          connecting under a certificate, and provisioning JetStream
    kvmirror     a live, decoded copy of a KV bucket, kept by a watch
    events       publishing to and reading the event stream
    leader       leadership for services that must act alone
    permissions  per-identity NATS permissions, from a certificate's role
    coalesce     an event loop that lets input gather before reading it

Identity and the embedded server
    pki          the certificate authority: issue, revoke, read identities
    natsconf     a nats-server configuration rendered from the PKI ledger
    natsserver   a real nats-server under llmgw's PKI (``llmgw up``, tests)
    natsbin      where the nats-server binary is

The operator's view
    operator     an operator's session: connect, read a bucket whole, call an endpoint
    readmodel    every fact ``llmgw ctl`` and the console derive from the buckets

The machine
    addresses    what a management address resolves to, and which is this machine's
    procfs       process facts from /proc: start times, liveness, safe signals
    procnet      what the kernel says is listening
    files        writing a file readers see whole or not at all
    logs         one log format for every process
    tasks        ending background tasks for sure

``tests/test_module_map.py`` holds this map and the modules equal.
"""
