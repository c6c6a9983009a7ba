"""The NATS transport: the one package of kvhandoff that imports nats-py.

Every process reaches NATS through a `connection.Bus`, and every nats-py error becomes a
`worker.errors.BusError` inside this package, `raise ... from` the driver's. It knows nothing of
tiers, partitions or members (worker.tier keeps those rules), so an engine or a frontend
(client/) loads it alone. One job per module; each opens with its theory of operation:

    settings    NatsSettings: how to reach NATS (URLs, credentials, TLS, subject prefix)
    connection  Bus: connecting (retries, refusals), reconnects, core subscribe and gather
    publish     the barrier (flush, confirm), JetStream publishes stored or durable,
                compare-and-set appends and atomic roll-up batches (Bus's base class)
    pull        the lean JetStream pull: Pull, Inbound, and Deliveries from nats-py's parser
    streams     stream and consumer administration (StreamSpec, priority groups) and reads
    kv          key-value buckets: TTL'd buckets with listing, expiring buckets with watches
    failures    what the translations share: `why`, JetStream API refusals, retryable errors
"""
