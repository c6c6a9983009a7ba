"""A model of JetStream: the extension the core hands publishes to (`model.JetStream`), its
streams (`streams`), consumers (`consumers`), and what those two share (`api`)."""
