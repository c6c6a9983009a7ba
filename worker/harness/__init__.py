"""What starts the parts for tests, demos and benchmarks: a private `nats-server` or a
three-node cluster (`natsserver`), worker child processes (`child`), testcontainers
(`containers`), and the HTTP health probe they wait on (`health`)."""
