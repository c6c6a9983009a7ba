"""A model of JetStream: streams (`streams`), consumers (`consumers`), what they share (`api`)."""
