"""A model of `nats-server`: the core protocol (`server`) and JetStream (`jetstream`)."""
